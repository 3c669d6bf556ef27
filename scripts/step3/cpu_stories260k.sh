#!/usr/bin/env bash
# Step 3 on CPU: 2 ranks, actor ZeRO-3 with the hybrid engine, stories260K actor from step 1 and a
# stories260K reward model from step 2 (see scripts/step1/cpu_stories260k_lora.sh, scripts/step2/).
# Usage: scripts/step3/cpu_stories260k.sh ACTOR_DIR CRITIC_DIR [OUTPUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launch_common.sh
ACTOR=$1; CRITIC=$2; OUTPUT=${3:-output/step3_cpu_stories260k}
SHARED=${CHATRL_SHARED:-../shared}
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
mkdir -p "$OUTPUT"
.venv/bin/deepspeed --num_gpus 2 --master_port "$PORT" --module chatrl.step3_ppo --resume \
  --actor_model_name_or_path "$ACTOR" --critic_model_name_or_path "$CRITIC" \
  --data_path "$SHARED/data/hh-rlhf/helpful-base" "$SHARED/data/prompts" --data_split 2,4,4 \
  --max_prompt_seq_len 128 --max_answer_seq_len 48 \
  --per_device_generation_batch_size 16 --per_device_training_batch_size 16 \
  --actor_learning_rate 3e-4 --critic_learning_rate 1e-3 --num_warmup_steps 0.125 --max_steps 40 \
  --actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --inference_tp_size 1 \
  --print_answers --output_dir "$OUTPUT" "${@:4}" 2>&1 | tee "$OUTPUT/training.log"
