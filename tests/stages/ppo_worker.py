"""PPO on the pretrained tiny Llama (stories260K) with a rule-based reward, through step 3's real loop
(:func:`chatrl.step3_ppo.main.build` with a ``score_fn``, and :func:`~chatrl.step3_ppo.main.train`).

Usage (under torchrun): ppo_worker.py RESULT_JSON WORK_DIR [--steps N] [--hybrid] [--zero STAGE]
[--model FOLDER] [-- EXTRA STEP-3 FLAGS]

The reward is 5 × the share of answer tokens whose text contains the letter "e" (a fixed token set):
PPO should raise it within a few dozen steps while the KL to the reference stays bounded. The
first PPO micro-batch is also checked for ratio == 1 and KL == 0 exactly (actor == reference,
dropout 0.1 in the config).
"""

import argparse
import json
import os
import sys

import torch

from chatrl.cli import parse
from chatrl.distributed import dist
from chatrl.distributed.dist import run_program
from chatrl.models.causal_lm import load_tokenizer
from chatrl.models.reward_model import load_reward_model, save_reward_model
from chatrl.step3_ppo.main import build, build_parser, train
from chatrl.tracking import METRICS_FILE, read_metrics
from tests.conftest import DATA, STORIES


def main():
    p = argparse.ArgumentParser()
    p.add_argument("result")
    p.add_argument("work")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hybrid", action="store_true")
    p.add_argument("--zero", type=int, default=3)
    p.add_argument("--model", default=str(STORIES), help="actor and critic backbone (default: stories260K)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a, extra = p.parse_args(argv[:cut]), argv[cut + 1:]
    info = dist.init_distributed()
    tok = load_tokenizer(a.model, padding_side="left")
    critic_dir = os.path.join(a.work, "critic")
    critic = load_reward_model(a.model, tok, require_head=False)
    torch.nn.init.zeros_(critic.hf.score.weight)  # V = 0 at first: advantages start as the returns
    save_reward_model(critic, tok, critic_dir)  # all ranks call it (rank 0 writes)
    out = os.path.join(a.work, "out")
    args = parse(build_parser(), [
        "--actor_model_name_or_path", a.model, "--critic_model_name_or_path", critic_dir,
        "--data_path", str(DATA / "prompts"), "--data_output_path", os.path.join(a.work, "cache"),
        "--output_dir", out, "--disable_progress_bar",
        "--actor_zero_stage", str(a.zero), "--critic_zero_stage", str(a.zero), "--actor_dropout", "0.1",
        "--actor_learning_rate", "5e-4", "--critic_learning_rate", "5e-3", "--num_warmup_steps", "0",
        "--lr_scheduler_type", "constant", "--per_device_generation_batch_size", "32",
        "--per_device_training_batch_size", "32", "--max_prompt_seq_len", "32", "--max_answer_seq_len", "16",
        "--init_kl_coef", "0.3", "--whiten_advantages", "--ppo_epochs", "2", "--num_train_epochs", "100",
        "--max_steps", str(a.steps), *(["--enable_hybrid_engine"] if a.hybrid else []), *extra])
    letter_e = torch.tensor(["e" in tok.convert_ids_to_tokens(i) for i in range(len(tok))])

    def score_fn(seq, mask, prompt_len):
        answer, m = seq[:, prompt_len:], mask[:, prompt_len:].bool()
        hits = letter_e[answer.clamp(max=len(tok) - 1)] & m
        return 5.0 * hits.sum(1).float() / m.sum(1).clamp(min=1)

    run = build(args, score_fn=score_fn)
    first = {}
    learn, train_actor = run.trainer.learn, run.trainer.train_actor

    def first_learn(exp, *xs):  # records the first experience's exactness (filled in by now on either path)
        out = learn(exp, *xs)
        if "max_abs_kl" not in first:
            first.update(max_abs_kl=exp.kl[exp.action_mask > 0].abs().max().item(),
                         logp_equals_ref=bool(torch.equal(exp.logp * exp.action_mask, exp.ref_logp * exp.action_mask)))
        return out

    def first_actor_step(exp, *xs):  # the first micro-batch of the first PPO epoch: ratio exactly 1
        stats = train_actor(exp, *xs)
        if "ratio_mean" not in first:
            first.update({k: float(stats[k]) for k in ("ratio_mean", "clip_frac", "approx_kl")})
        return stats

    run.trainer.learn, run.trainer.train_actor = first_learn, first_actor_step
    train(run)
    if info.is_main:
        rows = [r for r in read_metrics(os.path.join(out, METRICS_FILE)) if "kl" in r]
        with open(a.result, "w") as f:
            json.dump({"reward": [r["reward/score_mean"] for r in rows], "kl": [r["kl"] for r in rows],
                       "rows": rows, "first": first, "timings": run.hybrid.timings}, f)
    return run  # run_program leaves the group with the engines still referenced


if __name__ == "__main__":
    run_program(main)
