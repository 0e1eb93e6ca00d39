"""Every code block of docs/*.md and README.md that claims to run does.

* ```python blocks run in order, one fresh interpreter per document (as a reader
  pasting them into one session would), from the repository root, with a timeout.
  A block is left out only when the line before it (blank lines aside) is
  ``<!-- not run: REASON -->``, and REASON must say why.
* ```bash blocks are commands to read, not to run, but every ``hybridkv ...``
  line in them must be accepted by the CLI's parser, and the cheap ones
  (``hybridkv info``, ``--help``, ``--version``) run.
* What README says the default ``hybridkv replay`` prints is what it prints.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hybridkv.eval.cli import _parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*not run:((?:(?!-->).)*)-->\s*\Z", re.S)  # the comment right before a fence
TIMEOUT_S = 300  # per document; the slowest (docs/policy.md) replays the full conversation trace


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip_reason: str | None  # the marker's reason, or None when the block runs

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one markdown file, with the not-run marker before each, if any."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = MARKER.search(text[:m.start()].rstrip() + "\n")
        reason = " ".join(before.group(1).split()) if before else None
        out.append(Block(path, text.count("\n", 0, m.start()) + 1, m.group(1).lower(), m.group(2), reason))
    return out


def _python_docs() -> list[Path]:
    """Documents with a python block to run (the markers test covers the rest)."""
    return [p for p in DOCS if any(b.lang == "python" and b.skip_reason is None for b in blocks(p))]


def _program(doc: list[Block]) -> str:
    """One script running a document's blocks in order in one namespace; a failure names its block."""
    parts = ["import sys, traceback", "ns = {'__name__': '__main__'}"]
    for b in doc:
        parts.append(f"try:\n    exec(compile({b.code!r}, {b.where!r}, 'exec'), ns)\n"
                     f"except BaseException:\n    traceback.print_exc()\n"
                     f"    sys.exit('FAILED: the block at {b.where}')")
    return "\n".join(parts) + "\n"


@pytest.mark.parametrize("path", _python_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path):
    doc = [b for b in blocks(path) if b.lang == "python"]
    run = [b for b in doc if b.skip_reason is None]
    if any("../shared/traces" in b.code for b in run) and not (ROOT.parent / "shared" / "traces").is_dir():
        pytest.skip("a block reads ../shared/traces, absent beside this checkout")
    res = subprocess.run([sys.executable, "-c", _program(run)], cwd=ROOT, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-4000:]


def test_markers_are_rare_and_each_gives_its_reason():
    marked = [b for p in DOCS for b in blocks(p) if b.skip_reason is not None]
    python = [b for p in DOCS for b in blocks(p) if b.lang == "python"]
    assert all(b.lang == "python" for b in marked), [b.where for b in marked if b.lang != "python"]
    short = [b.where for b in marked if len(b.skip_reason or "") < 10]
    assert not short, f"say why these are not run: {short}"
    assert len(marked) * 2 < len(python), [b.where for b in marked]  # most blocks run


def test_block_parser_sees_markers_and_fences(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("text\n\n<!-- not run: needs a GPU -->\n\n```python\nimport x\n```\n\n```python\n1\n```\n")
    got = blocks(md)
    assert [(b.line, b.lang, b.skip_reason) for b in got] == [(5, "python", "needs a GPU"), (9, "python", None)]


def _cli_lines() -> list[tuple[str, list[str]]]:
    """``(where, argv)`` of every ``hybridkv ...`` command line in the bash blocks."""
    out = []
    for p in DOCS:
        for b in blocks(p):
            if b.lang not in ("bash", "sh", "console"):
                continue
            for cmd in re.split(r"\n|&&|;", b.code.replace("\\\n", " ")):  # continuation lines joined
                if cmd.split()[:1] == ["hybridkv"]:  # other commands may span lines inside quotes
                    out.append((b.where, shlex.split(cmd, comments=True)[1:]))
    return out


def test_every_hybridkv_command_in_the_docs_parses():
    lines = _cli_lines()
    assert any(argv == ["replay"] for _, argv in lines)  # README's and the quickstart's first command
    for where, argv in lines:
        try:
            _parser().parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"{where}: hybridkv {' '.join(argv)} is rejected by the CLI") from exc


@pytest.mark.parametrize("argv", [["info"], ["info", "--hbm-gb", "80"], ["--version"], ["replay", "--help"],
                                  ["verify", "--help"]])
def test_cheap_commands_of_the_docs_run(argv):
    res = subprocess.run([sys.executable, "-m", "hybridkv", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout and not res.stderr, res.stderr


def test_the_committed_sample_replay_is_what_hybridkv_replay_prints():
    """README and the quickstart render the default ``hybridkv replay`` figures from
    benchmarks/results/replay_sample.json (tests/core/test_figures.py checks the pages
    against it); here the file is checked against a run of the command it records."""
    saved = json.loads((ROOT / "benchmarks" / "results" / "replay_sample.json").read_text())
    assert saved["provenance"]["command"] == "hybridkv replay --json"
    res = subprocess.run([sys.executable, "-m", "hybridkv", "replay", "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["requests"] == saved["requests"] == 2000 and "bundled sample" in out["trace_name"]
    for key in ("hit_tokens", "input_tokens", "prefix_bound_hit_tokens"):
        assert out[key] == saved[key], key
    for name in ("naive", "tombstone"):
        assert out["baselines"][name]["hit_tokens"] == saved["baselines"][name]["hit_tokens"], name
    paras = [next(p for p in (ROOT / "README.md").read_text().split("\n\n") if "`hybridkv replay` prints" in p),
             next(p for p in (ROOT / "docs" / "quickstart.md").read_text().split("\n\n") if "`hybridkv replay` prints" in p)]
    for para in paras:
        assert f"{100 * out['token_hit_rate']:.1f}%" in para and "2,000" in para
