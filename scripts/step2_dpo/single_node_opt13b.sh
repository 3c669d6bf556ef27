#!/usr/bin/env bash
# DPO on one node of 8 GPUs: the step-1 OPT-13B actor, ZeRO-3, bf16, gradient checkpointing; the frozen
# reference is a ZeRO-3 partitioned copy offloaded to CPU, its log-probs precomputed once before training.
# Usage: scripts/step2_dpo/single_node_opt13b.sh STEP1_OUTPUT [OUTPUT_DIR] [ZERO_STAGE] [extra flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launch_common.sh
ACTOR=${1:?give the step-1 output folder}; OUTPUT=${2:-output/step2_dpo_opt13b}; ZERO_STAGE=${3:-3}
mkdir -p "$OUTPUT"
deepspeed --master_port "$PORT" --module chatrl.step2_dpo --resume \
  --model_name_or_path "$ACTOR" \
  --data_path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets \
  --data_split 2,4,4 --max_seq_len 512 --per_device_train_batch_size 4 --per_device_eval_batch_size 4 \
  --gradient_accumulation_steps 2 --learning_rate 1e-6 --weight_decay 0.0 --num_train_epochs 1 \
  --lr_scheduler_type cosine --num_warmup_steps 100 --seed 1234 --dtype bf16 --disable_dropout \
  --beta 0.1 --label_smoothing 0.0 --offload_reference_model --precompute_ref_log_probs \
  --gradient_checkpointing --eval_interval 500 --eval_iters 100 --save_interval 200 --zero_stage "$ZERO_STAGE" \
  --enable_tensorboard --output_dir "$OUTPUT" "${@:4}" 2>&1 | tee "$OUTPUT/training.log"
