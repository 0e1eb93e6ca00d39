"""Layer-by-layer L2 -> L1 loads on SGLang's layer hooks.

SGLang's HiCache loads a batch's host hits on a side stream, one layer at a
time, and the model's attention waits for its own layer only: SGLang's KV
pools call ``layer_transfer_counter.wait_until(layer)`` in
``get_key_buffer`` / ``get_value_buffer`` / ``get_kv_buffer``, and the
scheduler tells the worker which load a batch consumes
(``ready_to_load_host_cache()`` -> ``batch.hicache_consumer_index`` ->
``tp_worker.set_hicache_consumer``).  :class:`LayerLoads` gives hybridkv's
tiers the same contract with SGLang's own ``LayerDoneCounter``:

* at ``init_load_back`` the coordinator's host -> device copies are *queued*:
  each layer's K/V of the pages is read out of the host arena at once (the L2
  slots may be reused by the time the batch runs) and kept with the device
  slots they go to;
* ``ready_to_load_host_cache()`` (:meth:`LayerLoads.issue`) issues the queued
  copies in model-layer order, on a side stream on CUDA, and records the
  counter's event of each layer after its copies, so layer ``i``'s attention
  starts as soon as layer ``i``'s pages are in while layers ``i+1...`` load;
* anything that reads or reuses device pages outside a forward
  (a device -> host copy, a reset, a load that did not commit) first runs
  what is queued (:meth:`LayerLoads.flush`), so nothing ever reads a page
  whose load is still queued.

Pages being loaded belong to a request SGLang locks right after
``init_load_back`` returns, so no eviction can hand them to another request
before the batch runs.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.spec import AttnKind

__all__ = ["LayerLoads"]


@dataclass
class _Queued:
    kind: AttnKind
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # the i-th layer of the kind: (K, V) rows
    slots: torch.Tensor  # device token slots (int64, on the pools' device)


class LayerLoads:
    """Queued host -> device copies of one SGLang ``SWAKVPool``, issued layer by layer.

    Args:
        kv: SGLang's ``SWAKVPool`` (``layers_mapping``, ``full_kv_pool``,
            ``swa_kv_pool``, ``start_layer``).
        counter: SGLang's ``LayerDoneCounter`` registered with ``kv`` and the
            worker (``update_producer``, ``events[i].start_event`` /
            ``complete(layer)``), sized ``kv.layer_num``.

    ``issued`` counts the loads issued, ``issued_layers`` the layer events
    recorded, ``flushed`` the queued copies run at once instead.
    """

    def __init__(self, kv: Any, counter: Any) -> None:
        for name in ("layers_mapping", "full_kv_pool", "swa_kv_pool"):
            if not hasattr(kv, name):
                raise TypeError(f"kv must be SGLang's SWAKVPool (it has no {name!r})")
        for name in ("update_producer", "events"):
            if not hasattr(counter, name):
                raise TypeError(f"counter must be SGLang's LayerDoneCounter (it has no {name!r})")
        self.kv = kv
        self.counter = counter
        self.start = int(getattr(kv, "start_layer", 0) or 0)
        # model layer -> its position among the pool's layers of its kind (the
        # coordinator's i-th layer of a kind, as in its ``copy``)
        self._kind_pos: dict[int, int] = {}
        seen = {False: 0, True: 0}
        # the pool's layers in model order (the ids the attention layers wait with)
        self._order = sorted(kv.layers_mapping)
        for layer_id in self._order:
            is_swa = bool(kv.layers_mapping[layer_id][1])
            self._kind_pos[layer_id] = seen[is_swa]
            seen[is_swa] += 1
        self._queued: list[_Queued] = []
        self._device = kv.full_kv_pool.k_buffer[0].device
        self._stream: Any = None
        self.issued = 0
        self.issued_layers = 0
        self.flushed = 0

    def __len__(self) -> int:
        return len(self._queued)

    def queue(self, kind: AttnKind, layers: list[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor) -> None:
        """Queue ``layers[i]`` (K, V of the i-th pool layer of ``kind``) for the
        device ``slots``.  O(1)."""
        if len(slots):  # the index moves to the pools' device once, not once a layer
            self._queued.append(_Queued(kind, layers, slots.to(self._device)))

    def drop(self, kind: AttnKind, slots: torch.Tensor) -> None:
        """Forget the queued copies of ``kind`` into device ``slots`` (their pages
        went back to the allocator before the batch ran).  O(queued rows)."""
        for q in self._queued:
            if q.kind is kind:
                keep = ~torch.isin(q.slots, slots.to(q.slots.device))
                if not bool(keep.all()):
                    q.slots = q.slots[keep]
                    rows = keep.cpu()  # the K/V rows read out of L2 stay on the host
                    q.layers = [(k[rows], v[rows]) for k, v in q.layers]
        self._queued = [q for q in self._queued if len(q.slots)]

    def _copy_layer(self, layer_id: int) -> None:
        local, is_swa = self.kv.layers_mapping[layer_id]
        kind = AttnKind.SWA if is_swa else AttnKind.FULL
        dev = self.kv.swa_kv_pool if is_swa else self.kv.full_kv_pool
        kb, vb = dev.k_buffer[local], dev.v_buffer[local]
        for q in self._queued:
            if q.kind is kind:
                k, v = q.layers[self._kind_pos[layer_id]]
                kb[q.slots] = k.to(device=kb.device, dtype=kb.dtype, non_blocking=True)
                vb[q.slots] = v.to(device=vb.device, dtype=vb.dtype, non_blocking=True)

    def issue(self) -> int:
        """Issue every queued copy, layer by layer in model order, recording the
        counter's event of each layer after its copies (on a side stream on
        CUDA).  Returns the producer index the batch consumes, -1 when nothing
        was queued.  O(queued bytes)."""
        if not self._queued:
            return -1
        producer = self.counter.update_producer()
        event = self.counter.events[producer]
        event.start_event.record()
        cuda = self._device.type == "cuda"
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
        ctx = torch.cuda.stream(self._stream) if cuda else nullcontext()
        with ctx:
            for layer_id in self._order:
                self._copy_layer(layer_id)
                event.complete(layer_id - self.start)
        self.issued += 1
        self.issued_layers += len(self._order)
        self._queued.clear()
        return producer

    def flush(self) -> None:
        """Run whatever is queued now, on the current stream (no layer events).  O(queued bytes)."""
        if not self._queued:
            return
        for layer_id in self._order:
            self._copy_layer(layer_id)
        self.flushed += len(self._queued)
        self._queued.clear()
