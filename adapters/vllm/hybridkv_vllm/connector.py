"""``HybridKVConnector``: hybridkv's window-safe L2/L3 page store as a vLLM v1 KV connector.

Load it without patching vLLM::

    --kv-transfer-config '{"kv_connector": "HybridKVConnector",
                           "kv_connector_module_path": "hybridkv_vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"l3_url": "file:///var/cache/hkv"}}'

How it maps onto vLLM 0.32 (``SupportsHMA``: vLLM keeps its hybrid KV-cache
manager, one block table per KV-cache group; docs/vllm.md has the whole story):

* Groups may have different block sizes; each group's keys and block ids are at
  its own block size, and a hit ends on a multiple of the lcm of all block
  sizes (``self.unit``, also vLLM's scheduler block size).
* Scheduler: ``get_num_new_matched_tokens`` keys the prompt (hybridkv's chained
  page keys, one chain per group; read off hybridkv's device tree where bound,
  :mod:`.names`), finds what the tiers hold in its one record of them
  (:class:`.sources.TierView`; the store is asked ``exists`` only where the
  record has no answer that can change the hit, on a probe thread:
  :mod:`.lookups`) and returns the largest *window-safe* hit: full pages for
  the whole prefix, SWA pages only for the window before the hit end.  Loads
  are asynchronous: the path on which vLLM 0.32 accepts per-request load
  failures for hybrid models (``failed_recving``), so a page that vanished
  degrades to a recompute, never to garbage KV.  With hybridkv's prefix manager,
  a hit whose full KV the device holds loads only the window (:mod:`.repair`).
* ``update_state_after_alloc`` turns the hit into per-group (block id, key)
  load lists; SWA groups get only their non-null window blocks.
* Saves: full pages as soon as a prefill chunk completes them; SWA pages only
  for the windows a later hit can end at (prompt end, request end,
  checkpoints).  The finish save holds the request's blocks until the worker
  reports it.
* Worker: loads run in ``start_load_kv``; saves leave the step (:mod:`.saver`,
  a background thread; finish saves under vLLM's delayed-free protocol).
* Counters reach vLLM's KV-connector stats and ``/metrics`` (:mod:`.metrics`,
  :mod:`.progress`) and the stats file (one JSON line per event).
* L2 (``l2_gb``): the scheduler side owns its one index (:class:`.l2.HostPageIndex`)
  and names in each job the host rows to read or write; workers keep only the
  rows (:class:`.l2.HostPageRows`).  Saves go to L2 and through to L3, loads
  read L2 first; the index splits hits by source (:mod:`.sources`).
"""

from __future__ import annotations

import atexit
import math
import time
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybridkv.tiers.index import StoreIndex
from hybridkv.tiers.keys import parent_keys
from hybridkv.tiers.storage import open_backend

from .config import ConnectorConfig
from .groups import fingerprints, groups_from_config
from .jobs import HybridKVMetadata, PageJob, ReqState
from .kvio import GroupBuffers, load_pages
from .l1 import L1View, copy_down
from .l2 import HostPageRows, host_rows, l2_index
from .logs import logger, route_core_logs
from .lookups import Lookups, TimedProbe
from .metrics import Counters, HybridKVPromMetrics, HybridKVStats
from .names import TreeNames, bind_names
from .plan import checkpoint_ends, full_bases, pages_to_save, windows_before
from .progress import IDLE_WAIT_S, SavesBusy, SavesWatch, WorkerSaves
from .repair import device_tokens, swa_load_from
from .saver import SaveThread
from .sources import TierView, l3_source

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["HybridKVConnector", "HybridKVMetadata", "PageJob"]

TOUCH_INTERVAL_S = 30.0  # a hit's store keys are touched at most this often
SHUTDOWN_DRAIN_S = 3.0  # vLLM SIGKILLs an engine process ~5 s after SIGTERM
LOAD_WAIT_S = 30.0  # a load waits at most this long for a queued save of its pages


def _shutdown_at_exit(ref: weakref.ref) -> None:
    conn = ref()
    if conn is not None:
        conn.shutdown()


class HybridKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector backed by hybridkv's L3 storage (see module docstring)."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED  # only if a split is missing

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.cfg = ConnectorConfig.from_extra(extra)
        self.groups = sorted(groups_from_config(kv_cache_config), key=lambda g: g.is_swa)  # full first (L2 pairs)
        # A hit must end on a block boundary of every group: the lcm (vLLM's
        # scheduler block size for mixed groups, and what it aligns local hits to).
        self.unit = math.lcm(*(g.block_size for g in self.groups))
        ci = self.cfg.checkpoint_interval
        if ci != "auto" and int(ci) % self.unit:
            raise ValueError(f"kv_connector_extra_config['checkpoint_interval'] "
                             f"({self.cfg.checkpoint_interval}) must be a multiple of the "
                             f"hit unit {self.unit} (lcm of the groups' block sizes)")
        self.fingerprints = fingerprints(vllm_config, kv_cache_config, self.groups,
                                         self.cfg.model_id)
        self.backend = open_backend(self.cfg.l3_url, **dict(self.cfg.backend_options or {}))
        route_core_logs()
        self._counters = Counters(role.name.lower(), self.cfg.stats_file)
        self.stats = self._counters.totals  # the totals (the stats file's)
        # scheduler side
        self._reqs: dict[str, ReqState] = {}
        self._pending_loads: dict[str, PageJob] = {}
        self._pending_saves: list[PageJob] = []
        self._touches: list[bytes] = []
        self._loading: dict[str, dict[int, list[bytes]]] = {}  # req -> its load's keys per group
        # Keys of save jobs built but not sent yet (dedup only; lookups do not see them:
        # a load in the same step would run before the save is submitted).
        self._claimed: set[bytes] = set()
        self._worker_saves = SavesWatch()  # keeps vLLM stepping until saves are counted
        # The one record of what L2 and L3 hold (keys sent to the workers' saves count as stored)
        l2 = (l2_index(kv_cache_config, self.groups, int(self.cfg.l2_gb * (1 << 30)))
              if role == KVConnectorRole.SCHEDULER else None)
        # which full pages vLLM's device cache holds, for L2's eviction (hooked when bound)
        self._l1 = L1View(l2) if l2 is not None and self.cfg.l1_copies_first else None
        probe = TimedProbe(self.backend.exists)  # a store that answers fast is asked inline (.lookups)
        self._tiers = TierView(self.groups, l2, l3_source(self.cfg.l3_url), StoreIndex(probe))
        self._lookups = Lookups(self._tiers, self.cfg.lookup_wait_ms / 1000, self._count, times=probe)
        self._names: TreeNames | None = None  # keys kept on hybridkv's device tree (bound: .names)
        # worker side
        self._saves_report = WorkerSaves()
        self._buffers: dict[int, GroupBuffers] = {}
        self._l2: HostPageRows | None = None
        self._done_recv: set[str] = set()
        self._failed_recv: set[str] = set()
        self._saver: SaveThread | None = None
        # vLLM calls shutdown() on both roles at a clean exit; if a path skips it (e.g. an
        # interpreter exit without engine teardown) the totals are still written once.
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        self._record(event="init", unit=self.unit, l2_gb=self.cfg.l2_gb,
                     groups=[[g.index, g.window, g.block_size] for g in self.groups])
        logger.info("HybridKVConnector role=%s l3=%s l2_gb=%s unit=%d groups=%s", role.name,
                    self.cfg.l3_url, self.cfg.l2_gb, self.unit,
                    [(g.index, g.window, g.block_size, len(g.layer_names)) for g in self.groups])

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """With hybridkv's prefix manager, its tree keeps the pages' keys (:mod:`.names`)."""
        super().bind_kv_cache_manager(kv_cache_manager)
        self._names = bind_names(self.groups, kv_cache_manager, self._reqs, self._keys, self._tiers.l2, self._l1,
                                 self._tiers.store)
        if self._names is not None and self.cfg.repair_windows:  # repair case 2 (:mod:`.repair`)
            kv_cache_manager.repair_windows(self._window_hit)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Follow the pool's removals of cached blocks (:mod:`.l1`)."""
        super().bind_gpu_block_pool(gpu_block_pool)
        if self._l1 is not None and not self._l1.hook(gpu_block_pool):
            logger.warning("hybridkv: vLLM's block pool cannot be followed; L2 keeps no L1 copies rule")
            self._l1 = None

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is only a future miss.
        return False

    # ------------------------------------------------------------------ stats
    def _count(self, **inc: int) -> None:
        self._counters.count(**inc)

    def _record(self, **event: Any) -> None:
        self._counters.record(**event)

    def get_kv_connector_stats(self) -> HybridKVStats | None:
        """Counter increments since the last call (vLLM aggregates workers and the
        scheduler side, logs them and feeds ``/metrics``)."""
        data = self._counters.pull()
        return HybridKVStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HybridKVStats:
        return HybridKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> HybridKVPromMetrics:
        return HybridKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ============================================================ scheduler
    def _state(self, request: Request) -> ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            ns = self.cfg.namespace
            salt = getattr(request, "cache_salt", None)
            if salt:
                ns = f"{ns}/{salt}"
            st = self._reqs[request.request_id] = ReqState(request, ns)
        return st

    def _keys(self, st: ReqState, tokens: int) -> dict[int, list[bytes]]:
        return st.page_keys(tokens, self.groups, self.fingerprints)  # (ReqState.page_keys)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Window-safe external hit beyond ``num_computed_tokens`` (page aligned).

        Side-effect free towards vLLM (only caches keys).  Cost: the tiers' record
        (:class:`.sources.TierView`) answers for keys this engine saved, read or
        probed; the store is asked about the rest on the probe thread (:mod:`.lookups`):
        ``None`` (ask again later) while that takes longer than ``lookup_wait_ms``.
        A window repair the prefix manager took (:mod:`.repair`) is the hit as planned.
        """
        st = self._state(request)  # every request gets state: its pages are saved later
        plan = st.repair
        if plan is not None and plan[1] == num_computed_tokens:  # the device's part is handed over
            st.hit_tokens, st.hit_sources, st.local_tokens, st.l1_marked = plan[2], {}, num_computed_tokens, 0
            return plan[2] - num_computed_tokens, True
        st.repair, st.hit_tokens, st.hit_sources, st.local_tokens, st.l1_marked = None, 0, {}, num_computed_tokens, 0
        hit = self._hit(request, st, num_computed_tokens)
        if hit is None:
            return None, False
        st.hit_tokens = hit if hit > num_computed_tokens else 0
        if not st.hit_tokens:
            return 0, False
        return st.hit_tokens - num_computed_tokens, True

    def _hit(self, request: Request, st: ReqState, local: int, device_full: int = 0) -> int | None:
        """The tiers' window-safe hit past the device's ``local`` tokens (0: none past it;
        None: ask again later).  ``device_full``: see :meth:`.sources.TierView.hit`."""
        unit = self.unit
        max_tokens = (request.num_tokens - 1) // unit * unit  # vLLM must compute >= 1 token
        if self.cfg.max_hit_tokens:
            max_tokens = min(max_tokens, self.cfg.max_hit_tokens // unit * unit)
        if max_tokens <= local:
            return 0
        if self._names is not None:  # the leading pages' keys off the tree (a first lookup)
            self._count(tree_named_pages=self._names.seed(st, max_tokens))
        keys = self._keys(st, max_tokens)
        # Pages below the engine's own hit are never read; pages handed to the workers' save
        # threads count as present (the worker's load waits for them: SaveThread.wait_keys).
        self._count(lookups=1)
        names = self._names
        l2_held = (partial(names.l2_held, st.walk) if names is not None and st.walk is not None
                   and names.records is not None else None)  # L2 read off the tree's records first
        try:
            return self._lookups.hit(request.request_id, keys, local, max_tokens, unit, device_full=device_full,
                                     l2_held=l2_held)
        finally:
            if l2_held is not None:
                self._count(**names.pull_counts())

    def _window_hit(self, request: Request, safe: int, full: int) -> tuple[int, int] | None:
        """The prefix manager's question for a window repair (:mod:`.repair`), asked at each
        of its lookups (``full <= safe``: none to look for): ``(local, end)``, ``(0, 0)``
        for none, None: ask again later.  On the scheduler's thread."""
        st = self._state(request)
        st.repair = None  # a plan lasts from this question to the load it plans
        end = self._hit(request, st, safe, device_full=full) if full > safe else 0
        local = end and device_tokens(self._tiers, self.groups, self._keys(st, end), safe, full, end, self.unit,
                                      self._names.page_size if self._names is not None else self.unit)
        if local:
            st.repair = (safe, local, end)
        return None if end is None else (local, end) if local else (0, 0)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Turn the reported hit into a per-group load job (window blocks for SWA)."""
        st = self._reqs.get(request.request_id)
        hit = st is not None and num_external_tokens > 0 and bool(st.hit_tokens)
        if hit:  # counted before the event line, which carries the totals
            self._count(hit_requests=1, hit_tokens=int(num_external_tokens))
        if st is not None and not st.reported:
            st.reported = True
            self._record(event="alloc", req=request.request_id, prompt_tokens=request.num_prompt_tokens,
                         external_tokens=int(num_external_tokens))
        if st is not None and self._l1 is not None and st.local_tokens:  # the device's own hit: L1 holds it
            self._l1.held_prefix(self.groups, blocks.blocks, self._keys(st, st.local_tokens), st.local_tokens)
        if st is not None and (top := st.hit_tokens if hit else st.local_tokens):  # repairs 3, 4: the hit's store
            hit_keys = self._keys(st, top)  # entries stay alive, the window it ends at is anchored in L2
            self._touches += self._tiers.touches(hit_keys, top, TOUCH_INTERVAL_S)
            self._count(l2_anchored_pages=self._tiers.anchor_window(hit_keys, top))
        if not hit:
            return
        assert st is not None
        end = st.hit_tokens
        start = end - int(num_external_tokens)
        if self._names is not None:  # repair case 2: full KV the device holds, loaded again
            self._count(reloaded_held_tokens=self._names.reloaded(request.request_id, start, end))
        keys = self._keys(st, end)
        swa_from, st.repair = swa_load_from(st.repair, start), None  # a repair's fresh window blocks below start
        self._count(repaired_tokens=start - swa_from)
        job = PageJob(request.request_id)
        pages: dict[int, tuple[list[int], list[bytes]]] = {}  # per group: page indices, keys
        for g in self.groups:
            blk = blocks.blocks[g.index]
            bs = g.block_size
            lo_tok = max(swa_from, end - int(g.window)) if g.is_swa else start  # type: ignore[arg-type]
            lo, hi = max(0, lo_tok) // bs, end // bs
            sel = [i for i in range(lo, min(hi, len(blk))) if not blk[i].is_null]
            pages[g.index] = (sel, [keys[g.index][i] for i in sel])
            job.groups[g.index] = ([blk[i].block_id for i in sel], pages[g.index][1])
            job.bases[g.index] = full_bases(self.groups, keys, g.index, sel)
            job.parents[g.index] = parent_keys(keys[g.index], sel)
        st.hit_sources, job.slots = self._tiers.on_load(pages, start, end, job.bases, job.parents)
        if self._names is not None:  # where L2 holds them (or admits them from L3), for the tree's records
            self._names.placed(st, {gi: idx for gi, (idx, _) in pages.items()}, job.slots)
        self._pending_loads[request.request_id] = job.for_workers()
        self._loading[request.request_id] = {gi: list(ks) for gi, (_, ks) in job.groups.items()}
        st.saved_tokens = max(st.saved_tokens, end)  # these pages are in storage already

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        """The request's external hit by tier: ``host`` (the worker's L2) and ``disk``
        (a file L3), as :meth:`update_state_after_alloc` planned its load
        (:mod:`.sources`).  O(1)."""
        st = self._reqs.get(request.request_id)
        split = dict(st.hit_sources) if st is not None else {}
        if num_external_tokens <= 0:
            return {}
        if sum(split.values()) != num_external_tokens:  # not the load planned: no split to give
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return split

    def _save_job(self, st: ReqState, block_ids: tuple[list[int], ...], end_tokens: int,
                  final: bool, null_id: int) -> PageJob | None:
        """Pages of every group completed in ``(saved_tokens, end_tokens]`` worth storing.

        Full groups: every complete block.  SWA groups: the windows before checkpoints
        (:func:`.plan.checkpoint_ends`), the device hit's end and (``final``) the last
        hit-able end, all on the hit unit (a hit can only end there).  Those windows enter
        L2 as anchors but for checkpoints off ``anchor_checkpoint`` (plain)."""
        keys = self._keys(st, end_tokens)
        job = PageJob(st.request.request_id, state=st)
        swa_end = end_tokens // self.unit * self.unit
        ckpts = checkpoint_ends(st.saved_tokens, swa_end, self.unit,
                                self.cfg.checkpoint_interval, self.cfg.checkpoints_per_doubling)
        on_grid = [c for c in ckpts if (k := self.cfg.anchor_checkpoint) and c % k == 0]  # and (final) swa_end
        if st.saved_tokens < (hit := st.local_tokens) <= swa_end and hit not in ckpts:  # repair 1: a window the
            ckpts, on_grid = sorted(ckpts + [hit]), on_grid + [hit]  # device hit ended at, if L2 / L3 lost it
        for g in self.groups:
            ids, bs = block_ids[g.index], g.block_size
            if g.is_swa:
                done = st.saved_swa.setdefault(g.index, set())
                pages = pages_to_save(g, st.saved_tokens // bs, swa_end // bs, bs, final,
                                      checkpoints=[c // bs for c in ckpts])
            else:
                done = set()
                pages = pages_to_save(g, st.saved_tokens // bs, end_tokens // bs, bs, final)
            sel = [i for i in pages if i < len(ids) and ids[i] != null_id and i not in done]
            done.update(sel if g.is_swa else ())
            if self._l1 is not None and not g.is_swa:  # L1 holds these pages now, a load's too (repair case 1)
                on = [i for i in range(st.l1_marked // bs, min(end_tokens // bs, len(ids))) if ids[i] != null_id]
                self._l1.held(g.index, [ids[i] for i in on], keys[g.index], on)
            # Skipped: pages another job carries or that store and L2 both hold (only L2 lost: copied again)
            ks = keys[g.index]
            done_l23 = self._tiers.stored_everywhere(g.is_swa, [ks[i] for i in sel])
            sel = [i for i, d in zip(sel, done_l23.tolist()) if not d and ks[i] not in self._claimed]
            if sel:
                job.groups[g.index] = ([ids[i] for i in sel], [ks[i] for i in sel])
                job.bases[g.index] = full_bases(self.groups, keys, g.index, sel)
                job.parents[g.index] = parent_keys(ks, sel)
                job.pages[g.index] = sel
                self._claimed.update(ks[i] for i in sel)
                if g.is_swa and len(on_grid) < len(ckpts):  # some checkpoint windows enter plain
                    kept = windows_before(g, swa_end // bs, bs, [a // bs for a in on_grid + [swa_end] * final])
                    job.plain += [ks[i] for i in sel if not kept[i]]
        st.saved_tokens, st.l1_marked = max(st.saved_tokens, end_tokens), end_tokens
        return job if job.groups else None

    def _null_block_id(self) -> int:
        mgr = self._kv_cache_manager
        return int(mgr.block_pool.null_block.block_id) if mgr is not None else 0

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Loads decided since the last step, and prefill saves of this step."""
        meta = HybridKVMetadata(loads=list(self._pending_loads.values()), touches=self._touches)
        self._pending_loads.clear()
        self._touches = []
        null_id = self._null_block_id()
        sched: list[tuple[str, int]] = [(r.req_id, r.num_computed_tokens)
                                        for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        sched += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, computed in sched:
            st = self._reqs.get(req_id)
            n_new = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if st is None or n_new <= 0 or self._kv_cache_manager is None:
                continue
            prompt = st.request.num_prompt_tokens
            if computed >= prompt:
                continue  # decode: saved at finish
            end = min(computed + n_new, prompt)
            final = end >= prompt
            block_ids = self._kv_cache_manager.get_block_ids(req_id)
            job = self._save_job(st, block_ids, end, final, null_id)
            if job is not None:
                meta.saves.append(job)
        meta.saves.extend(self._pending_saves)
        self._pending_saves.clear()
        for job in meta.saves:  # visible to lookups from the next step on
            self._count(l2_demoted_pages=self._tiers.demote(job.demote))
            placed: dict[int, np.ndarray] = {}
            job.slots = self._tiers.on_save(job.groups, job.bases, job.plain, job.parents, placed)
            if self._names is not None:  # where L2 holds them, for the tree's records at the insert
                self._names.placed(job.state, job.pages, placed)
        meta.saves = [job.for_workers() for job in meta.saves if job.groups]
        self._claimed.clear()
        meta.rescues = self._l1.take_rescues() if self._l1 is not None else {}
        meta.idle = not (meta.loads or meta.saves or meta.touches or meta.rescues
                         or scheduler_output.total_num_scheduled_tokens)
        return meta

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Queue the decode-time pages (and the final SWA window) for saving, and the demotion of
        the anchored L2 windows the request moved past (inside its pages up to its tail, the last
        hit end it saved, neither that tail, a checkpoint nor its hit's end: as the core's L2).
        Returns ``(True, None)`` when a save was queued: vLLM then keeps the blocks until the
        worker lists the request in ``finished_sending``."""
        st = self._reqs.pop(request.request_id, None)
        self._lookups.drop(request.request_id)
        if self._pending_loads.pop(request.request_id, None) is not None:
            self._loading.pop(request.request_id, None)  # never sent: no worker reports it
        # a load not confirmed (aborted, or failed under vLLM's ``fail`` policy): the blocks it was
        # to fill hold no KV, so nothing is saved; the worker's report settles its keys later
        unloaded = request.request_id in self._loading
        if st is None:
            return False, None
        if self._names is not None:  # the prefix manager's insert (after this) names its pages
            self._names.keep(st)
        computed = min(request.num_computed_tokens, len(request.all_token_ids))
        save = (self.cfg.save_on_finish and not unloaded and any(block_ids)
                and computed >= min(g.block_size for g in self.groups))
        job = self._save_job(st, block_ids, computed, True, self._null_block_id()) if save else None
        if job is not None:
            job.finish = True
        unit, tail = self.unit, st.saved_tokens // self.unit * self.unit
        ends = checkpoint_ends(0, tail, unit, self.cfg.checkpoint_interval, self.cfg.checkpoints_per_doubling)
        demote = self._tiers.passed(self._keys(st, tail), tail, ends + [tail, st.hit_tokens or st.local_tokens])
        if demote:  # a job without pages carries it alone (vLLM need not hold the blocks)
            job = job or PageJob(request.request_id)
            job.demote = demote
        if job is None:
            return False, None
        self._pending_saves.append(job)
        return job.finish, None

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # Called instead of the all-groups variant when vLLM runs one group.
        return self.request_finished_all_groups(request, (block_ids,))

    def update_connector_output(self, connector_output: Any) -> None:
        """A finished load confirms its keys in the tiers' record; a failed one marks
        them absent: a save that was dropped (queue full) or lost must not make
        every later lookup fail."""
        failed = connector_output.failed_recving or ()
        for req_id in connector_output.finished_recving or ():
            keys = self._loading.pop(req_id, None)
            if keys is not None:
                self._tiers.on_load_done(keys, req_id not in failed)
        self._worker_saves.update(connector_output.kv_connector_worker_meta)

    def has_pending_push_work(self) -> bool:
        # Keep the engine stepping until queued finish saves reach a worker
        # (then the held request keeps it stepping until finished_sending),
        # and until the workers' saves are stored and counted (progress.py).
        return bool(self._pending_saves) or self._worker_saves.busy() or bool(self._l1 and self._l1.pending())

    # =============================================================== worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap vLLM's per-layer KV tensors per group (no copy, no registration cost)."""
        n = self._kv_cache_config.num_blocks
        self._buffers = {g.index: GroupBuffers(kv_caches, g.layer_names, n) for g in self.groups}
        # the rows the scheduler's index of L2 assigns (same budget and page bytes)
        self._l2 = host_rows({b.page_bytes for b in self._buffers.values()}, int(self.cfg.l2_gb * (1 << 30)))
        self._saver = SaveThread(self.backend, self._buffers, self._l2,
                                 {g.index: g.is_swa for g in self.groups},
                                 int(self.cfg.save_queue_mb * (1 << 20)), self._count,
                                 self._record)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Copy down the blocks vLLM's cache gave up that L2 lacks: vLLM calls this first
        in a step, before it zeroes the step's new blocks and runs the forward pass."""
        if isinstance(kv_connector_metadata, HybridKVMetadata) and kv_connector_metadata.rescues:
            self._count(l2_rescued_pages=copy_down(kv_connector_metadata.rescues, self._buffers, self._l2))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Run this step's loads (all or nothing per request)."""
        meta = self._connector_metadata
        if not isinstance(meta, HybridKVMetadata) or not meta.loads:
            return
        swa = {g.index: g.is_swa for g in self.groups}
        for job in meta.loads:
            if self._saver is not None:  # a page saved moments ago may still be queued
                self._saver.wait_keys([k for _, ks in job.groups.values() for k in ks],
                                      LOAD_WAIT_S)
            ok, l2_pages, l3_pages = True, 0, 0
            t0 = time.perf_counter()
            for gi, (ids, keys) in job.groups.items():
                if ok and ids:
                    ok, a, b = load_pages(self.backend, self._buffers[gi], keys, ids,
                                          self._l2, swa[gi], job.slots.get(gi))
                    l2_pages, l3_pages = l2_pages + a, l3_pages + b
            if ok:
                self._count(load_pages=job.num_pages(), load_pages_l2=l2_pages,
                            load_pages_l3=l3_pages)
            else:
                self._count(load_failures=1)
            (self._done_recv if ok else self._failed_recv).add(job.req_id)
            self._record(event="load", req=job.req_id, pages=job.num_pages(), ok=ok,
                         l2_pages=l2_pages, l3_pages=l3_pages,
                         ms=round((time.perf_counter() - t0) * 1e3, 3))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv (asynchronous-load path, see module doc)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # saved in wait_for_save, once the whole step's KV is written

    def wait_for_save(self) -> None:
        """Hand this step's save jobs to the save thread (see :mod:`.saver`).

        Prefill pages are copied out of vLLM's blocks here; the L2/L3 store
        runs on the thread.  With ``async_save: false`` the step waits for it.
        """
        meta = self._connector_metadata
        if not isinstance(meta, HybridKVMetadata) or self._saver is None:
            return
        if meta.idle:  # nothing else to do this step: let the save thread get on
            self._saver.wait_progress(IDLE_WAIT_S)
        if meta.touches:
            self._saver.touch(meta.touches)
        if not meta.saves:
            return
        for job in meta.saves:
            self._saver.submit(job.req_id, job.groups, job.finish, job.slots)
        if not self.cfg.async_save:
            self._saver.drain(None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent = self._saver.pop_released() if self._saver is not None else set()
        res = KVConnectorTransferResults(finished_sending=sent,
                                         finished_recving=self._done_recv | self._failed_recv,
                                         failed_recving=self._failed_recv)
        self._done_recv, self._failed_recv = set(), set()
        return res

    def build_connector_worker_meta(self) -> SavesBusy | None:
        """Whether saves are still queued or counted after this step's stats (progress.py)."""
        return self._saves_report.report(self._saver, self._counters.uncollected())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def shutdown(self) -> None:
        """Drain the save thread (bounded), then append the totals and fsync.

        Idempotent (vLLM's teardown and the ``atexit`` fallback may both call it).
        """
        if not self._counters.close_once():
            return
        drained = True
        self._lookups.close()
        if self._saver is not None:
            drained = self._saver.stop(SHUTDOWN_DRAIN_S)
            if not drained:
                logger.warning("hybridkv: %d saves still queued at shutdown are dropped",
                               self._saver.pending())
        index = self._tiers.l2
        extra: dict[str, Any] = ({"l2": index.tier.stats()} if index is not None
                                 else {"l2_rows": self._l2.stats()} if self._l2 is not None else {})
        totals = self._counters.snapshot()
        self._record(event="shutdown", drained=drained, **extra)
        self._counters.close_file()
        logger.info("hybridkv %s totals: %s", self.role.name.lower(),
                    {k: v for k, v in totals.items() if v})
        try:
            self.backend.close()
        except Exception:  # closing is best effort at interpreter exit
            logger.warning("hybridkv: backend close failed", exc_info=True)
