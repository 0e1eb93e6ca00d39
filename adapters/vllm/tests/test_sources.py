"""The connector's hits by source (``vllm:prompt_tokens_cached_by_source``): L2 pages are
``host``, a file L3's are ``disk``, and L2's one index (the scheduler's) names the rows
the workers read and write (no server: :class:`hybridkv_vllm.sources.TierView` alone)."""

from __future__ import annotations

import pytest
from hybridkv_vllm.l2 import HostPageIndex
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
                        1: (swa, [_keys(tag + "s", end // 32)[i] for i in swa])}, start, end)[0]


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
    assert none.on_load({}, 64, 64) == ({}, {})


def test_a_hit_past_a_local_hit_counts_only_its_own_tokens():
    src = TierView([FULL, SWA], HostPageIndex(PAGE, 64 * PAGE, 64), S.DISK)
    split = _load(src, "c", 384, start=128)
    assert split == {S.DISK: 256}


def test_a_load_names_the_rows_to_read_and_the_rows_to_fill():
    """The slots a load returns: the row L2 holds a key in (the worker reads it), the
    row L2 admits a missing key to (the worker copies its L3 read in), ``-1`` where
    L2 has no room; a save's slots name only the pages it stores anew."""
    view = TierView([FULL, SWA], HostPageIndex(PAGE, 4 * PAGE, 64), S.DISK)
    saved = view.on_save({0: ([1, 2], _keys("f", 2))})[0]
    assert sorted(saved) == [0, 1]
    assert view.on_save({0: ([1, 2], _keys("f", 2))}) == {0: [-1, -1]}  # held: only touched
    split, slots = view.on_load({0: ([0, 1, 2], _keys("f", 3))}, 0, 192)
    assert split == {S.HOST: 128, S.DISK: 64}
    assert slots[0][:2] == saved and slots[0][2] not in saved and 0 <= slots[0][2] < 4
    _, again = view.on_load({0: ([0, 1, 2], _keys("f", 3))}, 0, 192)
    assert again == slots  # now all held, in the same rows
    view.l2.tier.alloc(1, 0)  # the last free row goes: admitting g0 evicts the LRU page (f0)
    _, other = view.on_load({0: ([0], _keys("g", 1))}, 0, 64)
    assert other[0] == [saved[0]] and view.l2.held(False, _keys("f", 1)).tolist() == [False]


def test_plain_windows_displace_only_plain_windows():
    """A window named ``plain`` enters the plain class and makes room only from older plain
    windows (as in the core's L2): with the budget full of full pages and anchors it is
    not stored, and nothing is evicted for it; an anchor window is stored (a full page goes)."""
    for index in (HostPageIndex(PAGE, 4 * PAGE, 64),):
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


def test_a_lookup_probes_the_store_only_as_far_as_its_hit_can_reach():
    """The tiers' record answers for keys saved here, held in L2 or probed before; the
    store is asked about the other full pages up to the first absent one, and about the
    sliding group's pages from there down only as far as the best window needs: a miss
    costs one probe of a few keys, not every page of every group."""
    # 8 full pages (512 tokens) stored, the sliding pages of the window before 512
    view, probe = _view(set(_keys("pf", 8)) | set(_keys("ps", 16)[14:16]))
    keys = {0: _keys("pf", 12), 1: _keys("ps", 24)}  # a 768-token prompt
    assert view.hit(keys, 0, 768, 64) == 512
    # the full pages up to the first absent one (one chunk of 12), then the sliding pages
    # covering [384, 512): a window and a unit below the full pages' end
    assert [len(a) for a in probe.asked] == [12, 4]
    assert view.hit(keys, 0, 768, 64) == 512 and len(probe.asked) == 2  # answered from the record
    assert view.hit({0: _keys("new", 12), 1: _keys("nws", 24)}, 0, 768, 64) == 0  # a new prompt
    assert [len(a) for a in probe.asked] == [12, 4, 12]
    # below the engine's own hit nothing is asked
    assert view.hit(keys, 256, 768, 64) == 512 and len(probe.asked) == 3
    view.on_save({0: ([9], _keys("qf", 1)), 1: ([3, 4], _keys("qs", 2))})  # saved here: queued, in L2
    assert view.hit({0: _keys("qf", 1), 1: _keys("qs", 2)}, 0, 64, 64) == 64 and len(probe.asked) == 3
    assert view.saved_or_queued(_keys("qf", 1)[0]) and not view.saved_or_queued(b"never")


@pytest.mark.parametrize("seed", range(40))
def test_a_lookup_hits_as_if_it_asked_every_key(seed):
    """Whatever the store holds (full pages with holes, sliding pages here and there, some
    in L2, an engine hit below), the hit equals window_safe_tokens over every key's answer."""
    import numpy as np
    from hybridkv_vllm.plan import window_safe_tokens

    rng = np.random.default_rng(seed)
    n_full = int(rng.integers(1, 40))
    full, swa = _keys(f"f{seed}-", n_full), _keys(f"s{seed}-", 2 * n_full)
    have_full = rng.random(n_full) < rng.choice([0.8, 0.97, 1.0])
    have_swa = rng.random(2 * n_full) < rng.choice([0.05, 0.3, 0.9])
    there = {k for k, h in zip(full, have_full) if h} | {k for k, h in zip(swa, have_swa) if h}
    view, probe = _view(there)
    in_l2 = [k for k, h in zip(swa, rng.random(2 * n_full) < 0.1) if h]
    if in_l2:  # a few sliding pages only L2 holds
        view.l2.admit(True, in_l2)
    local = int(rng.integers(0, n_full)) * 64 if rng.random() < 0.3 else 0
    max_tokens = n_full * 64
    got = view.hit({0: full, 1: swa}, local, max_tokens, 64)
    truth = [np.array([i < local // 64 or k in there for i, k in enumerate(full)]),
             np.array([i < local // 32 or k in there or k in set(in_l2) for i, k in enumerate(swa)])]
    assert got == window_safe_tokens(truth, [FULL, SWA], 64, local, max_tokens)
    assert sum(len(a) for a in probe.asked) <= n_full * 3  # never more than every key once


def test_a_failed_load_leaves_the_record_absent_not_looping():
    """A save the worker dropped: the mirror and the record said present, the load failed.
    The keys leave both, so the next lookup does not plan the same failing load."""
    view, probe = _view(set())
    keys = {0: _keys("rf", 2), 1: _keys("rs", 4)}
    view.on_save({0: ([1, 2], keys[0]), 1: ([5, 6, 7, 8], keys[1])})
    assert view.hit(keys, 0, 128, 64) == 128
    view.on_load_done(keys, ok=False)
    assert view.hit(keys, 0, 128, 64) == 0
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


def test_a_jobs_demotion_runs_before_its_stores():
    """A finished request's demotion runs before the next save's stores: the windows it
    names become plain (given up first, before full pages); ``passed`` names only what
    L2 holds anchored, outside the kept windows."""
    index = HostPageIndex(PAGE, 8 * PAGE, 64)
    src = TierView([FULL, SWA], index, S.DISK)
    swa = _keys("s", 8)
    src.on_save({1: ([0] * 6, swa[:6])})
    # a request ending at 256 tokens (page 8), hit at 128: pages 2-3 and 6-7 are kept
    demote = src.passed({0: _keys("f", 4), 1: swa}, 256, [256, 128])
    assert demote == swa[:2] + swa[4:6]  # 6 and 7 are not held
    assert src.demote(demote) == 4 and src.demote([]) == 0
    src.on_save({0: ([0, 0], _keys("f", 2))})
    assert index.tier.anchored_swa(swa[:6]).tolist() == [False, False, True, True, False, False]
    assert list(index.tier._swa) == demote  # plain, in the order named
    assert src.passed({1: swa}, 256, [256, 128]) == []  # nothing anchored is left to demote
    assert TierView([FULL, SWA], None, S.DISK).passed({1: swa}, 256, []) == []  # no L2
