"""A tiny hybrid-SWA reference transformer (random weights, float64, CPU).

It reads and writes its KV *only* through hybridkv: new tokens' K/V go into
the pool buffers at the slots the cache hands out, and attention gathers K/V
back through the request's slots (full layers: every earlier position; SWA
layers: the last W positions, whose slots raise if the cache released them).
:meth:`ReferenceModel.forward_dense` computes the same logits without any
cache; with float64 both agree to ~1e-12, so any wrong hit (stale page,
released window, wrong position) shows up as a mismatch.

The layout mirrors MiMo in miniature: a few full-attention layers among SWA
layers, different KV heads per kind, K head dim != V head dim, RoPE on K/Q,
and a learned attention-sink logit per head on SWA layers (gpt-oss / MiMo
style: an extra softmax column with no value).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from ...cache import HybridKVCache, Request, StepBatch
from ...spec import AttnKind, KVShape, ModelSpec

__all__ = ["ReferenceModel", "scaled_spec", "tiny_spec", "tiny_two_window_spec", "torch_threads"]

# Floating-point operations one more intra-op thread must get before it pays for
# itself: waking it and joining at the end of every op costs tens of microseconds,
# and far more when a core is busy with another process (a thread spins until its
# core is free).  The verify model's largest op is ~10^6 operations, so it runs on one.
_FLOPS_PER_THREAD = 1 << 24


@contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run the block with at most ``n`` of torch's intra-op threads (never more than
    the caller had), and restore the caller's count afterwards, also on an error:
    a library must not leave torch's global thread count changed.  Yields the count
    in force.  ``n`` must be an int >= 1 (else ValueError / TypeError naming it)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    before = torch.get_num_threads()
    use = min(n, before)
    if use != before:
        torch.set_num_threads(use)
    try:
        yield use
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def tiny_spec(page_size: int = 4, window: int = 16) -> ModelSpec:
    """Scaled-down MiMo layout: 6 layers, full at 0 and 3, W=16, float64."""
    kinds = ["full", "swa", "swa", "full", "swa", "swa"]
    return ModelSpec("tiny-hybrid", kinds, window, full=KVShape(2, 8, 6), swa=KVShape(4, 8, 6),
                     dtype="float64", page_size=page_size)


def tiny_two_window_spec(page_size: int = 4, windows: tuple[int, int] = (8, 16)) -> ModelSpec:
    """:func:`tiny_spec`'s layout with two sliding windows (layers 1, 4 and 2, 5):
    three KV groups, as in models that mix local windows of several sizes."""
    kinds = ["full", "swa", "swa", "full", "swa", "swa"]
    small, large = windows
    per_layer = (0, small, large, 0, small, large)
    return ModelSpec("tiny-two-window", kinds, max(windows), full=KVShape(2, 8, 6), swa=KVShape(4, 8, 6),
                     dtype="float64", page_size=page_size, layer_windows=per_layer)


def scaled_spec(spec: ModelSpec, *, window: int = 16, page_size: int = 4) -> ModelSpec:
    """``spec``'s layers and KV groups at :func:`tiny_spec`'s scale, for the reference model.

    Layer kinds are kept; the largest sliding window becomes ``window`` tokens and
    every other window keeps its ratio to it (at least one page), as the verify
    prompts are scaled-down trace prompts; KV shapes become tiny float64 ones.
    """
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    tiny = tiny_spec(page_size=page_size, window=window)
    per_layer: tuple[int, ...] = ()
    if spec.layer_windows:
        per_layer = tuple(0 if w is None else max(page_size, round(window * w / spec.window))
                          for w in map(spec.layer_window, range(spec.num_layers)))
    top = max(per_layer) if per_layer else window
    return ModelSpec(f"{spec.name}-scaled", spec.layer_kinds, top, full=tiny.full, swa=tiny.swa,
                     dtype="float64", page_size=page_size, layer_windows=per_layer)


@dataclass
class _Layer:
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    sink: torch.Tensor | None


class ReferenceModel:
    """Random-weight transformer over ``spec`` (which must be float64).

    Args:
        spec: layer kinds, window, KV shapes (``dtype == "float64"``).
        vocab: vocabulary size (token ids are taken modulo it).
        hidden: model width.
        q_heads: query heads (a multiple of both kinds' KV heads).
    """

    def __init__(self, spec: ModelSpec, *, vocab: int = 64, hidden: int = 32, q_heads: int = 4,
                 seed: int = 0) -> None:
        if spec.dtype != "float64":
            raise ValueError(f"the reference model needs a float64 spec, got {spec.dtype}")
        for kind in (AttnKind.FULL, AttnKind.SWA):
            shape = spec.shape(kind)
            if q_heads % shape.num_kv_heads:
                raise ValueError(f"q_heads={q_heads} is not a multiple of {kind.value} KV heads")
            if shape.k_head_dim % 2:
                raise ValueError("k_head_dim must be even (RoPE)")
        self.spec, self.vocab, self.hidden, self.q_heads = spec, vocab, hidden, q_heads
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64) * scale / np.sqrt(shape[0])

        self.embed = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
        self.layers: list[_Layer] = []
        for kind in spec.layer_kinds:
            s = spec.shape(kind)
            self.layers.append(_Layer(
                wq=rnd(hidden, q_heads * s.k_head_dim), wk=rnd(hidden, s.num_kv_heads * s.k_head_dim),
                wv=rnd(hidden, s.num_kv_heads * s.v_head_dim), wo=rnd(q_heads * s.v_head_dim, hidden),
                w1=rnd(hidden, 2 * hidden), w2=rnd(2 * hidden, hidden, scale=0.5),
                sink=torch.randn(q_heads, generator=g, dtype=torch.float64) if kind is AttnKind.SWA else None))
        self.lm_head = rnd(hidden, vocab)

    def threads_for(self, tokens: int) -> int:
        """Intra-op threads worth using for forwards of up to ``tokens`` tokens: one per
        ``2**24`` floating-point operations of the largest op (a dense forward's attention
        scores or a projection), at least one.  The verify model (width 32, 4 heads,
        prompts of at most a few hundred tokens) gets 1.  O(layers)."""
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        head_dim = max(max(self.spec.shape(k).k_head_dim, self.spec.shape(k).v_head_dim)
                       for k in set(self.spec.layer_kinds))
        attention = 2 * self.q_heads * tokens * tokens * head_dim
        widest = max(2 * self.hidden, self.q_heads * head_dim, self.vocab)
        projection = 2 * tokens * self.hidden * widest
        return max(1, max(attention, projection) // _FLOPS_PER_THREAD)

    # ------------------------------------------------------------ pieces
    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)

    @staticmethod
    def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotary embedding on ``x[n, heads, d]`` at positions ``pos[n]``."""
        d = x.shape[-1]
        freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = pos.to(torch.float64)[:, None] * freq[None, :]
        cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    def _qkv(self, i: int, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layer, s = self.layers[i], self.spec.shape(self.spec.layer_kinds[i])
        x = self._norm(h)
        q = self._rope((x @ layer.wq).view(len(h), self.q_heads, s.k_head_dim), pos)
        k = self._rope((x @ layer.wk).view(len(h), s.num_kv_heads, s.k_head_dim), pos)
        v = (x @ layer.wv).view(len(h), s.num_kv_heads, s.v_head_dim)
        return q, k, v

    def _attend(self, i: int, q: torch.Tensor, qpos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kpos: torch.Tensor) -> torch.Tensor:
        """Attention of queries at ``qpos`` over keys at ``kpos`` (masked by kind)."""
        kind = self.spec.layer_kinds[i]
        s = self.spec.shape(kind)
        rep = self.q_heads // s.num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / np.sqrt(s.k_head_dim)
        allowed = kpos[None, :] <= qpos[:, None]
        if kind is AttnKind.SWA:
            allowed &= kpos[None, :] > qpos[:, None] - self.spec.layer_window(i)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        sink = self.layers[i].sink
        if sink is not None:
            col = sink[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hqk,khd->qhd", probs, v)
        return out.reshape(len(q), -1) @ self.layers[i].wo

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        return torch.nn.functional.silu(self._norm(h) @ layer.w1) @ layer.w2

    # ----------------------------------------------------------- forwards
    def forward_dense(self, tokens: np.ndarray) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` with no cache at all."""
        ids = torch.as_tensor(np.asarray(tokens) % self.vocab, dtype=torch.long)
        pos = torch.arange(len(ids))
        h = self.embed[ids]
        for i in range(len(self.layers)):
            q, k, v = self._qkv(i, h, pos)
            h = h + self._attend(i, q, pos, k, v, pos)
            h = h + self._mlp(i, h)
        return self._norm(h) @ self.lm_head

    def forward_cached(self, cache: HybridKVCache, req: Request, n: int, *,
                       before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute ``n`` tokens after ``req.computed`` through ``cache``; returns their logits.

        Allocates their slots, writes their K/V into the pool buffers, reads
        earlier K/V back through the request's slots, then commits (which may
        release out-of-window SWA).  ``before_layer(i)`` is called before layer
        ``i`` reads any KV (a layerwise loader waits there).
        """
        self._need_memory(cache)
        start = req.computed
        full_new, swa_new = cache.allocate(req, n)
        logits = self._forward(cache, req, start, start + n, full_new, swa_new, before_layer)
        cache.commit(req, n)
        return logits

    def forward_step(self, cache: HybridKVCache, batch: StepBatch, row: int) -> torch.Tensor:
        """Row ``row`` of a :meth:`HybridKVCache.step` batch: compute its new
        positions at the slots the batch handed out (the caller commits the
        batch).  Returns their logits."""
        self._need_memory(cache)
        if not batch.ok[row]:
            raise ValueError(f"row {row} of the batch got no slots")
        lo, hi = int(batch.cu_new[row]), int(batch.cu_new[row + 1])
        start = int(batch.start[row])
        return self._forward(cache, batch.requests[row], start, start + hi - lo, batch.full_slots[lo:hi],
                             batch.swa_slots[lo:hi], None)

    @staticmethod
    def _need_memory(cache: HybridKVCache) -> None:
        buffers = cache.pool.buffers
        if buffers is None or buffers.device.type == "meta":
            raise ValueError("forward_cached needs a cache with real KV buffers (device='cpu')")

    def _forward(self, cache: HybridKVCache, req: Request, start: int, end: int, full_new: np.ndarray,
                 swa_new: np.ndarray, before_layer: Callable[[int], None] | None) -> torch.Tensor:
        buffers = cache.pool.buffers
        ids = torch.as_tensor(req.tokens[start:end] % self.vocab, dtype=torch.long)
        pos = torch.arange(start, end)
        full_all = cache.full_slots(req, 0, end)
        # each sliding layer reads its own window: a smaller window's group gives its
        # pages back sooner, and reading one it gave back raises (never garbage)
        swa_win: dict[int, tuple[int, np.ndarray]] = {}
        for w in {self.spec.layer_window(i) for i in self.spec.swa_layers}:
            lo = max(0, start - w + 1)
            swa_win[w] = (lo, cache.swa_slots(req, lo, end))
        h = self.embed[ids]
        for i, kind in enumerate(self.spec.layer_kinds):
            if before_layer is not None:
                before_layer(i)
            kb = buffers.of(kind)
            li = kb.local(i)
            q, k, v = self._qkv(i, h, pos)
            # through the arena's kernel-facing views: logical slot -> (block, offset)
            kb.write(li, full_new if kind is AttnKind.FULL else swa_new, k, v)
            if kind is AttnKind.FULL:
                slots, kpos = full_all, torch.arange(0, end)
            else:
                lo, slots = swa_win[self.spec.layer_window(i)]
                kpos = torch.arange(lo, end)
            k_read, v_read = kb.read(li, slots)  # on the arena's device (CPU or CUDA)
            h = h + self._attend(i, q, pos, k_read.to(q.device), v_read.to(q.device), kpos)
            h = h + self._mlp(i, h)
        return self._norm(h) @ self.lm_head
