"""Worker side: vLLM's per-layer KV tensors <-> page payloads <-> L3.

vLLM hands the connector one tensor per attention layer (``register_kv_caches``).
Whatever the backend's layout, one dimension indexes blocks (size
``num_blocks``); everything else is the interior of a block.  A page payload
of a group is, for one block id, the interiors of every layer of that group
(sorted by layer name) laid end to end: ``sum(layer block bytes)`` bytes.

Blocks move with ``index_select`` / ``index_copy_`` per layer (bulk torch
work; the only Python loops run over layers and pages, never tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hybridkv.tiers.storage import StorageBackend

__all__ = ["GroupBuffers", "save_pages", "load_pages"]

logger = logging.getLogger("hybridkv_vllm")


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

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``[n, page_elems]`` rows, row i = block ``block_ids[i]`` of all layers.

        Allocates the result; mutates nothing.  O(n * page bytes).
        """
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        n = idx.numel()
        parts = [lay.tensor.index_select(lay.block_dim, idx).movedim(lay.block_dim, 0)
                 .reshape(n, -1) for lay in self.layers]
        return torch.cat(parts, dim=1).contiguous()

    def scatter(self, rows: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Write row i into block ``block_ids[i]`` of every layer.

        ``rows``: ``[n, page_elems]`` of the group's dtype.  Mutates the vLLM
        KV tensors only.  O(n * page bytes).
        """
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        off = 0
        for lay in self.layers:
            t = lay.tensor
            inner = list(t.shape)
            del inner[lay.block_dim]
            src = rows[:, off:off + lay.elems].reshape(idx.numel(), *inner)
            t.index_copy_(lay.block_dim, idx, src.movedim(0, lay.block_dim))
            off += lay.elems


def save_pages(backend: StorageBackend, group: GroupBuffers, keys: Sequence[bytes],
               block_ids: Sequence[int]) -> tuple[int, int]:
    """Store pages whose key is not in ``backend`` yet.

    Returns ``(stored, skipped_existing)``.  Backend faults come back as
    ``False`` from ``put`` (counted by the backend); nothing raises.
    O(n * page bytes) for the missing pages.
    """
    if not keys:
        return 0, 0
    present = backend.exists(list(keys))
    todo = [i for i, p in enumerate(present) if not p]
    if not todo:
        return 0, len(keys)
    rows = group.gather([block_ids[i] for i in todo])
    raw = rows.view(torch.uint8).numpy()
    ok = backend.put([keys[i] for i in todo], [raw[j] for j in range(len(todo))])
    return sum(ok), len(keys) - len(todo)


def load_pages(backend: StorageBackend, group: GroupBuffers, keys: Sequence[bytes],
               block_ids: Sequence[int]) -> bool:
    """Read every page and write it into its block; all or nothing.

    Returns ``True`` when every page was read intact and scattered; on any
    miss nothing is written and ``False`` comes back (the caller reports the
    request as a failed load so vLLM recomputes it).  O(n * page bytes).
    """
    if not keys:
        return True
    buf = torch.empty((len(keys), group.page_bytes), dtype=torch.uint8)
    arr = buf.numpy()
    got = backend.get_into(list(keys), [memoryview(arr[i]) for i in range(len(keys))])
    bad = [i for i, n in enumerate(got) if n != group.page_bytes]
    if bad:
        logger.warning("hybridkv: %d of %d pages missing or short at load; request recomputes",
                       len(bad), len(keys))
        return False
    group.scatter(buf.view(group.dtype).view(len(keys), group.page_elems), block_ids)
    return True


def as_np_tokens(tokens: Sequence[int]) -> np.ndarray:
    """Token ids as the int64 array :func:`hybridkv.tiers.keys.page_keys` takes."""
    return np.asarray(tokens, dtype=np.int64)
