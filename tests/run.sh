#!/usr/bin/env bash
# The test command: installs what the tests need, then runs them all (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -r requirements.txt -r tests/requirements.txt
# Debian packages: espeak-ng speaks the test sentences the speech tests transcribe.
if ! command -v espeak-ng >/dev/null; then
  apt-get update -qq && apt-get install -y -qq espeak-ng >/dev/null
fi
python -m pytest tests -q -rs "$@"
