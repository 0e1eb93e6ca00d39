"""CUDA page-copy library: build, load, error path here; bitwise kernels on a GPU.

On a machine without a GPU the library must still build (nvcc) and load
(cffi dlopen); calling into it must give a clear RuntimeError.  The kernel
correctness tests need a device and skip with "no CUDA device" otherwise;
src_cuda/device_check.sh runs them on a GPU machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from _transfer_helpers import GPU_EXAMPLES, DTYPES, assert_bitwise_equal, kv_pair
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.transfer import copy_pages, pack_pages, unpack_pages
from hybridkv.transfer import cuda_kernel as ck
from hybridkv.transfer._cdesc import read_cdef
from hybridkv.transfer._layout import CopyPlan, buffer_side

REPO = Path(__file__).resolve().parents[2]
HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
no_gpu_only = pytest.mark.skipif(
    HAS_CUDA, reason="checks the no-driver error path; a GPU is present")


@pytest.fixture(scope="module")
def cuda_lib(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Build src_cuda into a temp dir and point the loader at it."""
    if shutil.which(os.environ.get("NVCC", "nvcc")) is None:
        pytest.skip("nvcc not found (CI installs the CUDA toolkit)")
    build = tmp_path_factory.mktemp("cuda_build")
    proc = subprocess.run(["make", "-C", str(REPO / "src_cuda"), f"BUILD={build}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lib = build / ck.LIB_NAME
    assert lib.is_file()
    old = os.environ.get("HYBRIDKV_CUDA_LIB")
    os.environ["HYBRIDKV_CUDA_LIB"] = str(lib)
    ck.reset_cuda_kernel_cache()
    yield lib
    if old is None:
        os.environ.pop("HYBRIDKV_CUDA_LIB", None)
    else:
        os.environ["HYBRIDKV_CUDA_LIB"] = old
    ck.reset_cuda_kernel_cache()


def test_library_builds_and_loads(cuda_lib: Path) -> None:
    kernel = ck.load_cuda_kernel()
    assert kernel.path == cuda_lib
    assert kernel.lib.hkv_cuda_abi_version() == ck.ABI_VERSION
    assert "no error" in kernel.error_string(0)


def test_python_cdef_matches_header() -> None:
    norm = lambda s: re.sub(r"\s+", " ", s).strip()  # noqa: E731
    assert norm(read_cdef(REPO / "src_cuda" / "hkv_transfer_cuda.h")) == norm(ck.CUDA_CDEF)


def test_missing_library_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(ck, "library_candidates", lambda: [tmp_path / "nope.so"])
    monkeypatch.setenv("HYBRIDKV_CUDA_BUILD", "0")
    ck.reset_cuda_kernel_cache()
    try:
        with pytest.raises(RuntimeError, match="make -C src_cuda.*HYBRIDKV_CUDA_BUILD=0"):
            ck.load_cuda_kernel()
        # the outcome is cached: the second call fails the same way, fast
        with pytest.raises(RuntimeError, match="nope.so"):
            ck.load_cuda_kernel()
    finally:
        ck.reset_cuda_kernel_cache()


def test_library_is_built_on_first_use_from_the_sources(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    """What a ``pip install`` on a GPU machine gets: no prebuilt library, so the
    installed sources are built with the machine's nvcc into the user cache."""
    if ck.find_nvcc() is None:
        pytest.skip("nvcc not found: the first-use build needs it")
    assert ck.source_dir() is not None
    monkeypatch.setattr(ck, "library_candidates", lambda: [tmp_path / "absent.so"])
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path / "cache"))
    ck.reset_cuda_kernel_cache()
    try:
        kernel = ck.load_cuda_kernel()
        assert kernel.path.parent == tmp_path / "cache" and kernel.how.startswith("built with")
        assert kernel.lib.hkv_cuda_abi_version() == ck.ABI_VERSION
        # a library of another ABI is skipped, not loaded
        stale = tmp_path / "stale.so"
        stale.write_bytes(b"not a library")
        monkeypatch.setattr(ck, "library_candidates", lambda: [stale])
        ck.reset_cuda_kernel_cache()
        assert ck.load_cuda_kernel().path == kernel.path  # rebuilt? no: the cached build
    finally:
        ck.reset_cuda_kernel_cache()


@no_gpu_only
def test_device_query_without_driver_raises_runtime_error(cuda_lib: Path) -> None:
    kernel = ck.load_cuda_kernel()
    with pytest.raises(RuntimeError, match=r"cudaGetDeviceCount failed with CUDA error") as ei:
        kernel.device_count()
    # 35 = cudaErrorInsufficientDriver (no driver), 100 = cudaErrorNoDevice.
    assert ei.value.code in (35, 100)


@no_gpu_only
def test_launch_without_driver_raises_and_writes_nothing(cuda_lib: Path,
                                                         gen: torch.Generator) -> None:
    # Without a driver the runtime refuses the launch before touching memory,
    # so handing it host addresses is harmless here (never done on a GPU box).
    kernel = ck.load_cuda_kernel()
    sk, sv = kv_pair(2, 8, 2, 8, 8, torch.float16, gen)
    dk, dv = torch.zeros_like(sk), torch.zeros_like(sv)
    run = (2 * 2 * 8 * 2,) * 2
    plan = CopyPlan(n_pages=2, src_idx=None, dst_idx=None, mask=None, layer_begin=0,
                    layer_end=2, run_bytes=run, src=buffer_side(sk, sv, 2, 4),
                    dst=buffer_side(dk, dv, 2, 4))
    with pytest.raises(RuntimeError, match="page copy kernel launch failed with CUDA error"):
        kernel.launch(plan, 0, 0, src_base=plan.src.base, dst_base=plan.dst.base,
                      src_idx=None, dst_idx=None, mask=None)
    assert not dk.any() and not dv.any()


def test_cuda_backend_rejects_cpu_only_tensors(gen: torch.Generator) -> None:
    sk, sv = kv_pair(1, 4, 1, 2, 2, torch.float32, gen)
    with pytest.raises(ValueError, match="needs at least one tensor on a CUDA device"):
        copy_pages(sk, sv, sk.clone(), sv.clone(), [0], [1], 2, backend="cuda")


def test_stream_argument_is_type_checked() -> None:
    for bad in ("s0", True, 1.5):
        with pytest.raises(TypeError, match="stream must be"):
            ck.resolve_stream(bad, torch.device("cuda"))  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Kernel correctness: needs a GPU.
# --------------------------------------------------------------------------

GPU_SETTINGS = settings(max_examples=GPU_EXAMPLES, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow,
                                               HealthCheck.function_scoped_fixture])


def _place(t: torch.Tensor, where: str) -> torch.Tensor:
    return t.cuda() if where == "cuda" else t.pin_memory()


@st.composite
def gpu_cases(draw: st.DrawFn) -> dict:
    layers, ps = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4, 16]))
    p_src, p_dst = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    n = draw(st.integers(0, min(p_src, p_dst)))
    return dict(
        layers=layers, ps=ps, p_src=p_src, p_dst=p_dst,
        heads=draw(st.integers(1, 3)), k_dim=draw(st.sampled_from([1, 3, 8, 64])),
        v_dim=draw(st.sampled_from([1, 5, 8, 64])), dtype=draw(st.sampled_from(DTYPES)),
        src_pages=draw(st.lists(st.integers(0, p_src - 1), min_size=n, max_size=n)),
        dst_pages=draw(st.permutations(list(range(p_dst))))[:n],
        mask=draw(st.none() | st.lists(st.booleans(), min_size=n, max_size=n)),
        where=draw(st.sampled_from([("cuda", "cuda"), ("pinned", "cuda"), ("cuda", "pinned")])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@needs_gpu
@GPU_SETTINGS
@given(c=gpu_cases())
def test_cuda_copy_matches_reference_bitwise(cuda_lib: Path, c: dict) -> None:
    g = torch.Generator().manual_seed(c["seed"])
    geo = (c["heads"], c["k_dim"], c["v_dim"], c["dtype"], g)
    sk, sv = kv_pair(c["layers"], c["p_src"] * c["ps"], *geo)
    dk, dv = kv_pair(c["layers"], c["p_dst"] * c["ps"], *geo)
    rk, rv = dk.clone(), dv.clone()
    copy_pages(sk, sv, rk, rv, c["src_pages"], c["dst_pages"], c["ps"], mask=c["mask"],
               backend="torch")
    s_where, d_where = c["where"]
    sk, sv = _place(sk.contiguous(), s_where), _place(sv.contiguous(), s_where)
    dk, dv = _place(dk.contiguous(), d_where), _place(dv.contiguous(), d_where)
    stream = torch.cuda.Stream()
    assert copy_pages(sk, sv, dk, dv, c["src_pages"], c["dst_pages"], c["ps"],
                      mask=c["mask"], backend="cuda", stream=stream) == "cuda"
    stream.synchronize()
    assert_bitwise_equal(dk, rk, "K")
    assert_bitwise_equal(dv, rv, "V")


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("staging_where", ["cuda", "pinned"])
def test_cuda_pack_unpack_match_reference(cuda_lib: Path, dtype: torch.dtype,
                                          staging_where: str, gen: torch.Generator) -> None:
    sk, sv = kv_pair(3, 32 * 16, 4, 24, 16, dtype, gen)
    pages = torch.randperm(32, generator=gen)[:12]
    ref = pack_pages(sk, sv, pages, 16, backend="torch")
    gk, gv = sk.cuda(), sv.cuda()
    out = _place(torch.empty_like(ref), staging_where)
    pack_pages(gk, gv, pages, 16, out=out, backend="cuda")
    torch.cuda.synchronize()
    assert_bitwise_equal(out, ref, "pack")
    zk, zv = torch.zeros_like(gk), torch.zeros_like(gv)
    unpack_pages(out, zk, zv, pages, 16, backend="cuda")
    rk, rv = torch.zeros_like(sk), torch.zeros_like(sv)
    unpack_pages(ref, rk, rv, pages, 16, backend="torch")
    torch.cuda.synchronize()
    assert_bitwise_equal(zk, rk, "unpack K")
    assert_bitwise_equal(zv, rv, "unpack V")


@needs_gpu
@pytest.mark.parametrize("dim, ps, want", [(64, 2, 16), (3, 2, 4), (3, 1, 2)])
def test_vector_width_falls_back_when_misaligned(cuda_lib: Path, dim: int, ps: int, want: int,
                                                 gen: torch.Generator) -> None:
    # fp16, 1 head: a run is ps*dim*2 bytes -> 256 (16-byte access), 12 (4), 6 (2).
    kernel = ck.load_cuda_kernel()
    sk, sv = (t.cuda() for t in kv_pair(1, 8, 1, dim, dim, torch.float16, gen))
    dk, dv = torch.zeros_like(sk), torch.zeros_like(sv)
    run = (ps * dim * 2,) * 2
    limit = 8 // ps
    plan = CopyPlan(n_pages=2, src_idx=None, dst_idx=None, mask=None, layer_begin=0,
                    layer_end=1, run_bytes=run, src=buffer_side(sk, sv, ps, limit),
                    dst=buffer_side(dk, dv, ps, limit))
    vec = kernel.launch(plan, torch.cuda.current_device(),
                        torch.cuda.current_stream().cuda_stream,
                        src_base=plan.src.base, dst_base=plan.dst.base,
                        src_idx=None, dst_idx=None, mask=None)
    torch.cuda.synchronize()
    assert vec == want
    assert_bitwise_equal(dk[:, : 2 * ps], sk[:, : 2 * ps])
    assert not dk[:, 2 * ps:].any()


@needs_gpu
def test_cuda_backend_rejects_pageable_host(cuda_lib: Path, gen: torch.Generator) -> None:
    sk, sv = kv_pair(1, 4, 1, 2, 2, torch.float32, gen)
    dk, dv = torch.zeros_like(sk).cuda(), torch.zeros_like(sv).cuda()
    with pytest.raises(ValueError, match="src_k is pageable host memory"):
        copy_pages(sk, sv, dk, dv, [0], [1], 2, backend="cuda")
    # auto falls back to the torch reference for pageable memory.
    assert copy_pages(sk, sv, dk, dv, [0], [1], 2) == "torch"


def test_a_wheel_ships_the_cuda_sources(tmp_path: Path) -> None:
    """``pip install`` (no checkout) must still be able to build the library:
    setup.py's build_py puts the sources in hybridkv/transfer/cuda/."""
    import zipfile
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.skip(f"cannot build a wheel here: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr
    names = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist()
    for name in ck.CUDA_SOURCES:
        assert f"hybridkv/transfer/cuda/{name}" in names


def test_info_says_which_copy_path_runs() -> None:
    from hybridkv.transfer import describe_paths
    paths = describe_paths()
    assert set(paths) >= {"cpu<->cpu", "cuda_library", "host<->device", "device<->device"}
    if paths["cuda_library"].startswith("unavailable"):
        assert paths["host<->device"].startswith("torch")
    else:
        assert paths["host<->device"].startswith("copy engines")
