"""The tree's entries record where L2 holds their pages (host slot + stamp): a
lookup reads L2 off them and answers exactly as asking L2 by key.  The core's
records are complete (every admission recorded on its entry, the pages the tree
holds no entry for kept as orphans), so it never asks L2's index; an owner
without complete records asks only where no valid record exists
(hybridkv.tiers.records, hybridkv.tiers.slots)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv import CacheConfig
from hybridkv.eval.model.reference import tiny_spec
from hybridkv.radix.types import PageNames
from hybridkv.spec import AttnKind
from hybridkv.tiers.payload import swa_key
from hybridkv.tiers.slots import SlotStamps
from hybridkv.tiers.tiered import TierConfig, TieredCache

from .helpers import serve_once


def _cache(l1_pages: int, l2_pages: int, policy: str) -> TieredCache:
    spec = tiny_spec()
    fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    return TieredCache(spec, CacheConfig(budget_bytes=l1_pages * (fpb + spb), device="meta"),
                       tiers=TierConfig(l2_bytes=l2_pages * (fpb + spb), write_policy=policy))


def _by_key(co, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """L2's answer asked by key for every page: full and SWA host pages."""
    return co.host.lookup_full(keys), co.host.lookup_swa([swa_key(k) for k in keys])


def _workload(cache: TieredCache, seed: int, steps: int, check) -> None:
    """Shared stems, each request a stem's prefix and its own tail; ``check(tokens)``
    runs before each begin."""
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 500, 200).astype(np.int32) for _ in range(6)]
    for _ in range(steps):
        stem = stems[int(rng.integers(0, len(stems)))]
        cut = int(rng.integers(8, len(stem)))
        tokens = np.concatenate([stem[:cut], rng.integers(0, 500, int(rng.integers(1, 30))).astype(np.int32)])
        check(tokens)
        serve_once(cache, tokens)
        cache.check_invariants()  # includes HostRecords.check: every valid record is right


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_l2_read_off_the_tree_equals_l2_asked_by_key(policy):
    cache = _cache(l1_pages=60, l2_pages=300, policy=policy)
    co = cache.lower_tiers
    P = cache.spec.page_size
    inner = [0]  # lookups made while some run hung inside an entry

    def check(tokens):
        n = (len(tokens) - 1) // P
        nodes = [cache.tree.root("default"), *cache.tree.iter_nodes()]
        inner[0] += any(nd.inner for nd in nodes) or any(r.inner for r in cache.tree.runs.iter_runs(nodes))
        keys, walk = co.walk_prompt(tokens, "default", n)
        with co.mutex:
            want_full, want_swa = _by_key(co, keys)
            res = co.resident(keys, walk)  # every page's SWA asked (every_swa)
        n1 = len(res.l1_full)
        assert (res.l2_full[n1:] == want_full[n1:]).all()
        asked = res.swa == 0  # pages L1 lacks SWA for: L2's answer must be the by-key one
        lacking = np.flatnonzero((res.swa != 1) | asked)
        assert (res.l2_swa[lacking] == want_swa[lacking]).all()

    try:
        _workload(cache, seed=5, steps=150, check=check)
        c = co.counters
        # the core's records are complete: every answer comes off the tree (its entries'
        # records, or the pages it lost the names of), L2's index is never asked
        assert c["l2_pages_read_off_tree"] > 0 and c["l2_pages_asked_by_key"] == 0, c
        assert c["l2_pages_absent_off_tree"] > 0, c  # "not held" read off the tree too
        assert cache.tree.runs.pages > 0 and inner[0] > 0  # runs inside entries were read too
    finally:
        cache.close()


def _evicted_first(seed: int) -> tuple[TieredCache, np.ndarray, int]:
    """A cache whose L1 evicted a first prompt (write-through: L2 holds its pages)
    for 8 others; the cache, the first prompt and its pages."""
    cache = _cache(l1_pages=20, l2_pages=400, policy="write_through")
    P = cache.spec.page_size
    rng = np.random.default_rng(seed)
    first = rng.integers(0, 500, 12 * P + 1).astype(np.int32)
    for tokens in [first] + [rng.integers(500, 900, 12 * P + 1).astype(np.int32) for _ in range(8)]:
        serve_once(cache, tokens)
    return cache, first, (len(first) - 1) // P


def test_a_second_walk_reads_l2_off_the_runs():
    """A prompt whose pages L1 evicted: both lookups read every page's answer off
    the tree (its runs' records), L2's index asked nothing."""
    cache, first, n = _evicted_first(0)
    co = cache.lower_tiers
    try:
        keys, walk = co.walk_prompt(first, "default", n)
        assert sum(k for _, k in walk.runs) > 0, "L1 kept nothing of the first prompt as runs"
        c = co.counters
        for round_ in range(2):
            before = (c["l2_pages_read_off_tree"], c["l2_pages_asked_by_key"])
            keys, walk = co.walk_prompt(first, "default", n)
            with co.mutex:
                res = co.resident(keys, walk)
            read, asked = c["l2_pages_read_off_tree"] - before[0], c["l2_pages_asked_by_key"] - before[1]
            held = int((res.l2_full >= 0).sum()) + int((res.l2_swa >= 0).sum())
            absent = int(((res.l2_full < 0) & (res.full == 0)).sum()) + int(((res.l2_swa < 0) & (res.swa == 0)).sum())
            assert held >= n  # write-through: L2 holds every full page
            assert asked == 0 and read >= held + absent, (read, asked, held, absent)
        cache.check_invariants()
    finally:
        cache.close()


def test_what_l2_lost_is_read_off_the_tree_not_asked():
    """The core's records are complete: a page L2 dropped (evicted, cleared) reads
    "not held" off its entry's stale record, and L2 is asked nothing by key for a
    prompt every page of which the tree names."""
    cache, first, n = _evicted_first(1)
    co = cache.lower_tiers
    try:
        keys, walk = co.walk_prompt(first, "default", n)
        named = sum(k for _, k in walk.path) + sum(k for _, k in walk.runs)
        assert named == n and walk.runs, "the tree names every page of the first prompt, some in runs"
        assert co.clear_l2() > 0
        c = co.counters
        before = dict(c)
        with co.mutex:
            res = co.resident(keys, walk)
        n1 = len(res.l1_full)
        assert (res.l2_full[n1:] < 0).all() and (res.l2_swa[res.swa == 0] < 0).all()
        assert c["l2_pages_asked_by_key"] == before["l2_pages_asked_by_key"]
        absent = c["l2_pages_absent_off_tree"] - before["l2_pages_absent_off_tree"]
        assert absent >= n - n1, (absent, n, n1)
        cache.check_invariants()
        # and served again, the pages are copied back to L2 and recorded where they land
        serve_once(cache, first)
        keys, walk = co.walk_prompt(first, "default", n)
        before = dict(c)
        with co.mutex:
            res = co.resident(keys, walk)
            want_full, _ = _by_key(co, keys)
        n1 = len(res.l1_full)
        assert (res.l2_full[n1:] == want_full[n1:]).all()
        assert c["l2_pages_asked_by_key"] == before["l2_pages_asked_by_key"]
        cache.check_invariants()
    finally:
        cache.close()


@pytest.mark.parametrize("fault", ["finish_copies", "freed_swa"])
def test_an_admission_not_recorded_is_caught(monkeypatch, fault):
    """Planted faults: a finish's copies to L2 are not recorded on the request's path
    (the lifecycle's ``take_records``), or a free listener's SWA copies do not reach
    the entry (``FreedPages``' write-back).  A stale or absent record then hides a
    page L2 holds, and the complete records' check fails."""
    from hybridkv.lifecycle import Lifecycle
    from hybridkv.radix.types import FreedPages

    if fault == "finish_copies":
        monkeypatch.setattr(Lifecycle, "take_records", lambda self, tokens, namespace, rows: None)
        policy = "write_through"
    else:
        real = FreedPages._add
        monkeypatch.setattr(FreedPages, "_add", lambda self, into, n, names, back: real(self, into, n, names, None))
        policy = "write_back"
    cache = _cache(l1_pages=60, l2_pages=60, policy=policy)
    failed = False
    try:
        try:
            _workload(cache, seed=7, steps=200, check=lambda tokens: None)
        except AssertionError as exc:
            failed = "does not bear out" in str(exc)
    finally:
        cache.close()
    assert failed, "an admission the records missed went unnoticed"


def test_a_record_of_a_reused_slot_is_not_valid(monkeypatch):
    """Planted fault: freed slots keep their stamps.  A record of a page L2 evicted
    then reads as held in a slot now holding another page, and the check fails."""
    cache = _cache(l1_pages=60, l2_pages=30, policy="write_back")
    monkeypatch.setattr(SlotStamps, "clear", lambda self, slots: None)
    failed = False
    try:
        def check(tokens):
            pass

        try:
            _workload(cache, seed=7, steps=150, check=check)
        except AssertionError:
            failed = True
    finally:
        cache.close()
    assert failed, "stale records went unnoticed"


def test_slot_stamps():
    st = SlotStamps()
    a = st.stamp(np.array([3, 5000]))  # grows past its first size
    assert (a > 0).all() and a[0] != a[1]
    assert st.held(np.array([3, 5000, 7, -1]), np.array([a[0], a[1], a[0], a[0]])).tolist() == [True, True, False, False]
    st.clear(np.array([3]))
    assert st.held(np.array([3]), a[:1]).tolist() == [False]
    b = st.stamp(np.array([3]))  # the slot reused: the old record stays invalid
    assert b[0] > a[1] and st.held(np.array([3]), a[:1]).tolist() == [False]
    assert st.num_stamped == 2
    assert st.of(np.array([-1, 10 ** 7])).tolist() == [0, 0]


@pytest.mark.parametrize("shape", [(3, 4), (2, 3), (2,), (2, 0)])
def test_page_names_host_at_shape(shape):
    with pytest.raises(ValueError, match="host_at"):
        PageNames([b"a", b"b"], np.zeros(2, dtype=bool), host_at=np.zeros(shape, dtype=np.int64))


def test_records_of_more_pairs_are_read_and_written_at_their_pair():
    """A host recording more (slot, stamp) pairs per page (vLLM: one per block of each
    group) reads and writes only the pair it names; the other pairs stay as they were.
    A frozen walk keeps the rows it saw when the node is trimmed later."""
    from hybridkv.radix.node import TreeNode, unrecorded
    from hybridkv.tiers.records import HostRecords, TreeWalk

    cache = _cache(l1_pages=24, l2_pages=8, policy="write_through")
    host = cache.lower_tiers.host
    try:
        got = host.alloc(3, 0)
        assert got is not None
        host.insert_full([b"k0", b"k1", b"k2"], got[0])
        node = TreeNode.__new__(TreeNode)
        node.host_at = unrecorded(3, width=6)
        assert node.host_at[:, 0::2].tolist() == [[-1] * 3] * 3 and not node.host_at[:, 1::2].any()
        walk = TreeWalk([(node, 3)]).freeze(6)
        node.host_at = node.host_at[:1]  # trimmed after the walk: the frozen rows stay whole
        counts: dict[str, int] = {}
        rec = HostRecords(host, counts)
        keys = [b"k0", b"k1", b"gone"]
        out = rec.slots(AttnKind.FULL, walk, np.arange(3), keys.__getitem__, pair=2)
        assert out.tolist() == [int(got[0][0]), int(got[0][1]), -1]
        assert counts == {"l2_pages_read_off_tree": 0, "l2_pages_absent_off_tree": 0, "l2_pages_read_off_orphans": 0,
                          "l2_pages_asked_by_key": 3}
        rows = walk.segments()[0][0]
        assert rows[:2, 4].tolist() == out[:2].tolist() and (rows[:, :4] == unrecorded(3, 6)[:, :4]).all()
        again = rec.slots(AttnKind.FULL, walk, np.arange(3), keys.__getitem__, pair=2)
        assert again.tolist() == out.tolist() and counts["l2_pages_read_off_tree"] == 2
        assert rec.slots(AttnKind.FULL, TreeWalk([(node, 3)]).freeze(4), np.arange(1), keys.__getitem__,
                         pair=0).tolist() == [int(got[0][0])]  # another width: unrecorded, asked
        with pytest.raises(ValueError, match="pair"):
            rec.slots(AttnKind.FULL, walk, np.arange(1), keys.__getitem__, pair=-1)
    finally:
        cache.close()


def test_host_stamps_follow_admission_and_eviction():
    cache = _cache(l1_pages=24, l2_pages=8, policy="write_through")
    host = cache.lower_tiers.host
    try:
        got = host.alloc(2, 0)
        assert got is not None
        host.insert_full([b"k1", b"k2"], got[0])
        stamps = host.stamps[AttnKind.FULL].of(got[0])
        assert (stamps > 0).all()
        host.discard([b"k1"])
        assert host.stamps[AttnKind.FULL].held(got[0], stamps).tolist() == [False, True]
        host.check_invariants()
    finally:
        cache.close()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_the_backup_of_pages_l1_frees_is_recorded_on_their_run(policy):
    """Pages L1 evicts become a run; the backup that copies them to L2 (write-back,
    or write-through's copy of what L2 evicted as an L1 copy) records their host
    slots on that run, so the first lookup already reads them off the tree."""
    cache = _cache(l1_pages=20, l2_pages=400, policy=policy)
    co = cache.lower_tiers
    co.host.l1_copies_first = True  # write-through: L2 may evict copies of L1 pages, re-copied at free
    P = cache.spec.page_size
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 900, 12 * P + 1).astype(np.int32) for _ in range(9)]
    try:
        for tokens in prompts:
            serve_once(cache, tokens)
        cache.check_invariants()
        runs = list(cache.tree.runs.iter_runs([cache.tree.root("default")]))
        assert runs
        stamps = co.host.stamps[AttnKind.FULL]
        rows = np.concatenate([r.host_at for r in runs])
        valid = stamps.held(rows[:, 0], rows[:, 1])
        held = co.host.lookup_full([k for r in runs for k in r.names]) >= 0
        assert held.sum() > 0 and (valid == held).all(), (valid.sum(), held.sum())
    finally:
        cache.close()


def test_records_written_on_joined_freed_names_reach_each_part():
    """One tree call freeing two entries' pages hands listeners the names joined;
    what a listener records there goes back to each entry's own rows."""
    from hybridkv.radix.node import unrecorded
    from hybridkv.radix.types import FreedPages

    a, b = unrecorded(2), unrecorded(3)
    freed = FreedPages(named=True)
    freed.add_full(np.array([1, 2]), PageNames([b"a1", b"a2"], np.zeros(2, bool), host_at=a))
    freed.add_full(np.array([3]), None)  # an unnamed page between them
    freed.add_full(np.array([4, 5, 6]), PageNames([b"b1", b"b2", b"b3"], np.zeros(3, bool), host_at=b))

    class Index:
        def return_full_pages(self, pages, names):
            assert names.keys == [b"a1", b"a2", None, b"b1", b"b2", b"b3"]
            names.host_at[:, 0] = np.arange(10, 16)
            names.host_at[:, 1] = 7

        def return_swa_pages(self, pages, names):
            raise AssertionError("no SWA pages were freed")

    freed.give_back(Index())
    assert a[:, 0].tolist() == [10, 11] and b[:, 0].tolist() == [13, 14, 15] and (a[:, 1] == 7).all()


def test_orphans_are_believed_while_l2_holds_them():
    """An orphan (a page L2 holds that no entry records) answers a lookup past the
    walk while L2's stamp of its slot matches; one L2 dropped reads "not held" and a
    sweep forgets it; one an entry adopts with its record leaves, one L2 moved since
    stays."""
    from hybridkv.tiers.records import HostRecords, TreeWalk

    cache = _cache(l1_pages=24, l2_pages=8, policy="write_through")
    host = cache.lower_tiers.host
    try:
        counts: dict[str, int] = {}
        rec = HostRecords(host, counts, complete=True)
        got = host.alloc(3, 0)
        assert got is not None
        keys = [b"k0", b"k1", b"k2"]
        host.insert_full(keys, got[0])
        rec.orphan(AttnKind.FULL, keys, got[0])
        assert host.discard([b"k1"]) == 1
        out = rec.slots(AttnKind.FULL, TreeWalk(), np.arange(3), keys.__getitem__)  # all past the (empty) walk
        assert out.tolist() == [int(got[0][0]), -1, int(got[0][2])]
        assert counts["l2_pages_read_off_orphans"] == 2 and counts["l2_pages_asked_by_key"] == 0
        rec._sweep(AttnKind.FULL)
        assert rec.num_orphans == 2
        stamps = host.stamps[AttnKind.FULL].of(got[0])
        rec.adopted(AttnKind.FULL, [b"k0", b"k2"], np.array([[got[0][0], stamps[0]], [got[0][2], stamps[2] + 1]]))
        assert rec.num_orphans == 1  # k2's record names another stamp: it stays an orphan
        with pytest.raises(TypeError, match="complete"):
            HostRecords(host, counts, complete=1)  # type: ignore[arg-type]
    finally:
        cache.close()
