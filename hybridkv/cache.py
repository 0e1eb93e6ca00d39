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

Ownership: pages ``[0, req.tree_pages)`` belong to the tree (locked by the
request); pages after that belong to the request until :meth:`finish`.  The
request's SWA view holds a page id only where the request may read it: the
pinned window of its cached prefix and its own unreleased pages.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._validate import as_token_array
from .pools import DualPool
from .radix import LockHandle, MatchResult, TreeConfig, WindowSafeTree
from .radix.node import NO_PAGE
from .spec import ModelSpec

__all__ = ["CacheConfig", "CacheFullError", "HybridKVCache", "Request"]

_RETENTION = ("adaptive", "eager", "dense", "none")
_rids = itertools.count()


class CacheFullError(RuntimeError):
    """Not enough free or evictable memory; the request's state is unchanged."""


@dataclass(frozen=True)
class CacheConfig:
    """Cache policy and budget.

    Attributes:
        budget_bytes: shared byte budget of both pools (see :class:`DualPool`).
        full_pages / swa_pages: fixed pool capacities (instead of, or as caps
            under, ``budget_bytes``).
        device: device of the KV buffers (``"meta"``: accounting only).
        swa_checkpoint: K tokens between SWA retention checkpoints (0 = off).
        retention: what happens to SWA pages that fall out of a live request's
            window: ``"adaptive"`` keeps them while the budget has spare room
            (> ``spare_fraction``) and frees all but checkpoints otherwise;
            ``"eager"`` always frees all but checkpoints; ``"dense"`` keeps
            all (the tree evicts them first under pressure); ``"none"`` never
            releases (baselines that hold SWA for every cached token).
        decode_release_interval: release out-of-window SWA every N decode tokens.
        swa_eviction / anchor_branch_points: see :class:`TreeConfig`.
    """

    budget_bytes: int | None = None
    full_pages: int | None = None
    swa_pages: int | None = None
    device: str | None = "meta"
    swa_checkpoint: int = 16384
    retention: str = "adaptive"
    spare_fraction: float = 0.02
    decode_release_interval: int = 64
    swa_eviction: str = "page"
    anchor_branch_points: bool = True

    def __post_init__(self) -> None:
        if self.retention not in _RETENTION:
            raise ValueError(f"retention must be one of {_RETENTION}, got {self.retention!r}")
        if not 0.0 <= float(self.spare_fraction) < 1.0:
            raise ValueError(f"spare_fraction must be in [0, 1), got {self.spare_fraction}")
        if not isinstance(self.decode_release_interval, int) or self.decode_release_interval < 1:
            raise ValueError(f"decode_release_interval must be an int >= 1, got {self.decode_release_interval!r}")


@dataclass
class Request:
    """A live request: its tokens, pages and lock.  Mutated only by the cache."""

    rid: Any
    namespace: str
    tokens: np.ndarray
    prefix_len: int
    raw_match_len: int
    full_pages: np.ndarray
    swa_pages: np.ndarray
    tree_pages: int
    handle: LockHandle
    computed: int = 0
    n_pages: int = 0
    last_release: int = 0
    finished: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


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
        min_bytes = self.pool.swa_page_bytes * spec.window_pages + self.pool.full_page_bytes * spec.window_pages
        if self.pool.budget_bytes < min_bytes or self.pool.swa.capacity < spec.window_pages:
            raise ValueError(f"budget of {self.pool.budget_bytes} bytes cannot hold one {spec.window}-token "
                             f"window (needs >= {min_bytes} bytes)")
        self.tree = WindowSafeTree(
            TreeConfig(spec.page_size, spec.window, config.swa_checkpoint, config.swa_eviction,
                       config.anchor_branch_points),
            self.pool, full_page_bytes=self.pool.full_page_bytes, swa_page_bytes=self.pool.swa_page_bytes)
        self._live: dict[int, Request] = {}
        self.last_match_us = 0.0  # duration of the tree match inside the last begin()
        self.counters = {"requests": 0, "hit_tokens": 0, "raw_match_tokens": 0, "input_tokens": 0,
                         "rejected": 0, "released_swa_pages": 0}

    # ================================================================ match
    def match(self, tokens: object, namespace: str = "default") -> MatchResult:
        """Peek: window-safe hit for ``tokens`` without locking or touching LRU."""
        tokens = as_token_array(tokens)
        return self.tree.match(tokens, namespace, max_len=max(0, len(tokens) - 1), touch=False)

    def begin(self, tokens: object, namespace: str = "default", rid: Any = None) -> Request:
        """Start a request: match its prompt, lock the hit.

        The hit never covers the last prompt token (its logits are needed).
        Runtime complexity: that of :meth:`WindowSafeTree.match` plus O(depth).
        """
        tokens = as_token_array(tokens)
        if len(tokens) == 0:
            raise ValueError("tokens must not be empty")
        t0 = time.perf_counter()
        m = self.tree._match(tokens, namespace, len(tokens) - 1, True, True)
        self.last_match_us = (time.perf_counter() - t0) * 1e6
        handle = self.tree.lock(m.node)
        n = len(m.full_pages)
        full = np.empty(max(16, 2 * n), dtype=np.int32)
        full[:n] = m.full_pages
        swa = np.full(full.size, NO_PAGE, dtype=np.int32)
        w = handle.swa_pages.size
        if w:
            swa[n - w:n] = handle.swa_pages
        req = Request(rid if rid is not None else next(_rids), namespace, tokens, m.length,
                      m.raw_length, full, swa, n, handle, computed=m.length, n_pages=n,
                      last_release=m.length)
        self._live[id(req)] = req
        self.counters["requests"] += 1
        self.counters["hit_tokens"] += m.length
        self.counters["raw_match_tokens"] += m.raw_length
        self.counters["input_tokens"] += len(tokens)
        return req

    # ============================================================ allocation
    def append_tokens(self, req: Request, tokens: object) -> None:
        """Append generated tokens to ``req`` (decode).  O(n) amortised."""
        self._check_live(req)
        new = as_token_array(tokens)
        req.tokens = np.concatenate([req.tokens, new])

    def allocate(self, req: Request, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Slots for positions ``[req.computed, req.computed + n)``.

        Allocates pages in both pools, evicting cached data if needed.  Returns
        ``(full_slots, swa_slots)`` int64 arrays of length ``n``.  Raises
        :class:`CacheFullError` (request unchanged) when memory cannot be found.
        """
        self.reserve(req, n)
        end = req.computed + n
        return self.full_slots(req, req.computed, end), self.swa_slots(req, req.computed, end)

    def reserve(self, req: Request, n: int) -> None:
        """:meth:`allocate` without computing slots (schedulers that only account)."""
        self._check_live(req)
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive int, got {n!r}")
        end = req.computed + n
        if end > req.n_tokens:
            raise ValueError(f"n={n} goes past the request's {req.n_tokens} tokens (append_tokens first)")
        need = -(-end // self.page_size) - req.n_pages
        if need > 0:
            self._grow(req, need)

    def _grow(self, req: Request, need: int) -> None:
        got = self.pool.alloc(need, need)
        if got is None:
            short = self.pool.shortfall(need, need)
            self.tree.evict(short[0], short[1], short[2])
            got = self.pool.alloc(need, need)
        if got is None and self.config.retention == "adaptive":
            # SWA that live requests kept while memory was spare is the cheapest to give back
            for live in self._live.values():
                self._release(live, force=True)
            short = self.pool.shortfall(need, need)
            self.tree.evict(short[0], short[1], short[2])
            got = self.pool.alloc(need, need)
        if got is None:
            self.counters["rejected"] += 1
            raise CacheFullError(f"cannot allocate {need} pages in both pools "
                                 f"(free bytes {self.pool.free_bytes()}, evictable full pages "
                                 f"{self.tree.evictable_full_pages()}, swa {self.tree.evictable_swa_pages()})")
        lo, hi = req.n_pages, req.n_pages + need
        if hi > req.full_pages.size:
            size = max(hi, 2 * req.full_pages.size)
            req.full_pages = np.concatenate([req.full_pages, np.empty(size - req.full_pages.size, np.int32)])
            req.swa_pages = np.concatenate([req.swa_pages, np.full(size - req.swa_pages.size, NO_PAGE, np.int32)])
        req.full_pages[lo:hi] = got[0]
        req.swa_pages[lo:hi] = got[1]
        req.n_pages = hi

    def commit(self, req: Request, n: int, *, release: bool | None = None) -> None:
        """Mark ``n`` more tokens as computed (their KV is written).

        Releases out-of-window SWA when ``release`` is true, or by default when
        this is a chunk (``n > 1``) or ``decode_release_interval`` tokens passed.
        """
        self._check_live(req)
        if not isinstance(n, (int, np.integer)) or n < 1 or req.computed + n > req.n_pages * self.page_size:
            raise ValueError(f"n={n!r} must be >= 1 and within the allocated slots")
        req.computed += n
        if release is None:
            release = n > 1 or req.computed - req.last_release >= self.config.decode_release_interval
        if release:
            self.release_out_of_window(req)

    def release_out_of_window(self, req: Request) -> int:
        """Free the request's own SWA pages wholly before ``computed - W``.

        Retention policy decides which survive (see :class:`CacheConfig`);
        checkpoint windows always survive.  Returns pages freed.  O(pages).
        """
        self._check_live(req)
        req.last_release = req.computed
        return self._release(req, force=False)

    def _release(self, req: Request, force: bool) -> int:
        policy = self.config.retention
        if policy in ("none", "dense"):
            return 0
        if (policy == "adaptive" and not force
                and self.pool.free_bytes() > self.config.spare_fraction * self.pool.budget_bytes):
            return 0
        cut = max(0, (req.computed - self.spec.window) // self.page_size)
        lo = req.tree_pages
        if cut <= lo:
            return 0
        seg = req.swa_pages[lo:cut]
        drop = seg >= 0
        kp = self.tree.config.checkpoint_pages
        if kp:
            wp = self.tree.config.window_pages
            absolute = np.arange(lo, cut)
            drop &= (absolute % kp) < kp - wp if wp < kp else False
        count = int(drop.sum())
        if count:
            self.pool.free_swa(seg[drop])
            seg[drop] = NO_PAGE
            self.counters["released_swa_pages"] += count
        return count

    # ================================================================ finish
    def finish(self, req: Request, cache: bool = True) -> int:
        """End ``req``: insert its computed page-aligned prefix (if ``cache``),
        unlock, and free what the tree did not take.  Returns new cached pages."""
        self._check_live(req)
        aligned = req.computed // self.page_size if cache else 0
        aligned = max(aligned, req.tree_pages) if cache else req.tree_pages
        new_pages = 0
        if cache and aligned > req.tree_pages:
            res = self.tree.insert(req.tokens[:aligned * self.page_size], req.full_pages[:aligned],
                                   req.swa_pages[:aligned], req.namespace)
            new_pages = res.new_pages
        lo = aligned
        rest_full = req.full_pages[lo:req.n_pages]
        rest_swa = req.swa_pages[lo:req.n_pages]
        if rest_full.size:
            self.pool.free_full(rest_full)
        rest_swa = rest_swa[rest_swa >= 0]
        if rest_swa.size:
            self.pool.free_swa(rest_swa)
        self.tree.unlock(req.handle)
        req.finished = True
        del self._live[id(req)]
        return new_pages

    def abort(self, req: Request) -> None:
        """End ``req`` without caching anything it computed."""
        self.finish(req, cache=False)

    # ================================================================= slots
    def full_slots(self, req: Request, start: int, end: int) -> np.ndarray:
        """Full-pool token slots of positions ``[start, end)`` (int64)."""
        pos = self._positions(req, start, end)
        return req.full_pages[pos // self.page_size].astype(np.int64) * self.page_size + pos % self.page_size

    def swa_slots(self, req: Request, start: int, end: int) -> np.ndarray:
        """SWA-pool token slots of ``[start, end)``; raises if any was released.

        Reading a released SWA slot is the pseudo-hit bug this library exists
        to prevent, so it is an error, never garbage.
        """
        pos = self._positions(req, start, end)
        pages = req.swa_pages[pos // self.page_size]
        if pages.size and pages.min() < 0:
            bad = int(pos[np.argmax(pages < 0)])
            raise RuntimeError(f"SWA KV of position {bad} is not held by request {req.rid}")
        return pages.astype(np.int64) * self.page_size + pos % self.page_size

    def _positions(self, req: Request, start: int, end: int) -> np.ndarray:
        if not (0 <= start <= end <= req.n_pages * self.page_size):
            raise ValueError(f"positions [{start}, {end}) outside the request's slots")
        return np.arange(start, end, dtype=np.int64)

    def _check_live(self, req: Request) -> None:
        if not isinstance(req, Request):
            raise TypeError(f"req must be a Request, got {type(req).__name__}")
        if req.finished or id(req) not in self._live:
            raise ValueError(f"request {req.rid} is not live in this cache")

    # ================================================================= stats
    @property
    def live_requests(self) -> list[Request]:
        return list(self._live.values())

    def stats(self) -> dict[str, Any]:
        """Counters and sizes (tokens)."""
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
            tree_nodes=self.tree.num_nodes,
        )
        return out

    def check_invariants(self) -> None:
        """Tree + pools + ownership: every used page is owned exactly once.  O(n)."""
        self.tree.check_invariants()
        self.pool.check_invariants()
        owned_full = [n.full for n in self.tree.iter_nodes()]
        owned_swa = [n.swa[n.swa >= 0] for n in self.tree.iter_nodes()]
        for req in self._live.values():
            owned_full.append(req.full_pages[req.tree_pages:req.n_pages])
            s = req.swa_pages[req.tree_pages:req.n_pages]
            owned_swa.append(s[s >= 0])
            assert req.tree_pages <= req.n_pages and req.computed <= req.n_pages * self.page_size
        full = np.concatenate(owned_full) if owned_full else np.zeros(0, np.int32)
        swa = np.concatenate(owned_swa) if owned_swa else np.zeros(0, np.int32)
        assert np.unique(full).size == full.size == self.pool.full.num_used, \
            ("full page ownership", np.unique(full).size, full.size, self.pool.full.num_used)
        assert np.unique(swa).size == swa.size == self.pool.swa.num_used, \
            ("swa page ownership", np.unique(swa).size, swa.size, self.pool.swa.num_used)
        assert self.pool.full.is_allocated(full).all() and self.pool.swa.is_allocated(swa).all()
