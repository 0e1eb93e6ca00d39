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
  after its load while later loads keep running.  Host <-> device loads run
  on the copy engines (one batched DMA call per layer), so the model's
  kernels keep every SM; device <-> device loads use the SM kernel on at
  most ``max_blocks`` blocks.

Each distinct buffer pair and page list is validated and planned once per
request (:func:`~hybridkv.transfer.prepare_copy` with ``by_layer=True``);
a layer then costs one C call to issue.

An error in a layer's load is raised by ``wait()`` for that layer and every
later one (as ``RuntimeError`` chained to the cause); earlier layers stay
usable.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from ._layout import MaskLike, PageIndex
from .api import prepare_copy
from .cuda_kernel import CudaKernel, load_cuda_kernel
from .plan import PreparedCopy

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
    tables: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
    jobs = []
    page_size = src.spec.page_size
    for i, kind in enumerate(layer_kinds):
        if kind not in pages:
            raise ValueError(f"layer_kinds[{i}] is {kind!r}, which has no pages entry")
        j = seen.get(kind, 0)
        seen[kind] = j + 1
        s, d = src.of(kind), dst.of(kind)
        group, slot = s.layout.group_of(j)
        if (kind, group) not in tables:  # one block list per group: the loader plans it once
            sp, dp = (np.asarray(p, dtype=np.int64) for p in pages[kind])
            tables[(kind, group)] = (s.block_table(sp, group).astype(np.int64),
                                     d.block_table(dp, group).astype(np.int64))
        sb, db = tables[(kind, group)]
        jobs.append(LayerJob(i, (PageCopy(s.k, s.v, d.k, d.v, sb, db, page_size, slot),)))
    return jobs


class LayerwiseLoader:
    """Load layers in order in the background; ``wait(layer)`` before use.

    Args:
        jobs: one :class:`LayerJob` per model layer that needs loading, in
            load order; layer numbers must be unique.
        backend: passed to :func:`~hybridkv.transfer.prepare_copy`.
        stream: CUDA side stream for the loads (default: a new one).
        copy_fn: a copy function with ``copy_pages``'s signature, called per
            layer instead of the prepared plans (tests inject a slowed one).
        max_blocks: grid cap of the SM kernel when it runs device <-> device
            beside the model (host <-> device loads use the copy engines).
        dry_run: plan as for the copy engines and issue with the launch
            stubbed (no copy; measures the host cost of issuing anywhere).

    Each distinct (buffers, page lists) of the jobs is validated and planned
    once, per layer (:class:`~hybridkv.transfer.plan.PreparedCopy`), when
    its first layer is reached; issuing a layer is then one C call that
    queues its runs and records its event.  On CUDA (and in a dry run)
    ``plan_seconds`` and ``issue_seconds`` are the host time ``start()``
    spent planning every layer, then issuing them.
    """

    def __init__(self, jobs: Sequence[LayerJob], *, backend: str = "auto",
                 stream: Optional[torch.cuda.Stream] = None,
                 copy_fn: Optional[CopyFn] = None, max_blocks: int = 16,
                 dry_run: bool = False) -> None:
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
        self._max_blocks = max_blocks
        self._dry_run = bool(dry_run)
        self._plans: dict[tuple[int, ...], PreparedCopy] = {}
        self._done = {job.layer: threading.Event() for job in self._jobs}
        self._errors: dict[int, BaseException] = {}
        self.finish_times: dict[int, float] = {}  # layer -> time.monotonic() when loaded
        self.plan_seconds = 0.0
        self.issue_seconds = 0.0
        self._cancel = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._events: dict[int, Any] = {}  # layer -> torch.cuda.Event or a C event handle
        self._created: list[int] = []  # C events, destroyed when the loader is collected
        self._cuda = any(t.device.type == "cuda" for j in self._jobs
                         for c in j.copies for t in c.tensors())
        self._stream = stream
        self._device: Optional[torch.device] = None
        self._kernel: Optional[CudaKernel] = None
        self._started = False

    # -- starting ---------------------------------------------------------
    def start(self) -> "LayerwiseLoader":
        """Begin loading all layers in job order; returns self.  O(jobs)."""
        if self._started:
            raise RuntimeError("LayerwiseLoader.start() called twice")
        self._started = True
        if self._cuda or self._dry_run:
            self._start_issuing()
        else:
            self._thread = threading.Thread(target=self._run_cpu, name="hybridkv-layer-loader",
                                            daemon=True)
            self._thread.start()
        return self

    def _plan(self, c: PageCopy) -> PreparedCopy:
        key = (id(c.src_k), id(c.src_v), id(c.dst_k), id(c.dst_v), id(c.src_pages),
               id(c.dst_pages), id(c.mask), c.page_size)
        plan = self._plans.get(key)
        if plan is None:
            plan = prepare_copy(c.src_k, c.src_v, c.dst_k, c.dst_v, c.src_pages, c.dst_pages,
                                c.page_size, mask=c.mask, backend=self._backend, by_layer=True,
                                max_blocks=self._max_blocks, dry_run=self._dry_run)
            self._plans[key] = plan
        return plan

    def _run_one(self, job: LayerJob, stream: Optional[torch.cuda.Stream] = None) -> None:
        """The custom ``copy_fn`` path: one call per copy, validated each time."""
        assert self._copy is not None
        for c in job.copies:
            kw = {"stream": stream} if stream is not None else {}
            self._copy(c.src_k, c.src_v, c.dst_k, c.dst_v, c.src_pages, c.dst_pages,
                       c.page_size, mask=c.mask, layers=(c.kind_layer, c.kind_layer + 1),
                       backend=self._backend, **kw)

    def _check_layer(self, c: PageCopy, plan: PreparedCopy) -> None:
        lb, le = plan.layers
        if not lb <= c.kind_layer < le:
            raise ValueError(f"kind_layer {c.kind_layer} outside the buffers' layers [{lb}, {le})")

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
                if self._copy is not None:
                    self._run_one(job)
                else:
                    for c in job.copies:
                        plan = self._plan(c)
                        self._check_layer(c, plan)
                        plan.issue_layer(c.kind_layer)
            except Exception as exc:  # surfaced to the consumer by wait()
                self._fail_from(n, exc)
                return
            self.finish_times[job.layer] = time.monotonic()
            self._done[job.layer].set()

    def _new_event(self, job: LayerJob) -> int:
        """A C event for ``job`` when every copy of it runs in the CUDA library
        (0 otherwise: a torch event is recorded at issue).  Planning phase."""
        if self._kernel is None:
            return 0
        if not all(self._plan(c).backend == "cuda" for c in job.copies):
            return 0
        ev = self._kernel.event_create(self._index())
        self._created.append(ev)
        return ev

    def _issue_job(self, job: LayerJob, handle: int, event: int) -> Any:
        """Queue one layer's copies on the side stream; returns its event: the C
        ``event`` recorded by the last copy's own call, or a torch event where a
        plan is not the CUDA library's (pageable memory: the torch reference)."""
        copies = job.copies
        last = len(copies) - 1
        for i, c in enumerate(copies):
            self._plan(c).issue_layer(c.kind_layer, handle, event if i == last else 0)
        if event:
            if not copies:  # nothing to copy: record the event alone
                assert self._kernel is not None
                self._kernel.lib.hkv_cuda_copy_runs(0, 0, 0, 0, self._index(), handle, event, 0)
            return event
        if self._dry_run:
            return None
        ev = torch.cuda.Event()
        ev.record(self._stream)
        return ev

    def _index(self) -> int:
        d = self._device
        assert d is not None
        return d.index if d.index is not None else torch.cuda.current_device()

    def _start_issuing(self) -> None:
        handle = 0
        if self._cuda:
            self._device = next(t.device for j in self._jobs for c in j.copies
                                for t in c.tensors() if t.device.type == "cuda")
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=self._device)
            # Loads must not overtake work already queued on the consumer's
            # stream that still reads/writes the destination buffers.
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            handle = int(self._stream.cuda_stream)
            if self._copy is None:
                try:
                    self._kernel = load_cuda_kernel()
                    weakref.finalize(self, _destroy_events, self._kernel, self._created)
                except RuntimeError:
                    self._kernel = None  # pageable / no library: torch events
        # Plan every layer first (validation errors surface at the layer that
        # has them), then issue: the issue loop is what the model waits for.
        t0 = time.perf_counter()
        bad, err = len(self._jobs), None
        events: list[int] = []
        if self._copy is None:
            for n, job in enumerate(self._jobs):
                try:
                    for c in job.copies:
                        self._check_layer(c, self._plan(c))
                    events.append(self._new_event(job))
                except Exception as exc:
                    bad, err = n, exc
                    break
        t1 = time.perf_counter()
        self.plan_seconds = t1 - t0
        for n, job in enumerate(self._jobs[:bad]):
            try:
                if self._copy is not None:
                    self._run_one(job, self._stream)
                    ev: Any = torch.cuda.Event()
                    ev.record(self._stream)
                else:
                    ev = self._issue_job(job, handle, events[n])
            except Exception as exc:
                self._fail_from(n, exc)
                return
            if ev is not None:
                self._events[job.layer] = ev
            self._done[job.layer].set()
        self.issue_seconds = time.perf_counter() - t1
        if err is not None:
            self._fail_from(bad, err)

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
        if ev is None:
            return
        if isinstance(ev, int):
            assert self._kernel is not None and self._device is not None
            current = torch.cuda.current_stream(self._device).cuda_stream
            self._kernel.stream_wait_event(self._index(), int(current), ev)
        else:
            torch.cuda.current_stream().wait_event(ev)

    def done(self, layer: int) -> bool:
        """True once ``layer`` finished loading (or failed).  Non-blocking."""
        if layer not in self._done:
            raise ValueError(f"layer {layer} has no load job")
        ev = self._events.get(layer)
        if isinstance(ev, int):
            assert self._kernel is not None
            return self._kernel.event_done(ev)
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


def _destroy_events(kernel: CudaKernel, events: list[int]) -> None:
    """Finalizer: CUDA releases an event still pending once it completes."""
    for ev in events:
        kernel.lib.hkv_cuda_event_destroy(ev)
