"""Window-safe hit rule, save selection and config parsing (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv_vllm.config import ConnectorConfig
from hybridkv_vllm.plan import GroupInfo, pages_to_save, swa_first_page, window_safe_pages

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


def test_config_parsing_and_errors() -> None:
    cfg = ConnectorConfig.from_extra({"l3_url": "file:x", "checkpoint_interval": 64,
                                      "save_on_finish": "false"})
    assert cfg.l3_url == "file:x" and cfg.checkpoint_interval == 64 and not cfg.save_on_finish
    assert ConnectorConfig.from_extra(None) == ConnectorConfig()
    with pytest.raises(ValueError, match="unknown keys"):
        ConnectorConfig.from_extra({"l3url": "file:x"})
    with pytest.raises(ValueError, match="checkpoint_interval"):
        ConnectorConfig.from_extra({"checkpoint_interval": -1})
    with pytest.raises(TypeError, match="l3_url"):
        ConnectorConfig.from_extra({"l3_url": 3})
