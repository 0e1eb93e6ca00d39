"""Router policies, balance knob, share guard, fallback, stale entries; queue ordering."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import tiny_cache
from routing_helpers import serve, truth, wire

from hybridkv.routing import MemoryBus, Router, UncachedFirstQueue


def _cluster(n: int = 3):
    caches = [tiny_cache(full_pages=64, swa_pages=32, retention="dense") for _ in range(n)]
    bus = MemoryBus()
    pubs, index = wire(caches, bus)
    return caches, bus, pubs, index


def _sync(pubs, index) -> None:
    for p in pubs:
        p.flush()
    index.poll()


PROMPT = np.arange(1, 42, dtype=np.int32)  # 41 tokens: 10 whole pages


def test_round_robin_and_least_loaded() -> None:
    rr = Router(3, policy="round_robin")
    assert [rr.route(PROMPT).worker for _ in range(5)] == [0, 1, 2, 0, 1]
    ll = Router(3, policy="least_loaded")
    ll.loads[:] = [50, 10, 30]
    d = ll.route(PROMPT)
    assert d.worker == 1 and ll.loads[1] == 10 + len(PROMPT)
    ll.release(d)
    assert ll.loads[1] == 10
    idle = Router(3, policy="least_loaded")  # ties rotate instead of pinning worker 0
    picks = []
    for _ in range(6):
        d = idle.route(PROMPT)
        picks.append(d.worker)
        idle.release(d)
    assert picks == [0, 1, 2, 0, 1, 2]


def test_affinity_goes_to_the_worker_holding_the_prefix() -> None:
    caches, _, pubs, index = _cluster()
    serve(caches[2], PROMPT[:33])
    _sync(pubs, index)
    r = Router(3, index=index)
    d = r.route(PROMPT)
    assert d.worker == 2 and d.predicted_hit == truth(caches, PROMPT)[2] == 32
    assert d.cost == len(PROMPT) - 32 and r.loads[2] == d.cost


def test_balance_knob_trades_hit_against_load() -> None:
    caches, _, pubs, index = _cluster()
    serve(caches[0], PROMPT[:33])
    _sync(pubs, index)
    busy = Router(3, index=index, balance=1.0, guard_min_tokens=10**9)
    busy.loads[:] = [100, 0, 0]  # 100 queued tokens outweigh a 32-token hit
    assert busy.route(PROMPT).worker == 1
    sticky = Router(3, index=index, balance=0.1, guard_min_tokens=10**9)
    sticky.loads[:] = [100, 0, 0]  # 0.1 * 100 = 10 < 32 saved
    assert sticky.route(PROMPT).worker == 0


def test_share_guard_caps_a_hot_worker() -> None:
    caches, _, pubs, index = _cluster(2)
    serve(caches[0], PROMPT[:33])
    _sync(pubs, index)
    r = Router(2, index=index, balance=0.0, max_share=0.6, guard_min_tokens=0)
    picks = [r.route(PROMPT).worker for _ in range(10)]  # pure affinity would pick 0 every time
    assert picks.count(1) > 0
    assert r.loads[0] <= 0.6 * r.loads.sum() + 1e-9
    assert r.counters["guarded"] > 0


def test_unhealthy_index_falls_back_to_least_loaded() -> None:
    caches, bus, pubs, index = _cluster()
    serve(caches[0], PROMPT[:33])
    _sync(pubs, index)
    bus.fail = True
    assert index.poll() == 0 and not index.healthy()
    r = Router(3, index=index)
    r.loads[:] = [0, 5, 7]
    r.loads[0] = 9
    d = r.route(PROMPT)
    assert d.policy == "least_loaded" and d.worker == 1 and r.counters["fallbacks"] == 1
    assert Router(3, index=None).route(PROMPT).policy == "least_loaded"


def test_stale_entry_costs_a_miss_not_a_wrong_hit() -> None:
    """Worker 0 evicted the prefix while its events were lost: the index still
    believes it holds it.  The router sends the request there; the worker's own
    tree answers with the truth (a miss), and feedback repairs the index."""
    caches, _, pubs, index = _cluster(2)
    serve(caches[0], PROMPT[:33])
    _sync(pubs, index)
    pubs[0].detach()  # events of the eviction never reach the index
    other = np.arange(100, 100 + 4 * 64 + 1, dtype=np.int32)
    serve(caches[0], other)  # 64 pages: the full pool must evict PROMPT's pages
    assert truth(caches, PROMPT)[0] == 0
    r = Router(2, index=index)
    d = r.route(PROMPT)
    assert d.worker == 0 and d.predicted_hit == 32
    req = caches[0].begin(PROMPT)
    assert req.prefix_len == 0  # the truth: compute everything, read nothing stale
    caches[0].abort(req)
    r.feedback(d, req.prefix_len)
    assert r.counters["overpredicted_tokens"] == 32
    assert index.hits(PROMPT).tokens["L1"][0] == 0
    assert r.route(PROMPT).predicted_hit == 0


def test_router_bad_input() -> None:
    for kw, name in (({"policy": "random"}, "policy"), ({"balance": -1}, "balance"),
                     ({"max_share": 0}, "max_share"), ({"max_share": 1.5}, "max_share"),
                     ({"guard_min_tokens": -1}, "guard_min_tokens")):
        with pytest.raises(ValueError, match=name):
            Router(2, **kw)
    with pytest.raises(ValueError, match="num_workers"):
        Router(0)
    _, _, _, index = _cluster(3)
    with pytest.raises(ValueError, match="workers"):
        Router(2, index=index)
    r = Router(2, policy="least_loaded")
    with pytest.raises(TypeError, match="tokens"):
        r.route(np.zeros(0, np.int32))
    assert r.loads.tolist() == [0, 0]


def test_queue_prefers_fewest_uncached_tokens() -> None:
    q: UncachedFirstQueue[str] = UncachedFirstQueue(max_wait_s=100.0)
    for name, u, t in (("cold", 9000, 0.0), ("warm", 100, 1.0), ("mid", 500, 2.0), ("warm2", 100, 3.0)):
        q.push(name, u, t)
    assert [q.pop(4.0) for _ in range(4)] == ["warm", "warm2", "mid", "cold"]
    with pytest.raises(IndexError):
        q.pop(5.0)


def test_queue_starvation_guard_serves_old_requests_first() -> None:
    q: UncachedFirstQueue[str] = UncachedFirstQueue(max_wait_s=10.0)
    q.push("cold", 100_000, 0.0)
    q.push("cold2", 90_000, 1.0)
    for i in range(5):
        q.push(f"warm{i}", 10, 5.0 + i)
    assert q.pop(9.0) == "warm0"
    assert q.pop(10.5) == "cold"  # waited 10.5 s >= 10 s
    assert q.pop(10.6) == "warm1"  # cold2 waited 9.6 s only
    assert q.pop(11.0) == "cold2"
    assert q.starved_pops == 2 and len(q) == 3
    fifo: UncachedFirstQueue[int] = UncachedFirstQueue(max_wait_s=0.0)
    for i, u in enumerate((50, 10, 30)):
        fifo.push(i, u, float(i))
    assert [fifo.pop(5.0) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="uncached"):
        fifo.push(9, -1, 0.0)
    with pytest.raises(ValueError, match="max_wait_s"):
        UncachedFirstQueue(max_wait_s=-1)
