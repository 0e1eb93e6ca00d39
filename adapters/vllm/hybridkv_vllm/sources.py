"""The scheduler side's one record of the tiers: what L2 and L3 hold, and where hits come from.

:class:`TierView` answers the connector's lookups (which of a prompt's pages the
tiers hold) from L2's index (owned here, see below) and the store's :class:`~hybridkv.tiers.index.StoreIndex`
(keys this engine queued for storing, keys read back or found by a probe, keys
found absent for a short while), so a lookup probes the store (``exists``) only
for keys it has no answer for and that can change its hit (full pages up to the
first absent one, sliding-window pages from there down only as far as the best
window needs: the core's lookup, :func:`hybridkv.tiers.lookup.stored_hit`, which
the core's own L3 read-ahead runs too), and a key is known in one place from its
save to its loss.  It
also splits each hit by tier, in vLLM's words (``prompt_tokens_cached_by_source``):

vLLM 0.32 asks the scheduler-side connector, right after ``update_state_after_alloc``,
to split a request's external hit by tier (``get_external_cache_hit_sources``); a
connector that does not answer has every hit counted as ``external_unspecified``.
hybridkv's hits come from the worker's L2 (host memory: ``host``) or from L3: ``disk``
for a file or NIXL-POSIX store; a remote store (Redis, Mooncake) is what vLLM's
``external_unspecified`` stands for, so its hits keep that label.

The scheduler side owns L2's one index (:class:`.l2.HostPageIndex`) and decides
every L2 operation: a load touches the pages L2 holds and admits the rest (read
from L3), a save admits its pages after making plain the anchored windows a
finished request moved past (:meth:`TierView.demote`), and each returns the
host slots the workers read or write (:mod:`.l2`).  The split is the index's
own; a save the worker drops (full queue) or a row a queued write overtook
reads as a miss on the worker (its row's tag does not match), and the load
goes to L3 (a failed load drops its keys from the index).  Either way the
counts add up to the hit, as vLLM requires.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.tiers.index import StoreIndex
from hybridkv.tiers.lookup import stored_hit

from .l2 import HostPageIndex
from .plan import GroupInfo, passed_pages

__all__ = ["L2Held", "TierView", "l3_source"]

#: ``l2_held(group, keys, lo, hi)``: bool per block ``[lo, hi)`` of ``group`` (``keys``:
#: the group's keys): L2 holds it, read off the tree's records
#: (:meth:`.names.TreeNames.l2_held` over a request's walk).
L2Held = Callable[[GroupInfo, Sequence[bytes], int, int], np.ndarray]

# L3 URL schemes whose pages live on this machine's disks; any other is a remote store.
_DISK_SCHEMES = ("file", "nixl+posix")


def l3_source(url: str) -> CacheHitSource:
    """vLLM's label for hits read from the L3 at ``url``: ``disk`` for a file or
    NIXL-POSIX store, ``external_unspecified`` (vLLM's label for a remote store) else."""
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got {type(url).__name__}")
    scheme = url.split(":", 1)[0].lower() if ":" in url else "file"
    return CacheHitSource.DISK if scheme in _DISK_SCHEMES else CacheHitSource.EXTERNAL_UNSPECIFIED


class TierView:
    """The scheduler side's record of what the worker's L2 and the L3 store hold, and
    each hit's split by tier.

    Args:
        groups: the connector's KV-cache groups.
        l2: L2's index (None: no L2, every hit is L3's).
        l3: the label of L3 hits (:func:`l3_source`).
        store: what L3 holds as far as this engine knows (default: an index that never
            probes, so only what this engine queued counts).
    """

    def __init__(self, groups: Sequence[GroupInfo], l2: HostPageIndex | None, l3: CacheHitSource,
                 store: StoreIndex | None = None) -> None:
        self.groups = {g.index: g for g in groups}
        self.l2 = l2
        self.l3 = l3
        self.store = store if store is not None else StoreIndex(None)

    def hit(self, keys: dict[int, list[bytes]], local_tokens: int, max_tokens: int, unit: int, *,
            deferred: list[bytes] | None = None, in_l2: dict[int, np.ndarray] | None = None,
            device_full: int = 0, l2_held: L2Held | None = None) -> int:
        """The window-safe hit of a lookup from what L2 (the index, not touched) and L3
        hold, asking the store as little as the answer needs: the core's lookup
        (:func:`hybridkv.tiers.lookup.stored_hit`, the one the core's L3 read-ahead
        runs), with L2's index as the faster tier.  ``keys``: per group index, the
        request's keys up to ``max_tokens``; the pages below ``local_tokens`` (the
        engine's own hit) are never asked.  ``deferred``: a list to collect the keys
        the store would be asked instead of asking it (:mod:`.lookups` asks them off
        the scheduler's thread).  ``in_l2``: a copy of what L2 held (:meth:`in_l2`),
        read instead of L2's index, so the call is safe off the scheduler's thread
        (the record is thread-safe).  ``device_full``: tokens whose full KV the device
        holds past ``local_tokens`` (a window repair, :mod:`.repair`): full pages
        below it count as held.  ``l2_held``: what L2 holds read off the tree's
        records first (:data:`L2Held`; the scheduler's thread only).  O(keys) plus the probes."""
        def held(g: GroupInfo, lo: int, hi: int) -> np.ndarray:
            got = (in_l2[g.index][lo:hi] if in_l2 is not None
                   else self._in_l2(g, keys[g.index], lo, hi, l2_held))
            on_device = min(hi, device_full // g.block_size) - lo if not g.is_swa else 0
            if on_device > 0:
                got = got.copy()
                got[:on_device] = True
            return got

        return stored_hit(list(self.groups.values()), keys, held, self.store, local_tokens, max_tokens, unit,
                          deferred=deferred)[0]

    def in_l2(self, keys: dict[int, list[bytes]], l2_held: L2Held | None = None) -> dict[int, np.ndarray]:
        """Per group index, a bool per key: L2's index holds it now (for :meth:`hit`'s
        ``in_l2``; ``l2_held`` as there).  O(keys)."""
        return {gi: self._in_l2(self.groups[gi], ks, 0, len(ks), l2_held) for gi, ks in keys.items()}

    def _in_l2(self, g: GroupInfo, keys: Sequence[bytes], lo: int, hi: int, l2_held: L2Held | None) -> np.ndarray:
        """Bool per key of ``keys[lo:hi]`` (group ``g``'s): L2 holds it (not touched; all
        False without L2): off the tree's records through ``l2_held``, else L2's index."""
        hi = min(hi, len(keys))
        if self.l2 is None or hi <= lo:
            return np.zeros(max(0, hi - lo), dtype=bool)
        if l2_held is not None:
            return l2_held(g, keys, lo, hi)
        return self.l2.held(g.is_swa, keys[lo:hi])

    def touches(self, keys: dict[int, list[bytes]], end: int, interval_s: float) -> list[bytes]:
        """Store keys of a hit ``[0, end)`` to touch now (repair case 3: a prefix served
        from the device or L2 keeps its L3 entries alive): every full-attention page,
        each sliding group's window before ``end``; only keys the store holds whose
        last touch is older than ``interval_s``.  ``keys``: per group index, the
        request's keys (at least ``end`` tokens' worth).  O(pages of the hit)."""
        out: list[bytes] = []
        for gi, ks in keys.items():
            out += self.store.due_touch(self._hit_keys(self.groups[gi], ks, end), interval_s)
        return out

    @staticmethod
    def _hit_keys(g: GroupInfo, keys: list[bytes], end: int) -> list[bytes]:
        """The keys of group ``g`` a hit ``[0, end)`` needs: every page of a full
        group, the window before ``end`` of a sliding one.  O(pages)."""
        lo = max(0, end - int(g.window)) // g.block_size if g.is_swa else 0
        return keys[lo:end // g.block_size]

    def anchor_window(self, keys: dict[int, list[bytes]], end: int) -> int:
        """Anchor in L2 each sliding group's window before a hit's ``end`` (repair case
        4, as the core's L2 does at ``begin``): evicted after full KV, also where an
        earlier request's finish had made part of it plain.  ``keys``: per group index,
        at least ``end`` tokens' worth.  Returns pages moved.  O(window pages)."""
        if self.l2 is None or end <= 0:
            return 0
        out: list[bytes] = []
        for gi, ks in keys.items():
            if self.groups[gi].is_swa:
                out += self._hit_keys(self.groups[gi], ks, end)
        return self.l2.anchor(out) if out else 0

    def saved_or_queued(self, key: bytes) -> bool:
        """Whether the store holds ``key`` or this engine queued it.  O(1)."""
        return self.store.state(key) is not None

    def stored_everywhere(self, swa: bool, keys: Sequence[bytes]) -> np.ndarray:
        """Bool per key: whether a save need not carry it again: the store holds it (or
        this engine queued it, :meth:`saved_or_queued`) and so does L2 (without L2,
        the store alone).  A page L2 lost but the device still holds is
        copied down again, as the core copies down what the host lacks (repair case 1:
        device complete, host deficient); the worker then writes it to L2 only (L3's
        ``exists`` skips it).  O(n), one L2 lookup for the keys the store holds."""
        out = np.fromiter((self.saved_or_queued(k) for k in keys), dtype=bool, count=len(keys))
        if self.l2 is not None and out.any():
            idx = np.flatnonzero(out)
            out[idx] = self.l2.held(swa, [keys[i] for i in idx.tolist()])
        return out

    def on_load_done(self, keys: dict[int, list[bytes]], ok: bool) -> None:
        """A load of ``keys`` (per group index) finished: read intact (``ok``), or failed:
        which pages it lacked is unknown, so every key leaves L2's index and is
        absent from L3 until stored again or probed past the TTL (a save the worker
        dropped cannot make later lookups fail again and again).  O(keys)."""
        for gi, ks in keys.items():
            if ok:
                self.store.stored(ks)
                continue
            self.store.lost(ks)
            if self.l2 is not None:
                self.l2.tier.discard(ks, swa=self.groups[gi].is_swa)

    def on_load(self, pages: dict[int, tuple[list[int], list[bytes]]], start: int, end: int,
                bases: dict[int, list[bytes | None] | None] | None = None,
                parents: dict[int, list[bytes | None]] | None = None
                ) -> tuple[dict[CacheHitSource, int], dict[int, list[int]]]:
        """A load of ``pages`` (per group index: page indices at the group's block size
        and their keys) for the hit ``[start, end)``: returns its tokens by source and,
        per group, the L2 slot of each key (:mod:`.l2`): the slot L2 holds it in (the
        worker reads it there), or the slot L2 admits it to (the worker reads it from
        L3 and copies it in), ``-1`` for none.  ``bases``: per sliding group, the full
        key each page goes with in L2; ``parents``: per full group, the key of the page
        before each (L2's key tree, :meth:`.l2.HostPageIndex.place`).

        A token counts as L3's when any loaded page covering it is read from L3, else
        as L2's; tokens no loaded page covers (a sliding window group's history
        before its window, in a model with no full-attention group) take the farthest
        tier the load reads.  O(pages + (end - start) / smallest block)."""
        n = end - start
        if n <= 0:
            return {}, {}
        if self.l2 is None:
            return {self.l3: n}, {}
        unit = min(self.groups[g].block_size for g in pages) if pages else n
        slots_out: dict[int, list[int]] = {}
        num = -(-n // unit)
        covered = np.zeros(num, dtype=bool)
        from_l3 = np.zeros(num, dtype=bool)
        any_l3 = False
        for gi, (idx, keys) in pages.items():
            if not keys:
                continue
            g = self.groups[gi]
            # held pages are read from L2; the others from L3, copied into the rows L2 admits
            held, slots = self.l2.place(g.is_swa, keys, (bases or {}).get(gi), parents=(parents or {}).get(gi))
            any_l3 = any_l3 or not held.all()
            slots_out[gi] = slots.tolist()
            for i, h in zip(idx, held.tolist()):
                lo = max(0, i * g.block_size - start) // unit
                hi = -(-(min(end, (i + 1) * g.block_size) - start) // unit)
                covered[lo:hi] = True
                if not h:
                    from_l3[lo:hi] = True
        from_l3[~covered] = any_l3
        disk = min(n, int(from_l3.sum()) * unit)
        out = {CacheHitSource.HOST: n - disk, self.l3: disk}
        return {k: v for k, v in out.items() if v}, slots_out

    def passed(self, keys: dict[int, list[bytes]], end: int, kept_ends: Sequence[int]) -> list[bytes]:
        """SWA keys of the anchored windows in L2 that a request finished at
        ``end`` tokens moved past: each sliding group's pages before ``end`` outside
        the windows ending at ``kept_ends`` (tokens: its tail, checkpoints, hit end;
        :func:`.plan.passed_pages`).  ``keys``: per group index, at least ``end``
        tokens' worth.  Reads the index only.  O(pages before ``end``)."""
        if self.l2 is None or not self.l2.tier.num_anchored_swa_pages or end <= 0:
            return []
        out: list[bytes] = []
        for gi, ks in keys.items():
            g = self.groups[gi]
            if g.is_swa:
                bs = g.block_size
                idx = passed_pages(g, end // bs, bs, [e // bs for e in kept_ends])
                out += self.l2.anchored([ks[i] for i in idx])
        return out

    def demote(self, keys: Sequence[bytes]) -> int:
        """Make the anchored L2 windows of ``keys`` plain (a finished request moved past
        them, :meth:`passed`); returns pages moved.  O(n)."""
        return self.l2.demote(keys) if self.l2 is not None and keys else 0

    def on_save(self, groups: dict[int, tuple[list[int], list[bytes]]],
                bases: dict[int, list[bytes | None] | None] | None = None,
                plain: Collection[bytes] = (),
                parents: dict[int, list[bytes | None]] | None = None,
                placed: dict[int, np.ndarray] | None = None) -> dict[int, list[int]]:
        """A save job's pages (per group index: block ids and keys) go into L2 and
        count as queued for L3; returns per group the L2 slot the worker writes each
        page to (``-1``: L2 holds it already, only touched, or has no room).
        ``bases``: per sliding group, the full key each page goes with in L2;
        ``plain``: SWA keys entering L2 plain; ``parents``: per full group, the key of
        the page before each.  ``placed``: a dict to fill with, per group, the L2 slot
        holding each page now (held before or stored now; ``-1``: none).  O(pages)."""
        plain = frozenset(plain)
        for _, keys in groups.values():
            self.store.queued(keys)
        if self.l2 is None:
            return {}
        out: dict[int, list[int]] = {}
        for gi, (_, keys) in groups.items():
            if keys:
                held, slots = self.l2.place(self.groups[gi].is_swa, keys, (bases or {}).get(gi), plain,
                                            (parents or {}).get(gi))
                if placed is not None:
                    placed[gi] = slots.copy()
                slots[held] = -1  # held: only touched, not written again
                out[gi] = slots.tolist()
        return out
