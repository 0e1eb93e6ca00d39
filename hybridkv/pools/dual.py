"""Dual Full/SWA page pools with admission on both.

SGLang vocabulary: the *full pool* holds KV of full-attention layers for every
cached token; the *SWA pool* holds KV of sliding-window layers only where a
window is needed.  The full page id is a sequence's logical identity; SWA
pages are reached through the tree node or request that owns them, never
through a global full->SWA table (a stale table is how peers freed live slots).

Two budgeting modes:

* **fixed split** (``full_pages`` and ``swa_pages``): each pool has its own
  capacity, as when an engine pre-allocates two tensors;
* **shared byte budget** (``budget_bytes``): both pools draw from one byte
  budget, so memory flows to whichever kind the retention policy needs.

With a real device the memory is ONE :class:`~hybridkv.pools.buffers.KVArena`
in both modes: a block pool of ``budget_bytes // block_bytes`` blocks whose
blocks back pages of either kind (vLLM's hybrid allocator); a page of a kind
costs ``blocks_per_page * block_bytes`` (:class:`~hybridkv.pools.arena.ArenaLayout`),
so the arena never holds more than the budget and memory moves between kinds
one block at a time without reallocating.  On the ``meta`` device (and with
``device=None``) there is no memory: exact accounting at the model's page
bytes, for replays.

Invariant: ``used_bytes() <= budget_bytes`` and each allocator within capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .._validate import as_int_array, check_int
from ..spec import AttnKind, ModelSpec
from .allocator import PageAllocator
from .arena import ArenaLayout
from .buffers import KVArena
from .groups import GroupPages

__all__ = ["DualPool", "PoolStats", "check_device"]


def check_device(device: object) -> torch.device | None:
    """``device`` as a torch.device (None stays None); a clear error for a
    device that does not exist here (``"gpu"``, ``"cuda"`` without CUDA)."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device must be 'meta', 'cpu' or 'cuda[:N]', got {device!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available here "
                             "(use device='cpu', or 'meta' for accounting only)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    elif dev.type not in ("cpu", "meta"):
        raise ValueError(f"device must be 'meta', 'cpu' or 'cuda[:N]', got {device!r}")
    return dev


@dataclass(frozen=True)
class PoolStats:
    full_used_pages: int
    full_capacity_pages: int
    swa_used_pages: int
    swa_capacity_pages: int
    used_bytes: int
    budget_bytes: int


class DualPool:
    """A Full pool and a SWA pool for one model.

    Args:
        spec: model description (page size, bytes per page of each kind).
        full_pages / swa_pages: capacities in pages (fixed split).  Optional
            with ``budget_bytes``, where they default to what the budget could
            hold of each kind.
        budget_bytes: shared byte budget over both pools (None: sum of the two
            fixed capacities).
        device: where KV buffers live: ``"meta"`` (accounting only, the
            default), ``"cpu"``, ``"cuda"``...; ``None`` allocates no buffers.
    """

    def __init__(self, spec: ModelSpec, *, full_pages: int | None = None,
                 swa_pages: int | None = None, budget_bytes: int | None = None,
                 device: str | torch.device | None = "meta", pin: bool = False) -> None:
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
        for name, value in (("full_pages", full_pages), ("swa_pages", swa_pages),
                            ("budget_bytes", budget_bytes)):
            if value is not None:
                check_int(value, name, minimum=0)
        dev = check_device(device)
        self.spec = spec
        real = dev is not None and dev.type != "meta"
        self.layout: ArenaLayout | None = ArenaLayout.for_spec(spec) if real else None
        if self.layout is not None:
            self.full_page_bytes = self.layout.page_bytes(AttnKind.FULL)
            self.swa_page_bytes = self.layout.page_bytes(AttnKind.SWA)
        else:
            self.full_page_bytes = spec.bytes_per_page(AttnKind.FULL)
            self.swa_page_bytes = spec.bytes_per_page(AttnKind.SWA)
        if budget_bytes is None:
            if full_pages is None or swa_pages is None:
                raise ValueError("give budget_bytes, or both full_pages and swa_pages")
            budget_bytes = full_pages * self.full_page_bytes + swa_pages * self.swa_page_bytes
        if self.layout is not None:  # the arena holds whole blocks only
            budget_bytes -= budget_bytes % self.layout.block_bytes
        # a kind the model lacks (no layers) costs nothing: as many ids as the other kind
        if full_pages is None and self.full_page_bytes:
            full_pages = budget_bytes // self.full_page_bytes
        if swa_pages is None:
            swa_pages = budget_bytes // self.swa_page_bytes if self.swa_page_bytes else full_pages or 0
        if full_pages is None:
            full_pages = swa_pages
        # several sliding groups: the lead (largest window) owns the SWA ids, the
        # others hold their pages per id (GroupPages) and give them back sooner
        sliding = spec.sliding_groups
        others = []
        for i, group in enumerate(sliding[:-1]):
            gb = self.layout.group_page_bytes(i) if self.layout is not None else spec.group_page_bytes(group)
            others.append(GroupPages(group, i, gb, group.window_pages(spec.page_size)))
        self.groups: tuple[GroupPages, ...] = tuple(others)
        self._group_bytes = sum(g.page_bytes for g in others)  # of a fresh SWA page
        self.lead_page_bytes = self.swa_page_bytes - self._group_bytes
        self._group_used = 0  # bytes the other groups hold
        self.budget_bytes = int(budget_bytes)
        self.shared = self.budget_bytes < (full_pages * self.full_page_bytes
                                           + swa_pages * self.swa_page_bytes)
        self.full = PageAllocator(int(full_pages), "full")
        self.swa = PageAllocator(int(swa_pages), "swa")
        self.buffers: KVArena | None = None
        if dev is not None:
            layout = self.layout or ArenaLayout.for_spec(spec)
            blocks = self.budget_bytes // layout.block_bytes if real else 0
            self.buffers = KVArena(spec, layout, blocks, int(full_pages) if real else 0,
                                   int(swa_pages) if real else 0, dev, pin=pin)
        self._arena = self.buffers if real else None

    # ---------------------------------------------------------------- queries
    def used_bytes(self) -> int:
        return (self.full.num_used * self.full_page_bytes + self.swa.num_used * self.lead_page_bytes
                + self._group_used)

    def free_bytes(self) -> int:
        # used_bytes() inlined (the cache asks at every chunk): no property calls
        return (self.budget_bytes - self.full.used * self.full_page_bytes
                - self.swa.used * self.lead_page_bytes - self._group_used)

    def shortfall(self, n_full: int, n_swa: int) -> tuple[int, int, int]:
        """What must be freed before ``alloc(n_full, n_swa)`` can succeed.

        Returns ``(full_pages, swa_pages, bytes)``: pages missing in each
        pool's capacity and bytes missing in the shared budget (all >= 0).
        """
        need_full = max(0, n_full - self.full.num_free)
        need_swa = max(0, n_swa - self.swa.num_free)
        need_bytes = max(0, n_full * self.full_page_bytes + n_swa * self.swa_page_bytes - self.free_bytes())
        return need_full, need_swa, need_bytes

    def can_alloc(self, n_full: int, n_swa: int) -> bool:
        return self.shortfall(n_full, n_swa) == (0, 0, 0)

    # -------------------------------------------------------------- mutation
    def alloc(self, n_full: int, n_swa: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Allocate pages in both pools atomically; None (nothing changed) if short.  O(n)."""
        check_int(n_full, "n_full", minimum=0)
        check_int(n_swa, "n_swa", minimum=0)
        return self.take(n_full, n_swa)

    def take(self, n_full: int, n_swa: int) -> tuple[np.ndarray, np.ndarray] | None:
        """:meth:`alloc` without argument checks (ints >= 0 already checked), for the
        cache, which allocates per chunk of every request.  O(n)."""
        fa, sa = self.full, self.swa
        used_f, used_s = fa.used, sa.used
        fb, sb = self.full_page_bytes, self.lead_page_bytes
        # can_alloc, inlined: this runs for every chunk of every request
        if (n_full > fa.capacity - used_f or n_swa > sa.capacity - used_s
                or ((n_full + used_f) * fb + (n_swa + used_s) * sb + n_swa * self._group_bytes
                    + self._group_used > self.budget_bytes)):
            return None
        full = fa.take(n_full)
        swa = sa.take(n_swa)
        if self.groups:
            for g in self.groups:
                g.take(swa)
            self._group_used += n_swa * self._group_bytes
        if self._arena is not None:
            self._arena.assign(AttnKind.FULL, full)
            self._arena.assign(AttnKind.SWA, swa)
        return full, swa

    def free_full(self, pages: object) -> None:
        """Free full pages (validated; raises ValueError and frees nothing on bad ids)."""
        self.full.free(pages)
        if self._arena is not None:
            self._arena.release(AttnKind.FULL, np.asarray(pages, dtype=np.int64))

    def free_swa(self, pages: object) -> None:
        """Free SWA pages only (validated as for :meth:`free_full`)."""
        self.swa.free(pages)
        ids = np.asarray(pages, dtype=np.int64)
        if self.groups:
            self._free_groups(ids)
        if self._arena is not None:
            self._arena.release(AttnKind.SWA, ids)

    def free_full_trusted(self, pages: np.ndarray) -> None:
        """:meth:`free_full` for the tree and the cache, which free only pages they
        own (allocated, distinct int32 ids): no checks.  O(n)."""
        self.full.free_trusted(pages)
        if self._arena is not None:
            self._arena.release(AttnKind.FULL, pages)

    def free_swa_trusted(self, pages: np.ndarray) -> None:
        """:meth:`free_swa` without checks (see :meth:`free_full_trusted`)."""
        self.swa.free_trusted(pages)
        if self.groups:
            self._free_groups(pages)
        if self._arena is not None:
            self._arena.release(AttnKind.SWA, pages)

    def _free_groups(self, pages: np.ndarray) -> None:
        for g in self.groups:
            self._group_used -= g.free(pages).size * g.page_bytes

    # ------------------------------------------------------- sliding groups
    def release_group(self, group: GroupPages, pages: object) -> int:
        """Give back ``group``'s storage of SWA ``pages`` (ids stay allocated for
        the lead group); ids it no longer holds are skipped.  Returns pages given
        back.  Raises TypeError / ValueError (nothing given back) for a group of
        another pool or ids the lead group has not allocated.  O(n)."""
        if not any(group is g for g in self.groups):
            raise TypeError(f"group must be one of this pool's groups {[g.group.name for g in self.groups]}, "
                            f"got {group!r}")
        ids = as_int_array(pages, "pages")
        if not self.swa.is_allocated(ids).all():
            raise ValueError("pages must be allocated SWA page ids")
        return self.release_group_trusted(group, ids.astype(np.int64))

    def release_group_trusted(self, group: GroupPages, pages: np.ndarray) -> int:
        """:meth:`release_group` for the cache, which gives back only pages of its
        own requests (allocated ids of one of the pool's groups): no checks.  O(n)."""
        got = group.free(pages)
        self._group_used -= got.size * group.page_bytes
        if self._arena is not None and got.size:
            self._arena.release_group(group.index, got)
        return int(got.size)

    def held_by_all(self, pages: np.ndarray) -> np.ndarray:
        """bool per SWA id of ``pages`` (``-1``: not held): every sliding group
        holds its KV (what a tier may copy); ``pages >= 0`` with one sliding group.
        O(n x groups)."""
        held = np.asarray(pages) >= 0
        for g in self.groups:
            held &= g.holds(pages)
        return held

    def check_taken(self, kind: str, pages: np.ndarray, name: str) -> None:
        """Raise ValueError naming ``name`` unless every id of ``pages`` is
        allocated in the ``kind`` (``"full"`` / ``"swa"``) pool and listed once
        (what the tree checks before it takes pages from a public insert).  O(n)."""
        alloc = self.full if kind == "full" else self.swa
        if pages.size == 0:
            return
        if not alloc.is_allocated(pages).all():
            raise ValueError(f"{name} holds ids that are not allocated in the {kind} pool")
        if pages.size > 1 and alloc.has_repeats(pages):
            raise ValueError(f"{name} holds repeated ids")

    def tensor_bytes(self) -> int:
        """Bytes of every KV tensor this pool allocated (0 on ``meta``)."""
        return self._arena.nbytes if self._arena is not None else 0

    def stats(self) -> PoolStats:
        return PoolStats(self.full.num_used, self.full.capacity, self.swa.num_used,
                         self.swa.capacity, self.used_bytes(), self.budget_bytes)

    def check_invariants(self) -> None:
        """Verify both allocators and the byte budget; AssertionError on failure."""
        self.full.check_invariants()
        self.swa.check_invariants()
        swa_used = self.swa.used_ids()
        for g in self.groups:
            g.check_invariants(swa_used)
        assert self._group_used == sum(g.used * g.page_bytes for g in self.groups)
        assert self.used_bytes() <= self.budget_bytes, (self.used_bytes(), self.budget_bytes)
        if self._arena is not None:
            held = [g.holds(swa_used) for g in self.groups] + [np.ones(swa_used.size, bool)]
            self._arena.check_invariants(self.full.used_ids(), swa_used, held if self.groups else None)
            assert self._arena.nbytes <= self.budget_bytes
