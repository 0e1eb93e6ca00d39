"""Global prefix index: predictions equal every worker's own tree (the truth)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY, tiny_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from routing_helpers import fingerprint, serve, truth, wire

from hybridkv import HybridKVCache, ModelSpec
from hybridkv.eval.replay import system_config
from hybridkv.eval.traces import TokenMaterializer, bundled_sample, load_trace
from hybridkv.routing import EventBatch, GlobalPrefixIndex, KVEvent, MemoryBus
from hybridkv.routing.bus import decode_batch, encode_batch

seqs = st.lists(st.integers(1, 2), min_size=5, max_size=48).map(lambda x: np.array(x, dtype=np.int32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.integers(0, 2), seqs, st.sampled_from(["a", "b"])), min_size=1, max_size=25),
       queries=st.lists(seqs, min_size=1, max_size=4))
def test_index_matches_every_tree_under_eviction(ops, queries) -> None:
    caches = [tiny_cache() for _ in range(3)]
    bus = MemoryBus()
    pubs, index = wire(caches, bus)
    for worker, tokens, ns in ops:
        serve(caches[worker], tokens, ns)
        for p in pubs:
            p.flush()
        index.poll()
        for q in queries + [tokens]:
            for name in ("a", "b"):
                pred = index.hits(q, name).tokens["L1"].tolist()
                assert pred == truth(caches, q, name), (q, name)
    for c in caches:
        c.check_invariants()


def test_trace_replay_prediction_exact_with_evictions() -> None:
    """Two MiMo-V2.5-Pro workers on 200 Mooncake requests at a budget that evicts full and SWA KV."""
    spec = ModelSpec.preset("mimo-v2.5-pro", page_size=64)
    caches = [HybridKVCache(spec, system_config("hybridkv", spec, int(8e9))) for _ in range(2)]
    bus = MemoryBus()
    pubs, index = wire(caches, bus)
    mat = TokenMaterializer()
    compared = nonzero = 0
    for i, r in enumerate(load_trace(bundled_sample(), limit=200)):
        tokens = mat.tokens(r)
        for p in pubs:
            p.flush()
        index.poll()
        pred = index.hits(tokens, r.namespace).tokens["L1"].tolist()
        real = truth(caches, tokens, r.namespace)
        assert pred == real, i
        compared += 1
        nonzero += any(real)
        serve(caches[i % 2], tokens, r.namespace)
    assert compared == 200 and nonzero > 10
    assert all(c.tree.evicted_full_pages > 0 and c.tree.evicted_swa_pages > 0 for c in caches)


def test_namespaces_never_share() -> None:
    caches = [tiny_cache()]
    pubs, index = wire(caches, MemoryBus())
    tokens = np.arange(1, 30, dtype=np.int32)
    serve(caches[0], tokens, "tenant-a")
    pubs[0].flush()
    index.poll()
    assert index.hits(tokens, "tenant-a").tokens["L1"][0] > 0
    assert index.hits(tokens, "tenant-b").tokens["L1"][0] == 0


def _batch(worker: int, seq: int, keys: list[bytes], epoch: str = "e1", kind: str = "store") -> EventBatch:
    return EventBatch(worker, epoch, seq, 0.0, [KVEvent("L1", kind, "default", tuple(keys),
                                                        tuple(True for _ in keys) if kind != "remove" else ())])


def _index(n: int = 2, **kw) -> tuple[GlobalPrefixIndex, list[float]]:
    now = [0.0]
    idx = GlobalPrefixIndex(n, page_size=TINY.page_size, window=TINY.window, fingerprint=fingerprint(TINY),
                            clock=lambda: now[0], **kw)
    return idx, now


def _keys(tokens: np.ndarray) -> list[bytes]:
    from hybridkv.tiers.keys import page_keys
    return page_keys(tokens, TINY.page_size, namespace="default", fingerprint=fingerprint(TINY))


def test_seq_gap_and_new_epoch_forget_the_worker() -> None:
    idx, _ = _index()
    tokens = np.arange(1, 22, dtype=np.int32)  # 5 whole pages, hit capped at 20 tokens
    keys = _keys(tokens)
    idx.apply(_batch(0, 0, keys))
    idx.apply(_batch(1, 0, keys))
    assert idx.hits(tokens).tokens["L1"].tolist() == [20, 20]
    idx.apply(_batch(0, 2, []))  # seq 1 lost: worker 0's entries may be stale
    assert idx.counters["gaps"] == 1
    assert idx.hits(tokens).tokens["L1"].tolist() == [0, 20]
    idx.apply(_batch(1, 0, keys[:2], epoch="e2"))  # worker 1 restarted
    assert idx.hits(tokens).tokens["L1"].tolist() == [0, 8]


def test_swa_hole_limits_the_window_safe_length() -> None:
    idx, _ = _index(1)
    tokens = np.arange(1, 30, dtype=np.int32)  # 7 pages
    keys = _keys(tokens)
    b = EventBatch(0, "e", 0, 0.0, [KVEvent("L1", "store", "default", tuple(keys),
                                             (True, True, False, True, True, False, False))])
    idx.apply(b)
    # W = 2 pages: L = 5 pages needs SWA on pages 3, 4 -> valid; 6, 7 not.
    assert idx.hits(tokens).tokens["L1"][0] == 5 * 4
    idx.apply(EventBatch(0, "e", 1, 0.0, [KVEvent("L1", "swa_remove", "default", tuple(keys[3:5]),
                                                   (True, False))]))
    assert idx.hits(tokens).tokens["L1"][0] == 2 * 4  # pages 0, 1 still window-safe
    idx.apply(EventBatch(0, "e", 2, 0.0, [KVEvent("L1", "remove", "default", tuple(keys[1:]), ())]))
    assert idx.hits(tokens).tokens["L1"][0] == 4


def test_stale_workers_predict_nothing_and_make_index_unhealthy() -> None:
    idx, now = _index(2, stale_after_s=5.0)
    tokens = np.arange(1, 22, dtype=np.int32)
    idx.apply(_batch(0, 0, _keys(tokens)))
    idx.apply(_batch(1, 0, _keys(tokens)))
    now[0] = 3.0
    idx.apply(_batch(1, 1, []))  # heartbeat of worker 1 only
    now[0] = 6.0
    assert idx.fresh().tolist() == [False, True]
    assert idx.hits(tokens).tokens["L1"].tolist() == [0, 20]
    assert idx.healthy()
    now[0] = 20.0
    assert not idx.healthy()
    assert idx.hits(tokens).tokens["L1"].tolist() == [0, 0]


def test_encode_decode_roundtrip_and_malformed() -> None:
    keys = _keys(np.arange(1, 13, dtype=np.int32))
    b = EventBatch(3, "ep", 7, 1.5, [KVEvent("L1", "store", "ns", tuple(keys), (True, False, True)),
                                     KVEvent("*", "reset", "", (), ())], load=12.0)
    assert decode_batch(encode_batch(b)) == b
    fields = encode_batch(b)
    fields["keys"] = fields["keys"][:-1]
    with pytest.raises(ValueError, match="key blob"):
        decode_batch(fields)
    with pytest.raises(ValueError, match="malformed"):
        decode_batch({"meta": b"{}"})


def test_foreign_worker_ignored_and_bad_args() -> None:
    idx, _ = _index(2)
    idx.apply(_batch(5, 0, _keys(np.arange(1, 9, dtype=np.int32))))
    assert idx.counters["foreign_batches"] == 1 and idx.pages(0) == (0, 0)
    for kw, name in (({"num_workers": 0}, "num_workers"), ({"num_workers": 65}, "num_workers"),
                     ({"page_size": 0}, "page_size"), ({"window": 0}, "window"),
                     ({"stale_after_s": 0}, "stale_after_s")):
        args = {"num_workers": 2, "page_size": 4, "window": 8, "fingerprint": "f"} | kw
        n = args.pop("num_workers")
        with pytest.raises(ValueError, match=name):
            GlobalPrefixIndex(n, **args)
    with pytest.raises(TypeError, match="tokens"):
        idx.hits([1, 2, 3])  # type: ignore[arg-type]
