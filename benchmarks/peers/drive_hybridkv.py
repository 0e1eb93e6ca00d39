"""hybridkv (default policy, checkpoints off) and the naive single pool on a sequence file.

Each request runs the facade's engine lifecycle: ``begin`` (window-safe match
and lock), chunked prefill with ``reserve`` + ``commit`` (eviction inside
``reserve``; out-of-window SWA released at chunk ends), ``finish`` (insert the
prompt, unlock).  One request at a time, as for the peers.

    python drive_hybridkv.py SEQ_DIR --budgets 59,594 [--systems hybridkv,hybridkv-no-ckpt,naive]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import GB, Run, Sequences, driver_args, emit, load_sequences

from hybridkv.cache import CacheFullError, HybridKVCache
from hybridkv.eval.replay import system_config
from hybridkv.spec import ModelSpec

SYSTEMS = {"hybridkv": ("hybridkv", None), "hybridkv-no-ckpt": ("hybridkv", 0), "naive": ("naive", None)}


def drive(seqs: Sequences, system: str, budget_gb: float, chunk: int, checkpoint: int) -> dict:
    meta = seqs.meta
    spec = ModelSpec.preset(meta["model"], page_size=meta["page_size"])
    base, ckpt = SYSTEMS[system]
    run = Run(system, budget_gb)
    cache = HybridKVCache(spec, system_config(base, spec, int(budget_gb * GB),
                                              swa_checkpoint=checkpoint if ckpt is None else ckpt))
    clock = time.perf_counter
    for tokens, ns in seqs:
        t0 = clock()
        req = cache.begin(tokens, ns)
        t1 = clock()
        ok = True
        try:
            while req.computed < len(tokens):
                n = min(chunk, len(tokens) - req.computed)
                cache.reserve(req, n)
                cache.commit(req, n)
            t2 = clock()
            cache.finish(req)
        except CacheFullError:
            t2 = clock()
            cache.abort(req)
            run.rejected += 1
            ok = False
        t3 = clock()
        run.times.add(t1 - t0, t2 - t1, t3 - t2)
        run.record(len(tokens), req.prefix_len if ok else 0)  # a rejected request saved nothing
    st = cache.stats()
    k = checkpoint if ckpt is None else ckpt
    run.extra.update({"settings": {"swa_checkpoint": k}, "default": True,
                      "full_pool_tokens": st.get("full_pool_tokens", 0),
                      "swa_pool_tokens": st.get("swa_pool_tokens", 0),
                      "swa_checkpoint": k, "version": "hybridkv (this tree)"})
    return run.result()


def main() -> None:
    args = driver_args(__doc__, extra={
        "--systems": {"default": ",".join(SYSTEMS), "help": "comma-separated subset of " + ",".join(SYSTEMS)},
        "--swa-checkpoint": {"type": int, "default": 16384, "help": "K of the default hybridkv system"}})
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown} (choose from {list(SYSTEMS)})")
    seqs = load_sequences(args.sequences)
    for gb in args.budgets:
        for s in systems:
            emit(drive(seqs, s, gb, args.chunk, args.swa_checkpoint))


if __name__ == "__main__":
    main()
