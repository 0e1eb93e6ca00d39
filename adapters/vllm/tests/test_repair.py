"""Repair case 2 in vLLM: the device's full KV with the window a lower tier holds (:mod:`hybridkv_vllm.repair`).

Through vLLM's real scheduler with hybridkv's prefix cache and connector, and a
worker-role connector in the same process (the stack of ``test_l2_demote``).
The case itself (the device keeps a prompt's full KV, L2 its window; the bytes
loaded into the fresh window blocks are L2's) is
``test_l2_demote.test_host_swa_completes_the_device_window_at_the_next_load``,
with the repair on and off.  Here: the window stays on the device after the
load, a failed load caches and saves nothing it did not fill (under both of
vLLM's failure policies), and interleaved conversations on a small device serve
at least the same hits while loading less again.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from test_l2_demote import _conversations, _request, _rows_agree, _run, stack  # noqa: F401

import hybridkv_vllm.connector as connector_mod
from hybridkv.tiers.index import StoreIndex
from hybridkv.tiers.lookup import GroupInfo
from hybridkv_vllm.config import ConnectorConfig
from hybridkv_vllm.repair import device_tokens
from hybridkv_vllm.sources import TierView


def _case_2(stack: Any, seed: int, **kw: Any) -> tuple[Any, Any, list[int], int]:  # noqa: ANN001
    """Request a's prompt cached, then its SWA evicted from the device: the device keeps
    the full KV only.  Returns the stack, the prompt and its hit end."""
    sched, worker = stack(device_pages=400, host_pages=4000, **kw)
    rnd = random.Random(seed)
    prompt = [rnd.randrange(4, 30000) for _ in range(700)]
    _run(_request(sched, "a", list(prompt)), sched, worker)
    mgr = sched.kv_cache_manager
    mgr.tree.evict(swa_pages=mgr.tree.evictable_swa_pages())
    assert mgr.tree.swa_pages_cached == 0 and mgr.tree.full_pages_cached > 0
    return sched, worker, prompt, (len(prompt) - 1) // sched.connector.unit * sched.connector.unit


def test_a_repaired_window_stays_on_the_device(stack) -> None:  # noqa: ANN001
    """b's load fills fresh window blocks below the device's part of its hit; the tree
    takes them at b's finish, so c (the same prompt) hits wholly on the device."""
    sched, worker, prompt, hit = _case_2(stack, 3)
    conn, mgr = sched.connector, sched.kv_cache_manager
    req_b = _request(sched, "b", list(prompt))
    st_b = conn._state(req_b)
    _run(req_b, sched, worker)
    assert 0 < st_b.local_tokens < hit == st_b.hit_tokens and mgr.counters["window_repairs"] == 1
    assert mgr.tree.swa_pages_cached > 0  # the loaded window is the tree's now
    before = dict(worker.stats)
    req_c = _request(sched, "c", list(prompt))
    st_c = conn._state(req_c)
    _run(req_c, sched, worker)
    assert st_c.local_tokens == hit and st_c.hit_tokens == 0  # the device alone
    assert worker.stats.get("load_pages", 0) == before.get("load_pages", 0)
    assert mgr.counters["window_repairs"] == 1
    mgr.check_invariants()


@pytest.mark.parametrize("started_over", [True, False])
def test_a_window_repair_tells_l1s_view_anew(stack, monkeypatch, started_over: bool) -> None:  # noqa: ANN001
    """A request saved before a preemption has told L1's view its full pages up to
    where it was (``l1_marked``); taken again through a window repair it holds new
    blocks, so the handover starts that count over, as a plain lookup does: its
    first save tells the view every full block it holds, the loaded ones included
    (repair case 1 then covers them).  Planted fault: the handover keeps the old
    count (as before the mend); then no loaded block is told."""
    if not started_over:
        real = connector_mod.HybridKVConnector.get_num_new_matched_tokens

        def keep(self: Any, request: Any, n: int) -> Any:
            st = self._reqs.get(request.request_id)
            old = st.l1_marked if st is not None else 0
            out = real(self, request, n)
            if st is not None and st.repair is not None:
                st.l1_marked = old
            return out

        monkeypatch.setattr(connector_mod.HybridKVConnector, "get_num_new_matched_tokens", keep)
    sched, worker, prompt, hit = _case_2(stack, 4)
    conn, mgr = sched.connector, sched.kv_cache_manager
    g = next(g for g in conn.groups if not g.is_swa)
    told: list[int] = []
    tell = conn._l1.held

    def held(gi: int, ids: Any, keys: Any, pages: Any) -> None:
        pages = list(pages)
        told.extend(pages if gi == g.index else ())
        tell(gi, ids, keys, pages)

    monkeypatch.setattr(conn._l1, "held", held)
    req_b = _request(sched, "b", list(prompt))
    st_b = conn._state(req_b)
    st_b.l1_marked = len(prompt)  # as a save before a preemption leaves it
    _run(req_b, sched, worker)
    assert mgr.counters["window_repairs"] == 1 and 0 < st_b.local_tokens < hit == st_b.hit_tokens
    loaded = set(range(st_b.local_tokens // g.block_size, hit // g.block_size))
    assert loaded and (loaded <= set(told)) == started_over and (not loaded & set(told)) != started_over


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("repair", [True, False])
def test_a_failed_load_caches_and_saves_nothing_it_did_not_fill(stack, monkeypatch, policy: str,  # noqa: ANN001
                                                                  repair: bool) -> None:
    """b's load fails.  Under vLLM's ``fail`` policy b ends with an error while vLLM
    counts its hit computed: the tree caches none of the blocks the load was to fill
    (the fresh window blocks of a repair, the new blocks of a plain load) and the
    connector saves none of them.  Under ``recompute`` b runs again from scratch (the
    failed pages leave the tiers' record, so it does not load them again) and its
    pages are cached as computed.  Either way every block is the tree's or free."""
    from vllm.v1.request import RequestStatus

    sched, worker, prompt, hit = _case_2(stack, 5, policy=policy, repair_windows=repair)
    conn, mgr = sched.connector, sched.kv_cache_manager
    monkeypatch.setattr(connector_mod, "load_pages", lambda *a, **k: (False, 0, 0))
    full_before = mgr.tree.full_pages_cached
    saved_before = worker.stats.get("save_pages", 0)
    req_b = _request(sched, "b", list(prompt))
    st_b = conn._state(req_b)
    _run(req_b, sched, worker)
    # each failed load leaves its pages out of the tiers' record: a repair's retry may find a
    # shorter hit whose window no failed load carried, and load again
    assert worker.stats["load_failures"] == (mgr.counters["window_repairs"] if repair else 1) >= 1
    assert mgr.counters["window_repairs"] == int(repair) or policy == "recompute"
    if policy == "fail":
        assert req_b.status == RequestStatus.FINISHED_ERROR and st_b.hit_tokens == hit
        assert mgr.tree.swa_pages_cached == 0 and mgr.tree.full_pages_cached == full_before
        assert worker.stats.get("save_pages", 0) == saved_before
    else:
        assert req_b.status != RequestStatus.FINISHED_ERROR and req_b.num_computed_tokens >= len(prompt)
        assert st_b.hit_tokens == 0  # the retry's lookup: the failed pages left the tiers' record
        assert mgr.tree.swa_pages_cached > 0  # b computed them
    assert not conn._loading  # the worker's report settled the failed keys
    mgr.check_invariants()


def _served(stack: Any, monkeypatch: Any, repair: bool, seed: int) -> tuple[int, dict[str, int], Any]:
    """Interleaved conversations on a small device and L2: every admitted hit (device and
    connector tokens) summed, and the counters."""
    admitted: dict[str, int] = {}
    real = connector_mod.HybridKVConnector.update_state_after_alloc

    def spy(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        admitted[request.request_id] = (st.local_tokens if st is not None else 0) + int(num_external_tokens)
        real(self, request, blocks, num_external_tokens)

    monkeypatch.setattr(connector_mod.HybridKVConnector, "update_state_after_alloc", spy)
    sched, worker = stack(device_pages=70, host_pages=200, repair_windows=repair)
    _conversations(sched, worker, n_conv=3, seed=seed)
    sched.kv_cache_manager.check_invariants()
    assert _rows_agree(sched, worker) and worker.stats.get("load_failures", 0) == 0
    counts = {k: sched.connector.stats.get(k, 0) for k in ("repaired_tokens", "reloaded_held_tokens", "hit_tokens")}
    counts.update({k: worker.stats.get(k, 0) for k in ("load_pages", "load_pages_l2", "load_pages_l3")})
    return sum(admitted.values()), counts, sched


@pytest.mark.parametrize("seed", [5, 6])
def test_conversations_serve_as_much_and_load_less_again(stack, monkeypatch, seed: int) -> None:  # noqa: ANN001
    """The same interleaved conversations with the repair on and off: on, the device
    serves full KV it held (``repaired_tokens``), the full KV loaded again drops, the
    pages loaded drop, and the hits served (device plus connector) are not fewer."""
    served_on, on, _ = _served(stack, monkeypatch, True, seed)
    served_off, off, _ = _served(stack, monkeypatch, False, seed)
    assert on["repaired_tokens"] > 0 and off["repaired_tokens"] == 0
    assert on["reloaded_held_tokens"] < off["reloaded_held_tokens"]
    assert on["load_pages"] < off["load_pages"]
    assert served_on >= served_off


def _view(stored: list[bytes]) -> tuple[TierView, list[GroupInfo]]:
    groups = [GroupInfo(0, None, (), 16), GroupInfo(1, 32, (), 16)]
    view = TierView(groups, None, connector_mod.CacheHitSource.DISK, StoreIndex(None))
    view.store.stored(stored)
    return view, groups


def test_device_tokens_needs_the_tiers_to_hold_the_load_past_the_device() -> None:
    """The device's part ends on a page, a unit short of the hit at least, past the
    window-safe hit; the tiers must hold every full page from there to the hit's end."""
    keys = {0: [bytes([i]) * 16 for i in range(12)], 1: [bytes([100 + i]) * 16 for i in range(12)]}
    view, groups = _view(keys[0][8:12])
    assert device_tokens(view, groups, keys, 0, 160, 192, 16, 64) == 128
    assert device_tokens(view, groups, keys, 0, 192, 192, 16, 64) == 128  # a unit short: still page 2's end
    assert device_tokens(view, groups, keys, 128, 160, 192, 16, 64) == 0  # nothing past the safe hit
    view, groups = _view(keys[0][9:12])  # the tiers lack page 8's full KV
    assert device_tokens(view, groups, keys, 0, 160, 192, 16, 64) == 0
    view, groups = _view([])
    assert device_tokens(view, groups, keys, 0, 160, 192, 16, 16) == 0
    view, groups = _view(keys[0][11:12])
    assert device_tokens(view, groups, keys, 0, 192, 192, 16, 16) == 176  # page = unit: one unit loaded
    assert np.array_equal(view.store.held(keys[0][11:12]), [True])


def test_the_repair_option_is_validated() -> None:
    assert ConnectorConfig.from_extra({}).repair_windows is True
    assert ConnectorConfig.from_extra({"repair_windows": "off"}).repair_windows is False
    with pytest.raises(TypeError, match="repair_windows"):
        ConnectorConfig.from_extra({"repair_windows": 2})
