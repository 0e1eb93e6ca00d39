"""docs/index.md links every page with a plain markdown link (so the index works on
the repository page, where Sphinx directives do not run) and lists it in a toctree
(so the built site has it); every link of the index points at a page that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
INDEX = (DOCS / "index.md").read_text()
FENCE = re.compile(r"^```\{toctree\}\n(.*?)^```", re.S | re.M)


def _pages() -> set[str]:
    return {p.stem for p in DOCS.iterdir() if p.suffix in (".md", ".rst")} - {"index", "README"}


def _links(text: str) -> set[str]:
    outside = FENCE.sub("", text)
    return {m.group(1) for m in re.finditer(r"\]\(([\w-]+)\.(?:md|rst)(?:#[\w-]*)?\)", outside)}


def _toctree() -> set[str]:
    return {ln.strip() for body in FENCE.findall(INDEX) for ln in body.splitlines()
            if ln.strip() and not ln.startswith(":")}


def test_index_links_every_page_in_markdown():
    assert _pages() - _links(INDEX) == set(), "pages without a markdown link in docs/index.md"


def test_index_toctrees_list_every_page():
    assert _toctree() == _pages()


def test_index_links_point_at_pages_that_exist():
    assert _links(INDEX) <= _pages()


def test_the_index_has_no_comment_filled_in_by_conf_py():
    assert "<!--" not in INDEX
    assert "source-read" not in (DOCS / "conf.py").read_text()


def test_link_parser_sees_links_and_skips_toctrees():
    text = "- [A](a.md)\n- [B](b.rst#x)\n```{toctree}\n:hidden:\n\nc\n```\n"
    assert _links(text) == {"a", "b"}


def test_gib_appears_only_where_the_code_reads_gib():
    """Sizes are GB (10^9 bytes); the vLLM adapter's l2_gb, read as GiB by its code, is the
    one exception a user sets, and every page that says GiB says it about l2_gb."""
    connector = (ROOT / "adapters" / "vllm" / "hybridkv_vllm" / "connector.py").read_text()
    assert "self.cfg.l2_gb * (1 << 30)" in connector  # if this changes, the docs must too
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        if page.name == "changelog.md":
            continue
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if "GiB" in line:
                assert "l2_gb" in line or "2^30" in line, f"{page.name}:{n}: {line}"


def _slug(heading: str) -> str:
    """GitHub's (and MyST's myst_heading_anchors) anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_glossary_links_point_at_its_headings_and_every_term_is_linked():
    glossary = (DOCS / "glossary.md").read_text()
    anchors = {_slug(h) for h in re.findall(r"^## (.+)$", glossary, re.M)}
    used: dict[str, set[str]] = {}
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for anchor in re.findall(r"glossary\.md#([\w-]+)\)", page.read_text()):
            used.setdefault(anchor, set()).add(page.name)
    assert set(used) <= anchors, f"links to no glossary heading: {sorted(set(used) - anchors)}"
    first_met = {"tombstone", "window-safe", "retention", "retention-checkpoint", "anchor", "kv-group",
                 "l1-l2-l3", "pseudo-hit", "namespace", "page"}
    assert first_met <= anchors
    assert first_met <= set(used), f"glossary terms no page links to: {sorted(first_met - set(used))}"
    assert _slug("L1, L2, L3") == "l1-l2-l3" and _slug("Sliding window (SWA)") == "sliding-window-swa"
