"""L2: a host-memory page cache in the worker, in front of the L3 backend.

Index, budget and eviction are hybridkv's :class:`~hybridkv.tiers.host.HostTier`
(chained page keys, full pages and SWA pages with their own validity, plain SWA
evicted before full, tail/checkpoint SWA windows last).  Every saved SWA window
enters anchored; when a request finishes, the scheduler names the anchored windows
its sequence moved past (neither its tail, a checkpoint nor its hit's window) and
both the worker's L2 and the scheduler's mirror demote them to plain SWA at the
same point of their sequence of stores (the save job that carries them).

A window goes with its full KV, by the core L2's own rule: each stored SWA page may
name the full page holding its last token (its *base*, :func:`.plan.full_bases`);
when L2 evicts or discards a full page, the SWA pages of every sliding group based
on it leave too (a hit needs the full KV of its whole prefix: a window without it
buys little from L2).  An SWA page whose base L2 does not hold when it is stored
enters plain, not anchored.  The HostTier runs in
accounting mode (``device="meta"``); the page bytes live here, in one uint8
row per host page, because a vLLM page is an opaque ``page_bytes`` blob (all
layers of one KV-cache group for one block) rather than hybridkv's
per-layer K/V layout.

vLLM gives every KV-cache group the same page bytes (it changes block sizes to
get there), so one row size serves every group; the group identity is in the
key (per-group fingerprint), so groups never collide.

Memory: ``torch.empty`` rows (untouched rows are not resident); resident
bytes stay within ``budget_bytes`` plus the pages HostTier has freed but the
allocator has not reused yet.  Thread-safe: one lock serialises every call
(the worker's execute thread loads, its save thread stores);
:meth:`HostPageCache.fetch` looks up and copies under one hold, so a page
cannot be evicted and reused between the two.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

import numpy as np
import torch

from hybridkv.spec import AttnKind, KVShape, ModelSpec
from hybridkv.tiers.host import HostTier

__all__ = ["HostPageCache", "HostPageIndex"]


class HostPageIndex:
    """Which pages an L2 holds and what it evicts, without the page bytes.

    The worker's :class:`HostPageCache` indexes its rows with one; the scheduler
    side keeps another, fed with the same stores and lookups, to tell which of a
    hit's pages the worker will read from L2 (:mod:`.sources`).  Not thread-safe.

    Pairing SWA pages with their base full page is the core L2's own
    (:attr:`HostTier.pair_swa <hybridkv.tiers.host.HostTier.pair_swa>`: set it
    ``False`` to keep every window anchored until its own eviction, for comparisons;
    the bases are still recorded: :meth:`base_of`).

    Args:
        page_bytes: bytes of one page (one block of every layer of a group); > 0, even.
        budget_bytes: host bytes for full and SWA pages together (> 0).
        window: the smallest sliding window of the model (informational for the spec).
    """

    def __init__(self, page_bytes: int, budget_bytes: int, window: int) -> None:
        if page_bytes < 4 or page_bytes % 2:
            raise ValueError(f"page_bytes must be a positive even int, got {page_bytes}")
        if budget_bytes < page_bytes:
            raise ValueError(f"budget_bytes ({budget_bytes}) must hold at least one page "
                             f"of {page_bytes} bytes")
        elems = page_bytes // 2
        # One "layer" of each kind, 1 token per page, 2-byte elements: the spec's
        # bytes_per_page equals page_bytes, so HostTier's byte budget is exact.
        shape = KVShape(1, elems // 2, elems - elems // 2)
        spec = ModelSpec(name="vllm-page", layer_kinds=(AttnKind.FULL, AttnKind.SWA),
                         window=max(1, int(window)), full=shape, swa=shape, dtype="float16",
                         page_size=1)
        assert spec.bytes_per_page(AttnKind.FULL) == page_bytes
        self.page_bytes = int(page_bytes)
        self.budget_bytes = int(budget_bytes)
        self.tier = HostTier(spec, int(budget_bytes), device="meta")

    def base_of(self, key: bytes) -> bytes | None:
        """The base full key recorded for the held SWA page ``key`` (None: none).  O(1)."""
        return self.tier.base_of(key)

    def lookup(self, swa: bool, keys: Sequence[bytes]) -> np.ndarray:
        """Host page of each key, ``-1`` where absent (touches hits).  O(n)."""
        if swa:
            return self.tier.lookup_swa(keys, touch=True)
        return self.tier.lookup_full(keys, touch=True)

    def held(self, swa: bool, keys: Sequence[bytes]) -> np.ndarray:
        """Bool per key: whether the index holds it (recency untouched).  O(n)."""
        if swa:
            return self.tier.lookup_swa(keys) >= 0
        return self.tier.lookup_full(keys) >= 0

    def admit(self, swa: bool, keys: Sequence[bytes],
              bases: Sequence[bytes | None] | None = None,
              plain: Collection[bytes] = ()) -> tuple[np.ndarray, np.ndarray]:
        """Index the keys not held yet (those held are touched); returns the indices
        ``i`` of ``keys`` admitted and their host pages.  When the budget cannot make
        room (everything else protected) nothing is admitted: L2 is best effort.
        ``bases`` (SWA only, parallel to ``keys``): the full key each page goes with
        (``None``: none); a page whose base L2 does not hold enters plain.  ``plain``
        (SWA only): keys that enter plain whatever their base (windows L2 does not
        keep as anchors); storing them displaces only older plain SWA, as in the
        core's L2.  Mutates the index (may evict LRU pages).  O(n + evicted)."""
        have = self.lookup(swa, keys)
        todo = np.flatnonzero(have < 0)
        none = np.zeros(0, dtype=np.int64)
        if todo.size == 0:
            return none, none
        if not swa:
            got = self.tier.alloc(int(todo.size), 0)
            if got is None:
                return none, none
            self.tier.insert_full([keys[i] for i in todo.tolist()], got[0])
            return todo, got[0]
        # Only windows a hit can end at are saved (tails, checkpoints, hit windows):
        # they enter as anchors (those a sequence moved past are demoted later) but for
        # those named ``plain`` and one whose full KV L2 lacks (it would outlive it).
        base = [None] * len(keys) if bases is None else bases
        want = np.array([k not in plain and (b is None or not self.tier.pair_swa or b in self.tier)
                         for k, b in ((keys[i], base[i]) for i in todo.tolist())], dtype=bool)
        idx: list[np.ndarray] = []
        pages: list[np.ndarray] = []
        for anchor in (True, False):  # anchors first, then plain SWA on its own terms
            part = todo[want == anchor]
            if part.size == 0:
                continue
            got = self.tier.alloc(0, int(part.size), plain_only=not anchor)
            if got is None:
                continue
            sel = part.tolist()
            self.tier.insert_swa([keys[i] for i in sel], got[1], np.full(part.size, anchor),
                                 [base[i] for i in sel])
            idx.append(part)
            pages.append(got[1])
        if not idx:
            return none, none
        return np.concatenate(idx), np.concatenate(pages)

    def anchored(self, keys: Sequence[bytes]) -> list[bytes]:
        """The SWA ``keys`` held in the anchored class.  O(n)."""
        return [k for k, a in zip(keys, self.tier.anchored_swa(keys).tolist()) if a]

    def demote(self, keys: Sequence[bytes]) -> int:
        """Make the anchored SWA pages of ``keys`` plain (evicted before full pages; a
        finished request's sequence moved past their windows); others are ignored.
        Returns pages moved.  O(n)."""
        return self.tier.demote_swa(keys)


class HostPageCache:
    """L2 page store for one worker: a :class:`HostPageIndex` and the page bytes.

    Args: as :class:`HostPageIndex`.
    """

    def __init__(self, page_bytes: int, budget_bytes: int, window: int) -> None:
        self.index = HostPageIndex(page_bytes, budget_bytes, window)
        self.page_bytes = self.index.page_bytes
        self.tier = self.index.tier
        rows = int(budget_bytes) // self.page_bytes
        self._rows = {AttnKind.FULL: torch.empty((rows, self.page_bytes), dtype=torch.uint8),
                      AttnKind.SWA: torch.empty((rows, self.page_bytes), dtype=torch.uint8)}
        self._lock = threading.RLock()

    def lookup(self, swa: bool, keys: Sequence[bytes]) -> np.ndarray:
        """Host page of each key, ``-1`` where absent (touches hits).  O(n)."""
        with self._lock:
            return self._lookup(swa, keys)

    def _lookup(self, swa: bool, keys: Sequence[bytes]) -> np.ndarray:
        return self.index.lookup(swa, keys)

    def read(self, swa: bool, pages: np.ndarray) -> torch.Tensor:
        """``[n, page_bytes]`` uint8 copies of host ``pages``.  O(n * page_bytes)."""
        kind = AttnKind.SWA if swa else AttnKind.FULL
        with self._lock:
            return self._rows[kind].index_select(0, torch.as_tensor(pages, dtype=torch.long))

    def fetch(self, swa: bool, keys: Sequence[bytes], out: torch.Tensor) -> np.ndarray:
        """Copy every held page into ``out[i]`` (``[n, page_bytes]`` uint8); returns the
        indices ``i`` copied.  Lookup and copy happen under one lock hold (a
        concurrent store cannot evict and overwrite a row in between).
        O(n * page_bytes)."""
        kind = AttnKind.SWA if swa else AttnKind.FULL
        with self._lock:
            host = self._lookup(swa, keys)
            hit = np.flatnonzero(host >= 0)
            if hit.size:
                out.index_copy_(0, torch.as_tensor(hit, dtype=torch.long),
                                self._rows[kind].index_select(
                                    0, torch.as_tensor(host[hit], dtype=torch.long)))
        return hit

    def store(self, swa: bool, keys: Sequence[bytes], rows: torch.Tensor,
              bases: Sequence[bytes | None] | None = None, plain: Collection[bytes] = ()) -> int:
        """Copy ``rows`` (``[n, page_bytes]`` uint8) in under ``keys``; returns pages stored.
        ``bases``, ``plain``: as :meth:`HostPageIndex.admit`.

        Keys already held are only touched.  When the budget cannot make room
        (everything else protected) nothing is stored: L2 is best effort.
        Mutates the index (may evict LRU pages).  O(n * page_bytes + evicted).
        """
        if rows.dim() != 2 or rows.shape[1] != self.page_bytes or rows.shape[0] != len(keys):
            raise ValueError(f"rows must be [{len(keys)}, {self.page_bytes}] uint8, "
                             f"got {tuple(rows.shape)}")
        with self._lock:
            return self._store(swa, keys, rows, bases, plain)

    def _store(self, swa: bool, keys: Sequence[bytes], rows: torch.Tensor,
               bases: Sequence[bytes | None] | None, plain: Collection[bytes] = ()) -> int:
        todo, pages = self.index.admit(swa, keys, bases, plain)
        if todo.size == 0:
            return 0
        kind = AttnKind.SWA if swa else AttnKind.FULL
        self._rows[kind].index_copy_(0, torch.as_tensor(pages, dtype=torch.long),
                                     rows.index_select(0, torch.as_tensor(todo, dtype=torch.long)))
        return int(todo.size)

    def demote(self, keys: Sequence[bytes]) -> int:
        """:meth:`HostPageIndex.demote` under the lock."""
        with self._lock:
            return self.index.demote(keys)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self.tier.stats()
