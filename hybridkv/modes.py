"""Named modes: the policy switches users pass as strings, as enums.

Every mode is an :class:`enum.Enum` whose members are also their ``str``
value (``SwaEviction.PAGE == "page"``, same hash, ``str()`` and format give
``"page"``), so configurations written with strings keep working and
compare, hash and print the same.  :meth:`parse` turns a user's string into
the member and raises a ValueError that names the argument otherwise.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

__all__ = ["EvictionRanking", "L2Eviction", "L3Swa", "StrMode", "SwaEviction", "SwaRelease", "WritePolicy"]

_M = TypeVar("_M", bound="StrMode")


class StrMode(str, Enum):
    """Base of the string-valued modes (Python 3.10 has no ``enum.StrEnum``)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)

    def __hash__(self) -> int:  # equal to its value, so it hashes like it (dict keys, sets)
        return str.__hash__(self)

    @classmethod
    def parse(cls: type[_M], value: object, name: str) -> _M:
        """``value`` (a member or its string) as a member of ``cls``; ValueError naming
        ``name`` and the choices otherwise.  O(members)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if member.value == value:
                    return member
        raise ValueError(f"{name} must be one of {tuple(m.value for m in cls)}, got {value!r}")


class SwaEviction(StrMode):
    """How the tree evicts SWA apart from full KV (``TreeConfig.swa_eviction``)."""

    PAGE = "page"  #: hybridkv: per page, the SWA that ends no likely hit first
    NODE = "node"  #: tombstone baseline: a node's SWA goes as a whole, plain LRU
    NONE = "none"  #: naive baseline: SWA lives and dies with its full KV


class EvictionRanking(StrMode):
    """Which leaf eviction takes (``TreeConfig.ranking``, ``CacheConfig.eviction_ranking``)."""

    VALUE = "value"        #: lowest learned hit density (returns per tick held)
    ADAPTIVE = "adaptive"  #: ARC's RECENT/REUSED segments, reuse predicted per sequence
    ARC = "arc"            #: the plain segment rule
    LRU = "lru"            #: least recently used


class SwaRelease(StrMode):
    """What happens to SWA pages that fall out of a live request's window
    (``CacheConfig.swa_release``, formerly ``retention``)."""

    ADAPTIVE = "adaptive"  #: keep them while the budget has spare room, else free all but kept windows
    EAGER = "eager"        #: always free all but the kept windows (checkpoints, divergence, predicted)
    DENSE = "dense"        #: keep all (the tree evicts them first under pressure)
    NONE = "none"          #: never release (baselines holding SWA for every cached token)


class WritePolicy(StrMode):
    """When L1 pages are copied to L2 (``TierConfig.write_policy``)."""

    WRITE_THROUGH = "write_through"  #: a request's pages when it finishes
    WRITE_BACK = "write_back"        #: a page when the L1 tree frees it


class L2Eviction(StrMode):
    """Whose order L2 gives up its full pages in (``TierConfig.l2_eviction``)."""

    OWN = "own"    #: L2's own: the least recently used leaf of its key tree (copies of L1's pages first)
    TREE = "tree"  #: the tree's: its runs below L1, least recently used first (HiCache's host eviction)


class L3Swa(StrMode):
    """Which SWA pages L3 receives (``TierConfig.l3_swa``)."""

    ANCHORED = "anchored"  #: tails and checkpoint windows only
    ALL = "all"            #: every SWA page L2 holds
