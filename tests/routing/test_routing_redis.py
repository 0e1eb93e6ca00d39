"""KV events over a real redis-server (127.0.0.1, free port): round trip,
server crash (router degrades to least-loaded, nothing raises), recovery."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import RedisServer, tiny_cache
from routing_helpers import serve, truth, wire

from hybridkv.routing import BusError, EventBatch, KVEvent, RedisStreamBus, Router


def _bus(server: RedisServer) -> RedisStreamBus:
    return RedisStreamBus(server.url, stream="hkv:test-events", socket_timeout=0.5)


def _sync(pubs, index) -> list[bool]:
    sent = [p.flush() for p in pubs]
    index.poll()
    return sent


def _prompts(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    base = [rng.integers(1, 50, size=int(rng.integers(5, 60))).astype(np.int32) for _ in range(4)]
    return [np.concatenate([base[int(rng.integers(0, 4))], rng.integers(1, 3, size=int(rng.integers(1, 12)))])
            .astype(np.int32) for _ in range(n)]


def test_stream_roundtrip_and_bad_args(redis_server: RedisServer) -> None:
    bus = _bus(redis_server)
    b = EventBatch(1, "ep", 0, 2.0, [KVEvent("L1", "store", "ns", (b"k" * 16, b"j" * 16), (True, False))], 3.0)
    bus.publish(b)
    bus.publish(EventBatch(1, "ep", 1, 3.0, []))
    cursor, got = bus.read("0-0", 10)
    assert got == [b, EventBatch(1, "ep", 1, 3.0, [])]
    assert bus.read(cursor, 10) == (cursor, [])
    bus.close()
    for kw, name in (({"stream": ""}, "stream"), ({"maxlen": 0}, "maxlen"), ({"socket_timeout": 0}, "socket_timeout")):
        with pytest.raises(ValueError, match=name):
            RedisStreamBus(redis_server.url, **kw)


def test_index_over_redis_matches_trees(redis_server: RedisServer) -> None:
    caches = [tiny_cache() for _ in range(3)]
    pubs, index = wire(caches, _bus(redis_server))
    reader2 = wire([tiny_cache() for _ in range(3)], _bus(redis_server))[1]  # a second router, own cursor
    rng = np.random.default_rng(0)
    prompts = _prompts(rng, 60)
    for i, p in enumerate(prompts):
        serve(caches[i % 3], p)
        assert all(_sync(pubs, index))
        reader2.poll()
        for q in prompts[max(0, i - 5):i + 1]:
            assert index.hits(q).tokens["L1"].tolist() == truth(caches, q)
            assert reader2.hits(q).tokens["L1"].tolist() == truth(caches, q)
    assert index.healthy() and index.counters["gaps"] == 0


def test_redis_crash_degrades_then_recovers(redis_server: RedisServer) -> None:
    caches = [tiny_cache() for _ in range(2)]
    pubs, index = wire(caches, _bus(redis_server), stale_after_s=60.0)
    rng = np.random.default_rng(1)
    prompts = _prompts(rng, 30)
    for i, p in enumerate(prompts[:10]):
        serve(caches[i % 2], p)
    assert all(_sync(pubs, index)) and index.healthy()
    router = Router(2, index=index)

    redis_server.kill()
    t0 = time.monotonic()
    for i, p in enumerate(prompts[10:20]):  # the caches keep serving while events are lost
        serve(caches[i % 2], p)
    assert _sync(pubs, index) == [False, False]  # no exception into the engine
    assert all(p.counters["publish_failures"] == 1 for p in pubs)
    assert index.counters["bus_failures"] == 1 and not index.healthy()
    router.loads[:] = [10, 3]
    d = router.route(prompts[0])
    assert d.policy == "least_loaded" and d.worker == 1 and router.counters["fallbacks"] == 1
    assert time.monotonic() - t0 < 10, "a dead server must cost bounded time"

    redis_server.start()  # same port, empty server (no persistence): the stream is gone
    for i, p in enumerate(prompts[20:]):
        serve(caches[i % 2], p)
    assert _sync(pubs, index) == [True, True]
    assert all(p.counters["snapshots"] >= 2 for p in pubs)  # reset + snapshot after the loss
    assert index.healthy()
    for q in prompts:
        assert index.hits(q).tokens["L1"].tolist() == truth(caches, q)
    assert router.route(prompts[-1]).policy == "affinity"


def test_bus_errors_are_bus_errors(redis_server: RedisServer) -> None:
    bus = _bus(redis_server)
    redis_server.kill()
    with pytest.raises(BusError):
        bus.publish(EventBatch(0, "e", 0, 0.0, []))
    with pytest.raises(BusError):
        bus.read("0-0", 1)
