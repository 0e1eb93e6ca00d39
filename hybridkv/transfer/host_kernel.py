"""The C host kernel (``host_copy.c``): build on first use, load, run.

The source is compiled through cffi API mode into a per-user cache directory
keyed by a hash of everything that affects the binary (source, header,
flags, cffi version, Python ABI), so an edited source or another Python gets
its own build and concurrent first uses do not clash (each builds in a
private temp dir and publishes with an atomic ``os.replace``).

Cache directory: ``$HYBRIDKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/hybridkv``,
else ``~/.cache/hybridkv``.  ``HYBRIDKV_DISABLE_HOST_KERNEL=1`` skips the
kernel (the torch reference runs instead).  ``HYBRIDKV_HOST_THREADS`` caps
the OpenMP threads (default: the CPUs this process may run on).

If no compiler works, :func:`load_host_kernel` returns ``None`` once with a
logged warning and callers fall back to the torch reference.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

import cffi

from ._cdesc import HEADER, fill_desc, read_cdef
from ._layout import CopyPlan

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("host_copy.c")
#: Compiled into the same module (one build, one cache entry): the NH64 checksum.
CHECKSUM_SOURCE = Path(__file__).with_name("checksum.c")
_OPT_FLAGS = ["-O3", "-std=c11"]
_OMP_FLAGS = ["-fopenmp"]


def cache_dir() -> Path:
    """Directory for built kernels (created on demand)."""
    env = os.environ.get("HYBRIDKV_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hybridkv"


def default_threads() -> int:
    """OpenMP threads for host copies: the usable CPUs, capped by the env."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    cap = os.environ.get("HYBRIDKV_HOST_THREADS")
    if cap and cap.isdigit() and int(cap) > 0:
        n = min(n, int(cap))
    return max(1, n)


class HostKernel:
    """A loaded build of ``host_copy.c``."""

    def __init__(self, module: Any, path: Path) -> None:
        self.ffi = module.ffi
        self.lib = module.lib
        self.path = path
        self.openmp = bool(self.lib.hkv_host_openmp_enabled())

    def desc(self, plan: CopyPlan) -> Any:
        """A ``hkv_page_copy_t *`` for ``plan`` (host addresses; the caller
        keeps ``plan``'s index tensors alive while it is used)."""
        ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        return fill_desc(self.ffi, plan, src_idx_ptr=ptr(plan.src_idx),
                         dst_idx_ptr=ptr(plan.dst_idx), mask_ptr=ptr(plan.mask),
                         src_base=plan.src.base, dst_base=plan.dst.base)

    def run(self, plan: CopyPlan, num_threads: Optional[int] = None,
            store_mode: int = -1) -> None:
        """Execute ``plan`` on host memory.  Releases the GIL for the copy.

        ``store_mode``: -1 = automatic (streaming stores for calls of 4 MiB
        and more), 0 = memcpy, 1 = SSE2 streaming, 2 = AVX streaming; tests
        pin each path.  Raises ``RuntimeError`` if the C side rejects the
        plan (it re-checks every index before writing, as a second line of
        defence) or the mode is unsupported here.
        """
        rc = self.lib.hkv_host_copy_pages_mode(self.desc(plan), num_threads or default_threads(),
                                               store_mode)
        if rc != 0:
            raise RuntimeError(f"host page copy rejected its arguments (code {rc})")

    def nh64(self, payloads: list[memoryview], num_threads: Optional[int] = None,
             simd: int = -1) -> list[int]:
        """NH64 checksums of byte buffers (see ``checksum.c``), GIL released.

        Parallel over all threads inside and across payloads from 1 MiB per
        call.  ``simd``: -1 = the best this CPU has, 0 = portable loop,
        1 = at most AVX2, 2 = at most AVX-512 (all give the same values).
        """
        n = len(payloads)
        if n == 0:
            return []
        ffi = self.ffi
        keep = [ffi.from_buffer("uint8_t[]", p) for p in payloads]
        ptrs = ffi.new("uint8_t *[]", keep)
        lens = ffi.new("uint64_t[]", [len(k) for k in keep])
        out = ffi.new("uint64_t[]", n)
        rc = self.lib.hkv_nh64_batch(ptrs, lens, out, n, num_threads or default_threads(), simd)
        if rc != 0:
            raise RuntimeError(f"NH64 checksum failed (code {rc})")
        return list(out)

    def pread_nh64(self, fd: int, buf: memoryview, offset: int) -> tuple[int, int]:
        """Read ``len(buf)`` bytes of ``fd`` at ``offset`` into ``buf``, hashing
        each 1 MiB chunk while it is in cache; ``(bytes read, NH64 of them)``.
        GIL released; raises ``OSError`` on a read error."""
        out = self.ffi.new("uint64_t *")
        got = self.lib.hkv_pread_nh64(fd, self.ffi.from_buffer("uint8_t[]", buf), len(buf), offset, out)
        if got < 0:
            raise OSError(-got, os.strerror(-got))
        return int(got), int(out[0])

    def nh64_accumulate(self, data: memoryview, first_stripe: int, acc: Any) -> None:
        """Add whole 64-byte stripes of ``data`` (from stripe index
        ``first_stripe``) into ``acc`` (a cffi ``uint64_t[8]``).  GIL released."""
        buf = self.ffi.from_buffer("uint8_t[]", data)
        if self.lib.hkv_nh64_accumulate(buf, len(buf), first_stripe, acc, -1) != 0:
            raise RuntimeError("NH64 accumulate: length must be a multiple of 64")


def _build_key(flags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), CHECKSUM_SOURCE.read_bytes(), HEADER.read_bytes(),
                 " ".join(flags).encode(),
                 cffi.__version__.encode(), (sysconfig.get_config_var("EXT_SUFFIX") or "").encode(),
                 os.environ.get("CC", "").encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _import_built(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(flags: list[str], link: list[str]) -> HostKernel:
    name = f"_hybridkv_host_{_build_key(flags + link)}"
    out_dir = cache_dir()
    target = out_dir / (name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    if not target.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        ffi = cffi.FFI()
        ffi.cdef(read_cdef(HEADER))
        ffi.set_source(name, SOURCE.read_text() + "\n" + CHECKSUM_SOURCE.read_text(),
                       include_dirs=[str(HEADER.parent)],
                       extra_compile_args=flags, extra_link_args=link)
        with tempfile.TemporaryDirectory(dir=out_dir, prefix="build-") as tmp:
            built = Path(ffi.compile(tmpdir=tmp, verbose=False))
            os.replace(built, target)
    return HostKernel(_import_built(name, target), target)


_lock = threading.Lock()
_loaded: dict[str, Optional[HostKernel]] = {}


def load_host_kernel() -> Optional[HostKernel]:
    """Return the host kernel, building it on first use; ``None`` if unavailable.

    Thread-safe; the outcome (kernel or ``None``) is cached for the process.
    """
    if os.environ.get("HYBRIDKV_DISABLE_HOST_KERNEL") == "1":
        return None
    with _lock:
        if "kernel" in _loaded:
            return _loaded["kernel"]
        kernel: Optional[HostKernel] = None
        errors = []
        for flags, link in ((_OPT_FLAGS + _OMP_FLAGS, _OMP_FLAGS), (_OPT_FLAGS, [])):
            try:
                kernel = _build(flags, link)
                break
            except Exception as exc:  # compiler missing/broken: try the next recipe
                errors.append(f"{' '.join(flags)}: {exc}")
        if kernel is None:
            log.warning("hybridkv host copy kernel unavailable, using the torch "
                        "reference instead (%s)", "; ".join(errors))
        elif not kernel.openmp:
            log.warning("hybridkv host copy kernel built without OpenMP (single thread)")
        _loaded["kernel"] = kernel
        return kernel


def reset_host_kernel_cache() -> None:
    """Forget the loaded kernel so the next use rebuilds/reloads (for tests)."""
    with _lock:
        _loaded.clear()


__all__ = ["HostKernel", "cache_dir", "default_threads", "load_host_kernel",
           "reset_host_kernel_cache"]
