"""Block gather/scatter against vLLM-shaped tensors and the L3 file backend."""

from __future__ import annotations

import pytest
import torch
from hybridkv_vllm.kvio import GroupBuffers, as_np_tokens, load_pages, save_pages
from hybridkv_vllm.l2 import HostPageIndex, HostPageRows

from hybridkv.tiers.keys import page_keys
from hybridkv.tiers.storage import open_backend


def _caches(num_blocks: int = 10, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # CPU backend layout [num_blocks, kv_heads, block, 2 * head] and a block-dim-1 layout
    return {"a": torch.randn(num_blocks, 2, 32, 64, generator=g),
            "b": torch.randn(2, num_blocks, 32, 1, 32, generator=g)}


def test_gather_scatter_roundtrip() -> None:
    src, dst = _caches(seed=1), _caches(seed=2)
    gs, gd = GroupBuffers(src, ["a", "b"], 10), GroupBuffers(dst, ["b", "a"], 10)
    rows = gs.gather([3, 7])
    assert rows.shape == (2, gs.page_elems)
    gd.scatter(rows, [1, 4])
    assert torch.equal(dst["a"][1], src["a"][3]) and torch.equal(dst["a"][4], src["a"][7])
    assert torch.equal(dst["b"][:, 4], src["b"][:, 7])
    assert torch.equal(dst["a"][0], _caches(seed=2)["a"][0])  # untouched block


def test_save_then_load_through_file_backend(tmp_path) -> None:
    be = open_backend(f"file:{tmp_path / 'l3'}")
    keys = page_keys(as_np_tokens(list(range(64))), 32, namespace="t", fingerprint="f")
    src, dst = _caches(seed=3), _caches(seed=4)
    gs, gd = GroupBuffers(src, ["a", "b"], 10), GroupBuffers(dst, ["a", "b"], 10)
    assert save_pages(be, gs, keys, [2, 5]) == (2, 0, 0)
    assert save_pages(be, gs, keys, [2, 5]) == (0, 2, 0)  # existing keys are not rewritten
    assert load_pages(be, gd, keys, [0, 9]) == (True, 0, 2)
    assert torch.equal(dst["a"][0], src["a"][2]) and torch.equal(dst["b"][:, 9], src["b"][:, 5])


def test_missing_page_loads_nothing(tmp_path) -> None:
    be = open_backend(f"file:{tmp_path / 'l3'}")
    keys = page_keys(as_np_tokens(list(range(96))), 32, namespace="t", fingerprint="f")
    src, dst = _caches(seed=5), _caches(seed=6)
    gs, gd = GroupBuffers(src, ["a"], 10), GroupBuffers(dst, ["a"], 10)
    save_pages(be, gs, keys[:2], [1, 2])
    before = dst["a"].clone()
    assert load_pages(be, gd, keys, [3, 4, 5])[0] is False  # third page was never stored
    assert torch.equal(dst["a"], before)


def _slots(index: HostPageIndex, keys: list[bytes], swa: bool = False) -> list[int]:
    """The scheduler side's part of a save or a load: L2's index assigns each key its
    row (held: its row; admitted: a new one; ``-1``: none), as :mod:`.sources` does."""
    return index.place(swa, keys)[1].tolist()


def test_l2_in_front_of_l3(tmp_path) -> None:
    """Saves land in L2 (at the rows the index assigned) and L3; loads read L2 first,
    L3 for the rest, and fill L2."""
    be = open_backend(f"file:{tmp_path / 'l3'}")
    keys = page_keys(as_np_tokens(list(range(96))), 32, namespace="t", fingerprint="f")
    src = _caches(seed=7)
    gs = GroupBuffers(src, ["a", "b"], 10)
    index = HostPageIndex(gs.page_bytes, 2 * gs.page_bytes, 64)  # room for 2 full pages
    l2 = HostPageRows(gs.page_bytes, 2 * gs.page_bytes)
    assert save_pages(be, gs, keys[:2], [1, 2], l2, slots=_slots(index, keys[:2])) == (2, 0, 2)
    assert save_pages(be, gs, keys[2:], [3], l2, slots=_slots(index, keys[2:])) == (1, 0, 1)  # evicts LRU
    assert index.lookup(False, keys).tolist()[0] == -1 and index.tier.stats()["evicted_full_pages"] == 1
    dst = _caches(seed=8)
    gd = GroupBuffers(dst, ["a", "b"], 10)
    assert load_pages(be, gd, keys, [4, 5, 6], l2, slots=_slots(index, keys)) == (True, 2, 1)  # 0 from L3
    for i, j in ((4, 1), (5, 2), (6, 3)):
        assert torch.equal(dst["a"][i], src["a"][j]) and torch.equal(dst["b"][:, i], src["b"][:, j])
    # SWA rows are apart from full ones: the same row of the other kind is a miss
    probe = torch.empty((3, gs.page_bytes), dtype=torch.uint8)
    assert l2.read(True, [0, 1, 0], keys, probe).size == 0
    # a page only L2 holds still loads (L3 lost it), and L2 bytes are the page bytes
    be.delete([keys[2]])
    dst2 = _caches(seed=9)
    gd2 = GroupBuffers(dst2, ["a", "b"], 10)
    # (the L3 read of page 0 above evicted page 1, the LRU one, from L2)
    ok, from_l2, from_l3 = load_pages(be, gd2, [keys[0], keys[2]], [0, 1], l2, slots=_slots(index, [keys[0], keys[2]]))
    assert ok and from_l2 == 2 and from_l3 == 0
    assert torch.equal(dst2["a"][0], src["a"][1]) and torch.equal(dst2["a"][1], src["a"][3])
    assert load_pages(be, gd2, keys[1:2], [2], l2, slots=_slots(index, keys[1:2])) == (True, 0, 1)


def test_a_row_read_only_under_its_own_key(tmp_path) -> None:
    """A row is read only while its tag is the key asked for: a slot the index gave to
    another page before the write reached it, or a save the worker dropped, reads
    as a miss (L3, or a failed load), never as another page's bytes."""
    be = open_backend(f"file:{tmp_path / 'l3'}")
    keys = page_keys(as_np_tokens(list(range(96))), 32, namespace="t", fingerprint="f")
    src = _caches(seed=13)
    gs = GroupBuffers(src, ["a", "b"], 10)
    l2 = HostPageRows(gs.page_bytes, 4 * gs.page_bytes)
    assert l2.write(False, [0, -1, 9], keys, gs.gather([1, 2, 3]).view(torch.uint8)) == 1  # -1, 9: no row
    dst = _caches(seed=14)
    gd = GroupBuffers(dst, ["a", "b"], 10)
    before = dst["a"].clone()
    # keys[1] asked at row 0 (which holds keys[0]): a miss; L3 lacks it: nothing is written
    assert load_pages(be, gd, keys[1:2], [5], l2, slots=[0]) == (False, 0, 0)
    assert torch.equal(dst["a"], before)
    save_pages(be, gs, keys[1:2], [2])  # now L3 has it: read there, and copied into row 0
    assert load_pages(be, gd, keys[1:2], [5], l2, slots=[0]) == (True, 0, 1)
    assert torch.equal(dst["a"][5], src["a"][2])
    assert load_pages(be, gd, keys[1:2], [6], l2, slots=[0]) == (True, 1, 0)  # from L2 now
    assert load_pages(be, gd, keys[:1], [7], l2, slots=[0])[0] is False  # keys[0] left row 0
    with pytest.raises(ValueError, match="parallel"):
        l2.write(False, [0], keys[:2], gs.gather([1, 2]).view(torch.uint8))
    assert l2.stats() == {"rows": 4, "written_full_rows": 1, "written_swa_rows": 0}


def test_save_thread_async_store_release_and_wait(tmp_path) -> None:
    """Prefill saves copy out at submit; finish saves are released once copied out;
    loads can wait for queued keys; a full queue drops prefill saves (counted)."""
    import threading

    from hybridkv_vllm.saver import SaveThread

    be = open_backend(f"file:{tmp_path / 'l3'}")
    caches = _caches(seed=10)
    gb = GroupBuffers(caches, ["a", "b"], 10)
    counts: dict[str, int] = {}
    events: list[dict] = []
    gate = threading.Event()
    real_put = be.put

    def slow_put(keys, values):  # hold the save thread until the test opens the gate
        gate.wait(10)
        return real_put(keys, values)

    be.put = slow_put
    st = SaveThread(be, {0: gb}, None, {0: False}, 3 * gb.page_bytes,
                    lambda **kw: [counts.__setitem__(k, counts.get(k, 0) + v)
                                  for k, v in kw.items()],
                    lambda **ev: events.append(ev))
    keys = page_keys(as_np_tokens(list(range(160))), 32, namespace="t", fingerprint="f")
    want = gb.gather([1, 2]).clone()
    assert st.submit("r1", {0: ([1, 2], keys[:2])}, finish=False)
    caches["a"][1].zero_()  # the block is reused right away: the copy was taken at submit
    assert st.submit("r2", {0: ([3], keys[2:3])}, finish=True)
    assert not st.submit("r3", {0: ([4, 5], keys[3:5])}, finish=False)  # over 3 pages: dropped
    assert counts["save_dropped"] == 2
    assert not st.wait_keys(keys[:1], 0.05)  # still queued behind the gate
    gate.set()
    assert st.wait_keys(keys[:3], 10) and st.drain(None)
    assert st.pop_released() == {"r2"} and st.pop_released() == set()
    assert counts["save_pages"] == 3 and counts["finish_saves"] == 1
    assert [e["req"] for e in events] == ["r1", "r2"]
    dst = _caches(seed=11)
    gd = GroupBuffers(dst, ["a", "b"], 10)
    assert load_pages(be, gd, keys[:2], [6, 7]) == (True, 0, 2)
    assert torch.equal(gd.gather([6, 7]), want)
    assert st.stop(5)
    assert not st.submit("r4", {0: ([1], keys[:1])}, finish=True)  # stopped: released
    assert st.pop_released() == {"r4"}


def test_connector_stats_aggregate_and_prometheus() -> None:
    """The stats payload vLLM ships: sums over workers/scheduler, log summary, counters."""
    from hybridkv_vllm.metrics import COUNTERS, HybridKVPromMetrics, HybridKVStats
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    a = HybridKVStats(data={"hit_tokens": 128, "load_pages": 4})
    a.aggregate(HybridKVStats(data={"hit_tokens": 64, "save_pages": 2}))
    assert a.data == {"hit_tokens": 192, "load_pages": 4, "save_pages": 2}
    assert a.reduce()["hybridkv_hit_tokens"] == 192 and not a.is_empty()
    assert HybridKVStats(data={"lookups": 0}).is_empty()
    reg = CollectorRegistry()

    def bind(cls):  # vLLM passes its own metric classes; register into a private registry
        return lambda *args, **kw: cls(*args, registry=reg, **kw)

    cfg = type("Cfg", (), {"kv_transfer_config": None})()
    prom = HybridKVPromMetrics(cfg, {Counter: bind(Counter), Gauge: bind(Gauge),
                                      Histogram: bind(Histogram)},
                               ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    # every counter exports a sample for every engine from the start, at 0
    for name in COUNTERS:
        for eng in ("0", "1"):
            assert reg.get_sample_value(f"vllm:hybridkv_{name}_total",
                                        {"model_name": "m", "engine": eng}) == 0, (name, eng)
    prom.observe(a.data, 0)
    prom.observe({"hit_tokens": 8}, 0)
    assert reg.get_sample_value("vllm:hybridkv_hit_tokens_total",
                                {"model_name": "m", "engine": "0"}) == 200
    assert reg.get_sample_value("vllm:hybridkv_load_failures_total",
                                {"model_name": "m", "engine": "0"}) == 0
    prom.observe({"save_dropped": 3}, 1)
    assert reg.get_sample_value("vllm:hybridkv_save_dropped_total",
                                {"model_name": "m", "engine": "1"}) == 3


def test_saves_progress_keeps_engine_stepping_until_counted(tmp_path) -> None:
    """Worker reports (busy while saves are queued or counted after the stats pull,
    once more when idle); the scheduler's watch follows them and gives up on a
    stalled save thread; wait_progress wakes on a finished task."""
    import threading

    from hybridkv_vllm.progress import SavesBusy, SavesWatch, WorkerSaves
    from hybridkv_vllm.saver import SaveThread

    assert SavesBusy(1, 3).aggregate(SavesBusy(0, 2)) == SavesBusy(1, 5)
    be = open_backend(f"file:{tmp_path / 'l3'}")
    gb = GroupBuffers(_caches(seed=12), ["a", "b"], 10)
    gate = threading.Event()
    real_put = be.put
    be.put = lambda keys, values: (gate.wait(10), real_put(keys, values))[1]
    st = SaveThread(be, {0: gb}, None, {0: False}, 1 << 30, lambda **kw: None,
                    lambda **ev: None)
    rep, now = WorkerSaves(), [0.0]
    watch = SavesWatch(stall_s=5.0, clock=lambda: now[0])
    assert rep.report(st, False) is None and not watch.busy()  # idle: nothing to say
    keys = page_keys(as_np_tokens(list(range(64))), 32, namespace="p", fingerprint="f")
    assert st.submit("r1", {0: ([1, 2], keys)}, finish=True)
    assert st.wait_progress(5)  # the finish save's copy-out (release) is progress
    assert not st.wait_progress(0.02)  # then the store waits behind the gate
    watch.update(rep.report(st, False))
    assert watch.busy() and st.pending() == 1 and st.done() == 0
    now[0] = 4.0
    watch.update(rep.report(st, False))  # no progress for 4 s: still waiting
    assert watch.busy()
    now[0] = 6.0
    assert not watch.busy()  # stalled for 6 s > 5 s: vLLM may go idle
    gate.set()
    assert st.drain(10) and st.done() == 1
    meta = rep.report(st, True)  # stored, but counted after the stats pull: one more step
    assert meta == SavesBusy(1, 1)
    watch.update(meta)
    assert watch.busy()  # progress (done 0 -> 1) restarted the stall clock
    meta = rep.report(st, False)  # collected: the idle report, sent once
    assert meta == SavesBusy(0, 1)
    watch.update(meta)
    assert not watch.busy() and rep.report(st, False) is None
    watch.update(None)  # steps without worker metadata change nothing
    assert not watch.busy() and not st.wait_progress(1.0)  # nothing pending: at once
    assert st.stop(5)


def test_save_thread_touches_l3_keys_behind_queued_saves(tmp_path) -> None:
    """Repair case 3 on the worker: a touch task runs on the save thread, after the
    saves queued before it, and calls the store's touch with exactly its keys."""
    from hybridkv_vllm.saver import SaveThread

    be = open_backend(f"file:{tmp_path / 'l3'}")
    touched: list[list[bytes]] = []
    order: list[str] = []
    real_put = be.put
    be.touch = lambda keys: (order.append("touch"), touched.append(list(keys)))[0]
    be.put = lambda keys, values: (order.append("put"), real_put(keys, values))[1]
    gb = GroupBuffers(_caches(seed=12), ["a", "b"], 10)
    counts: dict[str, int] = {}
    st = SaveThread(be, {0: gb}, None, {0: False}, 1 << 30,
                    lambda **kw: [counts.__setitem__(k, counts.get(k, 0) + v) for k, v in kw.items()],
                    lambda **ev: None)
    keys = page_keys(as_np_tokens(list(range(96))), 32, namespace="t", fingerprint="f")
    assert st.submit("r1", {0: ([1, 2], keys[:2])}, finish=False)
    st.touch(keys[:3])
    assert st.drain(10)
    assert order == ["put", "touch"] and touched == [keys[:3]]
    assert counts["touch_keys"] == 3 and st.pending() == 0
    assert st.stop(5)
    st.touch(keys)  # stopped: nothing queued, nothing raised
    assert st.pending() == 0


def test_save_thread_writes_the_rows_its_job_names(tmp_path) -> None:
    """A save writes each page to the L2 row its job names (and L3 through); a job
    dropped for a full queue writes no row, so the rows the index gave it read as
    misses."""
    from hybridkv_vllm.saver import SaveThread

    be = open_backend(f"file:{tmp_path / 'l3'}")
    gb = GroupBuffers(_caches(seed=12), ["a", "b"], 10)
    l2 = HostPageRows(gb.page_bytes, 8 * gb.page_bytes)
    counts: dict[str, int] = {}
    st = SaveThread(be, {0: gb}, l2, {0: True}, 2 * gb.page_bytes,
                    lambda **kw: [counts.__setitem__(k, counts.get(k, 0) + v) for k, v in kw.items()],
                    lambda **ev: None)
    keys = page_keys(as_np_tokens(list(range(192))), 32, namespace="t", fingerprint="f")
    assert st.submit("r1", {0: ([1, 2], keys[:2])}, finish=False, slots={0: [5, -1]}) and st.drain(5)
    out = torch.empty((2, gb.page_bytes), dtype=torch.uint8)
    assert l2.read(True, [5, 5], keys[:2], out).tolist() == [0]
    assert torch.equal(out[0], gb.gather([1]).view(torch.uint8)[0])
    assert counts["save_pages"] == 2 and counts["save_pages_l2"] == 1
    st._pending += 1  # a task in flight: a job over the queue bound is dropped
    assert not st.submit("r3", {0: ([3, 4, 5], keys[2:5])}, finish=True, slots={0: [1, 2, 3]})
    st._pending -= 1
    assert st.drain(5) and st.pop_released() == {"r3"} and counts["save_dropped"] == 3
    assert l2.read(True, [1, 2, 3], keys[2:5], torch.empty((3, gb.page_bytes), dtype=torch.uint8)).size == 0
    assert st.stop(5)


@pytest.mark.parametrize("pairing", [True, False])
def test_l2_window_leaves_with_its_base_full_page(monkeypatch, pairing: bool) -> None:
    """An SWA page stored with a base full key leaves L2 when that full page does, and
    enters plain (not anchored) when L2 lacks its base; with ``pairing`` off it stays
    anchored and outlives its base (what the connector did before)."""
    from hybridkv_vllm.l2 import HostPageIndex

    from hybridkv.tiers.host import HostTier

    monkeypatch.setattr(HostTier, "pair_swa", pairing)
    idx = HostPageIndex(64, 4 * 64, 8)  # four pages in all
    full = [b"f0", b"f1"]
    assert idx.admit(False, full)[0].tolist() == [0, 1]
    todo, _ = idx.admit(True, [b"s0", b"sx"], [b"f0", b"absent"])
    assert todo.tolist() == [0, 1] and idx.base_of(b"s0") == b"f0"
    assert idx.tier.anchored_swa([b"s0", b"sx"]).tolist() == [True, not pairing]
    idx.tier.discard([b"f0"])  # e.g. a failed read of f0: its window goes too
    assert (idx.held(True, [b"s0"]).tolist() == [not pairing]
            and idx.tier.counters["dropped_paired_swa_pages"] == int(pairing))
    assert (idx.base_of(b"s0") is None) == pairing  # the pairing maps forget a dropped page
    assert idx.tier.stats()["swa_pages"] == 2 - int(pairing)
