#!/usr/bin/env bash
# Set up .venv if needed and run the test suite (CPU, offline). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
