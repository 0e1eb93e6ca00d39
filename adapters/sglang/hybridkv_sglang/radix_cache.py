"""hybridkv's window-safe tree as SGLang 0.5.23's prefix cache for hybrid SWA models.

Selected with ``--radix-cache-backend hybridkv`` (registered by
:mod:`hybridkv_sglang.plugin` through SGLang's ``sglang.srt.plugins`` entry
point).  SGLang keeps its own pools and its ``SWATokenToKVPoolAllocator``; the
tree decides what is a hit and what is evicted, and gives pages back through
:class:`~hybridkv_sglang.pool.SGLangPagePool`.

How the SGLang contract maps onto the tree (SGLang 0.5.23 names):

=============================  ==============================================
SGLang call                    here
=============================  ==============================================
``match_prefix``               ``Lifecycle.match`` (split): the largest
                               page-aligned *window-safe* prefix; the node ends
                               exactly there so the scheduler can lock it
``lock`` / ``inc_lock_ref``    ``Lifecycle.lock``: path lock on full KV + pin of the
                               W-token SWA window ending at the node
``checkpoint(req, up_to)``     ``Lifecycle.insert`` of ``[0, up_to)`` with the SWA
                               pages SGLang still maps (released SWA is -1),
                               row rewritten onto the tree's pages, lock moved
                               (0.5.23's replacement for ``cache_unfinished_req``
                               and, when ``req.finished()``, ``cache_finished_req``)
``evict(num_tokens, swa_num_tokens)``  ``tree.evict(full_pages, swa_pages)``
``evict_sliding_windows``      SGLang's own out-of-window release of the
                               request's private SWA (base class)
``host_hit_length``            with tiers: L2 (and landed L3) tokens past the
                               L1 hit, window safe (:mod:`.tiers`)
``init_load_back``             with tiers: L2 -> L1 copy, tree insert, mapping
                               adopted, re-match (all or none of the promise)
sizes                          tree counters x page size
=============================  ==============================================

Differences from SGLang's ``UnifiedRadixCache`` SWA component, by design:
SWA of cached prompts stays in the tree after the request moved on (evictable,
cheapest-first: SWA that ends no hit goes before tails, retention checkpoints
and branch windows, and all of it before full KV), so full KV is kept broadly
while SWA is kept where hits end.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch

from hybridkv.defaults import SWA_CHECKPOINT
from hybridkv._validate import as_token_array
from hybridkv.lifecycle import Lifecycle
from hybridkv.radix import LockHandle, TreeConfig, TreeNode, WindowSafeTree
from hybridkv.radix import PageNames
from hybridkv.tiers.config import TierConfig
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams

from .pool import SGLangPagePool
from .layer_loads import LayerLoads
from .tiers import SGLangTierCoordinator, tiers_from_env

__all__ = ["HybridKVRadixCache", "namespace_of"]

logger = logging.getLogger(__name__)

_EMPTY64 = torch.zeros(0, dtype=torch.int64)


def namespace_of(extra_key: Optional[str], cache_salt: Optional[str]) -> str:
    """Tree namespace of a RadixKey: LoRA/extra key and cache salt never share nodes."""
    return f"{extra_key!r}/{cache_salt!r}"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an int, got {raw!r}") from None


class HybridKVRadixCache(BasePrefixCache):
    """SGLang ``BasePrefixCache`` on hybridkv's :class:`WindowSafeTree`.

    Args:
        params: SGLang's ``CacheInitParams``; ``token_to_kv_pool_allocator``
            must be an ``SWATokenToKVPoolAllocator`` and ``sliding_window_size``
            set.  EAGLE bigram keys are not supported.
        swa_checkpoint: K, tokens between SWA retention checkpoints (0: off);
            default ``$HYBRIDKV_SWA_CHECKPOINT`` or
            :data:`hybridkv.defaults.SWA_CHECKPOINT`.
        swa_eviction: ``"page"`` (hybridkv), ``"node"`` or ``"none"``
            (baselines); default ``$HYBRIDKV_SWA_EVICTION`` or ``"page"``.
        tiers: hybridkv's lower tiers (a :class:`~hybridkv.tiers.config.TierConfig`:
            L2 host bytes, L3 URL, write policy), or None for
            :func:`~hybridkv_sglang.tiers.tiers_from_env` (``$HYBRIDKV_L2_BYTES``,
            ``$HYBRIDKV_L3``, ``$HYBRIDKV_WRITE_POLICY``; unset: no tiers).  With
            tiers, ``match_prefix`` reports L2/L3 hits as ``host_hit_length`` and
            ``init_load_back`` loads them (see :mod:`hybridkv_sglang.tiers`).
        tier_scope: the model and shard named in the tiers' page keys (the plugin
            passes the model path and TP/PP rank), so a shared L3 never mixes them.
        tier_spec: the ``ModelSpec`` L2 lays out and prices pages by (default the
            pools'; see :class:`~hybridkv_sglang.tiers.SGLangTierCoordinator`).
        layer_counter: SGLang's ``LayerDoneCounter`` registered with the KV pool
            and the worker (the plugin does it under ``--enable-hierarchical-cache``):
            loads are then queued at ``init_load_back`` and issued layer by layer
            by ``ready_to_load_host_cache`` (:mod:`hybridkv_sglang.layer_loads`);
            None: they run inside ``init_load_back``.

    Node handles are hybridkv ``TreeNode`` objects; each namespace has its own
    root.  Not thread-safe (SGLang's scheduler is single-threaded).
    """

    def __init__(self, params: CacheInitParams, *, swa_checkpoint: int | None = None,
                 swa_eviction: str | None = None, tiers: TierConfig | None = None,
                 tier_scope: str = "sglang", tier_spec: Any = None, layer_counter: Any = None) -> None:
        if not isinstance(params, CacheInitParams):
            raise TypeError(f"params must be SGLang's CacheInitParams, got {type(params).__name__}")
        if params.sliding_window_size is None or params.sliding_window_size < 1:
            raise ValueError("params.sliding_window_size must be set: hybridkv's SGLang backend is for "
                             f"hybrid SWA models, got {params.sliding_window_size!r}")
        if params.is_eagle:
            raise ValueError("params.is_eagle: EAGLE bigram keys are not supported by the hybridkv backend")
        self.disable = bool(params.disable)
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = int(params.page_size)
        self.sliding_window_size = int(params.sliding_window_size)
        self.draft_swa_window = int(params.draft_swa_window or 0)
        self.pool = SGLangPagePool(self.token_to_kv_pool_allocator)
        if self.pool.page_size != self.page_size:
            raise ValueError(f"allocator page size {self.pool.page_size} != params.page_size {self.page_size}")
        checkpoint = _env_int("HYBRIDKV_SWA_CHECKPOINT", SWA_CHECKPOINT) if swa_checkpoint is None else swa_checkpoint
        eviction = os.environ.get("HYBRIDKV_SWA_EVICTION", "page") if swa_eviction is None else swa_eviction
        # The tree's window is what every reader of the SWA pool needs (a fused
        # draft may read further back than the model's own window).
        self.tree_config = TreeConfig(self.page_size, max(self.sliding_window_size, self.draft_swa_window),
                                      checkpoint, eviction)
        if params.enable_metrics:
            self.init_metrics_collector()
        self.counters = {"match_calls": 0, "hit_tokens": 0, "raw_match_tokens": 0,
                         "checkpoints": 0, "unsafe_tail_locks": 0, "host_hit_tokens": 0, "loaded_tokens": 0}
        if tiers is not None and not isinstance(tiers, TierConfig):
            raise TypeError(f"tiers must be a TierConfig or None, got {type(tiers).__name__}")
        self.tier_config = tiers if tiers is not None else tiers_from_env()
        self.tier_scope = tier_scope
        self.tier_spec = tier_spec
        self.layer_counter = layer_counter
        self.coordinator: SGLangTierCoordinator | None = None
        # SGLang's scheduler reads these with --enable-hierarchical-cache: a load is
        # issued whole by ready_to_load_host_cache, nothing is in flight past a batch
        self.cache_controller = None
        self.ongoing_write_through: dict = {}
        self.ongoing_load_back: dict = {}
        self.enable_storage = False
        self.reset()

    # ================================================================ basics
    def reset(self) -> None:
        """Forget everything (SGLang clears its allocator alongside).  O(1)."""
        self.tree = WindowSafeTree(self.tree_config, self.pool)
        # the request lifecycle every host shares: SGLang matches, then locks
        # (inc_lock_ref), and checkpoints (insert, lock moved)
        self.lifecycle = Lifecycle(self.tree)
        self.pool.reset()
        self._locks: dict[int, list[LockHandle]] = {}
        self.root_node = self.tree.root(namespace_of(None, None))
        self._tier_reqs: dict[Any, dict] = {}  # rid -> match tokens, load plan, tier extra
        if self.tier_config is not None and not self.disable:
            if self.coordinator is not None:
                self.coordinator.close()  # L2 goes with L1 (SGLang's flush_cache clears HiCache too)
            self.coordinator = SGLangTierCoordinator(self.token_to_kv_pool_allocator, self.tree,
                                                     self.tree_config.window, self.tier_config,
                                                     self.tier_scope, self.tier_spec)
            if self.layer_counter is not None:
                loads = LayerLoads(self.token_to_kv_pool_allocator.get_kvcache(), self.layer_counter)
                self.coordinator.layer_loads = self.coordinator.pool.loads = loads

    def supports_swa(self) -> bool:
        return True

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def is_root(self, node: Any) -> bool:
        return node is None or node.parent is None

    def root_node_handle(self, extra_key: Optional[str] = None) -> Any:
        return self.tree.root(namespace_of(extra_key, None))

    def _key_tokens(self, key: Any) -> tuple[np.ndarray, str]:
        if getattr(key, "is_bigram", False):
            raise ValueError("key: bigram (EAGLE) RadixKeys are not supported")
        raw = key.raw_token_ids()
        tokens = np.frombuffer(raw, dtype=np.int64) if raw.itemsize == 8 else np.asarray(raw, dtype=np.int64)
        return tokens, namespace_of(key.extra_key, key.cache_salt)

    # ================================================================= match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Largest page-aligned window-safe prefix of ``params.key``.

        Splits the last node so one ends exactly at the hit (the scheduler locks
        it).  Runtime: that of :meth:`WindowSafeTree.match`.
        """
        key = params.key
        tokens, ns = self._key_tokens(key)
        if self.disable or len(tokens) < self.page_size:
            root = self.tree.root(ns)
            return MatchResult(0, root, root, root)
        safe, raw, node = self.lifecycle.match(as_token_array(tokens, "key"), ns)
        node = node if node is not None else self.tree.root(ns)
        ps = self.page_size
        self.counters["match_calls"] += 1
        self.counters["hit_tokens"] += safe * ps
        self.counters["raw_match_tokens"] += raw * ps
        host = 0
        req = getattr(params, "req", None)
        if self.coordinator is not None and req is not None:
            # one token past the key: the coordinator matches (len - 1) // P pages
            ext = as_token_array(np.append(tokens, 0), "key")  # int32, as the tree and page keys take
            state = self._tier_reqs.setdefault(req.rid, {})
            # a request's first match waits (bounded) for its L3 read-ahead; later
            # rounds of a waiting request read what has landed in L2 meanwhile
            host = self.coordinator.lower_hit_pages(ext, ns, safe, wait_l3="tokens" not in state) * ps
            state.update(tokens=ext, ns=ns)
            self._trim_tier_reqs()
            self.counters["host_hit_tokens"] += host
        return MatchResult(device_prefix_len=safe * ps, last_device_node=node, last_host_node=node,
                           best_match_node=node, host_hit_length=host, full_kv_hit_length=max(raw * ps, safe * ps + host))

    # ============================================================ lower tiers
    def init_load_back(self, params: InitLoadBackParams) -> tuple[int, Any]:
        """Load the request's L2 (and landed L3) hit into L1 at admission: the
        coordinator copies the pages H2D and inserts them into the tree, SGLang's
        full->SWA mapping is made to follow the tree on the path, and the hit is
        re-matched (so it is what was actually loaded).  Returns ``(loaded tokens,
        new last node)``; ``(0, old node)`` when less than the promised
        ``host_hit_length`` arrived (SGLang's all-or-none rule; the loaded pages
        stay cached).  Runtime: O(L / P) plus the copies."""
        req = params.req
        state = self._tier_reqs.get(getattr(req, "rid", None)) if req is not None else None
        if self.coordinator is None or state is None or "tokens" not in state:
            return 0, params.best_match_node
        ext, ns = state["tokens"], state["ns"]
        before = int(req.prefix_len)
        plan = self.coordinator.before_match(ext, ns)
        safe, _, node = self.lifecycle.match(ext[:-1], ns, touch=False)
        node = node if node is not None else self.tree.root(ns)
        full, swa = self._path_pages(node)
        self.pool.adopt(full, swa)  # loaded pages (and SWA adopted below the old hit)
        loaded = safe * self.page_size - before
        if loaded <= 0 or loaded < int(params.host_hit_length):
            if self.coordinator.layer_loads is not None:
                self.coordinator.layer_loads.flush()  # cached but unlocked: loaded now
            return 0, req.last_node
        state["plan"] = plan
        self.counters["loaded_tokens"] += loaded
        return loaded, node

    def ready_to_load_host_cache(self) -> int:
        """The scheduler's call before the batch's forward: issue the loads the
        batch's ``init_load_back`` calls queued, layer by layer, and return the
        ``LayerDoneCounter`` producer index the worker waits on (-1: nothing to
        wait for; always -1 without a layer counter, the copies having run in
        ``init_load_back``).  O(queued bytes)."""
        loads = self.coordinator.layer_loads if self.coordinator is not None else None
        return loads.issue() if loads is not None else -1

    def check_hicache_events(self) -> None:
        """Nothing to reconcile: the L3 workers land reads in L2 under the tiers' lock."""

    def clear_storage_backend(self) -> bool:
        """SGLang's ``/clear_hicache_storage``: drops L2 (L3 is the backend's own to clear)."""
        if self.coordinator is not None:
            self.coordinator.clear_l2()
        return True

    @property
    def token_to_kv_pool_host(self) -> Any:
        """What SGLang's HiCache metrics read of a host pool (``logical_size``,
        ``available_size()`` in tokens): L2's full pages, or None without tiers."""
        return None if self.coordinator is None else _HostView(self.coordinator.host.pool, self.page_size)

    def tier_stats(self) -> dict[str, Any]:
        """The tier coordinator's counters ({} without tiers)."""
        return self.coordinator.stats() if self.coordinator is not None else {}

    def close(self) -> None:
        """Stop the L3 worker and close a backend opened from a URL."""
        if self.coordinator is not None:
            self.coordinator.close()

    def _trim_tier_reqs(self, cap: int = 8192) -> None:
        """Forget the oldest matched-but-never-admitted requests (a waiting request
        aborted before admission gets no ``on_release``).  Amortised O(1)."""
        if len(self._tier_reqs) <= cap:
            return
        for rid in [r for r, st in self._tier_reqs.items() if "extra" not in st][:len(self._tier_reqs) - cap // 2]:
            del self._tier_reqs[rid]

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        self._tier_reqs.pop(getattr(req, "rid", None), None)

    def _tier_account(self, req: Any, protected: int) -> None:
        """The request's first checkpoint: account its admitted hit of
        ``protected`` pages (per-tier figures; repairs 3 and 4).  O(hit pages)."""
        state = self._tier_reqs.setdefault(req.rid, {})
        _, hit_swa = self._path_pages(req.last_node)  # empty at the root
        hit = len(hit_swa) if len(hit_swa) <= protected else 0
        tokens = as_token_array(np.asarray(req.full_untruncated_fill_ids[:hit * self.page_size]), "tokens")
        state["extra"] = self.coordinator.account_hit(tokens, namespace_of(req.extra_key, req.cache_salt), hit,
                                                      hit_swa[:hit], state.pop("plan", None))

    def _tier_checkpoint(self, req: Any, tokens: np.ndarray, ns: str, protected: int, full: np.ndarray,
                         swa: np.ndarray) -> PageNames | None:
        """Before the insert: write the new pages through to L2 (repair 1); returns
        the pages' names for the insert.  O(pages)."""
        extra = self._tier_reqs.setdefault(req.rid, {}).setdefault("extra", {})
        tokens = as_token_array(tokens, "tokens")  # the page keys hash int32 tokens, as at match
        # the coordinator sees the SWA the request can read: the tree's on [0, protected)
        # (write-back's repair 1 copies the device window the host lacks)
        _, path_swa = self._path_pages(req.last_node)
        if protected and len(path_swa) == protected:
            swa = np.concatenate([path_swa, swa[protected:]]).astype(np.int32)
        return self.coordinator.checkpoint(tokens, ns, protected, full, swa, extra)

    def touch_prefix(self, key: Any) -> None:
        tokens, ns = self._key_tokens(key)
        if not self.disable and len(tokens) >= self.page_size:
            self.tree.match(tokens, ns, touch=True)

    def path_device_indices(self, node: Any) -> torch.Tensor:
        """Full-pool token slots of the path root -> ``node`` (int64).  O(depth + L)."""
        full, _ = self._path_pages(node)
        return self.pool.tokens(full) if full.size else _EMPTY64

    @staticmethod
    def _path_pages(node: Any) -> tuple[np.ndarray, np.ndarray]:
        fulls, swas = [], []
        while node is not None and node.parent is not None:
            fulls.append(node.full)
            swas.append(node.swa)
            node = node.parent
        if not fulls:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        return np.concatenate(fulls[::-1]), np.concatenate(swas[::-1])

    # ================================================================= locks
    def inc_lock_ref(self, node: Any) -> IncLockRefResult:
        """Lock the path to ``node`` and pin its SWA window.  O(depth)."""
        if self.disable or self.is_root(node):
            return IncLockRefResult(delta=0)
        before = self.tree.protected_full_pages
        handle = self.lifecycle.lock(node)
        self._locks.setdefault(node.nid, []).append(handle)
        return IncLockRefResult(delta=-(self.tree.protected_full_pages - before) * self.page_size)

    def dec_lock_ref(self, node: Any, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        """Release one lock taken on ``node``.  O(depth)."""
        if self.disable or self.is_root(node):
            return DecLockRefResult(delta=0)
        handles = self._locks.get(node.nid)
        if not handles:
            raise ValueError(f"node {node.nid} holds no lock taken through this cache")
        before = self.tree.protected_full_pages
        self.lifecycle.end(handles.pop())
        if not handles:
            del self._locks[node.nid]
        return DecLockRefResult(delta=(before - self.tree.protected_full_pages) * self.page_size)

    # ============================================================ checkpoint
    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        """Insert the request's page-aligned ``[0, up_to)`` and move its lock.

        SWA pages the request already released (mapping 0) go in as missing;
        pages the tree already caches replace the request's duplicates in its
        row (the tree frees the duplicates).  Sets ``req.kv.cache_protected_len``
        to the inserted length.  Runtime: O(depth + up_to / page_size).
        """
        if self.disable:
            return
        kv = req.kv
        n_pages = min(int(up_to), len(req.full_untruncated_fill_ids)) // self.page_size
        protected = kv.cache_protected_len // self.page_size
        if self.coordinator is not None and "extra" not in self._tier_reqs.get(req.rid, {}):
            self._tier_account(req, protected)
        if n_pages <= protected:
            return
        length = n_pages * self.page_size
        tokens = np.asarray(req.full_untruncated_fill_ids[:length], dtype=np.int64)
        full = self._row_pages(req, protected, n_pages)
        # [0, protected) is the tree's own path (the row was rewritten onto it at
        # match or at the last checkpoint): its SWA is the tree's, not the
        # request's, so only the new pages carry SWA.  Keeps a checkpoint's
        # mapping reads O(new pages) instead of O(up_to).
        swa = np.full(n_pages, -1, dtype=np.int32)
        swa[protected:] = self.pool.swa_pages_of(full[protected:])
        ns = namespace_of(req.extra_key, req.cache_salt)
        names = None
        if self.coordinator is not None:
            names = self._tier_checkpoint(req, tokens, ns, protected, full, swa)
        # Record owners before the insert: the tree may free duplicates right away.
        self.pool.adopt(full[protected:], swa[protected:])
        # the prompt's length: past it the tokens are decoded output (the learned
        # divergence model measures from the prompt's end)
        prompt = getattr(req, "origin_input_ids", None)
        # from the root (SGLang's row holds the locked path's pages, compared as equal)
        result = self.lifecycle.insert(LockHandle(None), 0, as_token_array(tokens, "tokens"), full, swa, ns,
                                       mark=-1 if prompt is None else len(prompt) // self.page_size, names=names)
        assert result is not None
        path_full, path_swa = self._path_pages(result.node)
        assert path_full.size == n_pages, (path_full.size, n_pages)
        # Duplicates and adopted SWA: make the mapping and the row follow the tree.
        self.pool.adopt(path_full[protected:], path_swa[protected:])
        self.req_to_token_pool.write((kv.req_pool_idx, slice(protected * self.page_size, length)),
                                     self.pool.tokens(path_full[protected:]).to(torch.int32))
        self.unlock(req.lock)
        req.lock = self._lock_checkpoint(result.node, req)
        kv.cache_protected_len = length
        kv.cache_inserted_len = max(kv.cache_inserted_len, length)
        req.last_node = result.node
        self.counters["checkpoints"] += 1

    def _row_pages(self, req: Any, protected: int, n_pages: int) -> np.ndarray:
        """Full page ids of the request's row ``[0, n_pages)`` (int32).  The new
        pages ``[protected, n_pages)`` must be whole pages of SGLang's paged
        allocation (slot ``i`` of a page at ``page_start + i``): a row that is not
        would put a page's other slots in the tree under the wrong page id, so it
        raises ValueError naming ``req``.  O(n_pages + new tokens)."""
        ps = self.page_size
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n_pages * ps]
        full = row[::ps].to(torch.int64)
        if ps > 1:
            new = row[protected * ps:].to(torch.int64)
            off = new != self.pool.tokens(full[protected:] // ps)
            if bool(off.any()):
                bad = protected + int(torch.nonzero(off)[0, 0]) // ps
                raise ValueError(f"req {getattr(req, 'rid', '?')}: row page {bad} (positions {bad * ps}.."
                                 f"{bad * ps + ps - 1}) is not one whole page of size {ps}; SGLang's paged "
                                 "alloc_extend / alloc_decode give page-aligned rows")
            full = full // ps
        return full.cpu().numpy().astype(np.int32)

    def _lock_checkpoint(self, node: TreeNode, req: Any) -> Any:
        """Lock ``node``; if its SWA window is gone (only possible for a finished
        request whose tail window was released) lock nothing: the request is
        released right after and the tree owns the pages either way."""
        try:
            return self.lock(node)
        except ValueError:
            if not req.finished():
                raise
            self.counters["unsafe_tail_locks"] += 1
            return None

    # ============================================================== eviction
    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``num_tokens`` full and ``swa_num_tokens`` SWA tokens if
        unlocked data allows (SWA that ends no hit first).  O(k log n)."""
        if self.disable:
            return EvictResult()
        start = time.perf_counter()
        ps = self.page_size
        full_pages = -(-max(0, int(params.num_tokens)) // ps)
        swa_pages = -(-max(0, int(params.swa_num_tokens)) // ps)
        nf, ns = self.tree.evict(full_pages=full_pages, swa_pages=swa_pages)
        self.update_eviction_metrics(nf * ps, start)
        return EvictResult(num_tokens_evicted=nf * ps, swa_num_tokens_evicted=ns * ps)

    # ================================================================= sizes
    def evictable_size(self) -> int:
        return self.full_evictable_size()

    def full_evictable_size(self) -> int:
        return self.tree.evictable_full_pages() * self.page_size

    def swa_evictable_size(self) -> int:
        return self.tree.evictable_swa_pages() * self.page_size

    def protected_size(self) -> int:
        return self.full_protected_size()

    def full_protected_size(self) -> int:
        return self.tree.protected_full_pages * self.page_size

    def swa_protected_size(self) -> int:
        return self.tree.protected_swa_pages * self.page_size

    def total_size(self) -> int:
        return self.tree.full_pages_cached * self.page_size

    def dfs_weight_order(self, node_handles: Sequence[Any]) -> list[int]:
        # Namespaces have separate roots; keep arrival order (LPM scheduling
        # still sorts by prefix length on its own).
        return list(range(len(node_handles)))

    def pretty_print(self) -> None:
        print(f"hybridkv tree: {self.tree.num_nodes} nodes, {self.total_size()} full tokens, "
              f"{self.tree.swa_pages_cached * self.page_size} SWA tokens, namespaces {self.tree.namespaces()}")

    def sanity_check(self) -> None:
        """Tree invariants plus: SGLang's full->SWA mapping equals the tree's SWA
        pages on every token of every cached page.  O(cached tokens)."""
        self.tree.check_invariants()
        if self.coordinator is not None:
            self.coordinator.check_invariants()
        nodes = list(self.tree.iter_nodes())
        if not nodes:
            return
        full = np.concatenate([n.full for n in nodes])
        swa = np.concatenate([n.swa for n in nodes])
        bad = self.pool.mapping_mismatches(full, swa)  # every token of every page
        if bad.size:
            ends = np.cumsum([len(n.full) for n in nodes])
            node = nodes[int(np.searchsorted(ends, bad[0], side="right"))]
            raise AssertionError(f"full->SWA mapping disagrees with the tree at {node} "
                                 f"(full page {full[bad[0]]}, tree SWA page {swa[bad[0]]})")


class _HostView:
    """L2's full-page pool in tokens, as SGLang's metrics read a host pool."""

    def __init__(self, pool: Any, page_size: int) -> None:
        self.logical_size = int(pool.full.capacity) * page_size
        self._pool, self._ps = pool, page_size

    def available_size(self) -> int:
        return int(self._pool.full.num_free) * self._ps
