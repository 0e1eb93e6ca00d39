"""SGLang 0.5.23's HiCache (host KV tier) driven on CPU, with the content oracle.

In 0.5.23 there is no ``HiRadixCache`` class any more: ``--enable-hierarchical-cache``
makes ``registry.create_unified_radix_cache`` build a ``UnifiedRadixCache`` and
call ``cache.init_hicache(server_args, params)``, which (for an ``SWAKVPool``
with FULL + SWA components: ``hybrid_pool_assembler._SwaStrategy``) attaches a
``HostPoolGroup`` of two ``MHATokenToKVPoolHost`` (full KV and SWA KV) and a
``HybridCacheController``.  This module does exactly that over the pools of
:mod:`sglang_flow` and moves requests through the scheduler's HiCache calls:

* ``Req.init_next_round_input`` (match: device ``prefix_len`` plus
  ``host_hit_length`` / ``swa_host_hit_length`` of host-backed nodes);
* when ``req.needs_host_load_back()``: ``tree_cache.init_load_back`` (as
  ``PrefillAdder.add_one_req`` calls it), then ``ready_to_load_host_cache``
  (the scheduler's ``start_loading`` before the forward);
* ``check_hicache_events`` before every step (write-through acks, load acks,
  pending backups), as ``Scheduler`` does each iteration.

Test-side shim (the only one; see ``benchmarks/peers/hicache_on_cpu.md``):

* :func:`host_pools_unpinned` builds the host pools with ``pin_memory=False``.
  ``MHATokenToKVPoolHost`` exposes that flag (default True) but the assembler
  never passes it; with True, ``pool_host.common.alloc_with_host_register``
  calls ``torch.cuda.cudart()`` (``cudaHostRegister``), which a CPU torch
  refuses.  Pinning only makes H2D/D2H copies asynchronous-capable; the data
  path (``io_backend="direct"``: SGLang's own torch index-copy transfers) is
  unchanged.

Streams and events need no shim: on a machine without an accelerator SGLang's
``get_device_module()`` is ``torch.cpu``, whose ``Stream``/``Event`` are
synchronous stand-ins, so every transfer has finished when it is submitted.
``io_backend="kernel"`` (SGLang's default) needs CUDA/JIT transfer kernels and
is not used here.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterator

import numpy as np

from sglang_flow import Driver, Pools, PseudoHitError, _Live

IO_BACKEND = "direct"  # SGLang's torch-indexing transfer path (no CUDA kernels)
MEM_LAYOUT = "layer_first"


def hicache_server_args(ratio: float, write_policy: str = "write_through") -> dict:
    """The memory fields ``--enable-hierarchical-cache --hicache-ratio R`` set."""
    return dict(enable_hierarchical_cache=True, hicache_ratio=float(ratio), hicache_size=0,
                hicache_write_policy=write_policy, hicache_io_backend=IO_BACKEND,
                hicache_mem_layout=MEM_LAYOUT, hicache_storage_backend=None)


def cpu_transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size: int) -> None:
    """CPU stand-in for ``sgl_kernel.kvcacheio.transfer_kv_direct`` (the op
    ``io_backend="direct"`` uses with the ``layer_first`` host layout), written
    from the op's contract: for every layer, page ``i`` of the indices is
    copied as the ``page_size`` rows starting at its first index
    (``dst[d0:d0+P] = src[s0:s0+P]``).  The op copies whole pages from their
    first index; this does the same, and checks that each page's indices are
    indeed consecutive so a malformed transfer fails loudly."""
    import torch

    assert len(src_layers) == len(dst_layers), "source and destination layer counts differ"
    assert src_indices.numel() == dst_indices.numel(), "source and destination index counts differ"
    n = src_indices.numel()
    if n == 0:
        return
    assert page_size > 0 and n % page_size == 0, f"{n} indices are not whole pages of {page_size}"
    src = src_indices.to("cpu", torch.int64).view(-1, page_size)
    dst = dst_indices.to("cpu", torch.int64).view(-1, page_size)
    step = torch.arange(page_size, dtype=torch.int64)
    for idx in (src, dst):
        assert bool((idx == idx[:, :1] + step).all()), "a page's indices are not consecutive"
    src_rows, dst_rows = src[:, :1] + step, dst[:, :1] + step
    for s, d in zip(src_layers, dst_layers):
        d[dst_rows.reshape(-1)] = s[src_rows.reshape(-1)].to(d.device)


@contextlib.contextmanager
def cpu_transfer_ops() -> Iterator[None]:
    """Bind :func:`cpu_transfer_kv_direct` where ``pool_host.mha`` looks it up
    (its ``sgl_kernel.kvcacheio`` import runs only on CUDA/ROCm)."""
    from sglang.srt.mem_cache.pool_host import mha

    missing = object()
    prev = getattr(mha, "transfer_kv_direct", missing)
    mha.transfer_kv_direct = cpu_transfer_kv_direct
    try:
        yield
    finally:
        if prev is missing:
            del mha.transfer_kv_direct
        else:
            mha.transfer_kv_direct = prev


@contextlib.contextmanager
def host_pools_unpinned() -> Iterator[None]:
    """Build SGLang's MHA host pools with ``pin_memory=False`` (see module doc)."""
    from sglang.srt.mem_cache.pool_host import mha

    cls = mha.MHATokenToKVPoolHost
    orig = cls.__init__

    @functools.wraps(orig)
    def init(self, *args, **kwargs):
        if len(args) > 5:  # pin_memory passed positionally
            args = args[:5] + (False,) + args[6:]
        else:
            kwargs["pin_memory"] = False
        return orig(self, *args, **kwargs)

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = orig


def build_hicache(pools: Pools, window: int):
    """``UnifiedRadixCache`` (FULL + SWA) with its host tier attached, as
    ``create_unified_radix_cache`` builds it under ``--enable-hierarchical-cache``.
    The HiCache server args must be published (:func:`hicache_server_args`)."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = pools.init_params(window)
    params.tree_components = (ComponentType.FULL, ComponentType.SWA)
    cache = UnifiedRadixCache(params)
    with host_pools_unpinned():
        # server_args is read only for file_storage_path with a storage backend
        cache.init_hicache(SimpleNamespace(file_storage_path=None), params)
    return cache


def host_pool_tokens(cache) -> dict[str, int]:
    """Token capacity of the full and SWA host pools."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    swa = cache.components[ComponentType.SWA]._swa_kv_pool_host
    return {"full": int(cache.cache_controller.mem_pool_host.size), "swa": int(swa.size) if swa is not None else 0}


@dataclass
class TierStats:
    device_hit_tokens: int = 0   # L1: matched on device
    host_hit_tokens: int = 0     # L2: matched on host and loaded back
    host_hit_declined: int = 0   # host hits init_load_back did not load
    load_backs: int = 0
    host_hits_verified: int = 0


class HiCacheDriver(Driver):
    """:class:`sglang_flow.Driver` plus the scheduler's HiCache calls."""

    def __init__(self, cache, pools: Pools, window: int, **kwargs) -> None:
        super().__init__(cache, pools, window, **kwargs)
        self.tiers = TierStats()

    def _admit(self, prompt: np.ndarray, n_out, extra_key) -> None:
        """:meth:`Driver._admit` (match, ``init_load_back`` between the match and the
        lock, as ``PrefillAdder.add_one_req`` orders them, content check, lock)
        after the controller's events, with the hit split by tier."""
        self.cache.check_hicache_events()
        loaded = self.stats.loaded_tokens
        super()._admit(prompt, n_out, extra_key)
        host_hit = self.stats.loaded_tokens - loaded
        if host_hit:  # Driver._admit checked the hit, loaded part included
            self.tiers.host_hits_verified += 1
        self.tiers.device_hit_tokens += self.stats.hits[-1] - host_hit
        self.tiers.host_hit_tokens += host_hit

    def _load_back(self, req) -> None:
        """``init_load_back`` + ``start_loading`` for a request with a host hit (SGLang's
        HiCache takes no pin of the device match and may load less than promised)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        promised = req.host_hit_length
        loaded = self.cache.init_load_back(InitLoadBackParams(best_match_node=req.best_match_node,
                                                              host_hit_length=promised, req=req))
        req.host_loaded_length, req.last_node = loaded
        # the scheduler starts the queued loads before every forward, loaded or not
        self.cache.ready_to_load_host_cache()
        self.cache.check_hicache_events()
        if req.host_loaded_length:
            self.tiers.load_backs += 1
        else:
            self.tiers.host_hit_declined += promised
        req.prefix_len += req.host_loaded_length
        req.kv.cache_protected_len = req.prefix_len
        self.stats.loaded_tokens += req.host_loaded_length

    def _step(self, live: _Live) -> None:
        self.cache.check_hicache_events()
        return super()._step(live)


def run_hicache(prompts, kv_bytes: int, host_bytes: int = 0, *, host_ratio: float | None = None,
                page_size: int = 64, swa_ratio: float = 0.8, write_policy: str = "write_through",
                chunk: int | None = None, max_live: int | None = None, quoted_answers: bool = True) -> dict:
    """Replay ``prompts`` through SGLang's HiCache at ``kv_bytes`` of device KV
    (split by ``--swa-full-tokens-ratio swa_ratio``, as SGLang sizes it) and
    ``host_bytes`` of host KV, both in the bytes of :mod:`equal_memory`'s
    MiMo-shaped model.  Host bytes map to ``--hicache-ratio host_bytes /
    device pool bytes`` (SGLang gives each host pool ``ratio x`` its device
    pool's tokens, plus one padding page); ``host_ratio`` gives that ratio
    directly instead.  Returns the hit tokens split by tier."""
    import equal_memory as em
    from hybridkv_sglang.split import pools_at_ratio
    from sglang.srt.runtime_context import get_context

    full, swa = pools_at_ratio(kv_bytes, em.FULL_BYTES_PER_TOKEN, em.SWA_BYTES_PER_TOKEN, swa_ratio, page_size)
    device_bytes = full * em.FULL_BYTES_PER_TOKEN + swa * em.SWA_BYTES_PER_TOKEN
    ratio = host_ratio if host_ratio is not None else host_bytes / device_bytes
    if ratio <= 0:
        raise ValueError(f"host bytes / ratio must be positive, got {host_bytes=} {host_ratio=}")
    chunk, max_live = chunk or em.CHUNK, max_live or em.MAX_LIVE
    longest = max(len(p) for p in prompts) + em.OUTPUT_TOKENS + 1
    pools = Pools(full_tokens=full, swa_tokens=swa, page_size=page_size, max_reqs=max_live + 2, max_context=longest)
    override = get_context().override_server_args(**hicache_server_args(ratio, write_policy))
    override.install()
    try:
        with cpu_transfer_ops():
            return _replay(prompts, pools, ratio, write_policy, chunk, max_live, quoted_answers,
                           dict(kv_bytes=kv_bytes, host_bytes_asked=host_bytes, swa_ratio=swa_ratio))
    finally:
        override.restore()


def _replay(prompts, pools: Pools, ratio: float, write_policy: str, chunk: int, max_live: int,
            quoted_answers: bool, head: dict) -> dict:
    import equal_memory as em

    cache = build_hicache(pools, em.WINDOW)
    host = host_pool_tokens(cache)
    driver = HiCacheDriver(cache, pools, em.WINDOW, chunk=chunk, max_live=max_live)
    outputs = em.conversation_outputs(prompts) if quoted_answers else [em.OUTPUT_TOKENS] * len(prompts)
    stats = driver.run([(p, o, None) for p, o in zip(prompts, outputs)])
    cache.check_hicache_events()
    cache.sanity_check()
    t = driver.tiers
    return {**head, "hicache_ratio": ratio, "page_size": pools.page_size, "write_policy": write_policy,
            "full_tokens": pools.full_tokens, "swa_tokens": pools.swa_tokens,
            "device_bytes": pools.full_tokens * em.FULL_BYTES_PER_TOKEN + pools.swa_tokens * em.SWA_BYTES_PER_TOKEN,
            "host_full_tokens": host["full"], "host_swa_tokens": host["swa"],
            "host_bytes": host["full"] * em.FULL_BYTES_PER_TOKEN + host["swa"] * em.SWA_BYTES_PER_TOKEN,
            "requests": stats.requests, "input_tokens": stats.input_tokens, "hit_tokens": stats.hit_tokens,
            "l1_hit_tokens": t.device_hit_tokens, "l2_hit_tokens": t.host_hit_tokens,
            "l2_declined_tokens": t.host_hit_declined, "load_backs": t.load_backs,
            "hits_verified": sum(1 for h in stats.hits if h), "l2_hits_verified": t.host_hits_verified,
            "rejected": stats.rejected, "accounting_checks": stats.checks}


__all__ = ["HiCacheDriver", "PseudoHitError", "TierStats", "build_hicache", "hicache_server_args",
           "host_pool_tokens", "host_pools_unpinned", "run_hicache", "cpu_transfer_kv_direct",
           "cpu_transfer_ops"]
