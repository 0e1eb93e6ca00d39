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
    """Run ``scripts/run_llm.py`` (one process, ``job["runs"]`` in order).

    Returns ``{run name: result}``; a run that failed to start has ``error``
    (the exception) and ``root_cause`` (the first ``...Error:`` line vLLM
    logged for that run).  Raises with the log's root cause when the process
    itself fails.
    """
    job_path, out_path, log_path = (workdir / f"{name}.{ext}" for ext in ("job.json", "out.json",
                                                                           "log"))
    job_path.write_text(json.dumps(job))
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(SCRIPTS / "run_llm.py"), str(job_path),
                               str(out_path)], stdout=log, stderr=subprocess.STDOUT,
                              timeout=TIMEOUT_S, env=env, cwd=workdir, check=False)
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"{name} failed (rc={proc.returncode}): {root_cause(log_path)}")
    out = json.loads(out_path.read_text())
    text = log_path.read_text(errors="replace")
    for run, res in out.items():
        if "error" in res:
            seg = text.split(f"### hybridkv run {run} start", 1)[-1]
            res["root_cause"] = _first_error(seg.split(f"### hybridkv run {run} end", 1)[0])
    return out


def root_cause(log_path: Path) -> str:
    """The first ``...Error: ...`` line of a vLLM log (the engine's real failure)."""
    return _first_error(log_path.read_text(errors="replace"))


def _first_error(text: str) -> str:
    hits = re.findall(r"^(?:.*\] )?\s*([A-Za-z_.]*(?:Error|Exception): .+)$", text, re.MULTILINE)
    return hits[0].strip() if hits else text[-2000:]


def read_stats(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
