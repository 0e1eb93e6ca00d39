"""HostTier's public read of its full-KV index."""

from __future__ import annotations

import numpy as np
import pytest

from hybridkv.spec import ModelSpec
from hybridkv.tiers.host import HostTier


def test_full_keys_lists_stored_full_pages_lru_first_and_is_a_copy():
    spec = ModelSpec.preset("mimo-v2.5", page_size=4)
    host = HostTier(spec, 4 * spec.bytes_per_page("full") + 4 * spec.bytes_per_page("swa"))
    assert host.full_keys() == []
    f, _ = host.alloc(3, 0)
    keys = [bytes([i]) * 16 for i in range(3)]
    host.insert_full(keys, f)
    assert host.full_keys() == keys
    host.lookup_full(keys[:1], touch=True)  # a touched key becomes most recent
    got = host.full_keys()
    assert got == keys[1:] + keys[:1]
    got.clear()
    assert host.num_full_pages == 3 and len(host.full_keys()) == 3
    host.check_invariants()


@pytest.mark.parametrize("bad", [True, 1.5, "8"])
def test_budget_bytes_must_be_an_int(bad):
    spec = ModelSpec.preset("mimo-v2.5", page_size=4)
    with pytest.raises(TypeError, match="budget_bytes must be an int"):
        HostTier(spec, bad)


def test_budget_bytes_accepts_numpy_ints():
    spec = ModelSpec.preset("mimo-v2.5", page_size=4)
    host = HostTier(spec, np.int64(4 * spec.bytes_per_page("full")))
    assert host.alloc(4, 0) is not None


def test_discard_drops_keys_and_frees_their_pages():
    spec = ModelSpec.preset("mimo-v2.5", page_size=4)
    tier = HostTier(spec, 3 * spec.bytes_per_page("full") + 2 * spec.bytes_per_page("swa"))
    tier.insert_full([b"a", b"b", b"c"], tier.alloc(3, 0)[0])
    tier.insert_swa([b"s1", b"s2"], tier.alloc(0, 2)[1], np.array([True, False]))
    assert tier.discard([b"b", b"zz"]) == 1  # an absent key is ignored
    assert tier.lookup_full([b"a", b"b", b"c"]).tolist()[1] == -1
    assert tier.discard([b"s1", b"s2"], swa=True) == 2
    assert (tier.lookup_swa([b"s1", b"s2"]) == -1).all()
    assert (tier.num_full_pages, tier.num_swa_pages) == (2, 0)
    tier.check_invariants()
    got = tier.alloc(1, 0)  # the discarded page is free again: no eviction needed
    assert got is not None and tier.lookup_full([b"a", b"c"]).min() >= 0


def test_plain_swa_makes_room_only_from_older_plain_swa():
    """Storing a plain SWA page (it ends no kept window, L2 drops it first) may displace
    older plain SWA but never full KV or an anchored window; an anchored one may."""
    spec = ModelSpec.preset("mimo-v2.5", page_size=4)
    fb, sb = spec.bytes_per_page("full"), spec.bytes_per_page("swa")
    tier = HostTier(spec, 2 * fb + 2 * sb)
    tier.insert_full([b"f1", b"f2"], tier.alloc(2, 0)[0])
    tier.insert_swa([b"a1"], tier.alloc(0, 1)[1], np.array([True]))
    tier.insert_swa([b"p1"], tier.alloc(0, 1)[1], np.array([False]))
    got = tier.alloc(0, 1, plain_only=True)  # room from the older plain SWA page only
    assert got is not None and tier.lookup_swa([b"p1"])[0] == -1
    tier.insert_swa([b"p2"], got[1], np.array([False]))
    assert tier.alloc(0, 2, plain_only=True) is None  # one plain page cannot make room for two
    assert (tier.lookup_full([b"f1", b"f2"]) >= 0).all() and tier.lookup_swa([b"a1"])[0] >= 0
    got = tier.alloc(0, 2)  # without the restriction full KV goes
    assert got is not None and (tier.lookup_full([b"f1", b"f2"]) < 0).any()
    tier.free(*got)
    tier.check_invariants()


class _PerVictim(HostTier):
    """The reference: the eviction freeing each victim before the next shortfall
    (how :meth:`HostTier.alloc` ran before it gathered its victims' pages)."""

    def alloc(self, n_full, n_swa, protect=(), protect_swa=(), *, plain_only=False):
        got = self.pool.alloc(n_full, n_swa)
        if got is not None:
            return got
        pf, ps = set(int(p) for p in protect), set(int(p) for p in protect_swa)
        stages = ("swa", "copy", "full", "anchor") if self.l1_copies_first else ("swa", "full", "anchor")
        for stage in ("swa",) if plain_only else stages:
            frees_full = stage in ("copy", "full")  # else a stage of SWA pages
            while not self.pool.can_alloc(n_full, n_swa):
                short = self.pool.shortfall(n_full, n_swa)  # what is missing now: pages were freed
                if not (short[0 if frees_full else 1] or short[2]) or self._evict(stage, pf, ps, limit=1) != 1:
                    break
        return self.pool.alloc(n_full, n_swa)


def _state(tier: HostTier) -> tuple:
    return (tier.full_keys(), list(tier._swa.items()), list(tier._anchor.items()), dict(tier.counters),
            tier.pool.full.num_free, tier.pool.swa.num_free, tier.pool.free_bytes())


@pytest.mark.parametrize("two_windows", [False, True], ids=["one-window", "two-windows"])
@pytest.mark.parametrize("copies_first", [False, True])
def test_eviction_gathers_its_victims_and_picks_those_a_free_per_victim_picks(two_windows, copies_first):
    """Random stores, touches, protected loads and L1 marks on a tight L2, the same
    on both: after every step the index, the counters, the pool's free pages and
    bytes, and every page id handed out are the reference's."""
    from hybridkv.eval.model.reference import tiny_spec, tiny_two_window_spec

    spec = tiny_two_window_spec() if two_windows else tiny_spec()
    budget = 12 * spec.bytes_per_page("full") + 5 * spec.bytes_per_page("swa")
    tiers = [cls(spec, budget) for cls in (HostTier, _PerVictim)]
    freed: list[list] = [[], []]
    for tier, log in zip(tiers, freed):
        tier.l1_copies_first = copies_first
        tier.free_listeners.append(lambda kind, pages, log=log: log.append((kind, pages.tolist())))
    rng = np.random.default_rng(7)
    keys = [bytes([i]) * 16 for i in range(64)]
    marked: list[bytes] = []  # keys told to both as held by L1 (once per mark)
    for step in range(600):
        op, i = int(rng.integers(0, 5)), int(rng.integers(1, 56))
        nf, ns = int(rng.integers(0, 4)), int(rng.integers(0, 3))
        plain, anchored = bool(rng.integers(0, 8) == 0), rng.integers(0, 2, ns) == 1
        outs = []
        if op == 2:
            marked += [k for k in keys[i:i + 3] if k in tiers[0]]
        for tier in tiers:
            if op == 0:  # a store of nf full pages from key i on, with ns windows on them
                held = tier.lookup_full(keys[i:i + 8])
                protect = held[held >= 0][:2].tolist()  # a load reads these meanwhile
                got = tier.alloc(nf, ns, protect=protect, plain_only=plain)
                outs.append(None if got is None else (got[0].tolist(), got[1].tolist()))
                if got is None:
                    continue
                new = [j for j in range(nf) if keys[i + j] not in tier]
                tier.insert_full([keys[i + j] for j in new], got[0][:len(new)], [keys[i + j - 1] for j in new])
                tier.free(got[0][len(new):], got[1][:0])
                fresh = [j for j in range(ns) if tier.lookup_swa([b"s" + keys[i + j]])[0] < 0]
                tier.insert_swa([b"s" + keys[i + j] for j in fresh], got[1][fresh], anchored[fresh],
                                [keys[i + j] for j in fresh])
                tier.free(got[0][:0], np.delete(got[1], fresh))
            elif op == 1:
                tier.lookup_full(keys[i:i + 4], touch=True)
            elif op == 2:
                tier.mark_l1(marked[len(marked) - len([k for k in keys[i:i + 3] if k in tiers[0]]):], True)
            elif op == 3 and marked:
                tier.mark_l1(marked[-1:], False)
            elif op == 4:  # room made for pages that are then not stored (a failed copy)
                got = tier.alloc(nf, ns)
                outs.append(got is not None)
                if got is not None:
                    tier.free(*got)
        if op == 3 and marked:
            marked.pop()
        assert len(outs) in (0, 2) and (not outs or outs[0] == outs[1]), (step, op, outs)
        assert _state(tiers[0]) == _state(tiers[1]), (step, op)
        for tier in tiers:
            tier.check_invariants()
    assert tiers[0].counters["evicted_full_pages"] > 20 and tiers[0].counters["evicted_swa_pages"] > 20
    assert sorted(p for _, ps in freed[0] for p in ps) == sorted(p for _, ps in freed[1] for p in ps)


def test_a_listener_failing_on_full_pages_still_lets_the_evicted_swa_pages_go():
    """A free listener that raises for the full victims (their queued L3 writes could
    not be encoded) keeps those pages out of the pool (their data may still be read),
    but the SWA victims of the same eviction are freed."""
    spec = ModelSpec.preset("mimo-v2.5", page_size=4)
    tier = HostTier(spec, 3 * spec.bytes_per_page("full") + 2 * spec.bytes_per_page("swa"))
    f, s = tier.alloc(3, 2)
    tier.insert_full([b"a", b"b", b"c"], f)
    tier.insert_swa([b"s1", b"s2"], s, np.array([False, False]))

    def fail_full(kind, pages):
        if kind.name == "FULL":
            raise RuntimeError("encode failed")

    tier.free_listeners.append(fail_full)
    with pytest.raises(RuntimeError, match="encode failed"):
        tier.alloc(3, 2)  # needs every page: plain SWA goes first, then full KV
    assert tier.pool.swa.num_used == 0 and tier.pool.full.num_used == 3
    assert tier.num_full_pages == 0 and tier.num_swa_pages == 0
