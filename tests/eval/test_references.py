"""Replay references (LRU over full KV, Belady) and the prefill-FLOPs model."""

import json

import numpy as np
import pytest

from hybridkv import ModelSpec
from hybridkv.eval.cli import main
from hybridkv.eval.references import PageLog, prefill_flops, simulate_reference


def _log(prompts, page=2):
    log = PageLog(page)
    for p in prompts:
        t = np.asarray(p, dtype=np.int32)
        log.record(t, "default", len(t) - 1)
    return log


def test_loop_larger_than_cache_lru_zero_belady_keeps_some():
    a, b, c = (np.arange(k * 100, k * 100 + 7) for k in range(3))  # 3 pages each, hit cap 3 pages
    log = _log([a, b, c] * 4)
    lru = simulate_reference(log, 6, "lru")
    opt = simulate_reference(log, 6, "optimal")
    assert lru.sum() == 0                       # a cyclic loop one prompt too large: LRU always misses
    assert opt.sum() > 0
    assert (simulate_reference(log, 9, "lru")[3:] == 6).all()   # everything fits: every repeat hits


def test_references_hits_are_prefixes_and_bounded():
    rng = np.random.default_rng(1)
    base = rng.integers(0, 1000, 40)
    prompts = [np.concatenate([base[:rng.integers(2, 40)], rng.integers(0, 1000, rng.integers(1, 9))])
               for _ in range(60)]
    log = _log(prompts)
    for cap in (0, 3, 10, 100):
        lru = simulate_reference(log, cap, "lru")
        opt = simulate_reference(log, cap, "optimal")
        assert opt.sum() >= lru.sum()
        assert (opt <= np.array([(len(p) - 1) // 2 * 2 for p in prompts])).all()
        if cap == 0:
            assert opt.sum() == 0
    with pytest.raises(ValueError, match="policy"):
        simulate_reference(log, 3, "mru")


def test_prefill_flops_is_additive_and_superlinear():
    spec = ModelSpec.preset("mimo-v2.5-pro", page_size=64)
    n, h = 40_000, 12_345
    assert prefill_flops(spec, n) == pytest.approx(prefill_flops(spec, h) + prefill_flops(spec, n, h))
    assert prefill_flops(spec, 2 * n) > 2 * prefill_flops(spec, n)   # full layers: quadratic attention
    assert prefill_flops(spec, 0) == 0.0


def test_replay_json_reports_references_and_flops(capsys):
    assert main(["replay", "--limit", "40", "--json", "--no-progress", "--hbm-gb", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    refs = out["references"]
    opt, lru = refs["optimal_at_budget"]["token_hit_rate"], refs["lru_full"]["token_hit_rate"]
    assert 0 <= lru <= opt <= out["prefix_bound_hit_rate"] + 1e-12
    assert "upper reference" in refs["optimal_at_budget"]["label"]
    assert 0 <= out["prefill_flops_saved_fraction"] <= 1
    assert "prefill_flops_saved_fraction" in out["baselines"]["naive"]
    assert main(["replay", "--limit", "20", "--no-progress", "--hbm-gb", "5"]) == 0
    text = capsys.readouterr().out
    assert "optimal_at_budget" in text and "lru_full" in text and "FLOPs saved" in text
