"""Layerwise prefetch: load layer i+1.. while the model computes layer i.

Usage (the model side is one line per layer)::

    jobs = model_layer_jobs(spec_layer_kinds, buffers, pages, page_size)
    with LayerwiseLoader(jobs) as loader:      # starts loading layer 0, 1, ...
        for i, layer in enumerate(model.layers):
            loader.wait(i)                      # KV of layer i is in place
            h = layer(h)

* CPU tensors: one worker thread runs the copies in job order (the C host
  kernel releases the GIL) and sets a per-layer event when a layer is done.
* CUDA tensors: every copy is issued at ``start()`` on a side stream with
  one CUDA event recorded per layer; ``wait(i)`` makes the *current* stream
  wait for that event (no host sync), so attention of layer i is ordered
  after its load while later loads keep running.

An error in a layer's load is raised by ``wait()`` for that layer and every
later one (as ``RuntimeError`` chained to the cause); earlier layers stay
usable.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from ._layout import MaskLike, PageIndex
from .api import copy_pages
from .cuda_kernel import StreamLike

CopyFn = Callable[..., object]


@dataclass(frozen=True)
class PageCopy:
    """Pages of one layer of one kind to load: the arguments of ``copy_pages``.

    ``kind_layer`` indexes the layer inside this kind's ``[layers, ...]``
    buffers; ``mask`` optionally selects entries (e.g. SWA window pages).
    """

    src_k: torch.Tensor
    src_v: torch.Tensor
    dst_k: torch.Tensor
    dst_v: torch.Tensor
    src_pages: PageIndex
    dst_pages: PageIndex
    page_size: int
    kind_layer: int
    mask: MaskLike = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.src_k, self.src_v, self.dst_k, self.dst_v)


@dataclass(frozen=True)
class LayerJob:
    """Everything to load before model layer ``layer`` may run attention."""

    layer: int
    copies: tuple[PageCopy, ...] = field(default_factory=tuple)


def model_layer_jobs(
    layer_kinds: Sequence[str],
    buffers: Mapping[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    pages: Mapping[str, tuple[PageIndex, PageIndex]],
    page_size: int,
) -> list[LayerJob]:
    """One job per model layer from per-kind buffers and page lists.

    ``layer_kinds[i]`` is the kind ("full"/"swa") of model layer i; its
    buffers are ``buffers[kind] = (src_k, src_v, dst_k, dst_v)`` and it loads
    ``pages[kind] = (src_pages, dst_pages)`` (for "swa": only the window
    pages).  The n-th layer of a kind is layer n of that kind's buffers.
    O(layers).
    """
    seen: dict[str, int] = {}
    jobs = []
    for i, kind in enumerate(layer_kinds):
        if kind not in buffers or kind not in pages:
            raise ValueError(f"layer_kinds[{i}] is {kind!r}, which has no buffers/pages entry")
        j = seen.get(kind, 0)
        seen[kind] = j + 1
        src_k, src_v, dst_k, dst_v = buffers[kind]
        sp, dp = pages[kind]
        jobs.append(LayerJob(i, (PageCopy(src_k, src_v, dst_k, dst_v, sp, dp, page_size, j),)))
    for kind, count in seen.items():
        have = buffers[kind][0].shape[0]
        if have != count:
            raise ValueError(f"buffers[{kind!r}] hold {have} layers but layer_kinds "
                             f"lists {count} {kind!r} layers")
    return jobs


def arena_layer_jobs(layer_kinds: Sequence[str], src: Any, dst: Any,
                     pages: Mapping[str, tuple[PageIndex, PageIndex]]) -> list[LayerJob]:
    """:func:`model_layer_jobs` between two KV arenas (:class:`~hybridkv.pools.KVArena`
    of the same model, e.g. the host tier and the device cache).

    ``pages[kind] = (src_pages, dst_pages)`` are *logical* pages of each arena;
    layer ``i`` of a kind copies its layer slot of the blocks of its group
    (``arena.of(kind).block_table(pages, group)``), so a layer's load touches
    only that layer's bytes.  O(layers * pages).
    """
    seen: dict[str, int] = {}
    jobs = []
    page_size = src.spec.page_size
    for i, kind in enumerate(layer_kinds):
        if kind not in pages:
            raise ValueError(f"layer_kinds[{i}] is {kind!r}, which has no pages entry")
        j = seen.get(kind, 0)
        seen[kind] = j + 1
        s, d = src.of(kind), dst.of(kind)
        group, slot = s.layout.group_of(j)
        sp, dp = (np.asarray(p, dtype=np.int64) for p in pages[kind])
        jobs.append(LayerJob(i, (PageCopy(s.k, s.v, d.k, d.v, s.block_table(sp, group).astype(np.int64),
                                          d.block_table(dp, group).astype(np.int64), page_size, slot),)))
    return jobs


class LayerwiseLoader:
    """Load layers in order in the background; ``wait(layer)`` before use.

    Args:
        jobs: one :class:`LayerJob` per model layer that needs loading, in
            load order; layer numbers must be unique.
        backend: passed to ``copy_pages``.
        stream: CUDA side stream for the loads (default: a new one).
        copy_fn: the copy function (default ``copy_pages``); tests inject a
            slowed one.
    """

    def __init__(self, jobs: Sequence[LayerJob], *, backend: str = "auto",
                 stream: Optional[torch.cuda.Stream] = None,
                 copy_fn: CopyFn = copy_pages) -> None:
        layers = []
        for n, job in enumerate(jobs):
            if not isinstance(job, LayerJob):
                raise TypeError(f"jobs[{n}] must be a LayerJob, got {type(job).__name__}")
            if any(not isinstance(c, PageCopy) for c in job.copies):
                raise TypeError(f"jobs[{n}].copies must hold PageCopy objects")
            layers.append(job.layer)
        if len(set(layers)) != len(layers):
            raise ValueError("jobs name a layer more than once")
        self._jobs = list(jobs)
        self._backend = backend
        self._copy = copy_fn
        self._done = {job.layer: threading.Event() for job in self._jobs}
        self._errors: dict[int, BaseException] = {}
        self.finish_times: dict[int, float] = {}  # layer -> time.monotonic() when loaded
        self._cancel = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._events: dict[int, "torch.cuda.Event"] = {}
        self._cuda = any(t.device.type == "cuda" for j in self._jobs
                         for c in j.copies for t in c.tensors())
        self._stream = stream
        self._started = False

    # -- starting ---------------------------------------------------------
    def start(self) -> "LayerwiseLoader":
        """Begin loading all layers in job order; returns self.  O(jobs)."""
        if self._started:
            raise RuntimeError("LayerwiseLoader.start() called twice")
        self._started = True
        if self._cuda:
            self._start_cuda()
        else:
            self._thread = threading.Thread(target=self._run_cpu, name="hybridkv-layer-loader",
                                            daemon=True)
            self._thread.start()
        return self

    def _run_one(self, job: LayerJob, stream: StreamLike = None) -> None:
        for c in job.copies:
            kw = {"stream": stream} if stream is not None else {}
            self._copy(c.src_k, c.src_v, c.dst_k, c.dst_v, c.src_pages, c.dst_pages,
                       c.page_size, mask=c.mask, layers=(c.kind_layer, c.kind_layer + 1),
                       backend=self._backend, **kw)

    def _fail_from(self, index: int, exc: BaseException) -> None:
        for job in self._jobs[index:]:
            self._errors[job.layer] = exc
            self._done[job.layer].set()

    def _run_cpu(self) -> None:
        for n, job in enumerate(self._jobs):
            if self._cancel.is_set():
                self._fail_from(n, RuntimeError("loader closed before this layer loaded"))
                return
            try:
                self._run_one(job)
            except Exception as exc:  # surfaced to the consumer by wait()
                self._fail_from(n, exc)
                return
            self.finish_times[job.layer] = time.monotonic()
            self._done[job.layer].set()

    def _start_cuda(self) -> None:
        device = next(t.device for j in self._jobs for c in j.copies for t in c.tensors()
                      if t.device.type == "cuda")
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        # Loads must not overtake work already queued on the consumer's
        # stream that still reads/writes the destination buffers.
        self._stream.wait_stream(torch.cuda.current_stream(device))
        for n, job in enumerate(self._jobs):
            try:
                self._run_one(job, self._stream)
            except Exception as exc:
                self._fail_from(n, exc)
                return
            ev = torch.cuda.Event()
            ev.record(self._stream)
            self._events[job.layer] = ev
            self._done[job.layer].set()

    # -- consuming --------------------------------------------------------
    def wait(self, layer: int, timeout: Optional[float] = None) -> None:
        """Block until ``layer``'s KV is loaded (CUDA: order the current stream).

        Raises ``RuntimeError`` if the load failed or was cancelled,
        ``TimeoutError`` after ``timeout`` seconds, ``ValueError`` for a layer
        without a job.
        """
        if layer not in self._done:
            raise ValueError(f"layer {layer} has no load job")
        if not self._started:
            raise RuntimeError("LayerwiseLoader.wait() before start()")
        if not self._done[layer].wait(timeout):
            raise TimeoutError(f"layer {layer} not loaded after {timeout} s")
        err = self._errors.get(layer)
        if err is not None:
            raise RuntimeError(f"loading layer {layer} failed: {err}") from err
        ev = self._events.get(layer)
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def done(self, layer: int) -> bool:
        """True once ``layer`` finished loading (or failed).  Non-blocking."""
        if layer not in self._done:
            raise ValueError(f"layer {layer} has no load job")
        ev = self._events.get(layer)
        if ev is not None:
            return bool(ev.query())
        return self._done[layer].is_set()

    def close(self) -> None:
        """Stop after the layer in flight and join the worker.  Idempotent."""
        self._cancel.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "LayerwiseLoader":
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
