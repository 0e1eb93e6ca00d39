"""Byte runs: a validated page copy as the list of contiguous copies it is.

A :class:`~hybridkv.transfer._layout.CopyPlan` moves, for every selected
entry, layer and tensor (K, V), one contiguous run of ``run_bytes[t]``
bytes.  The copy engines take such a list directly (one batched call), so a
plan is turned into three parallel ``uint64`` arrays ``(dst, src, size)``,
with neighbouring runs merged wherever both sides are contiguous (whole
arena blocks, consecutive pages).  Runs are grouped by layer (``by_layer``:
one group per layer, what a layerwise load issues one at a time) or form one
group.  Everything here is numpy over all runs at once; no per-run Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ._layout import CopyPlan

__all__ = ["Runs", "build_runs", "coalesce"]


@dataclass(frozen=True)
class Runs:
    """Runs of one plan: group ``g`` is ``[offsets[g], offsets[g + 1])``.

    ``dst``, ``src``, ``size`` are C-contiguous ``uint64`` arrays (addresses
    and byte counts), the layout ``hkv_cuda_copy_runs`` reads.
    """

    dst: np.ndarray
    src: np.ndarray
    size: np.ndarray
    offsets: np.ndarray  # int64 [groups + 1]

    @property
    def count(self) -> int:
        return int(self.size.size)

    @property
    def nbytes(self) -> int:
        return int(self.size.sum()) if self.size.size else 0

    def group_args(self, g: int) -> tuple[int, int, int, int]:
        """``(dst address, src address, size address, count)`` of group ``g``:
        the run-array arguments of one batched call.  O(1)."""
        a, b = int(self.offsets[g]), int(self.offsets[g + 1])
        return (self.dst.ctypes.data + 8 * a, self.src.ctypes.data + 8 * a,
                self.size.ctypes.data + 8 * a, b - a)


def coalesce(dst: np.ndarray, src: np.ndarray, size: np.ndarray,
             starts: Optional[np.ndarray] = None) -> tuple[np.ndarray, ...]:
    """Merge run ``i`` into run ``i - 1`` where both its source and its
    destination begin where the previous run's end, never across a group
    boundary (``starts``: indices where groups begin).  Returns ``(dst, src,
    size, group_starts)`` of the merged runs.  O(n)."""
    n = size.size
    if n == 0:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty, np.zeros(0, dtype=np.int64)
    head = np.ones(n, dtype=bool)
    head[1:] = (src[1:] != src[:-1] + size[:-1]) | (dst[1:] != dst[:-1] + size[:-1])
    if starts is not None and starts.size:
        head[starts] = True
    first = np.flatnonzero(head)
    merged = np.add.reduceat(size, first).astype(np.uint64)
    group_first = (np.searchsorted(first, starts) if starts is not None
                   else np.zeros(1, dtype=np.int64))
    return (np.ascontiguousarray(dst[first]), np.ascontiguousarray(src[first]), merged,
            group_first.astype(np.int64))


# Axis orders tried (names: e = entry, l = layer, t = tensor); the one that
# leaves the fewest runs wins.  Arena blocks hold a page's layers as K, V
# slots side by side (entry-major merges whole blocks); separate K and V
# buffers of [layers, slots, ...] merge consecutive pages (tensor-major).
_WHOLE_ORDERS = ("elt", "tle", "let")
_LAYER_ORDERS = ("let", "lte")


def _entry_addresses(plan: CopyPlan, entries: np.ndarray, idx: Optional[object],
                     side: str) -> np.ndarray:
    """``[n, 2]`` addresses of layer 0 of each selected entry, K and V."""
    s = getattr(plan, side)
    pages = entries if idx is None else idx.numpy()[entries]  # type: ignore[attr-defined]
    pages = pages.astype(np.uint64)
    base = np.array(s.base, dtype=np.uint64)
    stride = np.array(s.page_stride, dtype=np.uint64)
    return base[None, :] + pages[:, None] * stride[None, :]


def build_runs(plan: CopyPlan, *, src_base: Optional[tuple[int, int]] = None,
               dst_base: Optional[tuple[int, int]] = None, by_layer: bool = False) -> Runs:
    """The runs of ``plan`` (its mask applied), coalesced.

    ``src_base`` / ``dst_base`` replace the plan's bases (e.g. with mapped
    device addresses); offsets inside each side are kept.  ``by_layer``: one
    group per layer of ``[layer_begin, layer_end)``, else one group.
    O(entries * layers) numpy.
    """
    n_layers = plan.layer_end - plan.layer_begin
    entries = np.arange(plan.n_pages, dtype=np.int64)
    if plan.mask is not None:
        entries = entries[plan.mask.numpy().astype(bool)]
    run = np.array(plan.run_bytes, dtype=np.uint64)
    # [n, 2] entry addresses, then [n, layers, 2] with the layer offsets
    src = _entry_addresses(plan, entries, plan.src_idx, "src")
    dst = _entry_addresses(plan, entries, plan.dst_idx, "dst")
    if src_base is not None:
        src = src - np.array(plan.src.base, dtype=np.uint64) + np.array(src_base, dtype=np.uint64)
    if dst_base is not None:
        dst = dst - np.array(plan.dst.base, dtype=np.uint64) + np.array(dst_base, dtype=np.uint64)
    layer = np.arange(plan.layer_begin, plan.layer_end, dtype=np.uint64)
    s_ls = np.array(plan.src.layer_stride, dtype=np.uint64)
    d_ls = np.array(plan.dst.layer_stride, dtype=np.uint64)
    src3 = src[:, None, :] + layer[None, :, None] * s_ls[None, None, :]
    dst3 = dst[:, None, :] + layer[None, :, None] * d_ls[None, None, :]
    size3 = np.broadcast_to(run[None, None, :], src3.shape)
    keep = run > 0  # a tensor with no bytes (e.g. a zero-width V) has no runs
    best: Optional[tuple[np.ndarray, ...]] = None
    for order in (_LAYER_ORDERS if by_layer else _WHOLE_ORDERS):
        perm = tuple("elt".index(a) for a in order)
        s_, d_, z_ = (np.transpose(a, perm) for a in (src3, dst3, size3))
        if not keep.all():
            tsel = (slice(None),) * order.index("t") + (keep,)
            s_, d_, z_ = s_[tsel], d_[tsel], z_[tsel]
        s_, d_, z_ = (np.ascontiguousarray(a).reshape(-1) for a in (s_, d_, z_))
        per_layer = s_.size // n_layers if n_layers else 0
        starts = (np.arange(n_layers, dtype=np.int64) * per_layer if by_layer
                  else np.zeros(1, dtype=np.int64))
        got = coalesce(d_, s_, z_, starts if s_.size else None)
        if best is None or got[2].size < best[2].size:
            best = got
    assert best is not None
    d_, s_, z_, first = best
    groups = n_layers if by_layer else 1
    offsets = np.empty(groups + 1, dtype=np.int64)
    if z_.size:
        offsets[:groups] = first
    else:
        offsets[:groups] = 0
    offsets[groups] = z_.size
    return Runs(d_, s_, z_, offsets)


def block_rows_runs(tensors: list, block_dims: list[int], blocks: np.ndarray, rows_base: int,
                    row_bytes: int, *, to_rows: bool) -> Runs:
    """Runs between blocks of arbitrary strided tensors and page-major rows.

    Row ``i`` is, tensor after tensor, the interior of block ``blocks[i]`` of
    each tensor in row-major order (``t.select(block_dim, b)`` flattened):
    the layout an engine's per-layer KV tensors give a page payload.  Every
    dimension after a tensor's block dimension must be dense (one contiguous
    chunk per index of the dimensions before it).  ``to_rows``: blocks ->
    rows (gather) else rows -> blocks (scatter).  One group.  O(blocks *
    chunks) numpy.
    """
    blocks = np.asarray(blocks, dtype=np.uint64)
    src_parts, dst_parts, size_parts = [], [], []
    col = 0
    row_of = np.arange(blocks.size, dtype=np.uint64) * np.uint64(row_bytes) + np.uint64(rows_base)
    for t, bd in zip(tensors, block_dims):
        es = t.element_size()
        inner = int(np.prod(t.shape[bd + 1:], dtype=np.int64)) * es
        outer_shape = t.shape[:bd]
        # byte offsets of each outer index, row-major
        offs = np.zeros(1, dtype=np.uint64)
        for n, st in zip(outer_shape, t.stride()[:bd]):
            offs = (offs[:, None] + np.arange(n, dtype=np.uint64)[None, :] * np.uint64(st * es)).reshape(-1)
        block_addr = np.uint64(t.data_ptr()) + blocks * np.uint64(t.stride(bd) * es)
        a = (block_addr[:, None] + offs[None, :]).reshape(-1)
        r = (row_of[:, None] + np.uint64(col)
             + np.arange(offs.size, dtype=np.uint64)[None, :] * np.uint64(inner)).reshape(-1)
        src_parts.append(a if to_rows else r)
        dst_parts.append(r if to_rows else a)
        size_parts.append(np.full(a.size, inner, dtype=np.uint64))
        col += offs.size * inner
    if col != row_bytes:
        raise ValueError(f"rows hold {row_bytes} bytes per block but the tensors' blocks are {col}")
    # block-major order: row i's pieces side by side (they merge into one run
    # wherever a block's interiors are adjacent in the tensors too)
    if not tensors or blocks.size == 0:
        empty = np.zeros(0, dtype=np.uint64)
        return Runs(empty, empty, empty, np.zeros(2, dtype=np.int64))
    order = lambda parts: np.concatenate(  # noqa: E731
        [p.reshape(blocks.size, -1) for p in parts], axis=1).reshape(-1)
    d, s, z, _ = coalesce(order(dst_parts), order(src_parts), order(size_parts))
    return Runs(d, s, z, np.array([0, z.size], dtype=np.int64))
