"""Block gather/scatter against vLLM-shaped tensors and the L3 file backend."""

from __future__ import annotations

import torch
from hybridkv_vllm.kvio import GroupBuffers, as_np_tokens, load_pages, save_pages
from hybridkv_vllm.l2 import HostPageCache

from hybridkv.tiers.keys import page_keys
from hybridkv.tiers.storage import open_backend


def _caches(num_blocks: int = 10, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # CPU backend layout [num_blocks, kv_heads, block, 2 * head] and a block-dim-1 layout
    return {"a": torch.randn(num_blocks, 2, 32, 64, generator=g),
            "b": torch.randn(2, num_blocks, 32, 1, 32, generator=g)}


def test_gather_scatter_roundtrip() -> None:
    src, dst = _caches(seed=1), _caches(seed=2)
    gs, gd = GroupBuffers(src, ["a", "b"], 10), GroupBuffers(dst, ["b", "a"], 10)
    rows = gs.gather([3, 7])
    assert rows.shape == (2, gs.page_elems)
    gd.scatter(rows, [1, 4])
    assert torch.equal(dst["a"][1], src["a"][3]) and torch.equal(dst["a"][4], src["a"][7])
    assert torch.equal(dst["b"][:, 4], src["b"][:, 7])
    assert torch.equal(dst["a"][0], _caches(seed=2)["a"][0])  # untouched block


def test_save_then_load_through_file_backend(tmp_path) -> None:
    be = open_backend(f"file:{tmp_path / 'l3'}")
    keys = page_keys(as_np_tokens(list(range(64))), 32, namespace="t", fingerprint="f")
    src, dst = _caches(seed=3), _caches(seed=4)
    gs, gd = GroupBuffers(src, ["a", "b"], 10), GroupBuffers(dst, ["a", "b"], 10)
    assert save_pages(be, gs, keys, [2, 5]) == (2, 0, 0)
    assert save_pages(be, gs, keys, [2, 5]) == (0, 2, 0)  # existing keys are not rewritten
    assert load_pages(be, gd, keys, [0, 9]) == (True, 0, 2)
    assert torch.equal(dst["a"][0], src["a"][2]) and torch.equal(dst["b"][:, 9], src["b"][:, 5])


def test_missing_page_loads_nothing(tmp_path) -> None:
    be = open_backend(f"file:{tmp_path / 'l3'}")
    keys = page_keys(as_np_tokens(list(range(96))), 32, namespace="t", fingerprint="f")
    src, dst = _caches(seed=5), _caches(seed=6)
    gs, gd = GroupBuffers(src, ["a"], 10), GroupBuffers(dst, ["a"], 10)
    save_pages(be, gs, keys[:2], [1, 2])
    before = dst["a"].clone()
    assert load_pages(be, gd, keys, [3, 4, 5])[0] is False  # third page was never stored
    assert torch.equal(dst["a"], before)


def test_l2_in_front_of_l3(tmp_path) -> None:
    """Saves land in L2 and L3; loads read L2 first, L3 for the rest, and fill L2."""
    be = open_backend(f"file:{tmp_path / 'l3'}")
    keys = page_keys(as_np_tokens(list(range(96))), 32, namespace="t", fingerprint="f")
    src = _caches(seed=7)
    gs = GroupBuffers(src, ["a", "b"], 10)
    l2 = HostPageCache(gs.page_bytes, 2 * gs.page_bytes, 64)  # room for 2 full pages
    assert save_pages(be, gs, keys[:2], [1, 2], l2) == (2, 0, 2)
    assert save_pages(be, gs, keys[2:], [3], l2) == (1, 0, 1)  # evicts the LRU page
    assert l2.lookup(False, keys).tolist()[0] == -1 and l2.stats()["evicted_full_pages"] == 1
    dst = _caches(seed=8)
    gd = GroupBuffers(dst, ["a", "b"], 10)
    assert load_pages(be, gd, keys, [4, 5, 6], l2) == (True, 2, 1)  # page 0 from L3
    for i, j in ((4, 1), (5, 2), (6, 3)):
        assert torch.equal(dst["a"][i], src["a"][j]) and torch.equal(dst["b"][:, i], src["b"][:, j])
    # SWA pages are indexed apart from full ones: same key, other kind, is a miss
    assert (l2.lookup(True, keys) == -1).all()
    # a page only L2 holds still loads (L3 lost it), and L2 bytes are the page bytes
    be.delete([keys[2]])
    dst2 = _caches(seed=9)
    gd2 = GroupBuffers(dst2, ["a", "b"], 10)
    # (the L3 read of page 0 above evicted page 1, the LRU one, from L2)
    ok, from_l2, from_l3 = load_pages(be, gd2, [keys[0], keys[2]], [0, 1], l2)
    assert ok and from_l2 == 2 and from_l3 == 0
    assert torch.equal(dst2["a"][0], src["a"][1]) and torch.equal(dst2["a"][1], src["a"][3])
    assert load_pages(be, gd2, keys[1:2], [2], l2) == (True, 0, 1)
