#!/usr/bin/env bash
# The critic-free recipe on the real chat model: SmolLM2-135M-Instruct (python -m chatrl.models.model_zoo
# smollm2-135m-instruct first) learns "a two-digit number plus a digit" with a verifiable reward.
#   1. the task: 800 training and 200 held-out problems (scripts/make_arith_task.py), never the same;
#   2. train.py --preset smollm2: step 1 teaches the answer format on the training problems' answers,
#      step 3 runs GRPO (--reward-fn exact_match, 8 answers a prompt) on their prompts; no reward model;
#   3. held-out greedy exact match of step 1's actor and of step 3's, paired, with a 95 % interval:
#      OUTPUT/arith_eval.json.
# Usage: scripts/smollm2_arith_grpo.sh [OUTPUT]     (default output/smollm2_arith; a rerun resumes)
# Extra train.py flags go in TRAIN_ARGS, e.g. TRAIN_ARGS='--dtype fp32'.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-output/smollm2_arith}
PY=${PYTHON:-.venv/bin/python}
TASK=(--train 800 --eval 200 --seed 0 --ops + --max_second_operand 9 --overwrite)
$PY scripts/make_arith_task.py --output_dir "$OUT/data/sft" "${TASK[@]}" --with_answers
$PY scripts/make_arith_task.py --output_dir "$OUT/data/prompts" "${TASK[@]}"
# shellcheck disable=SC2086
$PY train.py --preset smollm2 --step 1 3 --output-dir "$OUT" --skip-eval \
  --rl-algorithm grpo --num-samples-per-prompt 8 --reward-fn exact_match \
  --data-path "$OUT/data/sft/train.jsonl" "$OUT/data/prompts/train.jsonl" \
  --step1-args "--max_seq_len 96 --per_device_train_batch_size 8 --gradient_accumulation_steps 1 --max_steps 20
                --learning_rate 1e-5 --num_warmup_steps 0 --eval_interval 0 --eval_eos_samples 0 --save_interval 0" \
  --step3-args "--max_prompt_seq_len 64 --max_answer_seq_len 8 --per_device_generation_batch_size 4
                --per_device_training_batch_size 32 --actor_learning_rate 2e-5 --num_warmup_steps 0
                --init_kl_coef 0.01 --max_steps 40 --save_interval 20 --save_hf_interval 20 --save_rollouts 0" \
  ${TRAIN_ARGS:-}
$PY scripts/eval_exact_match.py --model "$OUT/step3_rlhf/actor" --baseline "$OUT/step1_actor" \
  --data "$OUT/data/prompts/eval.jsonl" --max_new_tokens 8 | tee "$OUT/arith_eval.json"
