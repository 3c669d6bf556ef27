"""One TRL 1.12 trainer (SFT, reward, DPO, PPO or GRPO) on the peer benchmark's set-up; runs in the TRL venv only.

Started by ``bench/peers/run.py`` as ``torchrun --nproc_per_node 2 trl_stage.py STAGE ...`` with the
TRL venv's python (TRL is never imported by chatrl or its tests). Writes one JSON file (rank 0):
``samples_per_s`` over the training loop without its first step (the same definition as
``run.py`` applies to chatrl's metrics log), the step times, and for the reward model the eval
accuracy on the eval pairs (share with ``r_chosen > r_rejected``; ties count as wrong).

Data (written by ``run.py``): ``pairs_train.jsonl`` / ``pairs_eval.jsonl`` with ``prompt`` (the
transcript up to and including the last "\\n\\nAssistant:"), ``chosen`` and ``rejected`` (the
answers after it). GRPO reads chatrl prompt rows (``scripts/make_arith_task.py``: ``prompt``,
``reference``) and scores answers with chatrl's own ``exact_match`` rule, loaded from its file
(``chatrl/rewards/builtin.py``, plain Python) so that both sides reward alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainerCallback,
)


class StepClock(TrainerCallback):
    """Wall-clock time at the end of every optimizer step (SFT, reward) or PPO update."""

    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def loop_rate(clock: StepClock, samples_per_step: int) -> float:
    """Samples/s from the end of step 1 to the end of the last step (step 1 holds one-off warm-up)."""
    if len(clock.ends) < 2:
        return float("nan")
    return (len(clock.ends) - 1) * samples_per_step / (clock.ends[-1] - clock.ends[0])


def common_args(a) -> dict:
    return dict(output_dir=a.out, per_device_train_batch_size=a.batch, gradient_accumulation_steps=1,
                max_steps=a.steps, bf16=a.dtype == "bf16", fp16=False, use_cpu=True, seed=1, logging_steps=10,
                save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
                dataloader_num_workers=0)


def completion_rows(tok, rows, n):
    """The examples SFTTrainer makes of prompt/completion rows, made here: ``input_ids`` of prompt +
    completion + EOS and ``labels`` (-100 on the prompt), both cut to their last ``n`` tokens, rows
    left without a label dropped. TRL 1.12's padding-free mode does not truncate (it refuses a
    ``max_length``), so its data set is given already tokenized and cut this way."""
    out = []
    for r in rows:
        prompt = tok(r["prompt"])["input_ids"]
        ids = tok(r["prompt"] + r["chosen"] + tok.eos_token)["input_ids"]
        labels = [-100] * len(prompt) + ids[len(prompt):]
        ids, labels = ids[-n:], labels[-n:]
        if any(x != -100 for x in labels):
            out.append({"input_ids": ids, "labels": labels})
    return out


def sft(a, tok, world):
    from trl import SFTConfig, SFTTrainer

    rows = read(os.path.join(a.data, "pairs_train.jsonl"))
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    if a.padding_free:  # one flattened row per batch, position ids restarting at 0, no attention mask
        ds = Dataset.from_list(completion_rows(tok, rows, a.seq_len))
        cfg = SFTConfig(**common_args(a), learning_rate=1e-3, max_length=None, padding_free=True, packing=False)
    else:
        ds = Dataset.from_list([{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows])
        cfg = SFTConfig(**common_args(a), learning_rate=1e-3, max_length=a.seq_len, truncation_mode="keep_end",
                        completion_only_loss=True, packing=False)
    clock = StepClock()
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[clock])
    trainer.train()
    return {"samples_per_s": loop_rate(clock, a.batch * world), "steps": len(clock.ends),
            "train_loss": trainer.state.log_history[-1].get("train_loss"),
            "logged_losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}


def dpo(a, tok, world):
    from trl import DPOConfig, DPOTrainer

    rows = read(os.path.join(a.data, "pairs_train.jsonl"))
    ds = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    # TRL 1.12 keeps the start of an over-long pair (its only truncation mode); padding_free=True is
    # accepted but switched off with a warning ("temporarily unavailable"), so it is run padded only
    cfg = DPOConfig(**common_args(a), learning_rate=5e-6, beta=0.1, max_length=a.seq_len)
    clock = StepClock()
    trainer = DPOTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[clock])
    trainer.train()
    return {"samples_per_s": loop_rate(clock, a.batch * world), "steps": len(clock.ends)}


def _left_truncated(tok, text, n):
    return tok(text + tok.eos_token)["input_ids"][-n:]


@torch.no_grad()
def accuracy(model, tok, pairs, n):
    """Share of pairs scored r_chosen > r_rejected (full sequences left-truncated to n tokens)."""
    model.eval()
    wins = 0
    for r in pairs:
        ids = [_left_truncated(tok, r["prompt"] + r[k], n) for k in ("chosen", "rejected")]
        scores = [model(input_ids=torch.tensor([x])).logits[0, 0].item() for x in ids]
        wins += scores[0] > scores[1]
    return wins / len(pairs)


def reward(a, tok, world):
    from trl import RewardConfig, RewardTrainer

    def tokenized(rows):  # TRL 1.12 drops over-long pairs; left-truncate instead, as chatrl keeps them
        return Dataset.from_list([{"chosen_ids": _left_truncated(tok, r["prompt"] + r["chosen"], a.seq_len),
                                   "rejected_ids": _left_truncated(tok, r["prompt"] + r["rejected"], a.seq_len)}
                                  for r in rows])

    model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    cfg = RewardConfig(**common_args(a), learning_rate=5e-4, max_length=a.seq_len)
    clock = StepClock()
    trainer = RewardTrainer(model=model, args=cfg, train_dataset=tokenized(read(os.path.join(a.data, "pairs_train.jsonl"))),
                            processing_class=tok, callbacks=[clock])
    trainer.train()  # no trainer.evaluate() before train(): under torchrun it leaves the model without DDP
    out = {"samples_per_s": loop_rate(clock, a.batch * world), "steps": len(clock.ends)}
    if int(os.environ.get("RANK", "0")) == 0:
        evals = read(os.path.join(a.data, "pairs_eval.jsonl"))
        out.update(eval_accuracy=accuracy(trainer.accelerator.unwrap_model(trainer.model), tok, evals, a.seq_len),
                   eval_pairs=len(evals))
    return out


def ppo(a, tok, world):
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    tok.padding_side = "left"
    prompts = [tok(r["prompt"])["input_ids"][-a.prompt_len:] for r in read(os.path.join(a.data, "pairs_train.jsonl"))]
    ds = Dataset.from_list([{"input_ids": p} for p in prompts])
    policy = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    rm = AutoModelForSequenceClassification.from_pretrained(a.reward_model, num_labels=1, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(a.reward_model, num_labels=1, dtype=torch.float32)
    args = common_args(a)
    args.pop("max_steps")
    cfg = PPOConfig(**args, total_episodes=a.steps * a.batch * world, num_ppo_epochs=1, num_mini_batches=1,
                    response_length=a.answer_len, stop_token="eos", temperature=0.7, learning_rate=3e-6,
                    num_sample_generations=0, sft_model_path=a.model, reward_model_path=a.reward_model)
    clock = StepClock()
    trainer = PPOTrainer(args=cfg, processing_class=tok, model=policy, ref_model=ref, reward_model=rm,
                         value_model=value, train_dataset=ds, eval_dataset=ds.select(range(8)), callbacks=[clock])
    trainer.train()
    return {"samples_per_s": loop_rate(clock, a.batch * world), "steps": len(clock.ends)}


def _chatrl_exact_match():
    """chatrl's ``exact_match`` reward, loaded from its source file without importing chatrl."""
    path = Path(__file__).resolve().parents[2] / "chatrl" / "rewards" / "builtin.py"
    spec = importlib.util.spec_from_file_location("chatrl_builtin_rewards", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.exact_match


def grpo(a, tok, world):
    """``GRPOTrainer`` on the prompt rows at ``a.data`` (one user turn each, through the chat template),
    ``a.batch`` answers per rank and step in groups of ``a.num_generations``, one update per
    generation, KL coefficient ``a.beta`` (0: no reference model, TRL's default)."""
    from trl import GRPOConfig, GRPOTrainer

    rows = read(a.data)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "reference": r["reference"]}
                            for r in rows])
    exact_match = _chatrl_exact_match()

    def reward(prompts, completions, reference, **kwargs):
        answers = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return exact_match(prompts, answers, [{"reference": x} for x in reference])

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    # gradient checkpointing is GRPOConfig's default; off here, as chatrl does not checkpoint (and it is
    # faster); without it the Trainer's DDP would look for unused parameters every step (it warns), so not
    cfg = GRPOConfig(**common_args(a), learning_rate=a.learning_rate, lr_scheduler_type="constant",
                     num_generations=a.num_generations, max_completion_length=a.answer_len, temperature=1.0,
                     top_p=1.0, top_k=0, beta=a.beta, num_iterations=1, gradient_checkpointing=False,
                     ddp_find_unused_parameters=False, weight_decay=0.0, max_grad_norm=1.0)
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[clock])
    trainer.train()
    return {"samples_per_s": loop_rate(clock, a.batch * world), "steps": len(clock.ends),
            "rewards": [h.get("reward") for h in trainer.state.log_history if "reward" in h]}


def main():
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=["sft", "reward", "dpo", "ppo", "grpo"])
    p.add_argument("--model", required=True)
    p.add_argument("--reward_model", help="ppo: reward model and value-model initialisation")
    p.add_argument("--data", required=True, help="the pairs' folder; grpo: the prompt rows' file")
    p.add_argument("--out", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (sft, reward) or PPO updates")
    p.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--answer_len", type=int, default=64)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: the trainers' bf16=True (HF mixed precision: fp32 weights, bf16 autocast)")
    p.add_argument("--num_generations", type=int, default=4, help="grpo: answers per prompt")
    p.add_argument("--learning_rate", type=float, default=5e-6, help="grpo: constant learning rate")
    p.add_argument("--beta", type=float, default=0.0, help="grpo: KL coefficient (0: no reference model)")
    p.add_argument("--padding_free", action="store_true",
                   help="sft: SFTConfig(padding_free=True), each batch flattened into one row")
    a = p.parse_args()
    t0 = time.time()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tok = AutoTokenizer.from_pretrained(a.model)
    result = {"sft": sft, "reward": reward, "dpo": dpo, "ppo": ppo, "grpo": grpo}[a.stage](a, tok, world)
    result.update(stage=a.stage, world_size=world, in_process_s=time.time() - t0)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(a.result, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
