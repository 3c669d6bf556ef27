#!/usr/bin/env bash
# Step 3 on one node of 8 GPUs: OPT-13B actor (ZeRO-3, hybrid engine with TP 2, LoRA 128) and OPT-350M critic.
# Usage: scripts/step3/single_node_opt13b.sh ACTOR_DIR CRITIC_DIR [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launch_common.sh
ACTOR=$1; CRITIC=$2; OUTPUT=${3:-output/step3_opt13b}
mkdir -p "$OUTPUT"
deepspeed --master_port "$PORT" --module chatrl.step3_ppo --resume \
  --actor_model_name_or_path "$ACTOR" --critic_model_name_or_path "$CRITIC" \
  --data_path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets \
  --data_split 2,4,4 --max_prompt_seq_len 256 --max_answer_seq_len 256 \
  --per_device_generation_batch_size 4 --per_device_training_batch_size 4 --generation_batches 1 --ppo_epochs 1 \
  --actor_learning_rate 5e-4 --critic_learning_rate 5e-6 --dtype bf16 \
  --actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --inference_tp_size 2 \
  --tp_gather_partition_size 4 --release_inference_cache \
  --actor_lora_dim 128 --actor_lora_module_name decoder.layers. --actor_gradient_checkpointing --only_optimize_lora \
  --enable_tensorboard --output_dir "$OUTPUT" "${@:4}" 2>&1 | tee "$OUTPUT/training.log"
