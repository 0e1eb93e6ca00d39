#!/usr/bin/env bash
# Build the documentation with warnings as errors.
#
#   bash docs/build.sh [OUT_DIR]      (default: docs/_build/html)
#
# Installs the docs extra (sphinx, myst-parser) under a torch==2.13.0 constraint
# (it keeps pip from replacing the installed torch),
# then runs sphinx-build -W.  Set HYBRIDKV_DOCS_NO_INSTALL=1 to skip pip.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/docs/_build/html}"
PYTHON="${PYTHON:-python3}"
if [ -z "${HYBRIDKV_DOCS_NO_INSTALL:-}" ]; then
    CONSTRAINT="$(mktemp)"
    trap 'rm -f "$CONSTRAINT"' EXIT
    echo "torch==2.13.0" > "$CONSTRAINT"
    "$PYTHON" -m pip install -q --disable-pip-version-check -c "$CONSTRAINT" -e "$ROOT[docs]"
fi
"$PYTHON" -m sphinx -E -W --keep-going -q -b html "$ROOT/docs" "$OUT"
echo "docs: $OUT/index.html"
