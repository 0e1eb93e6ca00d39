"""The connector reads where L2 holds a page off hybridkv's device tree (:meth:`TreeNames.l2_held`).

Through vLLM's real scheduler with hybridkv's prefix cache and connector, and a
worker-role connector in the same process (the stack of ``test_l2_demote``):
each tree page records, per block of every group, the L2 slot and its stamp
where the save placed it or a lookup found it; a later lookup over those pages
reads L2's answer there instead of asking L2's index by key.  Every answer read off the records
equals asking L2's index by key, page by page, under eviction; a planted fault
(stale records believed) is caught by the same check; and a lookup of a prompt
the device evicted asks L2 nothing by key.  The evicted runs name only pages L2
or L3's record holds, cut as L2 lets them go.
"""

from __future__ import annotations

import shutil
from functools import partial
from typing import Any

import numpy as np
import pytest
from test_l2_demote import _conversations, _request, _rows_agree, _run, stack  # noqa: F401
from test_tree_names import _build, _evicted_prompt

import hybridkv_vllm.connector as connector_mod
from hybridkv.radix.evicted import EvictedRuns
from hybridkv.tiers.index import StoreIndex
from hybridkv.tiers.records import LetGo
from hybridkv.tiers.slots import SlotStamps
from hybridkv_vllm.names import TreeNames


@pytest.fixture()
def compared(monkeypatch) -> list[int]:  # noqa: ANN001
    """Every record read checked against L2's index asked by key; the blocks each read covered."""
    real = TreeNames.l2_held
    blocks: list[int] = []

    def l2_held(self: TreeNames, walk: Any, g: Any, keys: Any, lo: int, hi: int) -> np.ndarray:
        got = real(self, walk, g, keys, lo, hi)
        idx = self.records.host  # the HostTier behind L2's index
        want = (idx.lookup_swa(list(keys[lo:hi])) if g.is_swa else idx.lookup_full(list(keys[lo:hi]))) >= 0
        assert got.tolist() == want.tolist(), "a block's L2 answer off the tree differs from asking by key"
        blocks.append(hi - lo)
        return got

    monkeypatch.setattr(TreeNames, "l2_held", l2_held)
    return blocks


def test_a_lookup_reads_l2_off_the_tree(stack, monkeypatch, compared) -> None:  # noqa: ANN001, F811
    """The device gives up a's prompt (its pages become evicted runs).  The save that
    put a's pages in L2 recorded their slots on the tree, so b's lookup reads them
    there and asks L2 nothing by key, and so does c's lookup of the same prompt (a
    new request, a new walk).  The hit is the same each time."""
    sched, _, prompt = _evicted_prompt(stack, monkeypatch, True)
    conn, mgr = sched.connector, sched.kv_cache_manager
    assert mgr.tree.runs.pages > 0
    hits = []
    counts = []
    for rid in ("b", "c"):
        before = {k: conn.stats.get(k, 0) for k in ("l2_pages_read_off_tree", "l2_pages_asked_by_key")}
        hits.append(conn.get_num_new_matched_tokens(_request(sched, rid, list(prompt)), 0))
        counts.append({k: conn.stats.get(k, 0) - v for k, v in before.items()})
    hit = (len(prompt) - 1) // conn.unit * conn.unit
    assert hits[0] == hits[1] == (hit, True)
    assert counts[0]["l2_pages_asked_by_key"] == 0 and counts[0]["l2_pages_read_off_tree"] > 0
    assert counts[1] == counts[0]
    assert compared and sum(compared) > 0
    mgr.check_invariants()


@pytest.mark.parametrize("orphans", [True, False])
def test_pages_of_a_dropped_run_are_read_off_the_orphans(stack, monkeypatch, compared, orphans: bool) -> None:  # noqa: ANN001, F811
    """The tree drops the runs naming a's evicted prompt (its cap at 0): the blocks
    L2 still holds become orphans, so b's lookup past the tree's entries still finds
    them without asking L2's index, and hits as before.  Planted fault: a dropped
    run leaves nothing behind; the lookup then misses blocks L2 holds and the by-key
    comparison fails."""
    if not orphans:
        monkeypatch.setattr(TreeNames, "orphan_run", lambda self, run: None)
    sched, _, prompt = _evicted_prompt(stack, monkeypatch, True)
    conn, mgr = sched.connector, sched.kv_cache_manager
    assert mgr.tree.runs.pages > 0
    mgr.tree.runs.keep_within(0)
    assert mgr.tree.runs.pages == 0
    if not orphans:
        with pytest.raises(AssertionError, match="differs from asking by key"):
            conn.get_num_new_matched_tokens(_request(sched, "b", list(prompt)), 0)
        return
    before = {k: conn.stats.get(k, 0) for k in ("l2_pages_read_off_orphans", "l2_pages_asked_by_key")}
    hit = (len(prompt) - 1) // conn.unit * conn.unit
    assert conn.get_num_new_matched_tokens(_request(sched, "b", list(prompt)), 0) == (hit, True)
    assert conn.stats["l2_pages_read_off_orphans"] > before["l2_pages_read_off_orphans"]
    assert conn.stats.get("l2_pages_asked_by_key", 0) == before["l2_pages_asked_by_key"]


def test_a_load_from_l3_records_where_l2_admits_it(stack, monkeypatch, compared) -> None:  # noqa: ANN001, F811
    """L2 loses a's pages (only L3 holds them); b's load reads them from L3 and L2
    admits them, and the slots it admits them to are recorded at b's insert: after
    the device evicts b's pages, c's lookup reads every full block off the tree."""
    sched, worker, prompt = _evicted_prompt(stack, monkeypatch, True)
    conn, mgr = sched.connector, sched.kv_cache_manager
    assert conn._tiers.l2.tier.clear() > 0  # L2's index forgets a's pages: L3 alone holds them
    before = dict(worker.stats)
    _run(_request(sched, "b", list(prompt)), sched, worker)
    assert worker.stats["load_pages_l3"] - before.get("load_pages_l3", 0) > 0
    tree = mgr.tree
    tree.evict(full_pages=tree.full_pages_cached, swa_pages=tree.swa_pages_cached)
    asked = conn.stats.get("l2_pages_asked_by_key", 0)
    read = conn.stats.get("l2_pages_read_off_tree", 0)
    hit = (len(prompt) - 1) // conn.unit * conn.unit
    assert conn.get_num_new_matched_tokens(_request(sched, "c", list(prompt)), 0) == (hit, True)
    full_blocks = sum(hit // g.block_size for g in conn.groups if not g.is_swa)
    assert conn.stats["l2_pages_read_off_tree"] - read >= full_blocks
    assert conn.stats.get("l2_pages_asked_by_key", 0) - asked == 0
    mgr.check_invariants()


def _replay(stack: Any, monkeypatch: Any, names: bool, seed: int, host_pages: int = 24, n_conv: int = 3,  # noqa: F811
            **extra: Any) -> tuple[list[Any], dict[str, int], Any]:
    sched, worker = _build(stack, names, monkeypatch, device_pages=70, host_pages=host_pages,
                           repair_windows=False, **extra)  # records go stale
    last = _conversations(sched, worker, n_conv=n_conv, seed=seed)
    per = sorted((rid, st.hit_tokens, st.local_tokens, sorted((str(k), v) for k, v in st.hit_sources.items()))
                 for rid, (_, st) in last.items())
    moved = {k: worker.stats.get(k, 0) for k in ("load_pages", "load_pages_l2", "load_pages_l3")}
    return per, moved, sched


@pytest.mark.parametrize("seed", [5, 6])
def test_records_answer_as_asking_by_key_under_eviction(stack, monkeypatch, compared, tmp_path,  # noqa: ANN001, F811
                                                        seed: int) -> None:
    """Conversations through a small device and a small L2 (records go stale as L2
    evicts): every block's answer off the tree equals asking by key, some come off
    the tree, and the hits and pages moved are those with the names (so the records)
    off."""
    on = _replay(stack, monkeypatch, True, seed)
    stats = on[2].connector.stats
    on[2].shutdown()
    shutil.rmtree(tmp_path / "l3")
    monkeypatch.undo()
    off = _replay(stack, monkeypatch, False, seed)
    assert on[0] == off[0] and on[1] == off[1]
    # complete records: every answer off the tree (its entries, the pages it lost the names of)
    assert compared and stats["l2_pages_read_off_tree"] > 0 and stats.get("l2_pages_asked_by_key", 0) == 0
    assert stats["l2_pages_absent_off_tree"] > 0 and stats["l2_pages_read_off_orphans"] > 0
    assert on[1]["load_pages_l2"] > 0


@pytest.mark.parametrize("fault", ["placements", "finish_saves", "copy_downs"])
def test_an_admission_the_records_miss_is_caught(stack, monkeypatch, compared, fault: str) -> None:  # noqa: ANN001, F811
    """Planted faults: a save's or load's placement in L2 is not recorded at all, or
    one after the prefix manager's insert is not recorded on the tree (only kept for
    an insert), or L2's copy-downs of blocks vLLM's pool gave up are not reported,
    A record (or its absence) then hides a block L2 holds, and the by-key comparison
    fails."""
    from hybridkv.lifecycle import Lifecycle

    if fault == "placements":
        monkeypatch.setattr(TreeNames, "placed", lambda self, st, pages, slots: None)
    elif fault == "finish_saves":
        # claims the tree's pages took the records, writes none
        monkeypatch.setattr(Lifecycle, "take_records", lambda self, tokens, namespace, rows: len(rows))
    else:
        monkeypatch.setattr(TreeNames, "rescued", lambda self, gi, keys, slots: None)
    with pytest.raises(AssertionError, match="differs from asking by key"):
        for seed in (5, 6):
            _replay(stack, monkeypatch, True, seed)[2].shutdown()


def test_a_stale_record_believed_is_caught(stack, monkeypatch, compared) -> None:  # noqa: ANN001, F811
    """Planted fault: a record is believed whatever L2's stamp of its slot says (a freed
    or reused slot still reads as holding the page).  The by-key comparison fails."""
    monkeypatch.setattr(SlotStamps, "held", lambda self, slots, stamps: np.asarray(slots) >= 0)
    with pytest.raises(AssertionError, match="differs from asking by key"):
        _replay(stack, monkeypatch, True, 5)


@pytest.mark.parametrize(("drain", "copies_first"), [("on", True), ("on", False), ("off", True)])
def test_runs_name_what_l2_or_l3s_record_holds(stack, monkeypatch, compared, tmp_path,  # noqa: ANN001, F811
                                               drain: str, copies_first: bool) -> None:
    """Ten conversations through a small device, an L2 not much larger and a short
    L3 record (64 keys, so it lacks most pages L2 lets go): right after each
    lookup's walk, every page an evicted run names is held by L2, or by the record
    now or at an earlier walk (a drain kept it for L3: the record forgets keys,
    not L3), by the key L2 lets it go by (its first full group's last block); pages
    were cut (``tree_run_pages_let_go``); the hits and pages moved are those with
    the names off, with ``l1_copies_first`` (L2 knows which pages the device holds)
    and without.  Planted fault: the drain taken out; a run then names a page
    neither L2 nor the record held."""
    monkeypatch.setattr(connector_mod, "StoreIndex", partial(StoreIndex, bound=64))
    if drain == "off":
        monkeypatch.setattr(LetGo, "drain", lambda self, runs, fresh=True: self.keys.clear() or 0)
    real, seen, stale, l3_kept = TreeNames.seed, [], [], set()

    def seed(self: TreeNames, st: Any, limit: int) -> int:
        n = real(self, st, limit)
        if self.copy_downs_pending():  # fresh runs wait for them
            return n
        tree, store = self.manager.tree, self.manager.connector_under_test._tiers.store
        root = tree.root(self.manager.namespace(st.request))
        for run in tree.runs.iter_runs([root, *tree.iter_nodes()]):
            keys = [self.page_key(nm) for nm in run.names]
            seen.append(len(keys))
            for k, h in zip(keys, (self.records.host.lookup_full(keys) >= 0).tolist()):
                if not h and store.state(k) is not None:
                    l3_kept.add(k)
                elif not h and k not in l3_kept:
                    stale.append(k)
        return n

    monkeypatch.setattr(TreeNames, "seed", seed)
    on = _replay(stack, monkeypatch, True, 5, host_pages=120, n_conv=10, l1_copies_first=copies_first)
    stats = on[2].connector.stats
    on[2].shutdown()
    if drain != "on":
        assert stale, f"with the drain {drain} no run named a page L2 and L3's record lacked"
        return
    assert sum(seen) > 0 and not stale, f"{len(stale)} run pages neither L2 nor L3's record held"
    assert stats["tree_run_pages_let_go"] > 0
    shutil.rmtree(tmp_path / "l3")
    monkeypatch.setattr(TreeNames, "seed", real)
    off = _replay(stack, monkeypatch, False, 5, host_pages=120, n_conv=10, l1_copies_first=copies_first)
    assert on[0] == off[0] and on[1] == off[1]


@pytest.mark.parametrize("counted", [True, False])
def test_pages_a_load_puts_on_the_device_count_as_l1s(stack, monkeypatch, counted: bool) -> None:  # noqa: ANN001, F811
    """a's prompt leaves the device (L2 keeps it); b's load puts it back there.  From
    b's first save on, L2 counts those full pages as the device's (its copies, given
    up first and told to no run), so when the device gives them up while L2 lacks
    them they are copied down, as every page the core's L1 gives up is (repair case
    1).  Planted fault: only the pages a save stores are counted (the loaded ones
    are not); then none of them is copied down."""
    if not counted:  # a load's pages count as stored already: the first save starts past them
        real = connector_mod.HybridKVConnector._save_job

        def save_job(self: Any, st: Any, *a: Any, **k: Any) -> Any:
            st.l1_marked = max(st.l1_marked, st.hit_tokens)
            return real(self, st, *a, **k)

        monkeypatch.setattr(connector_mod.HybridKVConnector, "_save_job", save_job)
    sched, worker, prompt = _evicted_prompt(stack, monkeypatch, True)
    conn, tree = sched.connector, sched.kv_cache_manager.tree
    tier, view = conn._tiers.l2.tier, conn._l1
    b = _request(sched, "b", list(prompt))
    st = conn._state(b)
    _run(b, sched, worker)
    assert st.hit_tokens > 0 and worker.stats["load_pages"] > 0
    loaded = [k for g in conn.groups if not g.is_swa for k in st.keys[g.index][:st.hit_tokens // g.block_size]]
    mine = {k for _, k in view._held.values()}
    assert (set(loaded) <= mine) == counted and (set(loaded) & mine == set()) != counted
    assert tier.discard(loaded, swa=False) > 0  # L2 loses them while the device holds them
    tree.evict(full_pages=tree.full_pages_cached, swa_pages=tree.swa_pages_cached)
    rescued = view.rescued
    _run(_request(sched, "c", [7] * 300), sched, worker)  # a step: the copy-downs queued go out
    back = (tier.lookup_full(loaded) >= 0).sum()
    assert (back == len(loaded) and view.rescued - rescued >= len(loaded)) if counted else back == 0
    assert _rows_agree(sched, worker) and worker.stats["load_failures"] == 0


@pytest.mark.parametrize("orphaned", [True, False])
def test_a_prefix_cache_reset_keeps_the_runs_hooks(stack, monkeypatch, compared, orphaned: bool) -> None:  # noqa: ANN001, F811
    """A prefix-cache reset (the device's cache only: L2 and L3 keep their pages)
    drops the old tree's runs first, so what L2 holds of them stays known as
    orphans, then builds a new tree whose runs still tell the connector what they
    drop, are keyed as L2 lets pages go, and stay capped: b's lookup reads L2 off
    the records and orphans, and after the device evicts the prompt again, c's
    lookup hits without asking L2's index by key.  Planted fault: the old runs
    not dropped; b's lookup then misses blocks L2 holds (before this, a reset also
    lost the drop hook)."""
    if not orphaned:
        monkeypatch.setattr(EvictedRuns, "keep_within", lambda self, cap: None)
    sched, worker, prompt = _evicted_prompt(stack, monkeypatch, True)
    mgr, names = sched.kv_cache_manager, sched.connector._names
    old = mgr.tree
    assert mgr.reset_prefix_cache() and mgr.tree is not old
    runs = mgr.tree.runs
    assert runs.on_drop == names.orphan_run and runs._page_key == names.page_key
    assert runs.on and runs.cap is not None and runs.cap > 0
    if not orphaned:
        with pytest.raises(AssertionError, match="differs from asking by key"):
            _run(_request(sched, "b", list(prompt)), sched, worker)
        return
    _run(_request(sched, "b", list(prompt)), sched, worker)
    mgr.tree.evict(full_pages=mgr.tree.full_pages_cached, swa_pages=mgr.tree.swa_pages_cached)
    assert runs.pages > 0
    asked = sched.connector.stats.get("l2_pages_asked_by_key", 0)
    hit = (len(prompt) - 1) // sched.connector.unit * sched.connector.unit
    assert sched.connector.get_num_new_matched_tokens(_request(sched, "c", list(prompt)), 0) == (hit, True)
    assert sched.connector.stats.get("l2_pages_asked_by_key", 0) == asked
    mgr.check_invariants()
