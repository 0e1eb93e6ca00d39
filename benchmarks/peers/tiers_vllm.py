"""vLLM 0.32's own KV offload vs hybridkv's tiers, at equal device and host bytes.

vLLM side: its real ``Scheduler`` (``vllm.v1.core.sched.scheduler``), built
the way ``EngineCore`` builds it (``get_kv_cache_configs`` on the model's
layer specs and the device budget, ``generate_scheduler_kv_cache_config``,
``resolve_kv_cache_block_sizes``), with the ``OffloadingConnector`` of
``--kv-transfer-config``: ``vllm-cpu`` its ``CPUOffloadingSpec``
(``cpu_bytes_to_use`` = the host budget; one offload chunk = one vLLM block,
``blocks_per_chunk`` 1), ``vllm-cpu-fs`` its ``TieringOffloadingSpec`` (the
CPU tier plus one ``fs`` file-system tier; run with scaled bytes, see
:func:`scaled_budgets`), ``vllm-l1`` no connector.
No model and no worker: this driver stands in for the model runner.  Each
step it samples one token for every request whose prefill the step completes
(``max_tokens=1``: the request then finishes, as a prompt-only replay), and
reports **every load and store job of that step's connector metadata as
finished in that step's output**: ``KVConnectorOutput.finished_recving`` holds
the requests of the step's load jobs and ``kv_connector_worker_meta`` is an
``OffloadingWorkerMetadata`` with ``completed_jobs = {job: 1}`` for all of the
step's load and store jobs -- what vLLM's ``OffloadingConnectorWorker``
reports through ``get_finished`` / ``build_connector_worker_meta`` once its
transfers are done.  Transfers are therefore assumed to take no time and
never fail (an upper bound for vLLM's offload).  Requests arrive one at a
time; the engine keeps stepping while ``Scheduler.has_requests()`` (so the
stores of a finished request's last blocks are issued and completed before
the next request arrives, as an idle engine does).

Hit tokens per tier come from vLLM's own statistics (``log_stats=True``, the
``SchedulerStats`` each ``update_from_output`` returns):
``prefix_cache_stats.hits`` (device, ``KVCacheManager``) and
``connector_prefix_cache_stats.hits_by_source`` (``host``; any other source,
e.g. ``disk`` from the fs tier, is the L3 column).

hybridkv side: :func:`hybridkv.eval.replay.replay` (system ``hybridkv``, the same
requests and the same token materialisation, one request at a time, chunked
prefill 8192) with L1 = the device bytes and a ``TierConfig`` with L2 = the
host bytes (and L3 a file backend without limit); per-tier hit tokens from
its tier stats.

    python tiers_vllm.py [--json] [--traces DIR] [--mooncake-limit 3000] [--sessions 16]
                         [--l1-gb 59] [--host-gb 594] [--retention 0,16384,none]
                         [--systems vllm-l1,vllm-cpu,vllm-cpu-fs,hybridkv-l1,hybridkv-l2,hybridkv-l2-l3,
                                    hybridkv-vllm-l1,hybridkv-vllm-l2-l3]

``hybridkv-vllm-*``: hybridkv inside vLLM's scheduler (``--scheduler-cls``) and,
for ``-l2-l3``, with its ``HybridKVConnector`` (see ``tiers_vllm_connector.py``).

Run it with the vLLM venv's python (``tiers_vllm.sh`` does).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

from common import GB, parse_retention  # noqa: E402

SYSTEMS = ("vllm-l1", "vllm-cpu", "vllm-cpu-fs", "hybridkv-l1", "hybridkv-l2", "hybridkv-l2-l3",
           "hybridkv-vllm-l1", "hybridkv-vllm-l2-l3")
SAMPLED_TOKEN = 1  # the one output token of every request (its KV is never stored: prompt-only)
MAX_IDLE_S = 120.0  # bound on the time an engine may schedule nothing before the driver gives up
IDLE_SLEEP_S = 0.0005  # between steps that schedule nothing (secondary-tier threads at work)


# ------------------------------------------------------------------ the model stand-in
def layer_specs(meta: dict[str, Any], scaled: bool = False) -> dict[str, Any]:
    """vLLM layer specs of the preset in ``meta`` (full and SWA layers
    interleaved as a real model's are; heads chosen so one token of one layer
    costs the preset's bytes, see ``drive_vllm._layer_spec``).  ``scaled``:
    the same layers with one head of size 1 (a page of a few hundred bytes),
    for runs whose offload tier moves real bytes (see :func:`scaled_budgets`)."""
    import torch
    from drive_vllm import _layer_spec
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    nf, ns = int(meta["full_layers"]), int(meta["swa_layers"])
    if nf < 1 or ns < 0:
        raise ValueError(f"meta needs full_layers >= 1 and swa_layers >= 0, got {nf}, {ns}")
    f_bpt, s_bpt = meta["full_bpt"] // nf, (meta["swa_bpt"] // ns if ns else 0)
    page, window = int(meta["page_size"]), int(meta["window"])
    specs: dict[str, Any] = {}
    for i in range(nf + ns):
        full = i * nf // (nf + ns) != (i + 1) * nf // (nf + ns)
        if not scaled:
            spec = _layer_spec("full" if full else "swa", f_bpt if full else s_bpt, page, window)
        elif full:
            spec = FullAttentionSpec(block_size=page, num_kv_heads=1, head_size=1, dtype=torch.bfloat16)
        else:
            spec = SlidingWindowSpec(block_size=page, num_kv_heads=1, head_size=1, dtype=torch.bfloat16,
                                     sliding_window=window)
        specs[f"model.layers.{i}.self_attn.attn"] = spec
    return specs


def scaled_budgets(vc: Any, meta: dict[str, Any], device_bytes: int, host_bytes: int) -> tuple[int, int]:
    """Device and host bytes that give the scaled layer specs exactly the
    device blocks and host chunks the real specs get from ``device_bytes``
    and ``host_bytes`` (block sizes from vLLM's own KV-cache config; a host
    chunk is one block rounded up to the host page, as ``CPUOffloadingSpec``
    sizes it)."""
    import mmap

    real = kv_cache_config(vc, layer_specs(meta), device_bytes)
    small = kv_cache_config(vc, layer_specs(meta, scaled=True), device_bytes)
    real_block = real.kv_cache_tensors[0].size // real.num_blocks
    small_block = small.kv_cache_tensors[0].size // small.num_blocks
    chunks = host_bytes // _round_up(real_block, mmap.PAGESIZE)
    return real.num_blocks * small_block, chunks * _round_up(small_block, mmap.PAGESIZE)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _model_dir(root: Path, max_len: int) -> Path:
    """A config-only Hugging Face model folder (no weights, no tokenizer): the
    scheduler reads lengths and flags from ``ModelConfig``, never the model."""
    d = root / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": max(max_len, 4096), "torch_dtype": "bfloat16"}))
    return d


def vllm_config(model_dir: Path, max_len: int, chunk: int, host_bytes: int,
                retention: int | None, fs_dir: Path | None = None, connector: bool = True) -> Any:
    """The ``VllmConfig`` a server gets from ``--max-model-len max_len
    --max-num-batched-tokens chunk --enable-prefix-caching
    --prefix-cache-retention-interval retention --kv-transfer-config
    '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": host_bytes}}'``
    (synchronous scheduling: one batch in flight, as this driver steps).
    ``fs_dir``: vLLM's tiering instead, ``"spec_name": "TieringOffloadingSpec"``
    with the CPU primary tier and one ``"fs"`` secondary tier in that folder;
    ``connector=False``: no ``--kv-transfer-config`` (the device cache alone)."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    if host_bytes <= 0:
        raise ValueError(f"host_bytes must be positive, got {host_bytes}")
    model = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), skip_tokenizer_init=True,
                        max_model_len=max_len, dtype="bfloat16")
    cache = CacheConfig(enable_prefix_caching=True, prefix_cache_retention_interval=retention)
    sched = SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=16, max_model_len=max_len,
                            is_encoder_decoder=False, enable_chunked_prefill=True,
                            async_scheduling=False)
    extra: dict[str, Any] = {"cpu_bytes_to_use": int(host_bytes)}
    if fs_dir is not None:
        extra.update(spec_name="TieringOffloadingSpec", secondary_tiers=[{"type": "fs", "root_dir": str(fs_dir)}])
    kv = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                          kv_connector_extra_config=extra)
    return VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched,
                      kv_transfer_config=kv if connector else None)


def kv_cache_config(vc: Any, specs: dict[str, Any], device_bytes: int) -> Any:
    """The scheduler's ``KVCacheConfig`` for ``specs`` in ``device_bytes``, as
    ``EngineCore._initialize_kv_caches`` makes it (layout resolved, then
    ``get_kv_cache_configs`` and ``generate_scheduler_kv_cache_config``).
    Mutates ``vc.cache_config.kv_cache_layout`` (resolved once, as the engine does)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core import kv_cache_utils as ku

    # Workers report their attention backends' layouts; without a worker the
    # layout is the one the offloading connector requires of them.
    layout = resolve_kv_cache_layout(vc, [[OffloadingConnector.get_required_kvcache_layout(vc)]],
                                     list(specs.values()))
    configs = ku.get_kv_cache_configs(vc, [specs], [int(device_bytes)])
    for c in configs:
        c.kv_cache_layout = layout.name
    return ku.generate_scheduler_kv_cache_config(configs)


def build_scheduler(vc: Any, specs: dict[str, Any], device_bytes: int) -> Any:
    """vLLM's ``Scheduler`` over ``device_bytes`` of KV cache, set up as
    ``EngineCore._initialize_kv_caches`` and ``EngineCore.__init__`` do.
    Mutates ``vc.cache_config`` (``num_gpu_blocks``, ``block_size``) as the
    engine does."""
    from vllm.v1.core import kv_cache_utils as ku
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = kv_cache_config(vc, specs, device_bytes)
    vc.cache_config.num_gpu_blocks = cfg.num_blocks
    vc.cache_config.block_size = min(g.kv_cache_spec.block_size for g in cfg.kv_cache_groups)
    block, hash_block = ku.resolve_kv_cache_block_sizes(cfg, vc)
    cfg.hash_block_size = hash_block
    cfg.cache_hit_alignment_tokens = ku.resolve_cache_hit_alignment_tokens(cfg, vc, block, hash_block)
    return Scheduler(vllm_config=vc, kv_cache_config=cfg, structured_output_manager=StructuredOutputManager(vc),
                     block_size=block, hash_block_size=hash_block, log_stats=True)


# ------------------------------------------------------------------ the worker stand-in
def fake_output(sched: Any, so: Any) -> Any:
    """The ``ModelRunnerOutput`` of step ``so``: one sampled token for each
    request whose prefill this step completes, and every load and store job
    of the step's connector metadata reported finished (see the module
    docstring).  Reads ``sched.requests``; mutates nothing."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = sched.requests[rid]
        # the scheduler has already advanced num_computed_tokens by this step's tokens
        sampled.append([SAMPLED_TOKEN] if req.num_computed_tokens >= req.num_tokens else [])
    meta = so.kv_connector_metadata
    done: dict[int, int] = {}
    recving: set[str] = set()
    if meta is not None:
        for jid, job in meta.load_jobs.items():
            done[jid] = 1
            recving.add(job.req_id)
        for jid in meta.store_jobs:
            done[jid] = 1
    kv_out = KVConnectorOutput(finished_recving=recving or None,
                               kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done))
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled, kv_connector_output=kv_out)


def run_vllm(seqs: Sequence[tuple[Any, str]], meta: dict[str, Any], device_bytes: int,
             host_bytes: int, retention: int | None, chunk: int = 8192, fs_tier: bool = False,
             scaled: bool = False, connector: bool = True) -> dict[str, Any]:
    """Replay ``seqs`` (token ids, namespace) one request at a time through
    vLLM's scheduler with the offloading connector (CPU spec, or with
    ``fs_tier`` the tiering spec: CPU + a file-system tier); per-tier hit
    tokens.  ``scaled`` (forced by ``fs_tier``, whose tiers hold real bytes):
    layer specs of a few hundred bytes a page, budgets giving the same block
    and chunk counts (:func:`scaled_budgets`).  ``connector=False``: no
    offloading connector (``host_bytes`` unused), vLLM's device cache alone."""
    if device_bytes <= 0:
        raise ValueError(f"device_bytes must be positive, got {device_bytes}")
    scaled = scaled or fs_tier
    t0 = time.perf_counter()
    max_len = max(len(t) for t, _ in seqs) + int(meta["page_size"]) + 1
    with tempfile.TemporaryDirectory(prefix="hkv-tiers-vllm-") as tmp:
        fs_dir = Path(tmp) / "fs" if fs_tier else None
        vc = vllm_config(_model_dir(Path(tmp), max_len), max_len, chunk, host_bytes, retention, fs_dir,
                         connector)
        dev, host = device_bytes, host_bytes
        if scaled:
            dev, host = scaled_budgets(vc, meta, device_bytes, host_bytes)
            vc.kv_transfer_config.kv_connector_extra_config["cpu_bytes_to_use"] = host
        sched = build_scheduler(vc, layer_specs(meta, scaled), dev)
        totals = {"device": 0, "host": 0, "other": 0, "input_tokens": 0, "steps": 0, "requests": 0}
        try:
            replay_into(sched, vc, seqs, totals, _drain)
        finally:
            sched.shutdown()
    name = "vllm-cpu-fs" if fs_tier else "vllm-cpu" if connector else "vllm-l1"
    out = _row(name, totals, device_bytes, host_bytes if connector else 0)
    out.update({"retention_interval": retention, "num_gpu_blocks": sched.kv_cache_config.num_blocks,
                "kv_cache_groups": len(sched.kv_cache_config.kv_cache_groups), "block_size": sched.block_size,
                "cpu_chunks": _cpu_chunks(sched.connector), "scaled_bytes": scaled, "steps": totals["steps"],
                "wall_s": round(time.perf_counter() - t0, 1), "version": _vllm_version(fs_tier, connector)})
    return out


def replay_into(sched: Any, vc: Any, seqs: Sequence[tuple[Any, str]], totals: dict[str, int],
                drain: Any) -> None:
    """Add ``seqs`` (token ids, namespace) to ``sched`` one at a time, each stepped to
    completion by ``drain(sched, totals)`` (steps counted); ``totals`` mutated."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(sched.hash_block_size, hash_fn)
    params = SamplingParams(max_tokens=1)
    for i, (ids, ns) in enumerate(seqs):
        # a list only while the request lives (Python ints cost ~36 bytes a token)
        req = Request(f"r{i}", np.asarray(ids).tolist(), params, None, block_hasher=hasher,
                      cache_salt=None if ns == "default" else ns)
        sched.add_request(req)
        totals["steps"] += drain(sched, totals)
        totals["input_tokens"] += len(ids)
        totals["requests"] += 1


def _cpu_chunks(connector: Any) -> int | None:
    """Host chunks of the CPU (primary) tier of an offloading connector (None without one)."""
    if connector is None:
        return None
    manager = connector.connector_scheduler.manager
    primary = getattr(manager, "primary_tier", manager)
    return getattr(primary, "_num_chunks", None)


def _drain(sched: Any, totals: dict[str, int], output: Any = None, busy: Any = None) -> int:
    """Step the engine until it has nothing to do (the request finished and
    the connector's jobs are done), adding each step's scheduler statistics
    to ``totals`` (mutated); returns the number of steps.  ``output(sched, so)``
    is the worker stand-in (default :func:`fake_output`), ``busy(sched)`` keeps
    stepping without requests (default: never).  A step that
    schedules nothing (a lookup or promotion of a secondary tier still
    running on its threads) is followed by a short sleep.  Raises if the
    engine stays idle for ``MAX_IDLE_S`` (a request that cannot be scheduled)."""
    steps = 0
    idle_since: float | None = None
    output = output or fake_output
    while sched.has_requests() or busy is not None and busy(sched):
        so = sched.schedule()
        outputs = sched.update_from_output(so, output(sched, so))
        for eco in outputs.values():
            if eco.scheduler_stats is not None:
                _add_stats(totals, eco.scheduler_stats)
        steps += 1
        if so.total_num_scheduled_tokens:
            idle_since = None
            continue
        now = time.monotonic()
        idle_since = now if idle_since is None else idle_since
        if now - idle_since > MAX_IDLE_S:
            raise RuntimeError(f"vLLM's scheduler stayed idle for {MAX_IDLE_S} s after {steps} steps "
                               f"({len(sched.waiting)} waiting, {len(sched.running)} running)")
        time.sleep(IDLE_SLEEP_S)
    return steps


def _add_stats(totals: dict[str, int], stats: Any) -> None:
    """Add one request's prefix-cache statistics (device and connector hits)
    to ``totals`` (mutated)."""
    totals["device"] += int(stats.prefix_cache_stats.hits)
    conn = stats.connector_prefix_cache_stats
    if conn is None or not conn.hits:
        return
    by_source = {getattr(k, "value", str(k)): int(v) for k, v in (conn.hits_by_source or {}).items()}
    host = by_source.pop("host", 0)
    totals["host"] += host
    totals["other"] += int(conn.hits) - host


def _vllm_version(fs_tier: bool, connector: bool) -> str:
    import vllm

    if not connector:
        return f"vllm {vllm.__version__} Scheduler, no KV connector"
    spec = "TieringOffloadingSpec: CPU + fs" if fs_tier else "CPUOffloadingSpec"
    return f"vllm {vllm.__version__} Scheduler + OffloadingConnector({spec})"


def _row(system: str, totals: dict[str, int], device_bytes: int, host_bytes: int) -> dict[str, Any]:
    hits = totals["device"] + totals["host"] + totals["other"]
    return {"system": system, "l1_gb": device_bytes / GB, "host_gb": host_bytes / GB,
            "requests": totals["requests"], "input_tokens": totals["input_tokens"],
            "l1_hit_tokens": totals["device"], "l2_hit_tokens": totals["host"], "l3_hit_tokens": totals["other"],
            "hit_tokens": hits, "token_hit_rate": hits / max(1, totals["input_tokens"])}


# ------------------------------------------------------------------ hybridkv
def run_hybridkv(reqs: Sequence[Any], spec: Any, device_bytes: int, host_bytes: int, tiers: str,
                 tmp: Path) -> dict[str, Any]:
    """hybridkv's replay of ``reqs`` with ``tiers`` in {"l1", "l2", "l2-l3"}."""
    from hybridkv.eval.replay import replay
    from hybridkv.tiers.tiered import TierConfig

    if tiers not in ("l1", "l2", "l2-l3"):
        raise ValueError(f"tiers must be l1, l2 or l2-l3, got {tiers!r}")
    t0 = time.perf_counter()
    cfg = None
    if tiers == "l2":
        cfg = TierConfig(l2_bytes=int(host_bytes))
    elif tiers == "l2-l3":
        # unbounded write queue: the replay assumes L3 keeps up (figures independent of timing)
        cfg = TierConfig(l2_bytes=int(host_bytes), l3=f"file://{tmp / 'l3'}",
                         l3_timeout_s=120.0, max_queued_writes=1 << 26)
    try:
        res = replay(reqs, spec, int(device_bytes), systems=["hybridkv"], tiers=cfg, references=False)
    finally:
        # one L3 directory at a time: hundreds of thousands of page files
        shutil.rmtree(tmp / "l3", ignore_errors=True)
    hk = res["systems"]["hybridkv"]
    totals = {"device": int(hk.get("l1_hit_tokens", hk["hit_tokens"])), "host": int(hk.get("l2_hit_tokens", 0)),
              "other": int(hk.get("l3_hit_tokens", 0)), "input_tokens": int(res["input_tokens"]),
              "requests": int(res["requests"])}
    out = _row("hybridkv-" + tiers, totals, device_bytes, host_bytes if cfg else 0)
    if out["hit_tokens"] != hk["hit_tokens"]:
        raise RuntimeError(f"hybridkv tier hits {out['hit_tokens']} != total {hk['hit_tokens']}")
    out.update({"rejected_requests": hk.get("rejected_requests", 0), "wall_s": round(time.perf_counter() - t0, 1)})
    if cfg is not None and hk.get("l2"):  # what L2 holds at the end, by class (as the connector rows)
        out["l2_end"] = hk["l2"]
    return out


# ------------------------------------------------------------------ traces
def materialize(reqs: Sequence[Any]) -> list[tuple[Any, str]]:
    """Token ids (int32 arrays) and namespaces of ``reqs`` exactly as
    :func:`hybridkv.eval.replay.replay` makes them (``TokenMaterializer``,
    extension rule on, empty prompts dropped)."""
    from hybridkv.eval.traces import TokenMaterializer

    mat = TokenMaterializer(extension_rule=True)
    out = []
    for r in reqs:
        t = mat.tokens(r)
        if len(t):
            out.append((t, r.namespace))
    return out


def load_traces(traces: Path, mooncake_limit: int, sessions: int, tmp: Path) -> Iterator[tuple[str, list]]:
    """(name, requests) of the conversation trace's first ``mooncake_limit``
    requests and the first ``sessions`` kv-cache-tester sessions (sorted by
    file name, interleaved by timestamp as benchmarks/tiers.py does)."""
    from hybridkv.eval.traces import load_trace

    moon = traces / "mooncake_conversation_trace.jsonl"
    if mooncake_limit > 0 and moon.exists():
        yield "mooncake_conversation", load_trace(moon, limit=mooncake_limit)
    weka = traces / "weka"
    if sessions > 0 and weka.is_dir():
        sub = tmp / "weka"
        sub.mkdir(exist_ok=True)
        for f in sorted(weka.iterdir())[:sessions]:
            (sub / f.name).symlink_to(f)
        yield f"kv_cache_tester_{sessions}_sessions", load_trace(sub)


def preset_meta(spec: Any) -> dict[str, Any]:
    """The bytes of ``spec`` in the sequence-folder ``meta`` form the peer drivers read."""
    return {"page_size": spec.page_size, "window": spec.window, "full_bpt": spec.bytes_per_token_full,
            "swa_bpt": spec.bytes_per_token_swa, "full_layers": len(spec.full_layers),
            "swa_layers": len(spec.swa_layers), "model": spec.name}


# ------------------------------------------------------------------ CLI
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--traces", default=None, help="folder with weka/ and the Mooncake conversation jsonl "
                   "(default: $HYBRIDKV_TRACES or shared/traces beside the checkout)")
    p.add_argument("--mooncake-limit", type=int, default=3000, help="conversation requests (default 3000; 0 = skip)")
    p.add_argument("--sessions", type=int, default=16, help="kv-cache-tester sessions (default 16; 0 = skip)")
    p.add_argument("--model", default="mimo-v2.5-pro")
    p.add_argument("--l1-gb", type=float, default=59.0, help="device KV bytes of both systems, GB (1e9)")
    p.add_argument("--host-gb", default="594", help="comma-separated host bytes (vLLM cpu_bytes_to_use, "
                   "hybridkv L2), GB (1e9)")
    p.add_argument("--retention", default="0", help="comma-separated prefix_cache_retention_interval values "
                   "for vLLM (0 = its default; 'none' = dense); vllm-cpu-fs runs at the first only")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--scaled", action="store_true", help="vllm-cpu with scaled bytes too (a check: the "
                   "same block and chunk counts must give the same hits; vllm-cpu-fs always runs scaled)")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad:
        p.error(f"--systems: unknown {bad}; choose from {', '.join(SYSTEMS)}")
    args.host_gb = [float(x) for x in args.host_gb.split(",") if x.strip()]
    try:
        args.retention = parse_retention(args.retention, "--retention")
    except ValueError as exc:
        p.error(str(exc))
    if args.l1_gb <= 0 or not args.host_gb or min(args.host_gb) <= 0:
        p.error("--l1-gb and --host-gb need positive numbers")
    return args


def run_all(args: argparse.Namespace, traces: Path) -> dict[str, Any]:
    """Every (trace, system, host size, retention) row."""
    from hybridkv.spec import ModelSpec

    spec = ModelSpec.preset(args.model)
    meta = preset_meta(spec)
    l1 = int(args.l1_gb * GB)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hkv-tiers-vllm-") as tmp:
        for name, reqs in load_traces(traces, args.mooncake_limit, args.sessions, Path(tmp)):
            seqs = materialize(reqs) if any("vllm" in x for x in args.systems) else []
            if "hybridkv-l1" in args.systems:
                rows.append({"trace": name, **run_hybridkv(reqs, spec, l1, 0, "l1", Path(tmp))})
                _progress(rows[-1])
            for host_gb in args.host_gb:
                host = int(host_gb * GB)
                for tiers in ("l2", "l2-l3"):
                    if f"hybridkv-{tiers}" in args.systems:
                        rows.append({"trace": name, **run_hybridkv(reqs, spec, l1, host, tiers, Path(tmp))})
                        _progress(rows[-1])
                rows += _in_vllm(name, args.systems, seqs, meta, l1, host, host_gb == args.host_gb[0])
                if "vllm-l1" in args.systems and host_gb == args.host_gb[0]:
                    rows.append({"trace": name, **run_vllm(seqs, meta, l1, host, args.retention[0],
                                                           connector=False)})
                    _progress(rows[-1])
                for k, ret in enumerate(args.retention):
                    for system in ("vllm-cpu", "vllm-cpu-fs"):
                        # the tiering run (minutes: real file I/O) only at the first retention value
                        if system in args.systems and (system == "vllm-cpu" or k == 0):
                            row = run_vllm(seqs, meta, l1, host, ret, fs_tier=system == "vllm-cpu-fs",
                                           scaled=args.scaled)
                            rows.append({"trace": name, **row})
                            _progress(rows[-1])
    return {"model": spec.name, "l1_gb": args.l1_gb, "host_gb": args.host_gb, "extension_rule": "on",
            "mooncake_limit": args.mooncake_limit, "sessions": args.sessions, "rows": rows}


def _in_vllm(trace: str, systems: Sequence[str], seqs: list, meta: dict[str, Any], l1: int, host: int,
             first_host: bool) -> list[dict[str, Any]]:
    """hybridkv inside vLLM's scheduler (``tiers_vllm_connector``): the prefix cache
    alone (at the first host size only) and with its connector's L2 + L3."""
    from tiers_vllm_connector import run_hybridkv_vllm

    rows = []
    for system, tiers in (("hybridkv-vllm-l1", False), ("hybridkv-vllm-l2-l3", True)):
        if system in systems and (tiers or first_host):
            rows.append({"trace": trace, **run_hybridkv_vllm(seqs, meta, l1, host, tiers)})
            _progress(rows[-1])
    return rows


def _progress(row: dict[str, Any]) -> None:
    print(f"[tiers_vllm] {row['trace']} {row['system']} host {row['host_gb']:g} GB "
          f"retention {row.get('retention_interval', '-')}: {row['token_hit_rate']:.2%} "
          f"({row.get('wall_s', 0)} s)", file=sys.stderr, flush=True)


def table(out: dict[str, Any]) -> str:
    """A markdown table of ``out["rows"]``."""
    lines = [f"Model {out['model']}, L1 (device) {out['l1_gb']:g} GB, extension rule on.", "",
             "| trace | system | host GB | vLLM retention | input tokens | L1 (device) hit tokens "
             "| L2 / CPU hit tokens | L3 hit tokens | total hit rate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        ret = r.get("retention_interval", "")
        ret = "None" if r["system"] == "vllm-cpu" and ret is None else ret
        lines.append(f"| {r['trace']} | {r['system']} | {r['host_gb']:g} | {ret} | {r['input_tokens']:,} "
                     f"| {r['l1_hit_tokens']:,} | {r['l2_hit_tokens']:,} | {r['l3_hit_tokens']:,} "
                     f"| {r['token_hit_rate']:.2%} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.WARNING)
    from hybridkv.eval.traces import default_shared_traces

    traces = Path(args.traces) if args.traces else default_shared_traces()
    if traces is None or not traces.is_dir():
        print("trace folder not found: pass --traces or set HYBRIDKV_TRACES", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = run_all(args, traces)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out) if args.json else table(out))
    return 0


if __name__ == "__main__":
    # vLLM reads these when it is imported (lazily, below main): set for the script's run
    # only, never on import (a test importing this module must not change what later
    # processes it starts inherit)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
