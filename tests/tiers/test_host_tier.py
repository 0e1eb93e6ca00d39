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
