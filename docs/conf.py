"""Sphinx configuration of the hybridkv documentation (built with -W in CI)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "hybridkv"
author = "hybridkv contributors"
copyright = "2026, hybridkv contributors"
try:
    from hybridkv import __version__ as release
except ImportError:  # the docs must still build if an optional import breaks
    release = "0.1.0"
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "README.md"]

# Pages other engineers own are listed in the index's how-to toctree when
# they exist (a toctree entry for a missing page fails the -W build).
# Every other top-level page is a guide: known ones in this order, then the
# rest alphabetically.  Build with -E (build.sh does) so a new page is listed.
MY_PAGES = {"index", "quickstart", "concepts", "budgets", "benchmarks", "correctness", "api"}
GUIDE_ORDER = ("sglang", "vllm", "tiers", "storage", "transfer", "routing", "policy")
GUIDES_MARKER = "<!-- guides: conf.py lists the engineers' pages that exist here -->"


def guide_pages() -> list[str]:
    here = Path(__file__).resolve().parent
    found = {p.stem for p in here.glob("*.md")} - MY_PAGES - {"README"}
    return [g for g in GUIDE_ORDER if g in found] + sorted(found - set(GUIDE_ORDER))


def _insert_guides(app: object, docname: str, source: list[str]) -> None:
    if docname == "index":
        source[0] = source[0].replace(GUIDES_MARKER, "\n".join(guide_pages()))


def setup(app: object) -> None:
    app.connect("source-read", _insert_guides)  # type: ignore[attr-defined]


suppress_warnings = [
    # headings in engineers' pages may start at any level; anchors are not used
    "myst.header",
    "myst.xref_missing",
]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Autodoc: optional backends are mocked so the API pages build on a plain install.
autodoc_mock_imports = ["redis", "hiredis", "mooncake", "nixl", "nixl._api"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
nitpicky = False

html_theme = os.environ.get("HYBRIDKV_DOCS_THEME", "alabaster")
html_static_path = ["_static"] if (Path(__file__).parent / "_static").is_dir() else []
html_title = f"hybridkv {release}"
