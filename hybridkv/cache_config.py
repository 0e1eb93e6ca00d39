"""Cache policy and budget (:class:`CacheConfig`) and the count argument check the
cache's public methods share."""

from __future__ import annotations

from dataclasses import dataclass

from ._validate import check_int
from .defaults import SWA_CHECKPOINT
from .radix.tree import RANKINGS, SWA_EVICTIONS

__all__ = ["CacheConfig", "check_count"]

_RETENTION = ("adaptive", "eager", "dense", "none")


def check_count(value: object, name: str, minimum: int = 1) -> int:
    """An int argument (bools rejected) >= ``minimum``, as an int.  O(1)."""
    value = check_int(value, name)
    if value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value}")
    return value


@dataclass(frozen=True)
class CacheConfig:
    """Cache policy and budget.

    Attributes:
        budget_bytes: shared byte budget of both pools (see :class:`DualPool`);
            with a real device the KV arena is exactly this big (rounded down
            to whole blocks).
        full_pages / swa_pages: fixed pool capacities (instead of, or as caps
            under, ``budget_bytes``).
        device: device of the KV arena (``"meta"``: accounting only, ``"cpu"``,
            ``"cuda[:N]"``).
        swa_checkpoint: K tokens between SWA retention checkpoints (0 = off).
        retention: what happens to SWA pages that fall out of a live request's
            window: ``"adaptive"`` keeps them while the budget has spare room
            (> ``spare_fraction``) and frees all but checkpoints otherwise;
            ``"eager"`` always frees all but checkpoints; ``"dense"`` keeps
            all (the tree evicts them first under pressure); ``"none"`` never
            releases (baselines that hold SWA for every cached token).
        decode_release_interval: release out-of-window SWA every N decode tokens.
        swa_eviction / anchor_branch_points: see :class:`TreeConfig`.
        eviction_ranking: which leaf eviction takes, ``"value"`` (default:
            lowest learned hit density), ``"adaptive"``, ``"arc"`` or ``"lru"``
            (:class:`TreeConfig` ``ranking``; docs/policy.md).
    """

    budget_bytes: int | None = None
    full_pages: int | None = None
    swa_pages: int | None = None
    device: str | None = "meta"
    swa_checkpoint: int = SWA_CHECKPOINT
    retention: str = "adaptive"
    spare_fraction: float = 0.02
    decode_release_interval: int = 64
    swa_eviction: str = "page"
    anchor_branch_points: bool = True
    eviction_ranking: str = "value"

    def __post_init__(self) -> None:
        if self.retention not in _RETENTION:
            raise ValueError(f"retention must be one of {_RETENTION}, got {self.retention!r}")
        if not 0.0 <= float(self.spare_fraction) < 1.0:
            raise ValueError(f"spare_fraction must be in [0, 1), got {self.spare_fraction}")
        if (not isinstance(self.decode_release_interval, int) or isinstance(self.decode_release_interval, bool)
                or self.decode_release_interval < 1):
            raise ValueError(f"decode_release_interval must be an int >= 1, got {self.decode_release_interval!r}")
        for name in ("full_pages", "swa_pages"):
            value = getattr(self, name)
            if value is not None:
                check_count(value, name, minimum=1)
        if self.budget_bytes is not None:
            check_count(self.budget_bytes, "budget_bytes", minimum=1)
        # the tree checks these too, but under its own names (ranking): name the argument here
        if self.eviction_ranking not in RANKINGS:
            raise ValueError(f"eviction_ranking must be one of {RANKINGS}, got {self.eviction_ranking!r}")
        if self.swa_eviction not in SWA_EVICTIONS:
            raise ValueError(f"swa_eviction must be one of {SWA_EVICTIONS}, got {self.swa_eviction!r}")
        check_count(self.swa_checkpoint, "swa_checkpoint", minimum=0)

