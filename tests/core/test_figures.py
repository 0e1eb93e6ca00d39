"""Every measured figure a reader sees in README.md and docs/*.md is rendered from a
committed result file by scripts/render_figures.py, and the result files are not
older than the code they say they depend on.

* Each page equals its rendered form (a hand edit inside a region, or a result
  file changed without re-rendering, fails here).
* A planted disagreement (a figure edited in a page, a figure changed in a
  result file) is caught.
* Every result file names its command, commit, date and the code it depends on;
  its commit is HEAD or an ancestor of it, and no later commit touched that code
  (unless a recorded rerun confirmed it, or the file declares the commit and why
  it cannot change the figures: that declaration is printed on the page).
* Pages listed in STRICT_PAGES have no measured figure (a percentage, a ratio
  like ``1.80x``, a latency in us/ms, a GB/s rate) outside a rendered region.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("render_figures", ROOT / "scripts" / "render_figures.py")
rf = importlib.util.module_from_spec(_spec)
sys.modules["render_figures"] = rf
_spec.loader.exec_module(rf)

PAGES = rf.pages()
# Pages whose every measured figure must be rendered.  Not yet: docs/engine.md (a computed
# layout overhead); docs/changelog.md is dated history by design.
STRICT_PAGES = ("README.md", "docs/quickstart.md", "docs/concepts.md", "docs/budgets.md", "docs/benchmarks.md",
                "docs/policy.md", "docs/tiers.md", "docs/routing.md", "docs/transfer.md", "docs/correctness.md",
                "docs/glossary.md", "docs/index.md", "docs/storage.md", "docs/sglang.md", "docs/vllm.md")
FIGURE = re.compile(r"\d[\d,.]*\s?(?:%|x\b|us\b|ms\b|GB/s)")


def _history() -> str | None:
    """Why the commits a result file names cannot be compared with HEAD here, or None."""
    res = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"], capture_output=True,
                         text=True)
    if res.returncode != 0:
        return "not a git checkout: the commits a result file names cannot be compared with HEAD"
    if res.stdout.strip() == "true":
        return "a shallow clone: the commits a result file names may be missing (git fetch --unshallow)"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_equals_its_rendered_form(page):
    text = page.read_text()
    assert rf.render_text(text, where=str(page)) == text, (
        f"{page.relative_to(ROOT)} differs from its result files: run python scripts/render_figures.py")


def test_every_renderer_is_used_and_every_result_file_read():
    used = {name for p in PAGES for name in rf.regions(p.read_text())}
    assert used == set(rf.RENDERERS), f"renderers no page uses: {sorted(set(rf.RENDERERS) - used)}"
    for rel in rf.result_files():
        assert (ROOT / rel).is_file(), rel


def test_a_page_edited_by_hand_is_caught():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- figures:readme-peers -->\n.*?(\d+\.\d\d)%", readme, re.S)
    assert m, "README has no rendered peers table"
    planted = readme[:m.start(1)] + f"{float(m.group(1)) + 0.01:.2f}" + readme[m.end(1):]
    assert rf.render_text(planted) != planted
    assert rf.render_text(planted) == readme


def test_a_result_file_changed_without_rerendering_is_caught():
    readme = (ROOT / "README.md").read_text()
    real = rf.load_file(rf.PEERS_CONV)
    hybridkv = next(r for r in real["results"] if r["system"] == "hybridkv" and r["budget_gb"] == 59)
    assert f"**{100 * hybridkv['token_hit_rate']:.2f}%**" in readme

    def load(rel: str) -> dict:
        out = rf.load_file(rel)
        if rel == rf.PEERS_CONV:
            for r in out["results"]:
                if r["system"] == "hybridkv" and r["budget_gb"] == 59:
                    r["token_hit_rate"] += 0.0123
            for c in out["comparison"]:  # what sweep.merge would recompute
                if c["budget_gb"] == 59:
                    c["hybridkv_hit_rate"] += 0.0123
        return out

    again = rf.render_text(readme, load)
    assert again != readme and f"**{100 * (hybridkv['token_hit_rate'] + 0.0123):.2f}%**" in again


def test_unknown_or_unpaired_regions_are_refused():
    with pytest.raises(ValueError, match="unknown figures region"):
        rf.render_text("<!-- figures:nope -->\nx\n<!-- /figures:nope -->\n")
    with pytest.raises(ValueError, match="unpaired"):
        rf.render_text("<!-- figures:readme-sample -->\nx\n")


@pytest.mark.parametrize("rel", rf.result_files())
def test_result_file_records_its_command_commit_date_and_code(rel):
    out = rf.load_file(rel)
    assert rf.provenance_problems(rel, out) == []
    assert rf.check_hit_tokens(rel, out) == []
    assert not re.search(r"/(work|root|tmp|home)/", json.dumps(out)), f"{rel} names a path of a machine"


@pytest.mark.parametrize("rel", rf.result_files())
def test_result_file_is_not_older_than_its_code(rel):
    if _history():
        pytest.skip(_history())
    assert rf.stale(rel, rf.load_file(rel)) == []


def test_staleness_is_detected():
    if _history():
        pytest.skip(_history())
    out = rf.load_file(rf.SAMPLE)
    first = subprocess.run(["git", "-C", str(ROOT), "rev-list", "--max-parents=0", "HEAD"], capture_output=True,
                           text=True, check=True).stdout.split()[0]
    old = {**out, "provenance": {**out["provenance"], "commit": first}}
    problems = rf.stale("x.json", old)
    assert problems and "changed after it" in problems[0] and "rerun: hybridkv replay" in problems[0]
    unknown = {**out, "provenance": {**out["provenance"], "commit": "f" * 40}}
    assert "not an ancestor" in rf.stale("x.json", unknown)[0]


def test_a_check_that_disagrees_with_the_rows_is_caught():
    out = rf.load_file(rf.PEERS_CONV)
    key = next(iter(out["provenance"]["checks"][0]["hit_tokens"]))
    out["provenance"]["checks"][0]["hit_tokens"][key] += 64
    assert rf.check_hit_tokens("x.json", out)


@pytest.mark.parametrize("rel", STRICT_PAGES)
def test_strict_pages_have_no_figure_outside_a_region(rel):
    text = rf.REGION.sub("", (ROOT / rel).read_text())
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # commands, not figures
    found = FIGURE.findall(text)
    assert not found, f"{rel}: measured figures outside a rendered region: {found[:10]}"


def test_the_figure_pattern_sees_measured_figures_and_not_settings():
    found = FIGURE.findall("hits 9.34% (1.80x), op p50 126 us, p99 1.2 ms, copies at 4.67 GB/s")
    assert found == ["9.34%", "1.80x", "126 us", "1.2 ms", "4.67 GB/s"]
    assert FIGURE.findall("page 64, 594 GB, W = 128, K = 16,384 tokens, vLLM 0.32, 2,000 requests") == []


def test_check_mode_changes_nothing_and_reports_a_difference(tmp_path, monkeypatch, capsys):
    assert rf.main(["--check"]) == 0
    page = tmp_path / "README.md"
    page.write_text("<!-- figures:readme-sample -->\nold figures\n<!-- /figures:readme-sample -->\n")
    monkeypatch.setattr(rf, "pages", lambda: [page])
    assert rf.main(["--check"]) == 1 and "README.md" in capsys.readouterr().err
    assert "old figures" in page.read_text()  # --check rewrites nothing
    assert rf.main([]) == 0 and "26." in page.read_text() and "old figures" not in page.read_text()
