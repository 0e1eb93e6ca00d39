"""The routing index's window-safe hit lengths agree with the one window rule
(:mod:`hybridkv.window`) and with the rule stated position by position."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.routing import GlobalPrefixIndex
from hybridkv.spec import window_pages
from hybridkv.window import groups_safe_pages


def _by_positions(full: np.ndarray, swa: np.ndarray, window: int, page_size: int) -> int:
    """Largest page-aligned L (tokens) with full KV on [0, L) and SWA KV on
    [max(0, L - window), L), checked token by token."""
    best = 0
    for end in range(1, full.size + 1):
        L = end * page_size
        if not full[:end].all():
            break
        first = max(0, L - window) // page_size
        if swa[first:end].all():
            best = L
    return best


@pytest.mark.parametrize("page_size,window", [(4, 4), (4, 6), (16, 64), (64, 128), (8, 100)])
def test_safe_lengths_agree_with_the_window_rule_on_random_masks(page_size, window):
    rng = np.random.default_rng(page_size * 1000 + window)
    index = GlobalPrefixIndex(5, page_size=page_size, window=window, fingerprint="fp")
    assert index.window_pages == window_pages(window, page_size)
    for _ in range(150):
        pages = int(rng.integers(1, 40))
        full = rng.random((pages, 5)) < rng.uniform(0.7, 1.0)
        swa = rng.random((pages, 5)) < rng.uniform(0.2, 1.0)
        got = index._safe_lengths(full, swa).tolist()
        for w in range(5):
            prefix = int(np.argmin(full[:, w])) if not full[:, w].all() else pages
            rule = groups_safe_pages([swa[:, w]], [window_pages(window, page_size)], prefix) * page_size
            assert got[w] == rule == _by_positions(full[:, w], swa[:, w], window, page_size), (w, full, swa)
