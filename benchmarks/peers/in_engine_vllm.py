"""In-engine replay through vLLM 0.32's real ``Scheduler`` (no model), vLLM vs hybridkv.

Runs in the vLLM adapter's venv (``in_engine_vllm.sh`` makes it).  Each system
is one ``vllm.v1.core.sched.scheduler.Scheduler`` (or a subclass given by
qualified name), built the way ``EngineCore`` builds it, stepped by this
driver, which plays the model runner: after every ``schedule()`` it hands
``update_from_output`` a ``ModelRunnerOutput`` with one deterministic sampled
token for every request whose scheduled chunk reached its last known token.

* ``vllm_default``  vLLM's own ``KVCacheManager`` at ``prefix_cache_retention_interval``
  0, what ``vllm serve`` runs;
* ``vllm``          the same at every ``--retention`` value (the sweep); the row with
  the most hit tokens is marked ``best`` and repeated as ``vllm_best``;
* ``hybridkv``      the scheduler class ``--hybridkv-scheduler-cls`` (default
  ``hybridkv_vllm.scheduler.HybridKVScheduler``), constructed the same way;
  skipped with a line on stderr if it does not import.

Model and memory: MiMo-V2.5-Pro (70 layers, 10 full + 60 SWA, W = 128), page
64.  The 70 layer specs go through vLLM's own grouping (1 full + 6 SWA groups
of 10 layers) and one block pool of ``budget / (page x 5,120 B x 10 layers)``
blocks serves them all (see ``drive_vllm.py``); every system gets the same
blocks.  Scheduler: chunked prefill, ``max_num_batched_tokens`` 8,192,
``max_num_seqs`` 16, prefix caching on, FCFS, synchronous scheduling.

Workload.  Prompts are the trace's token sequences from
``hybridkv.eval.traces.TokenMaterializer`` with the partial-block extension rule
on (as ``run.py`` builds them).  Requests are admitted in trace order while
fewer than ``--max-inflight`` (default 16) are waiting or running; requests
of one kv-cache-tester session (its namespace, also the ``cache_salt``) are
turns: a turn is admitted only after the session's previous turn finished
(Mooncake requests carry no session and are independent).  Each request
decodes ``min(output_length, --max-decode)`` tokens (default 16, at least 1;
ids from a hash of (request, position), never a stop token).  Traces carry
prompts only, so a later turn's prompt does not contain the earlier answer:
the decoded tokens are cached by vLLM (full blocks) but no later prompt
quotes them.  Preemption is vLLM's: a preempted request re-enters the
waiting queue and looks the cache up again when resumed.

Measured per (budget, system): ``hit_tokens`` = sum over requests of the
local prefix-cache hit at first scheduling (``NewRequestData.num_computed_tokens``,
the value vLLM records in ``prefill_stats.num_local_cached_tokens``), checked
against the ``SchedulerStats.prefix_cache_stats`` that ``update_from_output``
returns every step (``stats_hits`` / ``stats_queries``; resumed requests go to
its ``preempted_*`` fields); ``input_tokens`` = sum of prompt lengths.

Content oracle (system independent).  The driver keeps the model runner's
block table of every request (from ``SchedulerOutput``: new requests' block
ids, running requests' appended ids, resumed requests' replaced ones) and a
shadow map (group, block id) -> (page index, chained digest of the tokens
[0, end of page)) written whenever a scheduled chunk computes a full page
into that block.  At every hit of length L (first scheduling and resumption)
every full-attention block before L, and every sliding-window block covering
[L - W, L), must hold this request's page; null blocks are allowed only
outside the window.  Any mismatch makes the run exit 1.

    python in_engine_vllm.py [--trace T] [--limit N] [--budgets 59,594] [--json]
                             [--systems vllm_default,vllm,hybridkv] [--retention 0,4096,16384,none]
                             [--details FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import logging
import os
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402

from common import (  # noqa: E402
    GB,
    VLLM_RETENTION_DEFAULT,
    VLLM_RETENTION_SWEEP,
    format_retention,
    parse_retention,
    release_memory,
    vllm_num_blocks,
)

SYSTEMS = ("vllm_default", "vllm", "hybridkv")
DEFAULT_HYBRIDKV_CLS = "hybridkv_vllm.scheduler.HybridKVScheduler"
MODEL, PAGE = "mimo-v2.5-pro", 64
HEAD_SIZE = 128  # stand-in layer specs: heads are chosen so one token of a layer costs the preset's bytes
_MASK = (1 << 64) - 1


def log(msg: str) -> None:
    print(f"[in-engine-vllm] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ workload
@dataclass
class Item:
    """One request of the replay: ``session`` None = independent request."""

    idx: int
    session: str | None
    namespace: str
    tokens: np.ndarray  # int32 prompt
    decode: int


def load_workload(trace: Path, limit: int, max_decode: int) -> tuple[list[Item], dict[str, Any]]:
    """The first ``limit`` requests of ``trace`` as prompts (extension rule on)."""
    from hybridkv.eval.traces import TokenMaterializer, load_trace

    reqs = load_trace(trace, limit=limit)
    mat = TokenMaterializer(extension_rule=True)
    items: list[Item] = []
    for r in reqs:
        t = mat.tokens(r)
        if len(t) == 0:
            continue
        session = None if r.namespace == "default" else r.namespace
        items.append(Item(len(items), session, r.namespace, t, max(1, min(r.output_length, max_decode))))
    meta = {"trace": trace.name, "limit": limit, "requests": len(items), "extension_rule": "on",
            "input_tokens": int(sum(len(i.tokens) for i in items)),
            "sessions": len({i.session for i in items if i.session is not None})}
    return items, meta


def prefix_bound(items: list[Item], page: int) -> dict[str, Any]:
    """The most any prefix cache can hit on ``items``: each request's longest
    page-aligned prefix (at most ``(len - 1) // page`` pages, one token left to
    compute) that an earlier request of its namespace also had, with unlimited
    memory and nothing ever evicted (:class:`hybridkv.eval.traces.PrefixBound`, the
    bound ``hybridkv replay`` reports).  O(pages)."""
    from hybridkv.eval.traces import PrefixBound

    bound = PrefixBound(page)
    hit = sum(bound.hits(it.tokens, it.namespace, len(it.tokens) - 1) for it in items)
    total = int(sum(len(i.tokens) for i in items))
    return {"hit_tokens": hit, "input_tokens": total, "hit_rate": hit / max(1, total),
            "what": "upper bound of any prefix cache: unlimited memory, nothing evicted, page aligned"}


class Arrivals:
    """Trace order, one turn per session at a time: :meth:`next` is the earliest
    not yet admitted request whose session has nothing in flight.  O(log n)."""

    def __init__(self, items: list[Item]) -> None:
        self._queues: dict[Any, deque[Item]] = {}
        for it in items:
            self._queues.setdefault(self._key(it), deque()).append(it)
        self._ready = [(q[0].idx, k) for k, q in self._queues.items()]
        heapq.heapify(self._ready)
        self.pending = len(items)

    @staticmethod
    def _key(it: Item) -> Any:
        return ("s", it.session) if it.session is not None else ("r", it.idx)

    def next(self) -> Item | None:
        if not self._ready:
            return None
        _, key = heapq.heappop(self._ready)
        self.pending -= 1
        return self._queues[key].popleft()

    def done(self, it: Item) -> None:
        q = self._queues[self._key(it)]
        if q:
            heapq.heappush(self._ready, (q[0].idx, self._key(it)))


# ------------------------------------------------------------------ vLLM construction
def kv_cache_groups(page: int) -> tuple[list[Any], int, int]:
    """vLLM's KV-cache groups for the preset, bytes per token of one layer of the
    largest group and that group's layer count."""
    import torch
    from hybridkv.spec import ModelSpec
    from vllm.v1.core import kv_cache_utils as ku
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    spec = ModelSpec.preset(MODEL, page_size=page)
    nf, ns = len(spec.full_layers), len(spec.swa_layers)
    per_head = 2 * HEAD_SIZE * 2  # K + V, bf16
    specs: dict[str, Any] = {}
    for i in range(nf + ns):  # interleaved as a real model (grouping depends only on counts and specs)
        full = i * nf // (nf + ns) != (i + 1) * nf // (nf + ns)
        bpt = (spec.bytes_per_token_full // nf) if full else (spec.bytes_per_token_swa // ns)
        kw = dict(block_size=page, num_kv_heads=bpt // per_head, head_size=HEAD_SIZE, dtype=torch.bfloat16)
        specs[f"model.layers.{i}.attn"] = (FullAttentionSpec(**kw) if full
                                           else SlidingWindowSpec(**kw, sliding_window=spec.window))
    specs = ku.unify_kv_cache_spec_page_size(specs)
    groups = ku._get_kv_cache_groups_uniform_page_size(specs)
    group_size = max(len(g.layer_names) for g in groups)
    page_bytes = max(s.page_size_bytes for s in specs.values())
    return groups, page_bytes // page, group_size


def model_config(max_model_len: int) -> Any:
    """A ModelConfig from a tiny local Llama ``config.json`` (no weights, no
    tokenizer: the scheduler reads only lengths and flags from it)."""
    from vllm.config import ModelConfig

    d = tempfile.mkdtemp(prefix="hkv-in-engine-")
    Path(d, "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": max_model_len,
        "torch_dtype": "bfloat16"}))
    return ModelConfig(model=d, tokenizer=d, skip_tokenizer_init=True, max_model_len=max_model_len,
                       dtype="bfloat16")


@dataclass(frozen=True)
class EngineShape:
    page: int = PAGE
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 16


def build_scheduler(cls: type, mcfg: Any, groups: list[Any], num_blocks: int, retention: int | None,
                    shape: EngineShape, additional_config: dict[str, Any] | None = None) -> Any:
    """``cls(...)`` exactly as ``EngineCore.__init__`` calls it: a VllmConfig whose
    CacheConfig carries the retention interval and ``num_gpu_blocks``, the
    KVCacheConfig ``get_kv_cache_config_from_groups`` would make (retention
    copied from CacheConfig, ``hash_block_size`` set), a StructuredOutputManager,
    ``log_stats=True``."""
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.structured_output import StructuredOutputManager

    cache = CacheConfig(block_size=shape.page, enable_prefix_caching=True,
                        prefix_cache_retention_interval=retention)
    sched = SchedulerConfig(max_num_batched_tokens=shape.max_num_batched_tokens, max_num_seqs=shape.max_num_seqs,
                            enable_chunked_prefill=True, max_model_len=mcfg.max_model_len,
                            is_encoder_decoder=False, async_scheduling=False)
    vcfg = VllmConfig(model_config=mcfg, cache_config=cache, scheduler_config=sched,
                      additional_config=additional_config or {})
    vcfg.cache_config.num_gpu_blocks = num_blocks  # what _initialize_kv_caches stores
    kcfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                         prefix_cache_retention_interval=vcfg.cache_config.prefix_cache_retention_interval,
                         hash_block_size=shape.page)
    return cls(vllm_config=vcfg, kv_cache_config=kcfg, structured_output_manager=StructuredOutputManager(vcfg),
               block_size=shape.page, hash_block_size=shape.page, log_stats=True)


def import_class(qualname: str) -> type:
    import importlib

    mod, _, name = qualname.rpartition(".")
    if not mod:
        raise ImportError(f"{qualname!r} is not a qualified name (module.Class)")
    return getattr(importlib.import_module(mod), name)


def importable(qualname: str) -> bool:
    """Whether :func:`import_class` finds ``qualname`` (any failure: False)."""
    try:
        import_class(qualname)
    except Exception:  # noqa: BLE001 - a class being written may fail in any way
        return False
    return True


# ------------------------------------------------------------------ content oracle
@dataclass
class Live:
    """The driver's view of one admitted request (what the model runner holds)."""

    item: Item
    request: Any
    table: list[list[int]] = field(default_factory=list)  # per group: block ids by page
    chain: list[bytes] = field(default_factory=list)  # digest of tokens [0, (p + 1) * page)
    scheduled_once: bool = False


class Oracle:
    """Shadow map (group, block id) -> (page, digest) of what was computed into it."""

    def __init__(self, windows: list[int | None], page: int, null_id: int) -> None:
        self.windows, self.page, self.null_id = windows, page, null_id
        self.content: dict[tuple[int, int], tuple[int, bytes | None]] = {}
        self.checked_blocks = 0
        self.mismatches = 0
        self.hits_checked = 0
        self.anomalies = 0  # writes to a null or missing block (not a wrong hit; reported)
        self.examples: list[str] = []

    def _digests(self, live: Live, pages: int) -> list[bytes]:
        chain, P = live.chain, self.page
        if len(chain) < pages:
            req = live.request
            prompt = live.item.tokens
            for p in range(len(chain), pages):
                a, b = p * P, (p + 1) * P
                if b <= len(prompt):
                    page_bytes = prompt[a:b].tobytes()
                else:
                    page_bytes = np.asarray(list(req.all_token_ids[a:b]), dtype=np.int32).tobytes()
                prev = chain[-1] if chain else b"hkv-oracle"
                chain.append(hashlib.blake2b(prev + page_bytes, digest_size=12).digest())
        return chain

    def wrote(self, live: Live, start: int, n: int) -> None:
        """The step computed tokens [start, start + n) of ``live`` into its table."""
        P, end = self.page, start + n
        first, last = start // P, (end - 1) // P
        chain = self._digests(live, end // P)
        for p in range(first, last + 1):
            val = (p, chain[p]) if (p + 1) * P <= end else (p, None)  # a partial page never hits
            for g, row in enumerate(live.table):
                bid = row[p] if p < len(row) else None
                if bid is None or bid == self.null_id:
                    self.anomalies += 1
                    continue
                self.content[(g, bid)] = val

    def check_hit(self, live: Live, hit: int) -> None:
        """Every block the hit lets the model read holds this request's page."""
        if hit <= 0:
            return
        P = self.page
        n = hit // P
        chain = self._digests(live, n)
        self.hits_checked += 1
        for g, (row, w) in enumerate(zip(live.table, self.windows)):
            lo = 0 if w is None else max(0, hit - w) // P
            for p in range(lo, n):
                self.checked_blocks += 1
                bid = row[p] if p < len(row) else None
                got = None if bid is None or bid == self.null_id else self.content.get((g, bid))
                if got != (p, chain[p]):
                    self.mismatches += 1
                    if len(self.examples) < 5:
                        self.examples.append(f"request {live.item.idx} hit {hit}: group {g} page {p} "
                                             f"block {bid} holds {None if got is None else got[0]}")


# ------------------------------------------------------------------ replay
def sample_token(idx: int, pos: int) -> int:
    """Deterministic 'sampled' id of output ``pos`` of request ``idx`` (31 bits)."""
    x = (idx * 0x9E3779B97F4A7C15 + pos * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _MASK
    return (x ^ (x >> 32)) & 0x7FFFFFFF


@dataclass
class Tally:
    hit_tokens: int = 0
    input_tokens: int = 0
    scheduled_input_tokens: int = 0  # prompts of requests that were scheduled (the stats' queries)
    resumed_hit_tokens: int = 0
    stats_hits: int = 0
    stats_queries: int = 0
    stats_requests: int = 0
    stats_preempted_hits: int = 0
    preemptions: int = 0
    rejected: int = 0
    finished: int = 0
    steps: int = 0
    idle_steps: int = 0
    block_copies: int = 0  # copy-on-write block copies the scheduler asked for (none expected here)
    decode_tokens: int = 0
    schedule_s: list[float] = field(default_factory=list)


class Replay:
    """Drives one scheduler over the workload (one system, one budget)."""

    def __init__(self, scheduler: Any, items: list[Item], max_inflight: int, page: int) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        self.s, self.items, self.max_inflight = scheduler, items, max_inflight
        hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(page, hash_fn)
        self.params = SamplingParams
        windows = [g.kv_cache_spec.sliding_window if isinstance(g.kv_cache_spec, SlidingWindowSpec) else None
                   for g in scheduler.kv_cache_config.kv_cache_groups]
        self.oracle = Oracle(windows, page, scheduler.kv_cache_manager.block_pool.null_block.block_id)
        self.live: dict[str, Live] = {}
        self.arrivals = Arrivals(items)
        self.t = Tally()
        self._idle_run = 0

    def _admit(self) -> None:
        from vllm.v1.request import Request

        while len(self.live) < self.max_inflight:
            it = self.arrivals.next()
            if it is None:
                return
            req = Request(f"r{it.idx}", it.tokens.tolist(), self.params(max_tokens=it.decode), None,
                          block_hasher=self.hasher, cache_salt=it.session)
            self.live[req.request_id] = Live(it, req)
            self.s.add_request(req)

    def _observe(self, out: Any) -> list[tuple[Live, int, bool]]:
        """Update the block tables, apply the step's writes; return the hits to check."""
        hits: list[tuple[Live, int, bool]] = []
        starts: dict[str, int] = {}
        for nr in out.scheduled_new_reqs:
            live = self.live[nr.req_id]
            live.table = [list(ids) for ids in nr.block_ids]
            starts[nr.req_id] = nr.num_computed_tokens
            hits.append((live, nr.num_computed_tokens, not live.scheduled_once))
        c = out.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            live, ids = self.live[rid], c.new_block_ids[i]
            if rid in c.resumed_req_ids:
                live.table = [list(x) for x in ids]
                hits.append((live, c.num_computed_tokens[i], not live.scheduled_once))
            elif ids is not None:
                for row, new in zip(live.table, ids):
                    row.extend(new)
            starts[rid] = c.num_computed_tokens[i]
        for rid, n in out.num_scheduled_tokens.items():
            self.oracle.wrote(self.live[rid], starts[rid], n)
        return hits

    def _runner_output(self, out: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.live[rid].request
            if req.num_computed_tokens >= req.num_tokens:  # the chunk reached the last known token
                sampled.append([sample_token(self.live[rid].item.idx, req.num_output_tokens)])
                self.t.decode_tokens += 1
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled)

    def _finish(self, rid: str, rejected: bool = False) -> None:
        live = self.live.pop(rid)
        self.t.rejected += rejected
        self.t.finished += not rejected
        self.t.preemptions += live.request.num_preemptions
        self.arrivals.done(live.item)

    def _stuck(self) -> None:
        """Nothing runs and nothing can be scheduled: the head request can never
        fit the pool; abort it (counted in ``rejected``) as a server would."""
        from vllm.v1.request import RequestStatus

        if self.s.running or not self.s.waiting:
            return
        req = self.s.waiting.peek_request()
        self.s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
        live = self.live[req.request_id]
        if not live.scheduled_once:
            self.t.input_tokens += len(live.item.tokens)
        self._finish(req.request_id, rejected=True)

    def step(self) -> None:
        self._admit()
        t0 = time.perf_counter()
        out = self.s.schedule()
        self.t.schedule_s.append(time.perf_counter() - t0)
        self.t.steps += 1
        for live, hit, first in self._observe(out):
            self.oracle.check_hit(live, hit)
            if first:
                live.scheduled_once = True
                self.t.hit_tokens += hit
                self.t.input_tokens += len(live.item.tokens)
                self.t.scheduled_input_tokens += len(live.item.tokens)
            else:
                self.t.resumed_hit_tokens += hit
        self.t.block_copies += len(getattr(out, "kv_cache_block_copies", None) or ())
        if out.total_num_scheduled_tokens == 0:
            self.t.idle_steps += 1
            self._idle_run += 1
            if self._idle_run > 1000:
                raise RuntimeError(f"no progress for 1000 steps ({len(self.live)} requests live)")
            self._stuck()
        else:
            self._idle_run = 0
        eco = self.s.update_from_output(out, self._runner_output(out))
        for outs in eco.values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    self._finish(o.request_id)
            st = outs.scheduler_stats
            if st is not None and st.prefix_cache_stats is not None:
                pc = st.prefix_cache_stats
                self.t.stats_hits += pc.hits
                self.t.stats_queries += pc.queries
                self.t.stats_requests += pc.requests
                self.t.stats_preempted_hits += pc.preempted_hits

    def run(self, progress_every: int = 0) -> Tally:
        while self.arrivals.pending or self.live:
            self.step()
            if progress_every and self.t.steps % progress_every == 0:
                log(f"  step {self.t.steps}: {self.t.finished}/{len(self.items)} finished, "
                    f"hit {self.t.hit_tokens:,} / {self.t.input_tokens:,}")
        return self.t


# ------------------------------------------------------------------ systems and rows
def run_one(cls: type, mcfg: Any, groups: list[Any], num_blocks: int, retention: int | None,
            items: list[Item], args: argparse.Namespace, additional: dict[str, Any] | None) -> dict[str, Any]:
    release_memory()
    t0 = time.perf_counter()
    shape = EngineShape(PAGE, args.max_num_batched_tokens, args.max_num_seqs)
    sched = build_scheduler(cls, mcfg, groups, num_blocks, retention, shape, additional)
    rep = Replay(sched, items, args.max_inflight, PAGE)
    t = rep.run(args.progress)
    wall = time.perf_counter() - t0
    o = rep.oracle
    sched_ms = np.asarray(t.schedule_s) * 1e3 if t.schedule_s else np.zeros(1)
    return {
        "hit_tokens": t.hit_tokens, "input_tokens": t.input_tokens,
        "hit_rate": t.hit_tokens / max(1, t.input_tokens),
        "stats_hits": t.stats_hits, "stats_queries": t.stats_queries, "stats_requests": t.stats_requests,
        "stats_match": (t.stats_hits == t.hit_tokens and t.stats_queries == t.scheduled_input_tokens
                        and t.stats_preempted_hits == t.resumed_hit_tokens),
        "resumed_hit_tokens": t.resumed_hit_tokens, "stats_preempted_hits": t.stats_preempted_hits,
        "requests": t.finished, "rejected": t.rejected, "preemptions": t.preemptions,
        "decode_tokens": t.decode_tokens, "steps": t.steps, "idle_steps": t.idle_steps,
        "block_copies": t.block_copies,
        "oracle_hits_checked": o.hits_checked, "oracle_checked_blocks": o.checked_blocks,
        "oracle_mismatches": o.mismatches, "oracle_anomalies": o.anomalies, "oracle_examples": o.examples,
        "num_blocks": num_blocks, "kv_cache_groups": len(groups),
        "schedule_ms_p50": float(np.percentile(sched_ms, 50)), "schedule_ms_p99": float(np.percentile(sched_ms, 99)),
        "scheduler_cls": f"{cls.__module__}.{cls.__qualname__}", "wall_s": wall,
        # the hybridkv scheduler's own counters (holds, evictions, tree size)
        **({"hybridkv_stats": sched.hybridkv_stats()} if hasattr(sched, "hybridkv_stats") else {}),
    }


def mark_best(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per budget, the swept ``vllm`` row with the most hit tokens gets ``best``
    (a tie goes to the default setting, then to the earlier one); returns the
    ``vllm_best`` copies."""
    out = []
    for kv in dict.fromkeys(r["kv_bytes"] for r in rows):
        swept = [r for r in rows if r["kv_bytes"] == kv and r["system"] == "vllm"]
        if not swept:
            continue
        best = max(swept, key=lambda r: (r["hit_tokens"], r["default"], -swept.index(r)))
        best["best"] = True
        out.append(dict(best, system="vllm_best"))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from hybridkv.eval.traces import default_shared_traces

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared = default_shared_traces() or Path("traces")
    ap.add_argument("--trace", type=Path, default=shared / "mooncake_conversation_trace.jsonl",
                    help="Mooncake jsonl or kv-cache-tester folder (default: the shared conversation trace)")
    ap.add_argument("--limit", type=int, default=None,
                    help="first N requests (default 3000 for a jsonl trace, 600 for a session folder)")
    ap.add_argument("--budgets", default="59,594", help="KV byte budgets in GB (1e9 bytes), comma-separated")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    ap.add_argument("--retention", default=format_retention(VLLM_RETENTION_SWEEP),
                    help="prefix_cache_retention_interval values of the 'vllm' sweep ('none' = dense)")
    ap.add_argument("--hybridkv-scheduler-cls", default=DEFAULT_HYBRIDKV_CLS)
    ap.add_argument("--hybridkv-options", type=json.loads, default=None,
                    help="JSON object passed as additional_config['hybridkv'] (the scheduler's own options)")
    ap.add_argument("--max-inflight", type=int, default=16, help="admit while fewer are waiting+running")
    ap.add_argument("--max-decode", type=int, default=16, help="decode min(output_length, this) tokens")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--progress", type=int, default=0, help="log every N steps (0: off)")
    ap.add_argument("--details", type=Path, help="write every row and the run's parameters here as JSON")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = ap.parse_args(argv)
    if not args.trace.exists():
        ap.error(f"--trace {args.trace} does not exist")
    if args.limit is None:
        args.limit = 600 if args.trace.is_dir() else 3000
    for name in ("limit", "max_inflight", "max_decode", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        args.budget_list = [float(x) for x in args.budgets.split(",") if x.strip()]
        args.retention_list = parse_retention(args.retention, "--retention")
    except ValueError as exc:
        ap.error(str(exc))
    if not args.budget_list or min(args.budget_list) <= 0:
        ap.error("--budgets needs positive numbers")
    args.system_list = [s for s in args.systems.split(",") if s]
    if not args.system_list or any(s not in SYSTEMS for s in args.system_list):
        ap.error(f"--systems: a comma-separated subset of {','.join(SYSTEMS)}, got {args.systems!r}")
    if args.hybridkv_options is not None and not isinstance(args.hybridkv_options, dict):
        ap.error("--hybridkv-options must be a JSON object")
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, int | None]]:
    """(system, retention) replays per budget; retention 0 runs once for both
    ``vllm_default`` and the sweep."""
    runs: list[tuple[str, int | None]] = []
    if "vllm_default" in args.system_list or "vllm" in args.system_list:
        values = list(args.retention_list) if "vllm" in args.system_list else []
        if "vllm_default" in args.system_list and VLLM_RETENTION_DEFAULT not in values:
            values.insert(0, VLLM_RETENTION_DEFAULT)
        runs += [("vllm", v) for v in values]
    if "hybridkv" in args.system_list:
        runs.append(("hybridkv", VLLM_RETENTION_DEFAULT))
    return runs


def rows_for(system: str, retention: int | None, res: dict[str, Any], base: dict[str, Any],
             args: argparse.Namespace) -> Iterable[dict[str, Any]]:
    if system == "hybridkv":
        yield {**base, "system": "hybridkv", "setting": {"scheduler_cls": args.hybridkv_scheduler_cls,
                                                         "options": args.hybridkv_options or {}},
               "default": True, **res}
        return
    setting = {"prefix_cache_retention_interval": retention}
    default = retention == VLLM_RETENTION_DEFAULT
    if "vllm" in args.system_list and retention in args.retention_list:
        yield {**base, "system": "vllm", "setting": setting, "default": default, "best": False, **res}
    if default and "vllm_default" in args.system_list:
        yield {**base, "system": "vllm_default", "setting": setting, "default": True, **res}


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| budget | kv_bytes | system | setting | hit tokens | input tokens | hit rate | stats hits "
          "| preemptions | oracle blocks / mismatches | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["setting"]
        setting = (f"retention={format_retention([s['prefix_cache_retention_interval']])}"
                   if "prefix_cache_retention_interval" in s else s["scheduler_cls"].rsplit(".", 1)[-1])
        name = r["system"] + (" (best)" if r.get("best") else "")
        print(f"| {r['budget_gb']:g} GB | {r['kv_bytes']:,} | {name} | {setting} | {r['hit_tokens']:,} "
              f"| {r['input_tokens']:,} | {r['hit_rate']:.2%} | {r['stats_hits']:,} | {r['preemptions']} "
              f"| {r['oracle_checked_blocks']:,} / {r['oracle_mismatches']} | {r['wall_s']:.0f} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("vllm").setLevel(logging.WARNING)
    start = time.perf_counter()
    items, meta = load_workload(args.trace, args.limit, args.max_decode)
    log(f"{meta['trace']}: {meta['requests']} requests, {meta['input_tokens']:,} input tokens, "
        f"{meta['sessions']} sessions ({time.perf_counter() - start:.0f} s)")
    max_len = -(-max(len(i.tokens) + i.decode for i in items) // PAGE) * PAGE + PAGE
    mcfg = model_config(max_len)
    groups, per_layer_bpt, group_size = kv_cache_groups(PAGE)
    from vllm.v1.core.sched.scheduler import Scheduler

    classes: dict[str, type] = {"vllm": Scheduler}
    runs = plan(args)
    if "hybridkv" in args.system_list:
        try:
            classes["hybridkv"] = import_class(args.hybridkv_scheduler_cls)
        except Exception as exc:  # noqa: BLE001 - any import failure only skips those rows
            log(f"skipping hybridkv: {args.hybridkv_scheduler_cls} does not import "
                f"({type(exc).__name__}: {exc})")
            runs = [r for r in runs if r[0] != "hybridkv"]
    additional = {"hybridkv": args.hybridkv_options} if args.hybridkv_options else None
    rows: list[dict[str, Any]] = []
    for gb in args.budget_list:
        kv = int(gb * GB)
        num_blocks = vllm_num_blocks(kv, per_layer_bpt, PAGE, group_size)
        base = {"kv_bytes": kv, "budget_gb": gb, "trace": meta["trace"], "limit": args.limit}
        for system, retention in runs:
            what = system if system == "hybridkv" else f"vllm retention={format_retention([retention])}"
            log(f"{gb:g} GB ({num_blocks:,} blocks): {what} ...")
            res = run_one(classes[system], mcfg, groups, num_blocks, retention, items, args,
                          additional if system == "hybridkv" else None)
            log(f"  hit {res['hit_tokens']:,} / {res['input_tokens']:,} = {res['hit_rate']:.2%} "
                f"(stats {res['stats_hits']:,} / {res['stats_queries']:,}), preemptions {res['preemptions']}, "
                f"rejected {res['rejected']}, "
                f"oracle {res['oracle_checked_blocks']:,} blocks / {res['oracle_mismatches']} mismatches, "
                f"{res['steps']:,} steps, {res['wall_s']:.0f} s")
            for ex in res["oracle_examples"]:
                log(f"  oracle: {ex}")
            if not res["stats_match"]:
                log("  warning: first-scheduling hits differ from SchedulerStats.prefix_cache_stats")
            rows.extend(rows_for(system, retention, res, base, args))
    rows.extend(mark_best(rows))
    bound = prefix_bound(items, PAGE)
    log(f"bound: {bound['hit_tokens']:,} / {bound['input_tokens']:,} = {bound['hit_rate']:.2%} "
        f"(no cache can hit more on this workload)")
    order = {"hybridkv": 0, "vllm_default": 1, "vllm_best": 2, "vllm": 3}
    rows.sort(key=lambda r: (r["kv_bytes"], order[r["system"]]))
    wall = time.perf_counter() - start
    log(f"done in {wall:.0f} s")
    if args.details:
        args.details.write_text(json.dumps({**meta, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                             for k, v in vars(args).items()},
                                            "max_model_len": max_len, "wall_s": wall, "rows": rows,
                                            "bound": bound}, indent=1))
    if args.json:
        print(json.dumps({"vllm": rows, "bound": bound}))
    else:
        print_table(rows)
        print(f"\nbound (no prefix cache can hit more): {bound['hit_tokens']:,} / {bound['input_tokens']:,} "
              f"= {bound['hit_rate']:.2%}")
    return 1 if any(r["oracle_mismatches"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
