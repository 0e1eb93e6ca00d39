"""Prepared copies: the plan a GPU runs, checked byte for byte on the CPU.

The copy-engine path hands the driver a list of coalesced byte runs.  The
same runs are built here from CPU tensors (``dry_run=True``) and executed by
``memcpy`` (``run_on_host``): they must reproduce the torch reference
exactly, for any layout, mask, layer range and grouping.  The issue path
itself (one C call per layer) runs with the launch stubbed.  GPU tests at the
end run the real copy engines and the SM kernel (skipped without a device).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from _transfer_helpers import GPU_EXAMPLES, DTYPES, assert_bitwise_equal, kv_pair
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.pools import KVArena
from hybridkv.pools.arena import ArenaLayout
from hybridkv.spec import KVShape, ModelSpec
from hybridkv.transfer import (LayerwiseLoader, arena_layer_jobs, copy_pages, pack_pages,
                               prepare_copy, prepare_pack, prepare_unpack, unpack_pages)
from hybridkv.transfer.runs import coalesce

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def copy_cases(draw: st.DrawFn) -> dict:
    layers, ps = draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 4]))
    p_src, p_dst = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    n = draw(st.integers(0, min(p_src, p_dst)))
    lb = draw(st.integers(0, layers))
    return dict(
        layers=layers, ps=ps, p_src=p_src, p_dst=p_dst, heads=draw(st.integers(1, 3)),
        k_dim=draw(st.sampled_from([1, 3, 8])), v_dim=draw(st.sampled_from([0, 2, 8])),
        dtype=draw(st.sampled_from(DTYPES)), pad=draw(st.sampled_from([0, 3])),
        src_pages=draw(st.lists(st.integers(0, p_src - 1), min_size=n, max_size=n)),
        dst_pages=draw(st.permutations(list(range(p_dst))))[:n],
        mask=draw(st.none() | st.lists(st.booleans(), min_size=n, max_size=n)),
        span=(lb, draw(st.integers(lb, layers))), by_layer=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@SETTINGS
@given(c=copy_cases())
def test_dma_runs_reproduce_the_reference_bitwise(c: dict) -> None:
    g = torch.Generator().manual_seed(c["seed"])
    geo = (c["heads"], c["k_dim"], c["v_dim"], c["dtype"], g)
    sk, sv = kv_pair(c["layers"], c["p_src"] * c["ps"], *geo, pad_slots=c["pad"])
    dk, dv = kv_pair(c["layers"], c["p_dst"] * c["ps"], *geo, pad_slots=c["pad"])
    rk, rv = dk.clone(), dv.clone()
    args = (c["src_pages"], c["dst_pages"], c["ps"])
    copy_pages(sk, sv, rk, rv, *args, mask=c["mask"], layers=c["span"], backend="torch")
    plan = prepare_copy(sk, sv, dk, dv, *args, mask=c["mask"], layers=c["span"],
                        by_layer=c["by_layer"], dry_run=True)
    assert (plan.backend, plan.path) == ("dry-run", "dma")
    plan.issue()  # the stubbed launch writes nothing
    plan.run_on_host()
    assert_bitwise_equal(dk, rk, "K")
    assert_bitwise_equal(dv, rv, "V")


def test_runs_merge_where_both_sides_are_contiguous() -> None:
    u = lambda *x: np.array(x, dtype=np.uint64)  # noqa: E731
    d, s, z, first = coalesce(u(100, 110, 200), u(0, 10, 20), u(10, 10, 5))
    assert d.tolist() == [100, 200] and s.tolist() == [0, 20] and z.tolist() == [20, 5]
    # never across a group (layer) boundary
    d, s, z, first = coalesce(u(100, 110), u(0, 10), u(10, 10), np.array([0, 1]))
    assert z.tolist() == [10, 10] and first.tolist() == [0, 1]


def _arenas(pages: int) -> tuple[KVArena, KVArena, object]:
    kinds = ["full", "swa", "swa", "swa", "full", "swa", "swa"]
    spec = ModelSpec("t", kinds, 16, full=KVShape(2, 8, 6), swa=KVShape(4, 8, 6),
                     dtype="bfloat16", page_size=4)
    layout = ArenaLayout.for_spec(spec)
    per = layout.page_bytes("full") + layout.page_bytes("swa")
    blocks = pages * per // layout.block_bytes
    a = KVArena(spec, layout, blocks, pages, pages, "cpu")
    b = KVArena(spec, layout, blocks, pages, pages, "cpu")
    return a, b, spec


def test_a_whole_arena_page_copy_is_one_run_per_block_span() -> None:
    """Whole-page tier copies move blocks: K and V of every layer slot sit side
    by side in a block, and consecutive blocks merge, so a copy of pages whose
    blocks are consecutive on both sides is a handful of runs."""
    src, dst, spec = _arenas(8)
    pages = np.arange(4)
    for arena in (src, dst):
        arena.assign("full", pages)
    s, d = src.full, dst.full
    plan = prepare_copy(s.k, s.v, d.k, d.v, s.blocks(pages), d.blocks(pages), 4, dry_run=True)
    runs = plan._exec.runs  # noqa: SLF001 - the run list is what this test is about
    assert runs.count == 1 and runs.nbytes == plan.nbytes


def test_issue_cost_per_layer_with_the_launch_stubbed() -> None:
    """A prepared layer issues in one C call: a generous bound here (the
    benchmark prints the real figure); the old path validated every call."""
    gen = torch.Generator().manual_seed(0)
    sk, sv = kv_pair(8, 64 * 16, 4, 64, 32, torch.bfloat16, gen)
    dk, dv = torch.zeros_like(sk), torch.zeros_like(sv)
    pages = torch.randperm(64, generator=gen)
    plan = prepare_copy(sk, sv, dk, dv, pages, torch.arange(64), 16, by_layer=True, dry_run=True)
    t0 = time.perf_counter()
    for _ in range(50):
        for layer in range(8):
            plan.issue_layer(layer, 0, 0)
    per_layer_us = (time.perf_counter() - t0) / 400 * 1e6
    assert per_layer_us < 200, per_layer_us  # ~1-3 us on an idle core
    assert not dk.any()  # stubbed: nothing written


def test_prepare_validates_once_and_names_the_argument() -> None:
    gen = torch.Generator().manual_seed(0)
    sk, sv = kv_pair(2, 8, 1, 4, 4, torch.float32, gen)
    dk, dv = torch.zeros_like(sk), torch.zeros_like(sv)
    with pytest.raises(ValueError, match="cuda_path must be one of"):
        prepare_copy(sk, sv, dk, dv, [0], [1], 2, cuda_path="sm")
    with pytest.raises(ValueError, match="max_blocks must be >= 1"):
        prepare_copy(sk, sv, dk, dv, [0], [1], 2, max_blocks=0)
    with pytest.raises(ValueError, match="dst_pages holds page 9"):
        prepare_copy(sk, sv, dk, dv, [0], [9], 2)
    plan = prepare_copy(sk, sv, dk, dv, [0, 1], [1, 2], 2, layers=(0, 2), by_layer=False)
    with pytest.raises(ValueError, match="prepared whole"):
        plan.issue(layers=(0, 1))
    layered = prepare_copy(sk, sv, dk, dv, [0, 1], [1, 2], 2, layers=(1, 2), by_layer=True)
    with pytest.raises(ValueError, match="not within the plan's layers"):
        layered.issue(layers=(0, 1))
    assert not dk.any() and not dv.any()
    layered.issue(layers=(1, 2))
    assert dk[1].any() and not dk[0].any()
    assert layered.backend in ("host", "torch") and layered.nbytes == 2 * 2 * 4 * 4 * 2


def test_prepared_host_plan_reissues_the_same_copy() -> None:
    gen = torch.Generator().manual_seed(3)
    sk, sv = kv_pair(3, 16, 2, 8, 8, torch.float16, gen)
    dk, dv = torch.zeros_like(sk), torch.zeros_like(sv)
    plan = prepare_copy(sk, sv, dk, dv, [3, 1], [0, 2], 4, by_layer=True)
    for layer in range(3):
        plan.issue_layer(layer)
    rk, rv = torch.zeros_like(sk), torch.zeros_like(sv)
    copy_pages(sk, sv, rk, rv, [3, 1], [0, 2], 4, backend="torch")
    assert_bitwise_equal(dk, rk)
    assert_bitwise_equal(dv, rv)


def test_pack_unpack_plans_match_the_functions() -> None:
    gen = torch.Generator().manual_seed(5)
    sk, sv = kv_pair(3, 8 * 4, 2, 6, 4, torch.bfloat16, gen)
    pages = [5, 0, 7]
    plan, rows = prepare_pack(sk, sv, pages, 4)
    plan.issue()
    assert_bitwise_equal(rows, pack_pages(sk, sv, pages, 4, backend="torch"))
    dry, staging = prepare_pack(sk, sv, pages, 4, dry_run=True)
    dry.run_on_host()
    assert_bitwise_equal(staging, rows)
    zk, zv = torch.zeros_like(sk), torch.zeros_like(sv)
    prepare_unpack(rows, zk, zv, pages, 4, dry_run=True).run_on_host()
    rk, rv = torch.zeros_like(sk), torch.zeros_like(sv)
    unpack_pages(rows, rk, rv, pages, 4, backend="torch")
    assert_bitwise_equal(zk, rk)
    assert_bitwise_equal(zv, rv)


def test_loader_dry_run_issues_every_layer_from_plans() -> None:
    src, dst, spec = _arenas(8)
    for arena in (src, dst):
        arena.assign("full", np.arange(3))
        arena.assign("swa", np.arange(2))
    kinds = [k.value for k in spec.layer_kinds]
    pages = {"full": (np.arange(3), np.arange(3)), "swa": (np.arange(2), np.arange(2))}
    loader = LayerwiseLoader(arena_layer_jobs(kinds, src, dst, pages), dry_run=True).start()
    for layer in range(len(kinds)):
        loader.wait(layer)
    # one plan per (kind, block group), not one per layer
    groups = {(k, src.of(k).layout.group_of(j)[0]) for k in ("full", "swa")
              for j in range(len(spec.layers(k)))}
    assert len(loader._plans) == len(groups) < len(kinds)  # noqa: SLF001
    assert loader.issue_seconds > 0


# --------------------------------------------------------------------------
# On a GPU: the copy engines and the SM kernel against the reference.
# --------------------------------------------------------------------------


@needs_gpu
@settings(max_examples=GPU_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=copy_cases(), path=st.sampled_from(["dma", "kernel"]),
       where=st.sampled_from([("pinned", "cuda"), ("cuda", "pinned"), ("cuda", "cuda")]))
def test_gpu_paths_match_the_reference(c: dict, path: str, where: tuple[str, str]) -> None:
    g = torch.Generator().manual_seed(c["seed"])
    geo = (c["heads"], c["k_dim"], c["v_dim"], c["dtype"], g)
    sk, sv = (t.contiguous() for t in kv_pair(c["layers"], c["p_src"] * c["ps"], *geo))
    dk, dv = (t.contiguous() for t in kv_pair(c["layers"], c["p_dst"] * c["ps"], *geo))
    rk, rv = dk.clone(), dv.clone()
    args = (c["src_pages"], c["dst_pages"], c["ps"])
    copy_pages(sk, sv, rk, rv, *args, mask=c["mask"], layers=c["span"], backend="torch")
    place = lambda t, w: t.cuda() if w == "cuda" else t.pin_memory()  # noqa: E731
    sk, sv = place(sk, where[0]), place(sv, where[0])
    dk, dv = place(dk, where[1]), place(dv, where[1])
    stream = torch.cuda.Stream()
    plan = prepare_copy(sk, sv, dk, dv, *args, mask=c["mask"], layers=c["span"],
                        by_layer=c["by_layer"], cuda_path=path,
                        max_blocks=4 if path == "kernel" else None)
    assert (plan.backend, plan.path) == ("cuda", path)
    lb, le = c["span"]
    if c["by_layer"]:
        for layer in range(lb, le):
            plan.issue(layers=(layer, layer + 1), stream=stream)
    else:
        plan.issue(stream=stream)
    stream.synchronize()
    assert_bitwise_equal(dk, rk, "K")
    assert_bitwise_equal(dv, rv, "V")


@needs_gpu
def test_auto_path_is_dma_beside_the_host_and_kernel_on_the_device() -> None:
    gen = torch.Generator().manual_seed(0)
    sk, sv = kv_pair(2, 16, 2, 8, 8, torch.float16, gen)
    gk, gv = sk.cuda(), sv.cuda()
    hk, hv = sk.pin_memory(), sv.pin_memory()
    assert prepare_copy(hk, hv, gk, gv, [0], [1], 4).path == "dma"
    assert prepare_copy(gk, gv, hk, hv, [0], [1], 4).path == "dma"
    assert prepare_copy(gk, gv, gk.clone(), gv.clone(), [0], [1], 4).path == "kernel"
    # the legacy default stream: the batch runs on a side stream, fenced
    dk, dv = torch.zeros_like(gk), torch.zeros_like(gv)
    copy_pages(hk, hv, dk, dv, [0, 1, 2, 3], [3, 2, 1, 0], 4)
    torch.cuda.synchronize()
    assert_bitwise_equal(dk[:, 12:16].cpu(), sk[:, 0:4])


# --------------------------------------------------------------------------
# Engine block rows (a vLLM-style {layer: tensor} cache <-> page payload rows)
# --------------------------------------------------------------------------


@st.composite
def block_cases(draw: st.DrawFn) -> dict:
    nb = draw(st.integers(1, 6))
    layers = []
    for _ in range(draw(st.integers(1, 3))):
        outer = draw(st.lists(st.integers(1, 3), max_size=2))
        inner = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
        layers.append((outer, inner))
    n = draw(st.integers(0, nb))
    return dict(nb=nb, layers=layers, blocks=draw(st.permutations(list(range(nb))))[:n],
                dtype=draw(st.sampled_from([torch.float16, torch.float32])),
                seed=draw(st.integers(0, 2**31 - 1)))


def _engine_tensors(c: dict, gen: torch.Generator) -> tuple[list[torch.Tensor], list[int]]:
    from _transfer_helpers import random_bits
    tensors, dims = [], []
    for outer, inner in c["layers"]:
        tensors.append(random_bits((*outer, c["nb"], *inner), c["dtype"], gen))
        dims.append(len(outer))
    return tensors, dims


@SETTINGS
@given(c=block_cases())
def test_block_rows_gather_and_scatter_match_torch(c: dict) -> None:
    from hybridkv.transfer import prepare_block_rows
    gen = torch.Generator().manual_seed(c["seed"])
    tensors, dims = _engine_tensors(c, gen)
    n = len(c["blocks"])
    width = sum(t.select(d, 0).numel() for t, d in zip(tensors, dims))
    rows = torch.zeros(n, width, dtype=c["dtype"])
    ref = torch.zeros_like(rows)
    prepare_block_rows(tensors, dims, c["blocks"], ref, to_rows=True, backend="torch").issue()
    plan = prepare_block_rows(tensors, dims, c["blocks"], rows, to_rows=True)
    assert plan.path in ("host", "torch")
    plan.issue()
    assert_bitwise_equal(rows, ref, "gather")
    want = [t.select(d, c["blocks"][0]).reshape(-1) for t, d in zip(tensors, dims)] if n else []
    if n:
        assert_bitwise_equal(rows[0], torch.cat(want))
    # scatter the rows into zeroed copies: the gathered blocks come back, nothing else
    back = [torch.zeros_like(t) for t in tensors]
    dry = prepare_block_rows(back, dims, c["blocks"], rows, to_rows=False, dry_run=True)
    dry.run_on_host()
    for t, b, d in zip(tensors, back, dims):
        for blk in range(c["nb"]):
            got, orig = b.select(d, blk), t.select(d, blk)
            if blk in c["blocks"]:
                assert_bitwise_equal(got, orig)
            else:
                assert not got.view(torch.uint8).any()


def test_block_rows_validate_their_arguments() -> None:
    from hybridkv.transfer import prepare_block_rows
    t = torch.zeros(2, 4, 3)
    rows = torch.zeros(2, 6)
    with pytest.raises(ValueError, match="block_dims must list one"):
        prepare_block_rows([t], [1, 1], [0, 1], rows, to_rows=True)
    with pytest.raises(ValueError, match="blocks holds page 4"):
        prepare_block_rows([t], [1], [0, 4], rows, to_rows=True)
    with pytest.raises(ValueError, match="blocks holds a page more than once"):
        prepare_block_rows([t], [1], [1, 1], rows, to_rows=False)
    with pytest.raises(ValueError, match=r"tensors\[0\] must be dense after its block dim"):
        prepare_block_rows([t.transpose(1, 2)], [0], [0, 1], rows, to_rows=True)
    with pytest.raises(ValueError, match="rows hold 32 bytes per block"):
        prepare_block_rows([t], [1], [0, 1], torch.zeros(2, 8), to_rows=True)
    with pytest.raises(TypeError, match=r"tensors\[0\] must be a torch.Tensor"):
        prepare_block_rows([object()], [0], [0], rows, to_rows=True)  # type: ignore[list-item]
