"""How hybridkv's tree pages map onto vLLM 0.32's KV cache groups and block pool.

:func:`classify_groups` sorts vLLM's groups into full and sliding-window
:class:`Layout` s (a tree page is the largest block size; a group with smaller
blocks spans several per page); :class:`BlockPagePool` is the tree's
``PagePool`` over vLLM's ``BlockPool``; :class:`PrefixOptions` is the tree's
policy as configured from vLLM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from hybridkv.cache_config import CacheConfig
from hybridkv.defaults import SWA_CHECKPOINT
from hybridkv.modes import StrMode
from hybridkv.radix import OneWindowPool
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

__all__ = ["OPTION_NAMES", "BlockPagePool", "HitRows", "Layout", "PrefixOptions", "SwaHold", "classify_groups"]


class SwaHold(StrMode):
    """Which out-of-window SWA blocks the prefix manager holds before vLLM frees
    them (``PrefixOptions.swa_release``, formerly ``retention``)."""

    ADAPTIVE = "adaptive"  #: all while more than ``spare_fraction`` of the blocks are free, else the policy's windows
    SPARSE = "sparse"      #: only the retention policy's windows

#: group specs the tree pages (exact types: subclasses such as sink or RSWA
#: attention change what a block holds)
_FULL_SPECS = (FullAttentionSpec, MLAAttentionSpec)
_SWA_SPECS = (SlidingWindowSpec, SlidingWindowMLASpec)


@dataclass(frozen=True)
class PrefixOptions:
    """The tree's policy inside vLLM.

    Attributes:
        swa_checkpoint: K tokens between retention checkpoints (0: off).
        swa_release: a :class:`SwaHold` (or its string): ``"adaptive"`` (hold
            every out-of-window SWA block while more than ``spare_fraction`` of
            the blocks are free, else only the policy's windows) or
            ``"sparse"`` (only the policy's windows).  The old name
            ``retention`` is still accepted (keyword, ``--additional-config``
            key, ``hybridkv_retention`` extra key) and read.
        spare_fraction: see ``swa_release``.
        ranking: the tree's leaf ranking (:class:`hybridkv.radix.TreeConfig`).
            ``"adaptive"`` here, where the core's default is ``"value"``: inside
            vLLM's scheduler (requests prefilled in chunks side by side, their
            outputs cached behind each prompt) the learned ``value`` ranking lost
            to ARC's rule on both traces measured, most at tight budgets
            (docs/vllm.md, *Measured through vLLM's real scheduler*).
    """

    swa_checkpoint: int = SWA_CHECKPOINT
    swa_release: SwaHold = SwaHold.ADAPTIVE
    spare_fraction: float = CacheConfig.spare_fraction
    ranking: str = "adaptive"

    def __post_init__(self) -> None:
        if isinstance(self.swa_checkpoint, bool) or not isinstance(self.swa_checkpoint, int) or self.swa_checkpoint < 0:
            raise ValueError(f"swa_checkpoint must be an int >= 0, got {self.swa_checkpoint!r}")
        object.__setattr__(self, "swa_release", SwaHold.parse(self.swa_release, "swa_release"))
        if not 0.0 <= float(self.spare_fraction) < 1.0:
            raise ValueError(f"spare_fraction must be in [0, 1), got {self.spare_fraction!r}")

    @property
    def retention(self) -> SwaHold:
        """The old name of :attr:`swa_release` (read only)."""
        return self.swa_release

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None,
                   overrides: dict[str, Any] | None = None) -> PrefixOptions:
        """Options from ``kv_connector_extra_config`` keys ``hybridkv_<name>``
        (``hybridkv_swa_checkpoint``, ``hybridkv_swa_release``, ...), then
        ``overrides`` (option names, e.g. ``--additional-config``'s), which win.
        The old name ``retention`` counts as ``swa_release`` in either."""
        extra = extra or {}
        kw = _new_names({name: extra[f"hybridkv_{name}"] for name in OPTION_NAMES if f"hybridkv_{name}" in extra})
        kw.update(_new_names(dict(overrides or {})))
        return cls(**kw)


def _new_names(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the old key ``retention`` under its new name ``swa_release``."""
    if "retention" in options:
        if "swa_release" in options:
            raise ValueError("give swa_release or its old name retention, not both")
        options["swa_release"] = SwaHold.parse(options.pop("retention"), "retention")
    return options


def _accept_old_names(init: Any) -> Any:
    """``PrefixOptions(retention=...)``, the old keyword of ``swa_release``, keeps working."""

    @functools.wraps(init)
    def __init__(self: PrefixOptions, *args: Any, retention: object = None, **kwargs: Any) -> None:
        if retention is not None:
            kwargs["retention"] = retention
            kwargs = _new_names(kwargs)
        init(self, *args, **kwargs)

    return __init__


PrefixOptions.__init__ = _accept_old_names(PrefixOptions.__init__)  # type: ignore[method-assign]

#: the options' names (the fields of :class:`PrefixOptions`, and ``retention``, the old name of ``swa_release``)
OPTION_NAMES = (*(f.name for f in fields(PrefixOptions)), "retention")


@dataclass(frozen=True)
class Layout:
    """How a tree page maps onto vLLM's blocks for one attention kind: the groups
    of that kind and, per group, how many of its blocks one page spans (a page is
    the largest block size; a smaller block size divides it)."""

    groups: tuple[int, ...]
    per_page: tuple[int, ...]

    @property
    def blocks_per_page(self) -> int:
        return sum(self.per_page)

    def page_blocks(self, rows: list[list[Any]], i: int) -> tuple[Any, ...] | None:
        """Every group's blocks of page ``i`` from the request's block rows, in
        group order; None where a group lacks one (not allocated, or released).  O(blocks)."""
        out: list[Any] = []
        for row, k in zip(rows, self.per_page):
            part = row[i * k:(i + 1) * k]
            if len(part) < k or any(b.is_null for b in part):
                return None
            out.extend(part)
        return tuple(out)

    def split(self, blocks: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """A page's blocks per group (inverse of :meth:`page_blocks`)."""
        out, o = [], 0
        for k in self.per_page:
            out.append(blocks[o:o + k])
            o += k
        return out


def classify_groups(kv_cache_config: Any) -> tuple[Layout, Layout, int, int]:
    """``(full layout, sliding-window layout, page size, largest window)``.

    The tree's page is the largest block size; every group's block size must
    divide it (vLLM's hybrid allocator halves a group's block size when its
    layers hold twice the bytes per token).  Raises ValueError naming the
    group when a group is neither full nor sliding-window attention (Mamba,
    chunked local, cross attention), or for a model without both kinds.
    """
    full: list[int] = []
    swa: list[int] = []
    sizes: dict[int, int] = {}
    window = 0
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if type(spec) in _SWA_SPECS:
            swa.append(gid)
            window = max(window, int(spec.sliding_window))
        elif type(spec) in _FULL_SPECS:
            full.append(gid)
        else:
            raise ValueError(f"kv_cache_groups[{gid}] is {type(spec).__name__}: hybridkv's prefix cache "
                             "handles full and sliding-window attention groups only")
        sizes[gid] = int(spec.block_size)
    if not full:
        raise ValueError("kv_cache_groups: no full-attention group; hybridkv's prefix cache needs one")
    if not swa:
        raise ValueError("kv_cache_groups: no sliding-window group; hybridkv's prefix cache is for hybrid "
                         "models (vLLM's own serves full attention alone)")
    page = max(sizes.values())
    odd = {g: b for g, b in sizes.items() if page % b}
    if odd:
        raise ValueError(f"kv_cache_groups: block sizes {sorted(set(sizes.values()))} do not divide the largest "
                         f"({page}); hybridkv pages all groups by it")

    def layout(ids: list[int]) -> Layout:
        return Layout(tuple(ids), tuple(page // sizes[g] for g in ids))

    return layout(full), layout(swa), page, window


class BlockPagePool(OneWindowPool):
    """hybridkv's ``PagePool`` over vLLM's ``BlockPool``: the tree owns one
    reference on every block it caches and gives it back here.  A page's
    blocks are every group's (see :meth:`take`), so the tree sees one sliding
    window (the groups' largest) and no side groups."""

    def __init__(self, block_pool: Any) -> None:
        self.block_pool = block_pool
        #: page id -> the other groups' blocks of that page (full and SWA ids differ:
        #: a block belongs to one group at a time)
        self.more: dict[int, tuple[Any, ...]] = {}
        #: page ids the tree holds a reference on
        self.owned = np.zeros(len(block_pool.blocks), dtype=bool)
        self.freed_blocks = 0

    def take(self, blocks: tuple[Any, ...], *, held: bool = False) -> int:
        """A page handed to the tree (its blocks, every group's; the id is the
        first's): one tree reference on each, unless the tree holds this very page
        already (then a ``held`` reference the caller passes on is given back).
        ``held``: the caller's own reference becomes the tree's.  O(blocks)."""
        pid = blocks[0].block_id
        rest = blocks[1:]
        if self.owned[pid]:
            if held:
                self.block_pool.free_blocks(blocks)
            return pid
        if not held:
            self.block_pool.touch(blocks)
        self.owned[pid] = True
        if rest:
            self.more[pid] = rest
        return pid

    def blocks(self, page: int) -> tuple[Any, ...]:
        """Every block of a tree page (see :meth:`take`)."""
        return (self.block_pool.blocks[page],) + self.more.get(page, ())

    def _free(self, pages: np.ndarray) -> None:
        bp = self.block_pool
        blocks = []
        self.owned[pages] = False
        for p in pages.tolist():
            blocks.append(bp.blocks[p])
            blocks.extend(self.more.pop(p, ()))
        bp.free_blocks(blocks)
        self.freed_blocks += len(blocks)
        # a block nobody holds now cannot hit: drop its hash so KV events say so
        gone = {b.block_id for b in blocks if b.ref_cnt == 0 and b.block_hash is not None}
        if gone:
            bp.evict_blocks(gone)

    def free_full_trusted(self, pages: np.ndarray) -> None:
        """Give back the tree's reference on every block of full ``pages``."""
        self._free(pages)

    def free_swa_trusted(self, pages: np.ndarray) -> None:
        """Give back the tree's reference on every block of SWA ``pages``."""
        self._free(pages)


class HitRows:
    """The blocks a hit hands vLLM (``get_computed_blocks``), per KV-cache group.

    Args:
        pool: the tree's pages (:class:`BlockPagePool`).
        full, swa: the full and sliding-window layouts (:func:`classify_groups`).
        windows: each sliding-window group's window in tokens, in ``swa.groups`` order.
        n_groups: vLLM's KV-cache groups.
        page_size: tokens per tree page.
    """

    def __init__(self, pool: BlockPagePool, full: Layout, swa: Layout, windows: list[int], n_groups: int,
                 page_size: int) -> None:
        self.pool, self.full, self.swa, self.windows, self.n_groups = pool, full, swa, windows, n_groups
        self.page_size = page_size

    def rows(self, full: np.ndarray, swa: np.ndarray, end: int | None = None,
             safe: int | None = None) -> tuple[list[Any], ...] | None:
        """Per group, the blocks of a hit's pages (``full`` and ``swa`` page ids): full
        groups all, sliding-window groups the blocks their own window reads before
        ``end`` (the tokens vLLM counts computed; default the hit's end), vLLM's null
        block before them.  The tree holds SWA on the ``window_pages`` pages before a
        window-safe hit, which cover every group's window.  A window repair passes
        ``safe``, the hit's window-safe part: window blocks at or past it are None
        (fresh blocks go there), and a window block the device lacks below it makes
        the answer None.  O(pages)."""
        pool, lay, P = self.pool, self.swa, self.page_size
        null = pool.block_pool.null_block
        out: list[list[Any]] = [[] for _ in range(self.n_groups)]
        for p in full.tolist():
            for gid, part in zip(self.full.groups, self.full.split(pool.blocks(p))):
                out[gid].extend(part)
        n = int(full.size)
        top = n * P if end is None else end
        fresh_from = n * P if safe is None else safe
        for j, (gid, k, window) in enumerate(zip(lay.groups, lay.per_page, self.windows)):
            bs = P // k
            row: list[Any] = [null] * (n * k)
            for i in range(max(0, top - window + 1) // bs, n * k):  # vLLM's blocks
                if i * bs >= fresh_from:
                    row[i] = None
                    continue
                page = int(swa[i // k])
                if page < 0:
                    assert safe is not None, "a window-safe hit without its window"
                    return None
                row[i] = lay.split(pool.blocks(page))[j][i % k]
            out[gid] = row
        return tuple(out)
