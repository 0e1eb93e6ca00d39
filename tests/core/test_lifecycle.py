"""The one request lifecycle (hybridkv.lifecycle) and the PagePool protocol.

Besides the unit tests, :func:`direct_tree_calls` checks that the three hosts
(hybridkv's cache and its page growth, vLLM's prefix manager, SGLang's radix
cache) make a request's calls on the tree only through the lifecycle, with a
planted fault showing the check finds a host that goes around it.  Run as a
script it prints the lifecycle's call sites per host.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridkv import CacheConfig, HybridKVCache
from hybridkv.lifecycle import Hit, Lifecycle, TierHooks, TierPlan
from hybridkv.pools import DualPool
from hybridkv.radix import LockHandle, OneWindowPool, TreeConfig, WindowSafeTree, pool_lacks

from helpers import RecordingPool, run, spec

ROOT = Path(__file__).resolve().parents[2]
HOSTS = {
    "hybridkv": [ROOT / "hybridkv" / "cache.py", ROOT / "hybridkv" / "allocation.py"],
    "vllm": [ROOT / "adapters" / "vllm" / "hybridkv_vllm" / "prefix.py"],
    "sglang": [ROOT / "adapters" / "sglang" / "hybridkv_sglang" / "radix_cache.py"],
}
#: a request's calls on the tree, which belong to the lifecycle
REQUEST_CALLS = {"lock", "unlock", "lock_path", "insert", "insert_tokens", "match_parts", "match_tokens",
                 "releasable_runs", "release_cut"}


def _calls(path: Path) -> list[ast.Call]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)]


def direct_tree_calls(hosts: dict[str, list[Path]] = HOSTS) -> list[str]:
    """Calls of a request's tree calls (``REQUEST_CALLS``) on a ``...tree`` or
    ``...policy`` receiver in a host's files, i.e. around the lifecycle."""
    out = []
    for host, paths in hosts.items():
        for path in paths:
            for call in _calls(path):
                receiver = ast.unparse(call.func.value)
                if call.func.attr in REQUEST_CALLS and receiver.split(".")[-1] in ("tree", "policy"):
                    out.append(f"{host}: {path.name}:{call.lineno} {ast.unparse(call.func)}")
    return out


def lifecycle_sites(hosts: dict[str, list[Path]] = HOSTS) -> dict[str, list[str]]:
    """Per host, the lifecycle calls it makes (``...lifecycle.NAME``)."""
    out: dict[str, list[str]] = {}
    for host, paths in hosts.items():
        out[host] = sorted({call.func.attr for path in paths for call in _calls(path)
                            if ast.unparse(call.func.value).endswith("lifecycle")})
    return out


def test_every_host_goes_through_the_lifecycle():
    assert direct_tree_calls() == [], "a host calls the tree's request calls around hybridkv.lifecycle"
    sites = lifecycle_sites()
    for host in HOSTS:
        assert {"lock", "insert", "end"} & set(sites[host]), (host, sites[host])
        assert {"begin", "match"} & set(sites[host]), (host, sites[host])


def test_the_call_site_check_catches_a_host_going_around(tmp_path):
    host = tmp_path / "host.py"
    host.write_text("class H:\n    def begin(self, t):\n        m = self.tree.match_parts(t, 'ns')\n"
                    "        return self.lifecycle.lock(m)\n    def end(self, h):\n        self.tree.unlock(h)\n")
    found = direct_tree_calls({"planted": [host]})
    assert [f.split(" ")[-1] for f in found] == ["self.tree.match_parts", "self.tree.unlock"], found
    assert lifecycle_sites({"planted": [host]}) == {"planted": ["lock"]}


# ------------------------------------------------------------------ the pool protocol
def test_page_pools_implement_the_whole_protocol():
    s = spec()
    assert pool_lacks(DualPool(s, full_pages=8, swa_pages=8)) == []
    assert pool_lacks(RecordingPool()) == []


def test_a_pool_lacking_protocol_calls_is_refused_by_name():
    class Partial:
        def free_full(self, pages):
            pass

        def free_swa(self, pages):
            pass

    with pytest.raises(TypeError, match=r"lacks \['groups', 'free_full_trusted'"):
        WindowSafeTree(TreeConfig(1, 2), Partial())


def test_one_window_pool_answers_the_group_calls():
    class Pages(OneWindowPool):
        def __init__(self):
            self.freed = []

        def free_full_trusted(self, pages):
            self.freed += pages.tolist()

        def free_swa_trusted(self, pages):
            self.freed += pages.tolist()

    p = Pages()
    assert pool_lacks(p) == []
    t = WindowSafeTree(TreeConfig(1, 2), p)
    t.insert(np.arange(4), np.arange(4), np.arange(4))
    t.evict(full_pages=4, swa_pages=4)
    assert sorted(p.freed) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_dual_pool_check_taken_names_the_argument():
    pool = DualPool(spec(), full_pages=8, swa_pages=8)
    full, _ = pool.take(2, 2)
    pool.check_taken("full", full, "full_pages")
    with pytest.raises(ValueError, match="full_pages holds ids that are not allocated"):
        pool.check_taken("full", np.array([7], np.int32), "full_pages")
    with pytest.raises(ValueError, match="swa_pages holds repeated ids"):
        pool.check_taken("full", np.array([full[0], full[0]], np.int32), "swa_pages")


# ------------------------------------------------------------------ the lifecycle
def _tok(n):
    return np.arange(n, dtype=np.int32)  # the tree's token dtype (hosts convert first)


def _tree(page=2, window=4, checkpoint=0):
    return WindowSafeTree(TreeConfig(page, window, checkpoint), RecordingPool())


def test_begin_locks_the_window_safe_hit_and_end_gives_it_back():
    t = _tree()
    life = Lifecycle(t)
    t.insert(np.arange(12), np.arange(6), np.arange(6))
    hit = life.begin(_tok(12), "default", 11)
    assert isinstance(hit, Hit)
    assert (hit.pages, hit.raw_pages) == (5, 5)
    full, swa = hit.page_ids()
    assert full.tolist() == [0, 1, 2, 3, 4]
    assert swa.tolist() == [0, 1, 2, 3, 4]
    assert hit.handle.node is not None and t.protected_full_pages == 5
    life.end(hit.handle)
    assert t.protected_full_pages == 0


def test_reach_locks_full_kv_past_a_window_safe_hit():
    """Repair case 2: the tree holds 6 pages of full KV but SWA only on the first 2, so
    the window-safe hit is 2 pages; reach locks the full KV of 5 pages (no window rule)
    and gives their page ids, and end gives the lock back."""
    t = _tree()
    life = Lifecycle(t)
    t.insert(np.arange(12), np.arange(6), np.array([0, 1, -1, -1, -1, -1]))
    hit = life.begin(_tok(12), "default", 12)
    assert (hit.pages, hit.raw_pages) == (2, 6)
    with pytest.raises(ValueError):
        life.lock(t.walk(_tok(12), "default", 10)[1][-1][0])  # lock's rule: the window before it is not held
    handle, path = life.reach(_tok(12), "default", 5)
    assert np.concatenate([nd.full[:k] for nd, k in path]).tolist() == [0, 1, 2, 3, 4]
    assert t.protected_full_pages >= 5
    life.end(handle)
    life.end(hit.handle)
    assert t.protected_full_pages == 0
    handle, path = life.reach(_tok(12) + 100, "default", 3)
    assert handle.node is None and path == [] and t.protected_full_pages == 0  # nothing matched: nothing locked


def test_begin_without_a_hit_locks_nothing():
    life = Lifecycle(_tree())
    hit = life.begin(_tok(12), "default", 11)
    assert (hit.pages, hit.handle.node, hit.page_ids()[0].size) == (0, None, 0)


def test_release_rule_is_the_policy_and_kept_is_its_complement():
    t = _tree(page=2, window=4, checkpoint=8)
    life = Lifecycle(t)
    lo, cut = 0, 20
    rel = life.release_runs(lo, cut, 0, 0, 40)
    kept = life.kept_runs(lo, cut, 0, 0, 40)
    pages = sorted(i for a, b in rel + kept for i in range(a, b))
    assert pages == list(range(lo, cut)), (rel, kept)
    assert kept, "checkpoint windows are kept"
    assert rel == t.policy.releasable_runs(lo, cut, 0, 0, 40 // 2 if t.policy.pretail_pages >= 0 else 0)


def test_insert_starts_at_the_lock_and_refuses_a_lock_that_moved():
    t = _tree()
    life = Lifecycle(t)
    t.insert(np.arange(8), np.arange(4), np.arange(4))
    hit = life.begin(_tok(12), "default", 11)
    assert hit.pages == 4 and life.lock_ends_at(hit.handle, 4) and not life.lock_ends_at(hit.handle, 3)
    full = np.array([0, 0, 0, 0, 10, 11], np.int32)  # [0, 4): the locked path, skipped
    swa = np.array([-1, -1, -1, -1, 10, 11], np.int32)
    assert life.insert(hit.handle, 3, _tok(12), full, swa, "default") is None  # nothing changed
    assert t.full_pages_cached == 4
    res = life.insert(hit.handle, 4, _tok(12), full, swa, "default")
    assert res.new_pages == 2 and t.full_pages_cached == 6
    moved = life.move_lock(hit.handle, res.node)
    assert moved.node is res.node and t.protected_full_pages == 6
    life.end(moved)
    assert t.protected_full_pages == 0


def test_move_lock_keeps_the_old_lock_when_the_new_window_is_gone():
    t = _tree()
    life = Lifecycle(t)
    t.insert(np.arange(8), np.arange(4), np.arange(4))
    hit = life.begin(_tok(8), "default", 8)
    res = life.insert(hit.handle, hit.pages, _tok(12), np.array([0, 0, 0, 0, 8, 9], np.int32),
                      np.array([-1, -1, -1, -1, -1, -1], np.int32), "default")
    with pytest.raises(ValueError, match="not window safe"):
        life.move_lock(hit.handle, res.node)
    assert t.protected_full_pages == 4  # the old lock still holds
    life.end(hit.handle)


def test_the_cache_and_its_tiers_use_the_lifecycle_protocols():
    from hybridkv.tiers.tiered import TierConfig, TieredCache

    s = spec()
    cache = TieredCache(s, CacheConfig(budget_bytes=s.bytes_per_page("full") * 200),
                        tiers=TierConfig(l2_bytes=s.bytes_per_page("full") * 64))
    assert isinstance(cache.lifecycle, Lifecycle) and cache.lifecycle.tree is cache.tree
    hooks: TierHooks = cache.lower_tiers
    for name in ("before_match", "after_begin", "before_finish", "stats", "check_invariants"):
        assert callable(getattr(hooks, name))
    plan = hooks.before_match(np.arange(40, dtype=np.int32), "default")
    assert isinstance(plan, TierPlan) and len(plan.keys) == 19 and plan.origin.size <= 19
    for _ in range(3):
        run(cache, list(range(40)))
    cache.close()


def test_hit_page_arrays_are_copies():
    t = _tree()
    t.insert(np.arange(8), np.arange(4), np.arange(4))
    hit = Lifecycle(t).begin(_tok(8), "default", 8)
    hit.page_ids()[0][:] = 99
    assert hit.page_ids()[0].tolist() == [0, 1, 2, 3]
    assert isinstance(LockHandle(None), LockHandle)


if __name__ == "__main__":
    for host, names in lifecycle_sites().items():
        print(f"{host:9} lifecycle calls: {', '.join(names)}")
    print("direct tree calls:", direct_tree_calls() or "none")
    sys.exit(0)
