"""The GPU benchmark and the GPU check never rot: their dry runs run here.

``benchmarks/gpu_layerwise.py --device cpu`` builds the same buffers, plans
and issue path as on a GPU with the launch stubbed; ``gpu_summary.py`` turns
a check's files into summary.json; ``device_check.sh`` refuses a machine
without a GPU before it does anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_summary  # noqa: E402

GPU_FIELDS = ("overlap_ratio", "serial_ratio", "load_vs_memcpy")


def test_layerwise_dry_run_prints_the_documented_object() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_layerwise.py"), "--device", "cpu",
         "--sizes", "4096,16384", "--repeats", "2", "--json"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["device"].startswith("cpu") and out["model"] == "mimo-v2.5-pro"
    assert [r["prefix_tokens"] for r in out["runs"]] == [4096, 16384]
    for r in out["runs"]:
        assert r["host_us_per_layer"] > 0 and r["plan_ms"] > 0
        assert all(r[k] is None for k in GPU_FIELDS)
    # the 16k load moves about 4x the 4k one's full-layer bytes (SWA: the window only)
    small, big = (r["bytes"] for r in out["runs"])
    assert 3 < big / small < 4
    assert set(out["concurrency"]) >= {"kernel_overlap_ratio", "dma_overlap_ratio"}
    assert all(v is None for v in out["concurrency"].values())


def test_summary_reads_a_checks_files(tmp_path: Path) -> None:
    (tmp_path / "env.txt").write_text("NVIDIA H200\npython 3.12.3 torch 2.11.0 cuda 13.0\n")
    (tmp_path / "suite.txt").write_text("....\n612 passed, 3 skipped in 61.2s\n")
    (tmp_path / "sanitizer.txt").write_text(
        "========= ERROR SUMMARY: 0 errors\n========= ERROR SUMMARY: 2 errors\n")
    (tmp_path / "transfer_bench.json").write_text(json.dumps(
        {"cuda_h2d_ratio_vs_memcpy": 0.97, "cuda_d2h_ratio_vs_memcpy": 0.96,
         "cuda_d2d_ratio_vs_memcpy": 0.88, "cuda_h2d_path": "dma"}))
    runs = [{"prefix_tokens": 4096, "overlap_ratio": 1.2, "serial_ratio": 1.9,
             "load_vs_memcpy": 0.7, "host_us_per_layer": 4.0}]
    (tmp_path / "gpu_layerwise.json").write_text(json.dumps(
        {"device": "NVIDIA H200", "date": "2026-12-04", "runs": runs, "concurrency": {}}))
    (tmp_path / "reference_layerwise.json").write_text(json.dumps(
        {"runs": [{"prefix_tokens": 4096, "overlap_ratio": 1.25, "load_vs_memcpy": 0.9}]}))
    assert gpu_summary.main([str(tmp_path)]) == 1  # the sanitizer found errors
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["python"] == "3.12.3" and s["suites"] == {"passed": 612, "failed": 0, "skipped": 3}
    assert s["copy_vs_memcpy"] == {"h2d": 0.97, "d2h": 0.96, "d2d": 0.88}
    assert s["sanitizer_errors"] == 2 and s["layerwise"] == runs
    agree = s["reference_agreement"][0]
    assert agree["overlap_ratio"]["within_10pct"] is True
    assert agree["load_vs_memcpy"]["within_10pct"] is False


def test_summary_of_a_failed_suite_and_missing_files(tmp_path: Path) -> None:
    (tmp_path / "suite.txt").write_text("2 failed, 600 passed, 1 error in 80s\n")
    s = gpu_summary.summarise(tmp_path)
    assert s["suites"] == {"passed": 600, "failed": 3, "skipped": 0}
    assert s["sanitizer_errors"] is None and s["layerwise"] == [] and s["device"] is None


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_device_check_refuses_a_machine_without_a_gpu(tmp_path: Path) -> None:
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: device_check.sh would run for real")
    proc = subprocess.run(["bash", str(REPO / "src_cuda" / "device_check.sh")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
