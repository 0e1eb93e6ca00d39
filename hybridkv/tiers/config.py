"""Settings of the lower tiers (:class:`TierConfig`) and where a page of a hit
came from (:class:`PageOrigin`)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from ..modes import L2Eviction, L3Swa, WritePolicy
from .storage import backend_lacks

__all__ = ["L2Eviction", "L3Swa", "PageOrigin", "TierConfig", "WritePolicy"]


class PageOrigin(IntEnum):
    """Where a page's KV came from when a request was served (arrays of origins
    are numpy int8 holding these values).  SWA sources use NONE/L1/L2 only."""

    NONE = 0            #: no tier holds it
    L1 = 1              #: the device tree
    L2 = 2              #: the host tier
    L3 = 3              #: landed in L2 from L3, first served now
    L3_PREEXISTING = 4  #: the same, from L3 data older than this cache


@dataclass(frozen=True)
class TierConfig:
    """Lower tiers of a :class:`~hybridkv.tiers.tiered.TieredCache`.

    Attributes:
        l2_bytes: host (L2) budget in bytes for both kinds (> 0).
        l3: L3 backend URL (see :func:`~hybridkv.tiers.storage.open_backend`),
            a backend object, or None (no L3).
        write_policy: a :class:`~hybridkv.modes.WritePolicy` (or its string),
            ``"write_through"`` or ``"write_back"`` (L1 -> L2).
        l2_device: host buffer device; None picks ``"cpu"`` when L1 holds
            real KV and ``"meta"`` (accounting only) when L1 is ``"meta"``.
        l3_timeout_s: the most :meth:`~hybridkv.tiers.tiered.TieredCache.begin` waits for L3 in total
            (the fetch runs on the L3 read worker, never under the cache's
            mutex; what has not arrived in L2 by then is a miss).  A read
            slower than this counts as a failure for the read breaker.
        l3_read_breaker: ``(failures, cooldown_s)``: after that many failed or
            late L3 reads in a row, reads are skipped (misses, no waiting) for
            ``cooldown_s``; then one probe read goes out, not waited for.
        touch_interval_s: minimum seconds between two L3 touches of a key.
        max_queued_writes: pending L3 write pages before writes are dropped.
        l3_swa: a :class:`~hybridkv.modes.L3Swa` (or its string), ``"anchored"``
            (tails and checkpoint windows only) or ``"all"``.
        l2_eviction: a :class:`~hybridkv.modes.L2Eviction` (or its string): the
            order L2 gives up full pages in, ``"own"`` (its key tree's) or
            ``"tree"`` (the L1 tree's evicted runs, as HiCache's host eviction;
            write-through only: under write-back L2 takes pages in the tree's
            eviction order already).  Measured: ``benchmarks/l2_order.py``.
    """

    l2_bytes: int
    l3: Any = None
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    l2_device: str | None = None
    l3_timeout_s: float = 5.0
    touch_interval_s: float = 30.0
    max_queued_writes: int = 65536
    l3_swa: L3Swa = L3Swa.ANCHORED
    l3_read_breaker: tuple = (3, 5.0)
    l2_eviction: L2Eviction = L2Eviction.OWN

    def __post_init__(self) -> None:
        if not isinstance(self.l2_bytes, (int, np.integer)) or isinstance(self.l2_bytes, bool):
            raise TypeError(f"l2_bytes must be an int, got {type(self.l2_bytes).__name__}")
        if self.l2_bytes <= 0:
            raise ValueError(f"l2_bytes must be > 0, got {self.l2_bytes}")
        object.__setattr__(self, "write_policy", WritePolicy.parse(self.write_policy, "write_policy"))
        object.__setattr__(self, "l3_swa", L3Swa.parse(self.l3_swa, "l3_swa"))
        object.__setattr__(self, "l2_eviction", L2Eviction.parse(self.l2_eviction, "l2_eviction"))
        if self.l2_eviction is L2Eviction.TREE and self.write_policy is not WritePolicy.WRITE_THROUGH:
            raise ValueError(
                f"l2_eviction 'tree' needs write_policy 'write_through', got {self.write_policy.value!r}")
        rb = self.l3_read_breaker
        if (not isinstance(rb, tuple) or len(rb) != 2 or not isinstance(rb[0], int) or rb[0] < 1
                or not isinstance(rb[1], (int, float)) or rb[1] < 0):
            raise ValueError(f"l3_read_breaker must be (failures >= 1, cooldown_s >= 0), got {rb!r}")
        if self.l3_timeout_s <= 0:
            raise ValueError(f"l3_timeout_s must be > 0, got {self.l3_timeout_s}")
        if self.l3 is not None and not isinstance(self.l3, str) and backend_lacks(self.l3):
            raise TypeError(f"l3 must be a URL, a StorageBackend or None, got "
                            f"{type(self.l3).__name__} (lacks {', '.join(backend_lacks(self.l3))})")
