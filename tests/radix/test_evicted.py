"""Evicted runs: the pages an L1 eviction gives up stay in the tree as runs at the
end of what stays, named as they were, until an insert covers them; the
invariant check catches a run planted where it must not be."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.radix import TreeConfig, WindowSafeTree
from hybridkv.radix.node import EvictedRun
from hybridkv.radix.types import PageNames

from helpers import RecordingPool as Pool

P = 2  # tokens per page


def _names(tokens: np.ndarray, namespace: str = "default") -> PageNames:
    """A name per page spelling its namespace and whole prefix (what chained keys are)."""
    keys = [namespace.encode() + tokens[:(i + 1) * P].tobytes() for i in range(len(tokens) // P)]
    return PageNames(keys, np.zeros(len(keys), dtype=bool))


def _tree(runs: bool = True) -> WindowSafeTree:
    t = WindowSafeTree(TreeConfig(P, 2 * P), Pool())
    if runs:
        t.runs.enable()
    return t


def _insert(t: WindowSafeTree, tokens: np.ndarray, first_page: int) -> None:
    n = len(tokens) // P
    ids = np.arange(first_page, first_page + n, dtype=np.int32)
    t.insert(tokens, ids, ids, names=_names(tokens))


def _walk(t: WindowSafeTree, tokens: np.ndarray) -> list[bytes]:
    """The names the L1 match and then the runs at its end give, as the tiers read them."""
    root, path = t.walk(tokens, "default", len(tokens))
    have = [k for nd, k_ in path for k in nd.page_keys[:k_]]
    end = path[-1][0] if path else root
    return have + t.runs.names(end, tokens, len(have) * P, len(tokens), at=path[-1][1] if path else None)


def test_a_trimmed_leaf_keeps_its_pages_as_a_run_that_spells_their_names():
    t = _tree()
    seq = np.arange(40, dtype=np.int32)
    _insert(t, seq, 0)
    freed, _ = t.evict(full_pages=12)
    assert freed >= 12 and t.full_pages_cached == 20 - freed
    t.check_invariants()
    assert t.runs.pages == 20 - t.full_pages_cached > 0
    assert _walk(t, seq) == _names(seq).keys  # every page named: L1's, then the run's
    other = np.concatenate([seq[:10], np.arange(500, 520, dtype=np.int32)])
    assert _walk(t, other) == _names(other).keys[:5]  # the run spells only its own tokens


def test_runs_follow_evictions_down_to_the_root_and_off_when_not_enabled():
    for enabled in (True, False):
        t = _tree(enabled)
        a = np.arange(30, dtype=np.int32)
        b = np.concatenate([a[:10], np.arange(100, 120, dtype=np.int32)])
        _insert(t, a, 0)
        _insert(t, b, 100)
        t.evict(full_pages=t.full_pages_cached)
        assert t.full_pages_cached == 0
        t.check_invariants()
        want = (len(a) + len(b) - 10) // P if enabled else 0
        assert t.runs.pages == want
        assert _walk(t, a) == (_names(a).keys if enabled else [])
        assert _walk(t, b) == (_names(b).keys if enabled else [])


def test_an_insert_over_a_run_takes_what_both_spell_and_hangs_the_rest_inside_the_leaf():
    t = _tree()
    a = np.arange(30, dtype=np.int32)
    _insert(t, a, 0)
    t.evict(full_pages=t.full_pages_cached)
    assert t.runs.pages == 15
    c = np.concatenate([a[:6], np.arange(200, 210, dtype=np.int32)])
    _insert(t, c, 50)  # a new L1 leaf at the root, over the run's first three pages
    t.check_invariants()
    assert t.runs.pages == 12  # the three pages the leaf spells left the run; the rest stays
    leaf = next(t.iter_nodes())
    assert set(leaf.inner) == {3} and not leaf.evicted  # it leaves the leaf after its page 3
    assert _walk(t, a) == _names(a).keys  # L1's three pages, then the run's twelve
    assert _walk(t, c) == _names(c).keys
    d = np.concatenate([a[:20], np.arange(300, 310, dtype=np.int32)])
    _insert(t, d, 80)  # splits the leaf at page 3 and covers ten more pages of the run
    t.check_invariants()
    assert t.runs.pages == 5 and _walk(t, a) == _names(a).keys
    t.evict(full_pages=t.full_pages_cached)  # all of L1 back into runs
    t.check_invariants()
    assert t.runs.pages == 15 + 5 + 5  # a, c's tail, d's tail
    for w in (a, c, d):
        assert _walk(t, w) == _names(w).keys


def test_a_run_inside_a_leaf_moves_with_the_pages_it_leaves_when_l1_evicts_them():
    t = _tree()
    a = np.arange(40, dtype=np.int32)
    _insert(t, a, 0)
    t.evict(full_pages=t.full_pages_cached)
    b = np.concatenate([a[:20], np.arange(400, 420, dtype=np.int32)])
    _insert(t, b, 100)  # covers 10 pages of a's run; a's last 10 hang inside the leaf at 10
    leaf = next(t.iter_nodes())
    assert set(leaf.inner) == {10}
    for keep_pages in (15, 10, 4, 0):  # evict inside, at and before where the run leaves
        t.evict(full_pages=t.full_pages_cached - keep_pages)
        t.check_invariants()
        assert t.full_pages_cached == keep_pages
        assert _walk(t, a) == _names(a).keys and _walk(t, b) == _names(b).keys
    assert t.runs.pages == 30


def test_the_check_catches_a_run_beside_an_l1_child_a_wrong_count_or_a_run_lost_by_its_last_page():
    t = _tree()
    a = np.arange(20, dtype=np.int32)
    _insert(t, a, 0)
    t.evict(full_pages=4)
    t.check_invariants()
    leaf = next(t.iter_nodes())
    run = next(iter(leaf.evicted.values()))
    root = t.root("default")
    root.evicted = {leaf.key[:P].tobytes(): run}  # planted where an L1 child starts too
    with pytest.raises(AssertionError, match="L1 child"):
        t.check_invariants()
    root.evicted = None
    t.check_invariants()
    t.runs.pages += 1
    with pytest.raises(AssertionError):
        t.check_invariants()
    t.runs.pages -= 1
    home, run.home = run.home, {}
    with pytest.raises(AssertionError, match="does not know the map"):
        t.check_invariants()
    run.home = home
    t.check_invariants()
    last, run.names[-1] = run.names[-1], b"a name no map holds"
    with pytest.raises(AssertionError, match="not found by its last page"):
        t.check_invariants()
    run.names[-1] = last
    t.check_invariants()


def test_the_check_catches_a_run_inside_a_node_that_it_spells_or_outside_its_pages():
    t = _tree()
    a = np.arange(40, dtype=np.int32)
    _insert(t, a, 0)
    t.evict(full_pages=t.full_pages_cached)
    _insert(t, np.concatenate([a[:20], np.arange(400, 420, dtype=np.int32)]), 100)
    t.check_invariants()
    leaf = next(t.iter_nodes())
    at = leaf.inner[10]
    fake = EvictedRun(leaf.key[11 * P:12 * P].copy(), [b"x"])
    leaf.inner[11] = {fake.key.tobytes(): fake}  # a run starting with the leaf's own page 11
    with pytest.raises(AssertionError, match="that it spells"):
        t.check_invariants()
    leaf.inner = {leaf.n_pages: at}  # at its end: not inside
    with pytest.raises(AssertionError, match="outside it"):
        t.check_invariants()
    leaf.inner = {10: at}
    t.check_invariants()


@pytest.mark.parametrize("bad", [0, 1, "yes", None])
def test_enable_rejects_a_flag_that_is_not_a_bool(bad):
    t = _tree(False)
    with pytest.raises(TypeError, match="on must be a bool"):
        t.runs.enable(bad)
    assert t.runs.on is False


@pytest.mark.parametrize("bad", [-1, 1.5, True, None, "3"])
def test_keep_within_rejects_a_bad_cap_and_keeps_the_runs(bad):
    t = _tree()
    _insert(t, np.arange(40, dtype=np.int32), 0)
    t.evict(full_pages=t.full_pages_cached)
    with pytest.raises(ValueError, match="cap"):
        t.runs.keep_within(bad)
    assert t.runs.pages == 20 and t.runs.cap is None


def test_past_the_cap_the_oldest_runs_go_first_with_what_hangs_below_them():
    t = _tree()
    a = np.arange(40, dtype=np.int32)
    b = np.concatenate([a[:20], np.arange(300, 320, dtype=np.int32)])
    c = np.arange(500, 520, dtype=np.int32)
    _insert(t, a, 0)
    _insert(t, b, 100)
    t.evict(full_pages=t.full_pages_cached)  # the two branches first, then what they share
    _insert(t, c, 200)
    t.evict(full_pages=t.full_pages_cached)  # then c, the newest run
    t.check_invariants()
    assert t.runs.pages == 40
    t.runs.keep_within(30)
    t.check_invariants()
    assert t.runs.pages == 30 and t.runs.dropped == 10  # the oldest branch went (10 pages)
    kept = [w for w in (a, b) if _walk(t, w) == _names(w).keys]
    assert len(kept) == 1 and _walk(t, c) == _names(c).keys
    t.runs.keep_within(10)
    t.check_invariants()
    assert t.runs.pages == 10 and _walk(t, c) == _names(c).keys  # the shared run went with its branch
    assert _walk(t, a) == []
    t.runs.keep_within(0)
    t.check_invariants()
    assert t.runs.pages == 0 and t.runs.dropped == 40


def test_dropped_runs_do_not_pile_up_in_the_order():
    t = _tree()
    for i in range(200):  # each run is covered again by the next insert of the same tokens
        seq = np.arange(10, dtype=np.int32) + 1000 * (i % 2)
        _insert(t, seq, 10 * i)
        t.evict(full_pages=t.full_pages_cached)
    t.check_invariants()
    assert len(t.runs._order) <= 2 * t.runs.pages + 64


@pytest.mark.parametrize("seed", range(4))
def test_random_inserts_matches_and_evictions_keep_every_walk_named_right(seed):
    """Inserts of shared stems with their own tails, matches that split nodes and
    lock them for a while, evictions of every size, two namespaces: after each step
    the invariants hold and every walk over L1 and the runs gives the names the
    tokens spell."""
    rng = np.random.default_rng(seed)
    t = _tree()
    stems = [rng.integers(0, 50, 60).astype(np.int32) for _ in range(3)]
    handles = []
    next_page = from_runs = 0
    for step in range(300):
        ns = ("default", "other")[int(rng.integers(0, 2))]
        stem = stems[int(rng.integers(0, len(stems)))]
        cut = int(rng.integers(1, len(stem) // P)) * P
        tail = rng.integers(0, 50, int(rng.integers(0, 5)) * P).astype(np.int32)
        tokens = np.concatenate([stem[:cut], tail])
        op = rng.random()
        if op < 0.45:
            n = len(tokens) // P
            ids = np.arange(next_page, next_page + n, dtype=np.int32)
            next_page += n
            t.insert(tokens, ids, ids, namespace=ns, names=_names(tokens, ns))
        elif op < 0.7:
            m = t.match(tokens, ns, split=True)
            if m.node is not None and rng.random() < 0.5:
                handles.append(t.lock(m.node))
        elif op < 0.8 and handles:
            t.unlock(handles.pop(int(rng.integers(0, len(handles)))))
        else:
            t.evict(full_pages=int(rng.integers(1, 40)))
        t.check_invariants()
        probe = np.concatenate([stems[step % len(stems)], rng.integers(0, 50, 2 * P).astype(np.int32)])
        root, path = t.walk(probe, ns, len(probe))
        got = [k for nd, k_ in path for k in nd.page_keys[:k_]]
        end = path[-1][0] if path else root
        more = t.runs.names(end, probe, len(got) * P, len(probe), at=path[-1][1] if path else None)
        from_runs += len(more)
        got += more
        assert got == _names(probe, ns).keys[:len(got)]
    assert t.runs.pages > 0 and from_runs > 0
    assert any(nd.inner for nd in t.iter_nodes()) or any(r.inner for r in t.runs.iter_runs(t.iter_nodes()))


def test_let_go_cuts_a_run_that_ends_with_a_page_let_go_back_to_a_held_page():
    """A run that ends with a page the tiers let go is cut back to its last page
    a tier still holds (``held``; without it, back past the pages let go), with
    what hangs past the cut, and goes whole when none is held; a page inside a
    run is not looked for (it leaves once the pages after it have).  The hook
    hears each part cut, and every walk still gives the names hashing gives."""
    t = _tree()
    heard: list[list[bytes]] = []
    t.runs.on_drop = lambda run: heard.append(list(run.names))
    a = np.arange(40, dtype=np.int32)
    b = np.concatenate([a[:30], np.arange(300, 310, dtype=np.int32)])
    _insert(t, a, 0)
    _insert(t, b, 100)
    t.evict(full_pages=t.full_pages_cached)  # a's and b's tails below the run of what they share
    t.check_invariants()
    assert t.runs.pages == 25
    na, nb = _names(a).keys, _names(b).keys
    assert t.runs.let_go([b"no run names this", na[12]]) == 0 and t.runs.pages == 25 and not heard
    assert t.runs.let_go([na[19], na[18]]) == 2  # a's last two pages, in L2's order
    t.check_invariants()
    assert heard == [na[18:20]] and _walk(t, a) == na[:18] and _walk(t, b) == nb
    heard.clear()
    first12 = set(na[:12])  # the pages a tier still holds from now on
    assert t.runs.let_go([nb[19]], first12.__contains__, fresh=False) == 5  # b's tail: none held, it goes whole
    assert t.runs.let_go([na[17]], first12.__contains__, fresh=False) == 3
    assert t.runs.pages == 15 and _walk(t, b) == nb[:15]  # the shared run: its last page not let go
    assert t.runs.let_go([na[14]], first12.__contains__, fresh=False) == 3  # back to its last page held
    t.check_invariants()
    assert heard == [nb[15:20], na[15:18], na[12:15]] and _walk(t, a) == na[:12] and t.runs.pages == 12
    heard.clear()
    assert t.runs.let_go([na[11]], lambda name: False, fresh=False) == 12 and t.runs.pages == 0  # none held: whole
    t.check_invariants()
    assert heard == [na[:12]] and _walk(t, a) == [] and t.runs.let_go_pages == 25
    _insert(t, a, 200)  # the cut runs left nothing behind
    t.evict(full_pages=t.full_pages_cached)
    t.check_invariants()
    assert t.runs.pages == 20 and _walk(t, a) == na


def test_let_go_looks_at_runs_made_since_and_keys_pages_as_told():
    """A run made since the last let-go whose last page no tier holds (L2 let it go
    while L1 held it) is cut back to its last page held, and only once looked at;
    with ``fresh`` False it waits.  Runs keyed by what the tiers let a page go by
    (``key_pages_by``: here a name's last 4 bytes) are cut by those keys, and the
    check holds the map to the keys."""
    t = _tree()
    a = np.arange(40, dtype=np.int32)
    _insert(t, a, 0)
    t.evict(full_pages=t.full_pages_cached)
    na = _names(a).keys
    first12 = set(na[:12])
    assert t.runs.pages == 20
    assert t.runs.let_go([], first12.__contains__, fresh=False) == 0 and t.runs.pages == 20
    assert t.runs.let_go([], first12.__contains__) == 8 and _walk(t, a) == na[:12]
    t.check_invariants()
    assert t.runs.let_go([], lambda name: False) == 0  # looked at once: as the tiers tell from now on
    key = {n[-4:]: n for n in na}  # the 4 bytes of each page's last token: unique here
    assert len(key) == len(na)
    t.runs.key_pages_by(lambda name: name[-4:])
    t.check_invariants()
    assert t.runs.let_go([na[11][-4:], na[10][-4:]], lambda k: key[k] in first12) == 2
    assert _walk(t, a) == na[:10]
    t.check_invariants()
    t.runs._tails = {n: r for n, r in zip((na[9],), t.runs._tails.values())}  # planted: keyed by the name
    with pytest.raises(AssertionError, match="not found by its last page"):
        t.check_invariants()
    with pytest.raises(TypeError, match="page_key"):
        t.runs.key_pages_by("last 4 bytes")
