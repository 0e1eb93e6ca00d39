"""Arena geometry: how pages of both attention kinds share one block pool.

One device tier holds ONE tensor of ``num_blocks * block_bytes`` bytes.  A
*block* is the unit of memory; any free block can back a page of either kind,
so memory flows between full and SWA pages one block at a time and the
tensors never exceed the budget (this is vLLM's hybrid allocator: one block
pool, each kind's layers view the same storage).

Inside a block, layers of one kind sit side by side, each as ``K[page_size,
heads, k_dim]`` followed by ``V[page_size, heads, v_dim]`` (one *layer slot*
of ``layer_bytes``).  A block holds ``layers_per_block`` layer slots of the
kind that owns it, so a page of a kind with ``L`` layers needs
``blocks_per_page = ceil(L / layers_per_block)`` blocks: *group* ``j`` of the
page holds the kind's layers ``[j * g, (j + 1) * g)``.

The block size is chosen from the model alone (not the budget), among
multiples of each kind's layer slot, to waste the least memory on unused
layer slots for one page of each kind, then to use the fewest blocks per
page.  MiMo-V2.5-Pro at page 64 (10 full and 60 SWA layers, 8 KV heads
each): blocks of 3,276,800 bytes, a full page is 1 block of 10 layers, a SWA
page 6 blocks of 10 layers, nothing wasted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..spec import AttnKind, ModelSpec

__all__ = ["ArenaLayout", "KindLayout", "arena_page_bytes"]

# Candidates whose waste is within this of the best are equal; fewer blocks win.
_WASTE_SLACK = 0.005


@dataclass(frozen=True)
class KindLayout:
    """Geometry of one attention kind inside the arena's blocks.

    Attributes:
        kind: the attention kind.
        num_layers: model layers of this kind (0: the model has none).
        heads, k_dim, v_dim: KV shape per token.
        k_bytes / layer_bytes: bytes of K of one layer for one page / of K+V.
        layers_per_block: layer slots of this kind in one block (``g``).
        blocks_per_page: blocks of one page (``ceil(num_layers / g)``; with
            several sliding groups the sum of each group's ``ceil(n / g)``).
        group_columns: with several sliding-window groups, per group (smallest
            window first) ``(first, count)``: the block columns of a page that
            hold that group's layers (a block never mixes groups, so a group
            frees its blocks of a page on its own).  Empty: one group.
        places: with several groups, ``(column, slot)`` of each local layer.
    """

    kind: AttnKind
    num_layers: int
    heads: int
    k_dim: int
    v_dim: int
    k_bytes: int
    layer_bytes: int
    layers_per_block: int
    blocks_per_page: int
    group_columns: tuple[tuple[int, int], ...] = ()
    places: tuple[tuple[int, int], ...] = ()

    def group_of(self, local_layer: int) -> tuple[int, int]:
        """``(group, slot)`` of the kind's ``local_layer``: which block of a page
        and which layer slot inside it.  O(1)."""
        if self.places:
            return self.places[local_layer]
        return divmod(local_layer, self.layers_per_block)


@dataclass(frozen=True)
class ArenaLayout:
    """Block size and per-kind geometry for one model (see module docstring)."""

    page_size: int
    block_bytes: int
    full: KindLayout
    swa: KindLayout

    def of(self, kind: AttnKind | str) -> KindLayout:
        return self.full if AttnKind(kind) is AttnKind.FULL else self.swa

    def page_bytes(self, kind: AttnKind | str) -> int:
        """Bytes one page of ``kind`` takes from the arena (its blocks)."""
        return self.of(kind).blocks_per_page * self.block_bytes

    @classmethod
    def for_spec(cls, spec: ModelSpec) -> "ArenaLayout":
        """Choose the block size for ``spec``.  O(layers^2)."""
        p, item = spec.page_size, spec.dtype_bytes
        geo = {}
        # layers per block column set: the full kind is one set; each sliding group its own
        sets = {AttnKind.FULL: [len(spec.full_layers)],
                AttnKind.SWA: [len(g.layers) for g in spec.sliding_groups] or [0]}
        for kind in (AttnKind.FULL, AttnKind.SWA):
            shape = spec.shape(kind)
            k_bytes = p * shape.num_kv_heads * shape.k_head_dim * item
            v_bytes = p * shape.num_kv_heads * shape.v_head_dim * item
            geo[kind] = (len(spec.layers(kind)), shape, k_bytes, k_bytes + v_bytes)
        present = [k for k in geo if geo[k][0] > 0]
        slot_max = max(geo[k][3] for k in present)
        payload = sum(geo[k][0] * geo[k][3] for k in present)
        candidates = sorted({m * geo[k][3] for k in present for m in range(1, geo[k][0] + 1)
                             if m * geo[k][3] >= slot_max})
        scored = []
        for b in candidates:
            blocks = sum(math.ceil(n / (b // geo[k][3])) for k in present for n in sets[k])
            waste = blocks * b / payload - 1.0
            scored.append((waste, blocks, b))
        least = min(w for w, _, _ in scored)
        best = min((s for s in scored if s[0] <= least + _WASTE_SLACK), key=lambda s: (s[1], s[0]))
        block = best[2]
        kinds = {}
        for kind, (n, shape, kb, lb) in geo.items():
            g = block // lb if n else 0
            columns, places = (_group_places(spec, g) if kind is AttnKind.SWA and len(sets[kind]) > 1
                               else ((), ()))
            per_page = sum(c for _, c in columns) if columns else (math.ceil(n / g) if n else 0)
            kinds[kind] = KindLayout(kind, n, shape.num_kv_heads, shape.k_head_dim, shape.v_head_dim,
                                     kb, lb, g, per_page, columns, places)
        return cls(p, block, kinds[AttnKind.FULL], kinds[AttnKind.SWA])

    def group_page_bytes(self, group: int) -> int:
        """Bytes sliding group ``group`` (index into ``spec.sliding_groups``) takes
        of one SWA page: its block columns."""
        cols = self.swa.group_columns
        return (cols[group][1] if cols else self.swa.blocks_per_page) * self.block_bytes


def _group_places(spec: ModelSpec, per_block: int) -> tuple[tuple[tuple[int, int], ...],
                                                             tuple[tuple[int, int], ...]]:
    """Block columns of each sliding group and ``(column, slot)`` of each SWA layer
    (local index among ``spec.swa_layers``): groups in ``spec.sliding_groups``
    order, each group's layers packed ``per_block`` to a block."""
    local = {layer: i for i, layer in enumerate(spec.swa_layers)}
    places: list[tuple[int, int]] = [(0, 0)] * len(local)
    columns = []
    first = 0
    for group in spec.sliding_groups:
        for j, layer in enumerate(group.layers):
            places[local[layer]] = (first + j // per_block, j % per_block)
        count = math.ceil(len(group.layers) / per_block)
        columns.append((first, count))
        first += count
    return tuple(columns), tuple(places)


def arena_page_bytes(spec: ModelSpec, kind: AttnKind | str) -> int:
    """Bytes a page of ``kind`` costs in a real arena for ``spec`` (>= the model's
    ``bytes_per_page``: a block may leave layer slots unused).  Size budgets of
    caches with ``device="cpu"``/``"cuda"`` with it."""
    return ArenaLayout.for_spec(spec).page_bytes(kind)
