"""Registration with SGLang: ``--radix-cache-backend hybridkv``.

SGLang 0.5.23 runs every ``sglang.srt.plugins`` entry point in each of its
processes (``load_plugins()``) before the scheduler builds its tree cache;
this package declares :func:`register` there, so installing it is enough.
Calling :func:`register` by hand (e.g. from a launcher script) is also fine:
it is idempotent.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND_NAME", "register", "create_hybridkv_radix_cache"]

BACKEND_NAME = "hybridkv"


def create_hybridkv_radix_cache(ctx: Any) -> Any:
    """SGLang ``RadixCacheFactory``: build the cache from a ``TreeCacheBuildContext``.

    ``--enable-hierarchical-cache`` turns on hybridkv's own L2 (host) tier under
    the tree: ``--hicache-size`` (GB) or ``--hicache-ratio`` (x the device KV
    pool, default 2) sizes it, ``--hicache-write-policy`` picks write-through or
    write-back; L3 is ``$HYBRIDKV_L3`` (a hybridkv backend URL).  Refused, with
    the reason: ``--hicache-storage-backend`` (SGLang's ``HiCacheStorage`` plugs
    into SGLang's own HiCache tree, not into hybridkv's tiers).
    """
    from .radix_cache import HybridKVRadixCache
    from .tiers import tiers_from_env

    if not ctx.is_hybrid_swa:
        raise ValueError("--radix-cache-backend hybridkv needs a hybrid sliding-window model "
                         "(SGLang reported is_hybrid_swa=False)")
    if ctx.is_hybrid_ssm:
        raise ValueError("--radix-cache-backend hybridkv does not handle mamba state")
    tiers = None
    if ctx.enable_hierarchical_cache and not ctx.disable_radix_cache:
        l2_bytes, policy = _hicache_l2(ctx)
        tiers = tiers_from_env(l2_bytes=l2_bytes, write_policy=policy)
    else:
        tiers = tiers_from_env()
    if tiers is not None and tiers.l3 is not None and int(getattr(ctx, "tp_size", 1) or 1) > 1:
        raise ValueError("HYBRIDKV_L3 with --tp > 1 and --radix-cache-backend hybridkv: each rank reads its L3 "
                         "shard on its own clock, so ranks could admit different hits (SGLang's HiCache agrees "
                         "on them with a TP all-reduce this backend does not do yet); use L2 alone at --tp > 1")
    if ctx.disable_radix_cache:
        ctx.params.disable = True
    model = getattr(getattr(ctx, "model_config", None), "model_path", None) or "sglang"
    scope = f"{model}|tp{ctx.tp_rank}/{ctx.tp_size}|pp{ctx.params.pp_rank}/{ctx.params.pp_size}"
    counter = _layer_counter(ctx) if tiers is not None and ctx.enable_hierarchical_cache else None
    return HybridKVRadixCache(ctx.params, tiers=tiers, tier_scope=scope, layer_counter=counter)


def _layer_counter(ctx: Any) -> Any:
    """SGLang's ``LayerDoneCounter`` for layer-by-layer loads, registered as
    HiCache registers its own: with the KV pool (whose ``get_key_buffer`` and
    friends wait on it) and the worker (which the scheduler tells the batch's
    load).  None without a worker to register with (loads then run in
    ``init_load_back``).  Only under ``--enable-hierarchical-cache``: the
    scheduler calls ``ready_to_load_host_cache`` only then."""
    from sglang.srt.managers.cache_controller import LayerDoneCounter

    worker = getattr(ctx, "tp_worker", None)
    if worker is None or not hasattr(worker, "register_hicache_layer_transfer_counter"):
        return None
    kv = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    counter = LayerDoneCounter(int(kv.layer_num))
    kv.register_layer_transfer_counter(counter)
    worker.register_hicache_layer_transfer_counter(counter)
    return counter


def _hicache_l2(ctx: Any) -> tuple[int, str]:
    """L2 bytes and write policy from SGLang's ``--hicache-*`` flags (ValueError
    for the combinations hybridkv's tiers cannot serve)."""
    args = ctx.server_args
    if args is None:
        from sglang.srt.runtime_context import get_memory

        args = get_memory()
    if getattr(args, "hicache_storage_backend", None):
        raise ValueError("--hicache-storage-backend with --radix-cache-backend hybridkv: SGLang's HiCacheStorage "
                         "backends plug into SGLang's own HiCache tree; hybridkv's L3 is set with "
                         "HYBRIDKV_L3=<url> (file://, redis://, mooncake://, nixl://)")
    policy = getattr(args, "hicache_write_policy", None) or "write_through"
    if policy == "write_through_selective":  # hybridkv writes through whole requests
        policy = "write_through"
    size_gb = float(getattr(args, "hicache_size", 0) or 0)
    if size_gb > 0:
        return int(size_gb * (1 << 30)), policy
    ratio = getattr(args, "hicache_ratio", None)
    if ratio is None:  # SGLang's auto-sizing (auto_size_hicache) publishes its choice
        from sglang.srt.runtime_context import get_memory

        ratio = getattr(get_memory(), "hicache_ratio", None)
    ratio = 2.0 if ratio is None else float(ratio)
    if ratio <= 0:
        raise ValueError(f"--hicache-ratio must be > 0, got {ratio}")
    device = sum(ctx.params.token_to_kv_pool_allocator.get_kvcache().get_kv_size_bytes())
    return max(1, int(device * ratio)), policy


def register() -> None:
    """Register ``hybridkv`` in SGLang's radix-cache registry (idempotent)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, create_hybridkv_radix_cache)
