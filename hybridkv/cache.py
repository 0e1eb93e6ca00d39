"""The request-level facade an engine worker holds.

Lifecycle of one request::

    req = cache.begin(prompt_tokens, namespace)    # window-safe match + lock
    while req.computed < len(prompt):               # chunked prefill
        full, swa = cache.allocate(req, chunk)      # slots for the next chunk (evicts as needed)
        ...write KV of the chunk into those slots...
        cache.commit(req, chunk)                    # chunk end: out-of-window SWA released
    while decoding:
        cache.append_tokens(req, [tok]); cache.allocate(req, 1); ...; cache.commit(req, 1)
    cache.finish(req)                               # insert into the tree, unlock

An engine's scheduler drives a whole batch per step instead (one call each,
per-request failures reported, see :class:`StepBatch`)::

    batch = cache.step(running, new_tokens=sampled)  # append + allocate both kinds
    ...attention over batch.full_slots / batch.swa_slots, page tables...
    cache.commit_step(batch)

Ownership: pages ``[0, req.tree_pages)`` belong to the tree (locked by the
request); pages after that belong to the request until :meth:`finish`.  The
request's SWA view holds a page id only where the request may read it: the
pinned window of its cached prefix and its own unreleased pages.

Validation happens once, at the public methods; internal calls (``_append``,
:class:`~hybridkv.allocation.RequestPages`, the :class:`~hybridkv.lifecycle.Lifecycle`)
trust their callers.  The cache composes its parts: what a request does to the
tree (begin, the release rule, the finish's insert, end) is the
:class:`~hybridkv.lifecycle.Lifecycle` every host shares (``lifecycle``); page
growth and SWA release are :class:`~hybridkv.allocation.RequestPages`
(``pages``), the request record :mod:`hybridkv.request`, the step's record
and row arguments :mod:`hybridkv.step`, the policy :mod:`hybridkv.cache_config`.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import numpy as np

from ._validate import as_token_array, check_int
from .allocation import CacheFullError, RequestPages
from .cache_config import CacheConfig, check_count
from .lifecycle import Lifecycle, TierHooks
from .pools import DualPool
from .radix import MatchResult, TreeConfig, WindowSafeTree
from .radix.node import NO_PAGE
from .radix.tree import parts_side
from .radix import PageNames
from .request import Request
from .spec import ModelSpec
from .step import StepBatch, build_batch, check_distinct, step_counts, step_tokens

__all__ = ["CacheConfig", "CacheFullError", "HybridKVCache", "Request", "StepBatch"]

_rids = itertools.count()



def _own_tokens(tokens: object) -> tuple[np.ndarray, int]:
    """A request's own copy of ``tokens`` (validated like :func:`as_token_array`):
    a fresh int32 buffer with room for decode appends, and the token count.
    An int32 array, the common input, is checked on the copy, so the caller's
    array is read once (the copy is still in the CPU cache when its min is taken)."""
    plain = type(tokens) is np.ndarray and tokens.dtype == np.int32 and tokens.ndim == 1
    arr = tokens if plain else as_token_array(tokens)
    n = arr.size
    buf = np.empty(n + max(16, n // 8), dtype=np.int32)
    buf[:n] = arr
    if plain and n and buf[:n].min() < 0:
        as_token_array(tokens)  # raises the ValueError that names the argument
    return buf, n



class HybridKVCache:
    """Window-safe prefix cache over dual Full/SWA pools for one engine worker.

    Args:
        spec: the model.
        config: :class:`CacheConfig` (budget and policy).
    """

    def __init__(self, spec: ModelSpec, config: CacheConfig | None = None) -> None:
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
        config = config or CacheConfig(budget_bytes=spec.bytes_per_page("swa") * 64)
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        self.spec = spec
        self.config = config
        self.page_size = spec.page_size
        self.pool = DualPool(spec, full_pages=config.full_pages, swa_pages=config.swa_pages,
                             budget_bytes=config.budget_bytes, device=config.device)
        wp = spec.window_pages
        pool = self.pool
        min_bytes = (pool.swa_page_bytes + pool.full_page_bytes) * (wp + 1)
        if pool.budget_bytes < min_bytes or pool.swa.capacity < wp + 1 or pool.full.capacity < wp + 1:
            raise ValueError(
                f"the cache can hold {pool.full.capacity} full and {pool.swa.capacity} SWA pages "
                f"({pool.budget_bytes} bytes); one request needs at least {wp + 1} of each "
                f"(a {spec.window}-token window plus a page: {min_bytes} bytes at "
                f"{pool.full_page_bytes} + {pool.swa_page_bytes} bytes per full + SWA page)")
        self.tree = WindowSafeTree(
            TreeConfig(spec.page_size, spec.window, config.swa_checkpoint, config.swa_eviction,
                       anchor_branch_points=config.anchor_branch_points, ranking=config.eviction_ranking),
            # an SWA page frees at least the lead group's bytes (other groups may have
            # given theirs back already): eviction counts that, so it never frees too little
            self.pool, full_page_bytes=self.pool.full_page_bytes, swa_page_bytes=self.pool.lead_page_bytes)
        self._live: dict[int, Request] = {}
        self.last_match_us = 0.0  # duration of the tree match inside the last begin()
        self.counters = {"requests": 0, "hit_tokens": 0, "raw_match_tokens": 0, "input_tokens": 0,
                         "rejected": 0, "released_swa_pages": 0}
        if self.pool.groups:  # pages of the smaller windows' groups given back early
            self.counters["released_group_pages"] = 0
        # the request lifecycle on the tree (begin, insert at finish, end), shared with
        # the vLLM and SGLang hosts
        self.lifecycle = Lifecycle(self.tree)
        # page growth and SWA release of the live requests: a collaborator working on the
        # same pool, tree, counters and live requests (the dict objects are shared)
        self.pages = RequestPages(self.pool, self.tree, self.lifecycle, config, self.counters, self._live)
        # L2/L3 beside the tree (a hybridkv.tiers TierCoordinator, set by TieredCache):
        # called in begin (before_match, after_begin), finish (before_finish), stats
        # and check_invariants; None: L1 only
        self.lower_tiers: TierHooks | None = None

    # ================================================================ match
    def match(self, tokens: object, namespace: str = "default") -> MatchResult:
        """Peek: window-safe hit for ``tokens`` without locking or touching LRU."""
        tokens = as_token_array(tokens)
        self._check_namespace(namespace)
        return self.lifecycle.peek(tokens, namespace, max(0, len(tokens) - 1))

    def begin(self, tokens: object, namespace: str = "default", rid: Any = None) -> Request:
        """Start a request: match its prompt, lock the hit.

        The hit never covers the last prompt token (its logits are needed).
        Runtime complexity: that of :meth:`WindowSafeTree.match` plus O(depth).
        """
        buf, n = _own_tokens(tokens)
        if n == 0:
            raise ValueError("tokens must not be empty")
        self._check_namespace(namespace)
        lower = self.lower_tiers
        if lower is None:
            return self._begin(buf, n, namespace, rid)
        plan = lower.before_match(buf[:n], namespace)
        req = self._begin(buf, n, namespace, rid)
        lower.after_begin(req, plan)
        return req

    def _begin(self, buf: np.ndarray, n_tokens: int, namespace: str, rid: Any) -> Request:
        """``buf``: the request's own token buffer (:func:`_own_tokens`), ``n_tokens`` used."""
        tokens = buf[:n_tokens]
        t0 = time.perf_counter()
        hit = self.lifecycle.begin(tokens, namespace, len(tokens) - 1)
        self.last_match_us = (time.perf_counter() - t0) * 1e6
        handle, safe, raw_pages = hit.handle, hit.pages, hit.raw_pages
        # room for every page of the prompt (+ some decode) so prefill never regrows
        full = np.empty(max(16, -(-len(tokens) // self.page_size) + 16), dtype=np.int32)
        n = 0
        # the hit's page ids are copied once, straight from the nodes into the request
        for nd, take in hit.parts:
            full[n:n + take] = nd.full[:take]
            n += take
        swa = np.empty(full.size, dtype=np.int32)
        swa.fill(NO_PAGE)  # np.full is a Python-level wrapper
        ids = handle.ids  # the pinned window, as Python ints (None: nothing locked)
        if ids:
            swa[n - len(ids):n] = ids
        side = self._side_window(hit.parts, full.size, n, len(ids) if ids else 0) if self.pool.groups else None
        length = safe * self.page_size
        raw_length = raw_pages * self.page_size
        req = Request(rid if rid is not None else next(_rids), namespace, buf, n_tokens, length,
                      raw_length, full, swa, n, handle, computed=length, n_pages=n, last_release=length,
                      side_pages=side)
        self._live[id(req)] = req
        c = self.counters
        c["requests"] += 1
        c["hit_tokens"] += length
        c["raw_match_tokens"] += raw_length
        c["input_tokens"] += len(tokens)
        return req

    def _side_window(self, parts: list, size: int, n: int, w: int) -> list[np.ndarray]:
        """Each side group's page ids for a new request of ``size`` page slots
        whose hit is ``n`` pages: its pinned window (the last ``w`` pages of the
        hit, as the lead's) from the tree's nodes, ``NO_PAGE`` elsewhere.  O(n x groups)."""
        out = [np.full(size, NO_PAGE, dtype=np.int32) for _ in self.pool.groups]
        if w:
            for s, got in zip(out, parts_side(parts, len(out))):
                s[n - w:n] = got[n - w:n]
        return out

    # ============================================================ allocation
    def append_tokens(self, req: Request, tokens: object) -> None:
        """Append generated tokens to ``req`` (decode).  Amortised O(len(tokens))."""
        self._check_live(req)
        self._append(req, as_token_array(tokens))

    @staticmethod
    def _append(req: Request, new: np.ndarray) -> None:
        n, m = req.n_tokens, len(new)
        if n + m > req.token_buffer.size:
            grown = np.empty(max(2 * req.token_buffer.size, n + m), dtype=np.int32)
            grown[:n] = req.token_buffer[:n]
            req.token_buffer = grown
        req.token_buffer[n:n + m] = new
        req.n_tokens = n + m

    def allocate(self, req: Request, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots for positions ``[req.computed, req.computed + n)``.

        Allocates pages in both pools, evicting cached data if needed.  Returns
        ``(full_slots, swa_slots)`` int64 arrays of length ``n``.  Raises
        :class:`CacheFullError` (request unchanged) when memory cannot be found.
        """
        self._check_reserve(req, n)
        self.pages.reserve(req, n)
        start = req.computed
        if n == 1:  # decode: two scalars, not two fancy-indexing passes
            P = self.page_size
            pg, off = divmod(start, P)
            swa = int(req.swa_pages[pg])
            if swa >= 0:
                return (np.array([int(req.full_pages[pg]) * P + off], dtype=np.int64),
                        np.array([swa * P + off], dtype=np.int64))
        return self._full_slots(req, start, start + n), self._swa_slots(req, start, start + n)

    def reserve(self, req: Request, n: int) -> None:
        """:meth:`allocate` without computing slots (schedulers that only account)."""
        self._check_reserve(req, n)
        self.pages.reserve(req, n)

    def _check_reserve(self, req: Request, n: object) -> None:
        self._check_live(req)
        if type(n) is not int or n < 1:  # plain positive ints (every call of a replay) skip check_count
            n = check_count(n, "n")
        if req.computed + n > req.n_tokens:
            raise ValueError(f"n={n} goes past the request's {req.n_tokens} tokens "
                             f"({req.computed} computed; append_tokens first)")


    def commit(self, req: Request, n: int, *, release: bool | None = None) -> None:
        """Mark ``n`` more tokens as computed (their KV is written).

        ``n`` may not pass what :meth:`allocate`/:meth:`reserve` handed out.
        Releases out-of-window SWA when ``release`` is true, or by default when
        this is a chunk (``n > 1``) or ``decode_release_interval`` tokens passed.
        """
        self._check_live(req)
        if type(n) is not int or n < 1:
            n = check_count(n, "n")
        if req.computed + n > req.allocated:
            raise ValueError(f"commit of n={n} passes the allocated slots: {req.computed} computed, "
                             f"slots handed out up to {req.allocated}")
        if release is not None and not isinstance(release, (bool, np.bool_)):
            raise TypeError(f"release must be a bool or None, got {type(release).__name__}")
        self._commit(req, n, release)

    def _commit(self, req: Request, n: int, release: bool | None) -> None:
        req.computed += n
        if release is None:
            release = n > 1 or req.computed - req.last_release >= self.config.decode_release_interval
        if release:
            req.last_release = req.computed
            self.pages.release(req, force=False)

    def release_out_of_window(self, req: Request) -> int:
        """Free the request's own SWA pages wholly before ``computed - W``.

        Retention policy decides which survive (see :class:`CacheConfig`);
        checkpoint windows always survive.  Returns pages freed.  O(pages).
        """
        self._check_live(req)
        req.last_release = req.computed
        return self.pages.release(req, force=False)


    # ================================================================ finish
    def finish(self, req: Request, *, cache: bool = True) -> int:
        """End ``req``: insert its computed page-aligned prefix (if ``cache``),
        unlock, and free what the tree did not take.  Returns new cached pages.

        The insert starts at the node the request locked (its cached prefix),
        not at the root.  O(depth + new pages).
        """
        self._check_live(req)
        if not isinstance(cache, (bool, np.bool_)):
            raise TypeError(f"cache must be a bool, got {type(cache).__name__}")
        names = None
        if cache and self.lower_tiers is not None:
            names = self.lower_tiers.before_finish(req)
        return self._finish(req, bool(cache), names)

    def _finish(self, req: Request, cache: bool, names: PageNames | None = None) -> int:
        P = self.page_size
        aligned = max(req.computed // P, req.tree_pages) if cache else req.tree_pages
        new_pages = 0
        if cache and aligned > req.tree_pages:
            if self.pool.groups:
                self.pages.release_groups(req, aligned)
            side = None if req.side_pages is None else [s[:aligned] for s in req.side_pages]
            res = self.lifecycle.insert(req.handle, req.tree_pages, req.token_buffer[:aligned * P],
                                        req.full_pages[:aligned], req.swa_pages[:aligned], req.namespace,
                                        mark=req.prompt_len // P, side=side, names=names)
            assert res is not None, "a request's lock ends where its tree pages do while it is live"
            new_pages = res.new_pages
        elif names is not None and names.host_at is not None:  # nothing new: the finish's copies record
            self.lifecycle.take_records(req.token_buffer[:aligned * P], req.namespace, names.host_at)
        rest_full = req.full_pages[aligned:req.n_pages]
        rest_swa = req.swa_pages[aligned:req.n_pages]
        if rest_full.size:
            self.pool.free_full_trusted(rest_full)
        if aligned < req.release_mark:  # pages from the release mark on all hold SWA (see _release)
            rest_swa = rest_swa[rest_swa >= 0]
        if rest_swa.size:
            self.pool.free_swa_trusted(rest_swa)
        self.lifecycle.end(req.handle)
        req.finished = True
        del self._live[id(req)]
        return new_pages

    def abort(self, req: Request) -> None:
        """End ``req`` without caching anything it computed."""
        self.finish(req, cache=False)


    def step(self, requests: Sequence[Request], new_tokens: object = None,
             num_new: object = None) -> StepBatch:
        """Append, allocate and hand out slots for a whole batch in one call.

        Args:
            requests: the running requests of this engine step.
            new_tokens: tokens to append first (decode: the token each request
                sampled last step).  A 1-D int array with one entry per request
                (a negative entry appends nothing), or a sequence whose entries
                are None, an int or a 1-D int array.
            num_new: positions to compute this step per request (int or 1-D
                array); default: every token not computed yet (1 in decode).

        Returns a :class:`StepBatch`.  A request that cannot get its pages
        (:class:`CacheFullError`) or whose row is invalid is reported in
        ``ok``/``errors`` and left exactly as it was; the others are allocated.
        A request listed twice raises ``ValueError`` before anything changes.
        Decode (one new position per request) costs O(1) Python work per
        request plus O(pages) where a page fills up.
        """
        reqs = list(requests) if not isinstance(requests, list) else requests
        B = len(reqs)
        check_distinct(reqs)
        toks = step_tokens(new_tokens, B)
        counts = step_counts(num_new, B)
        ok = np.ones(B, dtype=bool)
        errors: dict[int, Exception] = {}
        starts = [0] * B
        nums = [0] * B
        grew: list[tuple[int, int, int]] = []
        pending = self._step_rows(reqs, toks, counts, ok, errors, starts, nums)
        if pending:
            self.pages.step_grow(pending, ok, errors, nums, grew, reqs)
        fs, ss, multi = self._step_slots(reqs, starts, nums)
        return build_batch(reqs, ok, errors, starts, nums, fs, ss, multi, grew)

    def _step_rows(self, reqs: list, toks: list | None, counts: list | None, ok: np.ndarray, errors: dict,
                   starts: list, nums: list) -> list[tuple[int, Request, int, int]]:
        """Append each row's new tokens and check its positions (``starts``/``nums``
        set; a bad row fails in ``ok``/``errors`` with its tokens taken back).  Returns
        the rows that need pages: ``(row, req, pages needed, tokens appended)``.  O(B)."""
        P = self.page_size
        live = self._live
        pending: list[tuple[int, Request, int, int]] = []
        for i, req in enumerate(reqs):
            if live.get(id(req)) is not req:
                ok[i] = False
                errors[i] = ValueError(f"requests[{i}] is not live in this cache")
                continue
            appended = 0
            t = toks[i] if toks is not None else None
            if t is not None:
                if type(t) is int:
                    n = req.n_tokens
                    if n == req.token_buffer.size:
                        self._append(req, np.array([t], dtype=np.int32))
                    else:
                        req.token_buffer[n] = t
                        req.n_tokens = n + 1
                    appended = 1
                else:
                    self._append(req, t)
                    appended = len(t)
            start = req.computed
            k = counts[i] if counts is not None else req.n_tokens - start
            end = start + k
            if k < 1 or end > req.n_tokens:
                req.n_tokens -= appended
                ok[i] = False
                errors[i] = ValueError(f"requests[{i}]: num_new={k} must be >= 1 and within its "
                                       f"{req.n_tokens + appended} tokens ({start} computed)")
                continue
            starts[i] = start
            nums[i] = k
            if end > req.n_pages * P:
                pending.append((i, req, -(-end // P) - req.n_pages, appended))
        return pending

    def _step_slots(self, reqs: list, starts: list, nums: list) -> tuple[list, list, bool]:
        """Slots of every row that got its pages (``nums[i] > 0``): an int per
        single-token row, int64 arrays otherwise (then ``multi`` is True).  O(B + slots)."""
        P = self.page_size
        B = len(reqs)
        fs: list = [0] * B
        ss: list = [0] * B
        multi = False
        for i, req in enumerate(reqs):
            k = nums[i]
            if not k:
                continue
            start = starts[i]
            end = start + k
            if end > req.allocated:
                req.allocated = end
            if k == 1:
                pg = start // P
                off = start - pg * P
                fs[i] = int(req.full_pages[pg]) * P + off
                ss[i] = int(req.swa_pages[pg]) * P + off
            else:
                multi = True
                fs[i] = self._full_slots(req, start, end)
                ss[i] = self._swa_slots(req, start, end)
        return fs, ss, multi

    def commit_step(self, batch: StepBatch, *, release: bool | None = None) -> None:
        """Commit every ok row of ``batch`` (their KV is written); see :meth:`commit`.

        Raises ValueError, changing nothing, if the batch was committed already or
        a row's request moved on since :meth:`step`.  O(batch).
        """
        if not isinstance(batch, StepBatch):
            raise TypeError(f"batch must be a StepBatch, got {type(batch).__name__}")
        if batch.committed:
            raise ValueError("this StepBatch was committed already")
        live = self._live
        rows = np.flatnonzero(batch.ok).tolist() if batch.errors else range(len(batch.requests))
        starts = batch.start.tolist()
        nums = batch.num_new.tolist()
        reqs = batch.requests
        for i in rows:
            req = reqs[i]
            if live.get(id(req)) is not req or req.computed != starts[i] or starts[i] + nums[i] > req.allocated:
                raise ValueError(f"row {i} of the batch is stale (its request finished or moved on)")
        batch.committed = True
        interval = self.config.decode_release_interval
        for i in rows:
            req = reqs[i]
            k = nums[i]
            req.computed += k
            if release if release is not None else (k > 1 or req.computed - req.last_release >= interval):
                req.last_release = req.computed
                self.pages.release(req, force=False)

    def page_table(self, requests: Sequence[Request], kind: str = "full") -> np.ndarray:
        """Logical pages of ``requests`` as an int32 ``[batch, max_pages]`` table
        padded with -1 (``kind`` "full" or "swa"; SWA is -1 where released).
        Map to arena blocks with ``cache.pool.buffers.of(kind).block_table(table, group)``
        (a -1 entry maps to garbage: mask it).  O(batch * pages)."""
        if kind not in ("full", "swa"):
            raise ValueError(f"kind must be 'full' or 'swa', got {kind!r}")
        reqs = list(requests)
        for i, r in enumerate(reqs):
            self._check_live(r)
        width = max((r.n_pages for r in reqs), default=0)
        out = np.full((len(reqs), width), NO_PAGE, dtype=np.int32)
        for i, r in enumerate(reqs):
            out[i, :r.n_pages] = (r.full_pages if kind == "full" else r.swa_pages)[:r.n_pages]
        return out

    # ================================================================= slots
    def full_slots(self, req: Request, start: int, end: int) -> np.ndarray:
        """Full-pool token slots of positions ``[start, end)`` (int64)."""
        self._check_live(req)
        self._check_range(req, start, end)
        return self._full_slots(req, start, end)

    def swa_slots(self, req: Request, start: int, end: int) -> np.ndarray:
        """SWA-pool token slots of ``[start, end)``; raises if any was released.

        Reading a released SWA slot is the pseudo-hit bug this library exists
        to prevent, so it is an error, never garbage.
        """
        self._check_live(req)
        self._check_range(req, start, end)
        return self._swa_slots(req, start, end)

    def _full_slots(self, req: Request, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end, dtype=np.int64)
        return req.full_pages[pos // self.page_size].astype(np.int64) * self.page_size + pos % self.page_size

    def _swa_slots(self, req: Request, start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end, dtype=np.int64)
        pages = req.swa_pages[pos // self.page_size]
        if pages.size and pages.min() < 0:
            bad = int(pos[np.argmax(pages < 0)])
            raise RuntimeError(f"SWA KV of position {bad} is not held by request {req.rid}")
        return pages.astype(np.int64) * self.page_size + pos % self.page_size

    def _check_range(self, req: Request, start: object, end: object) -> None:
        for name, v in (("start", start), ("end", end)):
            check_int(v, name)
        if not (0 <= start <= end <= req.n_pages * self.page_size):  # type: ignore[operator]
            raise ValueError(f"positions [{start}, {end}) outside the request's slots "
                             f"[0, {req.n_pages * self.page_size})")

    def _check_live(self, req: Request) -> None:
        if self._live.get(id(req)) is req and not req.finished:  # the common case first
            return
        if not isinstance(req, Request):
            raise TypeError(f"req must be a Request, got {type(req).__name__}")
        if req.finished or self._live.get(id(req)) is not req:
            raise ValueError(f"request {req.rid} is not live in this cache")

    @staticmethod
    def _check_namespace(namespace: object) -> None:
        if not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, got {type(namespace).__name__}")

    # ================================================================= stats
    @property
    def live_requests(self) -> list[Request]:
        return list(self._live.values())

    def stats(self) -> dict[str, Any]:
        """Counters and sizes (tokens), then the lower tiers' figures (if any)."""
        p = self.page_size
        out = dict(self.counters)
        out.update(
            cached_tokens=self.tree.full_pages_cached * p,
            cached_swa_tokens=self.tree.swa_pages_cached * p,
            full_pool_tokens=self.pool.full.capacity * p,
            swa_pool_tokens=self.pool.swa.capacity * p,
            evicted_tokens=self.tree.evicted_full_pages * p,
            evicted_swa_tokens=self.tree.evicted_swa_pages * p,
            used_bytes=self.pool.used_bytes(), budget_bytes=self.pool.budget_bytes,
            tensor_bytes=self.pool.tensor_bytes(), tree_nodes=self.tree.num_nodes,
        )
        if self.pool.groups:  # tokens each sliding group beside the lead holds
            out["group_tokens"] = {g.group.name: g.used * p for g in self.pool.groups}
        if self.lower_tiers is not None:
            out.update(self.lower_tiers.stats())
        return out

    def check_invariants(self) -> None:
        """Tree + pools + ownership: every used page is owned exactly once; then the
        lower tiers' own checks (if any).  O(n)."""
        self.tree.check_invariants()
        self.pool.check_invariants()
        self.pages.check_ownership()
        if self.lower_tiers is not None:
            self.lower_tiers.check_invariants()
