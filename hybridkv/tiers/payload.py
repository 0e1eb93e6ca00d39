"""What an L3 value holds: real page bytes, or a scaled-down checked stand-in.

Two codecs share one interface (:class:`PayloadCodec`):

* :class:`RealPayload` packs one page of one attention kind from the L2 host
  buffers (all layers of that kind, K then V, the layout of
  :func:`hybridkv.transfer.pack_pages`) and unpacks it back.  Used when the
  pools hold real KV (``hybridkv verify``, engines).
* :class:`ScaledPayload` stores a few bytes per page: a BLAKE2b checksum of
  the page key and its kind.  Replays cannot move MiMo-scale KV on a small
  machine, but they still go through the real backends (key space, capacity,
  eviction, faults, hit accounting), and a value that does not belong to its
  key is rejected exactly like corrupt real KV.  ``nominal_bytes`` reports
  what the real model would have moved.

Decoding never yields data for the wrong key: a payload of the wrong length
or checksum is a miss.
"""

from __future__ import annotations

import hashlib
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..pools.buffers import KVBuffers
from ..spec import AttnKind, ModelSpec
from ..transfer import page_nbytes, prepare_pack, prepare_unpack

__all__ = ["PayloadCodec", "RealPayload", "ScaledPayload", "swa_key"]

_SWA_PERSON = b"hybridkv-swa"


def swa_key(full_key: bytes) -> bytes:
    """Key of the SWA value of the page whose full-KV key is ``full_key``.

    Derived (BLAKE2b-128 with its own personalisation) rather than a second
    chain: one chain per prompt halves hashing, and the derived key is still
    unique per (namespace, model, prefix, kind).  O(1).
    """
    return hashlib.blake2b(full_key, digest_size=len(full_key), person=_SWA_PERSON).digest()


class PayloadCodec(Protocol):
    """Encodes host pages into L3 values and decodes them back."""

    #: bytes the real model moves per page of each kind (for "bytes moved")
    def nominal_bytes(self, kind: AttnKind) -> int: ...

    def encode(self, kind: AttnKind, keys: Sequence[bytes], host_pages: np.ndarray) -> list[bytes]:
        """One value per page: ``host_pages[i]`` stored under ``keys[i]``."""
        ...

    def decode(self, kind: AttnKind, keys: Sequence[bytes], values: Sequence[Any],
               host_pages: np.ndarray) -> np.ndarray:
        """Write ``values[i]`` into ``host_pages[i]``; bool ``[n]``: which ones were valid."""
        ...


class ScaledPayload:
    """8-byte stand-in values: ``BLAKE2b-64(kind || key)`` (see module docstring)."""

    def __init__(self, spec: ModelSpec) -> None:
        self._nominal = {AttnKind.FULL: spec.bytes_per_page(AttnKind.FULL),
                         AttnKind.SWA: spec.bytes_per_page(AttnKind.SWA)}

    def nominal_bytes(self, kind: AttnKind) -> int:
        return self._nominal[kind]

    @staticmethod
    def _value(kind: AttnKind, key: bytes) -> bytes:
        return hashlib.blake2b(kind.value.encode() + key, digest_size=8, person=b"hybridkv-pl").digest()

    def encode(self, kind: AttnKind, keys: Sequence[bytes], host_pages: np.ndarray) -> list[bytes]:
        return [self._value(kind, k) for k in keys]

    def decode(self, kind: AttnKind, keys: Sequence[bytes], values: Sequence[Any],
               host_pages: np.ndarray) -> np.ndarray:
        ok = np.zeros(len(keys), dtype=bool)
        for i, (k, v) in enumerate(zip(keys, values)):
            ok[i] = v is not None and bytes(v) == self._value(kind, k)
        return ok


class RealPayload:
    """Real page bytes packed from / unpacked into the L2 host buffers."""

    def __init__(self, spec: ModelSpec, buffers: KVBuffers) -> None:
        if buffers.device.type == "meta":
            raise ValueError("RealPayload needs host buffers with memory (device 'cpu'), not 'meta'")
        self.spec = spec
        self.buffers = buffers

    def nominal_bytes(self, kind: AttnKind) -> int:
        return self.spec.bytes_per_page(kind)

    def _page_bytes(self, kind: AttnKind) -> int:
        """Bytes of one page's value: its blocks' layer slots, block after block."""
        b = self.buffers.of(kind)
        return page_nbytes(b.k, b.v, self.spec.page_size) * b.layout.blocks_per_page

    def encode(self, kind: AttnKind, keys: Sequence[bytes], host_pages: np.ndarray) -> list[bytes]:
        if len(keys) == 0:
            return []
        b = self.buffers.of(kind)
        plan, rows = prepare_pack(b.k, b.v, torch.from_numpy(b.blocks(host_pages)),
                                  self.spec.page_size)
        plan.issue()
        raw = rows.contiguous().view(torch.uint8).numpy().reshape(len(keys), -1)
        return [raw[i].tobytes() for i in range(raw.shape[0])]

    def decode(self, kind: AttnKind, keys: Sequence[bytes], values: Sequence[Any],
               host_pages: np.ndarray) -> np.ndarray:
        n = len(keys)
        ok = np.zeros(n, dtype=bool)
        if n == 0:
            return ok
        b = self.buffers.of(kind)
        want = self._page_bytes(kind)
        for i, v in enumerate(values):
            ok[i] = v is not None and memoryview(v).nbytes == want
        if not ok.any():
            return ok
        good = np.flatnonzero(ok)
        staging = np.empty((good.size, want), dtype=np.uint8)
        for row, i in enumerate(good):
            staging[row] = np.frombuffer(values[i], dtype=np.uint8)
        blocks = b.blocks(np.asarray(host_pages, dtype=np.int64)[good])
        rows = torch.from_numpy(staging).view(b.k.dtype).reshape(blocks.size, -1)
        prepare_unpack(rows, b.k, b.v, torch.from_numpy(blocks), self.spec.page_size).issue()
        return ok
