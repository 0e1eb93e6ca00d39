"""L1 tree nodes carry their pages' tier names (``TreeNode.page_keys`` /
``tier_anchor``): the insert gives them, splits and trims cut them with the
pages, and the tree hands them to its free listeners with the pages it frees
(no registry of L1 page ids beside the tree)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hybridkv import CacheConfig, ModelSpec
from hybridkv.pools import arena_page_bytes
from hybridkv.radix import NO_PAGE, OneWindowPool, PageNames, TreeConfig, WindowSafeTree
from hybridkv.spec import AttnKind, KVShape
from hybridkv.tiers.keys import page_keys
from hybridkv.tiers.tiered import TierConfig, TieredCache

from .helpers import serve_once

SPEC = ModelSpec("tiny-names", ("full", "swa", "swa"), 8, KVShape(1, 4, 4), KVShape(2, 4, 4),
                 dtype="float32", page_size=4)
FPB, SPB = arena_page_bytes(SPEC, "full"), arena_page_bytes(SPEC, "swa")
P = SPEC.page_size


class _Pool(OneWindowPool):
    """Page ids handed out by the test; frees are recorded."""

    def __init__(self) -> None:
        self.freed: dict[str, list[int]] = {"full": [], "swa": []}

    def free_full(self, pages: np.ndarray) -> None:
        self.freed["full"] += pages.tolist()

    def free_swa(self, pages: np.ndarray) -> None:
        self.freed["swa"] += pages.tolist()

    free_full_trusted = free_full
    free_swa_trusted = free_swa

    def check_taken(self, kind: str, pages: np.ndarray, name: str) -> None:
        pass


def _tree() -> tuple[WindowSafeTree, list]:
    tree = WindowSafeTree(TreeConfig(page_size=P, window=8), _Pool())
    heard: list = []
    tree.free_listeners.append(lambda kind, pages, names: heard.append((kind, pages.tolist(), names)))
    return tree, heard


def _names(n: int, tag: bytes = b"k", anchored: list[int] = ()) -> PageNames:
    a = np.zeros(n, dtype=bool)
    a[list(anchored)] = True
    return PageNames([tag + bytes([i]) for i in range(n)], a)


def _path_keys(tree: WindowSafeTree, tokens: np.ndarray, ns: str = "default") -> list:
    _, path = tree.walk(tokens, ns, len(tokens))
    return [k for nd, take in path for k in nd.page_keys[:take]]


def test_nodes_keep_the_insert_names_and_a_split_cuts_them_with_the_pages():
    tree, _ = _tree()
    a = np.arange(24, dtype=np.int32)
    tree.insert(a, np.arange(6), np.arange(6), names=_names(6, anchored=[5]))
    b = a.copy()
    b[12:] += 100  # diverges after page 3: the node is split there
    tree.insert(b, np.arange(10, 16), np.arange(10, 16), names=_names(6, b"j"))
    tree.check_invariants()
    assert _path_keys(tree, a) == [b"k" + bytes([i]) for i in range(6)]
    # the first three pages are the tree's own (k), the rest the second insert's (j)
    assert _path_keys(tree, b) == [b"k\x00", b"k\x01", b"k\x02", b"j\x03", b"j\x04", b"j\x05"]
    _, path = tree.walk(a, "default", 24)
    assert [nd.n_pages for nd, _ in path] == [3, 3]
    assert np.concatenate([nd.tier_anchor for nd, _ in path]).tolist() == [0, 0, 0, 0, 0, 1]


def test_duplicates_an_insert_frees_carry_their_names_and_parents():
    tree, heard = _tree()
    a = np.arange(16, dtype=np.int32)
    tree.insert(a, np.arange(4), np.array([0, 1, 2, 3]), names=_names(4))
    tree.insert(a, np.array([0, 1, 7, 8]), np.array([0, 1, 2, 9]), names=_names(4, b"d", anchored=[3]))
    (k1, full, fn), (k2, swa, sn) = heard
    assert (k1, full, fn.keys, fn.parents) == (AttnKind.FULL, [7, 8], [b"d\x02", b"d\x03"], [b"d\x01", b"d\x02"])
    assert (k2, swa, sn.keys, sn.anchored.tolist()) == (AttnKind.SWA, [9], [b"d\x03"], [True])


def test_eviction_hands_the_freed_pages_names_with_the_parent_node_key():
    tree, heard = _tree()
    a = np.arange(24, dtype=np.int32)
    tree.insert(a[:12], np.arange(3), np.arange(3), names=_names(3))
    tree.insert(a, np.array([0, 1, 2, 3, 4, 5]), np.array([0, 1, 2, 3, 4, 5]),
                names=_names(6, anchored=[5]))
    heard.clear()
    tree.evict(full_pages=6)
    full = [(pages, names.keys, names.parents) for kind, pages, names in heard if kind is AttnKind.FULL]
    got = {p: (k, up) for pages, keys, ups in full for p, k, up in zip(pages, keys, ups)}
    assert got == {i: (b"k" + bytes([i]), b"k" + bytes([i - 1]) if i else None) for i in range(6)}
    swa = {p: (k, bool(an)) for kind, pages, names in heard if kind is AttnKind.SWA
           for p, k, an in zip(pages, names.keys, names.anchored)}
    assert swa == {i: (b"k" + bytes([i]), i == 5) for i in range(6)}
    tree.check_invariants()


def test_a_trimmed_leaf_keeps_the_names_of_what_stays():
    tree, heard = _tree()
    a = np.arange(40, dtype=np.int32)
    tree.insert(a, np.arange(10), np.arange(10), names=_names(10))
    tree.evict(full_pages=3)  # trimmed back to a held window: the leaf keeps its head
    freed = [k for kind, _, names in heard if kind is AttnKind.FULL for k in names.keys]
    _, path = tree.walk(a, "default", 40)
    kept = [k for nd, take in path for k in nd.page_keys[:take]]
    assert kept + freed == [b"k" + bytes([i]) for i in range(10)] and freed
    tree.check_invariants()


def test_names_must_match_the_pages_and_a_bad_insert_changes_nothing():
    tree, heard = _tree()
    with pytest.raises(ValueError, match="names"):
        tree.insert(np.arange(8, dtype=np.int32), np.arange(2), np.arange(2), names=_names(3))
    with pytest.raises(ValueError, match="names"):
        tree.insert(np.arange(8, dtype=np.int32), np.arange(2), np.arange(2), names=[b"a", b"b"])
    with pytest.raises(ValueError, match="anchored"):
        PageNames([b"a"], np.zeros(2, dtype=bool))
    with pytest.raises(TypeError, match="keys"):
        PageNames((b"a",), np.zeros(1, dtype=bool))
    assert tree.num_nodes == 0 and not heard
    tree.check_invariants()


def test_an_unnamed_tree_hands_no_names():
    tree, heard = _tree()
    a = np.arange(8, dtype=np.int32)
    tree.insert(a, np.arange(2), np.array([0, NO_PAGE]))
    tree.evict(full_pages=2)
    assert heard and all(names is None for _, _, names in heard)


def _cache(policy: str, l1_pages: int = 12) -> TieredCache:
    return TieredCache(SPEC, CacheConfig(budget_bytes=l1_pages * (FPB + SPB), device="meta"),
                       tiers=TierConfig(l2_bytes=200 * (FPB + SPB), write_policy=policy))


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_every_l1_node_carries_the_chained_keys_of_its_pages(policy):
    cache = _cache(policy, l1_pages=40)
    co = cache.lower_tiers
    try:
        rng = np.random.default_rng(0)
        base = rng.integers(0, 1000, 48).astype(np.int32)
        prompts = [base, np.concatenate([base[:20], rng.integers(0, 1000, 30).astype(np.int32)]), base[:33]]
        for t in prompts:
            serve_once(cache, t)
        for t in prompts:
            _, path = cache.tree.walk(t, "default", len(t))
            n = sum(k for _, k in path)
            want = page_keys(t[:n * P], P, namespace="default", fingerprint=co.fingerprint)
            assert _path_keys(cache.tree, t[:n * P]) == want
        cache.check_invariants()
    finally:
        cache.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_pages_l1_evicts_reach_l2_under_their_node_names_and_hit_again(policy):
    cache = _cache(policy)
    co = cache.lower_tiers
    try:
        first = np.arange(40, dtype=np.int32)
        serve_once(cache, first)
        keys = page_keys(first, P, namespace="default", fingerprint=co.fingerprint)
        for i in range(4):  # push the first prompt out of a 12-page L1
            serve_once(cache, np.arange(1000 * (i + 1), 1000 * (i + 1) + 40, dtype=np.int32))
        assert (co.host.lookup_full(keys) >= 0).all()
        assert not Counter(co.host.l1_counts()) & Counter(keys)  # L1 holds none of them now
        req = cache.begin(np.concatenate([first, [7, 7, 7]]).astype(np.int32))
        assert req.prefix_len == 40 and req.extra["tiers"]["l2_hit_tokens"] > 0
        cache.abort(req)
        cache.check_invariants()
    finally:
        cache.close()


def test_the_invariant_check_catches_a_node_named_apart_from_l2s_count():
    cache = _cache("write_back", l1_pages=40)
    try:
        serve_once(cache, np.arange(40, dtype=np.int32))
        cache.check_invariants()
        node = next(cache.tree.iter_nodes())
        node.page_keys = [b"planted"] + node.page_keys[1:]
        with pytest.raises(AssertionError, match="count"):
            cache.check_invariants()
        node.page_keys = None
        with pytest.raises(AssertionError, match="unnamed"):
            cache.check_invariants()
    finally:
        cache.close()


def test_the_invariant_check_catches_names_swapped_between_nodes():
    """Two nodes' names swapped: L2's counts still agree, the path's keys do not
    (what :meth:`TierCoordinator.prompt_keys` reads off the nodes would be wrong)."""
    cache = _cache("write_back", l1_pages=40)
    try:
        base = np.arange(48, dtype=np.int32)
        serve_once(cache, base)
        serve_once(cache, np.concatenate([base[:24], np.arange(500, 524, dtype=np.int32)]))
        cache.check_invariants()
        a, b = [nd for nd in cache.tree.iter_nodes() if not nd.children][:2]
        a.page_keys, b.page_keys = [b.page_keys[0]] + a.page_keys[1:], [a.page_keys[0]] + b.page_keys[1:]
        with pytest.raises(AssertionError, match="another path"):
            cache.check_invariants()
    finally:
        cache.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_prompt_keys_read_the_l1_match_off_the_nodes_and_hash_only_the_rest(policy, monkeypatch):
    from hybridkv.tiers import coordinator

    cache = _cache(policy, l1_pages=40)
    co = cache.lower_tiers
    hashed: list[int] = []
    real = coordinator.page_keys

    def counting(tokens, page_size, **kw):
        hashed.append(len(tokens) // page_size)
        return real(tokens, page_size, **kw)

    try:
        rng = np.random.default_rng(1)
        base = rng.integers(0, 1000, 48).astype(np.int32)
        serve_once(cache, base)
        longer = np.concatenate([base[:40], rng.integers(0, 1000, 24).astype(np.int32)])
        want = page_keys(longer, P, namespace="default", fingerprint=co.fingerprint)
        monkeypatch.setattr(coordinator, "page_keys", counting)
        assert co.prompt_keys(longer, "default", len(want)) == want
        assert hashed == [len(want) - 40 // P]  # the 10 pages L1 holds were read, not hashed
        hashed.clear()
        assert co.prompt_keys(base, "default", 12) == want[:10] + page_keys(
            base[40:48], P, namespace="default", fingerprint=co.fingerprint, parent=want[9])
        assert hashed == []  # all 12 from the tree
        # a node whose naming failed: hashed from its first unnamed page on, the same keys
        hashed.clear()
        _, path = cache.tree.walk(longer, "default", len(longer))
        node = path[0][0]
        node.page_keys = node.page_keys[:3] + [None] + node.page_keys[4:]
        assert co.prompt_keys(longer, "default", len(want)) == want
        assert hashed == [len(want) - 3]
        hashed.clear()
        assert co.prompt_keys(longer, "default", 0) == [] and hashed == []
    finally:
        cache.close()
