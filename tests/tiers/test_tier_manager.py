"""The tier manager never stalls the engine.

Reads have their own queue ahead of writes; ``begin`` waits for L3 at most
``l3_timeout_s`` in total and never while holding the cache's mutex;
``prefetch`` lands L3 pages in L2 in the background; reads have a circuit
breaker; payloads are encoded on the L3 worker, not the engine thread.
"""

from __future__ import annotations

import ast
import concurrent.futures
import threading
import time
from pathlib import Path

import pytest

from .faulty import FaultyBackend
from .reference import prompts, run, tiered
from hybridkv.tiers.manager import TierManager
from hybridkv.tiers.storage import open_backend


@pytest.fixture()
def warm_l3(tmp_path: Path):
    """A file L3 holding the pages of three prompts (written by another cache)."""
    url = f"file://{tmp_path / 'l3'}"
    ps = prompts(3, seed=11)
    a = tiered(url)
    run(a, ps)
    assert a.flush(10)
    a.close()
    return open_backend(url), ps


def test_reads_do_not_wait_behind_queued_writes(tmp_path):
    slow = FaultyBackend(open_backend(f"file://{tmp_path / 'l3'}"))
    mgr = TierManager(slow, timeout_s=5.0)
    try:
        assert mgr.put_async([b"k" * 16], [b"v" * 64]) and mgr.flush(5)
        slow.delay["put"] = 0.2
        for i in range(20):  # 4 s of queued writes
            assert mgr.put_async([bytes([i]) * 16], [b"w" * 64])
        t0 = time.perf_counter()
        got = mgr.get([b"k" * 16], timeout_s=1.5)
        waited = time.perf_counter() - t0
        assert got[0] is not None and bytes(got[0]) == b"v" * 64
        assert waited < 1.0, waited  # behind at most the write in flight
    finally:
        slow.delay.clear()
        mgr.close()


def test_begin_waits_at_most_the_budget_in_total(warm_l3):
    backend, ps = warm_l3
    slow = FaultyBackend(backend)
    slow.delay.update(exists=0.3, get=0.3)
    b = tiered(slow, l3_timeout_s=0.4)
    try:
        t0 = time.perf_counter()
        req = b.begin(ps[0][1], ps[0][0])
        took = time.perf_counter() - t0
        b.abort(req)
        assert took < 0.4 + 0.25, took  # not exists + get, each up to the timeout
    finally:
        b.close()


def test_begin_does_not_hold_the_mutex_while_waiting_for_l3(warm_l3):
    backend, ps = warm_l3
    slow = FaultyBackend(backend)
    b = tiered(slow, l3_timeout_s=3.0)
    try:
        local = prompts(1, seed=12)
        run(b, local)  # now L1-resident
        slow.delay.update(exists=1.5, get=1.5)
        t = threading.Thread(target=lambda: b.abort(b.begin(ps[0][1], ps[0][0])))
        t.start()
        time.sleep(0.2)  # thread is waiting on L3
        t0 = time.perf_counter()
        req = b.begin(local[0][1], local[0][0])
        took = time.perf_counter() - t0
        assert req.prefix_len == 40
        b.abort(req)
        t.join(10)
        assert took < 0.5, took  # before: blocked until the other begin's L3 wait ended
    finally:
        b.close()


def test_prefetch_lands_l3_pages_in_l2_without_blocking(warm_l3):
    backend, ps = warm_l3
    slow = FaultyBackend(backend)
    slow.delay.update(exists=0.2, get=0.2)
    b = tiered(slow, l3_timeout_s=0.05)
    try:
        tokens = ps[1][1]
        t0 = time.perf_counter()
        handle = b.prefetch(tokens, "default")
        assert time.perf_counter() - t0 < 0.15
        assert handle.wait(10)
        assert b.host.num_full_pages >= 10
        slow.delay.clear()
        t0 = time.perf_counter()
        out = run(b, [ps[1]])
        assert out["hit_tokens"] == 40
        st = b.stats()
        assert st["l3_hit_tokens"] == 40 and st["l3_timeouts"] == 0
    finally:
        b.close()


def test_reads_have_a_circuit_breaker(warm_l3):
    backend, ps = warm_l3
    slow = FaultyBackend(backend)
    slow.delay.update(exists=0.5, get=0.5)
    b = tiered(slow, l3_timeout_s=0.05, l3_read_breaker=(2, 60.0))
    try:
        extra = prompts(8, seed=13)
        for _, toks in extra:
            b.abort(b.begin(toks, "default"))
        time.sleep(1.2)
        calls = slow.calls["exists"] + slow.calls["get"]
        assert calls <= 3, slow.calls  # the breaker opened after two slow reads
        st = b.stats()
        assert st["l3_reads_skipped"] > 0 and st["l3_read_breaker_open"] == 1
    finally:
        b.close()


def test_payload_encoding_runs_off_the_engine_thread(tmp_path):
    b = tiered(f"file://{tmp_path / 'l3'}")
    seen: list[str] = []
    encode = b.codec.encode

    def spy(*a, **k):
        seen.append(threading.current_thread().name)
        return encode(*a, **k)

    b.codec.encode = spy
    try:
        run(b, prompts(3, seed=14))
        assert b.flush(10)
        assert seen and threading.main_thread().name not in seen, seen
        assert b.stats()["l3_write_pages_ok"] > 0
    finally:
        b.close()


def _timeout_handlers(path: Path) -> list[int]:
    """Lines with ``except TimeoutError`` (builtin): misses concurrent.futures' on 3.10."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            names = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            if any(isinstance(n, ast.Name) and n.id == "TimeoutError" for n in names):
                bad.append(node.lineno)
    return bad


def test_future_timeouts_are_caught_on_python_3_10():
    import hybridkv.tiers.manager as m
    import hybridkv.tiers.tiered as t
    for mod in (m, t):
        assert _timeout_handlers(Path(mod.__file__)) == [], mod.__name__
    mgr = TierManager(FaultyBackend(open_backend("file:///tmp/hkv-unused-l3")), timeout_s=0.01)
    try:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        assert mgr._wait(fut, 0.01) is None  # concurrent.futures.TimeoutError is caught
        assert mgr.stats()["l3_timeouts"] == 1
    finally:
        mgr.close()


def test_read_breaker_recovers_when_l3_does(warm_l3):
    backend, ps = warm_l3
    slow = FaultyBackend(backend)
    slow.delay.update(exists=0.3, get=0.3)
    b = tiered(slow, l3_timeout_s=0.05, l3_read_breaker=(1, 0.3))
    try:
        b.abort(b.begin(ps[0][1], "default"))  # late: the breaker opens
        assert b.flush(10)  # the late read finishes (0.6 s of delays, another failure) ...
        time.sleep(0.6)  # ... and the 0.3 s cooldown passes (waiting on the read, not a guess
        # of how long it takes, keeps a loaded machine from probing while still open)
        assert b.stats()["l3_read_breaker_trips"] >= 1
        slow.delay.clear()
        t0 = time.perf_counter()
        b.abort(b.begin(ps[1][1], "default"))  # the probe: sent, not waited for
        assert time.perf_counter() - t0 < 0.2
        assert b.flush(5)
        assert b.stats()["l3_read_breaker_open"] == 0
        out = run(b, [ps[2]])  # healthy again: L3 serves
        assert out["hit_tokens"] == 40 and b.stats()["l3_hit_tokens"] >= 40
    finally:
        b.close()


def test_queued_l3_writes_survive_l2_eviction_before_the_worker_encodes_them(tmp_path):
    slow = FaultyBackend(open_backend(f"file://{tmp_path / 'l3'}"))
    slow.delay["put"] = 0.3  # the write worker lags behind L2's churn
    b = tiered(slow, l1_pages=40, l2_pages=24)
    try:
        ps = prompts(6, seed=15)
        run(b, ps)  # each prompt evicts the previous one's L2 pages before they were encoded
        slow.delay.clear()
        assert b.flush(30)
        st = b.stats()
        assert st["l2_evicted_full_pages"] > 0, st
        assert st["l3_write_pages_gone"] == 0 and st["l3_write_pages_ok"] == st["l3_writes_queued"], st
        b.tree.evict(full_pages=b.tree.evictable_full_pages(), swa_pages=b.tree.evictable_swa_pages())
        b.clear_l2()  # (L1's pages were copied down as L1 freed them: L2 must lose them too)
        out = run(b, ps[:2])  # what L2 lost comes back from L3, right
        assert out["hit_tokens"] == 80 and b.stats()["l3_hit_tokens"] > 0
    finally:
        b.close()


def test_a_read_sees_a_write_still_queued_behind_a_slow_put(tmp_path):
    slow = FaultyBackend(open_backend(f"file://{tmp_path / 'l3'}"))
    slow.delay["put"] = 1.0
    b = tiered(slow, l1_pages=40, l2_pages=24)
    try:
        ps = prompts(8, seed=16)
        run(b, ps)  # L2 keeps only the last prompts' full KV; the earlier pages' L3 writes are still queued
        b.tree.evict(full_pages=b.tree.evictable_full_pages(), swa_pages=b.tree.evictable_swa_pages())
        before = slow.calls["put"]
        out = run(b, ps[:1])  # reads do not queue behind the writes, yet they see them
        assert out["hit_tokens"] == 40 and b.stats()["l3_hit_tokens"] > 0
        assert slow.calls["put"] - before <= 1  # served before the queued puts ran
    finally:
        slow.delay.clear()
        b.close()
