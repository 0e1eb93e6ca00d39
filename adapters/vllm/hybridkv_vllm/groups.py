"""What the connector reads from vLLM's KV-cache config: its groups and the
fingerprint of each group's stored pages.

A page key chains a group's fingerprint (:func:`hybridkv.tiers.keys.model_fingerprint`
over the model, the group's window, layers, block size, KV heads, head sizes and
dtype), so pages of two groups, or of two models, never share a key.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from hybridkv.tiers.keys import model_fingerprint

from .plan import GroupInfo

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["fingerprints", "groups_from_config"]


def groups_from_config(kv_cache_config: KVCacheConfig) -> list[GroupInfo]:
    """One :class:`.plan.GroupInfo` per KV-cache group, in vLLM's order.  O(groups).

    Raises ``TypeError`` for a group that is neither full attention nor
    sliding window.
    """
    groups = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            window: int | None = int(spec.sliding_window)
        elif isinstance(spec, FullAttentionSpec):
            # With the hybrid manager off, vLLM keeps SWA layers' KV for every
            # token (FullAttentionSpec with sliding_window set): all pages are valid.
            window = None
        else:
            raise TypeError(f"HybridKVConnector: KV-cache group {i} has unsupported spec "
                             f"{type(spec).__name__} (full attention and sliding window only)")
        # Groups may differ in block size (vLLM equalises page bytes: MiMo-V2's
        # full group gets 64-token blocks, its SWA groups 32): keys and block
        # ids of a group are always at its own block size.
        groups.append(GroupInfo(i, window, tuple(g.layer_names), int(spec.block_size)))
    return groups


def fingerprints(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 groups: list[GroupInfo], model_id: str) -> dict[int, str]:
    """Per group index, the fingerprint its page keys chain.  ``model_id``
    empty: the model's name from its config (last path component).  O(groups)."""
    if not model_id:
        hf = vllm_config.model_config.hf_config
        model_id = os.path.basename(str(getattr(hf, "_name_or_path", "") or
                                        vllm_config.model_config.model).rstrip("/"))
    out = {}
    for g in groups:
        spec = kv_cache_config.kv_cache_groups[g.index].kv_cache_spec
        desc = {"model": model_id, "group": g.index, "window": g.window,
                "layers": list(g.layer_names), "block_size": spec.block_size,
                "kv_heads": getattr(spec, "num_kv_heads", None),
                "head_size": getattr(spec, "head_size", None),
                "head_size_v": getattr(spec, "head_size_v", None),
                "dtype": str(getattr(spec, "dtype", ""))}
        out[g.index] = model_fingerprint(desc, "swa" if g.is_swa else "full")
    return out
