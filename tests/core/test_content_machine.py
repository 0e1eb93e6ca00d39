"""Content oracle over the real KV arena: a hypothesis state machine.

Unlike ``test_state_machine.py`` (which labels page ids in a side table) this
machine writes real values into the real KV tensors, exactly the way an engine
does (``docs/engine.md``), and reads them back through the slots and page
tables the cache reports.  Every token position an engine computes gets, in
EVERY layer's K and V (full layers through the full kind's buffers, SWA layers
through the SWA kind's), a value derived from

    (namespace id, hash of tokens[:pos + 1], layer, pos)

so the value a position should hold is a pure function of what the request
claims it is: the oracle keeps no shadow state about pages at all.

Checked:

* every ``begin`` hit of length ``L`` (and every ``match`` peek): full-layer KV
  of positions ``[0, L)`` and SWA-layer KV of ``[L - W, L)``, read through the
  request's page tables (block tables + paged gather, like a kernel) and
  through ``full_slots``/``swa_slots`` + ``KindBuffers.read``;
* after every step, every live request's own KV is intact: full layers for
  ``[0, computed)``, SWA layers for the window ``[computed - W, computed)``
  (eviction, SWA release, splits, other requests' writes and tier loads must
  never touch locked or pinned data);
* no leak: ``check_invariants()``, and an independent count (pool pages used =
  tree pages + live requests' own pages; arena blocks used = pages x blocks per
  page); a ``drain`` rule ends every request, evicts everything and expects
  both pools and the arena to be empty;
* batched ``step()`` and ``allocate``: a row / call that fails with
  ``CacheFullError`` leaves its request as before (tokens, computed,
  allocated, pages), except that SWA pages wholly before its window may have
  been released: a failing allocation first releases the out-of-window SWA of
  every live request, the failing one included (see ``HybridKVCache._grow``);
  the others get slots that the content checks then validate;
* a hit never covers the last prompt token.

Two machines: :class:`ContentMachine` (L1 only: shared byte budget, fixed
split, or both) and :class:`TierContentMachine` (a ``TieredCache`` with an L2
host tier and a ``file://`` L3 in a temp dir; L1 flushes, L2 drops and a
restart over the same L3 directory force hits to be loaded back from L2/L3;
prefetches are sometimes left to land in the background).  ``match`` peeks
are L1-only on a ``TieredCache`` (docs/tiers.md), so they check L1 content.

Defaults keep CI cheap (well under a minute on two cores);
``HYBRIDKV_FUZZ_EXAMPLES=N`` (and optionally ``HYBRIDKV_FUZZ_TIER_EXAMPLES``,
``HYBRIDKV_FUZZ_STEPS``) runs more, with random seeds, for bug hunting.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv import CacheConfig, CacheFullError, HybridKVCache, KVShape, ModelSpec
from hybridkv.pools import ArenaLayout
from hybridkv.spec import AttnKind

torch.set_num_threads(1)

NAMESPACES = ("a", "a", "b")  # sampled: "a" twice as often, so prompts meet earlier ones
NS_ID = {"a": 1, "b": 2}
MAX_LIVE = 5
VOCAB = 3  # tiny vocabulary: prompts share prefixes and branch constantly
# strategies of a prompt built by ``_request`` (namespace, earlier prompt to extend, length)
PROMPT = dict(ns=st.sampled_from(NAMESPACES), source=st.integers(0, 6), length=st.integers(0, 64))

# (layer kinds, full KV shape, SWA KV shape): chosen so the arena layouts differ
# (1 or several blocks per page, 1 or several layers per block, groups > 0)
LAYOUTS = (
    (("full", "swa", "swa"), (1, 2, 4), (1, 4, 2)),                 # 1 full blk/page, SWA 2 blks/page
    (("full", "swa", "swa"), (1, 4, 2), (2, 4, 4)),                 # 2 full layers' room per block
    (("full", "swa", "swa"), (2, 4, 4), (1, 2, 4)),                 # both SWA layers in one block
    (("full", "swa", "full", "swa", "swa"), (1, 4, 4), (1, 4, 4)),  # 2 full blocks, 3 SWA blocks/page
    (("swa", "full", "swa", "swa", "swa"), (2, 4, 4), (1, 2, 4)),   # SWA first, 4 SWA layers per block
    # two sliding windows ("swa/2": half the window): three KV groups, the smaller
    # window's group gives its pages back sooner than the lead's
    (("full", "swa/2", "swa", "swa/2"), (1, 2, 4), (1, 4, 2)),
    (("swa/2", "full", "swa", "swa", "swa/2"), (2, 4, 4), (1, 2, 4)),
)

_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------- the oracle
def prefix_hashes(ns: str, tokens: np.ndarray) -> np.ndarray:
    """``[n, 3]`` float64: three 20-bit pieces of a 64-bit hash of (ns, tokens[:i + 1])."""
    h = (0x9E3779B97F4A7C15 * NS_ID[ns]) & _MASK64
    out = np.empty((len(tokens), 3), dtype=np.float64)
    for i, t in enumerate(tokens.tolist()):
        h = ((h ^ (t + 1)) * 0x100000001B3) & _MASK64
        z = (h + 0x9E3779B97F4A7C15) & _MASK64  # splitmix64 finaliser: every bit mixes
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        out[i] = (z & 0xFFFFF, (z >> 20) & 0xFFFFF, (z >> 40) & 0xFFFFF)
    return out


class Oracle:
    """Expected K/V of (namespace, tokens, layer, positions); exact in float32."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._memo: dict[tuple[str, bytes], np.ndarray] = {}

    def hashes(self, ns: str, tokens: np.ndarray) -> np.ndarray:
        key = (ns, tokens.tobytes())
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            got = self._memo[key] = prefix_hashes(ns, tokens)
        return got

    def kv(self, ns: str, tokens: np.ndarray, layer: int, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K ``[n, heads, k_dim]`` and V ``[n, heads, v_dim]`` (float32) of ``pos``.

        The K|V elements of a token cycle through the five components
        ``(ns * 32 + layer + 1, pos + 1, h0, h1, h2)``.
        """
        sh = self.spec.shape(self.spec.layer_kinds[layer])
        hs = self.hashes(ns, tokens)[pos]
        comps = np.column_stack([np.full(len(pos), NS_ID[ns] * 32 + layer + 1, np.float64),
                                 pos.astype(np.float64) + 1, hs])
        nk = sh.num_kv_heads * sh.k_head_dim
        nv = sh.num_kv_heads * sh.v_head_dim
        k = comps[:, np.arange(nk) % 5].reshape(len(pos), sh.num_kv_heads, sh.k_head_dim)
        v = comps[:, (nk + np.arange(nv)) % 5].reshape(len(pos), sh.num_kv_heads, sh.v_head_dim)
        return k.astype(np.float32), v.astype(np.float32)


def _describe(got: np.ndarray) -> str:
    """What a mismatching K row holds (ns/layer, pos): where the wrong bytes came from."""
    flat = got.reshape(-1)
    if flat.size >= 2 and flat[0] > 0:
        code, pos = int(flat[0]), int(flat[1]) - 1
        return f"holds ns {code // 32} layer {code % 32 - 1} pos {pos} (or garbage {flat[:5].tolist()})"
    return f"holds {flat[:5].tolist()} (never written / zero)"


# ------------------------------------------------------------- the machine
class _ContentRules(RuleBasedStateMachine):
    """Rules and checks shared by the L1 and the tiered machine (no initialize here)."""

    cache: HybridKVCache

    # ----------------------------------------------------------- set-up
    def _setup_common(self, layout: int, page_size: int, window: int, seed: int) -> None:
        kinds, fs, ss = LAYOUTS[layout]
        windows = [0 if k == "full" else window if k == "swa" else max(1, window // 2) for k in kinds]
        self.spec = ModelSpec("tiny-content", [k.split("/")[0] for k in kinds], window, KVShape(*fs),
                              KVShape(*ss), dtype="float32", page_size=page_size,
                              layer_windows=tuple(windows) if "swa/2" in kinds else ())
        self.arena_layout = ArenaLayout.for_spec(self.spec)
        self.fpb = self.arena_layout.page_bytes("full")
        self.spb = self.arena_layout.page_bytes("swa")
        self.wp = self.spec.window_pages
        self.oracle = Oracle(self.spec)
        self.rng = np.random.default_rng(seed)
        self.bases = [self.rng.integers(0, VOCAB, 16 * page_size).astype(np.int32) for _ in range(3)]
        self.history: list[tuple[str, np.ndarray]] = []
        self.live: list = []
        self.hit_checks = 0
        self._block_kind: np.ndarray | None = None  # coverage only: which kind last wrote each block

    def _ready(self) -> bool:
        return hasattr(self, "cache")

    # ----------------------------------------------------------- KV I/O
    def _write(self, req, start: int, n: int, full_slots: np.ndarray, swa_slots: np.ndarray, via: int) -> None:
        """The engine computed positions [start, start + n) of ``req``: write every layer."""
        P = self.spec.page_size
        arena = self.cache.pool.buffers
        pos = np.arange(start, start + n)
        tokens = req.tokens
        assert len(full_slots) == n and len(swa_slots) == n
        for layer, kind in enumerate(self.spec.layer_kinds):
            kb = arena.of(kind)
            li = kb.local(layer)
            k, v = self.oracle.kv(req.namespace, tokens, layer, pos)
            slots = full_slots if kind is AttnKind.FULL else swa_slots
            k_cache, v_cache, group = kb.layer_view(li)
            blocks = kb.physical_slots(slots, group) // P
            if self._block_kind is None or len(self._block_kind) != k_cache.shape[0]:
                self._block_kind = np.full(k_cache.shape[0], -1, np.int8)
            was = self._block_kind[blocks]
            if ((was >= 0) & (was != int(kind is AttnKind.FULL))).any():
                event("arena block reused by the other kind")
            self._block_kind[blocks] = int(kind is AttnKind.FULL)
            if via % 2 == 0:  # the docs/engine.md loop: layer view + slot_mapping
                phys = torch.from_numpy(kb.physical_slots(slots, group))
                k_cache[phys // P, phys % P] = torch.from_numpy(k)
                v_cache[phys // P, phys % P] = torch.from_numpy(v)
            else:  # KindBuffers.write (logical slots)
                kb.write(li, np.asarray(slots), torch.from_numpy(k), torch.from_numpy(v))

    def _gather(self, kind: AttnKind, pages: np.ndarray, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Paged gather of one layer over logical ``pages`` (like an attention kernel)."""
        kb = self.cache.pool.buffers.of(kind)
        k_cache, v_cache, group = kb.layer_view(kb.local(layer))
        blocks = torch.from_numpy(kb.block_table(np.asarray(pages, dtype=np.int64), group).astype(np.int64))
        assert (blocks >= 0).all(), f"{kind.value} page without a block: {pages}"
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])
        return k.numpy(), v.numpy()

    def _expect(self, what: str, ns: str, tokens: np.ndarray, layer: int, pos: np.ndarray,
                k: np.ndarray, v: np.ndarray) -> None:
        ek, ev = self.oracle.kv(ns, tokens, layer, pos)
        for name, got, want in (("K", k, ek), ("V", v, ev)):
            if not np.array_equal(got, want):
                bad = int(np.flatnonzero((got != want).reshape(len(pos), -1).any(axis=1))[0])
                raise AssertionError(
                    f"{what}: wrong {name} bytes at position {int(pos[bad])} of layer {layer} "
                    f"({self.spec.layer_kinds[layer].value}) ns {ns!r}: expected {want[bad].reshape(-1)[:5]}, "
                    f"got {_describe(got[bad])}")

    def _check_kv(self, what: str, ns: str, tokens: np.ndarray, full_pages: np.ndarray,
                  swa_pages: np.ndarray, end: int) -> None:
        """Full layers: positions [0, end) through ``full_pages``; SWA layers: the
        window [end - W, end) through ``swa_pages`` (page-aligned arrays from page 0)."""
        if end <= 0:
            return
        P = self.spec.page_size
        n_pg = -(-end // P)
        fp = np.asarray(full_pages[:n_pg])
        assert len(fp) == n_pg and (fp >= 0).all(), f"{what}: full page table short or has holes"
        lo = max(0, end - self.spec.window)
        sp = np.asarray(swa_pages[lo // P:n_pg])
        assert (sp >= 0).all(), f"{what}: SWA of the window [{lo}, {end}) is not held: {sp}"
        for layer, kind in enumerate(self.spec.layer_kinds):
            if kind is AttnKind.FULL:
                k, v = self._gather(kind, fp, layer)
                self._expect(what, ns, tokens, layer, np.arange(end), k[:end], v[:end])
            else:  # each sliding layer over its own window
                lo = max(0, end - self.spec.layer_window(layer))
                sp = np.asarray(swa_pages[lo // P:n_pg])
                k, v = self._gather(kind, sp, layer)
                off = (lo // P) * P
                self._expect(what, ns, tokens, layer, np.arange(lo, end), k[lo - off:end - off],
                             v[lo - off:end - off])

    def _check_hit_via_slots(self, req, end: int) -> None:
        """Second read path: ``full_slots``/``swa_slots`` + ``KindBuffers.read``."""
        if end <= 0:
            return
        lo = max(0, end - self.spec.window)
        fs = self.cache.full_slots(req, 0, end)
        ss = self.cache.swa_slots(req, lo, end)
        arena = self.cache.pool.buffers
        for layer, kind in enumerate(self.spec.layer_kinds):
            kb = arena.of(kind)
            if kind is AttnKind.FULL:
                k, v = kb.read(kb.local(layer), fs)
                pos = np.arange(end)
            else:
                lo_l = max(0, end - self.spec.layer_window(layer))
                k, v = kb.read(kb.local(layer), ss[lo_l - lo:])
                pos = np.arange(lo_l, end)
            self._expect("hit via slots", req.namespace, req.tokens, layer, pos, k.numpy(), v.numpy())

    # ------------------------------------------------------------ prompts
    def _request(self, ns: str, source: int, length: int, tail: int) -> tuple[str, np.ndarray]:
        """``(namespace, prompt)``: a later turn of an earlier conversation keeps its namespace."""
        if source >= 3 and self.history:
            ns = self.history[source % len(self.history)][0]
        return ns, self._prompt(source, length, tail)

    def _prompt(self, source: int, length: int, tail: int) -> np.ndarray:
        P = self.spec.page_size
        if source < 3 or not self.history:
            head = self.bases[source % 3][:length * P // 4]
        else:  # a later turn of an earlier conversation (same namespace is picked by the rule)
            _, hist = self.history[source % len(self.history)]
            head = hist[:max(1, len(hist) - (length % (2 * P + 1)))]
        return np.concatenate([head, self.rng.integers(0, VOCAB, tail)]).astype(np.int32)

    def _snapshot(self, req) -> tuple:
        return (req.n_tokens, req.tokens.tobytes(), req.computed, req.allocated, req.n_pages,
                req.full_pages[:req.n_pages].tobytes(), req.swa_pages[:req.n_pages].copy(), req.tree_pages)

    def _assert_unchanged(self, req, before: tuple, what: str) -> None:
        """``req`` is exactly as in ``before`` (tokens, progress, pages of both kinds)."""
        now = self._snapshot(req)
        assert now[:6] == before[:6] and now[7] == before[7], f"{what} changed the request"
        assert np.array_equal(now[6], before[6]), f"{what} changed the request's SWA pages"

    # -------------------------------------------------------------- rules
    @precondition(lambda self: self._ready() and len(self.live) < MAX_LIVE)
    @rule(**PROMPT, tail=st.integers(1, 6))
    def begin(self, ns, source, length, tail):
        self._begin(*self._request(ns, source, length, tail))

    def _begin(self, ns: str, tokens: np.ndarray):
        req = self.cache.begin(tokens, ns)
        L = req.prefix_len
        P = self.spec.page_size
        assert L % P == 0 and L <= len(tokens) - 1, "a hit covers the last prompt token"
        assert req.computed == L and req.tree_pages * P >= L
        if L:
            self.hit_checks += 1
            event(f"hit ({'window < L' if L > self.spec.window else 'L <= window'})")
            self._check_kv("begin hit", ns, tokens, self.cache.page_table([req], "full")[0],
                           self.cache.page_table([req], "swa")[0], L)
            self._check_hit_via_slots(req, L)
        self._on_begin(req)
        self.live.append(req)
        return req

    def _on_begin(self, req) -> None:
        """Hook for the tiered machine."""

    @precondition(lambda self: self._ready() and len(self.live) < MAX_LIVE)
    @rule(**PROMPT, tail=st.integers(1, 6), chunk=st.integers(1, 32), decode=st.integers(0, 3),
          batched=st.booleans())
    def whole_request(self, ns, source, length, tail, chunk, decode, batched):
        """The common engine flow: begin, chunked prefill, a few decode tokens, finish (cached)."""
        self._whole(*self._request(ns, source, length, tail), chunk, decode, batched)

    @precondition(lambda self: self._ready() and len(self.live) < MAX_LIVE)
    @rule(ns=st.sampled_from(NAMESPACES), base=st.integers(0, 2), length=st.integers(0, 64),
          tails=st.lists(st.integers(1, 6), min_size=2, max_size=4), chunk=st.integers(1, 32),
          decode=st.integers(0, 3), batched=st.booleans())
    def conversation(self, ns, base, length, tails, chunk, decode, batched):
        """Several turns of one conversation: each prompt extends the previous turn's
        tokens, so each turn should hit (nearly) all of it (a tail hit)."""
        tokens = self._prompt(base, length, tails[0])
        for tail in tails[1:]:
            done = self._whole(ns, tokens, chunk, decode, batched)
            tokens = np.concatenate([done, self.rng.integers(0, VOCAB, tail)]).astype(np.int32)
        self._whole(ns, tokens, chunk, decode, batched)

    def _whole(self, ns: str, tokens: np.ndarray, chunk: int, decode: int, batched: bool) -> np.ndarray:
        req = self._begin(ns, tokens)
        for _ in range(64):
            if req.computed == req.n_tokens:
                if decode == 0:
                    break
                decode -= 1
                tok = int(self.rng.integers(0, VOCAB))
                if batched:
                    self._step_rows([req], [tok], [1], 1, 1)
                else:
                    self.cache.append_tokens(req, [tok])
                    if not self._chunk(req, 1, 0, 0):
                        break
                continue
            n = min(chunk, req.n_tokens - req.computed)
            if batched:
                if not self._step_rows([req], [None], [n], 1, 0).ok[0]:
                    break
            elif not self._chunk(req, n, 0, 1):
                break
        event("whole request: " + ("computed" if req.computed == req.n_tokens else "cache full"))
        self.live.remove(req)
        self.cache.finish(req)
        done = req.tokens[:req.n_tokens].copy()
        if req.computed > 1:
            self.history.append((req.namespace, done))
            del self.history[:-6]
        return done

    @precondition(lambda self: self._ready() and self.live)
    @rule(i=st.integers(0, 9), n=st.integers(1, 24), part=st.integers(0, 3), mode=st.integers(0, 3))
    def prefill(self, i, n, part, mode):
        """One chunk of a live request: allocate (or reserve + slots), write, commit (maybe less)."""
        req = self.live[i % len(self.live)]
        n = min(n, req.n_tokens - req.computed)
        if n <= 0:
            return
        self._chunk(req, n, part, mode)

    def _chunk(self, req, n: int, part: int, mode: int) -> bool:
        before = self._snapshot(req)
        start = req.computed
        try:
            if mode == 3:
                self.cache.reserve(req, n)
                full = self.cache.full_slots(req, start, start + n)
                swa = self.cache.swa_slots(req, start, start + n)
            else:
                full, swa = self.cache.allocate(req, n)
        except CacheFullError:
            event("allocate: CacheFullError")
            self._assert_unchanged(req, before, "a failed allocate")
            return False
        self._write(req, start, n, full, swa, mode)
        # an engine may commit less than it was handed (a rejected speculative tail):
        # the written KV of the rest is simply overwritten later
        m = n if part == 0 or n == 1 else max(1, n * part // 4)
        self.cache.commit(req, m, release=None if mode != 2 else bool(part % 2))
        return True

    @precondition(lambda self: self._ready() and self.live)
    @rule(i=st.integers(0, 9), toks=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=2),
          mode=st.integers(0, 3))
    def decode(self, i, toks, mode):
        """append_tokens + allocate(k) + commit: a decode step (k = 2: speculative)."""
        req = self.live[i % len(self.live)]
        if req.computed < req.n_tokens:
            return
        self.cache.append_tokens(req, toks)
        self._chunk(req, len(toks), 0, mode)

    @precondition(lambda self: self._ready() and self.live)
    @rule(pick=st.lists(st.integers(0, 9), min_size=1, max_size=MAX_LIVE, unique=True),
          chunks=st.lists(st.integers(1, 16), min_size=MAX_LIVE, max_size=MAX_LIVE),
          toks=st.lists(st.integers(0, VOCAB - 1), min_size=MAX_LIVE, max_size=MAX_LIVE),
          default_num=st.booleans(), commit=st.integers(0, 5), via=st.integers(0, 1))
    def step(self, pick, chunks, toks, default_num, commit, via):
        """The batched step over several live requests: decode rows sample a token,
        prefill rows compute a chunk; failed rows must be unchanged."""
        reqs = list({id(r): r for r in (self.live[p % len(self.live)] for p in pick)}.values())
        new_tokens: list = []
        num_new: list = []
        for j, r in enumerate(reqs):
            if r.computed == r.n_tokens:
                new_tokens.append(toks[j])
                num_new.append(1)
            else:
                new_tokens.append(None)
                num_new.append(min(chunks[j], r.n_tokens - r.computed))
        self._step_rows(reqs, new_tokens, num_new, commit, via, default_num)

    def _step_rows(self, reqs: list, new_tokens: list, num_new: list, commit: int, via: int,
                   default_num: bool = False):
        before = [self._snapshot(r) for r in reqs]
        if default_num and all(t is None for t in new_tokens):
            batch = self.cache.step(reqs)  # every token not computed yet
            num_new = [r.n_tokens - r.computed for r in reqs]
        else:
            arr = np.array([-1 if t is None else t for t in new_tokens], dtype=np.int64)
            batch = self.cache.step(reqs, new_tokens=arr if via else new_tokens, num_new=np.array(num_new))
        P = self.spec.page_size
        for j, r in enumerate(reqs):
            if not batch.ok[j]:
                assert isinstance(batch.errors[j], CacheFullError), batch.errors[j]
                self._assert_unchanged(r, before[j], "a failed step row")
                event("step: a row failed with CacheFullError")
                continue
            start = before[j][2]
            assert batch.start[j] == start and batch.num_new[j] == num_new[j]
            assert batch.seq_lens[j] == start + num_new[j]
            if new_tokens[j] is not None:
                assert r.n_tokens == before[j][0] + 1 and int(r.tokens[-1]) == new_tokens[j]
        # pages added this step (engines keeping block tables incrementally) agree with page_table
        for row, idx, nf, ns_ in zip(batch.new_rows.tolist(), batch.new_index.tolist(),
                                     batch.new_full.tolist(), batch.new_swa.tolist()):
            r = reqs[row]
            assert batch.ok[row] and r.full_pages[idx] == nf and r.swa_pages[idx] == ns_
        for j, r in enumerate(reqs):
            if batch.ok[j]:
                lo, hi = int(batch.cu_new[j]), int(batch.cu_new[j + 1])
                self._write(r, int(batch.start[j]), hi - lo, batch.full_slots[lo:hi], batch.swa_slots[lo:hi],
                            via + j)
                pos = np.arange(int(batch.start[j]), hi - lo + int(batch.start[j]))
                assert np.array_equal(batch.full_slots[lo:hi], r.full_pages[pos // P].astype(np.int64) * P + pos % P)
        if commit == 0:
            event("step: batch dropped without commit")
            return batch  # the engine dropped this step (preemption); the requests go on from `computed`
        self.cache.commit_step(batch, release=None if commit < 4 else commit == 4)
        return batch

    @precondition(lambda self: self._ready() and self.live)
    @rule(i=st.integers(0, 9), how=st.sampled_from(["cache", "cache", "drop", "abort"]))
    def finish(self, i, how):
        req = self.live.pop(i % len(self.live))
        if how == "abort":
            self.cache.abort(req)
        else:
            self.cache.finish(req, cache=how == "cache")
            if how == "cache" and req.computed > 1:
                self.history.append((req.namespace, req.tokens[:req.n_tokens].copy()))
                del self.history[:-6]

    @precondition(lambda self: self._ready() and self.live)
    @rule(i=st.integers(0, 9))
    def release(self, i):
        """An engine releasing a request's out-of-window SWA explicitly."""
        self.cache.release_out_of_window(self.live[i % len(self.live)])

    @precondition(lambda self: self._ready())
    @rule(full=st.integers(0, 8), swa=st.integers(0, 8), nbytes=st.integers(0, 4), everything=st.booleans())
    def evict(self, full, swa, nbytes, everything):
        tree = self.cache.tree
        if everything:
            tree.evict(tree.evictable_full_pages(), tree.evictable_swa_pages())
        else:
            tree.evict(full, swa, nbytes * self.spb)

    @precondition(lambda self: self._ready())
    @rule(**PROMPT, tail=st.integers(1, 3))
    def peek(self, ns, source, length, tail):
        ns, tokens = self._request(ns, source, length, tail)
        m = self.cache.match(tokens, ns)
        assert m.length <= max(0, len(tokens) - 1)
        if m.length:
            self._check_kv("match peek", ns, tokens, m.full_pages, m.swa_pages, m.length)

    @precondition(lambda self: self._ready())
    @rule(keep=st.booleans())
    def drain(self, keep):
        """End every request, evict everything: nothing may stay allocated."""
        while self.live:
            self.cache.finish(self.live.pop(), cache=keep)
        self._evict_all()
        self._assert_l1_empty()

    def teardown(self):
        if hasattr(self, "hit_checks"):
            n = self.hit_checks
            event("hits checked per example: " + ("0" if n == 0 else "1-4" if n < 5 else "5-19" if n < 20 else "20+"))

    def _evict_all(self) -> None:
        tree = self.cache.tree
        for _ in range(8):
            if tree.evict(tree.evictable_full_pages(), tree.evictable_swa_pages()) == (0, 0):
                break

    def _assert_l1_empty(self) -> None:
        pool = self.cache.pool
        assert self.cache.tree.full_pages_cached == 0 and self.cache.tree.swa_pages_cached == 0, \
            ("tree not empty after evicting everything", self.cache.tree.full_pages_cached,
             self.cache.tree.swa_pages_cached)
        assert pool.full.num_used == 0 and pool.swa.num_used == 0, \
            ("pages leaked", pool.full.num_used, pool.swa.num_used)
        assert pool.buffers.blocks.num_used == 0, ("arena blocks leaked", pool.buffers.blocks.num_used)

    # ---------------------------------------------------------- invariants
    def _invariants_locked(self) -> None:
        self.cache.check_invariants()
        # independent accounting: pages used = tree + live requests' own; blocks = pages x blocks/page
        tree_f = sum(int(nd.full.size) for nd in self.cache.tree.iter_nodes())
        tree_s = sum(int((nd.swa >= 0).sum()) for nd in self.cache.tree.iter_nodes())
        own_f = sum(r.n_pages - r.tree_pages for r in self.live)
        own_s = sum(int((r.swa_pages[r.tree_pages:r.n_pages] >= 0).sum()) for r in self.live)
        pool = self.cache.pool
        assert pool.full.num_used == tree_f + own_f, ("full pages", pool.full.num_used, tree_f, own_f)
        assert pool.swa.num_used == tree_s + own_s, ("swa pages", pool.swa.num_used, tree_s, own_s)
        lay = self.arena_layout
        # a smaller window's group holds its blocks of an SWA page only until it gives them back
        given_back = sum((pool.swa.num_used - g.used) * lay.swa.group_columns[g.index][1] for g in pool.groups)
        assert pool.buffers.blocks.num_used == (pool.full.num_used * lay.full.blocks_per_page
                                                + pool.swa.num_used * lay.swa.blocks_per_page - given_back)
        assert pool.used_bytes() <= pool.budget_bytes
        assert set(map(id, self.cache.live_requests)) == set(map(id, self.live))

    @invariant()
    def accounting(self):
        if self._ready():
            self._invariants_locked()

    @invariant()
    def live_kv_intact(self):
        """Locked prefixes, pinned windows and each request's own writes still hold their bytes."""
        if not self._ready():
            return
        for req in self.live:
            if req.computed:
                self._check_kv(f"live request {req.rid} (computed {req.computed}, hit {req.prefix_len})",
                               req.namespace, req.tokens, self.cache.page_table([req], "full")[0],
                               self.cache.page_table([req], "swa")[0], req.computed)


def _sizes(spec: ModelSpec, full_pages: int, swa_pages: int) -> tuple[int, int]:
    wp = spec.window_pages
    return max(full_pages, 2 * wp + 2), max(swa_pages, 2 * wp + 2)


class ContentMachine(_ContentRules):
    """L1 only: the KV arena under a shared byte budget, a fixed split, or both."""

    @initialize(layout=st.integers(0, len(LAYOUTS) - 1), page_size=st.sampled_from([1, 2, 4]),
                window=st.integers(1, 8), full_pages=st.integers(4, 48), swa_pages=st.integers(4, 24),
                mode=st.sampled_from(["budget", "budget", "fixed", "capped"]),
                checkpoint=st.sampled_from([0, 0, 2, 4]),
                retention=st.sampled_from(["adaptive", "adaptive", "eager", "dense", "none"]),
                eviction=st.sampled_from(["page", "page", "node", "none"]),
                ranking=st.sampled_from(["value", "adaptive", "lru", "arc"]),
                release_every=st.integers(1, 6), spare=st.sampled_from([0.0, 0.1, 0.3, 0.6]),
                anchor=st.booleans(), pretail=st.sampled_from([-1, -1, 0, 1, 2, 3]), seed=st.integers(0, 2**16))
    def setup(self, layout, page_size, window, full_pages, swa_pages, mode, checkpoint, retention, eviction,
              ranking, release_every, spare, anchor, pretail, seed):
        self._setup_common(layout, page_size, window, seed)
        full_pages, swa_pages = _sizes(self.spec, full_pages, swa_pages)
        common = dict(device="cpu", swa_checkpoint=checkpoint * page_size, retention=retention,
                      swa_eviction=eviction, eviction_ranking=ranking, decode_release_interval=release_every,
                      spare_fraction=spare, anchor_branch_points=anchor)
        # shared: the budget holds half the full pages the ids allow, so blocks flow between kinds
        budget = (full_pages // 2 + 1) * self.fpb + swa_pages * self.spb
        if mode == "budget":
            cfg = CacheConfig(budget_bytes=budget, **common)
        elif mode == "fixed":
            cfg = CacheConfig(full_pages=full_pages, swa_pages=swa_pages, **common)
        else:
            cfg = CacheConfig(budget_bytes=budget, full_pages=full_pages, swa_pages=swa_pages, **common)
        self.cache = HybridKVCache(self.spec, cfg)
        if pretail >= 0:
            # predicted branch points from the start (the learned decision frozen): every new
            # leaf is split ``pretail`` pages before its end and keeps that window, and every
            # live request spares it, so hits through those windows are checked for content
            tree = self.cache.tree
            tree.policy.pretail_pages = pretail
            tree.divergence.observe = lambda dist, gain: False  # type: ignore[method-assign]
        assert self.cache.pool.buffers.blocks.num_used == 0


class TierContentMachine(_ContentRules):
    """``TieredCache``: L1 arena, L2 host arena, L3 ``file://`` in a temp dir."""

    @initialize(layout=st.integers(0, len(LAYOUTS) - 1), page_size=st.sampled_from([1, 2, 4]),
                window=st.integers(1, 8), l1_full=st.integers(4, 32), l1_swa=st.integers(4, 16),
                l2_pages=st.integers(4, 60), policy=st.sampled_from(["write_through", "write_back"]),
                l3_swa=st.sampled_from(["anchored", "all"]), checkpoint=st.sampled_from([0, 2, 4]),
                retention=st.sampled_from(["adaptive", "eager", "dense"]),
                ranking=st.sampled_from(["value", "adaptive", "lru"]), release_every=st.integers(1, 6),
                seed=st.integers(0, 2**16))
    def setup(self, layout, page_size, window, l1_full, l1_swa, l2_pages, policy, l3_swa, checkpoint,
              retention, ranking, release_every, seed):
        from hybridkv.tiers.tiered import TierConfig

        self._setup_common(layout, page_size, window, seed)
        l1_full, l1_swa = _sizes(self.spec, l1_full, l1_swa)
        self.dir = Path(tempfile.mkdtemp(prefix="hkv-content-"))
        cfg = CacheConfig(budget_bytes=(l1_full // 2 + 1) * self.fpb + l1_swa * self.spb, device="cpu",
                          swa_checkpoint=checkpoint * page_size, retention=retention, eviction_ranking=ranking,
                          decode_release_interval=release_every, spare_fraction=0.1)
        self.cfg = cfg
        self.tier_cfg = TierConfig(
            l2_bytes=max(l2_pages, 2 * self.wp + 2) * (self.fpb + self.spb), l3=f"file://{self.dir / 'l3'}",
            write_policy=policy, l3_swa=l3_swa, l3_timeout_s=10.0)
        self._open()

    def _open(self) -> None:
        from hybridkv.tiers.tiered import TieredCache

        self.cache = TieredCache(self.spec, self.cfg, tiers=self.tier_cfg)

    def teardown(self):
        super().teardown()
        if hasattr(self, "cache"):
            try:
                self.cache.close()
            finally:
                shutil.rmtree(self.dir, ignore_errors=True)

    def _on_begin(self, req) -> None:
        per = req.extra.get("tiers", {})
        if per.get("l2_hit_tokens"):
            event("hit served from L2")
        if per.get("l3_hit_tokens"):
            event("hit served from L3")
        if per.get("l3_preexisting_hit_tokens"):
            event("hit served from L3 data of an earlier process")

    def _invariants_locked(self) -> None:
        with self.cache._mutex:  # the L3 workers land pages in L2 under the same lock
            super()._invariants_locked()

    @precondition(lambda self: self._ready())
    @rule()
    def drop_l2(self):
        """Host restart: queued L3 writes land first, then L2 forgets everything."""
        from hybridkv.eval.tier_verify import flush_l2

        assert self.cache.flush(30.0)
        flush_l2(self.cache)
        self.cache.host.check_invariants()

    @precondition(lambda self: self._ready())
    @rule(**PROMPT, tail=st.integers(1, 3))
    def prefetch(self, ns, source, length, tail):
        """Prefetch L3 -> L2; every other one is not waited for (it lands while we go on)."""
        ns, tokens = self._request(ns, source, length, tail)
        handle = self.cache.prefetch(tokens, ns)
        if tail != 2:
            assert handle.wait(30.0)

    @precondition(lambda self: self._ready() and self.history and len(self.live) < MAX_LIVE)
    @rule(source=st.integers(0, 5), tail=st.integers(1, 6), drop=st.booleans(), chunk=st.integers(1, 32),
          batched=st.booleans())
    def cold_rerun(self, source, tail, drop, chunk, batched):
        """Flush L1 (and drop L2), then the next turn of an earlier conversation: its
        hit must come back from L2 (or L3) with the right bytes."""
        self._evict_all()
        if drop:
            self.drop_l2()
        ns, hist = self.history[source % len(self.history)]
        self._whole(ns, np.concatenate([hist, self.rng.integers(0, VOCAB, tail)]).astype(np.int32), chunk, 1,
                    batched)

    @precondition(lambda self: self._ready())
    @rule(keep=st.booleans())
    def restart(self, keep):
        """A new process over the same L3 directory (L1 and L2 start empty)."""
        while self.live:
            self.cache.finish(self.live.pop(), cache=keep)
        assert self.cache.flush(30.0)
        self.cache.close()
        self._open()

    @precondition(lambda self: self._ready())
    @rule()
    def flush_l1(self):
        """Evict all unlocked L1 content: the next hits must come back from L2/L3."""
        self._evict_all()


def _examples(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


_FUZZ = "HYBRIDKV_FUZZ_EXAMPLES" in os.environ
_N = _examples("HYBRIDKV_FUZZ_EXAMPLES", 250)
_STEPS = _examples("HYBRIDKV_FUZZ_STEPS", 40)
# no "explain" phase: its line tracing of a failing run takes minutes on these machines
_PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)
ContentMachine.TestCase.settings = settings(
    max_examples=_N, stateful_step_count=_STEPS, deadline=None, derandomize=not _FUZZ, phases=_PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TierContentMachine.TestCase.settings = settings(
    max_examples=_examples("HYBRIDKV_FUZZ_TIER_EXAMPLES", max(1, _N // 8) if _FUZZ else 40),
    stateful_step_count=_STEPS, deadline=None, derandomize=not _FUZZ, phases=_PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestContentMachine = ContentMachine.TestCase
TestTierContentMachine = TierContentMachine.TestCase
