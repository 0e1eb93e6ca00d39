"""SGLang's own prefix caches on a sequence file, driven like its scheduler drives them.

Flavours (each runs in a venv holding that SGLang release):

* ``unified``   SGLang 0.5.23 ``UnifiedRadixCache`` with FULL + SWA components;
* ``swa-radix`` SGLang 0.5.20 ``SWARadixCache`` (removed after 0.5.20).

Both sit on SGLang's real CPU pools: ``SWAKVPool(device="cpu")`` (one full
and one SWA layer of a tiny head: only slot accounting matters, and the pool
sizes in *tokens* come from the byte budget), ``SWATokenToKVPoolAllocator``
(paged: ``alloc_extend`` through its naive extend path, the Triton kernel cannot
run on CPU; ``alloc(n)`` at page size 1, as the scheduler does) and
``ReqToTokenPool``.  Per request, one at a time: build a ``Req`` and match it
the scheduler's way, lock the hit, then per prefill chunk evict the
shortfall from the tree, ``alloc_extend`` the chunk and write the request's
token row; between chunks the tree caches the unfinished request
(``checkpoint_kv_cache`` / ``cache_unfinished_req``); at the end
``release_kv_cache`` inserts the prompt and unlocks.

``--ratios`` lists values of SGLang's ``--swa-full-tokens-ratio`` (default
0.8): the SWA pool holds ``ratio x`` the full pool's tokens, and the byte
budget fixes both (``common.sglang_pool_tokens``).  Every (budget, ratio)
gets fresh pools and a fresh tree in this one process.

    python drive_sglang.py SEQ_DIR --budgets 59,594 --flavour unified|swa-radix [--ratios 0.05,0.1,...,1.0]
"""

from __future__ import annotations

import os
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent.parent / "adapters" / "sglang" / "tests"))

from _torchvision_stub import install as _stub_torchvision
from common import (
    GB,
    SGLANG_RATIO_DEFAULT,
    SGLANG_RATIO_SWEEP,
    Run,
    Sequences,
    driver_args,
    emit,
    load_sequences,
    parse_ratios,
    release_memory,
    sglang_pool_tokens,
)

_stub_torchvision()  # SGLang imports torchvision eagerly; PyPI builds cannot load beside CPU torch

import torch


def _cpu_extend_path() -> None:
    """SGLang 0.5.20 always launches its Triton ``alloc_extend_kernel``, which
    cannot run without a GPU; it ships ``alloc_extend_naive``, the same
    computation in torch, which 0.5.23 dispatches to on CPU.  Route 0.5.20's
    launch to it (0.5.23 needs nothing)."""
    from sglang.srt.mem_cache.allocator import paged

    if "use_triton_kernels" in paged.PagedTokenToKVPoolAllocator.alloc_extend.__code__.co_names:
        return

    class _NaiveLaunch:
        def __getitem__(self, grid: object) -> Callable[..., None]:
            def launch(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                       free_pages: torch.Tensor, out: torch.Tensor, _bs_pow2: int, page: int) -> None:
                paged.alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_pages, out, page, out.device)
            return launch

    paged.alloc_extend_kernel = _NaiveLaunch()


def _server_args() -> None:
    """Publish default server args (scheduler helpers read config bags)."""
    try:
        from sglang.srt.runtime_context import get_context  # 0.5.23
    except ImportError:
        from sglang.srt.server_args import (  # 0.5.20
            ServerArgs,
            set_global_server_args_for_scheduler,
        )

        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
        return
    get_context().override_server_args().install()


class Flow:
    """One SGLang tree over its real pools, plus the scheduler steps."""

    def __init__(self, flavour: str, full_tokens: int, swa_tokens: int, page: int, window: int,
                 max_context: int) -> None:
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        self.flavour, self.page = flavour, page
        self.kv = SWAKVPool(size=full_tokens, size_swa=swa_tokens, page_size=page, dtype=torch.float16,
                            head_num=1, head_dim=1, swa_attention_layer_ids=[1], full_attention_layer_ids=[0],
                            device="cpu")
        self.alloc = SWATokenToKVPoolAllocator(full_tokens, swa_tokens, page, torch.float16, "cpu", self.kv,
                                               need_sort=False)
        self.req_to_token = ReqToTokenPool(2, max_context + page, "cpu", False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.req_to_token,
                                 token_to_kv_pool_allocator=self.alloc, page_size=page,
                                 sliding_window_size=window)
        if flavour == "unified":
            from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

            params.tree_components = (ComponentType.FULL, ComponentType.SWA)
            self.cache = UnifiedRadixCache(params)
        else:
            from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache

            self.cache = SWARadixCache(params)
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self._Req, self._Sampling, self._Finish = Req, SamplingParams, FINISH_LENGTH
        self._rid = 0
        self.kernel_s = 0.0  # time inside alloc_extend (a Triton kernel on GPU, torch here)

    def kv_buffer_bytes(self) -> int:
        """Bytes of the (tiny) KV tensors SGLang really allocates: not metadata."""
        total = 0
        for pool in (self.kv.full_kv_pool, self.kv.swa_kv_pool):
            for bufs in (pool.k_buffer, pool.v_buffer):
                total += sum(b.numel() * b.element_size() for b in bufs)
        return total

    # ------------------------------------------------------------ one request
    def new_req(self, tokens: Any, namespace: str) -> Any:
        self._rid += 1
        return self._Req(f"r{self._rid}", "", array("q", tokens.tolist()),
                         self._Sampling(max_new_tokens=1), extra_key=namespace)

    def match(self, req: Any) -> int:
        """Scheduler: match, adopt and lock the hit.  Returns the hit length."""
        req.init_next_round_input(self.cache)
        if self.flavour == "unified":
            req.lock = self.cache.lock(req.last_node)
            return int(req.prefix_len)
        req.lock_receipt = self.cache.inc_lock_ref(req.last_node).to_dec_params()
        return len(req.prefix_indices)

    def prefill(self, req: Any, hit: int, n_tokens: int, chunk: int) -> bool:
        """Chunked prefill of ``[hit, n_tokens)``; False if the pools cannot hold it."""
        r2t = self.req_to_token
        r2t.alloc([req])
        idx = req.kv.req_pool_idx
        if hit:
            prefix = self.cache.prefix_device_indices(req) if self.flavour == "unified" else req.prefix_indices
            r2t.write((idx, slice(0, hit)), prefix[:hit].to(torch.int32))
        req.kv.kv_allocated_len = req.kv.kv_committed_len = hit
        start = hit
        while start < n_tokens:
            end = min(start + chunk, n_tokens)
            slots = self._alloc_chunk(idx, start, end)
            if slots is None:
                return False
            r2t.write((idx, slice(start, end)), slots.to(torch.int32))
            req.kv.kv_allocated_len = req.kv.kv_committed_len = end
            if end < n_tokens:  # the scheduler caches the unfinished request between chunks
                self._checkpoint(req, start, end)
            start = end
        return True

    def _alloc_chunk(self, idx: int, start: int, end: int) -> torch.Tensor | None:
        n = end - start
        need = n + self.page  # a paged extend may open one more page than n / page
        if self.flavour == "unified":
            self.alloc.evict_to_free_tokens(self.cache, need)
        else:
            from sglang.srt.mem_cache.common import evict_from_tree_cache

            evict_from_tree_cache(self.cache, need)
        t0 = time.perf_counter()
        if self.page == 1:  # the scheduler's alloc_token_slots: SGLang's paged calls assert page_size > 1
            out = self.alloc.alloc(n)
        else:
            last = int(self.req_to_token.req_to_token[idx, start - 1]) if start else -1
            pl, sl = torch.tensor([start], dtype=torch.int64), torch.tensor([end], dtype=torch.int64)
            out = self.alloc.alloc_extend(pl, pl, sl, sl, torch.tensor([last], dtype=torch.int64), n)
        self.kernel_s += time.perf_counter() - t0
        return out

    def _checkpoint(self, req: Any, start: int, end: int) -> None:
        if self.flavour == "unified":
            from sglang.srt.mem_cache.common import checkpoint_kv_cache

            req.extend_end = end
            checkpoint_kv_cache(req, self.cache)
        else:
            from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

            req.set_extend_range(start, end)
            maybe_cache_unfinished_req(req, self.cache, chunked=True)

    def finish(self, req: Any, ok: bool) -> None:
        """Insert the prompt (``ok``) or abort, free the row, unlock."""
        from sglang.srt.mem_cache.common import release_kv_cache

        req.finished_reason = self._Finish(length=0)
        if not req.kv.holds_kv:  # rejected before its row was allocated
            self.req_to_token.alloc([req])
        if self.flavour == "unified":
            release_kv_cache(req, self.cache, checkpoint=ok)
        else:
            if ok:
                req.set_extend_range(req.kv.kv_committed_len, req.kv.kv_committed_len)
            release_kv_cache(req, self.cache, is_insert=ok)


def drive(seqs: Sequences, flavour: str, budget_gb: float, chunk: int,
          ratio: float = SGLANG_RATIO_DEFAULT) -> dict[str, Any]:
    """Replay ``seqs`` through new pools and a new tree sized with ``ratio``
    (``swa_full_tokens_ratio``); returns the result record."""
    m = seqs.meta
    full, swa = sglang_pool_tokens(int(budget_gb * GB), m["full_bpt"], m["swa_bpt"], ratio, m["page_size"])
    max_context = int((seqs.offsets[1:] - seqs.offsets[:-1]).max())
    system = "sglang-0.5.23" if flavour == "unified" else "sglang-0.5.20"
    run = Run(system, budget_gb)
    flow = Flow(flavour, full, swa, m["page_size"], m["window"], max_context)
    clock: Callable[[], float] = time.perf_counter
    for tokens, ns in seqs:
        req = flow.new_req(tokens, ns)  # request object construction is not a cache operation
        flow.kernel_s = 0.0
        t0 = clock()
        hit = flow.match(req)
        t1 = clock()
        ok = flow.prefill(req, hit, len(tokens), chunk)
        t2 = clock()
        flow.finish(req, ok)
        t3 = clock()
        if not ok:
            run.rejected += 1
        run.times.add(t1 - t0, t2 - t1, t3 - t2, flow.kernel_s)
        run.record(len(tokens), hit if ok else 0)  # a rejected request saved nothing
    import sglang

    run.extra.update({"settings": {"swa_full_tokens_ratio": ratio}, "default": ratio == SGLANG_RATIO_DEFAULT,
                      "full_pool_tokens": full, "swa_pool_tokens": swa, "swa_full_tokens_ratio": ratio,
                      "version": f"sglang {sglang.__version__} {type(flow.cache).__name__}"})
    return run.result(kv_buffer_bytes=flow.kv_buffer_bytes())


def main() -> None:
    args = driver_args(__doc__, extra={
        "--flavour": {"choices": ["unified", "swa-radix"], "required": True},
        "--ratios": {"default": ",".join(f"{r:g}" for r in SGLANG_RATIO_SWEEP),
                     "help": "comma-separated swa_full_tokens_ratio values"}})
    try:
        ratios = parse_ratios(args.ratios, "--ratios")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    os.environ.setdefault("SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK", "0")
    _server_args()
    _cpu_extend_path()
    seqs = load_sequences(args.sequences)
    for gb in args.budgets:
        for ratio in ratios:
            release_memory()  # each replay's memory baseline starts after the last one's garbage
            emit(drive(seqs, args.flavour, gb, args.chunk, ratio))


if __name__ == "__main__":
    main()
