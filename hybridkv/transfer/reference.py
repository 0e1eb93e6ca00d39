"""Torch reference for page copy / pack / unpack: the fallback and the oracle.

Deliberately plain: each operation is one advanced-indexing assignment per
tensor over a ``[layers, pages, page_elems]`` view, which torch executes as a
bulk gather/scatter (no Python loop over pages or tokens).  The C host and
CUDA kernels are tested bitwise against these functions.

Callers must validate first (see :mod:`hybridkv.transfer._layout`); these
functions assume valid, in-range, duplicate-free destination indices.
"""

from __future__ import annotations

from typing import Optional

import torch


def _paged(t: torch.Tensor, page_size: int) -> torch.Tensor:
    """View ``[L, slots, H, D]`` as ``[L, pages, page_size*H*D]`` (no copy)."""
    if t.dim() == 5:  # already paged (an arena view): pages may be strided
        return t.view(t.shape[0], t.shape[1], -1)
    layers, slots, heads, dim = t.shape
    return t.view(layers, slots // page_size, page_size * heads * dim)


def _select(idx: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    return idx if mask is None else idx[mask.to(torch.bool)]


def ref_copy_pages(
    src_k: torch.Tensor, src_v: torch.Tensor,
    dst_k: torch.Tensor, dst_v: torch.Tensor,
    src_idx: torch.Tensor, dst_idx: torch.Tensor, page_size: int,
    mask: Optional[torch.Tensor] = None, layers: tuple[int, int] = (0, -1),
) -> None:
    """``dst[l, dst_idx[i]] = src[l, src_idx[i]]`` for l in ``layers``, K and V.

    Mutates ``dst_k`` / ``dst_v``.  O(n * layers * page bytes).
    """
    src_idx, dst_idx = _select(src_idx, mask), _select(dst_idx, mask)
    begin, end = layers
    if end < 0:
        end = src_k.shape[0]
    if src_idx.numel() == 0 or end == begin:
        return
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        s, d = _paged(src, page_size), _paged(dst, page_size)
        rows = s[begin:end, src_idx.to(src.device)]
        d[begin:end, dst_idx.to(dst.device)] = rows.to(dst.device)


def ref_pack_pages(
    k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, page_size: int,
    out: torch.Tensor,
) -> None:
    """``out[i] = K[:, idx[i]] ++ V[:, idx[i]]`` (page-major staging rows).

    ``out`` is ``[n, page_elems]``; mutates it.  O(n * page bytes).
    """
    n, layers = idx.numel(), k.shape[0]
    if n == 0:
        return
    k_elems = layers * page_size * k.shape[-2] * k.shape[-1]
    out_k = out[:, :k_elems].view(n, layers, -1)
    out_v = out[:, k_elems:].view(n, layers, -1)
    for src, o in ((k, out_k), (v, out_v)):
        rows = _paged(src, page_size)[:, idx.to(src.device)]  # [L, n, run]
        o.copy_(rows.transpose(0, 1))


def ref_unpack_pages(
    staging: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
    page_size: int,
) -> None:
    """Inverse of :func:`ref_pack_pages`: ``K[:, idx[i]], V[:, idx[i]] = staging[i]``.

    Mutates ``k`` / ``v``.  O(n * page bytes).
    """
    n, layers = idx.numel(), k.shape[0]
    if n == 0:
        return
    k_elems = layers * page_size * k.shape[-2] * k.shape[-1]
    st_k = staging[:, :k_elems].view(n, layers, -1)
    st_v = staging[:, k_elems:].view(n, layers, -1)
    for dst, s in ((k, st_k), (v, st_v)):
        _paged(dst, page_size)[:, idx.to(dst.device)] = s.transpose(0, 1).to(dst.device)
