#!/usr/bin/env bash
# Step 3 on several nodes (DeepSpeed hostfile): OPT-66B actor (ZeRO-3, LoRA, hybrid engine TP 4) and OPT-350M critic.
# Usage: HOSTFILE=/job/hostfile scripts/step3/multi_node_opt66b.sh ACTOR_DIR CRITIC_DIR [OUTPUT_DIR]
#        (no-ssh mode: NODE_RANK=i MASTER_ADDR=node0 on every node; see docs/multi_node.md)
set -euo pipefail
cd "$(dirname "$0")/../.."
ACTOR=$1; CRITIC=$2; OUTPUT=${3:-output/step3_opt66b}; HOSTFILE=${HOSTFILE:-/job/hostfile}
# ssh mode (default): run on the first host; pdsh + passwordless ssh start the others (docs/multi_node.md).
# no-ssh mode (Slurm, Kubernetes): run on every node with NODE_RANK (0..N-1) and MASTER_ADDR (node 0) set.
LAUNCH=(--hostfile "$HOSTFILE")
if [ -n "${NODE_RANK:-}" ]; then
  LAUNCH+=(--no_ssh --node_rank "$NODE_RANK" --master_addr "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}")
fi
mkdir -p "$OUTPUT"
deepspeed "${LAUNCH[@]}" --module chatrl.step3_ppo \
  --actor_model_name_or_path "$ACTOR" --critic_model_name_or_path "$CRITIC" \
  --data_path Dahoas/rm-static Dahoas/full-hh-rlhf --data_split 2,4,4 --max_prompt_seq_len 256 --max_answer_seq_len 256 \
  --per_device_generation_batch_size 2 --per_device_training_batch_size 2 --generation_batches 2 \
  --actor_learning_rate 5e-4 --critic_learning_rate 5e-6 --num_warmup_steps 100 --dtype bf16 \
  --actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --inference_tp_size 4 --tp_gather_partition_size 2 \
  --release_inference_cache --offload_reference_model \
  --actor_lora_dim 128 --actor_lora_module_name decoder.layers. --only_optimize_lora --actor_gradient_checkpointing \
  --enable_tensorboard --output_dir "$OUTPUT" "${@:4}" 2>&1 | tee "$OUTPUT/training${NODE_RANK:+.node$NODE_RANK}.log"
