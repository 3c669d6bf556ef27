#!/usr/bin/env bash
# Step 3 on several nodes (DeepSpeed hostfile): OPT-66B actor (ZeRO-3, LoRA, hybrid engine TP 4) and OPT-350M critic.
# Usage: HOSTFILE=/job/hostfile scripts/step3/multi_node_opt66b.sh ACTOR_DIR CRITIC_DIR [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
ACTOR=$1; CRITIC=$2; OUTPUT=${3:-output/step3_opt66b}; HOSTFILE=${HOSTFILE:-/job/hostfile}
mkdir -p "$OUTPUT"
deepspeed --hostfile "$HOSTFILE" --module chatrl.step3_ppo \
  --actor_model_name_or_path "$ACTOR" --critic_model_name_or_path "$CRITIC" \
  --data_path Dahoas/rm-static Dahoas/full-hh-rlhf --data_split 2,4,4 --max_prompt_seq_len 256 --max_answer_seq_len 256 \
  --per_device_generation_batch_size 2 --per_device_training_batch_size 2 --generation_batches 2 \
  --actor_learning_rate 5e-4 --critic_learning_rate 5e-6 --num_warmup_steps 100 --dtype bf16 \
  --actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --inference_tp_size 4 --tp_gather_partition_size 2 \
  --release_inference_cache --offload_reference_model \
  --actor_lora_dim 128 --actor_lora_module_name decoder.layers. --only_optimize_lora --actor_gradient_checkpointing \
  --enable_tensorboard --output_dir "$OUTPUT" "${@:4}" 2>&1 | tee "$OUTPUT/training.log"
