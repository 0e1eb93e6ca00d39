"""KV buffers of the dual pools.

Layout (shared with ``hybridkv.transfer``): for each attention kind,

* ``k``: ``[num_layers_of_kind, num_pages * page_size, num_kv_heads, k_head_dim]``
* ``v``: ``[num_layers_of_kind, num_pages * page_size, num_kv_heads, v_head_dim]``

Token slot of page ``p``, offset ``o`` is ``p * page_size + o``; one page of
one layer is contiguous.  On the ``meta`` device the tensors take no memory.
"""

from __future__ import annotations

import numpy as np
import torch

from ..spec import AttnKind, ModelSpec

__all__ = ["KVBuffers", "KindBuffers", "slots_of_pages"]


class KindBuffers:
    """K and V tensors of all layers of one attention kind."""

    def __init__(self, spec: ModelSpec, kind: AttnKind, num_pages: int,
                 device: str | torch.device) -> None:
        shape = spec.shape(kind)
        layers = len(spec.layers(kind))
        slots = num_pages * spec.page_size
        self.kind = kind
        self.layer_ids = spec.layers(kind)
        self.k = torch.zeros((layers, slots, shape.num_kv_heads, shape.k_head_dim),
                             dtype=spec.torch_dtype, device=device)
        self.v = torch.zeros((layers, slots, shape.num_kv_heads, shape.v_head_dim),
                             dtype=spec.torch_dtype, device=device)
        self._index = {layer: i for i, layer in enumerate(self.layer_ids)}

    def local(self, layer: int) -> int:
        """Index of model layer ``layer`` inside this kind's tensors."""
        try:
            return self._index[layer]
        except KeyError:
            raise ValueError(f"layer {layer} is not a {self.kind.value} layer") from None


class KVBuffers:
    """The KV memory behind a :class:`~hybridkv.pools.dual.DualPool`."""

    def __init__(self, spec: ModelSpec, full_pages: int, swa_pages: int,
                 device: str | torch.device) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.full = KindBuffers(spec, AttnKind.FULL, full_pages, device)
        self.swa = KindBuffers(spec, AttnKind.SWA, swa_pages, device)

    def of(self, kind: AttnKind | str) -> KindBuffers:
        return self.full if AttnKind(kind) is AttnKind.FULL else self.swa


def slots_of_pages(pages: np.ndarray, page_size: int) -> np.ndarray:
    """Token slots of ``pages`` in order: ``[len(pages) * page_size]`` int64.  O(n)."""
    pages = np.asarray(pages, dtype=np.int64)
    return (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)[None, :]).reshape(-1)
