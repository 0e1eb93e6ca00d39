"""``WindowSafeTree.insert_tokens(start=node)``: the internal insert from a held node."""

import numpy as np

from hybridkv.radix import TreeConfig, WindowSafeTree

from helpers import RecordingPool


def _shape(tree):
    out = []
    for node in sorted(tree.iter_nodes(), key=lambda n: (n.start, n.key[:2].tolist())):
        out.append((node.start, node.key.tolist(), node.full.tolist(), node.swa.tolist()))
    return out


def test_insert_from_start_equals_insert_from_root():
    base = np.arange(12, dtype=np.int32)
    ext = np.concatenate([base, np.arange(100, 108, dtype=np.int32)])
    branch = np.concatenate([base[:8], np.arange(200, 206, dtype=np.int32)])
    trees = []
    for use_start in (False, True):
        pool = RecordingPool()
        t = WindowSafeTree(TreeConfig(2, 4), pool)
        t.insert(base, np.arange(6), np.arange(50, 56))
        t.insert(branch, np.r_[0:4, 20:23], np.r_[50:54, 70:73])
        m = t.match(ext, split=True)
        assert m.length == 12 and m.node is not None
        h = t.lock(m.node)
        full = np.r_[m.full_pages, 30:34].astype(np.int32)
        swa = np.r_[m.swa_pages, 80:84].astype(np.int32)
        if use_start:
            res = t.insert_tokens(ext, full, swa, "default", start=m.node)
        else:
            res = t.insert(ext, full, swa)
        assert res.new_pages == 4 and res.node is not None and res.node.start == 12
        t.unlock(h)
        t.check_invariants()
        assert pool.full == [] and pool.swa == []  # nothing of the caller's is freed
        trees.append(_shape(t))
    assert trees[0] == trees[1]


def test_insert_from_start_after_split_of_start_and_below():
    pool = RecordingPool()
    t = WindowSafeTree(TreeConfig(2, 4), pool)
    a = np.arange(8, dtype=np.int32)
    t.insert(a, np.arange(4), np.arange(10, 14))
    m = t.match(a[:6], split=True)           # node now ends at token 6
    h = t.lock(m.node)
    t.match(a[:2], split=True)                # another split above the held node
    assert m.node.alive and m.node.start + len(m.node.key) == 6
    # the request computed the same tokens as the tree's tail plus two new pages
    key = np.concatenate([a, [40, 41, 42, 43]]).astype(np.int32)
    full = np.r_[m.full_pages, 90, 91, 92].astype(np.int32)
    swa = np.r_[m.swa_pages, 95, 96, 97].astype(np.int32)
    res = t.insert_tokens(key, full, swa, "default", start=m.node)
    assert res.new_pages == 2
    assert pool.full == [90] and pool.swa == [95]  # duplicate of the cached page 3 only
    t.unlock(h)
    t.check_invariants()
    assert t.match(key).length == 12


def test_insert_from_root_start_is_root_walk():
    pool = RecordingPool()
    t = WindowSafeTree(TreeConfig(2, 4), pool)
    key = np.arange(6, dtype=np.int32)
    res = t.insert_tokens(key, np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32), "ns",
                    start=t.root("ns"))
    assert res.new_pages == 3
    res = t.insert_tokens(key, np.arange(5, 8, dtype=np.int32), np.full(3, -1, np.int32), "ns", start=None)
    assert res.new_pages == 0 and pool.full == [5, 6, 7]
    t.check_invariants()


def _chunked(ranking, continued):
    """One prompt cached in three chunks, each insert starting at the previous one's leaf."""
    t = WindowSafeTree(TreeConfig(2, 4, ranking=ranking), RecordingPool())
    key = np.arange(12, dtype=np.int32)
    node = None
    for end in (4, 8, 12):
        pages = end // 2
        res = t.insert_tokens(key[:end], np.arange(pages, dtype=np.int32), np.arange(50, 50 + pages, dtype=np.int32),
                              "default", start=node, continued=continued)
        node = res.node
    t.check_invariants()
    return t, node


def test_continued_chunks_of_one_prompt_are_not_reuse():
    from hybridkv.radix.policy import AdaptiveRanking

    for ranking in ("arc", "lru", "adaptive", "value"):
        t, leaf = _chunked(ranking, continued=True)
        assert t.ranking.pages == {AdaptiveRanking.RECENT: 6, AdaptiveRanking.REUSED: 0}, ranking
        assert leaf.last_access == max(n.last_access for n in t.iter_nodes())
        # without it, a chunk's insert counts the path before it as used again
        t, _ = _chunked(ranking, continued=False)
        assert t.ranking.pages[AdaptiveRanking.REUSED] >= 4, ranking  # the first two chunks
