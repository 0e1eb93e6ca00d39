"""Block gather/scatter against vLLM-shaped tensors and the L3 file backend."""

from __future__ import annotations

import torch

from hybridkv.tiers.keys import page_keys
from hybridkv.tiers.storage import open_backend
from hybridkv_vllm.kvio import GroupBuffers, as_np_tokens, load_pages, save_pages


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
    assert save_pages(be, gs, keys, [2, 5]) == (2, 0)
    assert save_pages(be, gs, keys, [2, 5]) == (0, 2)  # existing keys are not rewritten
    assert load_pages(be, gd, keys, [0, 9])
    assert torch.equal(dst["a"][0], src["a"][2]) and torch.equal(dst["b"][:, 9], src["b"][:, 5])


def test_missing_page_loads_nothing(tmp_path) -> None:
    be = open_backend(f"file:{tmp_path / 'l3'}")
    keys = page_keys(as_np_tokens(list(range(96))), 32, namespace="t", fingerprint="f")
    src, dst = _caches(seed=5), _caches(seed=6)
    gs, gd = GroupBuffers(src, ["a"], 10), GroupBuffers(dst, ["a"], 10)
    save_pages(be, gs, keys[:2], [1, 2])
    before = dst["a"].clone()
    assert not load_pages(be, gd, keys, [3, 4, 5])  # third page was never stored
    assert torch.equal(dst["a"], before)
