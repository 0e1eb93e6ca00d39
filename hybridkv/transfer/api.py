"""The dispatcher: one API over the torch reference, the C host kernel and CUDA.

``backend="auto"`` picks:

* CUDA kernel when any tensor is on a CUDA device and every host tensor is
  pinned (the kernel reaches pinned memory zero-copy); the torch reference
  when the CUDA library is not built or a host tensor is pageable;
* the C host kernel when every tensor is on the CPU (torch reference if no
  compiler could build it);
* validation only for ``meta`` tensors (nothing to copy).

Every function validates all arguments before anything is written, raising
``TypeError``/``ValueError`` that names the argument, so a failed call leaves
the destination unchanged.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch

from .._validate import check_int
from . import _layout as L
from .cuda_kernel import StreamLike, load_cuda_kernel, resolve_stream, run_cuda
from .host_kernel import load_host_kernel
from .reference import ref_copy_pages, ref_pack_pages, ref_unpack_pages

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def _check_threads(num_threads: object) -> Optional[int]:
    """``num_threads`` as None or an int >= 1 (TypeError / ValueError otherwise)."""
    return None if num_threads is None else check_int(num_threads, "num_threads", 1)


def _cuda_library_available() -> bool:
    try:
        load_cuda_kernel()
        return True
    except RuntimeError as exc:
        _warn_once("cuda-lib", "CUDA page-copy library unavailable, using torch: %s", exc)
        return False


def _resolve(backend: str, named: dict[str, torch.Tensor]) -> str:
    """Pick the backend that will run; raise naming the offending argument."""
    L.check_backend(backend)
    kinds = {n: t.device.type for n, t in named.items()}
    if "meta" in kinds.values():
        if set(kinds.values()) != {"meta"}:
            other = next(n for n, k in kinds.items() if k != "meta")
            raise ValueError(f"{other} is on {named[other].device} but other tensors are meta")
        return "meta"
    cuda = {named[n].device for n, k in kinds.items() if k == "cuda"}
    if len(cuda) > 1:
        raise ValueError(f"tensors span several CUDA devices {sorted(map(str, cuda))}")
    odd = [n for n, k in kinds.items() if k not in ("cpu", "cuda")]
    if odd and backend != "torch":
        raise ValueError(f"{odd[0]} is on unsupported device {named[odd[0]].device}; "
                         "use backend='torch'")
    if backend == "torch":
        return "torch"
    if backend == "host" or (backend == "auto" and not cuda):
        if cuda:
            name = next(n for n, k in kinds.items() if k == "cuda")
            raise ValueError(
                f"backend='host' needs CPU tensors but {name} is on {named[name].device}")
        if load_host_kernel() is not None:
            return "host"
        if backend == "host":
            raise RuntimeError("the C host kernel is unavailable (no working C compiler); "
                               "use backend='torch' or 'auto'")
        return "torch"
    # CUDA involved (backend "cuda", or "auto" with a CUDA tensor).
    if not cuda:
        raise ValueError("backend='cuda' needs at least one tensor on a CUDA device")
    pageable = [n for n, k in kinds.items() if k == "cpu" and not named[n].is_pinned()]
    if backend == "cuda":
        if pageable:
            raise ValueError(f"{pageable[0]} is pageable host memory; the CUDA kernel "
                             "needs pinned memory (tensor.pin_memory())")
        load_cuda_kernel()  # RuntimeError if not built
        return "cuda"
    return "cuda" if not pageable and _cuda_library_available() else "torch"


@contextlib.contextmanager
def _torch_stream(stream: StreamLike, named: dict[str, torch.Tensor]) -> Iterator[None]:
    dev = next((t.device for t in named.values() if t.device.type == "cuda"), None)
    if stream is None or dev is None:
        yield
        return
    with torch.cuda.stream(resolve_stream(stream, dev)):
        yield


def copy_pages(
    src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
    src_pages: L.PageIndex, dst_pages: L.PageIndex, page_size: int, *,
    mask: L.MaskLike = None, layers: Optional[tuple[int, int]] = None,
    backend: str = "auto", stream: StreamLike = None, num_threads: Optional[int] = None,
) -> str:
    """Copy pages ``src_pages[i] -> dst_pages[i]`` for all layers, K and V.

    Args:
        src_k, src_v, dst_k, dst_v: ``[layers, slots, heads, k_dim|v_dim]``
            buffers of one attention kind; source and destination may differ
            only in ``slots`` (a multiple of ``page_size``).
        src_pages, dst_pages: 1-D integer page lists of equal length ``n``
            (tensor, numpy array or sequence); ``dst_pages`` must not repeat.
        mask: optional bool ``[n]``; entries with ``False`` are skipped (how an
            SWA layer copies only window pages of a shared page list).
        layers: optional ``(begin, end)``: copy only those layers.
        backend: "auto" | "torch" | "host" | "cuda" (see module docstring).
        stream: CUDA stream (``torch.cuda.Stream`` or raw handle) for the
            copy; None = current stream.  The copy is asynchronous on it.
        num_threads: OpenMP threads of the host kernel (default: usable CPUs).

    Returns the backend that ran ("torch", "host", "cuda" or "meta").
    Mutates ``dst_k`` and ``dst_v`` only.  O(n * layers * page bytes), one
    kernel launch / one parallel C loop.
    """
    ps = L.check_page_size(page_size)
    sg = L.check_kv(src_k, src_v, "src_")
    dg = L.check_kv(dst_k, dst_v, "dst_")
    L.check_same_kind(sg, dg)
    src_limit = L.check_slots(sg, ps, "src_k")
    dst_limit = L.check_slots(dg, ps, "dst_k")
    si, di = L.as_index(src_pages, "src_pages"), L.as_index(dst_pages, "dst_pages")
    if si.numel() != di.numel():
        raise ValueError(f"src_pages has {si.numel()} entries but dst_pages has {di.numel()}")
    L.check_range(si, src_limit, "src_pages")
    L.check_range(di, dst_limit, "dst_pages")
    L.check_unique(di, "dst_pages")
    m = L.as_mask(mask, si.numel())
    lb, le = L.check_layers(layers, sg.num_layers)
    num_threads = _check_threads(num_threads)
    L.check_no_alias((src_k, src_v), (dst_k, dst_v), si, di)
    named = {"src_k": src_k, "src_v": src_v, "dst_k": dst_k, "dst_v": dst_v}
    chosen = _resolve(backend, named)
    if chosen == "meta":
        return chosen
    if chosen == "torch":
        with _torch_stream(stream, named):
            ref_copy_pages(src_k, src_v, dst_k, dst_v, si, di, ps, m, (lb, le))
        return chosen
    es = src_k.element_size()
    plan = L.CopyPlan(
        n_pages=si.numel(), src_idx=si, dst_idx=di, mask=m, layer_begin=lb, layer_end=le,
        run_bytes=(ps * sg.heads * sg.k_dim * es, ps * sg.heads * sg.v_dim * es),
        src=L.buffer_side(src_k, src_v, ps, src_limit),
        dst=L.buffer_side(dst_k, dst_v, ps, dst_limit),
    )
    _execute(chosen, plan, (src_k, src_v), (dst_k, dst_v), stream, num_threads)
    return chosen


def _execute(chosen: str, plan: L.CopyPlan, src: tuple[torch.Tensor, ...],
             dst: tuple[torch.Tensor, ...], stream: StreamLike,
             num_threads: Optional[int]) -> None:
    if chosen == "host":
        kernel = load_host_kernel()
        assert kernel is not None  # _resolve returned "host" only if it loaded
        kernel.run(plan, num_threads)
    else:
        run_cuda(plan, src, dst, stream)


def page_nbytes(k: torch.Tensor, v: torch.Tensor, page_size: int) -> int:
    """Bytes of one page of all layers, K and V: the size of one staging row.

    O(1).  Raises like :func:`copy_pages` on bad buffers.
    """
    ps = L.check_page_size(page_size)
    g = L.check_kv(k, v, "")
    return g.page_elems(ps) * k.element_size()


def _staging_plan(g: L.KVGeometry, ps: int, idx: torch.Tensor, buf: L.Side,
                  staging: L.Side, to_staging: bool) -> L.CopyPlan:
    es = torch.empty((), dtype=g.dtype).element_size()
    run = (ps * g.heads * g.k_dim * es, ps * g.heads * g.v_dim * es)
    return L.CopyPlan(
        n_pages=idx.numel(),
        src_idx=idx if to_staging else None, dst_idx=None if to_staging else idx,
        mask=None, layer_begin=0, layer_end=g.num_layers, run_bytes=run,
        src=buf if to_staging else staging, dst=staging if to_staging else buf,
    )


def pack_pages(
    k: torch.Tensor, v: torch.Tensor, pages: L.PageIndex, page_size: int, *,
    out: Optional[torch.Tensor] = None, backend: str = "auto",
    stream: StreamLike = None, num_threads: Optional[int] = None,
) -> torch.Tensor:
    """Gather pages into page-major staging rows.

    Row ``i`` of the result (``[n, page_elems]``, dtype of the pool) is page
    ``pages[i]``: K of layers 0..L-1 (each ``[page_size, heads, k_dim]``)
    then V of layers 0..L-1 (each ``[page_size, heads, v_dim]``), i.e.
    ``page_nbytes`` contiguous bytes, the L3 value of that page.

    ``out``: optional preallocated contiguous ``[n, page_elems]`` tensor (e.g.
    pinned host memory for a D2H pack); otherwise allocated on ``k.device``.
    Mutates only ``out``.  O(n * page bytes).
    """
    ps = L.check_page_size(page_size)
    g = L.check_kv(k, v, "")
    limit = L.check_slots(g, ps, "k")
    idx = L.as_index(pages, "pages")
    L.check_range(idx, limit, "pages")
    num_threads = _check_threads(num_threads)
    if out is None:
        L.check_backend(backend)
        out = torch.empty((idx.numel(), g.page_elems(ps)), dtype=g.dtype, device=g.device)
    L.check_staging(out, g, ps, idx.numel(), "out")
    named = {"k": k, "v": v, "out": out}
    chosen = _resolve(backend, named)
    if chosen == "meta" or idx.numel() == 0:
        return out
    if chosen == "torch":
        with _torch_stream(stream, named):
            ref_pack_pages(k, v, idx, ps, out)
        return out
    plan = _staging_plan(g, ps, idx, L.buffer_side(k, v, ps, limit),
                         L.staging_side(out, g, ps), to_staging=True)
    _execute(chosen, plan, (k, v), (out,), stream, num_threads)
    return out


def unpack_pages(
    staging: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: L.PageIndex,
    page_size: int, *, backend: str = "auto", stream: StreamLike = None,
    num_threads: Optional[int] = None,
) -> str:
    """Scatter staging rows back: page ``pages[i]`` of ``k``/``v`` = row ``i``.

    ``staging`` has the layout of :func:`pack_pages`; ``pages`` must not repeat.
    Returns the backend that ran.  Mutates ``k`` and ``v`` only.
    O(n * page bytes).
    """
    ps = L.check_page_size(page_size)
    g = L.check_kv(k, v, "")
    limit = L.check_slots(g, ps, "k")
    idx = L.as_index(pages, "pages")
    L.check_range(idx, limit, "pages")
    L.check_unique(idx, "pages")
    num_threads = _check_threads(num_threads)
    L.check_staging(staging, g, ps, idx.numel(), "staging")
    named = {"staging": staging, "k": k, "v": v}
    chosen = _resolve(backend, named)
    if chosen == "meta" or idx.numel() == 0:
        return chosen
    if chosen == "torch":
        with _torch_stream(stream, named):
            ref_unpack_pages(staging, k, v, idx, ps)
        return chosen
    plan = _staging_plan(g, ps, idx, L.buffer_side(k, v, ps, limit),
                         L.staging_side(staging, g, ps), to_staging=False)
    _execute(chosen, plan, (staging,), (k, v), stream, num_threads)
    return chosen
