#!/usr/bin/env bash
# DPO on step 2's reference point, one CPU process: a tiny random OPT (hidden 64, 2 layers, 4 heads, ffn 256,
# GPT-2 BPE + <pad>), 1 epoch on helpful-base pairs 0-999 (file order), max length 256, batch 4, lr 5e-4,
# β 0.1, fp32, evaluated on pairs 1000-1199 every 50 steps (eval rewards/accuracy starts at 0: every pair a tie).
# Usage: scripts/step2_dpo/cpu_reference.sh [OUTPUT_DIR] [SEED] [extra flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUTPUT=${1:-output/step2_dpo_reference}; SEED=${2:-1234}
SHARED=${CHATRL_SHARED:-../shared}
HB=$SHARED/data/hh-rlhf/helpful-base/test.jsonl.gz
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1
[ -f output/models/opt/config.json ] || .venv/bin/python scripts/make_tiny_models.py --out output/models --family opt
mkdir -p "$OUTPUT"
.venv/bin/python -m chatrl.step2_dpo \
  --model_name_or_path output/models/opt \
  --data_path "$HB[0:1000]" --data_split 0,1,0 --eval_fraction 0 --eval_data_path "$HB[1000:1200]" \
  --max_seq_len 256 --per_device_train_batch_size 4 --per_device_eval_batch_size 8 --learning_rate 5e-4 \
  --num_train_epochs 1 --eval_interval 50 --beta 0.1 --dtype fp32 \
  --seed "$SEED" --overwrite_output_dir --output_dir "$OUTPUT" "${@:3}" 2>&1 | tee "$OUTPUT/training.log"
