#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs hybridkv with its test
# extras (torch pinned to the CPU build), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -c <(echo torch==2.13.0) torch==2.13.0
python3 -m pip install -q -c <(echo torch==2.13.0) -e '.[test]'
python3 -m pytest -q tests "$@"
