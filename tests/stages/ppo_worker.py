"""PPO on the pretrained tiny Llama (stories260K) with a rule-based reward, over the launcher's ranks.

Usage (under torchrun): ppo_worker.py RESULT_JSON WORK_DIR [--steps N] [--hybrid] [--zero STAGE]

The reward is 5 × the share of answer tokens whose text contains the letter "e" (a fixed token set):
PPO should raise it within a few dozen steps while the KL to the reference stays bounded. The
first PPO epoch is also checked for ratio == 1 and KL == 0 exactly (actor == reference, dropout
0.1 in the config).
"""

import argparse
import json
import os

import torch

from chatrl import dist
from chatrl.config import PPOConfig
from chatrl.data import PromptCollator, build_phase_data
from chatrl.dist import shutdown
from chatrl.models import load_tokenizer
from chatrl.step2_reward.model import load_reward_model, save_reward_model
from chatrl.step3_ppo import core
from chatrl.step3_ppo.engine import build_engines
from chatrl.step3_ppo.main import build_parser, make_generate, reduce_stats
from chatrl.step3_ppo.trainer import PPOTrainer, summarize
from tests.conftest import DATA, STORIES


def main():
    p = argparse.ArgumentParser()
    p.add_argument("result")
    p.add_argument("work")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--hybrid", action="store_true")
    p.add_argument("--zero", type=int, default=3)
    a = p.parse_args()
    info = dist.init_distributed()
    torch.manual_seed(1234 + info.rank)
    tok = load_tokenizer(str(STORIES), padding_side="left")
    critic_dir = os.path.join(a.work, "critic")
    critic = load_reward_model(str(STORIES), tok, require_head=False)
    torch.nn.init.zeros_(critic.hf.score.weight)  # V = 0 at first: advantages start as the returns
    save_reward_model(critic, tok, critic_dir)

    args = build_parser().parse_args([
        "--actor_model_name_or_path", str(STORIES), "--critic_model_name_or_path", critic_dir,
        "--data_path", str(DATA / "prompts"), "--output_dir", os.path.join(a.work, "out"),
        "--actor_zero_stage", str(a.zero), "--critic_zero_stage", str(a.zero), "--actor_dropout", "0.1",
        "--actor_learning_rate", "5e-4", "--critic_learning_rate", "5e-3", "--num_warmup_steps", "0",
        "--lr_scheduler_type", "constant", "--per_device_generation_batch_size", "32",
        "--per_device_training_batch_size", "32", "--max_prompt_seq_len", "32", "--max_answer_seq_len", "16",
        "--init_kl_coef", "0.3", *(["--enable_hybrid_engine"] if a.hybrid else [])])
    data = build_phase_data(3, args.data_path, tok, max_prompt_len=args.max_prompt_seq_len,
                            cache_dir=os.path.join(a.work, "cache"))
    engines = build_engines(args, tok, info, a.steps)
    hybrid, generate = make_generate(engines.actor, args, tok)
    letter_e = torch.tensor(["e" in tok.convert_ids_to_tokens(i) for i in range(len(tok))])

    def score_fn(seq, mask, prompt_len):
        answer, m = seq[:, prompt_len:], mask[:, prompt_len:].bool()
        hits = letter_e[answer.clamp(max=len(tok) - 1)] & m
        return 5.0 * hits.sum(1).float() / m.sum(1).clamp(min=1)

    settings = PPOConfig(per_device_training_batch_size=32, whiten_advantages=True, ppo_epochs=2)
    trainer = PPOTrainer(engines.actor, engines.critic, engines.reference, score_fn, generate,
                         core.FixedKLController(args.init_kl_coef), settings, tok.eos_token_id, tok.pad_token_id,
                         on_actor_step=hybrid.mark_weights_stale)
    collate = PromptCollator(tok.pad_token_id)
    rows = list(range(info.rank, len(data.train), info.world_size))
    curve, kls, first = [], [], None
    for step in range(a.steps):
        idx = [rows[(step * 32 + j) % len(rows)] for j in range(32)]
        batch = collate([data.train[i] for i in idx])
        exp, _ = trainer.make_experience(batch["input_ids"], batch["attention_mask"])
        if first is None:
            first = {"max_abs_kl": exp.kl[exp.action_mask > 0].abs().max().item(),
                     "logp_equals_ref": bool(torch.equal(exp.logp * exp.action_mask, exp.ref_logp * exp.action_mask))}
        if step == 0:  # exactly one PPO epoch on the first experience
            learned = {**trainer.train_actor(exp), **trainer.train_critic(exp)}
            first.update({k: float(learned[k]) for k in ("ratio_mean", "clip_frac", "approx_kl")})
        else:
            learned = trainer.learn(exp)
        stats = reduce_stats({**summarize(exp, trainer.kl_ctl.value, tok.eos_token_id), **learned})
        curve.append(stats["reward/score_mean"])
        kls.append(stats["kl"])
    if info.is_main:
        with open(a.result, "w") as f:
            json.dump({"reward": curve, "kl": kls, "first": first, "timings": hybrid.timings}, f)


if __name__ == "__main__":
    main()
    shutdown()
