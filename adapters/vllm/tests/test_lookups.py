"""The scheduler side's lookups keep the store off the scheduler's thread unless it
answers fast (``hybridkv_vllm.lookups``): a lookup whose answer needs the store
waits for its probe at most ``lookup_wait_ms``, then answers "ask again later"
(``None``) and the request waits while the others run; the hit is then the
record's, the same one a lookup that probed inline gets.  A store whose last
probes were fast is asked inline; one that does not answer is given up on.
Through vLLM's real scheduler too: a restarted scheduler over a filled L3 (every
key unknown to its record) gets the same hits with every lookup deferred."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from test_l2_demote import _conversations, stack  # noqa: F401 - the fixture
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.tiers.index import StoreIndex
from hybridkv_vllm.config import ConnectorConfig
from hybridkv_vllm.lookups import Lookups, TimedProbe
from hybridkv_vllm.plan import GroupInfo
from hybridkv_vllm.sources import TierView

GROUPS = (GroupInfo(0, None, block_size=8), GroupInfo(1, 16, block_size=8))
UNIT = 8


class GatedStore:
    """``exists`` over a set of keys that blocks until ``gate`` is set and notes the
    threads it ran on."""

    def __init__(self, keys: set[bytes], gated: bool) -> None:
        self.keys, self.gate, self.threads = keys, threading.Event(), set()
        if not gated:
            self.gate.set()

    def exists(self, keys: list[bytes]) -> list[bool]:
        self.threads.add(threading.get_ident())
        assert self.gate.wait(10)
        return [k in self.keys for k in keys]


def _keys(n: int) -> dict[int, list[bytes]]:
    return {g.index: [bytes([g.index]) + i.to_bytes(4, "little") for i in range(n)] for g in GROUPS}


def _lookups(store: GatedStore, wait_s: float, **kw: Any) -> tuple[Lookups, dict[str, int]]:
    """Lookups over ``store`` (through ``kw['times']``, a timed probe of it, when given)
    and the counters they add to."""
    counts: dict[str, int] = {}

    def count(**inc: int) -> None:
        for k, v in inc.items():
            counts[k] = counts.get(k, 0) + v

    view = TierView(GROUPS, None, CacheHitSource.DISK, StoreIndex(kw.get("times") or store.exists))
    return Lookups(view, wait_s, count, **kw), counts


def test_a_slow_store_defers_the_lookup_and_the_hit_comes_later():
    keys = _keys(12)
    store = GatedStore({k for ks in keys.values() for k in ks[:10]}, gated=True)
    lookups, counts = _lookups(store, 0.01)
    try:
        assert lookups.hit("r", keys, 0, 12 * 8 - 8, UNIT) is None  # the probe waits for the store
        assert lookups.hit("r", keys, 0, 12 * 8 - 8, UNIT) is None and lookups.pending() == 1
        assert threading.get_ident() not in store.threads
        store.gate.set()
        for _ in range(1000):
            got = lookups.hit("r", keys, 0, 12 * 8 - 8, UNIT)
            if got is not None:
                break
            threading.Event().wait(0.01)
        # what a lookup probing inline gets: 10 full pages and their window
        inline = TierView(GROUPS, None, CacheHitSource.DISK, StoreIndex(store.exists)).hit(keys, 0, 88, UNIT)
        assert got == inline == 80
        assert counts["lookups_deferred"] == 1 and counts["lookup_probes"] == 1 and lookups.pending() == 0
    finally:
        lookups.close()


def test_a_fast_store_answers_in_the_same_call_from_the_probe_thread():
    keys = _keys(12)
    store = GatedStore({k for ks in keys.values() for k in ks[:6]}, gated=False)
    lookups, counts = _lookups(store, 5.0)
    try:
        assert lookups.hit("r", keys, 0, 88, UNIT) == 48
        assert store.threads and threading.get_ident() not in store.threads
        assert counts == {"lookup_probes": 1}
        assert lookups.hit("r2", keys, 0, 88, UNIT) == 48 and counts == {"lookup_probes": 1}  # the record answers
    finally:
        lookups.close()


def test_a_store_that_does_not_answer_is_given_up_on():
    keys = _keys(12)
    store = GatedStore({k for ks in keys.values() for k in ks}, gated=True)
    now = [0.0]
    lookups, counts = _lookups(store, 0.0, give_up_s=2.0, clock=lambda: now[0])
    try:
        assert lookups.hit("r", keys, 0, 88, UNIT) is None
        now[0] = 1.0
        assert lookups.hit("r", keys, 0, 88, UNIT) is None
        assert lookups.hit("r2", keys, 0, 88, UNIT) is None and counts["lookup_probes"] == 2  # queued behind it
        now[0] = 2.5  # no answer yet: the record's (nothing known), not a wait without end
        assert lookups.hit("r", keys, 0, 88, UNIT) == 0 and counts["lookup_probes_given_up"] == 1
        assert lookups.hit("r3", keys, 0, 88, UNIT) == 0 and counts["lookup_probes"] == 2  # no new probe queued
        lookups.drop("r2")
        assert lookups.pending() == 0
    finally:
        store.gate.set()
        lookups.close()


@pytest.mark.parametrize("kw, match", [({"wait_s": -1.0}, "wait_s"), ({"wait_s": True}, "wait_s"),
                                       ({"give_up_s": 0}, "give_up_s")])
def test_bad_arguments_are_named(kw: dict[str, Any], match: str):
    args = {"wait_s": 0.0, **kw}
    wait_s = args.pop("wait_s")
    with pytest.raises(ValueError, match=match):
        _lookups(GatedStore(set(), gated=False), wait_s, **args)
    with pytest.raises(ValueError, match="lookup_wait_ms"):
        ConnectorConfig.from_extra({"lookup_wait_ms": -1})


def test_a_restarted_scheduler_gets_its_l3_hits_with_every_lookup_deferred(stack, tmp_path: Path):  # noqa: F811
    """A filled L3 (one scheduler's conversations), then two fresh schedulers over it
    (their records know nothing): one waits for every probe, one never waits
    (``lookup_wait_ms=0``: every lookup that needs the store is deferred first).
    They get the same hits; the deferring one never asks the store on its thread (the
    waiting one asks a store that answers fast inline: ``lookup_probes_inline``)."""
    sched, worker = stack(device_pages=70, host_pages=48)
    _conversations(sched, worker, n_conv=2, seed=7)
    hits = {}
    for wait_ms in (60_000, 0):
        sched, worker = stack(device_pages=70, host_pages=48, lookup_wait_ms=wait_ms)
        record = sched.connector._tiers.store
        threads: set[int] = set()
        probe = record._probe

        def noted(keys: list[bytes], probe: Any = probe, threads: set[int] = threads) -> list[bool]:
            threads.add(threading.get_ident())
            return probe(keys)

        record._probe = noted
        last = _conversations(sched, worker, n_conv=2, seed=7)
        stats = sched.connector.stats
        hits[wait_ms] = (sorted((c, st.hit_tokens) for c, (_, st) in last.items()), stats["hit_tokens"])
        assert threads and stats["hit_tokens"] > 0
        if wait_ms == 0:
            assert threading.get_ident() not in threads and stats["lookups_deferred"] > 0
            assert not stats.get("lookup_probes_inline")
        else:
            assert stats["lookup_probes_inline"] > 0 and not stats.get("lookups_deferred")
    assert hits[0] == hits[60_000]


def test_a_store_that_answers_fast_is_asked_inline_until_it_turns_slow():
    """After 8 probes each faster than a quarter of the wait, lookups ask the store on
    the calling thread; one slow answer sends them back to the probe thread."""
    keys = {i: _keys(12) for i in range(12)}  # one prompt per lookup, all new to the record
    for i, ks in keys.items():
        for g in ks:
            ks[g] = [bytes([i]) + k for k in ks[g]]
    store = GatedStore({k for ks in keys.values() for g in ks.values() for k in g[:6]}, gated=False)
    times = TimedProbe(store.exists)
    lookups, counts = _lookups(store, 10.0, times=times)
    main = threading.get_ident()
    try:
        i = 0
        while "lookup_probes_inline" not in counts:  # learning the store: on the probe thread
            assert main not in store.threads and i < 8, (i, counts)  # a lookup probes at least once
            assert lookups.hit(str(i), keys[i], 0, 88, UNIT) == 48
            i += 1
        assert main in store.threads and counts["lookup_probes_inline"] == 1  # 8 fast probes: inline
        probes = counts["lookup_probes"]
        real = store.exists

        def slow(ks: list[bytes]) -> list[bool]:
            threading.Event().wait(3.0)  # slower than a quarter of the 10 s wait
            return real(ks)

        store.exists = slow  # type: ignore[method-assign]
        times._probe = slow  # the timed probe wraps the store's exists
        assert lookups.hit(str(i), keys[i], 0, 88, UNIT) == 48 and counts["lookup_probes_inline"] == 2
        store.threads.clear()
        store.exists = real  # type: ignore[method-assign]
        times._probe = real
        assert lookups.hit(str(i + 1), keys[i + 1], 0, 88, UNIT) == 48  # back on the probe thread
        assert main not in store.threads and counts["lookup_probes"] == probes + 1
        assert counts["lookup_probes_inline"] == 2
    finally:
        lookups.close()
    with pytest.raises(TypeError, match="probe"):
        TimedProbe(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep"):
        TimedProbe(store.exists, keep=0)
