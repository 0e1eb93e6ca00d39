"""L2's full pages form a tree of page keys: a page is evicted only once no page L2
holds extends it (a leaf), least recently used leaf first."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hybridkv.spec import ModelSpec
from hybridkv.tiers.host import HostTier

SPEC = ModelSpec.preset("mimo-v2.5", page_size=4)


def _tier(full_pages: int) -> HostTier:
    return HostTier(SPEC, full_pages * SPEC.bytes_per_page("full"))


def _store(tier: HostTier, keys: list[bytes], parents: list[bytes | None] | None, protect=()) -> None:
    got = tier.alloc(len(keys), 0, protect=protect)
    assert got is not None
    tier.insert_full(keys, got[0], parents)


def _chain(name: str, n: int, start: bytes | None = None) -> tuple[list[bytes], list[bytes | None]]:
    keys = [f"{name}{i}".encode() for i in range(n)]
    return keys, [start, *keys[:-1]]


def _reachable(tier: HostTier, keys: list[bytes]) -> int:
    """Pages of ``keys`` a lookup can use: the leading run L2 holds."""
    held = tier.lookup_full(keys) >= 0
    return len(keys) if held.all() else int(np.argmin(held))


def test_a_sequence_loses_its_tail_first():
    tier = _tier(6)
    keys, parents = _chain("a", 6)
    _store(tier, keys, parents)
    _store(tier, [b"x", b"y"], None)  # two roots: the sequence is older, its tail goes
    assert _reachable(tier, keys) == 4
    assert tier.lookup_full([b"x", b"y"]).min() >= 0
    tier.check_invariants()


def test_without_parents_the_first_page_goes_first():
    """The old rule (no key tree): LRU over keys drops the sequence's first page and
    leaves the other five unreachable.  The tree above keeps four of six usable."""
    tier = _tier(6)
    keys, _ = _chain("a", 6)
    _store(tier, keys, None)
    _store(tier, [b"x", b"y"], None)
    assert _reachable(tier, keys) == 0 and tier.num_full_pages == 6


def test_a_shared_prefix_outlives_its_extensions():
    """A later turn hits the first turn's prefix and adds pages: the first turn's own
    tail goes, then the new turn's tail, and the shared prefix last."""
    tier = _tier(9)
    a, pa = _chain("a", 6)
    _store(tier, a, pa)
    tier.lookup_full(a[:3], touch=True)  # the next turn hits a[:3] and adds b0..b2
    b, pb = _chain("b", 3, a[2])
    _store(tier, b, pb)
    _store(tier, [b"x", b"y", b"z"], None)  # 3 pages of room: a[3:] go, not a[0]
    assert _reachable(tier, a) == 3 and _reachable(tier, a[:3] + b) == 6
    _store(tier, [b"u", b"v"], None)  # then the extension's tail, the prefix stays whole
    assert _reachable(tier, a[:3] + b) == 4 and _reachable(tier, a) == 3
    tier.check_invariants()


def test_leaves_go_least_recently_used_first_and_protected_pages_stay():
    tier = _tier(4)
    _store(tier, [b"p", b"q"], None)
    _store(tier, [b"r", b"s"], None)
    tier.lookup_full([b"p"], touch=True)
    q = int(tier.lookup_full([b"q"])[0])
    _store(tier, [b"t"], None, protect=[q])  # q is the LRU leaf but a load reads it
    assert tier.lookup_full([b"p", b"q", b"r", b"s", b"t"]).tolist()[2] == -1
    tier.check_invariants()


def test_a_parent_becomes_a_leaf_at_its_own_last_use():
    """When its last child goes, a page is filed as a leaf at its last use, not as
    newly used: an older parent goes before a newer root."""
    tier = _tier(4)
    keys, parents = _chain("a", 2)
    _store(tier, keys, parents)
    _store(tier, [b"x"], None)
    _store(tier, [b"y"], None)  # full now; a1 is the LRU leaf
    _store(tier, [b"z"], None)
    assert tier.lookup_full(keys).tolist()[1] == -1
    _store(tier, [b"w"], None)  # a0 (used before x) is a leaf now and goes next
    assert tier.lookup_full([keys[0], b"x"]).tolist() == [-1, tier.lookup_full([b"x"])[0]]
    tier.check_invariants()


def test_a_root_stored_again_with_its_parent_joins_the_tree():
    tier = _tier(3)
    _store(tier, [b"c"], None)  # stored before its parent was known (a copy-down)
    _store(tier, [b"p"], None)
    got = tier.alloc(1, 0)
    tier.insert_full([b"c"], got[0], [b"p"])  # the duplicate's page is freed
    _store(tier, [b"x"], None)
    _store(tier, [b"y"], None)  # room for y: c (a leaf, LRU) goes, never p before c
    held = dict(zip([b"p", b"c", b"x", b"y"], (tier.lookup_full([b"p", b"c", b"x", b"y"]) >= 0).tolist()))
    assert held[b"c"] is False or held[b"p"] is True
    tier.check_invariants()


def test_parents_must_match_keys():
    tier = _tier(2)
    got = tier.alloc(2, 0)
    with pytest.raises(ValueError, match="parents"):
        tier.insert_full([b"a", b"b"], got[0], [None])
    assert tier.num_full_pages == 0


@pytest.mark.parametrize("seed", range(30))
def test_no_page_goes_before_a_page_that_extends_it(seed):
    """Random chains, branches, touches, discards and clears: every page the store
    evicts has no held page naming it as parent, and the tree's counts stay exact."""
    from hybridkv.tiers.events import TierEvent

    rng = random.Random(seed)
    cap = rng.randint(4, 24)
    tier = _tier(cap)
    parent_of: dict[bytes, bytes | None] = {}
    evicted: list[bytes] = []
    tier.listeners.append(lambda ev: evicted.extend(ev.keys) if ev.kind == "remove" else None)
    seqs: list[list[bytes]] = []
    for step in range(300):
        op = rng.random()
        if op < 0.55 or not seqs:
            base = rng.choice(seqs) if seqs and rng.random() < 0.6 else []
            cut = rng.randint(0, len(base))
            tier.lookup_full(base[:cut], touch=True)
            new = [f"{step}.{i}".encode() for i in range(rng.randint(1, min(6, cap)))]
            seq = base[:cut] + new
            parents = [seq[cut + i - 1] if cut + i else None for i in range(len(new))]
            evicted.clear()
            got = tier.alloc(len(new), 0)
            assert got is not None  # nothing is protected: room can always be made
            held = {k for k in tier.full_keys()}
            for k in evicted:  # no page L2 still holds extends a page it evicted
                assert not any(parent_of.get(h) == k for h in held), (seed, step, k)
            tier.insert_full(new, got[0], parents)
            parent_of.update(zip(new, parents))
            seqs.append(seq)
        elif op < 0.85:
            s = rng.choice(seqs)
            tier.lookup_full(s[:rng.randint(0, len(s))], touch=True)
        elif op < 0.97:
            tier.discard([rng.choice(rng.choice(seqs))])
        else:
            tier.clear()
        tier.check_invariants()
    assert tier.counters["evicted_full_pages"] > 0


def test_leaf_first_off_is_the_plain_lru():
    tier = _tier(6)
    tier.leaf_first = False
    keys, parents = _chain("a", 6)
    _store(tier, keys, parents)
    _store(tier, [b"x", b"y"], None)
    assert _reachable(tier, keys) == 0  # the first page went first, as before the key tree
    tier.check_invariants()  # the tree's counts are kept all the same


def test_leaf_first_switched_on_later_files_the_leaves_again():
    """Without leaf_first no leaf is filed (write-back does no work its eviction never
    reads); switched on, every leaf is filed at its last use and eviction is the
    tree's as if it had been on all along."""
    keys, parents = _chain("a", 6)
    on, later = _tier(6), _tier(6)
    later.leaf_first = False
    for tier in (on, later):
        _store(tier, keys, parents)
        tier.lookup_full(keys[:2], touch=True)
    later.check_invariants()
    later.leaf_first = True
    later.check_invariants()
    for tier in (on, later):
        _store(tier, [b"x", b"y"], None)
    assert [k in later for k in keys] == [k in on for k in keys]
    assert _reachable(later, keys) == _reachable(on, keys) == 4
    with pytest.raises(TypeError, match="leaf_first"):
        later.leaf_first = 1


@pytest.mark.parametrize(("policy", "leaf_first"), [("write_through", True), ("write_back", False)])
def test_the_cache_evicts_l2_leaves_first_under_write_through(tmp_path, policy, leaf_first):
    """Under write-back pages enter L2 as the L1 tree frees them (leaves first), so L2's
    LRU already follows the tree; under write-through they enter in sequence order."""
    from hybridkv import CacheConfig
    from hybridkv.tiers.tiered import TierConfig, TieredCache

    page = SPEC.bytes_per_page("full") + SPEC.bytes_per_page("swa")
    cache = TieredCache(SPEC, CacheConfig(budget_bytes=64 * page, device="meta"),
                        tiers=TierConfig(l2_bytes=32 * page, write_policy=policy))
    assert cache.host.leaf_first is leaf_first
    cache.close()


@pytest.mark.parametrize("by_tree", [True, False])
def test_the_owners_tree_order_goes_first_leaves_only(by_tree: bool) -> None:
    """With ``victims_by`` L2 gives up the keys its owner's tree yields, in that order,
    passing over those it does not hold, a page another held page extends, and a
    protected page, then turns to its own order once the tree's runs out.  Without it
    (the planted contrast) L2's own least recently used leaf goes first."""
    tier = _tier(8)
    a, pa = _chain("a", 3)
    b, pb = _chain("b", 3)
    _store(tier, a, pa)
    _store(tier, b, pb)
    _store(tier, [b"x", b"y"], None)
    tier.lookup_full(a, touch=True)  # L2's own order: b's tail, then b, x, y before a
    asked: list[list[bytes]] = []

    def order(holds):
        asked.append([])
        for k in [b"gone", a[1], a[2], a[1], b[0], b"x"]:  # a[1] extended by a[2] until a[2] goes
            asked[-1].append(k)
            if holds(k):
                yield k

    if by_tree:
        tier.victims_by = order
    got = tier.alloc(4, 0, protect=[tier.lookup_full([b"x"])[0]])
    assert got is not None
    held = {k for k in a + b + [b"x", b"y"] if k in tier}
    if by_tree:  # a's tail, then a[1] (a leaf once a[2] went); b[0] is extended, x protected;
        # then L2's own order: b's tail, b[1]
        assert held == {a[0], b[0], b"x", b"y"} and asked[0][0] == b"gone"
        assert tier.counters["evicted_off_tree_pages"] == 2
    else:
        assert held == {*a, b"x"} and not asked and "evicted_off_tree_pages" not in tier.counters
    assert tier.counters["evicted_full_pages"] == 4
    tier.free(got[0], got[1])
    tier.check_invariants()
