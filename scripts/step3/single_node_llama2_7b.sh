#!/usr/bin/env bash
# Step 3 on one node of 8 GPUs, Llama family: Llama-2-7B actor (ZeRO-3, hybrid engine TP 2) and a
# Llama-2-7B reward model as critic (ZeRO-3, reward model offloaded), bf16.
# Usage: scripts/step3/single_node_llama2_7b.sh ACTOR_DIR CRITIC_DIR [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launch_common.sh
ACTOR=$1; CRITIC=$2; OUTPUT=${3:-output/step3_llama2_7b}
mkdir -p "$OUTPUT"
deepspeed --master_port "$PORT" --module chatrl.step3_ppo --resume \
  --actor_model_name_or_path "$ACTOR" --critic_model_name_or_path "$CRITIC" \
  --data_path Dahoas/rm-static --data_split 2,4,4 --max_prompt_seq_len 256 --max_answer_seq_len 256 \
  --per_device_generation_batch_size 4 --per_device_training_batch_size 4 \
  --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 --dtype bf16 \
  --actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --inference_tp_size 2 \
  --actor_gradient_checkpointing --critic_gradient_checkpointing --offload_reference_model --offload_reward_model \
  --enable_ema --enable_tensorboard --output_dir "$OUTPUT" "${@:4}" 2>&1 | tee "$OUTPUT/training.log"
