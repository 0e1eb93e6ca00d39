"""Cache policy and budget (:class:`CacheConfig`) and the count argument check the
cache's public methods share."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ._validate import check_int
from .defaults import SWA_CHECKPOINT
from .modes import EvictionRanking, SwaEviction, SwaRelease

__all__ = ["CacheConfig", "check_count"]


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
        swa_release: what happens to SWA pages that fall out of a live
            request's window, a :class:`~hybridkv.modes.SwaRelease` (or its
            string): ``"adaptive"`` keeps them while the budget has spare room
            (> ``spare_fraction``) and frees all but checkpoints otherwise;
            ``"eager"`` always frees all but checkpoints; ``"dense"`` keeps
            all (the tree evicts them first under pressure); ``"none"`` never
            releases (baselines that hold SWA for every cached token).  The
            old keyword ``retention=`` is still accepted (and ``.retention``
            read), for the same setting.
        decode_release_interval: release out-of-window SWA every N decode tokens.
        swa_eviction / anchor_branch_points: see :class:`TreeConfig`
            (``swa_eviction``: a :class:`~hybridkv.modes.SwaEviction` or its string).
        eviction_ranking: which leaf eviction takes, a
            :class:`~hybridkv.modes.EvictionRanking` (or its string): ``"value"`` (default:
            lowest learned hit density), ``"adaptive"``, ``"arc"`` or ``"lru"``
            (:class:`TreeConfig` ``ranking``; docs/policy.md).
    """

    budget_bytes: int | None = None
    full_pages: int | None = None
    swa_pages: int | None = None
    device: str | None = "meta"
    swa_checkpoint: int = SWA_CHECKPOINT
    swa_release: SwaRelease = SwaRelease.ADAPTIVE
    spare_fraction: float = 0.02
    decode_release_interval: int = 64
    swa_eviction: SwaEviction = SwaEviction.PAGE
    anchor_branch_points: bool = True
    eviction_ranking: EvictionRanking = EvictionRanking.VALUE

    @property
    def retention(self) -> SwaRelease:
        """The old name of :attr:`swa_release` (read only)."""
        return self.swa_release

    def __post_init__(self) -> None:
        object.__setattr__(self, "swa_release", SwaRelease.parse(self.swa_release, "swa_release"))
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
        object.__setattr__(self, "eviction_ranking", EvictionRanking.parse(self.eviction_ranking, "eviction_ranking"))
        object.__setattr__(self, "swa_eviction", SwaEviction.parse(self.swa_eviction, "swa_eviction"))
        check_count(self.swa_checkpoint, "swa_checkpoint", minimum=0)



def _accept_old_names(init: Any) -> Any:
    """``CacheConfig(retention=...)``, the old keyword of ``swa_release``, keeps
    working (validated under its own name)."""

    @functools.wraps(init)
    def __init__(self: CacheConfig, *args: Any, retention: object = None, **kwargs: Any) -> None:
        if retention is not None:
            if "swa_release" in kwargs or len(args) > 5:
                raise TypeError("give swa_release or its old name retention, not both")
            kwargs["swa_release"] = SwaRelease.parse(retention, "retention")
        init(self, *args, **kwargs)

    return __init__


CacheConfig.__init__ = _accept_old_names(CacheConfig.__init__)  # type: ignore[method-assign]
