"""Which of a prompt's pages the tiers hold: one lookup for every host.

A prompt's pages are named per KV group (:class:`GroupInfo`: full attention, or
a sliding window in tokens, each with its block size).  :func:`stored_hit`
finds the longest window-safe hit (``../../DESIGN.md`` section 2) over what a
faster tier holds (the host's ``held``) and what the L3 store holds (a
:class:`~hybridkv.tiers.index.StoreIndex`: its record first, the store's
``exists`` only for keys it has no answer for), asking as little as the
answer needs:

* the full groups' leading run first (:meth:`StoreIndex.leading`: probes in
  growing chunks, up to the first absent key); no hit ends past it;
* then the sliding groups' pages from the run's end downwards, a window and a
  unit first, 4x more each round, one batched ask per round, until the best
  end found has its window and every larger end its window inside what was
  asked.  The hit equals the one from asking every key.

The core's tier coordinator asks it for its L3 read-ahead (groups: the full
KV and the lead SWA window, one page size), the vLLM connector's scheduler
for each lookup (vLLM's KV-cache groups, their own block sizes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..spec import window_pages
from ..window import held_windows
from .index import StoreIndex

__all__ = ["GroupInfo", "Held", "stored_hit", "window_safe_tokens"]


@dataclass(frozen=True)
class GroupInfo:
    """One KV-cache group as the tiers see it.

    ``window`` is ``None`` for full attention, else the sliding window in tokens.
    ``block_size`` is this group's tokens per page (vLLM may give groups of
    one model different block sizes at equal page bytes, e.g. MiMo-V2: full
    64, SWA 32); ``0`` means "the caller's single page size".
    ``layer_names``: the group's layers, where the host names them.
    """

    index: int
    window: int | None
    layer_names: tuple[str, ...] = ()
    block_size: int = 0

    @property
    def is_swa(self) -> bool:
        return self.window is not None


Held = Callable[[GroupInfo, int, int], np.ndarray]
"""``held(group, lo, hi)``: bool per page ``[lo, hi)`` of ``group`` that a faster
tier holds (never asked of the store)."""


def window_safe_tokens(present: Sequence[np.ndarray], groups: Sequence[GroupInfo], unit: int,
                       local_tokens: int, max_tokens: int) -> int:
    """Largest window-safe hit in tokens over groups with their own block sizes.

    Args:
        present: per group (same order as ``groups``) a bool array, page ``i``
            (of that group's ``block_size``) is stored; at least
            ``max_tokens // block_size`` long.
        groups: the KV-cache groups; every ``block_size`` divides ``unit``.
        unit: hit granularity in tokens (the lcm of the groups' block sizes:
            a hit must end on a block boundary of every group).
        local_tokens: tokens the engine already holds (a multiple of ``unit``);
            pages below it need not come from storage (for SWA: the engine's
            own hit keeps the window before it).
        max_tokens: upper bound of the hit.

    Returns:
        ``L``, a multiple of ``unit`` in ``[0, max_tokens]``: the largest end
        such that every full group holds pages ``[local, L)`` and every SWA
        group the pages covering ``[max(local, L - W), L)``; ``L <= local_tokens``
        means "nothing to load".  Pure; O(P * groups) numpy, no per-page loop.
    """
    if unit <= 0 or any(unit % g.block_size for g in groups):
        raise ValueError(f"unit {unit} must be a positive multiple of every block size "
                         f"{[g.block_size for g in groups]}")
    first, last = local_tokens // unit + 1, max_tokens // unit
    if last < first:
        return 0
    ends = np.arange(first, last + 1, dtype=np.int64) * unit  # candidate ends, tokens
    ok = np.ones(ends.size, dtype=bool)
    for pres, g in zip(present, groups):
        bs = g.block_size
        pages = last * unit // bs
        # a full group needs all of [local, L): a window as long as the whole hit
        wp = window_pages(int(g.window), bs) if g.is_swa else pages  # type: ignore[arg-type]
        ok &= held_windows(np.asarray(pres, dtype=bool)[:pages], ends // bs, wp, local_tokens // bs)
    good = ends[ok]
    return int(good[-1]) if good.size else 0


def stored_hit(groups: Sequence[GroupInfo], keys: Mapping[int, Sequence[bytes]], held: Held,
               store: StoreIndex, local_tokens: int, max_tokens: int, unit: int, *,
               deferred: list[bytes] | None = None) -> tuple[int, dict[int, np.ndarray]]:
    """The window-safe hit over a faster tier and the store (see the module docstring).

    Args:
        groups: the KV-cache groups (full ones are asked first, in this order).
        keys: per group index, the prompt's page keys up to ``max_tokens`` (a full
            group's keys are sliced; a sliding group's only indexed, so they may be
            derived on demand).
        held: what a faster tier holds (:data:`Held`).
        store: the L3 record; its probe is called only for keys it cannot answer.
        local_tokens: the engine's own hit (pages below it are never asked; a
            sliding group's window before it counts as held).
        max_tokens: upper bound of the hit.
        unit: hit granularity (see :func:`window_safe_tokens`).
        deferred: ``None``: the store is probed for keys the record cannot answer.
            A list: it is never probed; the keys it would have been asked are
            appended to the list and count as absent (the hit is then a lower
            bound: probe them elsewhere, e.g. off the engine's thread, and ask
            again; an empty list means the answer is the record's whole answer).

    Returns:
        ``(hit, flags)``: the hit in tokens (``<= local_tokens``: nothing to load)
        and per group index a bool per page: some tier holds it, as far as it was
        asked (every full page below the hit, every sliding page of the hit's
        window is).  O(keys asked) plus the store's probes.
    """
    order = list(groups)
    flags = {g.index: np.zeros(len(keys[g.index]), dtype=bool) for g in order}
    los = {g.index: min(len(keys[g.index]), local_tokens // g.block_size) for g in order}
    end = max_tokens
    for g in order:
        if g.is_swa:
            flags[g.index][:los[g.index]] = True  # the engine's own hit keeps its window
            continue
        lo, n = los[g.index], len(keys[g.index])
        ks = keys[g.index][lo:n]
        run = min(store.leading(ks, held(g, lo, n), deferred=deferred) if ks else 0,
                  max(0, end // g.block_size - lo))
        flags[g.index][:lo + run] = True
        end = min(end, (lo + run) * g.block_size)
    if end <= local_tokens:
        return 0, flags
    swa = [g for g in order if g.is_swa]
    window = max((int(g.window) for g in swa), default=0)
    span, asked = window + unit, end  # sliding pages are known from ``asked`` up to ``end``
    while True:
        lo_tok = max(local_tokens, (end - span) // unit * unit)
        _ask_sliding(swa, keys, flags, held, store, lo_tok, asked, deferred)
        asked = lo_tok
        hit = window_safe_tokens([flags[g.index] for g in order], order, unit, local_tokens, end)
        if lo_tok <= local_tokens or not swa or hit >= lo_tok + window:
            return hit, flags
        span *= 4


def _ask_sliding(swa: Sequence[GroupInfo], keys: Mapping[int, Sequence[bytes]], flags: dict[int, np.ndarray],
                 held: Held, store: StoreIndex, lo_tok: int, hi_tok: int, deferred: list[bytes] | None) -> None:
    """Fill ``flags`` for the sliding groups' pages covering ``[lo_tok, hi_tok)``:
    the faster tier first, the store's record and one batched probe for the rest."""
    ask: list[bytes] = []
    where: list[tuple[int, int]] = []
    for g in swa:
        ks, f = keys[g.index], flags[g.index]
        a, b = lo_tok // g.block_size, min(len(ks), hi_tok // g.block_size)
        if b <= a:
            continue
        for i, h in zip(range(a, b), held(g, a, b).tolist()):
            if f[i]:
                continue
            if h:
                f[i] = True
            else:
                ask.append(ks[i])
                where.append((g.index, i))
    if ask:
        for (gi, i), ok in zip(where, store.present(ask, deferred=deferred).tolist()):
            flags[gi][i] = ok
