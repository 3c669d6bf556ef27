#!/usr/bin/env bash
# Step 1 on CPU with the real pretrained tiny Llama (stories260K) and LoRA-only training, 2 ranks, ZeRO-3.
# Usage: scripts/step1/cpu_stories260k_lora.sh [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launch_common.sh
OUTPUT=${1:-output/step1_cpu_stories260k}
SHARED=${CHATRL_SHARED:-../shared}
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
mkdir -p "$OUTPUT"
.venv/bin/deepspeed --num_gpus 2 --master_port "$PORT" --module chatrl.step1_sft --resume \
  --model_name_or_path "$SHARED/models/stories260K" \
  --data_path "$SHARED/data/hh-rlhf/helpful-base" "$SHARED/data/alpaca-instructions" --data_split 2,4,4 \
  --max_seq_len 256 --per_device_train_batch_size 8 --learning_rate 1e-3 \
  --lora_dim 8 --lora_module_name layers. --only_optimize_lora --lora_learning_rate 5e-3 \
  --zero_stage 3 --output_dir "$OUTPUT" "${@:2}" 2>&1 | tee "$OUTPUT/training.log"
