"""Run vLLM ``LLM``s over prompt sets and write outputs, cache hits and times as JSON.

    python scripts/run_llm.py JOB.json OUT.json

JOB: ``runs`` (list of per-run dicts with a ``name``; run one after another in
this process, each with fresh vLLM engine/worker processes) plus defaults for
every run.  OUT: ``{name: result}``.  Per-run keys: ``model`` (dir),
``connector`` (``none`` | ``hybridkv`` | ``offloading``),
``extra`` (connector extra config), ``sets`` (names from :func:`prompt_sets`;
default :data:`DEFAULT_SETS`), ``reset_between`` (drop vLLM's own prefix cache
before every request so hits must come through the connector), ``max_tokens``,
``block_size``, ``max_model_len``, ``seed``, ``scheduler_cls`` (qualified name,
e.g. ``hybridkv_vllm.scheduler.HybridKVScheduler``: hybridkv's tree as vLLM's
prefix cache), ``num_gpu_blocks`` (``num_gpu_blocks_override``),
``async_scheduling`` (vLLM's; default: vLLM's choice).  Each request is one
``generate`` call so earlier
requests are finished (and saved) before later ones look up.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any


DEFAULT_SETS = ("repeat", "shared_prefix", "multi_turn")  # a job without "sets" runs these


def prompt_sets(seed: int, vocab: int = 512) -> dict[str, list[Any]]:
    """Token-id prompts; ``("turn", i, extra)`` items extend the previous turn with
    its own output (multi-turn), ``("cut", i, n, extra)`` ones prompt ``i``'s first
    ``n`` tokens."""
    rnd = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rnd.randrange(4, vocab) for _ in range(n)]

    a, s = toks(230), toks(170)
    return {
        "repeat": [a, a, a[:200]],
        "shared_prefix": [s + toks(60), s + toks(90), s + toks(15)],
        "multi_turn": [toks(150), ("turn", 0, toks(40)), ("turn", 1, toks(50))],
        # a conversation pushed out of a small device cache by four others, then its next turn
        "pushed_out": [toks(300), toks(300), toks(300), toks(300), toks(300), ("turn", 0, toks(40))],
        # a prompt whose device windows others push out while its full KV stays, then a prompt
        # that shares its first 300 tokens (a hit inside it, whose window no retention keeps)
        "window_lost": [toks(400), toks(400), toks(400), ("cut", 0, 300, toks(30))],
    }


def _connector(kind: str, extra: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    if kind == "none":
        return None
    if kind == "hybridkv":
        return KVTransferConfig(kv_connector="HybridKVConnector",
                                kv_connector_module_path="hybridkv_vllm.connector",
                                kv_role="kv_both", kv_connector_extra_config=extra,
                                kv_load_failure_policy="recompute")
    if kind == "offloading":
        return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                kv_connector_extra_config=extra)
    raise ValueError(f"connector must be none|hybridkv|offloading, got {kind!r}")


def _run_one(job: dict[str, Any]) -> dict[str, Any]:
    """Start one ``LLM``, run its prompt sets, shut it down (engine and worker exit)."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], enforce_eager=True, dtype="float32",
              max_model_len=job.get("max_model_len", 512), block_size=job.get("block_size", 32),
              kv_transfer_config=_connector(job["connector"], job.get("extra", {})),
              seed=0, max_num_seqs=4, trust_remote_code=job.get("trust_remote_code", False),
              disable_log_stats=True, gpu_memory_utilization=job.get("memory_fraction", 0.05),
              kv_cache_memory_bytes=job.get("kv_cache_bytes", 64 << 20),
              # worker inside the engine-core process: one process spawn (and
              # vLLM import, ~15-20 s here) less per LLM; still a fresh process per LLM
              distributed_executor_backend=job.get("executor", "uni"),
              **({"scheduler_cls": job["scheduler_cls"]} if job.get("scheduler_cls") else {}),
              **({"async_scheduling": job["async_scheduling"]} if "async_scheduling" in job else {}),
              **({"num_gpu_blocks_override": job["num_gpu_blocks"]} if job.get("num_gpu_blocks") else {}))
    init_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 12),
                            ignore_eos=True)
    result: dict[str, Any] = {"init_s": init_s, "sets": {}}
    sets = prompt_sets(job.get("seed", 0))
    for name in job.get("sets", DEFAULT_SETS):
        prompts, outs, cached, walls = [], [], [], []
        for item in sets[name]:
            if isinstance(item, (tuple, list)) and item and item[0] == "cut":  # JSON turns tuples to lists
                _, i, n, extra = item
                p = prompts[i][:n] + extra
            elif isinstance(item, tuple) or (isinstance(item, list) and item and item[0] == "turn"):
                _, i, extra = item
                p = prompts[i] + outs[i] + extra
            else:
                p = list(item)
            if job.get("reset_between"):
                llm.reset_prefix_cache()
            t = time.perf_counter()
            o = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
            walls.append(time.perf_counter() - t)
            prompts.append(p)
            outs.append(list(o.outputs[0].token_ids))
            cached.append(int(o.num_cached_tokens or 0))
        result["sets"][name] = {"prompt_lens": [len(p) for p in prompts], "outputs": outs,
                                "cached_tokens": cached, "wall_s": walls}
    result["total_s"] = time.perf_counter() - t0
    llm.llm_engine.engine_core.shutdown()  # lets queued finish saves drain; workers exit
    del llm
    gc.collect()
    return result


def main(job_path: str, out_path: str) -> None:
    """Run ``job["runs"]`` one after another in this process (one vLLM import).

    Each run gets a fresh engine-core and worker process from vLLM, so a
    later run's connector starts with empty memory (its L2 is new): it can
    only hit through L3.  A run whose ``LLM`` fails to start records
    ``{"error": ...}`` and the next run still goes ahead.
    """
    job = json.loads(Path(job_path).read_text())
    common = {k: v for k, v in job.items() if k != "runs"}
    out: dict[str, Any] = {}
    for run in job.get("runs", [{}]):
        spec = {**common, **run}
        name = spec.get("name", spec.get("connector", "run"))
        print(f"### hybridkv run {name} start", flush=True)
        try:
            out[name] = _run_one(spec)
        except Exception as exc:  # noqa: BLE001 - a refused start is a result (e.g. no CUDA for offload)
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"### hybridkv run {name} end", flush=True)
        with open(out_path, "w") as f:  # after every run: a later crash keeps earlier ones
            json.dump(out, f)
    os._exit(0)  # skip slow interpreter teardown of vLLM's workers


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
