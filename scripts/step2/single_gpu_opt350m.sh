#!/usr/bin/env bash
# Step 2 on one GPU: OPT-350m reward model (DeepSpeed-Chat's default critic size), ZeRO-0, bf16.
# Usage: scripts/step2/single_gpu_opt350m.sh [OUTPUT_DIR] [ZERO_STAGE] [extra flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launch_common.sh
OUTPUT=${1:-output/step2_opt350m}; ZERO_STAGE=${2:-0}
mkdir -p "$OUTPUT"
deepspeed --num_gpus 1 --master_port "$PORT" --module chatrl.step2_reward --resume \
  --model_name_or_path facebook/opt-350m \
  --data_path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets \
  --data_split 2,4,4 --max_seq_len 512 --per_device_train_batch_size 16 --per_device_eval_batch_size 16 \
  --gradient_accumulation_steps 1 --learning_rate 5e-5 --weight_decay 0.1 --num_train_epochs 1 \
  --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 --dtype bf16 --disable_dropout \
  --eval_interval 500 --eval_iters 100 --zero_stage "$ZERO_STAGE" \
  --enable_tensorboard --output_dir "$OUTPUT" "${@:3}" 2>&1 | tee "$OUTPUT/training.log"
