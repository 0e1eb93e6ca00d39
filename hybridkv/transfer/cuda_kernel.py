"""Loader and launcher for the CUDA page-copy library (``src_cuda/``).

The kernels are plain CUDA with a C ABI (no torch headers), built by
``make -C src_cuda`` and opened here with cffi ABI mode (``dlopen``).  The
launcher validates everything before a launch (see ``_layout``), converts
host buffers to their mapped device addresses, puts the index arrays on the
device and launches on the caller's stream.  Any CUDA error code becomes a
``RuntimeError`` naming the error.

Library search order: ``$HYBRIDKV_CUDA_LIB``, ``hybridkv/transfer/
libhybridkv_cuda.so`` (``make -C src_cuda install``), then
``src_cuda/build/libhybridkv_cuda.so`` of a source checkout.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Optional, Union

import cffi
import torch

from ._cdesc import HEADER, fill_desc, read_cdef
from ._layout import CopyPlan

LIB_NAME = "libhybridkv_cuda.so"
ABI_VERSION = 1

# Must equal the CDEF block of src_cuda/hkv_transfer_cuda.h (tested); kept
# inline because src_cuda/ is not part of the installed package.
CUDA_CDEF = """
int hkv_cuda_copy_pages(const hkv_page_copy_t *desc, int device, void *stream, int *vec_bytes);
int hkv_cuda_device_count(int *count);
int hkv_cuda_host_device_pointer(int device, void *host, void **device_ptr);
const char *hkv_cuda_error_string(int err);
int hkv_cuda_abi_version(void);
"""

StreamLike = Union[None, int, "torch.cuda.Stream"]


class CudaError(RuntimeError):
    """A CUDA runtime error reported by the page-copy library."""

    def __init__(self, what: str, code: int, message: str) -> None:
        super().__init__(f"{what} failed with CUDA error {code}: {message}")
        self.code = code


def library_candidates() -> list[Path]:
    """Paths tried, in order, when loading the CUDA library."""
    here = Path(__file__).resolve().parent
    paths = []
    env = os.environ.get("HYBRIDKV_CUDA_LIB")
    if env:
        paths.append(Path(env))
    paths.append(here / LIB_NAME)
    paths.append(here.parent.parent / "src_cuda" / "build" / LIB_NAME)
    return paths


class CudaKernel:
    """The dlopen'ed library plus its ffi."""

    def __init__(self, path: Path) -> None:
        self.ffi = cffi.FFI()
        self.ffi.cdef(read_cdef(HEADER))
        self.ffi.cdef(CUDA_CDEF)
        self.lib = self.ffi.dlopen(str(path))
        self.path = path
        got = self.lib.hkv_cuda_abi_version()
        if got != ABI_VERSION:
            raise RuntimeError(f"{path} has ABI version {got}, expected {ABI_VERSION}; "
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

    def device_address(self, t: torch.Tensor, device: int) -> int:
        """Address of ``t``'s data as seen by kernels on ``device`` (mapped for pinned host)."""
        if t.device.type == "cuda":
            return t.data_ptr()
        out = self.ffi.new("void **")
        self.check(self.lib.hkv_cuda_host_device_pointer(
            device, self.ffi.cast("void *", t.data_ptr()), out), "cudaHostGetDevicePointer")
        return int(self.ffi.cast("uintptr_t", out[0]))

    def launch(self, plan: CopyPlan, device: int, stream: int, *, src_base: tuple[int, int],
               dst_base: tuple[int, int], src_idx: Optional[torch.Tensor],
               dst_idx: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> int:
        """Launch one page copy; returns the vector width used (bytes).

        Index/mask tensors must already be device-accessible; the caller
        keeps them alive until the stream has run the kernel.
        """
        ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        d = fill_desc(self.ffi, plan, src_idx_ptr=ptr(src_idx), dst_idx_ptr=ptr(dst_idx),
                      mask_ptr=ptr(mask), src_base=src_base, dst_base=dst_base)
        vec = self.ffi.new("int *")
        code = self.lib.hkv_cuda_copy_pages(d, device, self.ffi.cast("void *", stream), vec)
        self.check(code, "page copy kernel launch")
        return int(vec[0])


_lock = threading.Lock()
_cache: dict[str, Any] = {}


def load_cuda_kernel() -> CudaKernel:
    """Load the library (cached).  Raises ``RuntimeError`` if it is not built."""
    with _lock:
        if "kernel" in _cache:
            return _cache["kernel"]
        tried = library_candidates()
        for path in tried:
            if path.is_file():
                kernel = CudaKernel(path)
                _cache["kernel"] = kernel
                return kernel
        raise RuntimeError(
            "CUDA page-copy library not found (run `make -C src_cuda`); tried: "
            + ", ".join(str(p) for p in tried)
        )


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


def run_cuda(plan: CopyPlan, src: tuple[torch.Tensor, ...], dst: tuple[torch.Tensor, ...],
             stream: StreamLike) -> int:
    """Launch ``plan`` whose ``src``/``dst`` tensors are CUDA or pinned host.

    ``src``/``dst`` are the tensors whose ``data_ptr`` anchors the plan's
    bases (their offsets are preserved when translating host addresses).
    Returns the vector width.  Raises ``RuntimeError`` on any CUDA error.
    """
    kernel = load_cuda_kernel()
    device = next(t.device for t in src + dst if t.device.type == "cuda")
    torch_stream = resolve_stream(stream, device)
    handle = int(torch_stream.cuda_stream)
    index = device.index if device.index is not None else torch.cuda.current_device()

    def translate(tensors: tuple[torch.Tensor, ...], base: tuple[int, int]) -> tuple[int, int]:
        # Host buffers are reached through their mapped device address; the
        # offset of each base inside its tensor is preserved.
        if tensors[0].device.type == "cuda":
            return base
        anchors = tensors if len(tensors) == 2 else (tensors[0], tensors[0])
        k_addr, v_addr = (kernel.device_address(a, index) + b - a.data_ptr()
                          for a, b in zip(anchors, base))
        return k_addr, v_addr

    src_base = translate(src, plan.src.base)
    dst_base = translate(dst, plan.dst.base)
    with torch.cuda.device(device):
        with torch.cuda.stream(torch_stream):
            on_dev = [None if t is None else t.to(device, non_blocking=True)
                      for t in (plan.src_idx, plan.dst_idx, plan.mask)]
            vec = kernel.launch(plan, index, handle, src_base=src_base, dst_base=dst_base,
                                src_idx=on_dev[0], dst_idx=on_dev[1], mask=on_dev[2])
            # The index copies are freed by the caching allocator only after
            # the stream has passed this point.
            for t in on_dev:
                if t is not None:
                    t.record_stream(torch_stream)
    return vec
