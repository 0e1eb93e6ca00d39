"""hybridkv's window-safe tree as vLLM 0.32's device prefix cache.

vLLM keeps its block pool, its block tables, its KV tensors and its kernels;
:class:`HybridKVCacheManager` (a ``KVCacheManager``) decides what is a hit and
which cached blocks stay:

* **hits** (``get_computed_blocks``): ``WindowSafeTree.match`` of the request's
  tokens (one token left to compute), split so a node ends at the hit and
  locked; the full groups get the path's blocks, every sliding-window group
  gets its blocks for the window before the hit and vLLM's null block before
  that.  A hit is window safe for every sliding-window group: the tree's window
  is the largest group window, and a tree page holds SWA only where every
  sliding-window group holds its block.
* **what is cached** (``free`` / ``pop_blocks_for_free``, i.e. at finish and at
  preemption): the request's computed page-aligned prefix goes into the tree,
  which takes one reference (``BlockPool.touch``) on each block it keeps.  The
  sliding-window blocks that vLLM frees while a request advances are held
  first where hybridkv's retention policy keeps them (checkpoint, divergence
  and predicted windows; all of them while more than ``spare_fraction`` of the
  blocks are free, the ``adaptive`` rule of :class:`hybridkv.CacheConfig`).
* **what goes** (``allocate_slots`` short of blocks): first the holds of live
  requests that the policy would release, then ``WindowSafeTree.evict`` by
  blocks (SWA that ends no likely hit first, then leaves by the tree's
  ranking); the tree returns a block with ``BlockPool.free_blocks`` and drops
  its hash (``evict_blocks``) so vLLM's KV events say it is gone.

* **window repair** (repair case 2, with hybridkv's connector,
  :meth:`HybridKVCacheManager.repair_windows`): where the tree holds a prompt's
  full KV past its window-safe hit and a lower tier holds the window, vLLM gets
  the device's full blocks and fresh window blocks the connector loads
  (:mod:`.repair`).
* **names** (with hybridkv's connector, :meth:`HybridKVCacheManager.name_pages`):
  each inserted page carries the connector's keys of it, and what eviction
  gives up stays named as evicted runs; the connector's lookups read a
  prompt's keys off the tree (:mod:`.names`).

vLLM's own hash table still records every computed block (``cache_blocks``:
BlockStored events, its metrics) but is never read for a hit.  Blocks vLLM
cached that the tree does not keep lose their hash when the request ends, so
the events agree with what can hit.

Tree page ids: a full page is the block id of the first full group (the other
full groups' blocks at that position, if any, in :attr:`BlockPagePool.more`);
an SWA page is the block id of the first sliding-window group, the other
groups' blocks in the same table.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hybridkv.lifecycle import Hit, Lifecycle
from hybridkv.radix import LockHandle, PageNames, TreeConfig, WindowSafeTree
from hybridkv.radix.node import EvictedRun, parts_pages
from hybridkv_vllm.blocks import BlockPagePool, HitRows, Layout, PrefixOptions, SwaHold, classify_groups
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.request import RequestStatus

__all__ = ["BlockPagePool", "HybridKVCacheManager", "Layout", "PrefixOptions", "classify_groups"]

_NO_PAGE = -1
#: the connector's hit over the device's full KV and the tiers: ``(request, window-safe device
#: tokens, device full tokens)`` -> ``(local, end)`` (see :meth:`HybridKVCacheManager.repair_windows`),
#: ``(0, 0)`` for none, or None (not known yet)
WindowHit = Callable[[Any, int, int], "tuple[int, int] | None"]
#: names of a request's pages ``[0, n)`` for an insert: ``(request, first page to name, n)`` -> names
#: (None below the first page), or None (unnamed)
Namer = Callable[[Any, int, int], "PageNames | None"]
_ALLOC_SIG = inspect.signature(KVCacheManager.allocate_slots)


@dataclass
class _Live:
    """A request the manager knows: its lock on the tree and the SWA blocks held for it."""

    request: Any
    handle: LockHandle
    hit_pages: int = 0
    raw_pages: int = 0
    #: page index -> every SWA group's block there, one extra reference each: the
    #: windows the retention policy keeps (``held``) and, while blocks are
    #: plentiful, the rest (``spare``: released first when blocks run short)
    held: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    spare: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    scan_mark: int = 0  # pages before it were looked at for holds
    looked: bool = False  # its first lookup was counted as a use (vLLM retries waiting requests)
    #: a window repair (:meth:`HybridKVCacheManager.repair_windows`): the lock on the device's
    #: full KV the hit reaches past its window-safe part, and the fresh sliding-window blocks
    #: handed for the connector to load (one manager reference each until vLLM takes them)
    reach: LockHandle = field(default_factory=lambda: LockHandle(None))
    fresh: list[Any] = field(default_factory=list)
    #: the connector's load into its blocks is not confirmed yet (vLLM's ``cache_blocks``
    #: after the load): nothing past the device's hit is cached while so, as a failed load
    #: under vLLM's ``fail`` policy ends the request with the unloaded blocks counted computed
    loading: bool = False


#: The state vLLM 0.32's ``KVCacheManager.__init__`` builds, which its methods
#: (inherited here: ``allocate_slots``, ``free``, ``take_events``, ...) read and
#: write.  It stays in the manager vLLM's scheduler made: the adopting manager
#: delegates each of these names to it (:func:`_delegate`), nothing is copied.
_VLLM_STATE = ("max_model_len", "enable_caching", "enable_kv_cache_events", "use_eagle", "log_stats",
               "metrics_collector", "prefix_cache_stats", "coordinator", "mamba_shared_prefix_checkpoint",
               "num_kv_cache_groups", "block_pool", "retained_hit_group_ids", "kv_cache_config",
               "watermark_blocks", "kv_cache_event_metadata", "empty_kv_cache_blocks")


def _delegate(name: str) -> property:
    """``name`` read from and written to the adopted vLLM manager (``self.vllm``)."""

    def get(self: HybridKVCacheManager) -> Any:
        return getattr(self.vllm, name)

    def put(self: HybridKVCacheManager, value: Any) -> None:
        setattr(self.vllm, name, value)

    return property(get, put, doc=f"vLLM's manager's ``{name}`` (delegated).")


class HybridKVCacheManager(KVCacheManager):
    """vLLM's ``KVCacheManager`` with hybridkv's tree deciding hits and eviction.

    Built over the manager vLLM's scheduler made (:meth:`adopt`), which it
    keeps as ``vllm``: the block pool, coordinator and settings that vLLM's
    own methods (inherited, called through ``super()``) use are that
    manager's, reached by delegation (:data:`_VLLM_STATE`).  Not thread-safe
    (vLLM's scheduler is single-threaded).
    """

    @classmethod
    def adopt(cls, manager: KVCacheManager, options: PrefixOptions | None = None) -> HybridKVCacheManager:
        """A manager over ``manager``'s block pool and coordinator (``manager`` is
        not to be used afterwards).  Raises ValueError for groups the tree cannot
        page (see :func:`classify_groups`) or a manager with caching off."""
        if not isinstance(manager, KVCacheManager):
            raise TypeError(f"manager must be vLLM's KVCacheManager, got {type(manager).__name__}")
        if not manager.enable_caching:
            raise ValueError("enable_prefix_caching is off: hybridkv's prefix cache has nothing to decide")
        if manager.use_eagle:
            raise ValueError("speculative decoding (EAGLE/MTP drafts) is not supported by hybridkv's prefix cache")
        # KVCacheManager.__init__ would build a second coordinator and block pool:
        # the adopted manager's are used instead, through the delegated state
        self = cls.__new__(cls)
        self.vllm = manager
        self._init_tree(options or PrefixOptions())
        return self

    def _init_tree(self, options: PrefixOptions) -> None:
        self.options = options
        self.full_layout, self.swa_layout, self.page_size, window = classify_groups(self.kv_cache_config)
        managers = self.coordinator.single_type_managers
        self._swa_managers = [managers[g] for g in self.swa_layout.groups]
        self.tree_config = TreeConfig(self.page_size, max(window, 1), options.swa_checkpoint, "page",
                                      ranking=options.ranking)
        self.pool = BlockPagePool(self.block_pool)
        self.hit_rows = HitRows(self.pool, self.full_layout, self.swa_layout,
                                [m.sliding_window for m in self._swa_managers],
                                len(self.kv_cache_config.kv_cache_groups), self.page_size)
        self._live: dict[str, _Live] = {}
        self._namer: Namer | None = None  # the connector's names of inserted pages (:meth:`name_pages`)
        self._runs_cap: Callable[[], int] | None = None
        self._runs_hooks: tuple[Callable[[EvictedRun], None] | None, Callable[[bytes], bytes] | None] = (None, None)
        self._window_hit: WindowHit | None = None  # repair case 2 (:meth:`repair_windows`)
        #: the last request ``get_computed_blocks`` looked up and its tokens (the connector's
        #: lookup, right after it, walks the tree with them: :mod:`.names`)
        self.looked_up: tuple[str, np.ndarray] = ("", np.empty(0, np.int32))
        self.counters = {"lookups": 0, "hit_tokens": 0, "raw_match_tokens": 0, "inserted_pages": 0,
                         "held_swa_pages": 0, "released_holds": 0, "evicted_blocks": 0,
                         "insert_skipped": 0, "checkpoint_unlocked": 0, "window_repairs": 0,
                         "repaired_tokens": 0}
        self._new_tree()

    def _new_tree(self) -> None:
        self.tree = WindowSafeTree(self.tree_config, self.pool, full_page_bytes=self.full_layout.blocks_per_page,
                                   swa_page_bytes=self.swa_layout.blocks_per_page)
        # begin, the release rule, the insert and the lock moves every host shares
        self.lifecycle = Lifecycle(self.tree)
        self._keep_runs()

    def _keep_runs(self) -> None:
        """The tree keeps evicted runs within the connector's cap, once it names pages
        (with its hooks: a new tree after a reset keeps them)."""
        if self._runs_cap is not None:
            runs = self.tree.runs
            runs.on_drop, page_key = self._runs_hooks
            runs.key_pages_by(page_key)
            runs.enable()
            runs.cap_by(self._runs_cap)

    def name_pages(self, namer: Namer, runs_cap: Callable[[], int], *,
                   on_drop: Callable[[EvictedRun], None] | None = None,
                   page_key: Callable[[bytes], bytes] | None = None) -> None:
        """Keep the lower tiers' names of the pages the tree caches (``namer``, the
        connector's page keys) and, past eviction, as evicted runs named within
        ``runs_cap()`` pages (:mod:`hybridkv.radix.evicted`): the connector reads
        them off the tree (:mod:`.names`) instead of hashing a prompt again.
        ``on_drop`` and ``page_key``: the runs' hooks (:attr:`EvictedRuns.on_drop
        <hybridkv.radix.evicted.EvictedRuns.on_drop>`, :meth:`EvictedRuns.key_pages_by
        <hybridkv.radix.evicted.EvictedRuns.key_pages_by>`), kept across resets."""
        if not callable(namer) or not callable(runs_cap):
            raise TypeError("namer and runs_cap must be callable")
        for arg, fn in (("on_drop", on_drop), ("page_key", page_key)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{arg} must be callable or None, got {type(fn).__name__}")
        self._namer, self._runs_cap, self._runs_hooks = namer, runs_cap, (on_drop, page_key)
        self._keep_runs()

    def repair_windows(self, window_hit: WindowHit) -> None:
        """Repair case 2 (the device holds a prompt's full KV but not the window its
        hit needs; a lower tier holds the window) with hybridkv's connector: where
        the tree's match reaches past its window-safe hit, ``window_hit(request,
        safe, full)`` (the connector's lookup, counting the device's full KV up to
        ``full`` tokens as held) answers ``(local, end)``: the device hands vLLM its
        full KV up to ``local`` (page aligned, past ``safe``) and, for each
        sliding-window group, fresh blocks for the window before ``end`` at or past
        ``safe``, which the connector loads with its hit ``[local, end)``; the
        device's full KV is not loaded again.  A load that fails is recomputed
        from scratch (vLLM's ``failed_recving``), and nothing unloaded is cached."""
        if not callable(window_hit):
            raise TypeError("window_hit must be callable")
        self._window_hit = window_hit

    # ------------------------------------------------------------ helpers
    @staticmethod
    def namespace(request: Any) -> str:
        """Requests share tree nodes only with the same LoRA adapter and cache salt."""
        lora = getattr(request, "lora_request", None)
        return f"{getattr(lora, 'lora_name', None)!r}/{getattr(request, 'cache_salt', None)!r}"

    def _cacheable(self, request: Any) -> bool:
        """Multimodal and prompt-embedding requests: their KV is not a function of token ids alone."""
        return not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None

    def _release_spare(self, live: _Live) -> int:
        n = len(live.spare)
        if n:
            self.block_pool.free_blocks([b for blocks in live.spare.values() for b in blocks])
            live.spare = {}
        return n

    def _release_held(self, live: _Live) -> None:
        self._release_spare(live)
        if live.held:
            self.block_pool.free_blocks([b for blocks in live.held.values() for b in blocks])
            live.held = {}

    # --------------------------------------------------------------- hits
    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlocks, int, int]:
        """Window-safe hit from the tree, locked until the request is freed.  O(depth + L/P)."""
        self._drop_lookup(request)  # an earlier lookup for a request vLLM did not schedule
        if not self.prefix_cache_lookup_enabled(request) or not self._cacheable(request):
            return self.empty_kv_cache_blocks, 0, 0
        self.counters["lookups"] += 1
        P = self.page_size
        limit = (request.num_tokens - 1) // P * P
        if limit < P:
            self._track(request, LockHandle(None), 0, 0)
            return self.empty_kv_cache_blocks, 0, 0
        tokens = np.asarray(request.all_token_ids[:limit], dtype=np.int32)  # the tree's token dtype
        self.looked_up = (request.request_id, tokens)
        # vLLM looks a waiting request up again each step it cannot admit it: only the
        # first lookup is a use the ranking learns from (recency, returns)
        live = self._live.get(request.request_id)
        first = live is None or not live.looked
        hit = self.lifecycle.begin(tokens, self.namespace(request), None, touch=first)
        self.counters["raw_match_tokens"] += hit.raw_pages * P
        self._track(request, hit.handle, hit.pages, hit.raw_pages)
        if self._window_hit is not None:  # asked each lookup: a plan lasts one lookup
            repaired = self._repair(request, tokens, hit)
            if repaired is not None:
                return repaired
        if hit.pages == 0:
            return self.empty_kv_cache_blocks, 0, 0
        self.counters["hit_tokens"] += hit.pages * P
        blocks = self.hit_rows.rows(*hit.page_ids())
        assert blocks is not None
        return self.create_kv_cache_blocks(blocks), hit.pages * P, 0

    def _repair(self, request: Any, tokens: np.ndarray, hit: Hit) -> tuple[KVCacheBlocks, int, int] | None:
        """Repair case 2 (:meth:`repair_windows`): the device's full KV past the
        window-safe ``hit``, with fresh blocks for the window the connector loads,
        or None (the window-safe hit as it is).  O(depth + pages + window blocks)."""
        P = self.page_size
        safe, raw = hit.pages * P, hit.raw_pages * P
        assert self._window_hit is not None
        local, end = self._window_hit(request, safe, raw) or (0, 0)
        if not (safe < local <= raw and local < end and local % P == 0):
            return None
        live = self._live[request.request_id]
        live.reach, path = self.lifecycle.reach(tokens, self.namespace(request), local // P)  # its full KV
        rows = self.hit_rows.rows(*parts_pages(path), end, safe)
        want = 0 if rows is None else sum(b is None for row in rows for b in row)
        short = want - self.block_pool.get_num_free_blocks()
        if rows is None or (short > 0 and not (self._make_room(short)
                                               and self.block_pool.get_num_free_blocks() >= want)):
            self._drop_repair(live)
            self._window_hit(request, safe, safe)  # the connector drops its plan
            return None
        live.fresh = self.block_pool.get_new_blocks(want)  # one reference each: ours until vLLM takes them
        new = iter(live.fresh)
        self.counters["hit_tokens"] += local
        self.counters["window_repairs"] += 1
        self.counters["repaired_tokens"] += local - safe
        return self.create_kv_cache_blocks(tuple([next(new) if b is None else b for b in row]
                                                 for row in rows)), local, 0

    def _drop_repair(self, live: _Live) -> None:
        """Give back a window repair's fresh blocks vLLM did not take and its lock."""
        if live.fresh:
            self.block_pool.free_blocks(live.fresh)
            live.fresh = []
        if live.reach.node is not None:
            self.lifecycle.end(live.reach)
            live.reach = LockHandle(None)

    def device_full_tokens(self, request_id: str) -> int:
        """Tokens of the request's last lookup whose full KV the tree holds (its match
        before the window rule; 0 for a request not known).  O(1)."""
        live = self._live.get(request_id)
        return live.raw_pages * self.page_size if live is not None else 0

    def _track(self, request: Any, handle: LockHandle, hit_pages: int, raw_pages: int) -> None:
        live = self._live.get(request.request_id)
        if live is None:
            self._live[request.request_id] = _Live(request, handle, hit_pages, raw_pages, scan_mark=hit_pages,
                                                   looked=True)
        else:
            live.handle, live.hit_pages, live.raw_pages = handle, hit_pages, raw_pages
            live.scan_mark = max(live.scan_mark, hit_pages)
            live.looked = True

    def _rows(self, request: Any, layout: Layout) -> list[list[Any]]:
        mgrs = self.coordinator.single_type_managers
        return [mgrs[g].req_to_blocks.get(request.request_id, []) for g in layout.groups]

    # ------------------------------------------------------ SWA retention
    def _hold_swa(self, request: Any, computed: int) -> None:
        """Before vLLM frees the request's out-of-window SWA blocks (those before
        ``get_num_skipped_tokens(computed)``), take a reference on the pages the
        retention policy keeps.  O(new pages)."""
        live = self._live.get(request.request_id)
        if live is None or not self._cacheable(request):
            return
        P = self.page_size
        # a page is lost once any group frees any of its blocks: the most skipped, rounded up
        upto = -(-max(mgr.get_num_skipped_tokens(computed) for mgr in self._swa_managers) // P)
        lo = live.scan_mark
        if upto <= lo:
            return
        live.scan_mark = upto
        keep = self.lifecycle.kept_runs(lo, upto, live.raw_pages * P, live.hit_pages * P, request.num_prompt_tokens)
        plenty = (self.options.swa_release is SwaHold.ADAPTIVE and self.block_pool.get_num_free_blocks()
                  > self.options.spare_fraction * self.block_pool.num_gpu_blocks)
        rows = self._rows(request, self.swa_layout)
        kept = {i for a, b in keep for i in range(a, b)}
        for i in (range(lo, upto) if plenty else sorted(kept)):
            blocks = self.swa_layout.page_blocks(rows, i)
            if blocks is not None:
                self.block_pool.touch(blocks)
                (live.held if i in kept else live.spare)[i] = blocks
                self.counters["held_swa_pages"] += 1

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        live = self._live.get(request_id)
        if live is not None:
            self._hold_swa(live.request, processed_computed_tokens)
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    # --------------------------------------------------------- allocation
    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, *args: Any, **kwargs: Any
                       ) -> KVCacheBlocks | None:
        """vLLM's allocation; when blocks are short, hybridkv evicts and retries.  A
        request with a hit keeps its lock (the hit's blocks cannot be evicted under it)."""
        if request.request_id not in self._live and self._cacheable(request):
            self._live[request.request_id] = _Live(request, LockHandle(None))
        self._checkpoint(request)
        total = request.num_computed_tokens + num_new_computed_tokens + kwargs.get("num_external_computed_tokens", 0)
        self._hold_swa(request, max(0, total - getattr(request, "num_in_flight_tokens", 0)))
        while True:
            got = super().allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                         *args, **kwargs)
            if got is not None:
                live = self._live.get(request.request_id)
                if live is not None and kwargs.get("delay_cache_blocks"):  # an async load runs first
                    live.loading = True
                if live is not None and live.fresh:  # vLLM holds the repair's fresh blocks now
                    self.block_pool.free_blocks(live.fresh)
                    live.fresh = []
                return got
            short = self._shortfall(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                    args, kwargs)
            if not self._make_room(short):
                self._drop_lookup(request)
                return None

    def _shortfall(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int,
                   new_computed_blocks: KVCacheBlocks | None, args: tuple, kwargs: dict) -> int:
        """Blocks ``allocate_slots`` lacked (vLLM's own count for these arguments,
        after it released the request's skipped blocks).  O(request blocks)."""
        a = _ALLOC_SIG.bind(self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                            *args, **kwargs)
        a.apply_defaults()
        v = a.arguments
        blocks = new_computed_blocks.blocks if new_computed_blocks is not None else self.empty_kv_cache_blocks.blocks
        local = request.num_computed_tokens + num_new_computed_tokens
        computed = local + v["num_external_computed_tokens"]
        main = min(computed, self.max_model_len) + num_new_tokens
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        common = dict(request_id=request.request_id, new_computed_blocks=blocks,
                      num_encoder_tokens=v["num_encoder_tokens"], total_computed_tokens=computed,
                      num_local_computed_tokens=local, prefill_end=prefill_end)
        need = self.coordinator.get_num_blocks_to_allocate(
            num_tokens=min(main + v["num_lookahead_tokens"], self.max_model_len), num_tokens_main_model=main,
            **common) + v["reserved_blocks"]
        if v["full_sequence_must_fit"]:
            whole = min(request.num_tokens, self.max_model_len)
            need = max(need, self.coordinator.get_num_blocks_to_allocate(
                num_tokens=whole, num_tokens_main_model=whole, apply_admission_cap=True, **common))
        if v["has_scheduled_reqs"] and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            need += self.watermark_blocks
        return max(1, need - self.block_pool.get_num_free_blocks())

    def _drop_lookup(self, request: Any) -> None:
        """A waiting request vLLM could not admit gives its hit's lock back (it looks
        up again when tried next); a running one keeps everything."""
        live = self._live.get(request.request_id)
        if live is None or request.num_computed_tokens != 0:
            return
        self._drop_repair(live)
        if live.handle.node is not None:
            self.lifecycle.end(live.handle)
            live.handle = LockHandle(None)
            live.hit_pages = live.scan_mark = 0

    def _make_room(self, blocks: int) -> bool:
        """Free ``blocks`` blocks: the spare holds of live requests first, then the
        tree's eviction (by blocks).  False when nothing could be freed.  O(k log n)."""
        before = self.block_pool.get_num_free_blocks()
        for live in self._live.values():
            self.counters["released_holds"] += self._release_spare(live)
        freed = self.block_pool.get_num_free_blocks() - before
        if freed < blocks:
            nf, ns = self.tree.evict(nbytes=blocks - freed)
            self.counters["evicted_blocks"] += (nf * self.full_layout.blocks_per_page
                                                + ns * self.swa_layout.blocks_per_page)
        return self.block_pool.get_num_free_blocks() > before

    # ------------------------------------------------------------- finish
    def _computed_pages(self, request: Any) -> int:
        """Whole pages whose KV is computed (tokens scheduled but still in flight, and
        output placeholders not yet known, excluded)."""
        computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        return max(0, min(computed, len(request.all_token_ids))) // self.page_size

    def _insert(self, request: Any, live: _Live, n: int) -> Any:
        """Cache pages ``[0, n)`` of the request (computed); the tree takes a reference
        on each block it keeps, its duplicates go back.  Returns the node ending
        at ``n`` (None: nothing inserted).  O(depth + new pages)."""
        P = self.page_size
        lo = live.hit_pages if live.handle.node is not None else 0
        if n <= lo:
            return None
        if not self.lifecycle.lock_ends_at(live.handle, lo):
            self.counters["insert_skipped"] += 1  # cannot happen while locked: never free what we did not take
            return None
        rows_f = self._rows(request, self.full_layout)
        rows_s = self._rows(request, self.swa_layout)
        pages_f = [self.full_layout.page_blocks(rows_f, i) for i in range(lo, n)]
        if any(b is None for b in pages_f):
            return None  # blocks already handed back (cannot happen before free)
        full = np.zeros(n, np.int32)  # [0, lo): the locked path, skipped by the walk
        swa = np.full(n, _NO_PAGE, np.int32)
        for i in range(lo, n):
            full[i] = self.pool.take(pages_f[i - lo])
            blocks = live.held.pop(i, None) or live.spare.pop(i, None)
            if blocks is not None:
                swa[i] = self.pool.take(blocks, held=True)  # the hold's reference moves
            else:
                blocks = self.swa_layout.page_blocks(rows_s, i)
                if blocks is not None:
                    swa[i] = self.pool.take(blocks)
        tokens = np.asarray(request.all_token_ids[:n * P], dtype=np.int32)
        # start is this request's own (its counted hit, or its last chunk's insert):
        # chunks of one prompt are not reuses of each other (continued)
        names = self._namer(request, lo, n) if self._namer is not None else None
        res = self.lifecycle.insert(live.handle, lo, tokens, full, swa, self.namespace(request),
                                    mark=request.num_prompt_tokens // P, continued=True, names=names)
        assert res is not None  # lock_ends_at held above, and nothing ran in between
        self.counters["inserted_pages"] += res.new_pages
        return res.node

    def _checkpoint(self, request: Any) -> None:
        """While a prompt is prefilled, cache what is computed so far (other requests
        hit it at once, as vLLM's own cache allows) and move the lock there."""
        live = self._live.get(request.request_id)
        if live is None or not self._cacheable(request) or request.num_computed_tokens > request.num_prompt_tokens:
            return
        n = self._computed_pages(request)
        if n <= live.hit_pages:
            return
        node = self._insert(request, live, n)
        if node is None:
            return
        try:
            handle = self.lifecycle.move_lock(live.handle, node)
        except ValueError:  # the window before n is not held (a sliding group freed it): keep the old lock
            self.counters["checkpoint_unlocked"] += 1
            return
        live.handle, live.hit_pages = handle, n
        live.scan_mark = max(live.scan_mark, n)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """vLLM's caching after a connector's load finished: the load is confirmed."""
        live = self._live.get(request.request_id)
        if live is not None:
            live.loading = False
        super().cache_blocks(request, num_computed_tokens)

    def _finish(self, request: Any) -> None:
        live = self._live.pop(request.request_id, None)
        if live is None:
            return
        # a request freed before the connector's load is confirmed (aborted, or failed under
        # vLLM's ``fail`` policy) counts the external tokens computed: they hold no KV
        if self._cacheable(request) and not live.loading and request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            self._insert(request, live, self._computed_pages(request))
        self.lifecycle.end(live.handle)
        self._drop_repair(live)
        self._release_held(live)

    def free(self, request: Any) -> None:
        self._finish(request)
        blocks = [b for g in self.coordinator.get_blocks(request.request_id) for b in g]  # [] if unknown
        super().free(request)
        gone = {b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None}
        if gone:
            self.block_pool.evict_blocks(gone)

    def pop_blocks_for_free(self, request: Any) -> list[Any]:
        self._finish(request)
        return super().pop_blocks_for_free(request)

    # -------------------------------------------------------------- admin
    def reset_prefix_cache(self) -> bool:
        """Drop the whole tree and vLLM's hash table; False (nothing changed) while a
        request holds a hit."""
        if any(live.handle.node is not None for live in self._live.values()):
            return False
        self.tree.evict(full_pages=self.tree.full_pages_cached, swa_pages=self.tree.swa_pages_cached)
        if self.tree.full_pages_cached:
            return False
        self.tree.runs.keep_within(0)  # dropped: what L2 holds of them stays known (orphans: on_drop)
        self._new_tree()
        self.pool.more.clear()
        return super().reset_prefix_cache()

    @property
    def usage(self) -> float:
        """Blocks in use by requests (what the tree holds and could evict counts as free)."""
        total = self.block_pool.num_gpu_blocks - 1
        cached = (self.tree.evictable_full_pages() * self.full_layout.blocks_per_page
                  + self.tree.evictable_swa_pages() * self.swa_layout.blocks_per_page)
        used = total - self.block_pool.get_num_free_blocks() - cached
        return max(0.0, min(1.0, used / total)) if total > 0 else 0.0

    def check_invariants(self) -> None:
        """The tree's invariants; every page it holds is owned and referenced; with no
        request live, every referenced or hashed block is the tree's (one reference)
        -- so vLLM's KV events name only blocks that can hit.  O(blocks)."""
        self.tree.check_invariants()
        bp, pool = self.block_pool, self.pool
        held: set[int] = set()
        for node in self.tree.iter_nodes():
            for p in node.full.tolist() + node.swa[node.swa >= 0].tolist():
                assert pool.owned[p], f"page {p} cached but not marked owned"
                for b in pool.blocks(p):
                    assert b.ref_cnt >= 1, f"block {b.block_id} of page {p} cached with ref_cnt 0"
                    held.add(b.block_id)
        assert int(pool.owned.sum()) == self.tree.full_pages_cached + self.tree.swa_pages_cached
        if self._live:
            return
        for b in bp.blocks:
            if b.is_null:
                continue
            if b.block_id in held:
                assert b.ref_cnt == 1, f"block {b.block_id}: ref_cnt {b.ref_cnt}, the tree's alone"
            else:
                assert b.ref_cnt == 0, f"block {b.block_id}: ref_cnt {b.ref_cnt} with no request live"
                assert b.block_hash is None, f"block {b.block_id} keeps a hash the tree does not hold"


for _name in _VLLM_STATE:
    setattr(HybridKVCacheManager, _name, _delegate(_name))
del _name
