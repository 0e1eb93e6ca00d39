"""Transfer-layer benchmark: page copy GB/s vs memcpy, layerwise overlap.

    python benchmarks/transfer.py            # table
    python benchmarks/transfer.py --json     # one JSON object
    python benchmarks/transfer.py --cuda     # + GPU page copies vs cudaMemcpy

Host part (MiMo-like SWA pool: 8 KV heads, K dim 192, V dim 128, bf16,
64-token pages): gather/scatter of a random page list between two pools
with the C host kernel, the torch reference, and a plain contiguous copy
of the same number of bytes (torch ``copy_`` and numpy ``copyto``, the
faster one is the memcpy bound), all in the same run.

Layerwise part: ``LayerwiseLoader`` loads each layer's pages on its worker
(1 copy thread) while the consumer runs a per-layer matmul (1 torch
thread); ``layerwise_overlap_ratio`` = overlapped time / max(load alone,
compute alone) (1.0 = perfect overlap, ~2.0 = serial).  Overlap needs a
free core for each side; ``layerwise_serial_ratio`` shows what no overlap
would give in the same run, and ``layerwise_overlap_ratio_sleep_compute``
repeats the pipeline with a compute that leaves the CPU idle (as a GPU
kernel would), isolating the loader's own overhead.

Contenders run interleaved, round after round (the machine may be shared),
and figures are medians over ``--repeats`` rounds; ratios are medians of
per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridkv.transfer import (  # noqa: E402
    LayerwiseLoader, copy_pages, model_layer_jobs, pack_pages, prepare_copy, unpack_pages)
from hybridkv.transfer.host_kernel import default_threads, load_host_kernel  # noqa: E402

HEADS, K_DIM, V_DIM, PAGE = 8, 192, 128, 64
DTYPE = torch.bfloat16


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Run each function once per round, round after round; seconds per run.

    Interleaving makes every contender see the same background load (this
    machine is shared), so per-round ratios are fair even when absolute
    figures drift.  One warm-up round first.
    """
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def median_ratio(num: list[float], den: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(num, den))


def pool(layers: int, pages: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    # fill_ touches every page so first-touch faults stay out of the timings.
    k = torch.empty(layers, pages * PAGE, HEADS, K_DIM, dtype=DTYPE).fill_(fill)
    v = torch.empty(layers, pages * PAGE, HEADS, V_DIM, dtype=DTYPE).fill_(fill)
    return k, v


def bench_host(args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(0)
    sk, sv = pool(args.layers, args.pool_pages, 1.0)
    dk, dv = pool(args.layers, args.copy_pages, 0.0)
    src = torch.randperm(args.pool_pages, generator=gen)[: args.copy_pages]
    dst = torch.randperm(args.copy_pages, generator=gen)
    nbytes = dk.numel() * 2 + dv.numel() * 2  # == bytes moved by one page copy
    host = load_host_kernel()
    fk, fv = sk.view(-1)[: dk.numel()], sv.view(-1)[: dv.numel()]
    nk, nv = fk.view(torch.int16).numpy(), fv.view(torch.int16).numpy()
    ndk, ndv = dk.view(-1).view(torch.int16).numpy(), dv.view(-1).view(torch.int16).numpy()
    staging = torch.empty(args.copy_pages, args.layers * PAGE * HEADS * (K_DIM + V_DIM),
                          dtype=DTYPE)
    t = interleaved({
        "memcpy_torch": lambda: (dk.view(-1).copy_(fk), dv.view(-1).copy_(fv)),
        "memcpy_numpy": lambda: (np.copyto(ndk, nk), np.copyto(ndv, nv)),
        "host_copy": lambda: copy_pages(sk, sv, dk, dv, src, dst, PAGE, backend="host"),
        "host_pack": lambda: pack_pages(sk, sv, src, PAGE, out=staging, backend="host"),
        "host_unpack": lambda: unpack_pages(staging, dk, dv, dst, PAGE, backend="host"),
        "torch_ref_copy": lambda: copy_pages(sk, sv, dk, dv, src, dst, PAGE, backend="torch"),
    }, args.repeats)
    memcpy = [min(a, b) for a, b in zip(t["memcpy_torch"], t["memcpy_numpy"])]
    out: dict = {"bytes_per_copy": nbytes, "host_kernel": host is not None,
                 "host_threads": default_threads(), "torch_threads": torch.get_num_threads()}
    for name, runs in t.items():
        out[f"{name}_gbps"] = nbytes / statistics.median(runs) / 1e9
    out["memcpy_gbps"] = nbytes / statistics.median(memcpy) / 1e9
    for op in ("copy", "pack", "unpack"):
        out[f"host_{op}_ratio_vs_memcpy"] = median_ratio(memcpy, t[f"host_{op}"])
    out["host_copy_speedup_vs_torch_ref"] = median_ratio(t["torch_ref_copy"], t["host_copy"])
    return out


def bench_layerwise(args: argparse.Namespace) -> dict:
    layers, pages = args.lw_layers, args.lw_pages
    gen = torch.Generator().manual_seed(1)
    sk, sv = pool(layers, pages * 2, 1.0)
    dk, dv = pool(layers, pages, 0.0)
    src = torch.randperm(pages * 2, generator=gen)[:pages]
    dst = torch.arange(pages)
    jobs = model_layer_jobs(["swa"] * layers, {"swa": (sk, sv, dk, dv)},
                            {"swa": (src, dst)}, PAGE)
    a = torch.randn(args.mm, args.mm)
    b = torch.randn(args.mm, args.mm)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core computes, the other loads

    def one_thread_copy(*a_, **kw):  # noqa: ANN002, ANN003
        return copy_pages(*a_, num_threads=1, **kw)

    def load_all() -> None:
        with LayerwiseLoader(jobs, copy_fn=one_thread_copy) as loader:
            loader.wait(layers - 1)

    def compute(reps: int) -> None:
        for _ in range(reps):
            torch.mm(a, b)

    try:
        t_load = statistics.median(interleaved({"l": load_all}, 3)["l"])
        t_mm = statistics.median(interleaved({"m": lambda: compute(1)}, 5)["m"])
        # Size per-layer compute to about the per-layer load, as in a model
        # where attention+MLP of a layer takes about as long as its KV load.
        reps = max(1, round(t_load / layers / t_mm))

        def compute_all() -> None:
            for _ in range(layers):
                compute(reps)

        def overlapped() -> None:
            with LayerwiseLoader(jobs, copy_fn=one_thread_copy) as loader:
                for i in range(layers):
                    loader.wait(i)
                    compute(reps)

        # The same pipeline with a compute that does not use the host CPU
        # (sleep, like a GPU kernel): isolates the loader's own overhead from
        # CPU contention, which on a 2-core box decides the matmul figure.
        pause = t_load / layers

        def sleep_all() -> None:
            for _ in range(layers):
                time.sleep(pause)

        def overlapped_sleep() -> None:
            with LayerwiseLoader(jobs, copy_fn=one_thread_copy) as loader:
                for i in range(layers):
                    loader.wait(i)
                    time.sleep(pause)

        t = interleaved({"load": load_all, "compute": compute_all, "both": overlapped,
                         "sleep": sleep_all, "both_sleep": overlapped_sleep}, args.repeats)
    finally:
        torch.set_num_threads(prev_threads)
    layer_bytes = pages * PAGE * HEADS * (K_DIM + V_DIM) * 2
    med = {k: statistics.median(v) for k, v in t.items()}
    bound = [max(x, y) for x, y in zip(t["load"], t["compute"])]
    return {
        "layerwise_layers": layers, "layerwise_bytes_per_layer": layer_bytes,
        "layerwise_load_s": med["load"], "layerwise_compute_s": med["compute"],
        "layerwise_overlapped_s": med["both"], "layerwise_serial_s": med["load"] + med["compute"],
        "layerwise_load_gbps": layer_bytes * layers / med["load"] / 1e9,
        "layerwise_matmuls_per_layer": reps,
        "layerwise_overlap_ratio": median_ratio(t["both"], bound),
        "layerwise_serial_ratio": median_ratio([x + y for x, y in zip(t["load"], t["compute"])],
                                               bound),
        "layerwise_overlap_ratio_sleep_compute": median_ratio(
            t["both_sleep"], [max(x, y) for x, y in zip(t["load"], t["sleep"])]),
    }


def bench_cuda(args: argparse.Namespace) -> dict:
    """GPU page copies by the copy engines (DMA) and the SM kernel, each
    direction, prepared once and issued, vs cudaMemcpy of the same bytes."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(2)
    layers, host_pages, n = args.layers, args.cuda_pool_pages, args.cuda_copy_pages
    hk, hv = (t.pin_memory() for t in pool(layers, host_pages, 1.0))
    gk = torch.zeros(layers, n * PAGE, HEADS, K_DIM, dtype=DTYPE, device=dev)
    gv = torch.zeros(layers, n * PAGE, HEADS, V_DIM, dtype=DTYPE, device=dev)
    src = torch.randperm(host_pages, generator=gen)[:n]
    dst = torch.randperm(n, generator=gen)
    nbytes = (gk.numel() + gv.numel()) * 2
    flat_h = torch.empty(nbytes // 2, dtype=DTYPE).pin_memory()
    flat_d = torch.empty(nbytes // 2, dtype=DTYPE, device=dev)

    def timed(fn: Callable[[], object]) -> float:
        # CUDA events time the stream, not the host; first run is warm-up.
        times = []
        for i in range(args.repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            if i:
                times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    gk2, gv2 = torch.zeros_like(gk), torch.zeros_like(gv)
    perm = torch.randperm(n, generator=gen)
    directions = {"h2d": (hk, hv, gk, gv, src, dst), "d2h": (gk, gv, hk, hv, dst, src),
                  "d2d": (gk, gv, gk2, gv2, perm, dst)}
    res: dict = {}
    # Prepared once (validation, runs, index upload), then only the issue is timed:
    # what a layerwise load or a tier read pays per copy.
    for d, (sk_, sv_, dk_, dv_, sp, dp) in directions.items():
        for path in ("dma", "kernel"):
            plan = prepare_copy(sk_, sv_, dk_, dv_, sp, dp, PAGE, backend="cuda", cuda_path=path)
            res[f"cuda_{d}_{path}_gbps"] = gbps(timed(plan.issue))
        auto = prepare_copy(sk_, sv_, dk_, dv_, sp, dp, PAGE, backend="cuda").path
        res[f"cuda_{d}_path"] = auto
        res[f"cuda_{d}_gbps"] = res[f"cuda_{d}_{auto}_gbps"]
    res["cudamemcpy_h2d_gbps"] = gbps(timed(lambda: flat_d.copy_(flat_h, non_blocking=True)))
    res["cudamemcpy_d2h_gbps"] = gbps(timed(lambda: flat_h.copy_(flat_d, non_blocking=True)))
    res["cudamemcpy_d2d_gbps"] = gbps(timed(
        lambda: (gk2.view(-1).copy_(gk.view(-1)), gv2.view(-1).copy_(gv.view(-1)))))
    # one-shot copy_pages (validate + plan + issue each call), for the record
    res["cuda_h2d_one_shot_gbps"] = gbps(timed(
        lambda: copy_pages(hk, hv, gk, gv, src, dst, PAGE, backend="cuda")))
    staging = torch.empty(n, layers * PAGE * HEADS * (K_DIM + V_DIM), dtype=DTYPE).pin_memory()
    res["cuda_pack_d2h_gbps"] = gbps(timed(
        lambda: pack_pages(gk, gv, dst, PAGE, out=staging, backend="cuda")))
    for d in ("h2d", "d2h", "d2d"):
        res[f"cuda_{d}_ratio_vs_memcpy"] = res[f"cuda_{d}_gbps"] / res[f"cudamemcpy_{d}_gbps"]
        for path in ("dma", "kernel"):
            res[f"cuda_{d}_{path}_ratio_vs_memcpy"] = (res[f"cuda_{d}_{path}_gbps"]
                                                       / res[f"cudamemcpy_{d}_gbps"])
    res["cuda_device"] = torch.cuda.get_device_name(dev)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--cuda", action="store_true", help="also benchmark the CUDA kernels")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=3, help="layers of the host pools")
    ap.add_argument("--pool-pages", type=int, default=2048, help="pages in the source pool")
    ap.add_argument("--copy-pages", type=int, default=512, help="pages per copy")
    ap.add_argument("--lw-layers", type=int, default=32)
    ap.add_argument("--lw-pages", type=int, default=32, help="pages loaded per layer")
    ap.add_argument("--mm", type=int, default=384, help="matmul size of per-layer compute")
    ap.add_argument("--cuda-pool-pages", type=int, default=4096)
    ap.add_argument("--cuda-copy-pages", type=int, default=1024)
    args = ap.parse_args()
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    res = {"shape": {"heads": HEADS, "k_dim": K_DIM, "v_dim": V_DIM, "page_size": PAGE,
                     "dtype": str(DTYPE), "layers": args.layers, "pool_pages": args.pool_pages,
                     "copy_pages": args.copy_pages}, "repeats": args.repeats,
           "statistic": "median", "loadavg_1min_start": load_start}
    res.update(bench_host(args))
    res.update(bench_layerwise(args))
    if args.cuda:
        if not torch.cuda.is_available():
            print("--cuda needs a CUDA device", file=sys.stderr)
            return 2
        res.update(bench_cuda(args))
    res["wall_s"] = time.perf_counter() - t0
    # Overlap needs two idle cores; the 1-minute load average tells a reader
    # whether other work shared them during the run.
    res["loadavg_1min_end"] = os.getloadavg()[0]
    res["cpu_count"] = os.cpu_count()
    if args.json:
        print(json.dumps(res, sort_keys=True))
        return 0
    rows = [(k, v) for k, v in sorted(res.items()) if isinstance(v, (int, float))]
    width = max(len(k) for k, _ in rows)
    print(f"transfer benchmark ({res['shape']}, medians of {args.repeats})")
    for k, v in rows:
        print(f"  {k:<{width}}  {v:.3f}" if isinstance(v, float) else f"  {k:<{width}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
