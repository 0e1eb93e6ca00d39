"""Validation of KV buffers and page lists, and the backend-neutral copy plan.

Every public entry point of :mod:`hybridkv.transfer` runs its arguments
through this module before any backend touches memory, so all backends
reject the same bad inputs with the same messages and nothing is written
when an argument is wrong.

The KV buffer layout (fixed, shared with the pools) is, per attention kind::

    k: [num_layers, num_slots, num_kv_heads, k_head_dim]
    v: [num_layers, num_slots, num_kv_heads, v_head_dim]
    num_slots = num_pages * page_size;  slot of (page p, offset o) = p * page_size + o

or *paged* (the arena's views, :mod:`hybridkv.pools.buffers`), where pages
may be any distance apart::

    k: [num_layers, num_pages, page_size, num_kv_heads, k_head_dim]

The staging layout used by pack/unpack (the L3 value of one page) is
page-major: row ``i`` of a ``[n, page_elems]`` tensor holds K of all layers
(``[num_layers, page_size, heads, k_dim]``) followed by V of all layers
(``[num_layers, page_size, heads, v_dim]``), so one page is one contiguous
slice of ``page_elems * itemsize`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from .._validate import check_int

PageIndex = Union[torch.Tensor, np.ndarray, Sequence[int]]
MaskLike = Union[torch.Tensor, np.ndarray, Sequence[bool], None]

BACKENDS = ("auto", "torch", "host", "cuda")


@dataclass(frozen=True)
class KVGeometry:
    """Shape facts of one (k, v) buffer pair of one attention kind."""

    num_layers: int
    num_slots: int
    heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype
    device: torch.device
    paged: int = 0  # page size of a 5-D paged view (0: 4-D slot layout)

    def num_pages(self, page_size: int) -> int:
        return self.num_slots // page_size

    def page_elems(self, page_size: int) -> int:
        """Elements of one page of all layers, K then V (a staging row)."""
        return self.num_layers * page_size * self.heads * (self.k_dim + self.v_dim)


@dataclass(frozen=True)
class Side:
    """One side (source or destination) of a copy, in bytes.

    ``base[t]`` is the address of layer 0 / page 0 of tensor ``t`` (0 = K,
    1 = V); the address of (layer, page) is
    ``base[t] + layer * layer_stride[t] + page * page_stride[t]``.
    """

    base: tuple[int, int]
    layer_stride: tuple[int, int]
    page_stride: tuple[int, int]
    limit: int  # number of addressable pages


@dataclass(frozen=True)
class CopyPlan:
    """A validated page copy: what the host and CUDA kernels execute.

    ``src_idx`` / ``dst_idx`` are CPU int64 tensors (``None`` = identity),
    ``mask`` a CPU uint8 tensor or ``None``.
    """

    n_pages: int
    src_idx: Optional[torch.Tensor]
    dst_idx: Optional[torch.Tensor]
    mask: Optional[torch.Tensor]
    layer_begin: int
    layer_end: int
    run_bytes: tuple[int, int]
    src: Side
    dst: Side


def check_backend(backend: str) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def check_page_size(page_size: object) -> int:
    """``page_size`` as an int >= 1 (TypeError / ValueError otherwise).  O(1)."""
    return check_int(page_size, "page_size", 1)


def _check_inner_contiguous(t: torch.Tensor, name: str) -> None:
    # Pages are contiguous runs only if slots/heads/dim are dense; the layer
    # stride (and a paged view's page stride) may be anything.
    h, d = t.shape[-2], t.shape[-1]
    st = t.stride()
    if t.numel() and (st[-1] != 1 or st[-2] != d or st[-3] != h * d):
        raise ValueError(
            f"{name} must be contiguous in its last three dims "
            f"(strides {tuple(t.stride())}, shape {tuple(t.shape)})"
        )


def check_kv(k: object, v: object, prefix: str) -> KVGeometry:
    """Validate one (k, v) pair; ``prefix`` names the arguments ("src_", "")."""
    kn, vn = f"{prefix}k", f"{prefix}v"
    for t, n in ((k, kn), (v, vn)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() not in (4, 5):
            raise ValueError(
                f"{n} must be 4-D [layers, slots, heads, dim] or 5-D [layers, pages, page_size, "
                f"heads, dim], got shape {tuple(t.shape)}"
            )
    assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if k.dim() != v.dim():
        raise ValueError(f"{vn} has {v.dim()} dims but {kn} has {k.dim()}")
    if k.dtype != v.dtype:
        raise TypeError(f"{vn} dtype {v.dtype} differs from {kn} dtype {k.dtype}")
    if k.device != v.device:
        raise ValueError(f"{vn} device {v.device} differs from {kn} device {k.device}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"{vn} shape {tuple(v.shape)} must match {kn} shape {tuple(k.shape)} "
            "in layers, slots and heads"
        )
    _check_inner_contiguous(k, kn)
    _check_inner_contiguous(v, vn)
    paged = int(k.shape[2]) if k.dim() == 5 else 0
    slots = int(k.shape[1]) * paged if paged else int(k.shape[1])
    return KVGeometry(
        int(k.shape[0]), slots, int(k.shape[-2]), int(k.shape[-1]),
        int(v.shape[-1]), k.dtype, k.device, paged,
    )


def check_same_kind(src: KVGeometry, dst: KVGeometry) -> None:
    """Source and destination of a page copy must differ only in num_slots."""
    if src.dtype != dst.dtype:
        raise TypeError(f"dst_k dtype {dst.dtype} differs from src_k dtype {src.dtype}")
    for field in ("num_layers", "heads", "k_dim", "v_dim"):
        a, b = getattr(src, field), getattr(dst, field)
        if a != b:
            raise ValueError(f"dst {field} {b} differs from src {field} {a}")


def check_slots(geom: KVGeometry, page_size: int, name: str) -> int:
    if geom.paged and geom.paged != page_size:
        raise ValueError(f"{name} is paged with {geom.paged} tokens per page, not page_size {page_size}")
    if geom.num_slots % page_size:
        raise ValueError(
            f"{name} has {geom.num_slots} slots, not a multiple of page_size {page_size}"
        )
    return geom.num_slots // page_size


def as_index(pages: object, name: str) -> torch.Tensor:
    """Convert a page list to a 1-D CPU int64 tensor (copying only if needed)."""
    if isinstance(pages, torch.Tensor):
        t = pages
    elif isinstance(pages, np.ndarray):
        if pages.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {pages.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(pages, dtype=np.int64))
    elif isinstance(pages, (list, tuple, range)):
        if any(isinstance(p, bool) or not isinstance(p, (int, np.integer)) for p in pages):
            raise TypeError(f"{name} must be a sequence of ints")
        t = torch.tensor(list(pages), dtype=torch.int64)
    else:
        raise TypeError(
            f"{name} must be a torch.Tensor, numpy array or sequence of ints, "
            f"got {type(pages).__name__}"
        )
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.device.type == "meta":
        raise ValueError(f"{name} must hold real values, not a meta tensor")
    # A CUDA page list is copied to the host for validation (one sync); pass
    # CPU lists on hot paths.
    return t.to(device="cpu", dtype=torch.int64).contiguous()


def check_range(idx: torch.Tensor, limit: int, name: str) -> None:
    if idx.numel() == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds page {bad}, outside [0, {limit})")


def check_unique(idx: torch.Tensor, name: str) -> None:
    # Two entries writing one page would race in the parallel kernels (and
    # make the result order-dependent), so the write side must be a set.
    if idx.numel() > 1 and torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"{name} holds a page more than once")


def as_mask(mask: MaskLike, n: int) -> Optional[torch.Tensor]:
    """Validate an optional per-entry selection mask; returns CPU uint8 or None."""
    if mask is None:
        return None
    if isinstance(mask, np.ndarray):
        mask = torch.from_numpy(np.ascontiguousarray(mask))
    elif isinstance(mask, (list, tuple)):
        if any(not isinstance(m, (bool, np.bool_)) for m in mask):
            raise TypeError("mask must be a sequence of bools")
        mask = torch.tensor(list(mask), dtype=torch.bool)
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a bool tensor/array or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must have dtype bool, got {mask.dtype}")
    if mask.dim() != 1 or mask.numel() != n:
        raise ValueError(f"mask must be 1-D with {n} entries, got shape {tuple(mask.shape)}")
    return mask.to(device="cpu", dtype=torch.uint8).contiguous()


def check_layers(layers: object, num_layers: int) -> tuple[int, int]:
    """Validate an optional ``(begin, end)`` layer range; None means all."""
    if layers is None:
        return 0, num_layers
    if (
        not isinstance(layers, (tuple, list))
        or len(layers) != 2
        or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in layers)
    ):
        raise TypeError(f"layers must be None or a (begin, end) pair of ints, got {layers!r}")
    b, e = int(layers[0]), int(layers[1])
    if not 0 <= b <= e <= num_layers:
        raise ValueError(f"layers ({b}, {e}) must satisfy 0 <= begin <= end <= {num_layers}")
    return b, e


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` byte addresses that ``t``'s elements occupy."""
    es = t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return t.data_ptr(), t.data_ptr() + (last + 1) * es


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.device.type == "meta" or a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = _byte_span(a)
    b0, b1 = _byte_span(b)
    return a0 < b1 and b0 < a1


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device == b.device and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())


def check_no_alias(
    src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
    src_idx: torch.Tensor, dst_idx: torch.Tensor,
) -> None:
    """Source and destination must not overlap, except one buffer copied
    onto itself between disjoint page sets (e.g. compaction)."""
    for s, d in zip(src, dst):
        for other in src:
            if other is not s and _overlap(other, d):
                raise ValueError("a destination buffer overlaps a different source buffer")
        if not _overlap(s, d):
            continue
        if not _same_view(s, d):
            raise ValueError("source and destination buffers partially overlap in memory")
        if src_idx.numel() and dst_idx.numel() and bool(torch.isin(dst_idx, src_idx).any()):
            raise ValueError(
                "dst_pages overlap src_pages within the same buffer; the result "
                "would depend on copy order"
            )


def buffer_side(k: torch.Tensor, v: torch.Tensor, page_size: int, limit: int) -> Side:
    es = k.element_size()
    run_k = page_size * k.shape[-2] * k.shape[-1] * es
    run_v = page_size * v.shape[-2] * v.shape[-1] * es
    paged = k.dim() == 5
    return Side(
        base=(k.data_ptr(), v.data_ptr()),
        layer_stride=(k.stride(0) * es, v.stride(0) * es),
        page_stride=(k.stride(1) * es, v.stride(1) * es) if paged else (run_k, run_v),
        limit=limit,
    )


def staging_side(staging: torch.Tensor, geom: KVGeometry, page_size: int) -> Side:
    es = staging.element_size()
    run_k = page_size * geom.heads * geom.k_dim * es
    run_v = page_size * geom.heads * geom.v_dim * es
    page_bytes = geom.num_layers * (run_k + run_v)
    base = staging.data_ptr()
    return Side(
        base=(base, base + geom.num_layers * run_k),
        layer_stride=(run_k, run_v),
        page_stride=(page_bytes, page_bytes),
        limit=int(staging.shape[0]),
    )


def check_staging(
    staging: object, geom: KVGeometry, page_size: int, n: int, name: str
) -> torch.Tensor:
    """A staging tensor must be contiguous ``[n, page_elems]`` of the pool dtype."""
    if not isinstance(staging, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(staging).__name__}")
    want = (n, geom.page_elems(page_size))
    if tuple(staging.shape) != want:
        raise ValueError(f"{name} must have shape {want}, got {tuple(staging.shape)}")
    if staging.dtype != geom.dtype:
        raise TypeError(f"{name} dtype {staging.dtype} differs from pool dtype {geom.dtype}")
    if not staging.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return staging
