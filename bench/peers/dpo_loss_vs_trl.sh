#!/usr/bin/env bash
# chatrl's DPO loss vs TRL's DPOTrainer (sigmoid, IPO) on identical inputs, TRL in its own venv.
# Reuses $TRL_CPU_ROOT/venv (default /tmp/trl_cpu/venv, TRL 1.12.0) and builds it with
# ../shared/baselines/trl/setup_venv.sh when it is missing. Writes bench/results/dpo_loss_vs_trl.json.
# Usage: bench/peers/dpo_loss_vs_trl.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
SHARED=${CHATRL_SHARED:-../shared}
WORK=${1:-/tmp/chatrl_dpo_vs_trl}
TRL_PY=${TRL_CPU_ROOT:-/tmp/trl_cpu}/venv/bin/python
export HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
if ! "$TRL_PY" -c "import trl" 2>/dev/null; then
  bash "$SHARED/baselines/trl/setup_venv.sh"
fi
.venv/bin/python bench/peers/dpo_loss_vs_trl.py prepare --work "$WORK" --shared "$SHARED"
# TRL's interpreter must not see chatrl's packages: no PYTHONPATH into this repository there.
env -u PYTHONPATH "$TRL_PY" bench/peers/dpo_loss_vs_trl.py trl --work "$WORK"
mkdir -p bench/results
.venv/bin/python bench/peers/dpo_loss_vs_trl.py compare --work "$WORK" | tee bench/results/dpo_loss_vs_trl.json
