#!/usr/bin/env bash
# Step 1 on CPU: 2 ranks, ZeRO-3, gloo, a tiny OPT on the offline hh-rlhf data. Minutes on 2 cores.
# Usage: scripts/step1/cpu_tiny_opt.sh [OUTPUT_DIR] [ZERO_STAGE]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launch_common.sh
OUTPUT=${1:-output/step1_cpu_opt}; ZERO_STAGE=${2:-3}
SHARED=${CHATRL_SHARED:-../shared}
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
[ -f output/models/opt/config.json ] || .venv/bin/python scripts/make_tiny_models.py --out output/models --family opt
mkdir -p "$OUTPUT"
.venv/bin/deepspeed --num_gpus 2 --master_port "$PORT" --module chatrl.step1_sft --resume \
  --model_name_or_path output/models/opt \
  --data_path "$SHARED/data/hh-rlhf/helpful-base" --data_split 10,0,0 \
  --max_seq_len 256 --per_device_train_batch_size 8 --per_device_eval_batch_size 16 \
  --learning_rate 1e-3 --num_warmup_steps 0.08 --num_train_epochs 1 --eval_interval 50 \
  --zero_stage "$ZERO_STAGE" --eval_eos_samples 32 --output_dir "$OUTPUT" "${@:3}" 2>&1 | tee "$OUTPUT/training.log"
