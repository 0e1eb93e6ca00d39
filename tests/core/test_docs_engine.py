"""The engine loop of docs/engine.md and the README's engine snippet run as written."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_engine_guide_loop_runs_verbatim(capsys):
    code = _blocks(ROOT / "docs" / "engine.md")[-1]
    assert "forward_row" in code and "cache.step(" in code
    exec(compile(code, "docs/engine.md", "exec"), {"__name__": "engine_doc"})  # noqa: S102
    assert "logits equal the dense forward" in capsys.readouterr().out


def test_readme_engine_snippet_runs_verbatim():
    code = next(b for b in _blocks(ROOT / "README.md") if "cache.begin" in b)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102
