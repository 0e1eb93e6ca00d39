"""The L2 host tier's eviction order, the tier manager's timeouts, queue limits and
rate-limited touches, and the scaled payload's keys (the tiers under replay and
verify are in ``tests/eval/test_replay_tiers.py``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from hybridkv.spec import AttnKind, ModelSpec
from hybridkv.tiers.host import HostTier
from hybridkv.tiers.manager import TierManager
from hybridkv.tiers.payload import swa_key
from hybridkv.tiers.storage import open_backend

SPEC = ModelSpec.preset("mimo-v2.5-pro")


def test_host_tier_evicts_plain_swa_then_full_then_anchored():
    spec = ModelSpec.preset("mimo-v2.5", page_size=4)
    fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    host = HostTier(spec, 4 * fpb + 4 * spb)
    f, s = host.alloc(4, 4)
    keys = [bytes([i]) * 16 for i in range(8)]
    host.insert_full(keys[:4], f)
    host.insert_swa(keys[4:], s, np.array([True, False, False, True]))
    host.check_invariants()
    f2, s2 = host.alloc(0, 2)  # two plain SWA pages go first
    assert host.stats()["anchored_swa_pages"] == 2 and host.num_full_pages == 4
    got = host.alloc(2, 0, protect=[int(f[0])])  # no plain SWA left: full LRU next, protected kept
    assert got is not None and (host.lookup_full(keys[:1]) >= 0).all()
    assert host.lookup_full(keys[1:3]).tolist() == [-1, -1]
    assert host.stats()["anchored_swa_pages"] == 2  # anchored SWA goes last
    host.free(*got)
    host.free(f2, s2)
    host.check_invariants()
    with pytest.raises(ValueError, match="budget_bytes"):
        HostTier(spec, 0)


def test_host_tier_demote_moves_anchored_windows_by_full_key_and_eviction_forgets_them():
    spec = ModelSpec.preset("mimo-v2.5", page_size=4)
    fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    host = HostTier(spec, 4 * fpb + 4 * spb)
    full = [bytes([i]) * 16 for i in range(4)]
    swa = [swa_key(k) for k in full]
    f, s = host.alloc(4, 4)
    host.insert_full(full, f)
    host.insert_swa(swa, s, np.array([True, True, False, True]), full)
    assert host.anchored_swa(swa).tolist() == [True, True, False, True]
    # plain, absent and unknown keys are ignored; the moved ones become plain, most recent
    assert host.demote([full[0], full[2], b"x" * 16]) == 1
    assert host.anchored_swa(swa).tolist() == [False, True, False, True]
    assert host.stats()["demoted_swa_pages"] == 1
    host.check_invariants()
    assert host.anchor([swa[0]]) == 1 and host.anchored_swa(swa)[0]  # promoted back: demotable again
    host.check_invariants()
    # an anchored window that goes with its full page is forgotten by key as well
    assert host.discard([full[3]]) == 1 and not host.anchored_swa(swa)[3]
    host.check_invariants()
    assert host.demote([full[3]]) == 0
    assert host.demote(full) == 2 and host.stats()["anchored_swa_pages"] == 0
    host.check_invariants()
    host.clear()
    host.check_invariants()


def test_host_tier_demote_swa_moves_anchored_windows_by_swa_key():
    """Demoting by SWA key (an owner without full-KV keys for its SWA pages): anchored
    entries become plain and most recently used there (evicted after older plain SWA),
    plain and absent keys are ignored, a based entry leaves the full-key index."""
    spec = ModelSpec.preset("mimo-v2.5", page_size=4)
    spb = spec.bytes_per_page("swa")
    host = HostTier(spec, 4 * spb)
    keys = [bytes([i]) * 16 for i in range(4)]
    _, s = host.alloc(0, 4)
    host.insert_swa(keys[:3], s[:3], np.array([False, True, True]))
    host.insert_swa(keys[3:], s[3:], np.array([True]), [b"f" * 16])
    assert host.demote_swa([keys[0], keys[1], b"x" * 16]) == 1
    assert host.anchored_swa(keys).tolist() == [False, False, True, True]
    assert host.stats()["demoted_swa_pages"] == 1
    host.check_invariants()
    assert host.demote_swa([keys[3]]) == 1 and host.demote([b"f" * 16]) == 0  # by either key, once
    host.check_invariants()
    got = host.alloc(0, 1)  # evicts the least recently used plain entry
    assert got is not None and (host.lookup_swa(keys) >= 0).tolist() == [False, True, True, True]
    host.free(*got)
    host.check_invariants()




@pytest.mark.parametrize("copies_first", [True, False])
def test_host_tier_evicts_its_copies_of_l1_pages_first(copies_first: bool):
    """With ``l1_copies_first`` a full page whose key L1 holds (``mark_l1``) is evicted
    before older pages only L2 holds, and counted; a key two L1 pages hold stays a copy
    until both are given back.  Off: plain LRU."""
    spec = ModelSpec.preset("mimo-v2.5", page_size=4)
    host = HostTier(spec, 3 * spec.bytes_per_page("full"))
    host.l1_copies_first = copies_first
    host.insert_full([b"a", b"b", b"c"], host.alloc(3, 0)[0])  # LRU first: a, b, c
    host.mark_l1([b"b", b"c", b"c"], True)  # L1 holds b, and c twice
    host.mark_l1([b"c"], False)
    host.check_invariants()
    host.insert_full([b"x"], host.alloc(1, 0)[0])  # one eviction
    held = (host.lookup_full([b"a", b"b", b"c"]) >= 0).tolist()
    assert held == ([True, False, True] if copies_first else [False, True, True])
    assert host.stats()["evicted_l1_copy_pages"] == int(copies_first)
    host.insert_full([b"y"], host.alloc(1, 0)[0])  # c: still a copy (one L1 page left)
    assert (host.lookup_full([b"c"]) >= 0).tolist() == [not copies_first]
    host.mark_l1([b"c", b"b"], False)
    host.check_invariants()


@pytest.mark.parametrize("pair", [True, False])
def test_host_tier_swa_pages_of_several_groups_leave_with_their_base(monkeypatch, pair: bool):
    """Two SWA pages based on one full page (two sliding groups): demoting by the full
    key moves both; evicting or discarding the full page drops both (counted), except
    one a load protects; with ``pair_swa`` off both outlive it (the fault the pairing
    prevents).  Any other SWA page is untouched."""
    monkeypatch.setattr(HostTier, "pair_swa", pair)
    spec = ModelSpec.preset("mimo-v2.5", page_size=4)
    fpb, spb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    host = HostTier(spec, 2 * fpb + 4 * spb)
    f, s = host.alloc(2, 4)
    host.insert_full([b"F0", b"F1"], f)
    host.insert_swa([b"a0", b"b0", b"a1", b"zz"], s, np.array([True, True, True, True]),
                    [b"F0", b"F0", b"F1", None])
    assert host.base_of(b"b0") == b"F0" and host.base_of(b"zz") is None
    assert host.demote([b"F0"]) == 2 and host.anchored_swa([b"a0", b"b0", b"a1"]).tolist() == [False, False, True]
    host.check_invariants()
    assert host.discard([b"F0"]) == 1
    held = (host.lookup_swa([b"a0", b"b0", b"a1", b"zz"]) >= 0).tolist()
    assert held == [not pair, not pair, True, True]
    assert host.stats()["dropped_paired_swa_pages"] == 2 * int(pair)
    host.check_invariants()
    # full eviction (room for two full pages) takes F1's window too, unless a load protects it
    protect = host.lookup_swa([b"a1"]).tolist()
    taken = []
    while host.lookup_full([b"F1"]).tolist() != [-1] and len(taken) < 64:
        got = host.alloc(1, 0, protect_swa=protect)
        assert got is not None
        taken.append(got)
    assert host.lookup_full([b"F1"]).tolist() == [-1]
    assert (host.lookup_swa([b"a1"]) >= 0).tolist() == [True]  # protected: it stays
    for got in taken:
        host.free(*got)
    host.check_invariants()
    assert host.discard([b"a1"], swa=True) == 1  # its base is gone: it leaves the pairing too
    host.check_invariants()


class SlowBackend:
    """A file backend whose reads take ``delay`` seconds (a slow server)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def exists(self, keys):  # noqa: ANN001, ANN201
        time.sleep(self.delay)
        return self.inner.exists(keys)

    def get(self, keys):  # noqa: ANN001, ANN201
        time.sleep(self.delay)
        return self.inner.get(keys)

    def get_into(self, keys, buffers):  # noqa: ANN001, ANN201
        return self.inner.get_into(keys, buffers)

    def put(self, keys, values):  # noqa: ANN001, ANN201
        return self.inner.put(keys, values)

    def touch(self, keys):  # noqa: ANN001, ANN201
        return self.inner.touch(keys)

    def delete(self, keys):  # noqa: ANN001, ANN201
        return self.inner.delete(keys)

    def stats(self):  # noqa: ANN201
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


def test_manager_slow_reads_time_out_as_misses_and_writes_drop_when_full(tmp_path):
    inner = open_backend(f"file://{tmp_path / 'l3'}")
    slow = SlowBackend(inner, delay=0.5)
    m = TierManager(slow, timeout_s=0.05, max_queued_writes=3)
    key = b"k" * 16
    assert m.put_async([key], [b"v"])
    t0 = time.monotonic()
    assert m.get([key]) == [None]  # late: a miss, the engine does not wait
    assert time.monotonic() - t0 < 0.4
    assert m.stats()["l3_timeouts"] == 1
    assert m.put_async([b"a" * 16, b"b" * 16], [b"1", b"2"])  # queued behind the slow read
    assert not m.put_async([b"c" * 16, b"d" * 16], [b"3", b"4"])  # 2 + 2 > 3: dropped, not blocking
    assert m.stats()["l3_writes_dropped"] == 2
    assert m.flush(5)
    assert bytes(m.get([key], timeout_s=5)[0]) == b"v"
    m.close()
    assert m.get([key]) == [None]  # closed: a miss, no exception
    inner.close()


def test_manager_touch_is_rate_limited():
    clock = [100.0]
    calls: list[list[bytes]] = []

    class Rec(SlowBackend):
        def touch(self, keys):  # noqa: ANN001, ANN201
            calls.append(list(keys))

    m = TierManager(Rec(None, 0), touch_interval_s=10, clock=lambda: clock[0])
    keys = [bytes([i]) * 16 for i in range(3)]
    assert m.touch(keys) == 3 and m.touch(keys) == 0
    clock[0] += 11
    assert m.touch(keys[:1]) == 1
    m.flush(5)
    assert calls == [keys, keys[:1]]
    m.close()
    with pytest.raises(TypeError, match="backend"):
        TierManager(object())  # type: ignore[arg-type]
    _ = threading.active_count()


def test_scaled_payload_rejects_a_value_of_another_key():
    from hybridkv.tiers.payload import ScaledPayload
    codec = ScaledPayload(SPEC)
    a, b = b"a" * 16, b"b" * 16
    va = codec.encode(AttnKind.FULL, [a], np.array([0]))
    assert codec.decode(AttnKind.FULL, [a, b], [va[0], va[0]], np.array([0, 1])).tolist() == [True, False]
    assert codec.decode(AttnKind.SWA, [a], va, np.array([0])).tolist() == [False]  # kind matters
    assert codec.nominal_bytes(AttnKind.FULL) == SPEC.bytes_per_page("full")
