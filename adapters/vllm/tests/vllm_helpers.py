"""Run ``scripts/run_llm.py`` in a subprocess (vLLM needs its own process per LLM)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
TIMEOUT_S = 420


def run_llm(job: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    """Run one LLM process; return its JSON result or raise with the log's root cause."""
    job_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("job.json", "out.json",
                                                                           "log"))
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(SCRIPTS / "run_llm.py"), str(job_path),
                               str(out_path)], stdout=log, stderr=subprocess.STDOUT,
                              timeout=TIMEOUT_S, env=env, cwd=workdir)
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"{name} failed (rc={proc.returncode}): {root_cause(log_path)}")
    return json.loads(out_path.read_text())


def root_cause(log_path: Path) -> str:
    """The first ``...Error: ...`` line of a vLLM log (the engine's real failure)."""
    text = log_path.read_text(errors="replace")
    hits = re.findall(r"^(?:.*\] )?\s*([A-Za-z_.]*(?:Error|Exception): .+)$", text, re.M)
    return hits[0].strip() if hits else text[-2000:]


def read_stats(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
