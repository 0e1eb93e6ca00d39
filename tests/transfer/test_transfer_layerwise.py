"""Layerwise prefetch: a layer is never read before its load completed."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _transfer_helpers import assert_bitwise_equal, bits, kv_pair

from hybridkv.transfer import LayerJob, LayerwiseLoader, PageCopy, copy_pages, model_layer_jobs

PS = 4
KINDS = ["full", "swa", "swa", "full", "swa", "swa"]


def _pools(gen: torch.Generator, device: str = "cpu") -> tuple[dict, dict]:
    """Host (source) and device-side (destination) pools per kind."""
    src, dst = {}, {}
    for kind, layers, heads in (("full", 2, 2), ("swa", 4, 3)):
        sk, sv = kv_pair(layers, 10 * PS, heads, 6, 4, torch.bfloat16, gen)
        dk, dv = torch.zeros(layers, 8 * PS, heads, 6, dtype=torch.bfloat16), \
            torch.zeros(layers, 8 * PS, heads, 4, dtype=torch.bfloat16)
        src[kind] = (sk.contiguous(), sv.contiguous())
        dst[kind] = (dk.to(device), dv.to(device))
    return src, dst


# full layers load every page of the prefix; SWA layers only the window.
PAGES = {"full": ([7, 2, 5, 9, 0], [0, 1, 2, 3, 4]), "swa": ([9, 0], [3, 4])}


def _jobs(src: dict, dst: dict) -> list[LayerJob]:
    buffers = {k: (*src[k], *dst[k]) for k in src}
    return model_layer_jobs(KINDS, buffers, PAGES, PS)


def _expected_layer(src: dict, kind: str, j: int, t: int) -> torch.Tensor:
    sp, _ = PAGES[kind]
    return torch.cat([src[kind][t][j, p * PS:(p + 1) * PS] for p in sp])


def _read_layer(dst: dict, kind: str, j: int, t: int) -> torch.Tensor:
    _, dp = PAGES[kind]
    return torch.cat([dst[kind][t][j, p * PS:(p + 1) * PS] for p in dp]).cpu()


def test_consumer_never_reads_a_layer_before_its_load(gen: torch.Generator) -> None:
    src, dst = _pools(gen)
    lock = threading.Lock()
    copy_done: dict[int, float] = {}

    def slow_copy(*args, **kwargs):  # noqa: ANN002, ANN003 - same signature as copy_pages
        time.sleep(0.03)  # loads are slower than compute: the consumer must wait
        out = copy_pages(*args, **kwargs)
        with lock:
            copy_done[kwargs["layers"][0], id(args[2])] = time.monotonic()
        return out

    read_start: dict[int, float] = {}
    seen: dict[str, int] = {}
    with LayerwiseLoader(_jobs(src, dst), copy_fn=slow_copy) as loader:
        for i, kind in enumerate(KINDS):
            loader.wait(i)
            read_start[i] = time.monotonic()
            j = seen.get(kind, 0)
            seen[kind] = j + 1
            for t in (0, 1):
                assert_bitwise_equal(_read_layer(dst, kind, j, t), _expected_layer(src, kind, j, t))
            time.sleep(0.005)  # "compute"
    for i, kind in enumerate(KINDS):
        j = KINDS[:i].count(kind)
        assert copy_done[j, id(dst[kind][0])] <= read_start[i], f"layer {i} read too early"
        assert loader.finish_times[i] <= read_start[i]
    # Pipelined, not load-everything-first: layer 0 was read while the last
    # layer was still loading.
    assert read_start[0] < loader.finish_times[len(KINDS) - 1]


def test_swa_layers_load_only_window_pages(gen: torch.Generator) -> None:
    src, dst = _pools(gen)
    with LayerwiseLoader(_jobs(src, dst)) as loader:
        for i in range(len(KINDS)):
            loader.wait(i)
    dk = dst["swa"][0]
    untouched = [p for p in range(8) if p not in PAGES["swa"][1]]
    for p in untouched:
        assert not dk[:, p * PS:(p + 1) * PS].any(), f"SWA page {p} was written"
    for j in range(2):  # both full layers got every prefix page
        for t in (0, 1):
            assert_bitwise_equal(_read_layer(dst, "full", j, t), _expected_layer(src, "full", j, t))


def test_error_surfaces_at_wait_for_that_layer_and_later(gen: torch.Generator) -> None:
    src, dst = _pools(gen)
    calls = []

    def failing_copy(*args, **kwargs):  # noqa: ANN002, ANN003
        calls.append(kwargs["layers"])
        if len(calls) == 3:
            raise OSError("simulated transfer failure")
        return copy_pages(*args, **kwargs)

    loader = LayerwiseLoader(_jobs(src, dst), copy_fn=failing_copy).start()
    try:
        loader.wait(0)
        loader.wait(1)
        for layer in (2, 3, 5):
            with pytest.raises(RuntimeError, match=f"loading layer {layer} failed") as ei:
                loader.wait(layer, timeout=5)
            assert isinstance(ei.value.__cause__, OSError)
    finally:
        loader.close()
    assert len(calls) == 3  # nothing ran after the failure


def test_bad_job_in_a_layer_is_reported_for_that_layer(gen: torch.Generator) -> None:
    src, dst = _pools(gen)
    jobs = _jobs(src, dst)
    c = jobs[1].copies[0]
    jobs[1] = LayerJob(1, (PageCopy(c.src_k, c.src_v, c.dst_k, c.dst_v, [99], [0], PS, 0),))
    with LayerwiseLoader(jobs) as loader:
        loader.wait(0)
        with pytest.raises(RuntimeError, match="src_pages holds page 99"):
            loader.wait(1, timeout=5)


def test_wait_misuse_and_timeout(gen: torch.Generator) -> None:
    src, dst = _pools(gen)
    gate = threading.Event()

    def blocked_copy(*args, **kwargs):  # noqa: ANN002, ANN003
        gate.wait(5)
        return copy_pages(*args, **kwargs)

    loader = LayerwiseLoader(_jobs(src, dst), copy_fn=blocked_copy)
    with pytest.raises(RuntimeError, match="before start"):
        loader.wait(0)
    with pytest.raises(ValueError, match="layer 42 has no load job"):
        loader.wait(42)
    loader.start()
    try:
        with pytest.raises(TimeoutError):
            loader.wait(0, timeout=0.05)
        assert not loader.done(0)
    finally:
        gate.set()
        loader.close()
    with pytest.raises(RuntimeError, match="start\\(\\) called twice"):
        loader.start()


def test_close_cancels_pending_layers(gen: torch.Generator) -> None:
    src, dst = _pools(gen)

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003
        time.sleep(0.02)
        return copy_pages(*args, **kwargs)

    loader = LayerwiseLoader(_jobs(src, dst), copy_fn=slow).start()
    loader.wait(0)
    loader.close()
    with pytest.raises(RuntimeError, match="loader closed"):
        loader.wait(len(KINDS) - 1, timeout=5)


def test_job_validation() -> None:
    with pytest.raises(TypeError, match="jobs\\[0\\] must be a LayerJob"):
        LayerwiseLoader(["x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="more than once"):
        LayerwiseLoader([LayerJob(1), LayerJob(1)])
    k = torch.zeros(2, 4, 1, 1)
    with pytest.raises(ValueError, match="hold 2 layers but layer_kinds lists 3"):
        model_layer_jobs(["full"] * 3, {"full": (k, k, k, k)}, {"full": ([0], [0])}, 2)
    with pytest.raises(ValueError, match="layer_kinds\\[0\\] is 'swa'"):
        model_layer_jobs(["swa"], {"full": (k, k, k, k)}, {"full": ([0], [0])}, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_side_stream_orders_reads_after_loads(gen: torch.Generator) -> None:
    src, dst = _pools(gen, device="cuda")
    src = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in src.items()}
    seen: dict[str, int] = {}
    with LayerwiseLoader(_jobs(src, dst)) as loader:
        for i, kind in enumerate(KINDS):
            loader.wait(i)  # current stream now waits on layer i's event
            j = seen.get(kind, 0)
            seen[kind] = j + 1
            for t in (0, 1):
                got = _read_layer(dst, kind, j, t)  # .cpu() syncs the current stream
                assert torch.equal(bits(got), bits(_expected_layer(src, kind, j, t)))
