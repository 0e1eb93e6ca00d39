"""Prepared copies: validate and plan a copy once, then issue it in microseconds.

A :class:`PreparedCopy` is what :func:`~hybridkv.transfer.prepare_copy`
(and ``prepare_pack`` / ``prepare_unpack``) return: the arguments checked,
the backend chosen, and the work built in the form its executor takes:

* ``path == "dma"`` (host <-> device): the copy engines.  The plan holds the
  coalesced byte runs (:mod:`hybridkv.transfer.runs`) per layer, host
  addresses resolved; issuing a layer is one C call that hands them to one
  ``cudaMemcpyBatchAsync`` and records the layer's event.  The SMs stay
  with the model.
* ``path == "kernel"`` (device <-> device): the SM page-copy kernel, one
  descriptor per layer, its index arrays on the device (uploaded once per
  stream); ``max_blocks`` caps its grid where it runs beside compute.
* ``path == "host"``: the C host kernel (OpenMP) on a prefilled descriptor.
* ``path == "torch"``: the torch reference (pageable host memory beside a
  GPU, or no compiler).  ``"meta"``: nothing to move.

Dry run (``dry_run=True``): the DMA plan built from tensors on any device,
issued through the same C entry point with the launch stubbed (it returns
before any CUDA call), so the host cost of issuing is measurable on a
machine without a GPU; :meth:`PreparedCopy.run_on_host` executes the same
runs with ``memcpy`` so tests can check them byte for byte.

A plan keeps its tensors alive.  It is not thread-safe: one issuer at a time.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch

from .._validate import check_int
from . import _layout as L
from .cuda_kernel import (FLAG_DRY_RUN, CudaKernel, StreamLike, load_cuda_kernel,
                          probe_cuda_kernel, resolve_stream)
from .host_kernel import default_threads, load_host_kernel
from .reference import ref_copy_pages
from .runs import Runs, build_runs

log = logging.getLogger(__name__)

CUDA_PATHS = ("auto", "dma", "kernel")
_warned: set[str] = set()


def warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def _cuda_library_available() -> bool:
    try:
        kernel = load_cuda_kernel()
    except RuntimeError as exc:
        warn_once("cuda-lib", "hybridkv: CUDA copy library unavailable, copies beside the GPU "
                  "use torch (index_select / index_copy_): %s", exc)
        return False
    if "cuda-path" not in _warned:  # one line saying what runs, once per process
        _warned.add("cuda-path")
        log.info("hybridkv: copies beside the GPU use %s (%s): host<->device on the copy "
                 "engines (batched DMA), device<->device on the SM kernel", kernel.path, kernel.how)
    return True


def resolve_backend(backend: str, named: dict[str, torch.Tensor]) -> str:
    """The backend that will run ("meta", "torch", "host" or "cuda"); raises
    naming the offending argument.  See :mod:`hybridkv.transfer.api`."""
    L.check_backend(backend)
    kinds = {n: t.device.type for n, t in named.items()}
    if "meta" in kinds.values():
        if set(kinds.values()) != {"meta"}:
            other = next(n for n, k in kinds.items() if k != "meta")
            raise ValueError(f"{other} is on {named[other].device} but other tensors are meta")
        return "meta"
    cuda = {named[n].device for n, k in kinds.items() if k == "cuda"}
    if len(cuda) > 1:
        raise ValueError(f"tensors span several CUDA devices {sorted(map(str, cuda))}")
    odd = [n for n, k in kinds.items() if k not in ("cpu", "cuda")]
    if odd and backend != "torch":
        raise ValueError(f"{odd[0]} is on unsupported device {named[odd[0]].device}; "
                         "use backend='torch'")
    if backend == "torch":
        return "torch"
    if backend == "host" or (backend == "auto" and not cuda):
        if cuda:
            name = next(n for n, k in kinds.items() if k == "cuda")
            raise ValueError(
                f"backend='host' needs CPU tensors but {name} is on {named[name].device}")
        if load_host_kernel() is not None:
            return "host"
        if backend == "host":
            raise RuntimeError("the C host kernel is unavailable (no working C compiler); "
                               "use backend='torch' or 'auto'")
        return "torch"
    if not cuda:
        raise ValueError("backend='cuda' needs at least one tensor on a CUDA device")
    pageable = [n for n, k in kinds.items() if k == "cpu" and not named[n].is_pinned()]
    if backend == "cuda":
        if pageable:
            raise ValueError(f"{pageable[0]} is pageable host memory; the CUDA copy path "
                             "needs pinned memory (tensor.pin_memory())")
        load_cuda_kernel()  # RuntimeError saying what was tried if there is none
        return "cuda"
    return "cuda" if not pageable and _cuda_library_available() else "torch"


def check_cuda_path(cuda_path: object) -> str:
    if not isinstance(cuda_path, str) or cuda_path not in CUDA_PATHS:
        raise ValueError(f"cuda_path must be one of {CUDA_PATHS}, got {cuda_path!r}")
    return cuda_path


def check_max_blocks(max_blocks: object) -> int:
    """``max_blocks`` as 0 (no cap) or a positive int."""
    if max_blocks is None:
        return 0
    return check_int(max_blocks, "max_blocks", 1)


class PreparedCopy:
    """A validated, planned copy; :meth:`issue` runs it (see module docstring).

    Attributes:
        backend: what ``copy_pages`` reports ("cuda", "host", "torch", "meta",
            or "dry-run").
        path: the mechanism ("dma", "kernel", "host", "torch", "meta").
        layers: ``(begin, end)`` layers the plan covers.
        by_layer: True if layers can be issued one at a time.
        nbytes: bytes one full issue moves.
        device: CUDA device index the copies run on (None off the GPU).
    """

    def __init__(self, backend: str, path: str, layers: tuple[int, int], by_layer: bool,
                 nbytes: int, device: Optional[int], executor: "_Executor",
                 keep: Sequence[torch.Tensor]) -> None:
        self.backend = backend
        self.path = path
        self.layers = layers
        self.by_layer = by_layer
        self.nbytes = nbytes
        self.device = device
        self._exec = executor
        self._keep = tuple(keep)  # the plan's buffers outlive it

    def _groups(self, layers: Optional[tuple[int, int]]) -> tuple[int, int]:
        lb, le = self.layers
        if layers is None:
            return (0, le - lb) if self.by_layer else (0, 1)
        b, e = L.check_layers(layers, le)
        if self.by_layer and lb <= b:
            return b - lb, e - lb
        if not self.by_layer and (b, e) == self.layers:
            return 0, 1
        raise ValueError(f"layers {layers!r} is not within the plan's layers {self.layers} "
                         + ("" if self.by_layer else "(prepared whole: issue all of them)"))

    def stream_handle(self, stream: StreamLike) -> int:
        """The raw ``cudaStream_t`` of ``stream`` (None: the current stream)."""
        if self.device is None:
            return 0
        if isinstance(stream, int) and not isinstance(stream, bool):
            return stream
        return int(resolve_stream(stream, torch.device("cuda", self.device)).cuda_stream)

    def issue(self, layers: Optional[tuple[int, int]] = None, *, stream: StreamLike = None,
              event: int = 0) -> None:
        """Run the copy of ``layers`` (default: all the plan's layers),
        asynchronously on ``stream`` for the CUDA paths; ``event`` (a handle
        from ``hkv_cuda_event_create``, 0 = none) is recorded after it.
        Raises ``RuntimeError`` on a CUDA error.  O(runs) in C."""
        g0, g1 = self._groups(layers)
        if g1 > g0:
            self._exec.issue(g0, g1, self.stream_handle(stream), event)

    def issue_layer(self, layer: int, stream: int = 0, event: int = 0) -> None:
        """The per-layer fast path of a ``by_layer`` plan: ``layer`` is an
        absolute layer inside :attr:`layers`, ``stream`` a raw stream handle.
        Trusts its arguments (the plan was validated); O(runs of the layer)."""
        g = layer - self.layers[0]
        self._exec.issue(g, g + 1, stream, event)

    def run_on_host(self, num_threads: Optional[int] = None) -> None:
        """Execute a DMA plan over host memory with ``memcpy`` (tests check a
        plan's runs with it; a dry-run plan moves nothing otherwise)."""
        if not isinstance(self._exec, _Dma):
            raise ValueError(f"run_on_host needs a DMA plan, this one is {self.path!r}")
        self._exec.run_on_host(num_threads)


class _Executor:
    def issue(self, g0: int, g1: int, stream: int, event: int) -> None:
        raise NotImplementedError


class _Meta(_Executor):
    def issue(self, g0: int, g1: int, stream: int, event: int) -> None:
        return None


class _Torch(_Executor):
    """The reference, layer range by layer range, on the caller's stream."""

    def __init__(self, run: Callable[[tuple[int, int]], None], lb: int, by_layer: bool,
                 le: int, device: Optional[torch.device]) -> None:
        self.run, self.lb, self.le, self.by_layer, self.device = run, lb, le, by_layer, device

    def issue(self, g0: int, g1: int, stream: int, event: int) -> None:
        span = (self.lb + g0, self.lb + g1) if self.by_layer else (self.lb, self.le)
        if self.device is None or stream == 0:
            self.run(span)
            return
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self.device)):
            self.run(span)


class _Host(_Executor):
    """The C host kernel on one prefilled descriptor (layer fields set per issue)."""

    def __init__(self, plan: L.CopyPlan, by_layer: bool, num_threads: Optional[int]) -> None:
        kernel = load_host_kernel()
        assert kernel is not None  # resolve_backend chose "host" only if it loaded
        self.lib = kernel.lib
        self.plan = plan  # the descriptor points into its index tensors
        self.desc = kernel.desc(plan)
        self.lb, self.le, self.by_layer = plan.layer_begin, plan.layer_end, by_layer
        self.threads = num_threads or default_threads()

    def issue(self, g0: int, g1: int, stream: int, event: int) -> None:
        d = self.desc
        if self.by_layer:
            d.layer_begin, d.layer_end = self.lb + g0, self.lb + g1
        rc = self.lib.hkv_host_copy_pages_mode(d, self.threads, -1)
        if rc != 0:
            raise RuntimeError(f"host page copy rejected its arguments (code {rc})")


class _Dma(_Executor):
    """Byte runs for the copy engines, one batched C call per issue."""

    def __init__(self, runs: Runs, device: int, kernel: Optional[CudaKernel], flags: int) -> None:
        self.runs, self.device, self.kernel, self.flags = runs, device, kernel, flags
        host = load_host_kernel() if kernel is None else None
        if kernel is None and host is None:
            raise RuntimeError("a dry run needs the CUDA library or the C host kernel")
        self.host = host
        offs = runs.offsets
        base = (runs.dst.ctypes.data, runs.src.ctypes.data, runs.size.ctypes.data)
        self.base = base
        self.offsets = [int(x) for x in offs]

    def issue(self, g0: int, g1: int, stream: int, event: int) -> None:
        a, b = self.offsets[g0], self.offsets[g1]
        d, s, z = self.base
        o = 8 * a
        if self.kernel is not None:
            rc = self.kernel.lib.hkv_cuda_copy_runs(d + o, s + o, z + o, b - a, self.device,
                                                     stream, event, self.flags)
            if rc != 0:
                self.kernel.check(rc, "batched page copy")
        else:  # dry run without the CUDA library: the host entry point, stubbed
            assert self.host is not None
            self.host.lib.hkv_host_copy_runs(d + o, s + o, z + o, b - a, 1, FLAG_DRY_RUN)

    def run_on_host(self, num_threads: Optional[int]) -> None:
        host = self.host or load_host_kernel()
        if host is None:
            raise RuntimeError("the C host kernel is unavailable")
        d, s, z = self.base
        rc = host.lib.hkv_host_copy_runs(d, s, z, self.runs.count, num_threads or default_threads(), 0)
        if rc != 0:
            raise RuntimeError(f"host run copy rejected its arguments (code {rc})")


class _HostRuns(_Executor):
    """Byte runs over host memory: one parallel ``memcpy`` loop in C."""

    def __init__(self, runs: Runs, num_threads: Optional[int]) -> None:
        host = load_host_kernel()
        assert host is not None  # resolve_backend chose "host" only if it loaded
        self.lib, self.runs = host.lib, runs
        self.threads = num_threads or default_threads()

    def issue(self, g0: int, g1: int, stream: int, event: int) -> None:
        r = self.runs
        rc = self.lib.hkv_host_copy_runs(r.dst.ctypes.data, r.src.ctypes.data, r.size.ctypes.data,
                                         r.count, self.threads, 0)
        if rc != 0:
            raise RuntimeError(f"host run copy rejected its arguments (code {rc})")


class _Kernel(_Executor):
    """The SM kernel: one descriptor per layer group, index arrays per stream."""

    def __init__(self, kernel: CudaKernel, plan: L.CopyPlan, device: torch.device,
                 bases: tuple[tuple[int, int], tuple[int, int]], by_layer: bool,
                 max_blocks: int) -> None:
        self.kernel, self.plan, self.device = kernel, plan, device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.bases, self.by_layer, self.max_blocks = bases, by_layer, max_blocks
        self.vec = kernel.ffi.new("int *")
        self._per_stream: dict[int, tuple[Any, tuple[torch.Tensor, ...]]] = {}

    def _desc(self, stream: int) -> Any:
        got = self._per_stream.get(stream)
        if got is None:
            # Uploaded on the stream that runs the kernel: ordered before it,
            # and the caching allocator keeps the memory for that stream.
            torch_stream = (torch.cuda.ExternalStream(stream, device=self.device) if stream
                            else torch.cuda.default_stream(self.device))
            with torch.cuda.stream(torch_stream):
                on_dev = tuple(None if t is None else t.to(self.device, non_blocking=True)
                               for t in (self.plan.src_idx, self.plan.dst_idx))
            desc = self.kernel.new_desc(self.plan, src_base=self.bases[0], dst_base=self.bases[1],
                                        src_idx=on_dev[0], dst_idx=on_dev[1])
            got = (desc, tuple(t for t in on_dev if t is not None))
            self._per_stream[stream] = got
        return got[0]

    def issue(self, g0: int, g1: int, stream: int, event: int) -> None:
        d = self._desc(stream)
        if self.by_layer:
            d.layer_begin, d.layer_end = self.plan.layer_begin + g0, self.plan.layer_begin + g1
        rc = self.kernel.lib.hkv_cuda_copy_pages_ex(d, self.index, stream, self.max_blocks,
                                                     event, 0, self.vec)
        if rc != 0:
            self.kernel.check(rc, "page copy kernel launch")


def compact(plan: L.CopyPlan) -> L.CopyPlan:
    """``plan`` without masked entries (the kernels then launch no idle work)."""
    if plan.mask is None:
        return plan
    keep = torch.from_numpy(plan.mask.numpy().astype(bool))
    n = int(keep.sum())
    pick = lambda t, default: (t if t is not None else default)[keep].contiguous()  # noqa: E731
    ident = torch.arange(plan.n_pages, dtype=torch.int64)
    return L.CopyPlan(n_pages=n, src_idx=pick(plan.src_idx, ident), dst_idx=pick(plan.dst_idx, ident),
                      mask=None, layer_begin=plan.layer_begin, layer_end=plan.layer_end,
                      run_bytes=plan.run_bytes, src=plan.src, dst=plan.dst)


def _dry_kernel() -> Optional[CudaKernel]:
    """The CUDA library for a dry run's stubbed issue; None: the host
    library's stub entry point stands in (same arguments, no CUDA)."""
    try:
        return load_cuda_kernel()
    except RuntimeError:
        return None


def _cuda_device(named: Sequence[torch.Tensor]) -> torch.device:
    return next(t.device for t in named if t.device.type == "cuda")


def _mapped(kernel: CudaKernel, tensors: Sequence[torch.Tensor], base: tuple[int, int],
            index: int) -> tuple[int, int]:
    """Bases of one side as the SMs see them: host buffers through their
    mapped device address, offsets inside each tensor kept."""
    if tensors[0].device.type == "cuda":
        return base
    anchors = tuple(tensors) if len(tensors) == 2 else (tensors[0], tensors[0])
    # an empty tensor (e.g. zero-width V) is never read: no mapping to ask for
    return tuple(b if a.numel() == 0 else kernel.device_address(a, index) + b - a.data_ptr()  # type: ignore[return-value]
                 for a, b in zip(anchors, base))


def plan_copy(chosen: str, plan: L.CopyPlan, src: Sequence[torch.Tensor],
              dst: Sequence[torch.Tensor], *, torch_run: Callable[[tuple[int, int]], None],
              by_layer: bool, cuda_path: str, max_blocks: int, num_threads: Optional[int],
              dry_run: bool) -> PreparedCopy:
    """Build the executor for a validated ``plan`` whose backend is ``chosen``.
    ``torch_run(layers)`` runs the reference over a layer range."""
    layers = (plan.layer_begin, plan.layer_end)
    nl = plan.layer_end - plan.layer_begin
    active = plan.n_pages if plan.mask is None else int(plan.mask.sum())
    nbytes = active * nl * (plan.run_bytes[0] + plan.run_bytes[1])
    tensors = (*src, *dst)
    if dry_run:
        ex: _Executor = _Dma(build_runs(plan, by_layer=by_layer), 0, _dry_kernel(), FLAG_DRY_RUN)
        return PreparedCopy("dry-run", "dma", layers, by_layer, nbytes, None, ex, tensors)
    if chosen == "meta":
        return PreparedCopy("meta", "meta", layers, by_layer, 0, None, _Meta(), tensors)
    cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if chosen == "torch":
        ex = _Torch(torch_run, plan.layer_begin, by_layer, plan.layer_end, cuda)
        return PreparedCopy("torch", "torch", layers, by_layer, nbytes,
                            None if cuda is None else _index(cuda), ex, tensors)
    if chosen == "host":
        return PreparedCopy("host", "host", layers, by_layer, nbytes, None,
                            _Host(compact(plan), by_layer, num_threads), tensors)
    kernel = load_cuda_kernel()
    device = _cuda_device(tensors)
    index = _index(device)
    host_side = any(t.device.type == "cpu" for t in tensors)
    path = ("dma" if host_side else "kernel") if cuda_path == "auto" else cuda_path
    if path == "dma":
        ex = _Dma(build_runs(plan, by_layer=by_layer), index, kernel, 0)
    else:
        bases = (_mapped(kernel, src, plan.src.base, index), _mapped(kernel, dst, plan.dst.base, index))
        ex = _Kernel(kernel, compact(plan), device, bases, by_layer, max_blocks)
    return PreparedCopy("cuda", path, layers, by_layer, nbytes, index, ex, tensors)


def plan_runs(chosen: str, runs: Runs, tensors: Sequence[torch.Tensor], *,
              torch_run: Callable[[tuple[int, int]], None],
              num_threads: Optional[int], dry_run: bool) -> PreparedCopy:
    """A one-group plan over prebuilt byte ``runs`` (e.g. engine block rows):
    copy engines beside a GPU, a C ``memcpy`` loop on the CPU."""
    nbytes = runs.nbytes
    if dry_run:
        return PreparedCopy("dry-run", "dma", (0, 1), False, nbytes, None,
                            _Dma(runs, 0, _dry_kernel(), FLAG_DRY_RUN), tensors)
    if chosen == "meta":
        return PreparedCopy("meta", "meta", (0, 1), False, 0, None, _Meta(), tensors)
    cuda = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if chosen == "torch":
        return PreparedCopy("torch", "torch", (0, 1), False, nbytes,
                            None if cuda is None else _index(cuda),
                            _Torch(torch_run, 0, False, 1, cuda), tensors)
    if chosen == "host":
        return PreparedCopy("host", "host", (0, 1), False, nbytes, None,
                            _HostRuns(runs, num_threads), tensors)
    assert cuda is not None
    index = _index(cuda)
    return PreparedCopy("cuda", "dma", (0, 1), False, nbytes, index,
                        _Dma(runs, index, load_cuda_kernel(), 0), tensors)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def describe_paths() -> dict[str, Any]:
    """Which copy path runs for each pair of places, and why (``hybridkv info``).
    Never builds the CUDA library (it says whether first use would)."""
    out: dict[str, Any] = {"cpu<->cpu": "host kernel (C, OpenMP)" if load_host_kernel()
                           else "torch reference (no C compiler)"}
    kernel, why = probe_cuda_kernel()
    if kernel is not None:
        out["cuda_library"] = f"{kernel.path} ({kernel.how})"
        out["host<->device"] = ("copy engines: one cudaMemcpyBatchAsync of coalesced runs per "
                                f"issue (batch {kernel.batch_state()}); pageable host memory: torch")
        out["device<->device"] = "SM page-copy kernel (grid capped by max_blocks beside compute)"
    else:
        out["cuda_library"] = f"unavailable: {why}"
        out["host<->device"] = out["device<->device"] = "torch (index_select / index_copy_)"
    out["cuda_available"] = bool(torch.cuda.is_available())
    return out


__all__ = ["CUDA_PATHS", "PreparedCopy", "describe_paths", "plan_copy", "plan_runs",
           "resolve_backend"]
