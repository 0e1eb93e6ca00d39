"""The connector's L2 demotes the anchored SWA windows a conversation moved past.

Through vLLM's real scheduler with hybridkv's prefix cache and connector (the
served stack's scheduler side) and a worker-role connector in the same process
(its save thread and host L2 store real page bytes; no model: blocks hold
zeros), several conversations are replayed turn by turn, each turn decoding a
few tokens.  L2's one index is the scheduler's; after every turn each key it
holds is in the worker's row the index gave it (tagged with the key); at the end only
the windows each conversation's last turn ends (its tail, its checkpoints) or
hit at are anchored -- with the demotion switched off, every earlier turn's
tail and prompt-end window stays anchored too.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import tiers_vllm as tv  # noqa: E402
import tiers_vllm_connector as tc  # noqa: E402
from hybridkv_vllm.plan import checkpoint_ends, passed_pages  # noqa: E402
from hybridkv_vllm.sources import TierView  # noqa: E402

from hybridkv.spec import AttnKind, KVShape, ModelSpec  # noqa: E402

PAGE = 64
WINDOW = 128
SPEC = ModelSpec("tiny-hybrid", (AttnKind.FULL, AttnKind.SWA), WINDOW, full=KVShape(1, 128, 128),
                 swa=KVShape(1, 128, 128), page_size=PAGE)
PAGE_BYTES = PAGE * 512  # one layer's page (bf16 K + V, 1 head of 128)
CHECKPOINT = 512  # tokens: a retention checkpoint every 8 pages
TURNS = 5
MAX_LEN = 2048


def _classes(tier: Any) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """A HostTier's full, plain SWA and anchored SWA keys, least recently used first."""
    return list(tier._full), list(tier._swa), list(tier._anchor)


def _tier(sched: Any) -> Any:
    """L2's index (the scheduler side's HostTier)."""
    return sched.connector._tiers.l2.tier


def _rows_agree(sched: Any, worker: Any) -> bool:
    """Whether every key L2's index holds is in the worker's row the index gave it."""
    tier, tags = _tier(sched), worker._l2._tags
    return all(tags[swa][page] == key for swa, table in ((False, tier._full), (True, tier._swa), (True, tier._anchor))
               for key, page in table.items())


def _worker(vc: Any, sched: Any) -> Any:
    """A worker-role connector over zero KV tensors of the scheduler's blocks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hybridkv_vllm.connector import HybridKVConnector

    cfg = sched.kv_cache_config
    w = HybridKVConnector(vc, KVConnectorRole.WORKER, cfg)
    kv = {name: torch.zeros((cfg.num_blocks, g.kv_cache_spec.page_size_bytes), dtype=torch.uint8)
          for g in cfg.kv_cache_groups for name in g.layer_names}
    w.register_kv_caches(kv)
    return w


def _step(sched: Any, worker: Any) -> int:
    """One engine step with the worker connector doing the step's loads and saves."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    so = sched.schedule()
    worker.handle_preemptions(so.kv_connector_metadata)  # first in vLLM's step
    worker.bind_connector_metadata(so.kv_connector_metadata)
    worker.start_load_kv(None)
    worker.wait_for_save()  # async_save false: stored before the step ends
    res = worker.get_transfer_results(set())  # as vLLM's model runner: failed loads reported too
    worker.clear_connector_metadata()
    req_ids = list(so.num_scheduled_tokens)
    sampled = [[tv.SAMPLED_TOKEN] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
               else [] for r in req_ids]
    stats = worker.get_kv_connector_stats()  # collected before the worker's report, as vLLM does
    kv_out = KVConnectorOutput(finished_recving=res.finished_recving or None, finished_sending=res.finished_sending or None,
                               failed_recving=res.failed_recving, kv_connector_stats=stats,
                               kv_connector_worker_meta=worker.build_connector_worker_meta())
    sched.update_from_output(so, ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                                   sampled_token_ids=sampled, kv_connector_output=kv_out))
    return so.total_num_scheduled_tokens


def _run(request: Any, sched: Any, worker: Any) -> None:
    sched.add_request(request)
    for _ in range(10_000):
        if not (sched.has_requests() or sched.connector.has_pending_push_work()):
            return
        _step(sched, worker)
    raise AssertionError(("the request did not finish", sched.has_requests(), len(sched.waiting), len(sched.running),
                          sched.connector._pending_saves, sched.connector._worker_saves.busy(), request.status,
                          request.num_computed_tokens, request.num_tokens))


def _kept(conn: Any, tokens: list[int], ns: str, tail: int, hit: int) -> set[bytes]:
    """SWA keys of the windows a turn ending at ``tail`` keeps: its tail, its checkpoints
    and its hit's window."""
    from hybridkv_vllm.jobs import ReqState

    class _Req:  # what the connector reads of a request to key it
        all_token_ids = tokens

    st = ReqState(_Req(), ns)  # type: ignore[arg-type]
    keys = conn._keys(st, tail)
    ends = [*checkpoint_ends(0, tail, conn.unit, CHECKPOINT), tail, hit]
    out: set[bytes] = set()
    for g in conn.groups:
        if g.is_swa:
            passed = set(passed_pages(g, tail // g.block_size, g.block_size, [e // g.block_size for e in ends]))
            out |= {k for i, k in enumerate(keys[g.index]) if i not in passed}
    return out


def _hasher(sched: Any) -> Any:
    """vLLM's block hasher for requests added to ``sched`` (its prefix-caching hash)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(sched.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(sched.hash_block_size, hash_fn)


def _conversations(sched: Any, worker: Any, n_conv: int, seed: int) -> dict[str, Any]:
    """Replay ``n_conv`` conversations of :data:`TURNS` turns, interleaved; after every
    turn the worker's rows hold what L2's index says.  Returns the last turn of each."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    hasher = _hasher(sched)
    rnd = random.Random(seed)
    history = {f"c{c}": [rnd.randrange(4, 30000) for _ in range(rnd.randrange(100, 300))] for c in range(n_conv)}
    last: dict[str, Any] = {}
    for turn in range(TURNS):
        for conv, toks in history.items():
            out = rnd.randrange(40, 100)
            req = Request(f"{conv}-t{turn}", list(toks), SamplingParams(max_tokens=out, ignore_eos=True),
                          None, block_hasher=hasher)
            st = sched.connector._state(req)  # kept after the finish pops it: the hit it got
            _run(req, sched, worker)
            assert _rows_agree(sched, worker), (conv, turn)
            last[conv] = (req, st)
            history[conv] = list(req.all_token_ids) + [rnd.randrange(4, 30000) for _ in range(rnd.randrange(60, 200))]
    return last


@pytest.fixture()
def stack(tmp_path: Path):  # noqa: ANN201
    def build(device_pages: int, host_pages: int, policy: str | None = None, **extra: Any) -> tuple[Any, Any]:
        vc = tc._config(tv._model_dir(tmp_path, MAX_LEN), MAX_LEN, 8192, host_pages * PAGE_BYTES,
                        tmp_path / "l3")
        vc.kv_transfer_config.kv_connector_extra_config.update(checkpoint_interval=CHECKPOINT, **extra)
        if policy is not None:  # vLLM's kv_load_failure_policy ("fail" by default, or "recompute")
            vc.kv_transfer_config.kv_load_failure_policy = policy
        sched = tc._scheduler(vc, tv.layer_specs(tv.preset_meta(SPEC)), device_pages * PAGE_BYTES)
        made.append(sched)
        return sched, _worker(vc, sched)

    made: list[Any] = []
    yield build
    for s in made:
        s.shutdown()


def test_l2_keeps_only_the_last_turns_windows_anchored(stack) -> None:  # noqa: ANN001
    sched, worker = stack(device_pages=400, host_pages=4000)
    conn = sched.connector
    last = _conversations(sched, worker, n_conv=2, seed=3)
    tier = _tier(sched)
    _, plain, anchored = _classes(tier)
    kept: set[bytes] = set()
    for req, st in last.values():
        tail = st.saved_tokens // conn.unit * conn.unit
        assert tail >= req.num_prompt_tokens // conn.unit * conn.unit  # decoded past the prompt
        kept |= _kept(conn, list(req.all_token_ids), st.namespace, tail, st.hit_tokens or st.local_tokens)
        ends = _kept(conn, list(req.all_token_ids), st.namespace, tail, 0)  # tail and checkpoints
        assert ends & (set(plain) | set(anchored)) <= set(anchored)  # held ones stay anchored
    assert set(anchored) <= kept, "a window the sequence moved past is still anchored"
    assert plain, "earlier turns' tails should be plain SWA now"
    assert tier.stats()["demoted_swa_pages"] > 0
    assert conn.stats["l2_demoted_pages"] == tier.stats()["demoted_swa_pages"]


def test_without_the_demotion_earlier_windows_stay_anchored(stack, monkeypatch) -> None:  # noqa: ANN001
    """The check above fails with the demotion off: the earlier turns' windows stay anchors."""
    monkeypatch.setattr(TierView, "passed", lambda self, keys, end, kept_ends: [])
    sched, worker = stack(device_pages=400, host_pages=4000)
    conn = sched.connector
    last = _conversations(sched, worker, n_conv=1, seed=3)
    _, plain, anchored = _classes(_tier(sched))
    (req, st), = last.values()
    kept = _kept(conn, list(req.all_token_ids), st.namespace, st.saved_tokens // conn.unit * conn.unit,
                 st.hit_tokens or st.local_tokens)
    assert not plain and not set(anchored) <= kept


def test_worker_rows_follow_the_index_under_eviction(stack) -> None:  # noqa: ANN001
    """A small device (turns come back from L2/L3) and a small L2 (it evicts): after every
    turn each key L2's index holds is in the worker's row it names, and every load the
    index planned read intact."""
    sched, worker = stack(device_pages=70, host_pages=48)
    _conversations(sched, worker, n_conv=3, seed=5)
    stats = _tier(sched).stats()
    assert stats["demoted_swa_pages"] > 0 and stats["evicted_full_pages"] + stats["evicted_swa_pages"] > 0
    assert worker.stats["load_pages_l2"] > 0 and worker.stats["load_failures"] == 0


def _orphans(idx: Any) -> tuple[list[bytes], list[bytes]]:
    """L2's (``idx``, a HostPageIndex) anchored SWA keys that name a base full page, and
    those of them whose base full page L2 no longer holds."""
    anchored = [k for k in _classes(idx.tier)[2] if idx.base_of(k) is not None]
    return anchored, [k for k in anchored if idx.base_of(k) not in idx.tier]


def test_windows_leave_l2_with_their_full_page(stack) -> None:  # noqa: ANN001
    """A small L2 that evicts full pages: the windows based on an evicted full page go
    with it (no anchored window outlives the full KV its hit needs)."""
    sched, worker = stack(device_pages=70, host_pages=48)
    _conversations(sched, worker, n_conv=3, seed=5)
    anchored, orphaned = _orphans(sched.connector._tiers.l2)
    assert anchored and not orphaned
    assert _tier(sched).counters["dropped_paired_swa_pages"] > 0


def test_without_the_pairing_windows_outlive_their_full_page(stack, monkeypatch) -> None:  # noqa: ANN001
    """The check above fails with the pairing off: anchored windows stay in L2 after
    their full page left it."""
    from hybridkv.tiers.host import HostTier

    monkeypatch.setattr(HostTier, "pair_swa", False)
    sched, worker = stack(device_pages=70, host_pages=48)
    _conversations(sched, worker, n_conv=3, seed=5)
    _, orphaned = _orphans(sched.connector._tiers.l2)
    assert orphaned
    assert _tier(sched).counters["dropped_paired_swa_pages"] == 0


def _request(sched: Any, rid: str, tokens: list[int]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=8, ignore_eos=True), None, block_hasher=_hasher(sched))


@pytest.mark.parametrize("copy_down", [True, False])
def test_a_page_l2_lost_is_copied_down_again(stack, monkeypatch, copy_down: bool) -> None:  # noqa: ANN001
    """Repair case 1 (device complete, host deficient) in the connector: a prompt's pages
    L3 holds but L2 lost (cleared here, as an eviction would) are copied down to L2
    again when a request computes or holds them; the worker's rows follow the index.  With the
    old rule (a page the store holds is never saved again) L2 stays without them."""
    if not copy_down:
        monkeypatch.setattr(TierView, "stored_everywhere",
                            lambda self, swa, keys: np.array([self.saved_or_queued(k) for k in keys], dtype=bool))
    sched, worker = stack(device_pages=400, host_pages=4000)
    rnd = random.Random(11)
    prompt = [rnd.randrange(4, 30000) for _ in range(700)]
    req_a = _request(sched, "a", list(prompt))
    conn = sched.connector
    ns = conn._state(req_a).namespace
    _run(req_a, sched, worker)
    from hybridkv_vllm.jobs import ReqState

    class _Req:  # the shared prompt's whole pages (request b differs past them)
        all_token_ids = prompt

    shared = len(prompt) // conn.unit * conn.unit
    keys = conn._keys(ReqState(_Req(), ns), shared)  # type: ignore[arg-type]
    full_a = {k for g in conn.groups if not g.is_swa for k in keys[g.index]}
    assert full_a and full_a <= set(_classes(_tier(sched))[0])
    _tier(sched).clear()
    _run(_request(sched, "b", prompt + [rnd.randrange(4, 30000) for _ in range(100)]), sched, worker)
    full_b = set(_classes(_tier(sched))[0])
    assert (full_a <= full_b) == copy_down and bool(full_a & full_b) == copy_down
    assert _rows_agree(sched, worker)


@pytest.mark.parametrize("anchor_checkpoint", [CHECKPOINT, 2 * CHECKPOINT, 0])
def test_checkpoint_windows_off_the_anchor_grid_enter_l2_plain(stack, anchor_checkpoint: int) -> None:  # noqa: ANN001
    """L2 keeps as anchors the windows the core's L2 keeps (tails, hit windows and the
    checkpoints on ``anchor_checkpoint``, hybridkv's ``swa_checkpoint``); the connector's
    denser checkpoint windows enter plain (evicted before full KV), and L3 stores them all."""
    sched, worker = stack(device_pages=400, host_pages=4000, anchor_checkpoint=anchor_checkpoint)
    rnd = random.Random(13)
    prompt = [rnd.randrange(4, 30000) for _ in range(1500)]
    req = _request(sched, "a", prompt)
    conn = sched.connector
    ns = conn._state(req).namespace
    _run(req, sched, worker)
    from hybridkv_vllm.jobs import ReqState

    class _Req:
        all_token_ids = prompt

    keys = conn._keys(ReqState(_Req(), ns), 1472)  # type: ignore[arg-type]
    _, plain, anchored = _classes(_tier(sched))
    for c in (CHECKPOINT, 2 * CHECKPOINT):
        window = {keys[g.index][i] for g in conn.groups if g.is_swa
                  for i in range((c - WINDOW) // g.block_size, c // g.block_size)}
        assert window and window <= set(plain) | set(anchored)  # L2 holds the checkpoint window
        on_grid = bool(anchor_checkpoint) and c % anchor_checkpoint == 0
        assert (window <= set(anchored)) == on_grid and (window <= set(plain)) != on_grid, c
        assert all(worker.backend.exists(sorted(window)))  # L3 stores it either way
    tail = {keys[g.index][i] for g in conn.groups if g.is_swa
            for i in range((1472 - WINDOW) // g.block_size, 1472 // g.block_size)}
    assert tail <= set(anchored)  # the prompt-end window: an anchor
    assert _rows_agree(sched, worker)


@pytest.mark.parametrize("copies_first", [True, False])
def test_l2_gives_up_its_copies_of_device_pages_first_and_gets_them_back(stack, copies_first: bool) -> None:  # noqa: ANN001
    """L2 knows which full pages vLLM's device cache holds (hybridkv's scheduler here):
    every block the connector counts as holding a page is still a cached block of
    vLLM's pool, L2's copies of those pages are evicted before the pages only L2
    holds, and a page the device gives up while L2 lacks it is copied down to L2
    (the worker writes exactly the rows the scheduler queued).  With the rule off
    (``l1_copies_first: false``) none of this happens."""
    sched, worker = stack(device_pages=70, host_pages=48, l1_copies_first=copies_first)
    conn = sched.connector
    _conversations(sched, worker, n_conv=5, seed=5)
    tier, view = _tier(sched), conn._l1
    assert (view is not None) == copies_first and tier.l1_copies_first == copies_first
    if not copies_first:
        assert tier.counters["evicted_l1_copy_pages"] == 0 and worker.stats.get("l2_rescued_pages", 0) == 0
        return
    blocks = conn._kv_cache_manager.block_pool.blocks
    assert len(view) > 0 and all(blocks[b].block_hash is not None for b in view._held)
    assert set(tier._copies) == {k for _, k in view._held.values() if k in tier._full}
    assert tier.counters["evicted_l1_copy_pages"] > 0
    assert view.rescued > 0 and worker.stats["l2_rescued_pages"] == view.rescued
    assert _rows_agree(sched, worker) and worker.stats["load_failures"] == 0


@pytest.mark.parametrize("copies_first", [False, True])
def test_every_full_page_l2_keeps_has_its_whole_prefix_in_l2(stack, copies_first: bool) -> None:  # noqa: ANN001
    """The connector names each stored full page's parent (the page before it), in
    saves, loads and copy-downs alike, so L2's full pages form a tree of keys and L2
    evicts leaves only: under pressure, every full page it keeps still has its whole
    prefix in L2 (usable by a hit).  Under the old LRU over keys, a sequence's first
    pages went first, leaving the rest unreachable.  With ``l1_copies_first`` L2
    gives up its copies of device pages first (the device serves that prefix), so
    there only the links are checked."""
    sched, worker = stack(device_pages=70, host_pages=48, l1_copies_first=copies_first)
    _conversations(sched, worker, n_conv=5, seed=7)
    tier = _tier(sched)
    tier.check_invariants()
    assert tier.counters["evicted_full_pages"] > 0 and worker.stats["load_failures"] == 0
    assert (worker.stats.get("l2_rescued_pages", 0) > 0) == copies_first
    full_groups = sum(not g.is_swa for g in sched.connector.groups)
    roots = [k for k in tier._full if k not in tier._parent]
    assert len(roots) <= 5 * full_groups  # only first pages lack a parent
    if copies_first:
        return
    for key in tier._full:
        up = tier._parent.get(key)
        while up is not None:
            assert up in tier._full, "a held full page whose prefix L2 lost"
            up = tier._parent.get(up)


def _prompt_keys(conn: Any, tokens: list[int], ns: str, end: int) -> dict[int, list[bytes]]:
    """Per group index, the keys of ``tokens``' pages up to ``end`` tokens, as the connector keys them."""
    from hybridkv_vllm.jobs import ReqState

    class _Req:
        all_token_ids = tokens

    return conn._keys(ReqState(_Req(), ns), end)  # type: ignore[arg-type]


@pytest.mark.parametrize("complete, repair", [(True, True), (False, True), (True, False), (False, False)])
def test_host_swa_completes_the_device_window_at_the_next_load(stack, monkeypatch,  # noqa: ANN001
                                                              complete: bool, repair: bool) -> None:
    """Repair case 2 (host holds SWA the device lacks) in the connector: the device's tree
    keeps a prompt's full KV but gave up all its SWA, so the device alone has no window-safe
    hit; L2 holds the window, so the repeat's load reads it host-to-device into the sliding
    group's blocks, and those blocks hold L2's rows (random bytes here, the device zeroed).

    With the window repair (``repair``, :mod:`hybridkv_vllm.repair`) the device hands vLLM
    its full KV up to the last page before the hit's end, with fresh blocks for the window
    below it: L2 serves the window and only the last page's full KV.  Without it the device
    has no hit and L2 serves every full page again.  With the sliding groups' part of the
    load switched off (``complete=False``) the window's blocks keep stale bytes."""
    import hybridkv_vllm.connector as connector_mod

    real = connector_mod.load_pages
    loads: list[tuple[bool, list[bytes], list[int]]] = []

    def spy(backend, group, keys, ids, l2=None, swa=False, slots=None):  # noqa: ANN001, ANN202
        loads.append((swa, list(keys), list(ids)))
        if swa and not complete:  # the repair off: the device's window is not completed
            return True, 0, 0
        return real(backend, group, keys, ids, l2, swa, slots)

    monkeypatch.setattr(connector_mod, "load_pages", spy)
    sched, worker = stack(device_pages=400, host_pages=4000, repair_windows=repair)
    conn, mgr = sched.connector, sched.kv_cache_manager
    for gb in worker._buffers.values():  # the saves copy distinct bytes into L2's rows
        for lay in gb.layers:
            lay.tensor.random_(0, 256)
    rnd = random.Random(17)
    prompt = [rnd.randrange(4, 30000) for _ in range(700)]
    req_a = _request(sched, "a", list(prompt))
    ns = conn._state(req_a).namespace
    _run(req_a, sched, worker)
    for gb in worker._buffers.values():  # what the device held is gone; only L2 has the bytes
        for lay in gb.layers:
            lay.tensor.zero_()
    mgr.tree.evict(swa_pages=mgr.tree.evictable_swa_pages())  # the device keeps the full KV only
    assert mgr.tree.swa_pages_cached == 0 and mgr.tree.full_pages_cached > 0
    hit = (len(prompt) - 1) // conn.unit * conn.unit
    local = (hit - conn.unit) // mgr.page_size * mgr.page_size if repair else 0  # the device's part
    req_b = _request(sched, "b", list(prompt))
    st_b = conn._state(req_b)
    before = dict(worker.stats)
    _run(req_b, sched, worker)
    assert st_b.local_tokens == local and st_b.hit_tokens == hit  # without the repair the device has no hit
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    assert st_b.hit_sources == {CacheHitSource.HOST: hit - local}
    assert conn.stats["repaired_tokens"] == local and conn.stats["reloaded_held_tokens"] == hit - local
    assert mgr.counters["window_repairs"] == int(repair)
    keys = _prompt_keys(conn, prompt, ns, hit)
    full_pages = sum((hit - local) // g.block_size for g in conn.groups if not g.is_swa)
    window = {g.index: keys[g.index][(hit - WINDOW) // g.block_size:hit // g.block_size]
              for g in conn.groups if g.is_swa}
    window_pages = sum(len(ks) for ks in window.values())
    got_l2 = worker.stats.get("load_pages_l2", 0) - before.get("load_pages_l2", 0)
    assert got_l2 == full_pages + window_pages * complete and worker.stats["load_failures"] == 0
    swa_loads = [(ks, ids) for swa, ks, ids in loads if swa]
    assert sorted(k for ks, _ in swa_loads for k in ks) == sorted(k for ks in window.values() for k in ks)
    index = conn._tiers.l2.tier
    for g in conn.groups:
        if not g.is_swa:
            continue
        ids = [i for ks, bids in swa_loads for k, i in zip(ks, bids) if k in set(window[g.index])]
        rows = torch.empty((len(ids), worker._l2.page_bytes), dtype=torch.uint8)
        slots = index.lookup_swa(window[g.index]).tolist()
        assert len(worker._l2.read(True, slots, window[g.index], rows)) == len(ids)  # L2 still holds them
        blocks = worker._buffers[g.index].gather(ids).view(torch.uint8)
        assert torch.equal(blocks, rows) == complete
    mgr.check_invariants()  # nothing live: the repair's fresh blocks are the tree's or free


@pytest.mark.parametrize("prompt_len, keep_hit", [
    (641, True), (641, False),  # a's tail is its prompt-end window: that window is anchored whole
    (700, True), (700, False),  # a's tail (704) moved past it: its first page was made plain at a's finish
])
def test_the_window_a_hit_ends_at_stays_anchored_in_l2(stack, monkeypatch, prompt_len: int,
                                                        keep_hit: bool) -> None:  # noqa: ANN001
    """Repair case 4 (a hit's window is anchored in L2 so it stays) in the connector: request
    b hits the device at a's prompt end (640 tokens) and its sequence moves far past it; when
    b finishes, the window ``[512, 640)`` its hit ended at is still anchored in L2 (not made
    plain with the other windows b moved past, so L2 gives it up only after full KV).  With the
    hit's end left out of the windows a finished request keeps (``keep_hit=False``) the
    window is demoted to plain.  In the ``700`` cases a's finish made the window's first page
    plain (its tail moved past it): b's hit anchors the whole window again, as the core's
    ``L2Backup.anchor_hit_window`` does (seen failing before ``TierView.anchor_window``)."""
    if not keep_hit:
        real = TierView.passed
        monkeypatch.setattr(TierView, "passed",  # the last kept end is the hit's
                            lambda self, keys, end, kept_ends: real(self, keys, end, kept_ends[:-1]))
    sched, worker = stack(device_pages=400, host_pages=4000)
    conn = sched.connector
    rnd = random.Random(19)
    prompt = [rnd.randrange(4, 30000) for _ in range(prompt_len)]
    req_a = _request(sched, "a", list(prompt))
    ns = conn._state(req_a).namespace
    _run(req_a, sched, worker)
    hit = (prompt_len - 1) // conn.unit * conn.unit
    assert hit == 640
    keys = _prompt_keys(conn, prompt, ns, hit)
    window = [k for g in conn.groups if g.is_swa for k in keys[g.index][(hit - WINDOW) // g.block_size:]]
    _, plain, anchored = _classes(_tier(sched))
    assert window and set(window) <= set(plain) | set(anchored)  # a's prompt-end window is in L2
    req_b = _request(sched, "b", prompt + [rnd.randrange(4, 30000) for _ in range(300)])
    st_b = conn._state(req_b)
    _run(req_b, sched, worker)
    assert (st_b.hit_tokens or st_b.local_tokens) == hit  # b's hit ends at a's prompt end
    assert st_b.saved_tokens >= hit + 256  # b's tail moved past that window
    _, plain, anchored = _classes(_tier(sched))
    assert (set(window) <= set(anchored)) == keep_hit and (not set(window) & set(plain)) == keep_hit
    assert (conn.stats.get("l2_anchored_pages", 0) > 0) == (prompt_len == 700)  # a's finish made a page plain
    assert _rows_agree(sched, worker)


@pytest.mark.parametrize("extra", [0, 100])
@pytest.mark.parametrize("copy_down", [True, False])
def test_a_window_l2_lost_is_copied_down_again(stack, monkeypatch, copy_down: bool,  # noqa: ANN001
                                               extra: int) -> None:
    """Repair case 1 (device complete, host deficient) for SWA in the connector: the window a
    later hit needs (each sliding group's pages of ``[hit - WINDOW, hit)``, a's prompt-end
    window) leaves L2 (discarded from the index, its worker rows untagged) while the store
    and the device keep it; a repeat of the prompt hits the device there and its prefill-end
    save stores the window in L2 again: the index holds every key and the worker's row at
    each slot is tagged with it.  With ``extra`` tokens after the prompt the window is not
    b's prompt-end window but the one its device hit ended at (saved since the save plan
    counts that end; before, L2 stayed without it).  With the old rule (a page the store
    holds is never saved again, ``copy_down=False``) L2 stays without the window."""
    if not copy_down:
        monkeypatch.setattr(TierView, "stored_everywhere",
                            lambda self, swa, keys: np.array([self.saved_or_queued(k) for k in keys], dtype=bool))
    sched, worker = stack(device_pages=400, host_pages=4000)
    conn, tier = sched.connector, _tier(sched)
    rnd = random.Random(23)
    prompt = [rnd.randrange(4, 30000) for _ in range(700)]
    req_a = _request(sched, "a", list(prompt))
    ns = conn._state(req_a).namespace
    _run(req_a, sched, worker)
    hit = (len(prompt) - 1) // conn.unit * conn.unit
    keys = _prompt_keys(conn, prompt, ns, hit)
    window = [k for g in conn.groups if g.is_swa for k in keys[g.index][(hit - WINDOW) // g.block_size:]]
    _, plain, anchored = _classes(tier)
    assert window and set(window) <= set(plain) | set(anchored)  # a's prompt-end window is in L2
    tags = worker._l2._tags[True]
    for slot in tier.lookup_swa(window).tolist():  # L2 loses the window: index and rows
        tags[slot] = None
    assert tier.discard(window, swa=True) == len(window)
    assert all(worker.backend.exists(window))  # the store keeps it
    req_b = _request(sched, "b", prompt + [rnd.randrange(4, 30000) for _ in range(extra)])
    st_b = conn._state(req_b)
    _run(req_b, sched, worker)
    assert st_b.local_tokens == hit and st_b.hit_tokens == 0  # b holds the window: the device's hit
    slots = tier.lookup_swa(window)
    assert (slots >= 0).all() == copy_down and (slots >= 0).any() == copy_down
    assert all(tags[s] == k for s, k in zip(slots.tolist(), window) if s >= 0)  # the worker wrote those rows
    assert _rows_agree(sched, worker)
