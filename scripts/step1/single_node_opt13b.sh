#!/usr/bin/env bash
# Step 1 on one node of 8 GPUs: OPT-13B, ZeRO-3, bf16, LoRA 128 (DeepSpeed-Chat's single-node recipe sizes).
# Usage: scripts/step1/single_node_opt13b.sh [OUTPUT_DIR] [ZERO_STAGE]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launch_common.sh
OUTPUT=${1:-output/step1_opt13b}; ZERO_STAGE=${2:-3}
mkdir -p "$OUTPUT"
deepspeed --master_port "$PORT" --module chatrl.step1_sft --resume \
  --model_name_or_path facebook/opt-13b \
  --data_path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets \
  --data_split 2,4,4 --max_seq_len 512 --per_device_train_batch_size 4 --per_device_eval_batch_size 4 \
  --gradient_accumulation_steps 1 --learning_rate 1e-4 --weight_decay 0.0 --num_train_epochs 16 \
  --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 --dtype bf16 --gradient_checkpointing \
  --lora_dim 128 --lora_module_name decoder.layers. --zero_stage "$ZERO_STAGE" \
  --enable_tensorboard --output_dir "$OUTPUT" "${@:3}" 2>&1 | tee "$OUTPUT/training.log"
