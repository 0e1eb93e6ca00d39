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
    """SGLang ``RadixCacheFactory``: build the cache from a ``TreeCacheBuildContext``."""
    from .radix_cache import HybridKVRadixCache

    if not ctx.is_hybrid_swa:
        raise ValueError("--radix-cache-backend hybridkv needs a hybrid sliding-window model "
                         "(SGLang reported is_hybrid_swa=False)")
    if ctx.is_hybrid_ssm:
        raise ValueError("--radix-cache-backend hybridkv does not handle mamba state")
    if ctx.enable_hierarchical_cache:
        raise ValueError("--radix-cache-backend hybridkv does not drive SGLang's HiCache host tier; "
                         "use hybridkv's HiCache storage backend with the default radix cache instead")
    if ctx.disable_radix_cache:
        ctx.params.disable = True
    return HybridKVRadixCache(ctx.params)


def register() -> None:
    """Register ``hybridkv`` in SGLang's radix-cache registry (idempotent)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, create_hybridkv_radix_cache)
