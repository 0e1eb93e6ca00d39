"""The KV arena: one tensor per device tier, typed views per attention kind.

Memory (see :mod:`hybridkv.pools.arena` for the geometry): one 1-D tensor of
``num_blocks * block_bytes`` bytes, the only KV tensor a pool allocates.  Each
kind sees it through two strided views (no copy)::

    k: [layers_per_block, num_blocks, page_size, heads, k_dim]
    v: [layers_per_block, num_blocks, page_size, heads, v_dim]

``k[s, b]`` is K of layer slot ``s`` of block ``b``: contiguous
``page_size * heads * k_dim`` elements, blocks ``block_bytes`` apart.

Pages are *logical* ids (what the tree and requests hold); each kind keeps a
block table ``table[page] -> blocks_per_page`` block ids, filled when the page
is allocated and cleared when it is freed.  Layer ``l`` of a kind (local index
``i``, ``(group, slot) = divmod(i, layers_per_block)``) of logical page ``p``
lives in ``k[slot, table[p, group]]``.

What an attention kernel gets for layer ``i`` of a kind: ``layer_view(i)``
returns ``(k [num_blocks, page_size, heads, k_dim], v [...], group)`` --
FlashInfer's paged NHD cache and vLLM/FlashAttention's ``[num_blocks,
block_size, heads, dim]`` cache with a page stride of ``block_bytes`` -- and
the block table is ``table[pages, group]`` (``block_table(pages, group)``);
a token slot for vLLM's ``slot_mapping`` / SGLang's ``out_cache_loc`` style
writes is ``block * page_size + offset`` in that view.
"""

from __future__ import annotations

import numpy as np
import torch

from ..spec import AttnKind, ModelSpec
from .allocator import PageAllocator
from .arena import ArenaLayout, KindLayout

__all__ = ["KVArena", "KVBuffers", "KindBuffers", "slots_of_pages"]


class KindBuffers:
    """Views and block table of one attention kind inside a :class:`KVArena`."""

    def __init__(self, spec: ModelSpec, layout: KindLayout, storage: torch.Tensor,
                 block_bytes: int, num_blocks: int, capacity: int) -> None:
        self.kind = layout.kind
        self.layout = layout
        self.layer_ids = spec.layers(layout.kind)
        self._index = {layer: i for i, layer in enumerate(self.layer_ids)}
        item = storage.element_size()
        g, p = max(1, layout.layers_per_block), spec.page_size
        h, dk, dv = layout.heads, layout.k_dim, layout.v_dim
        if layout.num_layers and num_blocks:
            slot, blk = layout.layer_bytes // item, block_bytes // item
            self.k = storage.as_strided((g, num_blocks, p, h, dk), (slot, blk, h * dk, dk, 1), 0)
            self.v = storage.as_strided((g, num_blocks, p, h, dv), (slot, blk, h * dv, dv, 1),
                                        layout.k_bytes // item)
        else:
            self.k = storage.new_empty((0, 0, p, h, dk))
            self.v = storage.new_empty((0, 0, p, h, dv))
        # logical page -> its blocks (-1 while the page is free)
        self.table = np.full((capacity, layout.blocks_per_page), -1, dtype=np.int32)

    # ------------------------------------------------------------- addressing
    def local(self, layer: int) -> int:
        """Index of model layer ``layer`` among this kind's layers."""
        try:
            return self._index[layer]
        except KeyError:
            raise ValueError(f"layer {layer} is not a {self.kind.value} layer") from None

    def layer_view(self, local_layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Kernel-facing paged views of one layer: ``(k [num_blocks, page_size,
        heads, k_dim], v [...], group)``; index them with ``block_table(pages,
        group)``.  O(1), no copy."""
        group, slot = self.layout.group_of(local_layer)
        return self.k[slot], self.v[slot], group

    def block_table(self, pages: np.ndarray, group: int) -> np.ndarray:
        """Physical block ids of logical ``pages`` for layer group ``group``."""
        return self.table[pages, group]

    def physical_slots(self, slots: np.ndarray, group: int = 0) -> np.ndarray:
        """Logical token ``slots`` (what the cache hands out) as slots of layer
        group ``group``'s view, ``block * page_size + offset`` (int64): vLLM's
        ``slot_mapping`` for ``layer_view(i)`` of a layer in that group.  O(n)."""
        blk, off = self._block_offset(slots, group)
        return blk * self.k.shape[2] + off

    def blocks(self, pages: np.ndarray) -> np.ndarray:
        """All blocks of ``pages`` in page-major, group-minor order (what a page
        copy moves): ``[len(pages) * blocks_per_page]`` int64."""
        return self.table[np.asarray(pages, dtype=np.int64)].reshape(-1).astype(np.int64)

    def _block_offset(self, slots: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
        """``(block, offset)`` int64 arrays of logical token ``slots`` in layer group ``group``."""
        slots = np.asarray(slots, dtype=np.int64)
        p = self.k.shape[2]
        return self.table[slots // p, group].astype(np.int64), slots % p

    def _physical(self, local_layer: int, slots: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        group, slot = self.layout.group_of(local_layer)
        return (slot, *self._block_offset(slots, group))

    def read(self, local_layer: int, slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of logical token ``slots`` of one layer: ``[n, heads, dim]`` copies.
        Raises RuntimeError for a slot whose page holds no block for the layer (its
        group gave the page back): never garbage."""
        s, blk, off = self._physical(local_layer, slots)
        if blk.size and blk.min() < 0:
            raise RuntimeError(f"layer {self.layer_ids[local_layer]}: token slot "
                               f"{int(np.asarray(slots)[np.argmax(blk < 0)])} has no KV block")
        bi, oi = torch.from_numpy(blk), torch.from_numpy(off)
        return self.k[s][bi, oi], self.v[s][bi, oi]

    def write(self, local_layer: int, slots: np.ndarray, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[n, heads, dim]`` at logical token ``slots`` of one layer."""
        s, blk, off = self._physical(local_layer, slots)
        bi, oi = torch.from_numpy(blk), torch.from_numpy(off)
        self.k[s][bi, oi] = k.to(device=self.k.device, dtype=self.k.dtype)
        self.v[s][bi, oi] = v.to(device=self.v.device, dtype=self.v.dtype)


class KVArena:
    """The KV memory behind a :class:`~hybridkv.pools.dual.DualPool`.

    Args:
        spec: the model.
        layout: block geometry (:meth:`ArenaLayout.for_spec`).
        num_blocks: blocks in the arena (the budget divided by ``block_bytes``).
        full_pages / swa_pages: logical page capacity of each kind.
        device: where the tensor lives (``"meta"`` allocates nothing).

    ``storage`` is the only tensor: ``num_blocks * block_bytes`` bytes.
    ``blocks`` hands out block ids; :meth:`assign` / :meth:`release` bind them
    to logical pages (called by the pool on alloc/free).
    """

    def __init__(self, spec: ModelSpec, layout: ArenaLayout, num_blocks: int, full_pages: int,
                 swa_pages: int, device: str | torch.device, *, pin: bool = False) -> None:
        self.spec = spec
        self.layout = layout
        self.device = torch.device(device)
        self.num_blocks = int(num_blocks)
        item = spec.dtype_bytes
        if layout.block_bytes % item:
            raise ValueError(f"block of {layout.block_bytes} bytes is not a multiple of the dtype size")
        # pinned host memory (async H2D/D2H) exists only where CUDA does
        pin = bool(pin) and self.device.type == "cpu" and torch.cuda.is_available()
        self.storage = torch.zeros(self.num_blocks * layout.block_bytes // item, dtype=spec.torch_dtype,
                                   device=self.device, pin_memory=pin)
        self.blocks = PageAllocator(self.num_blocks, "blocks")
        self.full = KindBuffers(spec, layout.full, self.storage, layout.block_bytes, self.num_blocks,
                                int(full_pages))
        self.swa = KindBuffers(spec, layout.swa, self.storage, layout.block_bytes, self.num_blocks,
                               int(swa_pages))

    @property
    def nbytes(self) -> int:
        return self.storage.untyped_storage().nbytes() if self.device.type != "meta" else 0

    def of(self, kind: AttnKind | str) -> KindBuffers:
        return self.full if AttnKind(kind) is AttnKind.FULL else self.swa

    def assign(self, kind: AttnKind, pages: np.ndarray) -> None:
        """Give freshly allocated logical ``pages`` their blocks.  O(n)."""
        kb = self.of(kind)
        n = kb.layout.blocks_per_page
        if n == 0 or len(pages) == 0:
            return
        got = self.blocks.alloc(len(pages) * n)
        if got is None:  # the pool's byte accounting guarantees blocks; this is a bug
            raise RuntimeError("arena out of blocks while the byte budget had room")
        kb.table[pages] = got.reshape(-1, n)

    def release(self, kind: AttnKind, pages: np.ndarray) -> None:
        """Return the blocks of logical ``pages`` (being freed).  O(n)."""
        kb = self.of(kind)
        if kb.layout.blocks_per_page == 0 or len(pages) == 0:
            return
        blocks = kb.table[pages].reshape(-1)
        if kb.layout.group_columns:  # a group may have given its columns back already
            blocks = blocks[blocks >= 0]
        self.blocks.free_trusted(blocks)
        kb.table[pages] = -1

    def release_group(self, group: int, pages: np.ndarray) -> None:
        """Return sliding group ``group``'s blocks of SWA ``pages`` (the group no
        longer needs them; the pages stay allocated for the other groups).
        Pages whose group blocks are gone already are skipped.  O(n)."""
        first, count = self.swa.layout.group_columns[group]
        if len(pages) == 0 or count == 0:
            return
        cols = self.swa.table[pages, first:first + count]
        blocks = cols.reshape(-1)
        self.blocks.free_trusted(blocks[blocks >= 0])
        self.swa.table[pages, first:first + count] = -1

    def check_invariants(self, full_used: np.ndarray, swa_used: np.ndarray,
                         group_held: list[np.ndarray] | None = None) -> None:
        """Blocks of used pages are exactly the allocated blocks, each once;
        ``group_held[g]`` (several sliding groups): which of ``swa_used`` still
        hold sliding group ``g``'s blocks (the others hold none)."""
        swa_blocks = self.swa.table[swa_used]
        if group_held is not None and self.swa.layout.group_columns:
            for (first, count), held in zip(self.swa.layout.group_columns, group_held):
                cols = swa_blocks[:, first:first + count]
                assert (cols[held] >= 0).all() and (cols[~held] < 0).all(), "group blocks"
            swa_blocks = swa_blocks[swa_blocks >= 0]
        used = np.concatenate([self.full.table[full_used].reshape(-1), swa_blocks.reshape(-1)])
        assert (used >= 0).all(), "a used page has no block"
        assert np.unique(used).size == used.size == self.blocks.num_used, "block ownership"


KVBuffers = KVArena  # the pool's buffers (name kept for existing callers)


def slots_of_pages(pages: np.ndarray, page_size: int) -> np.ndarray:
    """Token slots of ``pages`` in order: ``[len(pages) * page_size]`` int64.  O(n)."""
    pages = np.asarray(pages, dtype=np.int64)
    return (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)[None, :]).reshape(-1)
