#!/usr/bin/env bash
# Step 3 on one GPU: OPT-1.3B actor (LoRA 128, gradient checkpointing) and an OPT-350M critic/reward, bf16.
# Usage: scripts/step3/single_gpu_opt1.3b.sh ACTOR_DIR CRITIC_DIR [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launch_common.sh
ACTOR=$1; CRITIC=$2; OUTPUT=${3:-output/step3_opt1.3b}
mkdir -p "$OUTPUT"
deepspeed --num_gpus 1 --master_port "$PORT" --module chatrl.step3_ppo --resume \
  --actor_model_name_or_path "$ACTOR" --critic_model_name_or_path "$CRITIC" \
  --data_path Dahoas/rm-static --data_split 2,4,4 --max_prompt_seq_len 256 --max_answer_seq_len 256 \
  --per_device_generation_batch_size 4 --per_device_training_batch_size 4 --generation_batches 1 --ppo_epochs 1 \
  --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 --dtype bf16 \
  --actor_zero_stage 0 --critic_zero_stage 0 --enable_hybrid_engine \
  --actor_lora_dim 128 --actor_lora_module_name decoder.layers. --actor_gradient_checkpointing \
  --enable_tensorboard --output_dir "$OUTPUT" "${@:4}" 2>&1 | tee "$OUTPUT/training.log"
