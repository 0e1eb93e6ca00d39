"""Worker side: vLLM's per-layer KV tensors <-> page payloads <-> L2 (host) / L3.

vLLM hands the connector one tensor per attention layer (``register_kv_caches``).
Whatever the backend's layout, one dimension indexes blocks (size
``num_blocks``); everything else is the interior of a block.  A page payload
of a group is, for one block id, the interiors of every layer of that group
(sorted by layer name) laid end to end: ``sum(layer block bytes)`` bytes.

Blocks move through :func:`hybridkv.transfer.prepare_block_rows`: the runs
of every layer's block interiors, planned once per call and issued as one
batched copy (copy engines beside a GPU, one C ``memcpy`` loop on the CPU).
A layout that plan cannot express (a block interior that is not dense) falls
back to ``index_select`` / ``index_copy_`` per layer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridkv.tiers.storage import StorageBackend
from hybridkv.transfer import prepare_block_rows

if TYPE_CHECKING:
    from .l2 import HostPageRows

__all__ = ["GroupBuffers", "gather_host", "load_pages", "save_pages", "store_rows"]

# Under the "vllm." namespace: vLLM configures that logger (handler, format,
# VLLM_LOGGING_LEVEL), so these lines appear in the server log.
logger = logging.getLogger("vllm.hybridkv_vllm.kvio")


@dataclass
class _Layer:
    name: str
    tensor: torch.Tensor
    block_dim: int
    elems: int  # elements of one block of this layer


def _block_dim(t: torch.Tensor, num_blocks: int, name: str) -> int:
    for d, size in enumerate(t.shape):
        if size == num_blocks:
            return d
    raise ValueError(f"kv_caches[{name!r}] of shape {tuple(t.shape)} has no dimension of "
                     f"num_blocks={num_blocks}")


class GroupBuffers:
    """The registered KV tensors of one KV-cache group.

    Args:
        kv_caches: ``{layer_name: tensor}`` from vLLM (all layers of the model).
        layer_names: the layers of this group.
        num_blocks: ``kv_cache_config.num_blocks`` (size of the block dimension).
    """

    def __init__(self, kv_caches: dict[str, torch.Tensor], layer_names: Sequence[str],
                 num_blocks: int) -> None:
        self.layers: list[_Layer] = []
        for name in sorted(layer_names):
            if name not in kv_caches:
                raise ValueError(f"kv_caches lacks layer {name!r} of this group")
            t = kv_caches[name]
            bd = _block_dim(t, num_blocks, name)
            self.layers.append(_Layer(name, t, bd, t.numel() // t.shape[bd]))
        if not self.layers:
            raise ValueError("layer_names must name at least one layer")
        dtypes = {lay.tensor.dtype for lay in self.layers}
        if len(dtypes) != 1:
            raise ValueError(f"layers of one group must share a dtype, got {dtypes}")
        self.dtype = self.layers[0].tensor.dtype
        self.page_elems = sum(lay.elems for lay in self.layers)
        self.page_bytes = self.page_elems * self.layers[0].tensor.element_size()

    def _plan(self, block_ids: Sequence[int], rows: torch.Tensor, to_rows: bool):  # noqa: ANN202
        """The prepared block <-> rows copy, or None where the layout needs torch."""
        try:
            return prepare_block_rows([lay.tensor for lay in self.layers],
                                      [lay.block_dim for lay in self.layers],
                                      list(block_ids), rows, to_rows=to_rows)
        except ValueError:
            return None  # e.g. a permuted (non-dense) block interior

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, page_elems]`` rows, row i = block ``block_ids[i]`` of all layers.

        ``out``: where to put them (e.g. pinned host rows: the copy engines
        fill them directly); else allocated beside the KV tensors.  Mutates
        only the rows.  O(n * page bytes).
        """
        n = len(block_ids)
        dev = self.layers[0].tensor.device
        rows = out if out is not None else torch.empty((n, self.page_elems), dtype=self.dtype,
                                                       device=dev)
        plan = self._plan(block_ids, rows, True)
        if plan is not None:
            plan.issue()
            if plan.device is not None:
                torch.cuda.current_stream(dev).synchronize()  # the rows are read next
            return rows
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=dev)
        parts = [lay.tensor.index_select(lay.block_dim, idx).movedim(lay.block_dim, 0)
                 .reshape(n, -1) for lay in self.layers]
        rows.copy_(torch.cat(parts, dim=1))
        return rows

    def scatter(self, rows: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Write row i into block ``block_ids[i]`` of every layer.

        ``rows``: ``[n, page_elems]`` of the group's dtype.  Mutates the vLLM
        KV tensors only.  O(n * page bytes).
        """
        plan = self._plan(block_ids, rows.contiguous(), False)
        if plan is not None:
            plan.issue()
            return
        dev = self.layers[0].tensor.device
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=dev)
        off = 0
        for lay in self.layers:
            t = lay.tensor
            inner = list(t.shape)
            del inner[lay.block_dim]
            src = rows[:, off:off + lay.elems].reshape(idx.numel(), *inner).to(dev)
            t.index_copy_(lay.block_dim, idx, src.movedim(0, lay.block_dim))
            off += lay.elems


def gather_host(group: GroupBuffers, block_ids: Sequence[int]) -> torch.Tensor:
    """Copy blocks out of vLLM's KV tensors: ``[n, page_bytes]`` uint8 on the host.

    After this returns the blocks may be reused (the rows are a private copy).
    On a CPU build this is one C ``memcpy`` loop; on an accelerator one
    batched DMA of the blocks' runs into pinned rows.  O(n * page bytes).
    """
    ids = list(block_ids)
    out = None
    if group.layers[0].tensor.device.type == "cuda":  # the copy engines write host rows
        out = torch.empty((len(ids), group.page_elems), dtype=group.dtype, pin_memory=True)
    return group.gather(ids, out).view(torch.uint8)


def store_rows(backend: StorageBackend, keys: Sequence[bytes], rows: torch.Tensor,
               l2: HostPageRows | None = None, swa: bool = False,
               slots: Sequence[int] | None = None) -> tuple[int, int, int]:
    """Store host ``rows`` (from :func:`gather_host`) into L2 (when given) and L3.
    ``slots``: parallel to ``keys``, the L2 row each page goes to (the scheduler's
    index assigned it; ``-1``: not stored in L2).

    L3 is written through where a key is missing (a fresh process or another
    server can only hit there); L2 keeps a host copy so this worker's next
    load skips L3.  Returns ``(stored_l3, skipped_existing_l3, stored_l2)``.
    Backend faults come back as ``False`` from ``put`` (counted by the
    backend); nothing raises.  O(n * page bytes).
    """
    if not keys:
        return 0, 0, 0
    in_l2 = 0
    if l2 is not None and slots is not None and l2.page_bytes == rows.shape[1]:
        in_l2 = l2.write(swa, slots, keys, rows)
    present = backend.exists(list(keys))
    todo = [i for i, p in enumerate(present) if not p]
    if not todo:
        return 0, len(keys), in_l2
    raw = rows.numpy()
    ok = backend.put([keys[i] for i in todo], [raw[i] for i in todo])
    return sum(ok), len(keys) - len(todo), in_l2


def save_pages(backend: StorageBackend, group: GroupBuffers, keys: Sequence[bytes],
               block_ids: Sequence[int], l2: HostPageRows | None = None,
               swa: bool = False, slots: Sequence[int] | None = None) -> tuple[int, int, int]:
    """:func:`gather_host` then :func:`store_rows`, synchronously (same return)."""
    if not keys:
        return 0, 0, 0
    return store_rows(backend, keys, gather_host(group, block_ids), l2, swa, slots)


def load_pages(backend: StorageBackend, group: GroupBuffers, keys: Sequence[bytes],
               block_ids: Sequence[int], l2: HostPageRows | None = None,
               swa: bool = False, slots: Sequence[int] | None = None) -> tuple[bool, int, int]:
    """Read every page (L2 first, the rest from L3) into its block; all or nothing.

    ``slots``: parallel to ``keys``, the L2 row the scheduler's index assigned each
    page (``-1``: none): a row tagged with the page's key is read from L2; any
    other page is read from L3 and copied into its row (the index admitted it
    there).  Returns ``(ok, pages_from_l2, pages_from_l3)``.  ``ok`` is ``True``
    when every page was read intact and scattered; on any miss nothing is written
    (the caller reports the request as a failed load so vLLM recomputes it).
    O(n * page bytes).
    """
    n = len(keys)
    if not n:
        return True, 0, 0
    # pinned beside a GPU: the copy engines read the rows straight into the blocks
    buf = torch.empty((n, group.page_bytes), dtype=torch.uint8,
                      pin_memory=group.layers[0].tensor.device.type == "cuda")
    use_l2 = l2 is not None and slots is not None and l2.page_bytes == group.page_bytes
    hit = (l2.read(swa, slots, keys, buf) if use_l2  # type: ignore[union-attr,arg-type]
           else np.zeros(0, dtype=np.int64))
    held = np.zeros(n, dtype=bool)
    held[hit] = True
    miss = np.flatnonzero(~held)
    if miss.size:
        arr = buf.numpy()
        got = backend.get_into([keys[i] for i in miss.tolist()],
                               [memoryview(arr[i]) for i in miss.tolist()])
        bad = [i for i, nb in enumerate(got) if nb != group.page_bytes]
        if bad:
            logger.warning("hybridkv: %d of %d pages missing or short at load; request "
                           "recomputes", len(bad), n)
            return False, int(hit.size), 0
        if use_l2:
            sel = miss.tolist()
            l2.write(swa, [slots[i] for i in sel], [keys[i] for i in sel],  # type: ignore[union-attr,index]
                     buf.index_select(0, torch.as_tensor(miss, dtype=torch.long)))
    group.scatter(buf.view(group.dtype).view(n, group.page_elems), block_ids)
    return True, int(hit.size), int(miss.size)


def as_np_tokens(tokens: Sequence[int]) -> np.ndarray:
    """Token ids as the int64 array :func:`hybridkv.tiers.keys.page_keys` takes."""
    return np.asarray(tokens, dtype=np.int64)
