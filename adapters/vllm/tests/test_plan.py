"""Window-safe hit rule, save selection and config parsing (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hybridkv_vllm.config import ConnectorConfig
from hybridkv_vllm.plan import (
    GroupInfo,
    full_bases,
    pages_to_save,
    passed_pages,
    swa_first_page,
    window_safe_pages,
    window_safe_tokens,
)

FULL = GroupInfo(0, None, ("l1",))
SWA = GroupInfo(1, 64, ("l0",))


def _arr(n: int, present: set[int]) -> np.ndarray:
    return np.array([i in present for i in range(n)])


def test_swa_first_page() -> None:
    assert swa_first_page(7, 32, 64) == 5
    assert swa_first_page(1, 32, 64) == 0
    assert swa_first_page(3, 32, 48) == 1  # positions [48, 96) start in page 1


def test_hit_needs_full_prefix_and_swa_window() -> None:
    full = np.ones(8, bool)
    # SWA stored only for pages 5, 6 (window before 7 pages): hit = 7
    assert window_safe_pages(full, [_arr(8, {5, 6})], [64], 32, 0) == 7
    # window before 8 needs pages 6, 7; 7 missing -> falls back to 7
    assert window_safe_pages(full, [_arr(8, {5, 6})], [64], 32, 0) == 7
    # nothing of SWA -> no hit at all (a pseudo-hit would read garbage)
    assert window_safe_pages(full, [np.zeros(8, bool)], [64], 32, 0) == 0
    # full prefix broken at page 3: SWA beyond it is useless
    assert window_safe_pages(_arr(8, {0, 1, 2, 4, 5, 6, 7}), [np.ones(8, bool)], [64], 32, 0) == 3


def test_local_pages_cover_swa_below_them() -> None:
    full = np.ones(6, bool)
    # engine holds 4 pages locally: hit end 5 needs SWA pages [3, 5) -> only page 4 from storage
    assert window_safe_pages(full, [_arr(6, {4})], [64], 32, 4) == 5
    assert window_safe_pages(full, [_arr(6, set())], [64], 32, 4) <= 4  # nothing to load


def test_two_swa_groups_must_both_hold_their_window() -> None:
    full = np.ones(6, bool)
    a, b = _arr(6, {4, 5}), _arr(6, {2, 3, 4, 5})
    assert window_safe_pages(full, [a, b], [64, 128], 32, 0) == 6
    assert window_safe_pages(full, [a, _arr(6, {4, 5})], [64, 128], 32, 0) == 0


def test_pages_to_save_full_and_swa() -> None:
    assert pages_to_save(FULL, 2, 7, 32, final=False) == [2, 3, 4, 5, 6]
    assert pages_to_save(SWA, 0, 7, 32, final=False) == []
    assert pages_to_save(SWA, 0, 7, 32, final=True) == [5, 6]
    # checkpoints every 2 pages -> windows before pages 2, 4, 6 and the tail 7
    assert pages_to_save(SWA, 0, 7, 32, final=True, checkpoint_pages=2) == [0, 1, 2, 3, 4, 5, 6]
    assert pages_to_save(SWA, 4, 7, 32, final=False, checkpoint_pages=2) == [4, 5]


def test_mixed_block_sizes_hit_on_lcm() -> None:
    """MiMo-V2 layout in vLLM: full group at block 64, SWA group at block 32 (W=64)."""
    full, swa = GroupInfo(0, None, ("f",), 64), GroupInfo(1, 64, ("s",), 32)
    # 256 tokens: full pages 0-3 (64 each), SWA pages 0-7 (32 each)
    f = np.ones(4, bool)
    # SWA window before 256 = pages 6, 7 only -> hit 256
    assert window_safe_tokens([f, _arr(8, {6, 7})], [full, swa], 64, 0, 256) == 256
    # window before 192 = SWA pages 4, 5 -> hit 192 when 7 is gone
    assert window_safe_tokens([f, _arr(8, {4, 5, 6})], [full, swa], 64, 0, 256) == 192
    # SWA window ending at 224 (pages 5, 6) is not on the 64-token unit: no hit there
    assert window_safe_tokens([f, _arr(8, {5, 6})], [full, swa], 64, 0, 256) == 0
    # full page 2 (tokens 128-191) missing: nothing beyond 128
    assert window_safe_tokens([_arr(4, {0, 1, 3}), np.ones(8, bool)], [full, swa],
                              64, 0, 256) == 128
    # the engine's own hit of 128 covers everything below it
    assert window_safe_tokens([_arr(4, {2}), _arr(8, {4, 5})], [full, swa], 64, 128, 256) == 192
    assert window_safe_tokens([_arr(4, {2}), _arr(8, {5})], [full, swa], 64, 128, 256) == 0
    assert window_safe_tokens([f, np.ones(8, bool)], [full, swa], 64, 0, 200) == 192  # cap
    with pytest.raises(ValueError, match="multiple"):
        window_safe_tokens([f], [GroupInfo(0, None, ("f",), 48)], 64, 0, 256)


def test_mixed_sizes_agree_with_single_size_rule() -> None:
    """With one block size the token rule equals the page rule on random layouts."""
    rng = np.random.default_rng(0)
    full, swa = GroupInfo(0, None, ("f",), 32), GroupInfo(1, 64, ("s",), 32)
    for _ in range(200):
        f = rng.random(10) < 0.9
        w = rng.random(10) < 0.5
        local = int(rng.integers(0, 4))
        f[:local] = True  # the engine's own hit is a complete prefix
        pages = window_safe_pages(f, [w], [64], 32, local)
        toks = window_safe_tokens([f, w], [full, swa], 32, local * 32, 320)
        assert toks == (pages * 32 if pages > local else 0), (f, w, local)


def test_config_parsing_and_errors() -> None:
    cfg = ConnectorConfig.from_extra({"l3_url": "file:x", "checkpoint_interval": 64,
                                      "save_on_finish": "false"})
    assert cfg.l3_url == "file:x" and cfg.checkpoint_interval == 64 and not cfg.save_on_finish
    assert ConnectorConfig.from_extra(None) == ConnectorConfig()
    with pytest.raises(ValueError, match="unknown keys"):
        ConnectorConfig.from_extra({"l3url": "file:x"})
    with pytest.raises(ValueError, match="checkpoint_interval"):
        ConnectorConfig.from_extra({"checkpoint_interval": -1})
    assert ConnectorConfig().l2_gb == 1.0 and ConnectorConfig.from_extra({"l2_gb": 0}).l2_gb == 0
    with pytest.raises(ValueError, match="l2_gb"):
        ConnectorConfig.from_extra({"l2_gb": -1})
    with pytest.raises(TypeError, match="l3_url"):
        ConnectorConfig.from_extra({"l3_url": 3})


def test_checkpoint_auto_grid_scales_with_position() -> None:
    """Every unit up to 2*D units, then D per doubling; position-only (nested calls agree)."""
    from hybridkv_vllm.plan import checkpoint_ends

    assert checkpoint_ends(0, 640, 64) == [64 * m for m in range(1, 9)] + [640]
    grid = checkpoint_ends(0, 1 << 15, 64)
    assert len(grid) == 32 and grid[-1] == 1 << 15
    for lo in range(0, 4000, 97):  # a request resuming at ``lo`` sees the same grid
        assert checkpoint_ends(lo, 4000, 64) == [c for c in checkpoint_ends(0, 4000, 64)
                                                if c > lo]
    # a prefix shared up to p tokens keeps a checkpoint within max(unit, p / D) below p
    for p in range(64, 1 << 14, 61):
        below = [c for c in grid if c <= p]
        assert p - below[-1] <= max(64, p // 4), p
    # short prompts get checkpoints too (the old fixed 4096 stored none below 4096)
    assert checkpoint_ends(0, 300, 64) == [64, 128, 192, 256]
    assert checkpoint_ends(0, 4096, 64, 4096) == [4096] and checkpoint_ends(0, 999, 64, 0) == []
    assert checkpoint_ends(0, 1024, 64, per_doubling=1) == [64, 128, 256, 512, 1024]


def test_pages_to_save_with_explicit_checkpoints() -> None:
    # checkpoints at pages 2 and 6 (W = 2 pages) plus the final tail 7
    assert pages_to_save(SWA, 0, 7, 32, final=True, checkpoints=[2, 6]) == [0, 1, 4, 5, 6]
    assert pages_to_save(SWA, 3, 7, 32, final=False, checkpoints=[2, 6]) == [4, 5]


def test_config_new_keys() -> None:
    cfg = ConnectorConfig.from_extra({"checkpoint_interval": "auto", "async_save": "off",
                                      "save_queue_mb": 8, "checkpoints_per_doubling": 2})
    assert cfg.checkpoint_interval == "auto" and not cfg.async_save
    assert cfg.save_queue_mb == 8.0 and cfg.checkpoints_per_doubling == 2
    assert ConnectorConfig().checkpoint_interval == "auto" and ConnectorConfig().async_save
    with pytest.raises(ValueError, match="checkpoint_interval"):
        ConnectorConfig.from_extra({"checkpoint_interval": "often"})
    with pytest.raises(ValueError, match="checkpoints_per_doubling"):
        ConnectorConfig.from_extra({"checkpoints_per_doubling": 0})
    with pytest.raises(ValueError, match="save_queue_mb"):
        ConnectorConfig.from_extra({"save_queue_mb": 0})


def test_passed_pages_leave_out_the_kept_windows() -> None:
    # window 64 tokens at 32-token pages: a window is the 2 pages before its end
    assert passed_pages(SWA, 10, 32, [10, 6]) == [0, 1, 2, 3, 6, 7]
    assert passed_pages(SWA, 10, 32, [0]) == list(range(10))  # no hit: nothing kept
    assert passed_pages(SWA, 10, 32, [11, 1]) == [1, 2, 3, 4, 5, 6, 7, 8]  # past the end: its part inside
    assert passed_pages(SWA, 0, 32, [4]) == [] and passed_pages(FULL, 10, 32, []) == []


def test_full_bases_name_the_full_page_holding_each_windows_last_token() -> None:
    """MiMo-V2's layout (full blocks of 64, SWA blocks of 32): SWA page i ends at token
    32 (i + 1) - 1, inside full page (32 (i + 1) - 1) // 64; past the full keys: None;
    a full group or a model without one: None; block size 0 (one page size): same index."""
    full, swa = GroupInfo(0, None, ("f",), 64), GroupInfo(1, 128, ("s",), 32)
    keys = {0: [b"F0", b"F1"], 1: [b"S%d" % i for i in range(6)]}
    assert full_bases([full, swa], keys, 1, [0, 1, 2, 3, 4]) == [b"F0", b"F0", b"F1", b"F1", None]
    assert full_bases([full, swa], keys, 0, [0, 1]) is None
    assert full_bases([swa], keys, 1, [0]) is None
    one = [GroupInfo(0, None, ("f",)), GroupInfo(1, 128, ("s",))]
    assert full_bases(one, keys, 1, [1, 2]) == [b"F1", None]
