"""hybridkv inside vLLM with its tiers: the scheduler and the connector a vLLM user runs.

:func:`run_hybridkv_vllm` replays the requests of ``tiers_vllm.py`` through
vLLM 0.32's real scheduler built as ``--scheduler-cls
hybridkv_vllm.scheduler.HybridKVScheduler`` (hybridkv's window-safe tree as the
device prefix cache) with, for ``hybridkv-vllm-l2-l3``, ``--kv-transfer-config``
naming ``HybridKVConnector`` (``l2_gb`` = the host bytes, ``l3_url`` a file
store in a temporary folder); ``hybridkv-vllm-l1`` runs the scheduler alone.

No model and no worker, as for vLLM's own offload in ``tiers_vllm.py``: this
driver stands in for the model runner and reports every load of a step's
connector metadata as received and every finish save as sent in that step's
output (transfers take no time and never fail: the same upper bound vLLM's
offload gets).  Like the worker, it stores every page a step's save jobs name
in the L3 store (a one-byte value: no load reads it), so the store answers the
connector's probes as a served engine's store would.  The connector's scheduler side therefore decides every hit
from its own record of the tiers (``hybridkv_vllm.sources.TierView``: the L2
mirror, with the worker's budget and eviction, and the store's index of
what was saved), which is what a served engine decides from; the worker's
L2 and L3 bytes are what the served tests check.

Hit tokens per tier come from vLLM's statistics as for the peers:
``prefix_cache_stats.hits`` (device) and ``connector_prefix_cache_stats``
(``host`` = L2; ``disk`` = L3).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tiers_vllm as tv

__all__ = ["CONNECTOR_SYSTEMS", "run_hybridkv_vllm"]

CONNECTOR_SYSTEMS = ("hybridkv-vllm-l1", "hybridkv-vllm-l2-l3")
SCHEDULER_CLS = "hybridkv_vllm.scheduler.HybridKVScheduler"


def _config(model_dir: Path, max_len: int, chunk: int, host_bytes: int, l3_dir: Path | None) -> Any:
    """``VllmConfig`` as the server gets it from ``--scheduler-cls`` (hybridkv) and, with
    ``l3_dir``, ``--kv-transfer-config`` naming ``HybridKVConnector``."""
    from vllm.config import KVTransferConfig

    vc = tv.vllm_config(model_dir, max_len, chunk, max(1, host_bytes), None, connector=False)
    vc.scheduler_config.scheduler_cls = SCHEDULER_CLS
    if l3_dir is not None:
        extra = {"l3_url": f"file://{l3_dir}", "l2_gb": host_bytes / (1 << 30), "async_save": False}
        vc.kv_transfer_config = KVTransferConfig(kv_connector="HybridKVConnector",
                                                 kv_connector_module_path="hybridkv_vllm.connector",
                                                 kv_role="kv_both", kv_connector_extra_config=extra)
    return vc


def _scheduler(vc: Any, specs: dict[str, Any], device_bytes: int) -> Any:
    """``HybridKVScheduler`` over ``device_bytes``, set up as ``tiers_vllm.build_scheduler``
    sets up vLLM's (the same KV-cache config and block sizes)."""
    from vllm.v1.core import kv_cache_utils as ku
    from vllm.v1.structured_output import StructuredOutputManager

    from hybridkv_vllm.scheduler import HybridKVScheduler

    cfg = tv.kv_cache_config(vc, specs, device_bytes)
    vc.cache_config.num_gpu_blocks = cfg.num_blocks
    vc.cache_config.block_size = min(g.kv_cache_spec.block_size for g in cfg.kv_cache_groups)
    block, hash_block = ku.resolve_kv_cache_block_sizes(cfg, vc)
    cfg.hash_block_size = hash_block
    cfg.cache_hit_alignment_tokens = ku.resolve_cache_hit_alignment_tokens(cfg, vc, block, hash_block)
    return HybridKVScheduler(vllm_config=vc, kv_cache_config=cfg,
                             structured_output_manager=StructuredOutputManager(vc),
                             block_size=block, hash_block_size=hash_block, log_stats=True)


def fake_output(sched: Any, so: Any) -> Any:
    """The ``ModelRunnerOutput`` of step ``so`` for hybridkv's connector: one sampled
    token per request whose prefill the step completes, every load of the step's
    metadata received, every finish save sent.  Mutates nothing."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(so.num_scheduled_tokens)
    sampled = [[tv.SAMPLED_TOKEN] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
               else [] for r in req_ids]
    meta = so.kv_connector_metadata
    recving = {job.req_id for job in getattr(meta, "loads", ())}
    sending = {job.req_id for job in getattr(meta, "saves", ()) if job.finish}
    kv_out = KVConnectorOutput(finished_recving=recving or None, finished_sending=sending or None)
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled, kv_connector_output=kv_out)


def store_saves(sched: Any, so: Any) -> int:
    """Put the pages of step ``so``'s save jobs into the connector's L3 store, as the
    worker's save thread does (one-byte values); returns the pages put."""
    meta = so.kv_connector_metadata
    keys = [k for job in getattr(meta, "saves", ()) for _, ks in job.groups.values() for k in ks]
    if keys:
        sched.connector.backend.put(keys, [b"\0"] * len(keys))
    return len(keys)


def _output(sched: Any, so: Any) -> Any:
    """The worker's step: store the step's saves in L3, then report its output."""
    if sched.connector is not None:
        store_saves(sched, so)
    return fake_output(sched, so)


def _drain(sched: Any, totals: dict[str, int]) -> int:
    """``tiers_vllm._drain`` with this module's worker stand-in, stepping while the
    connector has push work left too; returns the steps."""
    return tv._drain(sched, totals, _output,
                     lambda s: s.connector is not None and s.connector.has_pending_push_work())


def run_hybridkv_vllm(seqs: Sequence[tuple[Any, str]], meta: dict[str, Any], device_bytes: int,
                      host_bytes: int, tiers: bool, chunk: int = 8192,
                      extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Replay ``seqs`` (token ids, namespace) one request at a time through vLLM's
    scheduler with hybridkv's prefix cache and (``tiers``) its connector; per-tier
    hit tokens.  ``host_bytes``: the connector's L2 (unused without ``tiers``);
    ``extra``: more connector options (``kv_connector_extra_config``)."""
    if device_bytes <= 0:
        raise ValueError(f"device_bytes must be positive, got {device_bytes}")
    if tiers and host_bytes <= 0:
        raise ValueError(f"host_bytes must be positive with tiers, got {host_bytes}")
    t0 = time.perf_counter()
    max_len = max(len(t) for t, _ in seqs) + int(meta["page_size"]) + 1
    totals = {"device": 0, "host": 0, "other": 0, "input_tokens": 0, "steps": 0, "requests": 0}
    with tempfile.TemporaryDirectory(prefix="hkv-tiers-vllm-conn-") as tmp:
        vc = _config(tv._model_dir(Path(tmp), max_len), max_len, chunk, host_bytes,
                     Path(tmp) / "l3" if tiers else None)
        if tiers and extra:
            vc.kv_transfer_config.kv_connector_extra_config.update(extra)
        sched = _scheduler(vc, tv.layer_specs(meta), device_bytes)
        try:
            tv.replay_into(sched, vc, seqs, totals, _drain)
            view = getattr(sched.connector, "_tiers", None)  # (an older connector has no record)
            record = view.store.stats() if tiers and view is not None else {}
            # what L2 (its index, the scheduler side's) holds at the end, by class; full pages the
            # device cache was about to give up that L2 lacked, copied down (the rule's price in copies)
            l2 = view.l2.tier.stats() if tiers and view is not None and view.l2 is not None else {}
            l1 = getattr(sched.connector, "_l1", None)
            # prompt pages whose keys the lookups read off the device tree instead of hashing; the
            # device's full KV a hit loaded again, and what the window repair served from the device;
            # blocks whose L2 answer a lookup read off the tree's records, and those it asked by key
            named = ({k: sched.connector.stats.get(k, 0)
                      for k in ("tree_named_pages", "tree_run_pages_let_go", "reloaded_held_tokens",
                                "repaired_tokens", "l2_pages_read_off_tree", "l2_pages_absent_off_tree",
                                "l2_pages_read_off_orphans", "l2_pages_asked_by_key")} if tiers else {})
            if l2 and l1 is not None:
                l2["rescued_full_pages"] = l1.rescued
        finally:
            sched.shutdown()
    out = tv._row(CONNECTOR_SYSTEMS[1] if tiers else CONNECTOR_SYSTEMS[0], totals, device_bytes,
                  host_bytes if tiers else 0)
    out.update({"num_gpu_blocks": sched.kv_cache_config.num_blocks, "block_size": sched.block_size,
                "kv_cache_groups": len(sched.kv_cache_config.kv_cache_groups), "steps": totals["steps"],
                "store_record": record, "l2_end": l2, **named,
                "wall_s": round(time.perf_counter() - t0, 1),
                "version": f"{tv._vllm_version(False, False).split(' Scheduler')[0]} {SCHEDULER_CLS}"
                           + (" + HybridKVConnector" if tiers else "")})
    return out
