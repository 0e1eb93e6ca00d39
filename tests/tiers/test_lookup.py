"""hybridkv.tiers.lookup: one window-safe tier lookup for every host.

``stored_hit`` asks the store as little as the answer needs, yet its hit equals
the one from asking every key (checked against asking everything, for the
core's two groups and for vLLM-like groups with their own block sizes); the
core's read-ahead runs it, so a long prompt asks about a window's SWA keys,
not every page's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .faulty import Probed
from .reference import SPEC, run, tiered
from hybridkv.tiers.index import StoreIndex
from hybridkv.tiers.lookup import GroupInfo, stored_hit, window_safe_tokens
from hybridkv.tiers.payload import swa_key
from hybridkv.tiers.storage import open_backend


class Store:
    """An in-memory store: ``exists`` counts the keys it was asked about."""

    def __init__(self, keys: set[bytes]) -> None:
        self.keys, self.asked = keys, 0

    def exists(self, keys: list[bytes]) -> list[bool]:
        self.asked += len(keys)
        return [k in self.keys for k in keys]


def _keys(g: int, n: int) -> list[bytes]:
    return [bytes([g]) + i.to_bytes(4, "little") for i in range(n)]


def _draw(data, groups, max_tokens: int):  # noqa: ANN001, ANN202
    """Per group: the prompt's keys, which of them the store holds, which L2 holds."""
    keys, stored, held = {}, set(), {}
    for g in groups:
        n = max_tokens // g.block_size
        keys[g.index] = _keys(g.index, n)
        stored |= {k for k, s in zip(keys[g.index], data.draw(st.lists(st.booleans(), min_size=n, max_size=n))) if s}
        held[g.index] = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool)
    return keys, stored, held


CORE = (GroupInfo(0, None, block_size=4), GroupInfo(1, 16, block_size=4))  # the core's: one page size
MIMO = (GroupInfo(0, None, block_size=8), GroupInfo(1, 16, block_size=4), GroupInfo(2, 32, block_size=8))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["core", "mimo"]), st.integers(1, 40), st.data())
def test_the_hit_equals_asking_every_key_and_asks_no_more(which, units, data):
    groups = CORE if which == "core" else MIMO
    unit = 8 if which == "mimo" else 4
    max_tokens = units * unit
    local = data.draw(st.integers(0, units)) * unit
    keys, stored, held = _draw(data, groups, max_tokens)
    store = Store(stored)
    hit, flags = stored_hit(groups, keys, lambda g, lo, hi: held[g.index][lo:hi], StoreIndex(store.exists),
                            local, max_tokens, unit)
    everything = [held[g.index] | np.array([k in stored for k in keys[g.index]], dtype=bool) for g in groups]
    for g, every in zip(groups, everything):
        every[:local // g.block_size] = True  # the engine's own hit (its pages, its window)
    assert hit == window_safe_tokens(everything, groups, unit, local, max_tokens)
    assert store.asked <= sum(len(k) for k in keys.values())
    for g in groups:  # what it says some tier holds, some tier does hold
        assert not (flags[g.index] & ~everything[groups.index(g)]).any()


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["core", "mimo"]), st.integers(1, 40), st.data())
def test_deferred_keys_probed_elsewhere_give_the_same_hit_without_probing_here(which, units, data):
    """With a ``deferred`` list the store is never asked: the keys it would have been
    asked are collected; once something else asked them (the vLLM connector's probe
    thread), asking again with a fresh list gives the probing lookup's hit and
    collects nothing."""
    groups = CORE if which == "core" else MIMO
    unit = 8 if which == "mimo" else 4
    max_tokens = units * unit
    local = data.draw(st.integers(0, units)) * unit
    keys, stored, held = _draw(data, groups, max_tokens)

    def look(record: StoreIndex, deferred: list[bytes] | None) -> int:
        return stored_hit(groups, keys, lambda g, lo, hi: held[g.index][lo:hi], record, local, max_tokens, unit,
                          deferred=deferred)[0]

    probing = look(StoreIndex(Store(stored).exists), None)
    store = Store(stored)
    record = StoreIndex(store.exists)
    deferred: list[bytes] = []
    first = look(record, deferred)
    assert store.asked == 0 and first <= probing  # nothing asked here; unknown keys count absent
    if not deferred:
        assert first == probing
    look(record, None)  # the probe thread's run: the store's answers land in the record
    asked = store.asked
    again: list[bytes] = []
    assert look(record, again) == probing and not again and store.asked == asked


def test_a_missing_first_full_page_costs_one_small_probe():
    n = 1000
    keys = {0: _keys(0, n), 1: _keys(1, n)}
    store = Store(set(keys[1]))  # every window stored, no full page
    hit, _ = stored_hit(CORE, keys, lambda g, lo, hi: np.zeros(hi - lo, bool), StoreIndex(store.exists),
                        0, n * 4, 4)
    assert hit == 0 and store.asked == 16  # the first chunk of full keys, no SWA key


@pytest.mark.parametrize("length", [401, 161])
def test_the_core_read_ahead_asks_about_a_window_of_swa_not_every_page(tmp_path: Path, length: int):
    url = f"file://{tmp_path / 'l3'}"
    prompt = [("default", np.random.default_rng(31).integers(0, 64, length).astype(np.int32))]
    a = tiered(url, l1_pages=200, l2_pages=400)  # another process fills L3
    run(a, prompt)
    assert a.flush(10)
    a.close()
    store = Probed(open_backend(url))
    b = tiered(store, l1_pages=200, l2_pages=400)  # empty record, empty L1 and L2: everything comes from L3
    try:
        out = run(b, prompt)
        assert out["hit_tokens"] == length - 1, out
        n = (length - 1) // SPEC.page_size
        full = b.lower_tiers.page_keys(prompt[0][1], "default", n)
        swa = {swa_key(k) for k in full}
        asked_swa = [k for k in store.asked if k in swa]
        # the tail window and one page more, not one SWA key per page of the prompt
        assert len(asked_swa) <= SPEC.window_pages + 1, (len(asked_swa), n)
        assert {k for k in store.asked if k not in swa} <= set(full)
    finally:
        b.close()
