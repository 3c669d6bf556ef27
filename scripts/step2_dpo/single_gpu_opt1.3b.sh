#!/usr/bin/env bash
# DPO on one GPU: the step-1 OPT-1.3B actor, ZeRO-0, bf16, LoRA 128 with only the adapters trained, so the
# reference is the same model with its adapters disabled (no second copy). DeepSpeed-Chat's DPO settings.
# Usage: scripts/step2_dpo/single_gpu_opt1.3b.sh STEP1_OUTPUT [OUTPUT_DIR] [ZERO_STAGE] [extra flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launch_common.sh
ACTOR=${1:?give the step-1 output folder}; OUTPUT=${2:-output/step2_dpo_opt1.3b}; ZERO_STAGE=${3:-0}
mkdir -p "$OUTPUT"
deepspeed --num_gpus 1 --master_port "$PORT" --module chatrl.step2_dpo --resume \
  --model_name_or_path "$ACTOR" \
  --data_path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets \
  --data_split 2,4,4 --max_seq_len 512 --per_device_train_batch_size 8 --per_device_eval_batch_size 8 \
  --gradient_accumulation_steps 1 --learning_rate 9.65e-6 --lora_learning_rate 5e-4 --weight_decay 0.0 \
  --num_train_epochs 1 --lr_scheduler_type cosine --num_warmup_steps 0 --seed 1234 --dtype bf16 --disable_dropout \
  --beta 0.1 --label_smoothing 0.0 --lora_dim 128 --lora_module_name layers. --only_optimize_lora \
  --gradient_checkpointing --eval_interval 500 --eval_iters 100 --save_interval 200 --zero_stage "$ZERO_STAGE" \
  --enable_tensorboard --output_dir "$OUTPUT" "${@:4}" 2>&1 | tee "$OUTPUT/training.log"
