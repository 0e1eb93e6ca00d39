"""The connector's hits by source (``vllm:prompt_tokens_cached_by_source``): L2 pages are
``host``, a file L3's are ``disk``, and the scheduler's mirror of the worker's L2 moves
as the worker's L2 does (no server: :class:`hybridkv_vllm.sources.TierView` alone)."""

from __future__ import annotations

import pytest
import torch
from hybridkv_vllm.l2 import HostPageCache, HostPageIndex
from hybridkv_vllm.plan import GroupInfo
from hybridkv_vllm.sources import TierView, l3_source
from vllm.v1.metrics.cache_hit_source import CacheHitSource as S

# MiMo-V2's shape in vLLM: a full group of 64-token blocks, a sliding group (window 64) of 32
FULL, SWA = GroupInfo(0, None, ("f",), 64), GroupInfo(1, 64, ("s",), 32)
PAGE = 1024


def _keys(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def _load(src: TierView, tag: str, end: int, start: int = 0) -> dict:
    """A hit [start, end): every full page, and the sliding group's window before ``end``."""
    full = list(range(start // 64, end // 64))
    swa = list(range(max(start, end - 64) // 32, end // 32))
    return src.on_load({0: (full, [_keys(tag + "f", end // 64)[i] for i in full]),
                        1: (swa, [_keys(tag + "s", end // 32)[i] for i in swa])}, start, end)


@pytest.mark.parametrize("url, source", [("file:hybridkv-l3", S.DISK), ("file:///var/cache/hkv", S.DISK),
                                         ("nixl+posix:///data/l3", S.DISK), ("hybridkv-l3", S.DISK),
                                         ("redis://127.0.0.1:6379/0", S.EXTERNAL_UNSPECIFIED),
                                         ("mooncake://127.0.0.1:50051?metadata=x", S.EXTERNAL_UNSPECIFIED)])
def test_l3_label_is_disk_for_local_stores_only(url, source):
    assert l3_source(url) is source


def test_l3_label_rejects_a_non_string():
    with pytest.raises(TypeError, match="url"):
        l3_source(None)


def test_first_load_is_disk_the_repeat_is_host():
    src = TierView([FULL, SWA], HostPageIndex(PAGE, 64 * PAGE, 64), S.DISK)
    assert _load(src, "a", 384) == {S.DISK: 384}  # L2 empty: all from L3, which fills L2
    assert _load(src, "a", 384) == {S.HOST: 384}
    # a longer prompt over the same prefix: the new pages (and the new window) from L3
    assert _load(src, "a", 512) == {S.DISK: 128, S.HOST: 384}


def test_saved_pages_are_host_and_without_l2_every_hit_is_l3s():
    src = TierView([FULL, SWA], HostPageIndex(PAGE, 64 * PAGE, 64), S.DISK)
    src.on_save({0: ([1, 2, 3], _keys("bf", 3)), 1: ([7, 8], _keys("bs", 6)[4:6])})
    assert _load(src, "b", 192) == {S.HOST: 192}
    none = TierView([FULL, SWA], None, S.EXTERNAL_UNSPECIFIED)
    assert _load(none, "b", 192) == {S.EXTERNAL_UNSPECIFIED: 192}
    assert none.on_load({}, 64, 64) == {}


def test_a_hit_past_a_local_hit_counts_only_its_own_tokens():
    src = TierView([FULL, SWA], HostPageIndex(PAGE, 64 * PAGE, 64), S.DISK)
    split = _load(src, "c", 384, start=128)
    assert split == {S.DISK: 256}


def test_the_mirror_evicts_as_the_workers_l2_does():
    """Same operations, same budget: the mirror holds exactly what the worker's L2 holds,
    also after evictions."""
    budget = 6 * PAGE
    worker, mirror = HostPageCache(PAGE, budget, 64), HostPageIndex(PAGE, budget, 64)
    rows = torch.zeros((4, PAGE), dtype=torch.uint8)
    for tag in ("x", "y", "z"):  # 12 full pages into room for 6
        keys = _keys(tag, 4)
        worker.store(False, keys, rows)
        mirror.admit(False, keys)
        worker.lookup(False, _keys("x", 2))  # the worker reads x0, x1 again: recently used
        mirror.lookup(False, _keys("x", 2))
    every = _keys("x", 4) + _keys("y", 4) + _keys("z", 4)
    held = (worker.lookup(False, every) >= 0).tolist()
    assert held == (mirror.lookup(False, every) >= 0).tolist()
    assert 0 < sum(held) < len(every)  # something was evicted, not everything



def test_plain_windows_displace_only_plain_windows():
    """A window named ``plain`` enters the plain class and makes room only from older plain
    windows (as in the core's L2): with the budget full of full pages and anchors it is
    not stored, and nothing is evicted for it; an anchor window is stored (a full page goes)."""
    for index in (HostPageIndex(PAGE, 4 * PAGE, 64), HostPageCache(PAGE, 4 * PAGE, 64).index):
        index.admit(False, _keys("f", 3))
        index.admit(True, _keys("a", 1), [b"f2"])  # based on a held full page: an anchor
        assert index.tier.num_anchored_swa_pages == 1 and index.tier.num_full_pages == 3
        idx, _ = index.admit(True, _keys("p", 1), [b"f1"], plain=set(_keys("p", 1)))
        assert idx.size == 0 and index.tier.num_full_pages == 3 and index.tier.num_swa_pages == 1
        idx, _ = index.admit(True, _keys("b", 1), [b"f2"])
        assert idx.size == 1 and index.tier.num_full_pages == 2 and index.tier.num_anchored_swa_pages == 2
        index.demote(_keys("a", 1))  # a plain window now: the next plain one displaces it
        idx, _ = index.admit(True, _keys("p", 1), [b"f2"], plain=set(_keys("p", 1)))
        assert idx.size == 1 and index.anchored(_keys("p", 1)) == [] and index.held(True, _keys("a", 1)).tolist() == [False]


class _Probe:
    def __init__(self, there: set[bytes]) -> None:
        self.there, self.asked = there, []

    def __call__(self, keys: list[bytes]) -> list[bool]:
        self.asked.append(list(keys))
        return [k in self.there for k in keys]


def _view(there: set[bytes]) -> tuple[TierView, _Probe]:
    from hybridkv.tiers.index import StoreIndex
    probe = _Probe(there)
    return TierView([FULL, SWA], HostPageIndex(PAGE, 64 * PAGE, 64), S.DISK, StoreIndex(probe)), probe


def test_a_lookup_probes_the_store_once_per_unknown_key():
    """The tiers' record answers for keys saved here, held in L2 or probed before; only
    keys with no answer reach the store's exists, in one call for all groups."""
    view, probe = _view(set(_keys("pf", 4)))
    got = view.present({0: _keys("pf", 6), 1: _keys("ps", 2)})
    assert got[0].tolist() == [True] * 4 + [False] * 2 and got[1].tolist() == [False, False]
    assert len(probe.asked) == 1 and len(probe.asked[0]) == 8
    view.present({0: _keys("pf", 6), 1: _keys("ps", 2)})  # the same prompt again
    assert len(probe.asked) == 1
    view.on_save({0: ([9], _keys("qf", 1)), 1: ([3], _keys("qs", 1))})  # saved here: queued, in L2
    got = view.present({0: _keys("qf", 1), 1: _keys("qs", 1)})
    assert got[0].tolist() == [True] and got[1].tolist() == [True] and len(probe.asked) == 1
    assert view.saved_or_queued(_keys("qf", 1)[0]) and not view.saved_or_queued(b"never")


def test_a_failed_load_leaves_the_record_absent_not_looping():
    """A save the worker dropped: the mirror and the record said present, the load failed.
    The keys leave both, so the next lookup does not plan the same failing load."""
    view, probe = _view(set())
    keys = {0: _keys("rf", 2), 1: _keys("rs", 1)}
    view.on_save({0: ([1, 2], keys[0]), 1: ([5], keys[1])})
    assert all(v.all() for v in view.present(keys).values())
    view.on_load_done(keys, ok=False)
    assert not any(v.any() for v in view.present(keys).values())
    assert probe.asked == []  # absent within the TTL: not even asked
    assert (view.l2.held(False, keys[0]) == False).all()  # noqa: E712
    view.on_load_done({0: _keys("pf", 1)}, ok=True)  # a load read intact: stored
    assert view.saved_or_queued(_keys("pf", 1)[0])


def test_a_hit_touches_its_store_keys_at_most_once_per_interval():
    """Repair case 3 on the scheduler: the pages of a hit the store holds (every full
    page, the sliding group's window before the end) are touched, rate-limited."""
    view, _ = _view(set())
    full, swa = _keys("tf", 6), _keys("ts", 12)
    view.on_save({0: (list(range(6)), full), 1: (list(range(12)), swa)})
    got = view.touches({0: full, 1: swa}, 384, interval_s=30.0)
    # full pages [0, 6) and the window [320, 384) = sliding pages 10, 11
    assert got == full + swa[10:12]
    assert view.touches({0: full, 1: swa}, 384, interval_s=30.0) == []  # touched just now
    assert view.touches({0: _keys("unknown", 2)}, 128, interval_s=0.0) == []  # not in the store


def test_the_mirror_demotes_as_the_worker_does_before_the_jobs_stores():
    """A save job's demotion runs first on both sides: the windows it names become plain
    (given up first, before full pages) in the worker's L2 and the mirror alike;
    ``passed`` names only what the mirror holds anchored, outside the kept windows."""
    budget = 8 * PAGE
    worker, mirror = HostPageCache(PAGE, budget, 64), HostPageIndex(PAGE, budget, 64)
    src = TierView([FULL, SWA], mirror, S.DISK)
    swa = _keys("s", 8)
    src.on_save({1: ([0] * 6, swa[:6])})
    worker.store(True, swa[:6], torch.zeros((6, PAGE), dtype=torch.uint8))
    # a request ending at 256 tokens (page 8), hit at 128: pages 2-3 and 6-7 are kept
    demote = src.passed({0: _keys("f", 4), 1: swa}, 256, [256, 128])
    assert demote == swa[:2] + swa[4:6]  # 6 and 7 are not held
    src.on_save({0: ([0, 0], _keys("f", 2))}, demote)
    assert worker.demote(demote) == 4
    worker.store(False, _keys("f", 2), torch.zeros((2, PAGE), dtype=torch.uint8))
    for tier in (worker.tier, mirror.tier):
        assert tier.anchored_swa(swa[:6]).tolist() == [False, False, True, True, False, False]
    assert list(worker.tier._swa) == list(mirror.tier._swa) == demote  # same LRU order
    assert src.passed({1: swa}, 256, [256, 128]) == []  # nothing anchored is left to demote
    assert TierView([FULL, SWA], None, S.DISK).passed({1: swa}, 256, []) == []  # no L2
