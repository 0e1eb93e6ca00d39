"""benchmarks/engine_step.py says what it is doing on stderr and keeps --json clean."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_mode_reports_each_step_and_prints_one_json_object(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join('{"timestamp": %d, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, %d]}\n'
                             % (i, i + 2) for i in range(6)))
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_step.py"), "--quick", "--no-vllm",
                          "--steps", "4", "--repeats", "1", "--trace", str(trace), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)  # nothing but the JSON object on stdout
    assert out["quick"] is True and out["steps"] == 4 and out["requests"] == 6
    assert set(out["decode_us_per_req"]["hybridkv_batched"]) == {"32", "128"}  # --quick's batches
    assert "decode_us_per_req_32k" not in out  # --quick: 4K context only
    steps = re.findall(r"^engine_step \[(\d+)/(\d+)\] ", res.stderr, re.M)
    total = 2 * 2 + 1  # two APIs x two batch sizes, one replay
    assert [(int(i), int(n)) for i, n in steps] == [(i, total) for i in range(1, total + 1)]
    assert "request path: replay 1 of 1 of 6 requests" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("engine_step: done in")
