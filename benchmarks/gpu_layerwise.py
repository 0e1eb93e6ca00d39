"""Layerwise prefetch on a GPU: does loading a cached prefix cost the model anything?

One request's cached prefix comes back from pinned host pages (L2) into
device pages layer by layer while the GPU computes, with MiMo-V2.5-Pro's
layer pattern and KV shapes (the ``mimo-v2.5-pro`` preset: 70 layers, every
7th full attention, 8 KV heads, K 192 / V 128, bf16, page 64, window 128):
full layers load every prefix page, SWA layers only the window's pages.
Host pages are a random choice from a pool twice the prefix (an L2 that has
seen other requests), device pages are fresh (contiguous) ones.  The compute
per layer is bf16 matmuls sized so that computing all layers takes about as
long as loading them (the hardest case for overlap: neither hides the
other).  Everything is timed with CUDA events, in interleaved rounds.

Printed per prefix size:
* ``overlap_ratio`` = overlapped / max(load alone, compute alone): 1.0 is
  perfect overlap; ``serial_ratio`` = (load + compute) / max(...) is what no
  overlap at all gives;
* ``load_vs_memcpy``: cudaMemcpy of the same bytes (one contiguous pinned
  buffer) / the layerwise load, both alone;
* ``host_us_per_layer``: host time ``LayerwiseLoader.start()`` spends
  issuing, per layer (the model's thread waits for it), and ``plan_ms``:
  validating and planning the request's load once, before that;
  ``one_shot_us_per_layer``: the same load issued the old way, one
  validated ``copy_pages``-style call per layer.
And once: a two-stream check, a copy of the same pages beside matmuls on an
independent stream, by the SM kernel and by the copy engines
(``*_overlap_ratio`` as above).

``--device cpu`` is the dry run CI runs: the same buffers (allocated, never
touched), the same plans and the same issue path with the launch stubbed,
so it measures host us per layer anywhere; GPU-only fields are null.

    python benchmarks/gpu_layerwise.py [--device cuda|cpu] [--sizes 4096,16384,65536] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

from hybridkv.spec import ModelSpec
from hybridkv.transfer import LayerwiseLoader, model_layer_jobs, prepare_copy

SPEC = ModelSpec.preset("mimo-v2.5-pro")


class Setup:
    """Buffers, page lists and jobs for one prefix size."""

    def __init__(self, prefix_tokens: int, device: str, seed: int = 0) -> None:
        ps = SPEC.page_size
        self.kinds = [k.value for k in SPEC.layer_kinds]
        self.full_pages = prefix_tokens // ps
        # the window's pages: W tokens may straddle one more page boundary
        self.swa_pages = min(-(-SPEC.window // ps) + 1, self.full_pages)
        g = torch.Generator().manual_seed(seed)
        dev = torch.device(device)
        pin = dev.type == "cuda"
        self.buffers, self.pages = {}, {}
        nbytes = 0
        for kind, n in (("full", self.full_pages), ("swa", self.swa_pages)):
            shape = SPEC.shape(kind)
            layers = len(SPEC.layers(kind))
            pool = 2 * n

            def make(pages: int, d: int, where: torch.device, pinned: bool) -> torch.Tensor:
                # Never touched on the CPU dry run: the memory stays virtual.
                return torch.empty(layers, pages * ps, shape.num_kv_heads, d,
                                   dtype=SPEC.torch_dtype, device=where, pin_memory=pinned)

            hk, hv = make(pool, shape.k_head_dim, torch.device("cpu"), pin), \
                make(pool, shape.v_head_dim, torch.device("cpu"), pin)
            dk, dv = make(n, shape.k_head_dim, dev, False), make(n, shape.v_head_dim, dev, False)
            if pin:  # random bits, generated on the GPU (CPU randn of GBs is slow)
                for t in (hk, hv):
                    t.copy_(torch.randn(t.shape, dtype=t.dtype, device=dev))
            self.buffers[kind] = (hk, hv, dk, dv)
            self.pages[kind] = (torch.randperm(pool, generator=g)[:n], torch.arange(n))
            nbytes += n * SPEC.bytes_per_page(kind)  # every layer of the kind
        self.nbytes = nbytes
        self.jobs = model_layer_jobs(self.kinds, self.buffers, self.pages, ps)

    def check_loaded(self) -> bool:
        """Spot-check one full and one SWA layer against the host pages."""
        ok = True
        for kind, layer in (("full", 3), ("swa", 5)):
            hk, hv, dk, dv = self.buffers[kind]
            src, dst = self.pages[kind]
            ps = SPEC.page_size
            for h, d in ((hk, dk), (hv, dv)):
                got = d[layer].view(-1, ps, *d.shape[2:])[dst].cpu()
                want = h[layer].view(-1, ps, *h.shape[2:])[src]
                ok = ok and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return ok


def ev_time(fn: Callable[[], None]) -> float:
    """Seconds of GPU time ``fn``'s work takes, by CUDA events on the current stream."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / 1e3


def issue_us(setup: Setup, dry_run: bool, rounds: int) -> tuple[float, float]:
    """Median host us per layer ``LayerwiseLoader.start()`` spends issuing
    (what the model waits for), and median ms it spends planning the request."""
    got, plan = [], []
    for _ in range(rounds):
        loader = LayerwiseLoader(setup.jobs, dry_run=dry_run)
        loader.start()
        for layer in range(len(setup.kinds)):
            loader.wait(layer)
        got.append(loader.issue_seconds / len(setup.kinds) * 1e6)
        plan.append(loader.plan_seconds * 1e3)
        loader.close()
    if not dry_run:
        torch.cuda.synchronize()
    return statistics.median(got), statistics.median(plan)


def one_shot_us(setup: Setup, dry_run: bool, rounds: int) -> float:
    """Median host us per layer of the old way: validate, plan and issue each
    layer's copy on its own (one ``copy_pages`` per layer), for comparison."""
    got = []
    stream = None if dry_run else torch.cuda.Stream()
    for _ in range(rounds):
        t0 = time.perf_counter()
        for job in setup.jobs:
            for c in job.copies:
                prepare_copy(c.src_k, c.src_v, c.dst_k, c.dst_v, c.src_pages, c.dst_pages,
                             c.page_size, layers=(c.kind_layer, c.kind_layer + 1),
                             dry_run=dry_run).issue(stream=stream)
        got.append((time.perf_counter() - t0) / len(setup.jobs) * 1e6)
    if stream is not None:
        stream.synchronize()
    return statistics.median(got)


def run_gpu(setup: Setup, repeats: int, mm: int) -> dict[str, Any]:
    dev = torch.device("cuda")
    layers = len(setup.kinds)
    with LayerwiseLoader(setup.jobs) as ld:
        for i in range(layers):
            ld.wait(i)
    torch.cuda.synchronize()
    loaded = setup.check_loaded()

    def load_all() -> None:
        with LayerwiseLoader(setup.jobs) as ld:
            ld.wait(layers - 1)

    a = torch.randn(mm, mm, device=dev, dtype=torch.bfloat16)
    b = torch.randn(mm, mm, device=dev, dtype=torch.bfloat16)
    t_load = statistics.median(ev_time(load_all) for _ in range(5))
    t_mm = statistics.median(ev_time(lambda: [torch.mm(a, b) for _ in range(10)])
                             for _ in range(5)) / 10
    reps = max(1, round(t_load / layers / t_mm))

    def compute_all() -> None:
        for _ in range(layers * reps):
            torch.mm(a, b)

    def both() -> None:
        with LayerwiseLoader(setup.jobs) as ld:
            for i in range(layers):
                ld.wait(i)
                for _ in range(reps):
                    torch.mm(a, b)

    flat_h = torch.empty(setup.nbytes, dtype=torch.uint8, pin_memory=True)
    flat_d = torch.empty(setup.nbytes, dtype=torch.uint8, device=dev)

    def memcpy() -> None:
        flat_d.copy_(flat_h, non_blocking=True)

    t: dict[str, list[float]] = {k: [] for k in ("load", "compute", "both", "memcpy")}
    fns = (("load", load_all), ("compute", compute_all), ("both", both), ("memcpy", memcpy))
    for _, fn in fns:
        fn()
    for _ in range(repeats):  # interleaved: drift hits every figure alike
        for k, fn in fns:
            t[k].append(ev_time(fn))
    bound = [max(x, y) for x, y in zip(t["load"], t["compute"])]
    med = {k: statistics.median(v) for k, v in t.items()}
    return {
        "loaded_correctly": loaded, "matmuls_per_layer": reps,
        "load_s": med["load"], "compute_s": med["compute"], "overlapped_s": med["both"],
        "load_gbps": setup.nbytes / med["load"] / 1e9,
        "memcpy_gbps": setup.nbytes / med["memcpy"] / 1e9,
        "load_vs_memcpy": med["memcpy"] / med["load"],
        "overlap_ratio": statistics.median(x / m for x, m in zip(t["both"], bound)),
        "serial_ratio": statistics.median((x + y) / m for x, y, m in
                                          zip(t["load"], t["compute"], bound)),
    }


def concurrency(repeats: int, mm: int, pages: int = 256) -> dict[str, Optional[float]]:
    """A copy of ``pages`` full pages (all full layers) beside matmuls on an
    independent stream: SM kernel vs copy engines vs one cudaMemcpyAsync."""
    dev = torch.device("cuda")
    shape, layers, ps = SPEC.shape("full"), len(SPEC.full_layers), SPEC.page_size
    hk = torch.empty(layers, 2 * pages * ps, shape.num_kv_heads, shape.k_head_dim,
                     dtype=SPEC.torch_dtype, pin_memory=True)
    hv = torch.empty(layers, 2 * pages * ps, shape.num_kv_heads, shape.v_head_dim,
                     dtype=SPEC.torch_dtype, pin_memory=True)
    dk = torch.empty(layers, pages * ps, *hk.shape[2:], dtype=hk.dtype, device=dev)
    dv = torch.empty(layers, pages * ps, *hv.shape[2:], dtype=hv.dtype, device=dev)
    src = torch.randperm(2 * pages)[:pages]
    dst = torch.arange(pages)
    side = torch.cuda.Stream()
    plans = {p: prepare_copy(hk, hv, dk, dv, src, dst, ps, cuda_path=p) for p in ("kernel", "dma")}
    nbytes = plans["dma"].nbytes
    flat_h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    flat_d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    a = torch.randn(mm, mm, device=dev, dtype=torch.bfloat16)
    b = torch.randn(mm, mm, device=dev, dtype=torch.bfloat16)

    def copier(kind: str) -> Callable[[], None]:
        if kind == "memcpy":
            return lambda: flat_d.copy_(flat_h, non_blocking=True)
        return lambda: plans[kind].issue()  # on the current stream

    t_copy = {k: statistics.median(ev_time(copier(k)) for _ in range(3))
              for k in ("kernel", "dma", "memcpy")}
    t_mm = statistics.median(ev_time(lambda: torch.mm(a, b)) for _ in range(5))
    out: dict[str, Optional[float]] = {}
    for kind in ("kernel", "dma", "memcpy"):
        reps = max(1, round(t_copy[kind] / t_mm))
        ratios = []
        for _ in range(repeats):
            t_mms = ev_time(lambda: [torch.mm(a, b) for _ in range(reps)])

            def together() -> None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    copier(kind)()
                for _ in range(reps):
                    torch.mm(a, b)
                torch.cuda.current_stream().wait_stream(side)

            ratios.append(ev_time(together) / max(t_copy[kind], t_mms))
        out[f"{kind}_overlap_ratio"] = statistics.median(ratios)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available()
                    else "cpu", help="cuda: measure on the GPU; cpu: dry run (default: cuda if present)")
    ap.add_argument("--sizes", default="4096,16384,65536", help="prefix tokens (comma separated)")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved rounds per figure")
    ap.add_argument("--mm", type=int, default=4096, help="matmul size (n x n x n, bf16)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device (use --device cpu for the dry run)")
    gpu = args.device == "cuda"
    runs = []
    for size in (int(s) for s in args.sizes.split(",")):
        setup = Setup(size, args.device)
        us, plan_ms = issue_us(setup, not gpu, args.repeats)
        row: dict[str, Any] = {"prefix_tokens": size, "bytes": setup.nbytes,
                               "host_us_per_layer": us, "plan_ms": plan_ms,
                               "one_shot_us_per_layer": one_shot_us(setup, not gpu, 3)}
        if gpu:
            row.update(run_gpu(setup, args.repeats, args.mm))
        else:
            row.update({k: None for k in ("overlap_ratio", "serial_ratio", "load_vs_memcpy")})
        runs.append(row)
        del setup
    conc = (concurrency(args.repeats, args.mm) if gpu
            else {"kernel_overlap_ratio": None, "dma_overlap_ratio": None, "memcpy_overlap_ratio": None})
    out = {"device": torch.cuda.get_device_name() if gpu else "cpu (dry run: launch stubbed)",
           "model": SPEC.name, "runs": runs, "concurrency": conc,
           "date": time.strftime("%Y-%m-%d")}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{out['device']}, {SPEC.name}, page {SPEC.page_size}")
        for r in runs:
            fig = lambda k: "-" if r.get(k) is None else f"{r[k]:.2f}"  # noqa: E731
            print(f"  {r['prefix_tokens']:>6} tokens {r['bytes'] / 1e6:8.1f} MB: overlap "
                  f"{fig('overlap_ratio')} (serial {fig('serial_ratio')}), load/memcpy "
                  f"{fig('load_vs_memcpy')}, host {r['host_us_per_layer']:.1f} us/layer "
                  f"(planning {r['plan_ms']:.2f} ms/request; unplanned "
                  f"{r['one_shot_us_per_layer']:.0f} us/layer)")
        print("  copy beside matmul: " + ", ".join(
            f"{k} {'-' if v is None else f'{v:.2f}'}" for k, v in conc.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
