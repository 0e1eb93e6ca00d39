"""The dispatcher: one API over the torch reference, the C host kernel and CUDA.

``backend="auto"`` picks:

* the CUDA library when any tensor is on a CUDA device and every host tensor
  is pinned: host <-> device copies go to the copy engines (batched DMA of
  coalesced runs), device <-> device copies to the SM page-copy kernel
  (``cuda_path`` overrides: "dma" or "kernel"); the torch reference when the
  library cannot be had or a host tensor is pageable;
* the C host kernel when every tensor is on the CPU (torch reference if no
  compiler could build it);
* validation only for ``meta`` tensors (nothing to copy).

Every function validates all arguments before anything is written, raising
``TypeError``/``ValueError`` that names the argument, so a failed call leaves
the destination unchanged.  ``prepare_copy`` / ``prepare_pack`` /
``prepare_unpack`` do the validation and planning once and return a
:class:`~hybridkv.transfer.plan.PreparedCopy` to issue (per layer) later;
``copy_pages`` / ``pack_pages`` / ``unpack_pages`` are prepare-then-issue.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .._validate import check_int
from . import _layout as L
from .cuda_kernel import StreamLike
from .plan import (PreparedCopy, check_cuda_path, check_max_blocks, plan_copy, plan_runs,
                   resolve_backend)
from .reference import ref_copy_pages, ref_pack_pages, ref_unpack_pages
from .runs import block_rows_runs


def _check_threads(num_threads: object) -> Optional[int]:
    """``num_threads`` as None or an int >= 1 (TypeError / ValueError otherwise)."""
    return None if num_threads is None else check_int(num_threads, "num_threads", 1)


def prepare_copy(
    src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
    src_pages: L.PageIndex, dst_pages: L.PageIndex, page_size: int, *,
    mask: L.MaskLike = None, layers: Optional[tuple[int, int]] = None,
    backend: str = "auto", cuda_path: str = "auto", by_layer: bool = False,
    max_blocks: Optional[int] = None, num_threads: Optional[int] = None,
    dry_run: bool = False,
) -> PreparedCopy:
    """Validate and plan :func:`copy_pages` once; issue it later.

    Arguments as :func:`copy_pages`, plus:
        cuda_path: "auto" (copy engines for host <-> device, the SM kernel
            for device <-> device), "dma" or "kernel".
        by_layer: plan each layer of ``layers`` on its own, so that
            ``issue(layers=(i, i + 1))`` / ``issue_layer(i)`` copies one layer
            (what a layerwise load does); else one issue copies every layer.
        max_blocks: cap on the SM kernel's grid (None: a full grid); a few
            blocks leave the SMs to compute that runs beside the copy.
        dry_run: plan the copy-engine path from tensors on any device and
            stub the launch (``issue`` runs the whole host path, copies
            nothing): measures issue cost without a GPU.

    Raises what :func:`copy_pages` raises; mutates nothing.  O(n * layers)
    numpy for the copy-engine runs; the index arrays are uploaded once.
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
    cuda_path, blocks = check_cuda_path(cuda_path), check_max_blocks(max_blocks)
    L.check_no_alias((src_k, src_v), (dst_k, dst_v), si, di)
    named = {"src_k": src_k, "src_v": src_v, "dst_k": dst_k, "dst_v": dst_v}
    chosen = "dry-run" if dry_run else resolve_backend(backend, named)
    es = src_k.element_size()
    plan = L.CopyPlan(
        n_pages=si.numel(), src_idx=si, dst_idx=di, mask=m, layer_begin=lb, layer_end=le,
        run_bytes=(ps * sg.heads * sg.k_dim * es, ps * sg.heads * sg.v_dim * es),
        src=L.buffer_side(src_k, src_v, ps, src_limit),
        dst=L.buffer_side(dst_k, dst_v, ps, dst_limit),
    )

    def torch_run(span: tuple[int, int]) -> None:
        ref_copy_pages(src_k, src_v, dst_k, dst_v, si, di, ps, m, span)

    return plan_copy(chosen, plan, (src_k, src_v), (dst_k, dst_v), torch_run=torch_run,
                     by_layer=bool(by_layer), cuda_path=cuda_path, max_blocks=blocks,
                     num_threads=num_threads, dry_run=bool(dry_run))


def copy_pages(
    src_k: torch.Tensor, src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
    src_pages: L.PageIndex, dst_pages: L.PageIndex, page_size: int, *,
    mask: L.MaskLike = None, layers: Optional[tuple[int, int]] = None,
    backend: str = "auto", stream: StreamLike = None, num_threads: Optional[int] = None,
) -> str:
    """Copy pages ``src_pages[i] -> dst_pages[i]`` for all layers, K and V.

    Args:
        src_k, src_v, dst_k, dst_v: ``[layers, slots, heads, k_dim|v_dim]``
            buffers of one attention kind (or 5-D paged views); source and
            destination may differ only in ``slots`` (a multiple of ``page_size``).
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
    Mutates ``dst_k`` and ``dst_v`` only.  O(n * layers * page bytes): one
    batched DMA call, one kernel launch or one parallel C loop
    (:func:`prepare_copy` then ``issue``).
    """
    prepared = prepare_copy(src_k, src_v, dst_k, dst_v, src_pages, dst_pages, page_size,
                            mask=mask, layers=layers, backend=backend, num_threads=num_threads)
    prepared.issue(stream=stream)
    return prepared.backend


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


def prepare_pack(
    k: torch.Tensor, v: torch.Tensor, pages: L.PageIndex, page_size: int, *,
    out: Optional[torch.Tensor] = None, backend: str = "auto", cuda_path: str = "auto",
    num_threads: Optional[int] = None, dry_run: bool = False,
) -> tuple[PreparedCopy, torch.Tensor]:
    """Validate and plan :func:`pack_pages` once: ``(plan, out)``; ``plan.issue()``
    fills ``out`` (allocated on ``k.device`` if not given).  Raises what
    :func:`pack_pages` raises.  O(n * layers)."""
    ps = L.check_page_size(page_size)
    g = L.check_kv(k, v, "")
    limit = L.check_slots(g, ps, "k")
    idx = L.as_index(pages, "pages")
    L.check_range(idx, limit, "pages")
    num_threads = _check_threads(num_threads)
    cuda_path = check_cuda_path(cuda_path)
    if out is None:
        L.check_backend(backend)
        out = torch.empty((idx.numel(), g.page_elems(ps)), dtype=g.dtype, device=g.device)
    L.check_staging(out, g, ps, idx.numel(), "out")
    named = {"k": k, "v": v, "out": out}
    chosen = "dry-run" if dry_run else resolve_backend(backend, named)
    plan = _staging_plan(g, ps, idx, L.buffer_side(k, v, ps, limit),
                         L.staging_side(out, g, ps), to_staging=True)
    staging = out

    def torch_run(span: tuple[int, int]) -> None:
        ref_pack_pages(k, v, idx, ps, staging)

    prepared = plan_copy(chosen, plan, (k, v), (out,), torch_run=torch_run, by_layer=False,
                         cuda_path=cuda_path, max_blocks=0, num_threads=num_threads,
                         dry_run=bool(dry_run))
    return prepared, out


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
    prepared, out = prepare_pack(k, v, pages, page_size, out=out, backend=backend,
                                 num_threads=num_threads)
    prepared.issue(stream=stream)
    return out


def prepare_unpack(
    staging: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: L.PageIndex,
    page_size: int, *, backend: str = "auto", cuda_path: str = "auto",
    num_threads: Optional[int] = None, dry_run: bool = False,
) -> PreparedCopy:
    """Validate and plan :func:`unpack_pages` once; ``issue()`` it later.
    Raises what :func:`unpack_pages` raises.  O(n * layers)."""
    ps = L.check_page_size(page_size)
    g = L.check_kv(k, v, "")
    limit = L.check_slots(g, ps, "k")
    idx = L.as_index(pages, "pages")
    L.check_range(idx, limit, "pages")
    L.check_unique(idx, "pages")
    num_threads = _check_threads(num_threads)
    cuda_path = check_cuda_path(cuda_path)
    L.check_staging(staging, g, ps, idx.numel(), "staging")
    named = {"staging": staging, "k": k, "v": v}
    chosen = "dry-run" if dry_run else resolve_backend(backend, named)
    plan = _staging_plan(g, ps, idx, L.buffer_side(k, v, ps, limit),
                         L.staging_side(staging, g, ps), to_staging=False)

    def torch_run(span: tuple[int, int]) -> None:
        ref_unpack_pages(staging, k, v, idx, ps)

    return plan_copy(chosen, plan, (staging,), (k, v), torch_run=torch_run, by_layer=False,
                     cuda_path=cuda_path, max_blocks=0, num_threads=num_threads,
                     dry_run=bool(dry_run))


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
    prepared = prepare_unpack(staging, k, v, pages, page_size, backend=backend,
                              num_threads=num_threads)
    prepared.issue(stream=stream)
    return prepared.backend


def _check_block_tensor(t: object, bd: object, i: int) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
    bd = check_int(bd, f"block_dims[{i}]", 0)
    if bd >= t.dim():
        raise ValueError(f"block_dims[{i}] is {bd} but tensors[{i}] has {t.dim()} dims")
    want = 1
    for n, st in zip(reversed(t.shape[bd + 1:]), reversed(t.stride()[bd + 1:])):
        if n > 1 and st != want:
            raise ValueError(f"tensors[{i}] must be dense after its block dim {bd} "
                             f"(shape {tuple(t.shape)}, strides {tuple(t.stride())})")
        want *= n
    return bd


def prepare_block_rows(
    tensors: Sequence[torch.Tensor], block_dims: Sequence[int], blocks: L.PageIndex,
    rows: torch.Tensor, *, to_rows: bool, backend: str = "auto",
    num_threads: Optional[int] = None, dry_run: bool = False,
) -> PreparedCopy:
    """Plan moving blocks of an engine's per-layer KV tensors to or from rows.

    Row ``i`` of ``rows`` (contiguous ``[n, *]``) is, tensor after tensor,
    the interior of block ``blocks[i]`` (``t.select(block_dims[j], b)`` in
    row-major order) of every tensor: a page payload.  ``to_rows``: gather
    the blocks into ``rows``; else scatter ``rows`` into the blocks
    (``blocks`` must not repeat).  Host <-> device runs on the copy engines,
    host <-> host in one C ``memcpy`` loop.  Validates everything first
    (``TypeError``/``ValueError`` naming the argument); mutates nothing.
    O(n * layers) numpy.
    """
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError("tensors must be a non-empty list of torch.Tensors")
    if not isinstance(block_dims, (list, tuple)) or len(block_dims) != len(tensors):
        raise ValueError(f"block_dims must list one block dim per tensor ({len(tensors)})")
    dims = [_check_block_tensor(t, bd, i) for i, (t, bd) in enumerate(zip(tensors, block_dims))]
    idx = L.as_index(blocks, "blocks")
    for i, (t, bd) in enumerate(zip(tensors, dims)):
        L.check_range(idx, int(t.shape[bd]), "blocks")
    if not to_rows:
        L.check_unique(idx, "blocks")
    num_threads = _check_threads(num_threads)
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.dim() != 2 or rows.shape[0] != idx.numel() or not rows.is_contiguous():
        raise ValueError(f"rows must be contiguous [{idx.numel()}, row elements], "
                         f"got shape {tuple(rows.shape)}")
    row_bytes = int(rows.shape[1]) * rows.element_size()
    named = {f"tensors[{i}]": t for i, t in enumerate(tensors)}
    named["rows"] = rows
    chosen = "dry-run" if dry_run else resolve_backend(backend, named)
    if chosen == "meta":
        runs = block_rows_runs([], [], idx.numpy(), 0, 0, to_rows=to_rows)
    else:
        runs = block_rows_runs(list(tensors), dims, idx.numpy(), rows.data_ptr(), row_bytes,
                               to_rows=to_rows)

    def torch_run(span: tuple[int, int]) -> None:
        flat = rows.view(torch.uint8).view(idx.numel(), row_bytes)
        on = idx.to(rows.device if to_rows else tensors[0].device)
        col = 0
        for t, bd in zip(tensors, dims):
            width = t[(slice(None),) * bd + (0,)].numel() * t.element_size()
            inner = list(t.shape)
            del inner[bd]
            part = flat[:, col:col + width]
            if to_rows:
                got = t.index_select(bd, on.to(t.device)).movedim(bd, 0).contiguous()
                part.copy_(got.view(torch.uint8).view(idx.numel(), width))
            else:
                vals = part.contiguous().view(t.dtype).view(idx.numel(), *inner)
                t.index_copy_(bd, on.to(t.device), vals.to(t.device).movedim(0, bd))
            col += width

    return plan_runs(chosen, runs, (*tensors, rows), torch_run=torch_run,
                     num_threads=num_threads, dry_run=bool(dry_run))
