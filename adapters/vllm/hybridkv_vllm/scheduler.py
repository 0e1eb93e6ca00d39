"""vLLM 0.32 schedulers whose device prefix cache is hybridkv's tree.

    python -m vllm.entrypoints.openai.api_server --model M \\
        --scheduler-cls hybridkv_vllm.scheduler.HybridKVScheduler \\
        [--additional-config '{"hybridkv": {"swa_checkpoint": 16384}}']

:class:`HybridKVScheduler` is vLLM's ``Scheduler`` (and
:class:`HybridKVAsyncScheduler` its ``AsyncScheduler``, for
``--async-scheduling``) with the ``KVCacheManager`` it builds replaced by
:class:`~hybridkv_vllm.prefix.HybridKVCacheManager` over the same block pool:
scheduling, preemption, chunked prefill, stats, KV events and connectors are
vLLM's.  Settings the tree cannot serve are refused at start-up with one line
naming the setting (:func:`check_supported`).

Options (``--additional-config '{"hybridkv": {...}}'``, or
``hybridkv_<name>`` keys of ``kv_connector_extra_config``):
``swa_checkpoint``, ``swa_release`` (``adaptive`` | ``sparse``; its old name
``retention`` is still accepted),
``spare_fraction``, ``ranking`` (see :class:`~hybridkv_vllm.prefix.PrefixOptions`).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from .blocks import OPTION_NAMES
from .prefix import HybridKVCacheManager, PrefixOptions, classify_groups

__all__ = ["HybridKVAsyncScheduler", "HybridKVScheduler", "check_supported", "options_of"]


def options_of(vllm_config: Any) -> PrefixOptions:
    """The prefix cache's options from ``additional_config["hybridkv"]`` and the
    connector's ``hybridkv_*`` extra keys (the former wins)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    additional = getattr(vllm_config, "additional_config", None)
    mine = additional.get("hybridkv", {}) if isinstance(additional, dict) else {}
    if not isinstance(mine, dict):
        raise ValueError(f"--additional-config hybridkv must be an object, got {type(mine).__name__}")
    unknown = set(mine) - set(OPTION_NAMES)
    if unknown:
        raise ValueError(f"--additional-config hybridkv: unknown option(s) {sorted(unknown)}")
    return PrefixOptions.from_extra(extra, mine)


def check_supported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raise ValueError (one line naming the setting) for what hybridkv's prefix
    cache does not support."""
    cache = vllm_config.cache_config
    if not cache.enable_prefix_caching:
        raise ValueError("hybridkv scheduler: --no-enable-prefix-caching leaves it nothing to decide; "
                         "drop --scheduler-cls or enable prefix caching")
    if vllm_config.speculative_config is not None:
        raise ValueError("hybridkv scheduler: --speculative-config (draft tokens: EAGLE, MTP, n-gram) "
                         "is not supported")
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        raise ValueError("hybridkv scheduler: --decode-context-parallel-size > 1 is not supported")
    if vllm_config.model_config.is_encoder_decoder:
        raise ValueError("hybridkv scheduler: encoder-decoder models (cross attention) are not supported")
    try:
        classify_groups(kv_cache_config)
    except ValueError as exc:
        raise ValueError(f"hybridkv scheduler: {exc}") from None


class _HybridKVMixin:
    """Swaps the scheduler's KV-cache manager for hybridkv's after vLLM built it."""

    def _install_hybridkv(self, vllm_config: Any, kv_cache_config: Any) -> None:
        self.kv_cache_manager = HybridKVCacheManager.adopt(self.kv_cache_manager, options_of(vllm_config))
        if self.connector is not None:  # it was bound to the manager vLLM built
            self.connector.bind_kv_cache_manager(self.kv_cache_manager)

    def hybridkv_stats(self) -> dict[str, int]:
        """The prefix cache's counters and the tree's size (pages)."""
        mgr = self.kv_cache_manager
        tree = mgr.tree
        return {**mgr.counters, "tree_full_pages": tree.full_pages_cached, "tree_swa_pages": tree.swa_pages_cached,
                "tree_nodes": tree.num_nodes, "free_blocks": mgr.block_pool.get_num_free_blocks()}


class HybridKVScheduler(_HybridKVMixin, Scheduler):
    """vLLM's ``Scheduler`` with hybridkv's tree as its device prefix cache."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        check_supported(vllm_config, kv_cache_config)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        self._install_hybridkv(vllm_config, kv_cache_config)


class HybridKVAsyncScheduler(_HybridKVMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (``--async-scheduling``) with hybridkv's tree."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        check_supported(vllm_config, kv_cache_config)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        self._install_hybridkv(vllm_config, kv_cache_config)
