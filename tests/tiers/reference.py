"""Tiered caches over the tiny reference model, for tests that verify every hit's
tokens (test helper): the model, a cache, random prompts, a verified run."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridkv import CacheConfig
from hybridkv.eval.model.reference import ReferenceModel, tiny_spec
from hybridkv.eval.model.verify import verify_requests
from hybridkv.tiers.tiered import TierConfig, TieredCache

torch.set_num_threads(1)
SPEC = tiny_spec()
MODEL = ReferenceModel(SPEC, seed=0)
FPB, SPB = SPEC.bytes_per_page("full"), SPEC.bytes_per_page("swa")


def tiered(l3: Any, *, l1_pages: int = 60, l2_pages: int = 200, **kw: Any) -> TieredCache:
    """A CPU cache of ``l1_pages`` with an L2 of ``l2_pages`` and L3 ``l3``."""
    return TieredCache(SPEC, CacheConfig(budget_bytes=l1_pages * (FPB + SPB), device="cpu"),
                       tiers=TierConfig(l2_bytes=l2_pages * (FPB + SPB), l3=l3, **kw))


def prompts(n: int, seed: int, length: int = 41) -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [("default", rng.integers(0, 64, length).astype(np.int32)) for _ in range(n)]


def run(cache: TieredCache, ps: list) -> dict[str, Any]:
    """Serve ``ps`` (prefill only), every hit's tokens checked; invariants after."""
    out = verify_requests(ps, cache, MODEL, decode_tokens=0)
    assert out["mismatched_requests"] == 0, out
    cache.check_invariants()
    return out


def drop_l1_and_l2(cache: TieredCache) -> None:
    """Evict all L1 can give and clear L2: what comes back comes from L3."""
    cache.tree.evict(full_pages=cache.tree.evictable_full_pages(), swa_pages=cache.tree.evictable_swa_pages())
    cache.clear_l2()
