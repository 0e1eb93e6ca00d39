"""Loader of the CUDA copy library (``src_cuda/``), built on first use.

The kernels are plain CUDA with a C ABI (no torch headers), opened here with
cffi ABI mode (``dlopen``).  Any CUDA error code becomes a :class:`CudaError`
naming the error.  What runs where (copy engines for host <-> device, the SM
kernel for device <-> device) is decided in :mod:`hybridkv.transfer.plan`.

Library search order: ``$HYBRIDKV_CUDA_LIB``, ``hybridkv/transfer/
libhybridkv_cuda.so`` (``make -C src_cuda install``),
``src_cuda/build/libhybridkv_cuda.so`` of a source checkout, then a build
of the installed sources (``hybridkv/transfer/cuda/``, or ``src_cuda/`` of a
checkout) with the machine's ``nvcc`` into the per-user cache (as the C host
kernel is), keyed by a hash of the sources, the flags and the GPU's
architecture.  ``HYBRIDKV_CUDA_BUILD=0`` turns that build off; ``$HYBRIDKV_NVCC``
names the compiler (else ``nvcc`` on ``PATH``, ``$CUDA_HOME/bin/nvcc``,
``/usr/local/cuda/bin/nvcc``).  A library of another ABI version is skipped
(with a log line), not an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional, Union

import cffi
import torch

from ._cdesc import HEADER, fill_desc, read_cdef
from ._layout import CopyPlan
from .host_kernel import cache_dir

log = logging.getLogger(__name__)

LIB_NAME = "libhybridkv_cuda.so"
ABI_VERSION = 2
#: flags of hkv_cuda_copy_runs / hkv_cuda_copy_pages_ex
FLAG_DRY_RUN = 1
FLAG_NO_BATCH = 2

# Must equal the CDEF block of src_cuda/hkv_transfer_cuda.h (tested); kept
# inline so the installed package needs no header at run time.
CUDA_CDEF = """
int hkv_cuda_copy_pages(const hkv_page_copy_t *desc, int device, void *stream, int *vec_bytes);
int hkv_cuda_copy_pages_ex(const hkv_page_copy_t *desc, int device, uint64_t stream,
                           int max_blocks, uint64_t event, int flags, int *vec_bytes);
int hkv_cuda_copy_runs(uint64_t dsts, uint64_t srcs, uint64_t sizes, int64_t count,
                       int device, uint64_t stream, uint64_t event, int flags);
int hkv_cuda_batch_state(void);
int hkv_cuda_event_create(int device, uint64_t *event);
int hkv_cuda_event_destroy(uint64_t event);
int hkv_cuda_stream_wait_event(int device, uint64_t stream, uint64_t event);
int hkv_cuda_event_query(uint64_t event);
int hkv_cuda_device_count(int *count);
int hkv_cuda_host_device_pointer(int device, void *host, void **device_ptr);
int hkv_cuda_runtime_version(int *version);
const char *hkv_cuda_error_string(int err);
int hkv_cuda_abi_version(void);
"""

StreamLike = Union[None, int, "torch.cuda.Stream"]

#: the sources a build needs, relative to the source directory
CUDA_SOURCES = ("page_copy.cu", "hkv_transfer_cuda.h")
#: cudaErrorNotReady: an event query of work still in flight
NOT_READY = 600


class CudaError(RuntimeError):
    """A CUDA runtime error reported by the page-copy library."""

    def __init__(self, what: str, code: int, message: str) -> None:
        super().__init__(f"{what} failed with CUDA error {code}: {message}")
        self.code = code


def source_dir() -> Optional[Path]:
    """Where the CUDA sources are: the installed package's ``transfer/cuda/``,
    else ``src_cuda/`` of a source checkout; None if neither has them."""
    here = Path(__file__).resolve().parent
    for d in (here / "cuda", here.parent.parent / "src_cuda"):
        if all((d / f).is_file() for f in CUDA_SOURCES):
            return d
    return None


def library_candidates() -> list[Path]:
    """Prebuilt library paths tried, in order, before building one."""
    here = Path(__file__).resolve().parent
    paths = []
    env = os.environ.get("HYBRIDKV_CUDA_LIB")
    if env:
        paths.append(Path(env))
    paths.append(here / LIB_NAME)
    paths.append(here.parent.parent / "src_cuda" / "build" / LIB_NAME)
    return paths


class CudaKernel:
    """The dlopen'ed library plus its ffi; ``how`` says where it came from."""

    def __init__(self, path: Path, how: str = "prebuilt") -> None:
        self.ffi = cffi.FFI()
        self.ffi.cdef(read_cdef(HEADER))
        self.ffi.cdef(CUDA_CDEF)
        self.path = path
        self.how = how
        try:
            self.lib = self.ffi.dlopen(str(path))
            got = self.lib.hkv_cuda_abi_version()
        except (OSError, AttributeError) as exc:  # another build's symbols
            raise AbiMismatch(f"{path} cannot be used ({exc}); rebuild with make -C src_cuda") from exc
        if got != ABI_VERSION:
            raise AbiMismatch(f"{path} has ABI version {got}, expected {ABI_VERSION}; "
                              "rebuild with make -C src_cuda")

    def error_string(self, code: int) -> str:
        return self.ffi.string(self.lib.hkv_cuda_error_string(code)).decode()

    def check(self, code: int, what: str) -> None:
        """Raise :class:`CudaError` if ``code`` is not cudaSuccess."""
        if code != 0:
            raise CudaError(what, code, self.error_string(code))

    def device_count(self) -> int:
        """Number of CUDA devices; raises :class:`CudaError` (e.g. no driver)."""
        n = self.ffi.new("int *")
        self.check(self.lib.hkv_cuda_device_count(n), "cudaGetDeviceCount")
        return int(n[0])

    def runtime_version(self) -> int:
        """The CUDA runtime version the library links (e.g. 13000)."""
        n = self.ffi.new("int *")
        self.check(self.lib.hkv_cuda_runtime_version(n), "cudaRuntimeGetVersion")
        return int(n[0])

    def batch_state(self) -> str:
        """Whether cudaMemcpyBatchAsync ran here: "untried", "batched" or
        "per-run" (the runtime refused it; runs go one cudaMemcpyAsync each)."""
        return {0: "untried", 1: "batched", -1: "per-run"}[int(self.lib.hkv_cuda_batch_state())]

    def device_address(self, t: torch.Tensor, device: int) -> int:
        """Address of ``t``'s data as seen by kernels on ``device`` (mapped for pinned host)."""
        if t.device.type == "cuda":
            return t.data_ptr()
        out = self.ffi.new("void **")
        self.check(self.lib.hkv_cuda_host_device_pointer(
            device, self.ffi.cast("void *", t.data_ptr()), out), "cudaHostGetDevicePointer")
        return int(self.ffi.cast("uintptr_t", out[0]))

    def new_desc(self, plan: CopyPlan, *, src_base: tuple[int, int], dst_base: tuple[int, int],
                 src_idx: Optional[torch.Tensor], dst_idx: Optional[torch.Tensor]) -> Any:
        """A kernel descriptor for ``plan`` with device-side index arrays (the
        caller keeps them alive while the descriptor is used)."""
        ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        return fill_desc(self.ffi, plan, src_idx_ptr=ptr(src_idx), dst_idx_ptr=ptr(dst_idx),
                         mask_ptr=None, src_base=src_base, dst_base=dst_base)

    def launch(self, plan: CopyPlan, device: int, stream: int, *, src_base: tuple[int, int],
               dst_base: tuple[int, int], src_idx: Optional[torch.Tensor],
               dst_idx: Optional[torch.Tensor], mask: Optional[torch.Tensor],
               max_blocks: int = 0) -> int:
        """Launch the SM kernel for ``plan`` once; returns the vector width
        used (bytes).  Index/mask tensors must already be device-accessible;
        the caller keeps them alive until the stream has run the kernel."""
        ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        d = fill_desc(self.ffi, plan, src_idx_ptr=ptr(src_idx), dst_idx_ptr=ptr(dst_idx),
                      mask_ptr=ptr(mask), src_base=src_base, dst_base=dst_base)
        vec = self.ffi.new("int *")
        self.check(self.lib.hkv_cuda_copy_pages_ex(d, device, stream, max_blocks, 0, 0, vec),
                   "page copy kernel launch")
        return int(vec[0])

    def event_create(self, device: int) -> int:
        out = self.ffi.new("uint64_t *")
        self.check(self.lib.hkv_cuda_event_create(device, out), "cudaEventCreate")
        return int(out[0])

    def event_destroy(self, event: int) -> None:
        self.check(self.lib.hkv_cuda_event_destroy(event), "cudaEventDestroy")

    def stream_wait_event(self, device: int, stream: int, event: int) -> None:
        self.check(self.lib.hkv_cuda_stream_wait_event(device, stream, event), "cudaStreamWaitEvent")

    def event_done(self, event: int) -> bool:
        code = int(self.lib.hkv_cuda_event_query(event))
        if code == NOT_READY:
            return False
        self.check(code, "cudaEventQuery")
        return True


class AbiMismatch(RuntimeError):
    """A library file of another ABI version (skipped by the loader)."""


def find_nvcc() -> Optional[str]:
    """The nvcc to build with: ``$HYBRIDKV_NVCC``, ``nvcc`` on PATH,
    ``$CUDA_HOME/bin/nvcc``, ``/usr/local/cuda/bin/nvcc``; None if none exists."""
    env = os.environ.get("HYBRIDKV_NVCC")
    if env:
        return env if Path(env).is_file() else None
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def _arch_flags() -> list[str]:
    """SASS for the GPU present (plus its PTX); without one, sm_80 + sm_90 + PTX."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        cc = f"{major}{minor}"
        return ["-gencode", f"arch=compute_{cc},code=sm_{cc}",
                "-gencode", f"arch=compute_{cc},code=compute_{cc}"]
    return ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
            "-gencode", "arch=compute_90,code=compute_90"]


def _build_target(src: Path) -> tuple[list[str], Path]:
    """nvcc flags and the cache path a build of ``src`` for this machine gets."""
    flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", "-cudart", "static",
             *_arch_flags()]
    h = hashlib.sha256()
    for part in [*(src / f for f in CUDA_SOURCES), HEADER]:
        h.update(part.read_bytes())
        h.update(b"\0")
    h.update(" ".join(flags).encode())
    return flags, cache_dir() / f"libhybridkv_cuda-{h.hexdigest()[:16]}.so"


def _cached_build(src: Path) -> Optional[Path]:
    target = _build_target(src)[1]
    return target if target.is_file() else None


def build_library(src: Path, nvcc: str, timeout_s: float = 300.0) -> Path:
    """Build ``src``'s CUDA library into the per-user cache (once per sources,
    flags and architecture; concurrent builders publish atomically).  Raises
    ``RuntimeError`` with the compiler's output on failure."""
    flags, target = _build_target(src)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="cuda-build-") as tmp:
        out = Path(tmp) / LIB_NAME
        cmd = [nvcc, *flags, f"-I{HEADER.parent}", f"-I{src}", "-o", str(out),
               str(src / "page_copy.cu")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}): {proc.stderr[-2000:]}")
        os.replace(out, target)
    return target


_lock = threading.Lock()
_cache: dict[str, Any] = {}


def _load_uncached(build: bool = True) -> CudaKernel:
    tried = []
    for path in library_candidates():
        if not path.is_file():
            tried.append(f"{path} (absent)")
            continue
        try:
            return CudaKernel(path, "prebuilt")
        except AbiMismatch as exc:
            log.info("hybridkv: skipping %s", exc)
            tried.append(f"{path} (other ABI)")
    src, nvcc = source_dir(), find_nvcc()
    if not build:
        cached = None if src is None else _cached_build(src)
        if cached is not None:
            return CudaKernel(cached, "built earlier")
        tried.append("not built yet" + ("" if nvcc is None or src is None
                                        else f" (first use builds it with {nvcc})"))
    elif os.environ.get("HYBRIDKV_CUDA_BUILD") == "0":
        tried.append("building turned off by HYBRIDKV_CUDA_BUILD=0")
    elif src is None:
        tried.append("no CUDA sources installed")
    elif nvcc is None:
        tried.append("no nvcc to build with (set HYBRIDKV_NVCC or put nvcc on PATH)")
    else:
        return CudaKernel(build_library(src, nvcc), f"built with {nvcc}")
    raise RuntimeError("CUDA copy library not found (run `make -C src_cuda`, or install "
                       "nvcc to build it on first use); tried: " + "; ".join(tried))


def load_cuda_kernel() -> CudaKernel:
    """Load the library (cached; built on first use where nvcc exists).
    Raises ``RuntimeError`` saying what was tried if none can be had."""
    with _lock:
        if "kernel" in _cache:
            return _cache["kernel"]
        if "error" in _cache:
            raise RuntimeError(_cache["error"])
        try:
            kernel = _load_uncached()
        except Exception as exc:
            _cache["error"] = str(exc)
            raise RuntimeError(str(exc)) from exc
        _cache["kernel"] = kernel
        log.info("hybridkv: CUDA copy library %s (%s)", kernel.path, kernel.how)
        return kernel


def probe_cuda_kernel() -> tuple[Optional[CudaKernel], str]:
    """The library if one is loaded or can be loaded without building, else
    ``(None, what was tried)``.  Never builds; caches nothing."""
    with _lock:
        if "kernel" in _cache:
            return _cache["kernel"], "loaded"
    try:
        return _load_uncached(build=False), "found"
    except (RuntimeError, OSError) as exc:
        return None, str(exc)


def reset_cuda_kernel_cache() -> None:
    """Forget the loaded library so the next use searches again (for tests)."""
    with _lock:
        _cache.clear()


def resolve_stream(stream: StreamLike, device: torch.device) -> "torch.cuda.Stream":
    """The torch stream to launch on: None = current stream of ``device``.

    Accepts a ``torch.cuda.Stream`` (including ``ExternalStream``) or a raw
    ``cudaStream_t`` handle as int (wrapped in ``ExternalStream``).
    """
    if stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(stream, torch.cuda.Stream):
        return stream
    if isinstance(stream, int) and not isinstance(stream, bool):
        return torch.cuda.ExternalStream(stream, device=device)
    raise TypeError(
        f"stream must be None, an int handle or a torch.cuda.Stream, got {type(stream).__name__}"
    )
