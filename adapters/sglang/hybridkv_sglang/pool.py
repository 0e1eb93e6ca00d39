"""SGLang's SWA allocator seen as a hybridkv page pool.

hybridkv's :class:`~hybridkv.radix.WindowSafeTree` gives pages back through
``free_full_trusted(pages)`` / ``free_swa_trusted(pages)`` (its ``PagePool``
protocol).  SGLang 0.5.23 keeps one token slot
per position in the full pool and reaches a position's SWA slot through the
allocator's ``full_to_swa_index_mapping`` (0 = no SWA peer).  This module keeps
the two views consistent:

* tree full page id  = full token slot // page_size (a request row's value);
* tree SWA page id   = SWA token slot  // page_size (the mapping's value);
* a tree page holds SWA  <=>  the mapping of its full slots is non-zero.

At ``page_size > 1`` SGLang's paged calls (``alloc_extend`` / ``alloc_decode``)
hand a request whole pages and page both pools in step, so slot ``i`` of full
page F maps to slot ``i`` of one SWA page S: the mapping is per token, the
pairing per page.  The pool reads a page's SWA from its first slot and always
writes and clears whole pages; :meth:`SGLangPagePool.mapping_mismatches` checks
every token of a page against that pairing.

The tree frees a node's SWA without its full KV (SWA-only eviction); the
mapping of that node's full slots must then read 0, or SGLang's kernels would
read a slot that now belongs to someone else.  The pool therefore remembers,
for every SWA page the tree owns, which full page it belongs to
(:attr:`SGLangPagePool.owner`) and clears that mapping when the SWA page goes.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from hybridkv.radix import OneWindowPool

__all__ = ["SGLangPagePool"]

logger = logging.getLogger(__name__)


def page_tokens(pages: np.ndarray | torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots of whole ``pages`` of SGLang's paged allocators (slot = page *
    ``page_size`` + offset), page after page: int64, ``len(pages) * page_size``.  O(n)."""
    p = torch.as_tensor(np.asarray(pages, dtype=np.int64)) if isinstance(pages, np.ndarray) else pages.long()
    if page_size == 1:
        return p
    return (p[:, None] * page_size + torch.arange(page_size, dtype=torch.int64)[None, :]).reshape(-1)


class SGLangPagePool(OneWindowPool):
    """Adapter from ``SWATokenToKVPoolAllocator`` to hybridkv's ``PagePool``.

    Args:
        allocator: SGLang's ``SWATokenToKVPoolAllocator`` (needs
            ``full_to_swa_index_mapping``, ``full_attn_allocator``,
            ``swa_attn_allocator``, ``page_size``, ``size_swa``).

    Only the tree calls :meth:`free_full_trusted` / :meth:`free_swa_trusted`, and only for pages
    it owns, so no page is ever freed twice through this object.
    """

    def __init__(self, allocator: Any) -> None:
        for attr in ("full_to_swa_index_mapping", "full_attn_allocator", "swa_attn_allocator", "page_size"):
            if not hasattr(allocator, attr):
                raise TypeError(f"allocator must be SGLang's SWATokenToKVPoolAllocator (no {attr!r}), "
                                f"got {type(allocator).__name__}")
        self.allocator = allocator
        self.page_size = int(allocator.page_size)
        swa_pages = int(allocator.size_swa) // self.page_size + 2
        #: full page id owning each tree-held SWA page, -1 if the tree holds none
        self.owner = np.full(swa_pages, -1, dtype=np.int64)
        self.freed_full_pages = 0
        self.freed_swa_pages = 0

    # ------------------------------------------------------------ helpers
    @property
    def mapping(self) -> torch.Tensor:
        return self.allocator.full_to_swa_index_mapping

    def tokens(self, pages: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Token slots of ``pages`` (int64, ``len(pages) * page_size``).  O(n)."""
        return page_tokens(pages, self.page_size)

    def swa_pages_of(self, full_pages: np.ndarray) -> np.ndarray:
        """Current SWA page of each full page from SGLang's mapping, -1 where none.  O(n)."""
        if full_pages.size == 0:
            return np.zeros(0, dtype=np.int32)
        firsts = torch.as_tensor(full_pages.astype(np.int64) * self.page_size)
        swa = self.mapping[firsts].cpu().numpy()
        return np.where(swa > 0, swa // self.page_size, -1).astype(np.int32)

    def mapping_mismatches(self, full_pages: np.ndarray, swa_pages: np.ndarray) -> np.ndarray:
        """Indices into ``full_pages`` whose mapping, token by token, is not the
        tree's: slot ``i`` of ``full_pages[k]`` must map to slot ``i`` of
        ``swa_pages[k]`` (0 where ``swa_pages[k] == -1``).  O(n * page_size)."""
        if full_pages.size == 0:
            return np.zeros(0, dtype=np.int64)
        swa = np.asarray(swa_pages, dtype=np.int64)
        want = self.tokens(np.maximum(swa, 0)).view(-1, self.page_size)
        want[torch.as_tensor(swa < 0)] = 0
        got = self.mapping[self.tokens(full_pages)].view(-1, self.page_size).to(want.dtype)
        return np.flatnonzero((got != want).any(dim=1).cpu().numpy())

    def adopt(self, full_pages: np.ndarray, swa_pages: np.ndarray) -> None:
        """Make SGLang's mapping agree with the tree for these (full, swa) pairs.

        ``swa_pages[i] == -1`` clears the mapping of ``full_pages[i]``.  Records
        the owner of every SWA page.  O(n) vectorised.
        """
        if full_pages.size == 0:
            return
        held = swa_pages >= 0
        self.owner[swa_pages[held]] = full_pages[held]
        toks = self.tokens(full_pages)
        if held.all():
            self.mapping[toks] = self.tokens(swa_pages)
            return
        vals = torch.zeros(toks.numel(), dtype=self.mapping.dtype)
        if held.any():
            rows = torch.as_tensor(np.repeat(held, self.page_size))
            vals[rows] = self.tokens(swa_pages[held]).to(vals.dtype)
        self.mapping[toks] = vals

    # ------------------------------------------------------------ PagePool
    def free_full_trusted(self, pages: np.ndarray) -> None:
        """Return full pages to SGLang.  Their mapping is cleared first: any SWA the
        tree held for them is freed by :meth:`free_swa_trusted` in the same tree call or
        was adopted onto another full page.  O(n)."""
        if pages.size == 0:
            return
        pages64 = torch.as_tensor(pages.astype(np.int64))
        self.mapping.index_fill_(0, self.tokens(pages64), 0)
        # page ids straight to SGLang's free list (at page size 1 they are the slots)
        self.allocator.full_attn_allocator.free_page_ids(pages64)
        self.freed_full_pages += int(pages.size)

    def free_swa_trusted(self, pages: np.ndarray) -> None:
        """Return SWA pages to SGLang and clear the mapping of their owners.  O(n)."""
        if pages.size == 0:
            return
        pages64 = pages.astype(np.int64)
        owners = self.owner[pages64]
        self.owner[pages64] = -1
        known = owners >= 0
        if known.any():
            # Clear only where the owner still points at this very page: a full page
            # freed earlier in the same call (free_full_trusted) already reads 0.
            own = owners[known]
            firsts = torch.as_tensor(own * self.page_size)
            still = (self.mapping[firsts] // self.page_size).cpu().numpy() == pages64[known]
            if still.any():
                self.mapping.index_fill_(0, self.tokens(own[still]), 0)
        if (~known).any():
            logger.warning("hybridkv: %d SWA pages freed without a recorded owner", int((~known).sum()))
        self.allocator.swa_attn_allocator.free_page_ids(torch.as_tensor(pages64))
        self.freed_swa_pages += int(pages.size)

    def reset(self) -> None:
        """Forget every owner (SGLang cleared its allocator).  O(n)."""
        self.owner.fill(-1)
