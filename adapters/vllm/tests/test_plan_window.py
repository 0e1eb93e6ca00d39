"""plan's window-safe hits agree with the one window rule (:mod:`hybridkv.window`)
and with the rule stated position by position, on random masks (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hybridkv_vllm.plan import GroupInfo, window_safe_pages, window_safe_tokens

from hybridkv.spec import window_pages
from hybridkv.window import groups_safe_pages


def _by_positions(present: list[np.ndarray], groups: list[GroupInfo], unit: int, local: int,
                  max_tokens: int) -> int:
    """Largest L (a multiple of unit, local < L <= max_tokens) such that every
    token of [local, L) has full KV and every token of [max(local, L - W), L)
    the KV of each sliding group, checked token by token; 0 if none."""
    best = 0
    for L in range(unit, max_tokens + 1, unit):
        if L <= local:
            continue
        ok = True
        for pres, g in zip(present, groups):
            lo = local if not g.is_swa else max(local, L - g.window)
            tokens = np.arange(lo, L)
            if tokens.size and not np.asarray(pres, dtype=bool)[tokens // g.block_size].all():
                ok = False
                break
        if ok:
            best = L
    return best


@pytest.mark.parametrize("seed", range(6))
def test_window_safe_pages_agrees_with_the_window_rule(seed):
    rng = np.random.default_rng(seed)
    for _ in range(120):
        page_size = int(rng.choice([4, 16, 32]))
        n = int(rng.integers(0, 30))
        groups = int(rng.integers(1, 4))
        windows = [int(rng.integers(1, 5 * page_size)) for _ in range(groups)]
        full = rng.random(n) < rng.uniform(0.8, 1.0)
        swa = [rng.random(n) < rng.uniform(0.2, 1.0) for _ in range(groups)]
        local = int(rng.integers(0, n + 2))
        got = window_safe_pages(full, swa, windows, page_size, local)
        prefix = int(np.argmin(full)) if not full.all() else n
        rule = groups_safe_pages(swa, [window_pages(w, page_size) for w in windows], prefix, local)
        assert got == rule, (full, swa, windows, page_size, local)
        if got > local:  # a load: the rule checked position by position
            gs = [GroupInfo(0, None, ("f",), page_size)] + [GroupInfo(i + 1, w, ("s",), page_size)
                                                            for i, w in enumerate(windows)]
            want = _by_positions([full] + swa, gs, page_size, local * page_size, prefix * page_size)
            assert got * page_size == want


@pytest.mark.parametrize("seed", range(6))
def test_window_safe_tokens_agrees_with_the_window_rule(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(120):
        sizes = [int(rng.choice([16, 32, 64])) for _ in range(int(rng.integers(1, 4)))]
        groups = [GroupInfo(i, None if rng.random() < 0.4 else int(rng.integers(1, 300)), ("l",), bs)
                  for i, bs in enumerate(sizes)]
        unit = int(np.lcm.reduce(sizes))
        max_tokens = int(rng.integers(0, 12)) * unit
        local = int(rng.integers(0, max_tokens // unit + 2)) * unit
        present = [rng.random(max_tokens // g.block_size) < rng.uniform(0.3, 1.0) for g in groups]
        got = window_safe_tokens(present, groups, unit, local, max_tokens)
        assert got == _by_positions(present, groups, unit, local, max_tokens), (present, groups, unit, local)
