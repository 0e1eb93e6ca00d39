"""Property-based model check of the tree + pools + facade (hypothesis).

Tiny capacities make eviction, splitting and SWA release happen constantly.
The model labels every page with what it holds when a request writes it:
``(namespace, tokens up to the end of that page)``.  After every step we
check, independently of the tree's own bookkeeping:

* no leak: every used page of either pool is owned exactly once (tree or a
  live request) and the pools' accounting is consistent;
* no pseudo-hit: every page a match returns holds exactly the prefix it
  claims (full pages for all of [0, L), SWA pages for the window before L);
* locked data is never evicted: live requests' prefix pages and pinned
  window pages still hold their contents;
* namespaces never share (labels carry the namespace).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv import CacheConfig, CacheFullError, HybridKVCache, KVShape, ModelSpec

NAMESPACES = ("a", "b")


class CacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]), window=st.sampled_from([1, 2, 3, 5, 8]),
                full_pages=st.integers(8, 40), swa_pages=st.integers(4, 20),
                shared=st.booleans(), checkpoint=st.sampled_from([0, 4, 8]),
                retention=st.sampled_from(["adaptive", "eager", "dense"]),
                eviction=st.sampled_from(["page", "page", "node"]),
                seed=st.integers(0, 2**16))
    def setup(self, page_size, window, full_pages, swa_pages, shared, checkpoint, retention, eviction, seed):
        self.spec = ModelSpec("tiny", ["full", "swa", "swa"], window, KVShape(1, 2, 2), KVShape(1, 2, 2),
                              dtype="float32", page_size=page_size)
        wp = -(-window // page_size)
        swa_pages = max(swa_pages, 2 * wp + 2)
        full_pages = max(full_pages, 2 * wp + 2)
        if shared:
            budget = (full_pages // 2) * self.spec.bytes_per_page("full") + swa_pages * self.spec.bytes_per_page("swa")
            cfg = CacheConfig(budget_bytes=budget, swa_checkpoint=checkpoint * page_size, retention=retention,
                              swa_eviction=eviction, spare_fraction=0.3)
        else:
            cfg = CacheConfig(full_pages=full_pages, swa_pages=swa_pages, swa_checkpoint=checkpoint * page_size,
                              retention=retention, swa_eviction=eviction, spare_fraction=0.3)
        self.cache = HybridKVCache(self.spec, cfg)
        self.rng = np.random.default_rng(seed)
        self.bases = [self.rng.integers(0, 3, 60) for _ in range(3)]
        self.full_label: dict[int, tuple] = {}
        self.swa_label: dict[int, tuple] = {}
        self.live: list = []
        self.hits = 0

    # ------------------------------------------------------------ helpers
    def _tokens(self, base: int, length: int, tail: int) -> np.ndarray:
        t = self.bases[base][:length]
        return np.concatenate([t, self.rng.integers(0, 3, tail)]).astype(np.int32)

    def _label(self, ns: str, tokens: np.ndarray, page: int) -> tuple:
        end = (page + 1) * self.spec.page_size
        return (ns, tokens[:end].tobytes())

    def _check_hit(self, ns: str, tokens: np.ndarray, length: int, full: np.ndarray, swa: np.ndarray) -> None:
        p = self.spec.page_size
        assert length % p == 0 and length <= len(tokens)
        assert len(full) == length // p
        for i, page in enumerate(full):
            assert self.full_label.get(int(page)) == self._label(ns, tokens, i), "full pseudo-hit"
        lo = max(0, length - self.spec.window) // p
        for i in range(lo, length // p):
            page = int(swa[i])
            assert page >= 0, "hit without SWA in its window"
            assert self.swa_label.get(page) == self._label(ns, tokens, i), "SWA pseudo-hit"

    # -------------------------------------------------------------- rules
    @rule(ns=st.sampled_from(NAMESPACES), base=st.integers(0, 2), length=st.integers(0, 40),
          tail=st.integers(1, 12))
    def begin(self, ns, base, length, tail):
        tokens = self._tokens(base, length, tail)
        req = self.cache.begin(tokens, ns)
        self._check_hit(ns, tokens, req.prefix_len, req.full_pages[:req.tree_pages],
                        req.swa_pages[:req.tree_pages])
        assert req.prefix_len <= req.raw_match_len < len(tokens) or req.raw_match_len == req.prefix_len == 0
        self.hits += req.prefix_len
        self.live.append(req)

    @rule(ns=st.sampled_from(NAMESPACES), base=st.integers(0, 2), length=st.integers(0, 50),
          tail=st.integers(1, 12), chunk=st.integers(1, 24))
    def whole_request(self, ns, base, length, tail, chunk):
        """begin, chunked prefill to the end, finish: the common engine flow."""
        self.begin(ns, base, length, tail)
        req = self.live[-1]
        while req.computed < len(req.tokens):
            before = req.computed
            self._compute(req, chunk)
            if req.computed == before:  # cache full
                break
        self.live.pop()
        self.cache.finish(req)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10), n=st.integers(1, 16))
    def compute(self, i, n):
        self._compute(self.live[i % len(self.live)], n)

    def _compute(self, req, n):
        n = min(n, len(req.tokens) - req.computed)
        if n <= 0:
            return
        before = (req.n_pages, req.computed)
        try:
            full, swa = self.cache.allocate(req, n)
        except CacheFullError:
            assert (req.n_pages, req.computed) == before
            return
        p = self.spec.page_size
        # the model "writes" KV: label every page the new tokens touch
        for pos in range(req.computed, req.computed + n):
            page = pos // p
            assert full[pos - req.computed] // p == req.full_pages[page]
            self.full_label[int(req.full_pages[page])] = self._label(req.namespace, req.tokens, page)
            self.swa_label[int(req.swa_pages[page])] = self._label(req.namespace, req.tokens, page)
        # SWA layers read the window before each new token: it must be held
        lo = max(0, req.computed - self.spec.window)
        self.cache.swa_slots(req, lo, req.computed + n)
        self.cache.commit(req, n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10), tok=st.integers(0, 2))
    def decode(self, i, tok):
        req = self.live[i % len(self.live)]
        if req.computed < len(req.tokens):
            return
        self.cache.append_tokens(req, [tok])
        self._compute(req, 1)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10), keep=st.booleans())
    def finish(self, i, keep):
        req = self.live.pop(i % len(self.live))
        self.cache.finish(req, cache=keep)

    @rule(full=st.integers(0, 6), swa=st.integers(0, 6))
    def evict(self, full, swa):
        self.cache.tree.evict(full, swa)

    @rule(ns=st.sampled_from(NAMESPACES), base=st.integers(0, 2), length=st.integers(1, 50))
    def peek(self, ns, base, length):
        tokens = self._tokens(base, length, 1)
        m = self.cache.match(tokens, ns)
        self._check_hit(ns, tokens, m.length, m.full_pages, m.swa_pages)

    # ---------------------------------------------------------- invariants
    @invariant()
    def structures_consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()

    @invariant()
    def locked_data_intact(self):
        if not hasattr(self, "cache"):
            return
        p = self.spec.page_size
        for req in self.live:
            for i in range(req.tree_pages):
                assert self.full_label[int(req.full_pages[i])] == self._label(req.namespace, req.tokens, i)
            lo = max(0, req.computed - self.spec.window) // p
            hi = -(-req.computed // p)
            for i in range(lo, hi):
                page = int(req.swa_pages[i])
                assert page >= 0, "live window SWA was released"
                assert self.swa_label[page] == self._label(req.namespace, req.tokens, i)


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestCacheMachine = CacheMachine.TestCase
