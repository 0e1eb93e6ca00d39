"""Which run of an SGLang ratio sweep is "default" and which is "best" (pure: no SGLang).

One rule for the harnesses that run the sweeps (``equal_memory.equal_memory`` for
``UnifiedRadixCache``, ``equal_memory_tiers.tiers_rows`` for HiCache) and for the
script that merges sweeps run in parts (``benchmarks/peers/merge_tiers.py``).  A run
is a mapping with ``setting`` (``swa_full_tokens_ratio``, ``write_policy``),
``rejected`` and ``hit_tokens``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DEFAULT_RATIO", "DEFAULT_POLICY", "default_index", "best_index"]

DEFAULT_RATIO = 0.8              # SGLang's --swa-full-tokens-ratio default
DEFAULT_POLICY = "write_through"  # SGLang's --hicache-write-policy default


def default_index(sweep: Sequence[Mapping[str, Any]]) -> int | None:
    """Index of SGLang's default setting (ratio 0.8, write-through), None if not swept."""
    for i, r in enumerate(sweep):
        s = r["setting"]
        if s["swa_full_tokens_ratio"] == DEFAULT_RATIO and s.get("write_policy", DEFAULT_POLICY) == DEFAULT_POLICY:
            return i
    return None


def best_index(sweep: Sequence[Mapping[str, Any]]) -> int | None:
    """Index of the run with the most hit tokens among those that rejected no request
    (among all when every run rejected some); ties go to the ratio nearest the
    default.  None for an empty sweep."""
    if not sweep:
        return None
    eligible = [i for i, r in enumerate(sweep) if r["rejected"] == 0] or list(range(len(sweep)))
    return max(eligible, key=lambda i: (sweep[i]["hit_tokens"],
                                        -abs(sweep[i]["setting"]["swa_full_tokens_ratio"] - DEFAULT_RATIO)))
