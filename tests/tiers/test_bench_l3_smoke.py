"""benchmarks/tiers_l3.py keeps running and prints one JSON object (tiny sizes)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


def test_tiers_l3_benchmark_prints_ratios(capsys):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "tiers_l3.py"
    spec = importlib.util.spec_from_file_location("tiers_l3_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.PAGE_BYTES == 3_276_800
    assert mod.main(["--json", "--pages", "2", "--repeats", "1", "--backends", "file"]) == 0
    out = json.loads(capsys.readouterr().out)
    file = out["backends"]["file"]
    assert out["l3_overhead_ratio"]["file"] == file["l3_overhead_ratio"] > 0
    assert file["hkv_get_gbps"] > 0 and file["raw_put_gbps"] > 0
