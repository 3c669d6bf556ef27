#!/usr/bin/env bash
# Set up .venv if needed and run the test suite (CPU, offline). Extra arguments go to pytest.
# scripts/test.sh --extended also runs the long learning runs marked `extended` (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
if [ "${1:-}" = "--extended" ]; then
  shift
  exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python -m pytest -q -m "not extended" "$@"
