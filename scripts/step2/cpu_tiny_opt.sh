#!/usr/bin/env bash
# Step 2 on CPU: 2 ranks, ZeRO-3, gloo, a tiny random OPT on four hh-rlhf subsets blended (step-2 phase
# of --data_split 2,4,4). A few minutes on 2 cores.
# Usage: scripts/step2/cpu_tiny_opt.sh [OUTPUT_DIR] [ZERO_STAGE] [extra flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launch_common.sh
OUTPUT=${1:-output/step2_cpu_opt}; ZERO_STAGE=${2:-3}
SHARED=${CHATRL_SHARED:-../shared}
HH=$SHARED/data/hh-rlhf
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
[ -f output/models/opt/config.json ] || .venv/bin/python scripts/make_tiny_models.py --out output/models --family opt
mkdir -p "$OUTPUT"
.venv/bin/deepspeed --num_gpus 2 --master_port "$PORT" --module chatrl.step2_reward --resume \
  --model_name_or_path output/models/opt \
  --data_path "$HH/helpful-base" "$HH/harmless-base" "$HH/helpful-online" "$HH/helpful-rejection-sampled" \
  --data_split 2,4,4 --max_seq_len 256 --per_device_train_batch_size 4 --per_device_eval_batch_size 16 \
  --learning_rate 5e-4 --lr_scheduler_type cosine --num_train_epochs 1 --eval_interval 100 \
  --zero_stage "$ZERO_STAGE" --output_dir "$OUTPUT" "${@:3}" 2>&1 | tee "$OUTPUT/training.log"
