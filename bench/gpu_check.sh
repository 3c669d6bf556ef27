#!/usr/bin/env bash
# One command that proves the GPU path on a machine with a CUDA GPU, in under 10 minutes:
#   bench/gpu_check.sh [SUMMARY_JSON]        (default: gpu_check.json in the repository root)
# 1. finds a Python with CUDA torch + this package's dependencies: $CHATRL_GPU_PYTHON, else .venv-gpu/,
#    else .venv/ or python3 if their torch sees CUDA; failing those it makes .venv-gpu/ and installs
#    the package there (pip, CUDA torch from the default index);
# 2. runs bench/gpu_check.py: the gpu-marked tests (tests/gpu), the device's memory bandwidth, the
#    hybrid-engine benchmark on the OPT-1.3B configuration (random weights, bf16), step 3 in bf16 on one
#    GPU (OPT-1.3B-shaped actor, OPT-350M-shaped reward and critic, 256 + 256 tokens: samples/s and
#    generated tokens/s) and one JSON summary.
# On a machine without a CUDA GPU it prints one "gpu_check: SKIP: ..." line and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check.json}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q "^GPU "; then
  echo "gpu_check: SKIP: no CUDA GPU on this machine (nvidia-smi lists none); nothing checked"
  exit 0
fi
nvidia-smi -L
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset DS_ACCELERATOR
has_cuda() { [ -x "$1" ] && "$1" -c "import torch, deepspeed, transformers, pytest; assert torch.cuda.is_available()" 2>/dev/null; }
PY=""
for cand in "${CHATRL_GPU_PYTHON:-}" .venv-gpu/bin/python .venv/bin/python "$(command -v python3 || true)"; do
  if [ -n "$cand" ] && has_cuda "$cand"; then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
  echo "gpu_check: no Python with CUDA torch found; installing into .venv-gpu/ (a few minutes)"
  python3 -m venv .venv-gpu
  .venv-gpu/bin/pip install -q --upgrade pip
  .venv-gpu/bin/pip install -q torch          # the default index's Linux wheel is the CUDA build
  .venv-gpu/bin/pip install -q -e ".[dev]"
  PY=.venv-gpu/bin/python
  has_cuda "$PY" || { echo "gpu_check: FAILED: .venv-gpu's torch does not see the GPU" >&2; exit 1; }
fi
echo "gpu_check: using $PY ($("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)'))"
exec timeout 590 "$PY" bench/gpu_check.py --out "$OUT"
