"""scripts/test.sh and the adapters' run-tests.sh, driven with a stand-in python3 that
records its calls: a header per phase, pip's noise kept out unless an install fails,
skip reasons from pytest, and SGLang's deps installed before sglang --no-deps."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Records every call in $CALLS; pip prints 50 lines of noise (and fails when $FAIL_PIP is set).
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
case "$1 $2" in
  "-m pip") for i in $(seq 50); do echo "pip noise $i"; done
            [ -z "${FAIL_PIP:-}" ] || { echo "pip: no matching distribution" >&2; exit 1; }
            case "${FAIL_VENV_PIP:-}:$0" in 1:*.venv*) echo "venv pip failed" >&2; exit 1 ;; esac ;;
  "-m pytest") echo "fake pytest ran" ;;
  "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
  *) echo "2.13.0" ;;
esac
"""


def _exe(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """A copy of the scripts in an otherwise empty tree, and a bin/ with the stand-ins."""
    for rel in ("scripts/test.sh", "adapters/sglang/run-tests.sh", "adapters/vllm/run-tests.sh"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    _exe(tmp_path / "bin" / "python3", FAKE_PYTHON)
    _exe(tmp_path / "bin" / "id", "#!/bin/sh\necho 1000\n")  # not root: no apt-get
    return tmp_path


def _run(tree: Path, script: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    calls = tree / "calls.txt"
    full = {**os.environ, "PATH": f"{tree / 'bin'}:/usr/bin:/bin", "CALLS": str(calls),
            "PYTHON": str(tree / "bin" / "python3"), **env}
    res = subprocess.run(["bash", str(tree / script)], capture_output=True, text=True, env=full, timeout=60)
    return res, calls.read_text().splitlines() if calls.exists() else []


def test_test_sh_prints_headers_and_hides_pip(tree):
    (tree / "adapters").rename(tree / "no-adapters")  # the core phases only
    res, calls = _run(tree, "scripts/test.sh")
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    assert "pip noise" not in out
    headers = [ln for ln in res.stdout.splitlines() if ln.startswith("== ")]
    assert headers[0].startswith("== install") and any(h.startswith("== core suite (pytest tests") for h in headers)
    assert res.stdout.index("== core suite") < res.stdout.index("fake pytest ran")
    pytest_calls = [c for c in calls if c.startswith("-m pytest")]
    assert pytest_calls and all(" -rs " in f" {c} " for c in pytest_calls)
    assert all("-c /" in c for c in calls if c.startswith("-m pip install"))  # under the torch constraint


def test_test_sh_makes_the_adapter_venvs_while_the_core_suite_runs(tree):
    """Both adapters' venvs are made (their pip output in .ci-out/adapter-venvs.log,
    not on the console), then each suite runs after the core suite, in its venv."""
    res, calls = _run(tree, "scripts/test.sh")
    assert res.returncode == 0, res.stderr
    assert "pip noise" not in res.stdout + res.stderr
    for adapter in ("sglang", "vllm"):
        assert (tree / "adapters" / adapter / ".venv" / "bin" / "python").exists(), adapter
    assert (tree / ".ci-out" / "adapter-venvs.log").read_text().count("installing") == 2
    out = res.stdout
    core = out.index("== core suite")
    assert core < out.index("== adapters/sglang suite") < out.index("== adapters/vllm suite")
    assert sum(c.startswith("-m pytest") for c in calls) == 3  # the core suite and each adapter's


def test_test_sh_stops_when_an_adapter_venv_cannot_be_made(tree):
    res, calls = _run(tree, "scripts/test.sh", FAIL_VENV_PIP="1")
    assert res.returncode != 0
    assert "making an adapter's virtual environment failed" in res.stderr and "venv pip failed" in res.stderr
    assert "== adapters/" not in res.stdout
    assert sum(c.startswith("-m pytest") for c in calls) == 1  # the core suite ran, no adapter's


def test_test_sh_shows_the_pip_log_when_an_install_fails(tree):
    res, calls = _run(tree, "scripts/test.sh", FAIL_PIP="1")
    assert res.returncode != 0
    assert "install failed" in res.stderr and "pip noise 50" in res.stderr and "no matching distribution" in res.stderr
    assert not any(c.startswith("-m pytest") for c in calls)


@pytest.mark.parametrize("adapter", ["sglang", "vllm"])
def test_adapter_scripts_hide_pip_and_print_skip_reasons(tree, adapter):
    venv = tree / "venv"
    res, calls = _run(tree, f"adapters/{adapter}/run-tests.sh",
                      **{f"HYBRIDKV_{adapter.upper()}_VENV": str(venv)})
    assert res.returncode == 0, res.stderr
    assert "pip noise" not in res.stdout + res.stderr
    assert (venv / "install.log").read_text().count("pip noise") >= 50  # kept for when it is needed
    assert calls[-1].startswith("-m pytest") and " -rs " in f" {calls[-1]} "
    installs = [c for c in calls if c.startswith("-m pip") and " install " in f" {c} "]
    if adapter == "sglang":
        deps = next(i for i, c in enumerate(installs) if "transformers" in c.split())
        sglang = next(i for i, c in enumerate(installs) if "sglang==0.5.23" in c.split())
        # after the deps, a --no-deps install is never checked against sglang's CUDA pins
        assert deps < sglang and "--no-deps" in installs[sglang].split()
        assert all("--no-deps" in c.split() for c in installs[sglang:])


@pytest.mark.parametrize("adapter", ["sglang", "vllm"])
def test_adapter_scripts_show_the_log_when_pip_fails(tree, adapter):
    res, calls = _run(tree, f"adapters/{adapter}/run-tests.sh", FAIL_PIP="1",
                      **{f"HYBRIDKV_{adapter.upper()}_VENV": str(tree / "venv")})
    assert res.returncode != 0 and "pip noise 50" in res.stderr and "failed" in res.stderr
    assert not any(c.startswith("-m pytest") for c in calls)


def test_no_script_or_guide_says_the_constraint_picks_the_cpu_build():
    for rel in ("scripts/test.sh", "docs/quickstart.md", "docs/build.sh", "adapters/sglang/run-tests.sh"):
        text = " ".join((ROOT / rel).read_text().split()).lower()
        assert "pinned to the cpu build" not in text and "pin the cpu build" not in text, rel
        assert "cpu torch pinned" not in text, rel


def test_test_sh_keeps_its_log_and_docs_build_in_the_checkout(tree):
    """The install log and the docs build go to .ci-out/ (ignored by git), nothing to $TMPDIR."""
    (tree / "adapters").rename(tree / "no-adapters")
    (tree / "docs").mkdir()
    (tree / "docs" / "build.sh").write_text('mkdir -p "$1" && echo built > "$1/index.html"\n')
    tmp = tree / "tmpdir"
    tmp.mkdir()
    res, _ = _run(tree, "scripts/test.sh", TMPDIR=str(tmp))
    assert res.returncode == 0, res.stderr
    assert list(tmp.iterdir()) == []
    assert (tree / ".ci-out" / "install.log").read_text().count("pip noise") >= 50
    assert (tree / ".ci-out" / "docs" / "index.html").exists()
    assert ".ci-out/" in (ROOT / ".gitignore").read_text().split()
