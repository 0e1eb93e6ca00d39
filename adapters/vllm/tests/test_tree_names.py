"""The connector reads a prompt's page keys off hybridkv's device tree (:mod:`hybridkv_vllm.names`).

Through vLLM's real scheduler with hybridkv's prefix cache and connector, and a
worker-role connector in the same process (the stack of ``test_l2_demote``): the
prefix manager's tree keeps the connector's keys of the pages it caches and,
past eviction, as evicted runs; a lookup takes the keys of the prompt's leading
pages from there.  Every key read off the tree equals what hashing gives, and
the hits, their split by tier and the pages moved are the same with the names
switched off.
"""

from __future__ import annotations

import random
import shutil
from typing import Any

import pytest
from test_l2_demote import _conversations, _prompt_keys, _request, _run, stack  # noqa: F401

import hybridkv_vllm.connector as connector_mod
from hybridkv_vllm.names import FINISHING_MAX, TreeNames


@pytest.fixture()
def checked(monkeypatch) -> list[int]:  # noqa: ANN001
    """Every seed checked against hashing; the pages each seed named."""
    real = TreeNames.seed
    named: list[int] = []

    def seed(self: TreeNames, st: Any, limit: int) -> int:
        n = real(self, st, limit)
        if n:
            want = _prompt_keys(self.manager.connector_under_test, list(st.request.all_token_ids), st.namespace,
                                n * self.page_size)
            assert {gi: ks for gi, ks in st.keys.items()} == want, "a key read off the tree differs from hashing"
        named.append(n)
        return n

    monkeypatch.setattr(TreeNames, "seed", seed)
    return named


def _build(stack: Any, names: bool, monkeypatch: Any, **kw: Any) -> tuple[Any, Any]:  # noqa: ANN001
    if not names:
        monkeypatch.setattr(connector_mod, "bind_names", lambda *a, **k: None)
    sched, worker = stack(**kw)
    sched.kv_cache_manager.connector_under_test = sched.connector  # for the seed check
    assert (sched.connector._names is not None) == names
    return sched, worker


def test_the_tree_keeps_the_connectors_keys_and_a_lookup_reads_them(stack, monkeypatch, checked) -> None:  # noqa: ANN001
    """After request a, each tree page's name is the connector's keys of that page (every
    group, in order); request b extends a's prompt and its lookup reads a's pages' keys
    off the tree (checked against hashing): only b's new pages are hashed."""
    sched, worker = _build(stack, True, monkeypatch, device_pages=400, host_pages=4000)
    conn, mgr = sched.connector, sched.kv_cache_manager
    rnd = random.Random(7)
    prompt = [rnd.randrange(4, 30000) for _ in range(700)]
    req_a = _request(sched, "a", list(prompt))
    ns = conn._state(req_a).namespace
    _run(req_a, sched, worker)
    P = mgr.page_size
    nodes = [nd for nd in mgr.tree.iter_nodes() if nd.n_pages]
    assert nodes and all(nd.page_keys is not None and None not in nd.page_keys for nd in nodes)
    total = sum(nd.n_pages for nd in nodes)
    keys = _prompt_keys(conn, list(req_a.all_token_ids), ns, total * P)
    names = conn._names.names(keys, 0, total).keys
    got = [k for nd in sorted(nodes, key=lambda nd: nd.start) for k in nd.page_keys]
    assert got == names  # one chain here: the nodes in order spell it
    assert all(len(nm) == conn._names.width for nm in names)
    req_b = _request(sched, "b", prompt + [rnd.randrange(4, 30000) for _ in range(200)])
    _run(req_b, sched, worker)
    assert checked and checked[-1] == (len(prompt) - 1) // P  # every page of a's prompt the lookup could read
    assert conn.stats["tree_named_pages"] == sum(checked)
    mgr.check_invariants()


def _evicted_prompt(stack: Any, monkeypatch: Any, names: bool) -> tuple[Any, Any, list[int]]:
    """A 700-token prompt served (request "a") through a stack with room in L2, then
    every page of it evicted from the device's tree."""
    sched, worker = _build(stack, names, monkeypatch, device_pages=400, host_pages=4000)
    rnd = random.Random(11)
    prompt = [rnd.randrange(4, 30000) for _ in range(700)]
    _run(_request(sched, "a", list(prompt)), sched, worker)
    tree = sched.kv_cache_manager.tree
    tree.evict(full_pages=tree.full_pages_cached, swa_pages=tree.swa_pages_cached)
    assert tree.full_pages_cached == 0
    return sched, worker, prompt


@pytest.mark.parametrize("names", [True, False])
def test_runs_name_what_the_device_evicted(stack, monkeypatch, checked, names: bool) -> None:  # noqa: ANN001
    """The device's tree gives up a's prompt; its pages stay named as evicted runs, and
    the repeat's lookup reads their keys there (checked against hashing).  L2 serves the
    repeat the same hit, split the same way, with the names off (nothing named)."""
    sched, worker, prompt = _evicted_prompt(stack, monkeypatch, names)
    conn, mgr = sched.connector, sched.kv_cache_manager
    tree = mgr.tree
    assert (tree.runs.pages > 0) == names
    req_b = _request(sched, "b", list(prompt))
    st_b = conn._state(req_b)
    before = dict(worker.stats)
    _run(req_b, sched, worker)
    hit = (len(prompt) - 1) // conn.unit * conn.unit
    assert st_b.local_tokens == 0 and st_b.hit_tokens == hit
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    assert st_b.hit_sources == {CacheHitSource.HOST: hit}
    assert worker.stats["load_pages_l2"] - before.get("load_pages_l2", 0) > 0
    assert conn.stats["tree_named_pages"] == (hit // mgr.page_size if names else 0)
    assert conn.stats.get("reloaded_held_tokens", 0) == 0  # the device held none of it
    mgr.check_invariants()


def _replay(stack: Any, monkeypatch: Any, names: bool, seed: int) -> tuple[list[Any], dict[str, int], Any]:
    # the window repair needs the names: off both ways, so the two replays compare (test_repair.py)
    sched, worker = _build(stack, names, monkeypatch, device_pages=70, host_pages=48, repair_windows=False)
    last = _conversations(sched, worker, n_conv=3, seed=seed)
    sched.kv_cache_manager.check_invariants()
    per = sorted((rid, st.hit_tokens, st.local_tokens, sorted((str(k), v) for k, v in st.hit_sources.items()),
                  st.saved_tokens) for rid, (_, st) in last.items())
    moved = {k: worker.stats.get(k, 0) for k in ("load_pages", "load_pages_l2", "load_pages_l3", "save_pages",
                                                   "save_pages_l2", "load_failures")}
    hits = {k: sched.connector.stats.get(k, 0) for k in ("hit_requests", "hit_tokens", "lookups")}
    return per, {**moved, **hits}, sched


@pytest.mark.parametrize("seed", [5, 6])
def test_conversations_hit_the_same_with_the_names(stack, monkeypatch, checked, tmp_path,  # noqa: ANN001
                                                   seed: int) -> None:
    """A small device (turns come back from L2 / L3) and a small L2: with the names every
    key read off the tree equals hashing, some pages come off the runs, and each request's
    hit, its split and every page count are what they are with the names off."""
    on = _replay(stack, monkeypatch, True, seed)
    named = sum(checked)
    runs_named = on[2].kv_cache_manager.tree.runs
    # the runs are L2 and L3 entries: capped at what L2 and L3's record hold, per tree page
    conn = on[2].connector
    per = sum(k for g, k in zip(conn._names.groups, conn._names.per_page) if not g.is_swa)
    l2_full, l3_keys = conn._tiers.l2.tier.num_full_pages, len(conn._tiers.store)
    assert l3_keys > 0 and runs_named.cap == (l2_full + l3_keys) // per > l2_full // per
    on[2].shutdown()
    shutil.rmtree(tmp_path / "l3")  # the second replay starts from an empty store too
    monkeypatch.undo()
    off = _replay(stack, monkeypatch, False, seed)
    assert on[0] == off[0] and on[1] == off[1]
    assert named > 0 and on[2].connector.stats["tree_named_pages"] == named
    assert runs_named.pages + runs_named.dropped > 0  # the device evicted named pages
    assert on[1]["load_pages_l2"] > 0 and on[1]["load_failures"] == 0


def test_finished_states_wait_for_the_insert_within_a_bound(stack, monkeypatch) -> None:  # noqa: ANN001
    """A finished request's state is kept for the insert that names its pages, handed out
    once, and at most FINISHING_MAX are kept."""
    sched, _ = _build(stack, True, monkeypatch, device_pages=400, host_pages=4000)
    names = sched.connector._names

    class _St:
        def __init__(self, rid: str) -> None:
            self.request = type("R", (), {"request_id": rid})()

    for i in range(FINISHING_MAX + 3):
        names.keep(_St(f"r{i}"))  # type: ignore[arg-type]
    assert names.state("r0", {}) is None and names.state("r2", {}) is None  # the oldest went
    st = names.state("r3", {})
    assert st is not None and st.request.request_id == "r3"
    assert names.state("r3", {}) is None  # handed out once
    live = {"x": _St("x")}
    assert names.state("x", live) is live["x"]  # type: ignore[comparison-overlap]
