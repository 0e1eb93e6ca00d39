"""What vLLM's device cache (L1) holds, as L2's index needs it.

The connector writes every saved page through to L2, so under load L2 holds a
copy of many pages vLLM's device cache still holds; a hit on those is served by
the device, and the L2 pages worth keeping are the ones the device lacks.  As
hybridkv's own L2 does under write-through (:attr:`HostTier.l1_copies_first
<hybridkv.tiers.host.HostTier.l1_copies_first>`), the connector's L2 evicts its
copies of pages L1 holds before the pages only it holds, and when L1 gives up a
page L2 lacks it is copied down before its block is reused (repair case 1:
device complete, host deficient).  Both need to know which full pages L1 holds,
in L2's keys; :class:`L1View` keeps that, on the scheduler side, beside L2's one
index (:mod:`.l2`).

* A full-attention block is *held* under a page key from the moment the
  connector sees it cached with that page (a prefill chunk's pages, a local hit's
  pages) until vLLM's block pool removes its hash: the one place a block stops
  being a prefix-cache block, whether vLLM's own manager reuses it or hybridkv's
  tree evicts it.  The view wraps that method of the pool it is bound to
  (:meth:`L1View.hook`; vLLM 0.32's ``BlockPool._remove_cached_block_hashes``);
  where the pool has no such method the rule stays off.
* A block removed while L2 lacks its page is *rescued*: when the scheduler side
  builds the step's metadata, L2's index admits the step's removed pages it lacks
  (one admit) and the metadata names (block, key, row); the worker copies the
  block into the row first thing in that step, in
  :meth:`~.connector.HybridKVConnector.handle_preemptions`, which vLLM calls before
  it touches the step's blocks.  A block is removed only when it is free (no
  request holds it), so its bytes are the page's until the step that reuses it
  runs; and that step writes it before its forward pass: vLLM 0.32 zeroes a
  step's newly allocated full-attention blocks while it updates its batch
  (``new_block_ids_to_zero``), so a copy in ``start_load_kv`` would read zeros
  in some layers (seen on vLLM's CPU build, tiny MiMo-V2:
  ``tests/test_vllm_pushed_out.py``).

Sliding-window pages are not tracked: L2's copies rule is about full pages (an
SWA page leaves L2 with the full page it is based on, as before).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hybridkv.tiers.keys import parent_keys

from .l2 import HostPageIndex

__all__ = ["L1View"]


class L1View:
    """Which full pages vLLM's device cache holds, told to L2's index; the pages it
    gives up that L2 lacks, queued to be copied down.

    Args:
        l2: L2's index (its ``l1_copies_first`` is switched on by :meth:`hook`).
    """

    def __init__(self, l2: HostPageIndex) -> None:
        self.l2 = l2
        self._pool: Any = None
        self._held: dict[int, tuple[int, bytes]] = {}  # block id -> (group index, full key)
        self._blocks_of: dict[bytes, int] = {}  # full key -> blocks holding it (vLLM may compute a page twice)
        self._parent: dict[bytes, bytes | None] = {}  # held full key -> the key of the page before it
        self._gone: dict[int, dict[bytes, tuple[int, bytes | None]]] = {}  # per group: pages given up
        # this step -> (block, parent key)
        self.rescued = 0  # pages queued to be copied down so far
        # told the (group index, keys, L2 rows) each copy-down admits (the tree's records, :mod:`.names`)
        self.on_admit: Callable[[int, list[bytes], Any], None] | None = None

    def hook(self, block_pool: Any) -> bool:
        """Follow ``block_pool``'s removals of cached blocks (once per pool) and turn
        L2's copies rule on.  Returns whether the pool can be followed."""
        if self._pool is block_pool:
            return True
        remove = getattr(block_pool, "_remove_cached_block_hashes", None)
        if remove is None or not hasattr(block_pool, "blocks"):
            return False

        held = self._held  # (cleared, never replaced)

        def removed(block: Any) -> Any:
            out = remove(block)
            if block.block_id in held:  # most removals are blocks no full page is tracked in
                self.released(block.block_id)
            return out

        block_pool._remove_cached_block_hashes = removed
        self._pool = block_pool
        self._held.clear()
        self._blocks_of.clear()
        self._parent.clear()
        self._gone.clear()
        self.l2.tier.l1_copies_first = True
        return True

    def held(self, gi: int, block_ids: Sequence[int], keys: Sequence[bytes], pages: Sequence[int]) -> None:
        """Blocks of full group ``gi`` that hold pages ``pages`` (parallel) of a
        request whose keys are ``keys``; only blocks the pool has cached count (a block
        without a hash is never removed, so it could not be followed).  A page's
        parent (the key before it) goes with its copy-down (L2's key tree).  O(n)."""
        if self._pool is None:
            return
        blocks, held, l2 = self._pool.blocks, self._held, self.l2.tier
        pages = list(pages)
        for b, i, up in zip(block_ids, pages, parent_keys(keys, pages)):
            k = keys[i]
            now = held.get(b)
            if now is not None and now[1] == k:
                continue
            if blocks[b].block_hash is None:
                continue
            if now is not None:  # reused without a removal seen: the old page left
                self._drop(now[1])
            held[b] = (gi, k)
            self._blocks_of[k] = self._blocks_of.get(k, 0) + 1
            self._parent[k] = up
            l2.mark_l1([k], True)

    def held_prefix(self, groups: Sequence[Any], blocks: Sequence[Sequence[Any]],
                    keys: dict[int, list[bytes]], tokens: int) -> None:
        """A request's first ``tokens`` are cached on the device (its local hit):
        :meth:`held` for each full group's blocks (``blocks[g.index]``, vLLM's block
        objects) and keys in that prefix.  O(pages)."""
        for g in groups:
            if not g.is_swa:
                blk = blocks[g.index][:tokens // g.block_size]
                self.held(g.index, [b.block_id for b in blk], keys[g.index], range(len(blk)))

    def _drop(self, key: bytes) -> int:
        """One block holding ``key`` left L1; returns how many still hold it."""
        self.l2.tier.mark_l1([key], False)
        n = self._blocks_of.pop(key, 1) - 1
        if n > 0:
            self._blocks_of[key] = n
        else:
            self._parent.pop(key, None)
        return n

    def released(self, block_id: int) -> None:
        """vLLM's pool removed ``block_id``'s hash: L1 no longer holds its page, and the
        block is a candidate for a copy-down (decided per step, :meth:`take_rescues`).
        O(1)."""
        got = self._held.pop(block_id, None)
        if got is None:
            return
        gi, key = got
        parent = self._parent.get(key)
        if not self._drop(key):  # no other block holds the page
            self._gone.setdefault(gi, {})[key] = (block_id, parent)

    def take_rescues(self) -> dict[int, tuple[list[int], list[bytes], list[int]]]:
        """The copy-downs of the blocks given up since the last call, per group index:
        block ids, keys and L2 rows.  Only pages that L2 lacks, that no block holds
        again and that L2 can make room for (one admit per group); the rest are
        dropped.  O(candidates) plus L2's admit."""
        out: dict[int, tuple[list[int], list[bytes], list[int]]] = {}
        gone, self._gone = self._gone, {}
        for gi, cand in gone.items():
            keys = [k for k in cand if k not in self._blocks_of]
            if keys:
                keys = [k for k, h in zip(keys, self.l2.held(False, keys).tolist()) if not h]
            idx, rows = self.l2.admit(False, keys, parents=[cand[k][1] for k in keys]) if keys else ((), ())
            if len(idx):
                sel = [keys[i] for i in idx.tolist()]
                out[gi] = ([cand[k][0] for k in sel], sel, [int(r) for r in rows.tolist()])
                self.rescued += len(sel)
                if self.on_admit is not None:
                    self.on_admit(gi, sel, rows)
        return out

    def pending(self) -> bool:
        """Whether copy-downs wait for the next step's metadata."""
        return bool(self._gone)

    def __len__(self) -> int:
        return len(self._held)


def copy_down(rescues: dict[int, tuple[list[int], list[bytes], list[int]]],
              buffers: dict[int, Any], rows: Any) -> int:
    """The worker's part of a rescue: copy each named block of vLLM's KV into its L2
    row (``rows``: the worker's :class:`.l2.HostPageRows`, or None: no L2), before
    the step writes any block.  Returns rows written.  O(pages * page bytes)."""
    from .kvio import gather_host

    n = 0
    for gi, (ids, keys, slots) in rescues.items():
        if ids and rows is not None and gi in buffers and buffers[gi].page_bytes == rows.page_bytes:
            n += rows.write(False, slots, keys, gather_host(buffers[gi], ids))
    return n
