#!/usr/bin/env bash
# Step 1 then DPO on CPU: 2 ranks, ZeRO-3, gloo, stories260K (a pretrained tiny Llama) on hh-rlhf helpful-base;
# DPO starts from step 1's output with train.py's DPO settings (lr a tenth of step 1's, beta 0.1, RPO's SFT term
# --rpo_alpha 1, which keeps the answers ending with EOS: docs/dpo.md) and reports the share of greedy answers
# ending in EOS before and after. Minutes on 2 cores.
# Usage: scripts/step2_dpo/cpu_stories260k.sh [OUTPUT_DIR] [ZERO_STAGE] [extra DPO flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/launch_common.sh
OUTPUT=${1:-output/step2_dpo_stories}; ZERO_STAGE=${2:-3}
SHARED=${CHATRL_SHARED:-../shared}
HB=$SHARED/data/hh-rlhf/helpful-base
export DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
mkdir -p "$OUTPUT"
[ -f "$OUTPUT/sft/chatrl_run.json" ] || .venv/bin/deepspeed --num_gpus 2 --master_port "$PORT" --module chatrl.step1_sft --resume \
  --model_name_or_path "$SHARED/models/stories260K" --data_path "$HB[0:2000]" --data_split 10,0,0 \
  --max_seq_len 256 --per_device_train_batch_size 16 --learning_rate 2e-3 --num_warmup_steps 0.08 \
  --num_train_epochs 1 --eval_eos_samples 32 --zero_stage "$ZERO_STAGE" --output_dir "$OUTPUT/sft" \
  2>&1 | tee "$OUTPUT/sft.log"
.venv/bin/deepspeed --num_gpus 2 --master_port "$PORT" --module chatrl.step2_dpo --resume \
  --model_name_or_path "$OUTPUT/sft" --data_path "$HB[2000:4000]" --data_split 0,10,0 --eval_fraction 0.1 \
  --max_seq_len 256 --per_device_train_batch_size 8 --per_device_eval_batch_size 32 --learning_rate 2e-4 \
  --beta 0.1 --rpo_alpha 1.0 --num_train_epochs 1 --eval_interval 25 --eval_eos_samples 32 --save_interval 25 \
  --zero_stage "$ZERO_STAGE" --output_dir "$OUTPUT/dpo" "${@:3}" 2>&1 | tee "$OUTPUT/dpo.log"
echo "chat with it: .venv/bin/python chat.py --path $OUTPUT/dpo"
