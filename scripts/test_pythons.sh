#!/usr/bin/env bash
# The core suite on every other Python that pyproject admits (3.10 - 3.13) and
# this machine has (python3.X on PATH, or a pyenv version), each in its own
# venv (.venv-py3.X, gitignored).  CI runs 3.11 (scripts/test.sh); this is the
# check for the others.  On Pythons other than the one torch's local CPU wheel
# was built for, pip takes PyPI's torch 2.13.0 (a CUDA build: about 3 GB per
# venv, runs on the CPU); the first run of each venv costs about a minute.
#
#   bash scripts/test_pythons.sh [pytest args]      # default: tests -q
set -uo pipefail
cd "$(dirname "$0")/.."
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(tests -q -p no:cacheprovider)
status=0
for v in 3.10 3.12 3.13; do
    py=$(command -v "python$v" || true)
    # a pyenv shim is on PATH for every version pyenv has, but runs only the selected ones
    if [ -n "$py" ] && ! "$py" -c "" 2>/dev/null; then
        py=""
    fi
    if [ -z "$py" ] && command -v pyenv >/dev/null; then
        root=$(pyenv root)
        py=$(ls -d "$root"/versions/"$v".*/bin/python 2>/dev/null | sort -V | tail -n 1)
    fi
    if [ -z "$py" ]; then
        echo "== python $v: not on this machine (skipped)"
        continue
    fi
    venv=".venv-py$v"
    echo "== python $v ($py, venv $venv)"
    if [ ! -x "$venv/bin/python" ]; then
        "$py" -m venv "$venv" || { status=1; continue; }
    fi
    if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check \
            -c <(echo torch==2.13.0) torch==2.13.0 -e ".[test]" > "$venv/install.log" 2>&1; then
        echo "install failed; the end of $venv/install.log:"
        tail -n 30 "$venv/install.log"
        status=1
        continue
    fi
    "$venv/bin/python" -m pytest "${args[@]}" || status=1
done
exit "$status"
