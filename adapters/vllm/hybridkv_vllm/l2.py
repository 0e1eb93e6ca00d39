"""L2: a host-memory page cache in the worker, in front of the L3 backend, with
one index, on the scheduler side.

The scheduler side owns L2's index (:class:`HostPageIndex`, hybridkv's
:class:`~hybridkv.tiers.host.HostTier`: chained page keys, full pages and SWA
pages with their own validity, plain SWA evicted before full, tail/checkpoint
SWA windows last) and decides every L2 operation: which pages a save stores and
in which host slots, which pages a load reads from L2 and from which slots, where
the pages a load reads from L3 are copied in, which windows are demoted.  Each job
carries its slots to the workers (:class:`.jobs.PageJob`); a worker keeps only the
page bytes (:class:`HostPageRows`), each row tagged with its key, and keeps no
index of its own (vLLM's own offloading manager divides the work the same way).
So a hit's split by tier is the index's own, and L2's eviction can use what only
the scheduler knows.

Every saved SWA window enters anchored; when a request finishes, the scheduler
names the anchored windows its sequence moved past (neither its tail, a
checkpoint nor its hit's window) and demotes them to plain SWA before the next
stores.  A window goes with its full KV, by the core L2's own rule: each stored
SWA page may name the full page holding its last token (its *base*,
:func:`.plan.full_bases`); when L2 evicts or discards a full page, the SWA pages
of every sliding group based on it leave too (a hit needs the full KV of its
whole prefix: a window without it buys little from L2).  An SWA page whose base
L2 does not hold when it is stored enters plain, not anchored.  The HostTier
runs in accounting mode (``device="meta"``); the page bytes live in the worker,
one uint8 row per host page, because a vLLM page is an opaque ``page_bytes``
blob (all layers of one KV-cache group for one block) rather than hybridkv's
per-layer K/V layout.

vLLM gives every KV-cache group the same page bytes (it changes block sizes to
get there), so one row size serves every group; the group identity is in the
key (per-group fingerprint), so groups never collide.

Memory: ``torch.empty`` rows (untouched rows are not resident); resident
bytes stay within twice ``budget_bytes`` (a full and an SWA row array) and, in
use, within ``budget_bytes`` plus the rows the index freed that were not reused
yet.  :class:`HostPageRows` is thread-safe (the worker's execute thread loads,
its save thread stores); :class:`HostPageIndex` is not (the scheduler's thread).
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridkv.spec import AttnKind, KVShape, ModelSpec
from hybridkv.tiers.host import HostTier

from .logs import logger

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from .plan import GroupInfo

__all__ = ["HostPageIndex", "HostPageRows", "host_rows", "l2_index"]


class HostPageIndex:
    """Which pages an L2 holds and what it evicts, without the page bytes.

    The scheduler side keeps the one index of L2 (:mod:`.sources`); the host page
    each key gets is the slot of the workers' :class:`HostPageRows` that holds its
    bytes.  Not thread-safe.

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
              plain: Collection[bytes] = (), parents: Sequence[bytes | None] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        """Index the keys not held yet (those held are touched); returns the indices
        ``i`` of ``keys`` admitted and their host pages (:meth:`place`).  O(n + evicted)."""
        held, slots = self.place(swa, keys, bases, plain, parents)
        new = np.flatnonzero(~held & (slots >= 0))
        return new, slots[new]

    def place(self, swa: bool, keys: Sequence[bytes],
              bases: Sequence[bytes | None] | None = None,
              plain: Collection[bytes] = (), parents: Sequence[bytes | None] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        """Touch the keys held and index the others; returns, per key, whether it was
        held and its host page (``-1``: not held and not admitted).  When the budget
        cannot make room (everything else protected) nothing is admitted: L2 is best
        effort.  ``bases`` (SWA only, parallel to ``keys``): the full key each page
        goes with (``None``: none); a page whose base L2 does not hold enters plain.
        ``plain`` (SWA only): keys that enter plain whatever their base (windows L2
        does not keep as anchors); storing them displaces only older plain SWA, as in
        the core's L2.  ``parents`` (full only, parallel to ``keys``): the key of the
        page before each (None: the first page, or unknown); L2 evicts a full page
        only after the pages that extend it (:meth:`HostTier.insert_full
        <hybridkv.tiers.host.HostTier.insert_full>`).  Mutates the index (may evict
        LRU pages).  O(n log n + evicted)."""
        slots = self.lookup(swa, keys)
        held = slots >= 0
        todo = np.flatnonzero(~held)
        if todo.size == 0:
            return held, slots
        if not swa:
            got = self.tier.alloc(int(todo.size), 0)
            if got is not None:
                sel = todo.tolist()
                self.tier.insert_full([keys[i] for i in sel], got[0],
                                      None if parents is None else [parents[i] for i in sel])
                slots[todo] = got[0]
            return held, slots
        # Only windows a hit can end at are saved (tails, checkpoints, hit windows):
        # they enter as anchors (those a sequence moved past are demoted later) but for
        # those named ``plain`` and one whose full KV L2 lacks (it would outlive it).
        base = [None] * len(keys) if bases is None else bases
        want = np.array([k not in plain and (b is None or not self.tier.pair_swa or b in self.tier)
                         for k, b in ((keys[i], base[i]) for i in todo.tolist())], dtype=bool)
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
            slots[part] = got[1]
        return held, slots

    def anchored(self, keys: Sequence[bytes]) -> list[bytes]:
        """The SWA ``keys`` held in the anchored class.  O(n)."""
        return [k for k, a in zip(keys, self.tier.anchored_swa(keys).tolist()) if a]

    def anchor(self, keys: Sequence[bytes]) -> int:
        """Move the plain SWA pages of ``keys`` to the anchored class (a hit ended at
        their window); others are ignored.  Returns pages moved.  O(n)."""
        return self.tier.anchor(keys)

    def demote(self, keys: Sequence[bytes]) -> int:
        """Make the anchored SWA pages of ``keys`` plain (evicted before full pages; a
        finished request's sequence moved past their windows); others are ignored.
        Returns pages moved.  O(n)."""
        return self.tier.demote_swa(keys)


class HostPageRows:
    """The worker's L2 page bytes: one uint8 row per host page, at the slots the
    scheduler side's :class:`HostPageIndex` (the one L2 index) assigns, each row
    tagged with the key it holds.

    The worker keeps no index of its own: a save writes its rows to the slots its
    job names, a load reads a slot only while the slot's tag is the key it asks
    for.  A slot the scheduler reassigned before a queued write reached it, or a
    save the worker dropped, leaves a tag that does not match, which reads as a
    miss (the load goes to L3), never as another page's bytes.  Tag test and row
    copy happen under one lock hold, as do row write and tag set.

    Args:
        page_bytes: bytes of one page (one block of every layer of a group); > 0.
        budget_bytes: host bytes of the L2 (the index's budget): ``budget_bytes //
            page_bytes`` rows for full pages and as many for SWA pages (untouched
            rows are not resident; the index keeps the two together in budget).
    """

    def __init__(self, page_bytes: int, budget_bytes: int) -> None:
        if page_bytes < 1 or budget_bytes < page_bytes:
            raise ValueError(f"budget_bytes ({budget_bytes}) must hold at least one page "
                             f"of {page_bytes} bytes")
        self.page_bytes = int(page_bytes)
        self.num_rows = int(budget_bytes) // self.page_bytes
        self._rows = {swa: torch.empty((self.num_rows, self.page_bytes), dtype=torch.uint8)
                      for swa in (False, True)}
        self._tags: dict[bool, list[bytes | None]] = {swa: [None] * self.num_rows for swa in (False, True)}
        self._lock = threading.Lock()

    def _valid(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        if len(slots) != len(keys):
            raise ValueError(f"slots ({len(slots)}) and keys ({len(keys)}) must be parallel")
        return [i for i, s in enumerate(slots) if 0 <= s < self.num_rows]

    def read(self, swa: bool, slots: Sequence[int], keys: Sequence[bytes], out: torch.Tensor) -> np.ndarray:
        """Copy the row of each slot whose tag is its key into ``out[i]`` (``[n,
        page_bytes]`` uint8); returns the indices ``i`` copied (the rest: misses).
        O(n * page_bytes)."""
        sel = self._valid(slots, keys)
        with self._lock:
            tags = self._tags[swa]
            hit = np.array([i for i in sel if tags[slots[i]] == keys[i]], dtype=np.int64)
            if hit.size:
                src = torch.as_tensor([slots[i] for i in hit.tolist()], dtype=torch.long)
                out.index_copy_(0, torch.as_tensor(hit, dtype=torch.long), self._rows[swa].index_select(0, src))
        return hit

    def write(self, swa: bool, slots: Sequence[int], keys: Sequence[bytes], rows: torch.Tensor) -> int:
        """Copy ``rows[i]`` (``[n, page_bytes]`` uint8) into slot ``slots[i]`` and tag it
        ``keys[i]``, for every slot ``>= 0``; returns rows written.  O(n * page_bytes)."""
        if rows.dim() != 2 or rows.shape[1] != self.page_bytes or rows.shape[0] != len(keys):
            raise ValueError(f"rows must be [{len(keys)}, {self.page_bytes}] uint8, got {tuple(rows.shape)}")
        sel = self._valid(slots, keys)
        if not sel:
            return 0
        dst = torch.as_tensor([slots[i] for i in sel], dtype=torch.long)
        with self._lock:
            self._rows[swa].index_copy_(0, dst, rows.index_select(0, torch.as_tensor(sel, dtype=torch.long)))
            tags = self._tags[swa]
            for i in sel:
                tags[slots[i]] = keys[i]
        return len(sel)

    def stats(self) -> dict[str, int]:
        """Rows per kind and rows written so far (a row once written stays tagged)."""
        with self._lock:
            return {"rows": self.num_rows,
                    "written_full_rows": sum(t is not None for t in self._tags[False]),
                    "written_swa_rows": sum(t is not None for t in self._tags[True])}


def l2_index(kv_cache_config: KVCacheConfig, groups: Sequence[GroupInfo], budget_bytes: int) -> HostPageIndex | None:
    """L2's index for the scheduler side: pages of the bytes the worker's
    ``GroupBuffers`` will have (every layer of a group, one block).  None without
    L2 (``budget_bytes <= 0``), or where the worker has none (groups differ in page
    bytes, or the budget holds no page)."""
    if budget_bytes <= 0:
        return None
    page_bytes = {int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names)
                  for g in kv_cache_config.kv_cache_groups}
    if len(page_bytes) != 1 or budget_bytes < min(page_bytes):
        return None
    windows = [int(g.window) for g in groups if g.is_swa] or [1]
    return HostPageIndex(page_bytes.pop(), budget_bytes, min(windows))


def host_rows(page_bytes: set[int], budget_bytes: int) -> HostPageRows | None:
    """The worker's L2 rows for groups of ``page_bytes`` (each group's page: one block
    of its layers) and the index's budget; None without L2 (``budget_bytes <= 0``),
    or where the groups differ in page bytes: the rows cannot be shared then, so the
    worker goes without L2 rather than guess (vLLM equalises page bytes across groups)."""
    if budget_bytes <= 0:
        return None
    if len(page_bytes) != 1:
        logger.warning("hybridkv: groups differ in page bytes %s; L2 disabled", sorted(page_bytes))
        return None
    return HostPageRows(next(iter(page_bytes)), budget_bytes)
