#!/usr/bin/env bash
# The test command: installs what the tests need, then runs them all (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -r requirements.txt -r tests/requirements.txt
# Debian packages: Chromium for the browser tests (Playwright drives it; it downloads no browser of its
# own), espeak-ng to speak the sentences the speech tests transcribe.
missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v espeak-ng >/dev/null || missing+=(espeak-ng)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
fi
python -m pytest tests -q -rs "$@"
