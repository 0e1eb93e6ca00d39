"""Faults degrade to misses: down, slow, restarted servers; circuit breaker."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from hybridkv.tiers.storage import CircuitBreaker, open_backend

from .conftest import FAST, RedisServer, _need_redis, free_port


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_cools_down_and_probes():
    clock = FakeClock()
    br = CircuitBreaker(threshold=2, cooldown_s=5.0, clock=clock)
    assert br.allow() and br.state == "closed"
    br.record_failure()
    assert br.allow()  # one failure < threshold
    br.record_failure()
    assert br.state == "open" and not br.allow() and br.opened == 1
    clock.now += 4.9
    assert not br.allow()
    clock.now += 0.2
    assert br.state == "half-open"
    assert br.allow() and not br.allow()  # exactly one probe
    br.record_failure()  # failed probe re-opens for another cool-down
    assert br.state == "open" and br.opened == 2 and not br.allow()
    clock.now += 5.1
    assert br.allow()
    br.record_success()
    assert br.state == "closed" and br.allow() and br.allow()


def test_breaker_rejects_bad_arguments():
    with pytest.raises(ValueError, match="threshold"):
        CircuitBreaker(threshold=0)
    with pytest.raises(ValueError, match="cooldown_s"):
        CircuitBreaker(cooldown_s=-1)


def test_redis_down_is_a_miss_and_trips_breaker(caplog):
    _need_redis()
    port = free_port()  # nothing listens there: connection refused
    b = open_backend(f"redis://127.0.0.1:{port}/0", breaker_threshold=2, breaker_cooldown_s=30,
                     warn_interval_s=60)
    key = [b"k" * 16]
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hybridkv.tiers.storage"):
        results = [b.get(key), b.put(key, [b"v"]), b.exists(key), b.get_into(key, [memoryview(bytearray(4))])]
        b.touch(key)
        b.delete(key)
    assert time.monotonic() - t0 < 5
    assert results == [[None], [False], [False], [-1]]
    s = b.stats()
    assert s["errors"] == 2 and s["skipped"] == 4 and s["breaker_open"] == 1 and s["breaker_trips"] == 1
    assert s["misses"] == 2 and s["put_failures"] == 1
    # rate limited: one warning per category, not one per call
    assert caplog.text.count("ConnectionError") <= 2
    b.close()


@pytest.fixture()
def silent_server():
    """A TCP server on loopback that accepts connections and never answers."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    yield srv.getsockname()[1]
    stop.set()
    th.join(timeout=2)
    for c in conns:
        c.close()
    srv.close()


def test_redis_slow_server_times_out_to_a_miss(silent_server):
    _need_redis()
    b = open_backend(f"redis://127.0.0.1:{silent_server}/0", socket_timeout=0.2, retries=0,
                     breaker_threshold=5, warn_interval_s=0)
    t0 = time.monotonic()
    assert b.get([b"x" * 16]) == [None]
    assert b.put([b"x" * 16], [b"v"]) == [False]
    assert time.monotonic() - t0 < 3
    s = b.stats()
    assert s["timeouts"] == 2 and s["errors"] == 0 and s["misses"] == 1
    b.close()


def test_breaker_recovers_when_server_comes_up(tmp_path):
    _need_redis()
    server = RedisServer(tmp_path)
    b = open_backend(server.url, breaker_threshold=1, breaker_cooldown_s=0.3, warn_interval_s=0)
    key = [b"r" * 16]
    try:
        assert b.put(key, [b"early"]) == [False]
        assert b.stats()["breaker_open"] == 1
        server.start()
        assert b.put(key, [b"skipped"]) == [False]  # still cooling down: not even tried
        assert b.stats()["skipped"] == 1
        time.sleep(0.35)
        assert b.put(key, [b"later"]) == [True]  # the probe succeeds and closes the breaker
        assert bytes(b.get(key)[0]) == b"later" and b.stats()["breaker_open"] == 0
    finally:
        b.close()
        server.stop()


def test_redis_killed_and_restarted_mid_loop(own_redis):
    b = open_backend(own_redis.url, socket_timeout=0.5, breaker_threshold=2, breaker_cooldown_s=0.1,
                     warn_interval_s=0)
    expected: dict[bytes, bytes] = {}
    wrong: list[int] = []
    hits_after_restart = 0
    for i in range(60):  # bounded: about 2-3 s in all
        if i == 20:
            own_redis.kill()
        if i == 30:
            own_redis.start()  # same port, empty (no persistence)
            time.sleep(0.15)  # let the breaker's cool-down pass
        key = i.to_bytes(16, "little")
        value = f"value-{i}".encode() * 50
        if b.put([key], [value])[0]:
            expected[key] = value
        probe = list(expected)[-5:]
        for k, got in zip(probe, b.get(probe)):
            if got is not None:
                if bytes(got) != expected[k]:
                    wrong.append(i)
                elif i > 30:
                    hits_after_restart += 1
    s = b.stats()
    assert not wrong
    assert s["errors"] + s["timeouts"] >= 1 and s["corrupt"] == 0
    assert hits_after_restart >= 25
    assert bytes(b.get([(59).to_bytes(16, "little")])[0]) == b"value-59" * 50
    b.close()


def test_mooncake_down_is_fast_miss(caplog):
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda not installed")
    rpc, http = free_port(), free_port()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hybridkv.tiers.storage"):
        b = open_backend(f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{http}/metadata",
                         **{**FAST, "breaker_cooldown_s": 0.0})
        key = [b"m" * 16]
        assert b.get(key) == [None] and b.put(key, [b"v"]) == [False] and b.exists(key) == [False]
    assert time.monotonic() - t0 < 10
    assert b.stats()["errors"] >= 3
    assert "not reachable" in caplog.text
    b.close()
