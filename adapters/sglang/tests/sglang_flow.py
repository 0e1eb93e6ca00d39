"""Scheduler-like driver of an SGLang prefix cache on CPU, with a content oracle.

The driver builds SGLang's real SWA KV pool, SWA allocator and request-to-token
pool, creates real ``Req`` objects and moves them through the same helpers the
0.5.23 scheduler uses: ``Req.init_next_round_input`` (match), ``tree_cache.lock``,
allocation with ``evict_to_free_tokens`` under pressure, ``checkpoint_kv_cache``
between prefill chunks, ``evict_sliding_windows`` during decode and
``release_kv_cache(checkpoint=True)`` at the end.

Content oracle, in the KV itself: every token's K/V written for both layers
(through ``SWAKVPool.set_kv_buffer`` with the full slot and its SWA slot, as an
attention backend writes them) is a tag, ``prefix_hash(tokens[:pos+1])`` spread
over the 4 float32 K/V values in exact 16-bit pieces.  A hit of length L is
correct iff the tags read back from the pool's key/value buffers through the
hit's full slots for ``[0, L)`` and through the allocator's full->SWA mapping
for ``[L - W, L)`` are the request's own.  A stale, freed or reused slot shows
up as a wrong tag, so a pseudo-hit cannot pass.  After every step the pool
accounting of SGLang's own invariant checker is checked (available + evictable
+ protected + request-private == capacity).

Like the scheduler (``process_batch_result_prefill``), a request whose prefill
ended and that is not finished is checkpointed into the tree
(``checkpoint_kv_cache``) before it decodes; ``checkpoint_prefill_end=False``
turns that off (only chunk boundaries are checkpointed).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.managers.scheduler_components.pool_stats_observer import (
    kv_private_swa_tokens,
    kv_private_tokens,
)
from sglang.srt.mem_cache.allocation import get_last_loc_torch
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, InitLoadBackParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, evict_from_tree_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, ReqToTokenPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.sampling.sampling_params import SamplingParams

# 2**20 positions: kv-cache-tester's prompts reach 806,730 tokens (the first 2**18 are those of the smaller table)
_MULT = np.random.default_rng(12345).integers(1, 2**62, size=1 << 20, dtype=np.uint64) | np.uint64(1)


def prefix_hashes(tokens: np.ndarray) -> np.ndarray:
    """``h[i]`` identifies ``tokens[:i+1]`` (sum of token * per-position odd multiplier, mod 2**64)."""
    n = len(tokens)
    assert n <= _MULT.size, "sequence longer than the oracle's multiplier table"
    with np.errstate(over="ignore"):
        h = np.cumsum(tokens.astype(np.uint64) * _MULT[:n], dtype=np.uint64)
    h[h == 0] = 1  # 0 means "never written"
    return h.view(np.int64)


class _Layer:
    """What ``set_kv_buffer`` reads of an attention layer."""

    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id
        self.is_cross_attention = False


_LAYERS = (_Layer(0), _Layer(1))  # layer 0 full attention, layer 1 sliding window
_PIECES = np.array([0, 16, 32, 48], dtype=np.uint64)


def encode_tags(tags: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (``[n, 1, 2]`` float32 each) holding the 64-bit ``tags`` in 16-bit pieces."""
    pieces = ((tags.view(np.uint64)[:, None] >> _PIECES[None, :]) & np.uint64(0xFFFF)).astype(np.float32)
    kv = torch.from_numpy(pieces).view(-1, 2, 1, 2)
    return kv[:, 0].contiguous(), kv[:, 1].contiguous()


def decode_tags(k: torch.Tensor, v: torch.Tensor) -> np.ndarray:
    """Inverse of :func:`encode_tags` (int64)."""
    pieces = torch.cat([k.reshape(-1, 2), v.reshape(-1, 2)], dim=1).numpy().astype(np.uint64)
    return (pieces << _PIECES[None, :]).sum(axis=1, dtype=np.uint64).view(np.int64)


@dataclass
class Pools:
    """SGLang's CPU pools for a 2-layer hybrid model (layer 0 full, layer 1 SWA).

    One KV head of dimension 2 in float32: K and V of a token carry its 64-bit
    content tag (see :func:`encode_tags`).  The pool sizes are rounded down to
    whole pages, as SGLang rounds its token budget (its paged allocators hold
    ``size // page_size`` pages).
    """

    full_tokens: int
    swa_tokens: int
    page_size: int = 1
    max_reqs: int = 16
    max_context: int = 1 << 17

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")
        self.full_tokens -= self.full_tokens % self.page_size
        self.swa_tokens -= self.swa_tokens % self.page_size
        self.kv = SWAKVPool(size=self.full_tokens, size_swa=self.swa_tokens, page_size=self.page_size,
                            dtype=torch.float32, head_num=1, head_dim=2, swa_attention_layer_ids=[1],
                            full_attention_layer_ids=[0], device="cpu", enable_memory_saver=False)
        self.allocator = SWATokenToKVPoolAllocator(self.full_tokens, self.swa_tokens, self.page_size,
                                                   torch.float32, "cpu", self.kv, need_sort=False)
        self.req_to_token = ReqToTokenPool(self.max_reqs, self.max_context, "cpu", False)

    def init_params(self, window: int) -> CacheInitParams:
        return CacheInitParams(disable=False, req_to_token_pool=self.req_to_token,
                               token_to_kv_pool_allocator=self.allocator, page_size=self.page_size,
                               sliding_window_size=window)

    def write_tags(self, full_slots: torch.Tensor, swa_slots: torch.Tensor, tags: np.ndarray) -> None:
        """Write ``tags`` as the K/V of both layers, the way an attention backend does."""
        k, v = encode_tags(tags)
        loc = KVWriteLoc(full_slots, swa_loc=swa_slots)
        for layer in _LAYERS:
            self.kv.set_kv_buffer(layer, loc, k, v)

    def read_tags(self, layer_id: int, slots: torch.Tensor) -> np.ndarray:
        """Tags held by ``slots`` of ``layer_id``'s buffer (SWA slots for layer 1)."""
        return decode_tags(self.kv.get_key_buffer(layer_id)[slots], self.kv.get_value_buffer(layer_id)[slots])


@dataclass
class FlowStats:
    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    rejected: int = 0
    checks: int = 0
    loaded_tokens: int = 0
    hits: list = field(default_factory=list)


class PseudoHitError(AssertionError):
    """A hit whose KV (full, or SWA inside the window) is not the request's."""


@dataclass
class _Live:
    req: Req
    tokens: np.ndarray        # prompt + outputs (the outputs are decided up front)
    hashes: np.ndarray
    prompt_len: int
    chunk: int
    phase: str = "prefill"


class Driver:
    """Runs requests through ``cache`` the way SGLang's scheduler does.

    Args:
        cache: a ``BasePrefixCache`` over ``pools``.
        pools: the SGLang pools.
        window: sliding window W.
        chunk: chunked-prefill size.
        max_live: requests running at once (round-robin steps).
        check_every_step: run the accounting check after each step.
        checkpoint_prefill_end: checkpoint a request into the tree when its
            prefill ends, as SGLang's scheduler does (False: chunk boundaries only).
    """

    def __init__(self, cache: BasePrefixCache, pools: Pools, window: int, chunk: int = 1024,
                 max_live: int = 3, check_every_step: bool = True,
                 checkpoint_prefill_end: bool = True) -> None:
        self.cache = cache
        self.pools = pools
        self.alloc: SWATokenToKVPoolAllocator = pools.allocator
        self.window = window
        self.chunk = chunk
        self.max_live = max_live
        self.check_every_step = check_every_step
        self.checkpoint_prefill_end = checkpoint_prefill_end
        self.stats = FlowStats()
        self._live: list[_Live] = []
        self._rid = 0
        self.after_step: Callable[["Driver"], None] | None = None

    # ------------------------------------------------------------ public
    def run(self, sequences: Iterable[tuple[np.ndarray, int | np.ndarray, str | None]]) -> FlowStats:
        """Run ``(prompt, outputs, extra_key)`` requests, ``max_live`` at a time.

        ``outputs`` is the number of tokens to decode (their ids are derived from
        the prompt) or the output token ids themselves."""
        pending = list(sequences)[::-1]
        while pending or self._live:
            while pending and len(self._live) < self.max_live:
                prompt, n_out, extra_key = pending.pop()
                self._admit(prompt, n_out, extra_key)
            for live in list(self._live):
                self._step(live)
                if self.check_every_step:
                    self.check_accounting()
                if self.after_step is not None:
                    self.after_step(self)
        return self.stats

    # ------------------------------------------------------------ steps
    def _admit(self, prompt: np.ndarray, n_out: int | np.ndarray, extra_key: str | None) -> None:
        self._rid += 1
        if isinstance(n_out, np.ndarray):
            outputs, n_out = n_out, len(n_out)
        else:
            outputs = (prefix_hashes(prompt)[-1:] + np.arange(1, n_out + 1)) % 50000 + 7 if n_out else np.zeros(0)
        tokens = np.concatenate([prompt, outputs.astype(np.int64)]).astype(np.int64)
        req = Req(f"r{self._rid}", "", array("q", prompt.astype(np.int64).tolist()),
                  SamplingParams(max_new_tokens=max(1, n_out)), extra_key=extra_key)
        req.init_next_round_input(self.cache)
        if req.needs_host_load_back():
            self._load_back(req)
        live = _Live(req, tokens, prefix_hashes(tokens), len(prompt), self.chunk)
        self._verify_hit(live)
        req.lock = self.cache.lock(req.last_node)
        self.stats.requests += 1
        self.stats.input_tokens += len(prompt)
        self.stats.hit_tokens += req.prefix_len
        self.stats.hits.append(req.prefix_len)
        self._live.append(live)

    def _load_back(self, req: Req) -> None:
        """The admission's host load-back (``schedule_policy`` under HiCache): the
        device match pinned, ``init_load_back``, all-or-none, the loaded prefix
        protected."""
        pin = self.cache.lock(req.last_node)
        try:
            promised = req.host_hit_length
            loaded, node = self.cache.init_load_back(InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=promised, req=req))
        finally:
            self.cache.unlock(pin)
        # the batch's forward: the scheduler issues the queued loads
        # (ready_to_load_host_cache) and the worker's layers wait on them
        # (tp_worker.set_hicache_consumer: the pool's layer_transfer_counter)
        consumer = self.cache.ready_to_load_host_cache()
        counter = getattr(self.pools.kv, "layer_transfer_counter", None)
        if counter is not None:
            counter.set_consumer(consumer)
        assert loaded == 0 or loaded >= promised, (req.rid, promised, loaded)
        req.host_loaded_length, req.last_node = loaded, node
        req.prefix_len += loaded
        req.kv.cache_protected_len = req.prefix_len
        self.stats.loaded_tokens += loaded

    def _verify_hit(self, live: _Live) -> None:
        req = live.req
        hit = req.prefix_len
        if hit == 0:
            return
        full = self.cache.prefix_device_indices(req)[:hit].to(torch.int64)
        want = live.hashes[:hit]
        got_full = self.pools.read_tags(0, full)
        if not np.array_equal(got_full, want):
            bad = int(np.argmax(got_full != want))
            raise PseudoHitError(f"{req.rid}: full KV of position {bad} of a {hit}-token hit is not its own")
        lo = max(0, hit - self.window)
        swa_t = self.alloc.translate_loc_from_full_to_swa(full[lo:hit]).to(torch.int64)
        swa = swa_t.numpy()
        got_swa = np.where(swa > 0, self.pools.read_tags(1, swa_t.clamp(min=0)), 0)
        if not np.array_equal(got_swa, want[lo:hit]):
            bad = lo + int(np.argmax(got_swa != want[lo:hit]))
            raise PseudoHitError(f"{req.rid}: SWA KV of position {bad} inside the window of a {hit}-token hit "
                                 f"is {'freed' if swa[bad - lo] <= 0 else 'not its own'}")

    def _alloc_extend(self, req: Req, start: int, end: int) -> torch.Tensor | None:
        """Slots for row positions ``[start, end)``, as the scheduler allocates an
        extend (``alloc_for_extend``): ``alloc_token_slots`` at page size 1, else
        ``alloc_paged_token_slots_extend`` (eviction of the demand with one more
        page per request, then ``alloc_extend`` with the prefix and sequence
        lengths and ``last_loc``, the row's slot before ``start``, -1 for none).
        None when the pools cannot hold it even after eviction."""
        n, ps = end - start, self.pools.page_size
        if ps == 1:
            evict_from_tree_cache(self.cache, n)
            return self.alloc.alloc(n)
        prefix_lens = torch.tensor([start], dtype=torch.int64)
        seq_lens = torch.tensor([end], dtype=torch.int64)
        demand = self.alloc.get_extend_allocation_demand(prefix_lens, seq_lens, conservative_num_tokens=n + ps,
                                                         shard_size=1)
        evict_from_tree_cache(self.cache, demand)
        last_loc = get_last_loc_torch(self.pools.req_to_token.req_to_token,
                                      torch.tensor([req.kv.req_pool_idx], dtype=torch.int64), prefix_lens)
        return self.alloc.alloc_extend(prefix_lens, prefix_lens, seq_lens, seq_lens, last_loc.to(torch.int64), n)

    def _alloc_decode(self, req: Req, pos: int) -> torch.Tensor | None:
        """The slot of row position ``pos`` (one decode token), as
        ``alloc_for_decode_default`` allocates it: ``alloc_token_slots`` at page
        size 1, else ``alloc_paged_token_slots_decode`` (eviction of a page, then
        ``alloc_decode`` with the sequence length after the token and ``last_loc``
        = the row's slot at ``pos - 1``).  None when the pools cannot hold it."""
        ps = self.pools.page_size
        if ps == 1:
            evict_from_tree_cache(self.cache, 1)
            return self.alloc.alloc(1)
        evict_from_tree_cache(self.cache, ps)
        last_loc = self.pools.req_to_token.req_to_token[req.kv.req_pool_idx, pos - 1:pos].to(torch.int64)
        seq_lens = torch.tensor([pos + 1], dtype=torch.int64)
        return self.alloc.alloc_decode(seq_lens, seq_lens, last_loc)

    def _write(self, live: _Live, start: int, slots: torch.Tensor) -> None:
        req = live.req
        end = start + len(slots)
        self.pools.req_to_token.write((req.kv.req_pool_idx, slice(start, end)), slots.to(torch.int32))
        swa = self.alloc.translate_loc_from_full_to_swa(slots.to(torch.int64))
        assert bool((swa > 0).all()), "a fresh allocation must map to SWA slots"
        self.pools.write_tags(slots.to(torch.int64), swa.to(torch.int64), live.hashes[start:end])
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end

    def _step(self, live: _Live) -> None:
        req = live.req
        if live.phase == "prefill":
            start = req.prefix_len
            end = min(start + live.chunk, live.prompt_len)
            if not req.kv.holds_kv:
                self.pools.req_to_token.alloc([req])
                if start:
                    prefix = self.cache.prefix_device_indices(req)[:start]
                    self.pools.req_to_token.write((req.kv.req_pool_idx, slice(0, start)), prefix.to(torch.int32))
                req.kv.kv_allocated_len = req.kv.kv_committed_len = start
            req.extend_end = end
            slots = self._alloc_extend(req, start, end)
            if slots is None:
                return self._reject(live)
            self._write(live, start, slots)
            if end < live.prompt_len or self.checkpoint_prefill_end:
                checkpoint_kv_cache(req, self.cache)  # SGLang's "cache_unfinished_req"
            else:
                req.prefix_len = end
            if end == live.prompt_len:
                live.phase = "decode"
                req.decode_batch_idx = 0
            return None
        # decode: one token per step; the window slides first, as in maybe_evict_swa
        pos = req.seqlen
        if pos >= len(live.tokens):
            return self._finish(live)
        if req.decode_batch_idx >= 1:
            due = req.seqlen - 1 - self.cache.swa_retain_window >= req.kv.get_evicted_seqlen(ComponentType.SWA) + 1
            if due:
                self.cache.evict_sliding_windows(req, req.seqlen - 1)
        slots = self._alloc_decode(req, pos)
        if slots is None:
            return self._reject(live)
        req.output_ids.append(int(live.tokens[pos]))
        self._write(live, pos, slots)
        req.decode_batch_idx += 1
        return None

    def _finish(self, live: _Live) -> None:
        req = live.req
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        release_kv_cache(req, self.cache, checkpoint=True)
        self._live.remove(live)

    def _reject(self, live: _Live) -> None:
        """Out of memory even after eviction: abort without caching (a retraction)."""
        req = live.req
        self.stats.rejected += 1
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        if req.kv.holds_kv and req.kv.is_kv_released:
            # rejected at its first chunk with no hit: a row and no KV, which SGLang's
            # scheduler never has (it takes the row with the chunk); give both back
            self.pools.req_to_token.free(req)
            self.cache.unlock(req.lock)
            req.lock = None
        else:
            release_kv_cache(req, self.cache, checkpoint=False)
        self._live.remove(live)

    # ------------------------------------------------------------ checks
    def check_accounting(self) -> None:
        """SGLang's busy-time conservation check for both pools (see invariant_checker)."""
        ps = self.pools.page_size
        alloc, cache = self.alloc, self.cache
        full_private = sum(kv_private_tokens(l.req.kv, ps) for l in self._live if l.req.kv.holds_kv)
        swa_private = sum(kv_private_swa_tokens(l.req.kv, ps) for l in self._live if l.req.kv.holds_kv)
        full = alloc.full_available_size() + cache.full_evictable_size() + cache.full_protected_size() + full_private
        swa = (alloc.swa_available_size() + cache.swa_evictable_size() + cache.swa_protected_size()
               + swa_private + cache.swa_transient_size())
        assert full == self.pools.full_tokens, (
            f"full pool: available {alloc.full_available_size()} + evictable {cache.full_evictable_size()} + "
            f"protected {cache.full_protected_size()} + private {full_private} != {self.pools.full_tokens}")
        assert swa == self.pools.swa_tokens, (
            f"swa pool: available {alloc.swa_available_size()} + evictable {cache.swa_evictable_size()} + "
            f"protected {cache.swa_protected_size()} + private {swa_private} + transient "
            f"{cache.swa_transient_size()} != {self.pools.swa_tokens}")
        self.stats.checks += 1
