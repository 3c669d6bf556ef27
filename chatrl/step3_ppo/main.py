"""Step 3: RLHF with PPO (Ouyang et al., 2022; Stiennon et al., 2020) on the step-1 actor and step-2 reward model.

Read top to bottom: flags, set-up (distributed, prompts, the four models, the hybrid engine), the
loop (make experience → PPO epochs on it → log), then the HF-format saves of ``actor/``,
``critic/`` and (``--enable_ema``) ``actor_ema/`` under ``--output_dir``. The maths lives in
:mod:`chatrl.step3_ppo.core`; ``docs/ppo.md`` lists the implementation details and metrics.

``--rl_algorithm grpo|rloo|reinforce_pp`` trains critic-free instead (no critic engine, no reward
model when ``--reward_fn``/``--reward_url`` give the reward): the loop's other branch, driven by
:class:`chatrl.step3_ppo.critic_free_trainer.CriticFreeTrainer`; see ``docs/critic_free.md``.

Run ``python -m chatrl.step3_ppo --help`` for the flags (DeepSpeed-Chat's names).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from chatrl import cli, config
from chatrl.config import setting
from chatrl.tracking import Tracker, setup_logging

log = logging.getLogger("chatrl.step3")


ACTOR_CRITIC = ("actor_", "critic_")


@dataclass
class Step3ModelsConfig:
    """The frozen reward model."""

    reward_model_name_or_path: str | None = setting(None, "frozen reward model (unset: the critic's step-2 folder)",
                                                    type=str)


def build_parser():
    """Step 3's flags: the blocks of :mod:`chatrl.config`, per-model ones for the actor and the critic."""
    p = config.new_parser("chatrl step 3: RLHF fine-tuning of the actor with PPO", prog="python -m chatrl.step3_ppo")
    config.add_block(p, config.ModelConfig, prefixes=ACTOR_CRITIC, title="models",
                     defaults={"critic_model_name_or_path": None})  # required by PPO, checked in build()
    config.add_block(p, Step3ModelsConfig)
    config.add_block(p, config.RewardConfig)
    config.add_block(p, config.LoraConfig, prefixes=ACTOR_CRITIC)
    config.add_block(p, config.DataConfig, only=("data_path", "data_split", "data_output_path",
                                                 "unsupervised_dataset_name"))
    config.add_block(p, config.RolloutConfig)
    config.add_block(p, config.OptimConfig, prefixes=ACTOR_CRITIC,
                     defaults={"actor_learning_rate": 9.65e-6, "critic_learning_rate": 5e-6, "num_warmup_steps": 100})
    config.add_block(p, config.PPOConfig)
    config.add_block(p, config.SamplingConfig)
    config.add_block(p, config.ZeroConfig, prefixes=ACTOR_CRITIC)
    config.add_block(p, config.HybridEngineConfig)
    config.add_block(p, config.LogConfig)
    config.add_block(p, config.CheckpointConfig)
    return p


def make_generate(actor_engine, args, tokenizer, logprobs: bool = False):
    """The rollout function: the hybrid engine's generate with the sampling flags bound, run inside
    :meth:`HybridEngine.inference` so that training always runs in the training layout (and
    ``--release_inference_cache`` frees the inference copy after every rollout). With ``logprobs``
    it returns ``(sequences, sampler log-probs of the sampled tokens)``."""
    from chatrl.hybrid_engine import HybridEngine
    from chatrl.models import sampling_settings, stop_token_ids

    hybrid = HybridEngine(actor_engine, enable=args.enable_hybrid_engine, inference_tp_size=args.inference_tp_size,
                          tp_gather_partition_size=args.tp_gather_partition_size,
                          release_inference_cache=args.release_inference_cache)

    def generate(ids, mask):
        with hybrid.inference():
            return hybrid.generate(ids, mask, max_new_tokens=args.max_answer_seq_len,
                                   **sampling_settings(args.temperature, args.top_k, args.top_p),
                                   eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                   output_logprobs=logprobs)

    return hybrid, generate


def reward_model_scores(reward_engine, micro_batch: int):
    """The production reward: the frozen reward model's end score, ``micro_batch`` rollouts per pass
    (a :data:`~chatrl.step3_ppo.trainer.ScoreFn`)."""

    @torch.no_grad()
    def score_fn(seq, mask, prompt_len):
        return torch.cat([reward_engine(seq[i:i + micro_batch], mask[i:i + micro_batch]).end_scores
                          for i in range(0, len(seq), micro_batch)])

    return score_fn


def reduce_stats(stats: dict) -> dict:
    """Mean of each statistic over ranks (every rank holds the same number of rollouts)."""
    from chatrl.dist import all_reduce_mean

    keys = sorted(stats)
    vals = all_reduce_mean(torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64))
    return dict(zip(keys, vals.tolist(), strict=False))


def check_reward_flags(args) -> bool:
    """Check the model and reward flags of ``args`` together; return whether a reward model is loaded.

    A reward model is loaded when no ``--reward_fn``/``--reward_url`` is given, or when
    ``--reward_model_name_or_path`` is given next to them (then all are summed). PPO needs a critic
    (``--critic_model_name_or_path``) and, for now, takes its reward from a reward model only.

    Raises:
        ValueError: naming the flags.
    """
    rule_rewards = bool(args.reward_fn or args.reward_url)
    use_model = not rule_rewards or bool(args.reward_model_name_or_path)
    if args.rl_algorithm == "ppo":
        if not args.critic_model_name_or_path:
            raise ValueError("--rl_algorithm ppo needs --critic_model_name_or_path (the step-2 reward model that "
                             "initialises the critic); or choose a critic-free --rl_algorithm (grpo, rloo, reinforce_pp)")
        if rule_rewards:
            raise ValueError("--reward_fn/--reward_url are used by the critic-free algorithms (--rl_algorithm grpo, "
                             "rloo, reinforce_pp); with ppo the reward is the reward model")
    elif use_model and not (args.reward_model_name_or_path or args.critic_model_name_or_path):
        raise ValueError(f"--rl_algorithm {args.rl_algorithm} needs a reward: --reward_fn, --reward_url or "
                         "--reward_model_name_or_path")
    if args.unsupervised_dataset_name and args.rl_algorithm != "ppo":
        raise ValueError(f"--unsupervised_dataset_name (the PTX loss) is not supported with --rl_algorithm "
                         f"{args.rl_algorithm} yet")
    return use_model


def make_reward(args, reward_engine):
    """The weighted reward of a critic-free run (:func:`chatrl.rewards.build_reward`): the reward
    model (when loaded), ``--reward_fn`` functions and ``--reward_url`` servers."""
    from chatrl.rewards import ModelReward, build_reward

    model = (ModelReward(reward_model_scores(reward_engine, args.per_device_training_batch_size))
             if reward_engine is not None else None)
    return build_reward(args.reward_fn, args.reward_url, model, http_timeout=args.reward_http_timeout,
                        http_retries=args.reward_http_retries, http_batch_size=args.reward_http_batch_size)


@dataclass
class Step3Run:
    """Everything a step-3 run is made of, built by :func:`build` and trained by :func:`train`."""

    args: object
    info: object
    tokenizer: object
    plan: object  # chatrl.sizes.PPOPlan
    loader: object  # prompts, per_device_generation_batch_size per batch
    ptx_iter: object | None  # Cycle of PTX text batches (--unsupervised_dataset_name)
    engines: object  # chatrl.step3_ppo.engine.RLHFEngines
    hybrid: object  # chatrl.hybrid_engine.HybridEngine
    kl_ctl: object
    trainer: object  # chatrl.step3_ppo.trainer.PPOTrainer
    tracker: object
    ckpt: object  # chatrl.checkpoint.LoopCheckpoints


def main(argv: list[str] | None = None) -> dict:
    """Run step 3; returns the last logged metrics."""
    return run(argv)["metrics"]


def run(argv: list[str] | None = None) -> dict:
    """Run step 3 and return ``{"metrics", "run"}``: the last logged metrics and the
    :class:`Step3Run`, whose engines the caller keeps until the process group is shut down
    (:func:`chatrl.dist.run_program`)."""
    step3 = build(cli.parse(build_parser(), argv))
    return {"metrics": train(step3), "run": step3}


def build(args) -> Step3Run:
    """Set up a step-3 run from parsed flags: distributed, prompts (and PTX text), the derived sizes,
    the four models, the hybrid engine, the KL controller, the trainer (scoring with the reward
    model), the tracker and the checkpoints. All ranks call it."""
    from transformers import set_seed

    from chatrl import dist
    from chatrl.checkpoint import Cycle, LoopCheckpoints, check_output_dir
    from chatrl.data import PromptCollator, SFTCollator, build_phase_data
    from chatrl.models import check_context_window, load_tokenizer, sampling_settings, stop_token_ids
    from chatrl.resilience import set_progress
    from chatrl.sizes import plan_ppo
    from chatrl.step3_ppo import core
    from chatrl.step3_ppo.critic_free_trainer import CriticFreeTrainer
    from chatrl.step3_ppo.engine import build_engines, check_tokenizers_compatible, seed_rollouts
    from chatrl.step3_ppo.trainer import PPOTrainer

    sampling_settings(args.temperature, args.top_k, args.top_p)  # bad sampling flags fail here, not after loading
    check_context_window([args.actor_model_name_or_path, args.critic_model_name_or_path, args.reward_model_name_or_path],
                         {"--max_prompt_seq_len + --max_answer_seq_len": args.max_prompt_seq_len + args.max_answer_seq_len},
                         args.trust_remote_code)
    set_progress("step 3 (PPO)")
    info = dist.init_distributed()
    setup_logging(info.rank)
    check_output_dir(args.output_dir, args.overwrite_output_dir)
    set_seed(args.seed)
    critic_free = args.rl_algorithm != "ppo"
    use_reward_model = check_reward_flags(args)
    tokenizer = load_tokenizer(args.actor_model_name_or_path, padding_side="left",
                               trust_remote_code=args.trust_remote_code)
    reward_path = args.reward_model_name_or_path or args.critic_model_name_or_path
    if use_reward_model:
        check_tokenizers_compatible(tokenizer, load_tokenizer(reward_path), args.actor_model_name_or_path, reward_path)

    data = build_phase_data(3, args.data_path, tokenizer, data_split=args.data_split,
                            max_prompt_len=args.max_prompt_seq_len, seed=args.seed, cache_dir=args.data_output_path)
    loader = dist.seeded_loader(data.train, args.per_device_generation_batch_size,
                                PromptCollator(tokenizer.pad_token_id, with_metadata=critic_free),
                                info, args.seed, drop_last=True)
    plan = plan_ppo(len(loader), len(data.train), info.world_size, args.per_device_generation_batch_size,
                    args.per_device_training_batch_size, args.generation_batches, args.ppo_epochs,
                    args.gradient_accumulation_steps, args.num_train_epochs, args.max_steps,
                    args.num_warmup_steps, ptx=bool(args.unsupervised_dataset_name),
                    rl_algorithm=args.rl_algorithm, num_samples_per_prompt=args.num_samples_per_prompt)
    ptx_iter = None
    if args.unsupervised_dataset_name:
        unsup = build_phase_data(1, args.unsupervised_dataset_name, tokenizer, data_split="10,0,0",
                                 max_seq_len=args.max_prompt_seq_len + args.max_answer_seq_len, seed=args.seed,
                                 cache_dir=args.data_output_path)
        ptx_loader = dist.seeded_loader(unsup.train, args.per_device_training_batch_size,
                                        SFTCollator(tokenizer.pad_token_id, mask_prompt=False), info, args.seed,
                                        drop_last=True, shuffle=True)
        ptx_iter = Cycle(ptx_loader, info.device)

    engines = build_engines(args, tokenizer, info, plan.actor_steps, plan.critic_steps, with_critic=not critic_free,
                            with_reward_model=use_reward_model)
    seed_rollouts(args.seed, info.rank)  # per-rank sampling: ranks given the same prompt answer differently
    hybrid, generate = make_generate(engines.actor, args, tokenizer, logprobs=critic_free)
    kl_ctl = (core.AdaptiveKLController(args.init_kl_coef, args.kl_target, args.kl_horizon)
              if args.kl_ctl == "adaptive" else core.FixedKLController(args.init_kl_coef))
    settings = config.from_args(config.PPOConfig, args)
    if critic_free:
        trainer = CriticFreeTrainer(
            engines.actor, engines.reference, make_reward(args, engines.reward), generate, kl_ctl, settings,
            tokenizer, args.gradient_accumulation_steps, info.world_size, args.max_answer_seq_len,
            all_reduce_sum=dist.all_reduce_sum if info.world_size > 1 else None,
            all_reduce_max=dist.all_reduce_max if info.world_size > 1 else None, rank=info.rank, ema=engines.ema)
    else:
        trainer = PPOTrainer(engines.actor, engines.critic, engines.reference,
                             reward_model_scores(engines.reward, args.per_device_training_batch_size), generate,
                             kl_ctl, settings, stop_token_ids(tokenizer), tokenizer.pad_token_id, ema=engines.ema)
    tracker = Tracker(args.output_dir, info.is_main, args.enable_tensorboard, args.tensorboard_path,
                      progress=not args.disable_progress_bar)
    reward_desc = " + ".join([f"reward model {reward_path}"] * use_reward_model + list(args.reward_fn)
                             + list(args.reward_url))
    critic_desc = (f"{plan.critic_steps} critic optimizer steps; critic ZeRO-{args.critic_zero_stage}" if not critic_free
                   else "no critic")
    tracker.write(f"step 3 ({args.rl_algorithm}): {len(data.train)} prompts, {plan.total_buffers} experience buffers "
                  f"of {args.generation_batches}×{args.per_device_generation_batch_size} prompts × "
                  f"{args.num_samples_per_prompt} answers per rank × {info.world_size} ranks, {args.ppo_epochs} "
                  f"epoch(s), {plan.actor_steps} actor optimizer steps, {critic_desc}; actor "
                  f"ZeRO-{args.actor_zero_stage}, hybrid engine {'on' if args.enable_hybrid_engine else 'off'}; "
                  f"reward: {reward_desc}")
    trained = {"actor": engines.actor} if critic_free else {"actor": engines.actor, "critic": engines.critic}
    ckpt = LoopCheckpoints(args, trained, {"actor_ema": engines.ema.module} if engines.ema is not None else None)
    return Step3Run(args, info, tokenizer, plan, loader, ptx_iter, engines, hybrid, kl_ctl, trainer, tracker, ckpt)


def train(run: Step3Run, score_fn=None) -> dict:
    """The PPO loop over ``run``: per experience buffer, make experience (generate, score, KL-shaped
    rewards, advantages) and learn from it, then log and checkpoint; at the end save the HF folders.

    ``score_fn`` (a :data:`~chatrl.step3_ppo.trainer.ScoreFn`) replaces the reward model (tests use
    a rule). Returns the last logged metrics.
    """
    from chatrl import dist
    from chatrl.checkpoint import batches_from, write_run_marker
    from chatrl.resilience import nonfinite_scores, set_progress
    from chatrl.step2_reward.model import save_reward_model
    from chatrl.step3_ppo.trainer import summarize
    from chatrl.weights import save_hf_model

    args, info, plan, trainer, tracker, ckpt = run.args, run.info, run.plan, run.trainer, run.tracker, run.ckpt
    engines, hybrid, kl_ctl, ptx_iter, tokenizer = run.engines, run.hybrid, run.kl_ctl, run.ptx_iter, run.tokenizer
    step = 0
    critic_free = args.rl_algorithm != "ppo"
    # The reward: the reward model unless a rule is given; --debug_nonfinite_steps (a testing hook) wraps it.
    if not critic_free:
        trainer.score_fn = nonfinite_scores(score_fn or trainer.score_fn, args.debug_nonfinite_steps, lambda: step + 1)
    elif score_fn is not None:
        from chatrl.rewards import ModelReward, WeightedReward

        rule = nonfinite_scores(score_fn, args.debug_nonfinite_steps, lambda: step + 1)
        trainer.reward = WeightedReward([(1.0, ModelReward(rule, name="score_fn"))])
    steps_per_epoch, total_buffers = plan.buffers_per_epoch, plan.total_buffers
    resumed, samples = ckpt.resume(), 0

    def state() -> dict:
        return {"epoch": step // steps_per_epoch, "kl_ctl": kl_ctl.state_dict(), "samples": samples,
                "ptx_batches": ptx_iter.consumed if ptx_iter is not None else 0}

    if resumed:
        step, samples = resumed["step"], resumed["samples"]
        kl_ctl.load_state_dict(resumed["kl_ctl"])
        if ptx_iter is not None:
            ptx_iter.skip(resumed["ptx_batches"])
        tracker.resumed_at(step)
        tracker.write(f"resumed from {resumed['path']} at step {step} ({samples} rollouts so far, "
                      f"KL coefficient {kl_ctl.value:.4g})")
    tracker.bar(total_buffers, "step 3 PPO", initial=step)
    t_start, metrics = time.time(), {}
    while step < total_buffers:
        it = batches_from(run.loader, step, steps_per_epoch, args.generation_batches)
        for _ in range(steps_per_epoch - step % steps_per_epoch):
            t0 = time.time()
            stats: dict = {}
            if critic_free:
                # rollouts of N answers per prompt (inference layout) and their rewards, then one buffer:
                # log-probs, sampler/training agreement, group or batch advantages; then learning on it
                rollouts = []
                for _ in range(args.generation_batches):
                    batch = next(it)
                    rollouts.append(trainer.rollout(batch["input_ids"].to(info.device),
                                                    batch["attention_mask"].to(info.device), batch["metadata"],
                                                    step + 1))
                t1 = time.time()
                exp, buffer_stats = trainer.make_buffer(rollouts)
                t2 = time.time()
                learned = trainer.learn(exp)
                summary = summarize(exp, kl_ctl.value, tokenizer.eos_token_id)
                summary.pop("explained_variance")
                summary.pop("reward/mean")
                stats = {k: float(v) for k, v in {**summary, **buffer_stats, **learned}.items()}
                stats.update({"time/generate": t1 - t0, "time/experience": t2 - t1, "time/train": time.time() - t2,
                              "memory/rss_train_mb": dist.resident_mb(),
                              **{f"time/{k}": v for k, v in hybrid.timings.items()}})
            for _ in range(0 if critic_free else args.generation_batches):
                batch = {k: v.to(info.device) for k, v in next(it).items()}
                # rollouts (in the inference layout), their scores, KL-shaped rewards and advantages
                exp, times = trainer.make_experience(batch["input_ids"], batch["attention_mask"])
                t1 = time.time()
                # PPO epochs on them (in the training layout), with the PTX loss when on
                learned = trainer.learn(exp, ptx_iter)
                times["time/train"] = time.time() - t1
                times["memory/rss_train_mb"] = dist.resident_mb()
                for k, v in {**summarize(exp, kl_ctl.value, trainer.eos), **learned, **times,
                             **{f"time/{k}": v for k, v in hybrid.timings.items()}}.items():
                    stats[k] = stats.get(k, 0.0) + float(v) / args.generation_batches
            step += 1
            set_progress(optimizer_step=step)
            samples += plan.rollouts_per_buffer
            agreement = {k: stats.pop(k) for k in ("rollout/logp_diff_max", "rollout/logp_diff_mean") if k in stats}
            metrics = {**reduce_stats(stats), **agreement}  # agreement figures are already global
            if not ckpt.after_step(step, state()):  # a skipped (non-finite) step tells the KL controller nothing
                kl_ctl.update(metrics["kl"], plan.rollouts_per_buffer)
            metrics["memory/rss_train_max_mb"] = dist.all_reduce_max(torch.tensor(stats["memory/rss_train_mb"])).item()
            metrics.update(skipped_steps=ckpt.skipped, samples=samples, actor_lr=engines.actor.get_lr()[0],
                           **({"critic_lr": engines.critic.get_lr()[0]} if engines.critic is not None else {}),
                           samples_per_s=plan.rollouts_per_buffer / (time.time() - t0),
                           elapsed_min=(time.time() - t_start) / 60)
            if step % args.log_interval == 0 or step == total_buffers:
                tracker.log(metrics, step)
            tracker.advance()
            if step % args.print_answers_interval == 0 or step == 1:  # one rollout for the report (and console)
                p = exp.sequences[0, :exp.prompt_len][exp.attention_mask[0, :exp.prompt_len] > 0]
                a = exp.sequences[0, exp.prompt_len:][exp.action_mask[0] > 0]
                tracker.sample(step, tokenizer.decode(p, skip_special_tokens=True),
                               tokenizer.decode(a, skip_special_tokens=True), exp.scores[0].item(),
                               (exp.kl[0] * exp.action_mask[0]).sum().item(), show=args.print_answers)
            ckpt.save_if_due(step, total_buffers, state())
            if step >= total_buffers or ckpt.stop_here(step):
                break
        if ckpt.stop_here(step):
            ckpt.note_stop(step, tracker)
            return metrics
    tracker.close()
    out = args.output_dir
    save_hf_model(engines.actor.module, tokenizer, f"{out}/actor")
    if engines.critic is not None:
        save_reward_model(engines.critic.module, tokenizer, f"{out}/critic")
    if engines.ema is not None:
        save_hf_model(engines.ema.module, tokenizer, f"{out}/actor_ema")
    if info.is_main:
        write_run_marker(out, {"step": 3, "steps": step, "metrics": metrics, "args": vars(args)})
    return metrics


if __name__ == "__main__":
    main()
