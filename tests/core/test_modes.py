"""Typed modes: enums whose members are their strings, old names kept, errors naming the argument."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridkv import CacheConfig, EvictionRanking, SwaEviction, SwaRelease, TreeConfig
from hybridkv.modes import L3Swa, WritePolicy
from hybridkv.tiers.config import TierConfig
from hybridkv.radix.policy import AdaptiveRanking, RetentionPolicy


def test_members_equal_hash_and_print_as_their_strings():
    for mode in (*SwaEviction, *EvictionRanking, *SwaRelease, *WritePolicy, *L3Swa):
        assert mode == mode.value and hash(mode) == hash(mode.value)
        assert str(mode) == f"{mode}" == mode.value
        assert {mode.value: 1}[mode] == 1
    assert json.dumps({"m": SwaEviction.NODE}) == '{"m": "node"}'


def test_strings_become_members():
    cfg = CacheConfig(budget_bytes=10**9, swa_eviction="node", eviction_ranking="lru", swa_release="eager")
    assert cfg.swa_eviction is SwaEviction.NODE and cfg.eviction_ranking is EvictionRanking.LRU
    assert cfg.swa_release is SwaRelease.EAGER
    tc = TreeConfig(2, 4, swa_eviction="none", ranking="arc")
    assert tc.swa_eviction is SwaEviction.NONE and tc.ranking is EvictionRanking.ARC
    tiers = TierConfig(l2_bytes=1, write_policy="write_back", l3_swa="all")
    assert tiers.write_policy is WritePolicy.WRITE_BACK and tiers.l3_swa is L3Swa.ALL


def test_retention_is_the_old_name_of_swa_release():
    cfg = CacheConfig(budget_bytes=10**9, retention="dense")
    assert cfg.swa_release is SwaRelease.DENSE and cfg.retention is SwaRelease.DENSE
    assert dataclasses.replace(cfg, spare_fraction=0.1).swa_release is SwaRelease.DENSE
    with pytest.raises(TypeError, match="not both"):
        CacheConfig(budget_bytes=10**9, retention="dense", swa_release="eager")


@pytest.mark.parametrize("build, name", [
    (lambda: CacheConfig(retention="lazy"), "retention"),
    (lambda: CacheConfig(swa_release="lazy"), "swa_release"),
    (lambda: CacheConfig(swa_eviction="tree"), "swa_eviction"),
    (lambda: CacheConfig(eviction_ranking="mru"), "eviction_ranking"),
    (lambda: TreeConfig(2, 4, ranking="mru"), "ranking"),
    (lambda: TreeConfig(2, 4, swa_eviction=3), "swa_eviction"),
    (lambda: TierConfig(l2_bytes=1, write_policy="back"), "write_policy"),
    (lambda: TierConfig(l2_bytes=1, l3_swa="some"), "l3_swa"),
])
def test_bad_modes_name_the_argument(build, name):
    with pytest.raises(ValueError, match=f"^{name} must be one of"):
        build()


def test_flags_are_keyword_only():
    with pytest.raises(TypeError):
        RetentionPolicy(2, 4, 0, False)  # type: ignore[misc]
    with pytest.raises(TypeError):
        AdaptiveRanking().evict_from(True, True)  # type: ignore[misc]
    with pytest.raises(TypeError):
        TreeConfig(2, 4, 0, "page", False, "lru")  # type: ignore[misc]
    assert TreeConfig(2, 4, anchor_branch_points=False).anchor_branch_points is False
