#!/usr/bin/env bash
# The test command: installs what the tests need, then runs them all (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -r requirements.txt -r tests/requirements.txt
python -m pytest tests -q -rs "$@"
