#!/usr/bin/env bash
# Step 1 on several nodes (a DeepSpeed hostfile: one "host slots=N" line per node): Llama-2-70B, ZeRO-3,
# bf16, CPU offload of optimizer states, LoRA 128.
# Usage: HOSTFILE=/job/hostfile scripts/step1/multi_node_llama2_70b.sh [OUTPUT_DIR] [ZERO_STAGE]
#        (no-ssh mode: NODE_RANK=i MASTER_ADDR=node0 on every node; see docs/multi_node.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUTPUT=${1:-output/step1_llama2_70b}; ZERO_STAGE=${2:-3}; HOSTFILE=${HOSTFILE:-/job/hostfile}
# ssh mode (default): run on the first host; pdsh + passwordless ssh start the others (docs/multi_node.md).
# no-ssh mode (Slurm, Kubernetes): run on every node with NODE_RANK (0..N-1) and MASTER_ADDR (node 0) set.
LAUNCH=(--hostfile "$HOSTFILE")
if [ -n "${NODE_RANK:-}" ]; then
  LAUNCH+=(--no_ssh --node_rank "$NODE_RANK" --master_addr "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}")
fi
mkdir -p "$OUTPUT"
deepspeed "${LAUNCH[@]}" --module chatrl.step1_sft \
  --model_name_or_path meta-llama/Llama-2-70b-hf \
  --data_path Dahoas/rm-static Dahoas/full-hh-rlhf Dahoas/synthetic-instruct-gptj-pairwise yitingxie/rlhf-reward-datasets \
  --data_split 2,4,4 --max_seq_len 512 --per_device_train_batch_size 2 --per_device_eval_batch_size 2 \
  --gradient_accumulation_steps 2 --learning_rate 5e-5 --weight_decay 0.0 --num_train_epochs 4 \
  --lr_scheduler_type cosine --num_warmup_steps 100 --seed 1234 --dtype bf16 --gradient_checkpointing --offload \
  --lora_dim 128 --lora_module_name layers. --zero_stage "$ZERO_STAGE" \
  --enable_tensorboard --output_dir "$OUTPUT" "${@:3}" 2>&1 | tee "$OUTPUT/training${NODE_RANK:+.node$NODE_RANK}.log"
