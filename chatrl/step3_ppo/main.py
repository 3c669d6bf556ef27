"""Step 3: RLHF of the step-1 actor (Ouyang et al., 2022; Stiennon et al., 2020): PPO with a critic,
or a critic-free algorithm (GRPO, RLOO, REINFORCE++), through one loop.

Read top to bottom: flags (:mod:`chatrl.step3_ppo.settings`), set-up (:func:`build`: distributed,
prompts, sizes, the models, the hybrid engine, the reward, the trainer), the loop (:func:`train`:
rollouts → experience → learning → log, KL control, checkpoint, per experience buffer), then the
HF-format saves of ``actor/``, ``critic/`` (with a critic) and (``--enable_ema``) ``actor_ema/``
under ``--output_dir``. The algorithm (``--rl_algorithm``, :mod:`chatrl.rl.algorithms`) chooses the
advantage estimator and whether a critic exists; the trainer (:mod:`chatrl.step3_ppo.trainer`) is
the same for all. ``docs/ppo.md`` and ``docs/critic_free.md`` list the details and metrics.

Run ``python -m chatrl.step3_ppo --help`` for the flags (DeepSpeed-Chat's names).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from chatrl import cli, config, dist, program
from chatrl.checkpoint import Cycle, resume_path
from chatrl.data import PromptCollator, SFTCollator, phase_data
from chatrl.data.template_check import DEFAULT_CONVERSATIONS, check_startup, startup_conversations
from chatrl.envs import load_environment
from chatrl.hybrid_engine import HybridEngine
from chatrl.hybrid_engine.tp_plan import check_inference_tp
from chatrl.models import (
    check_context_window,
    check_packing,
    load_tokenizer,
    sampling_settings,
    stop_token_ids,
    torch_dtype,
)
from chatrl.packing import pack
from chatrl.resilience import nonfinite_scores
from chatrl.reward_model import save_reward_model
from chatrl.rewards import ModelReward, RewardContext, WeightedReward, build_reward, check_reward_metadata
from chatrl.rl import core
from chatrl.rl.loss import check_rollout_is
from chatrl.rl.stats import PooledStats
from chatrl.run import Run, Saved, Schedule
from chatrl.sizes import PPOPlan, PromptCounts, plan_ppo
from chatrl.step3_ppo.engine import RLHFEngines, build_engines, check_tokenizers_compatible, seed_rollouts
from chatrl.step3_ppo.evidence import Step3Evidence
from chatrl.step3_ppo.settings import Step3Settings
from chatrl.step3_ppo.trainer import Trainer, summarize
from chatrl.tracking import Tracker, Trend
from chatrl.weight_version import WeightVersionError
from chatrl.weights import save_hf_model

log = logging.getLogger("chatrl.step3")


def build_parser():
    """Step 3's flags: the blocks of :class:`~chatrl.step3_ppo.settings.Step3Settings`."""
    return config.program_parser(Step3Settings, "chatrl step 3: RLHF fine-tuning of the actor (PPO, GRPO, RLOO, "
                                                "REINFORCE++)", prog="python -m chatrl.step3_ppo")


def make_generate(actor_engine, s: Step3Settings, tokenizer) -> tuple[HybridEngine, callable]:
    """The rollout function: the hybrid engine's generate with the sampling flags bound, run inside
    :meth:`HybridEngine.inference` so that training always runs in the training layout (and
    ``--release_inference_cache`` frees the inference copy after every rollout). It returns
    ``(sequences, sampler log-probs of the sampled tokens)``. Its ``session`` attribute is
    :meth:`HybridEngine.inference`: a multi-turn rollout generates every turn inside one session
    (one switch of layout per rollout, not one per turn)."""
    hybrid = HybridEngine(actor_engine, s.hybrid)
    sampling = sampling_settings(s.sampling.temperature, s.sampling.top_k, s.sampling.top_p)

    def turn(ids, mask):
        return hybrid.generate(ids, mask, max_new_tokens=s.rollout.max_answer_seq_len, **sampling,
                               eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id,
                               output_logprobs=True)

    def generate(ids, mask):
        if hybrid.in_inference:  # inside a session (a multi-turn rollout)
            return turn(ids, mask)
        with hybrid.inference():
            return turn(ids, mask)

    generate.session = hybrid.inference
    return hybrid, generate


def reward_model_scores(reward_engine, micro_batch: int, pad_token_id: int | None = None):
    """The reward model's end score, ``micro_batch`` rollouts per pass, packed into rows of their real
    tokens when ``pad_token_id`` is given (``--packing``: the same scores):
    ``score_fn(sequences (B, T), attention_mask (B, T), prompt_len) -> (B,)``."""

    @torch.no_grad()
    def score_fn(seq, mask, prompt_len):
        scores = []
        for i in range(0, len(seq), micro_batch):
            s, m = seq[i:i + micro_batch], mask[i:i + micro_batch]
            if pad_token_id is None:
                scores.append(reward_engine(s, m).end_scores)
            else:
                packed = pack([row[keep > 0] for row, keep in zip(s, m, strict=True)], pad_token_id)
                scores.append(reward_engine(packed.input_ids, None, packed=packed).end_scores)
        return torch.cat(scores)

    return score_fn


def make_reward(s: Step3Settings, reward_engine, reward_path: str | None, score_fn=None,
                pad_token_id: int | None = None) -> WeightedReward:
    """The weighted reward of every algorithm (:func:`chatrl.rewards.build_reward`, each source built by
    its kind): the reward model at ``reward_path`` scored by ``reward_engine`` (when loaded; on packed
    rows with ``pad_token_id``), the ``--reward_fn`` and ``--reward_url`` values. ``score_fn`` (a test
    hook, ``score_fn(sequences, attention_mask, prompt_len) -> (B,)``) replaces all of them."""
    if score_fn is not None:
        return WeightedReward([(1.0, ModelReward(score_fn, name="score_fn"))])
    scores = (reward_model_scores(reward_engine, s.ppo.per_device_training_batch_size, pad_token_id)
              if reward_engine is not None else None)
    return build_reward(s.reward, RewardContext(model_scores=scores),
                        reward_path if scores is not None else None, episodes=bool(s.env.env))


def episode_turns(exp, row: int) -> list[dict]:
    """The turns after the opening of episode ``row`` of a buffer, for the report: each
    ``{"role", "content", "observation": bool}`` (observations are the environment's turns)."""
    msgs = exp.transcripts[row]
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
    return [{"role": m["role"], "content": m["content"], "observation": m["role"] != "assistant"} for m in msgs[first:]]


@dataclass
class Step3Run:
    """Everything a step-3 run is made of, built by :func:`build` and trained by :func:`train`."""

    settings: Step3Settings
    args: object  # the parsed flags (recorded in the run marker)
    info: dist.DistInfo
    tokenizer: object
    plan: PPOPlan
    loader: object  # prompts, per_device_generation_batch_size per batch
    ptx_iter: Cycle | None  # PTX text batches (--unsupervised_dataset_name)
    engines: RLHFEngines
    hybrid: HybridEngine
    kl_ctl: object
    trainer: Trainer
    evidence: Step3Evidence  # the certificate and the rollout records
    run: Run | None = None  # the lifecycle: resume, cadence, checkpoints, stop, final save
    samples: int = 0  # rollouts so far

    @property
    def tracker(self) -> Tracker:
        """The run's tracker (metrics, console)."""
        return self.run.tracker


def main(argv: list[str] | None = None) -> dict:
    """Run step 3; returns the last logged metrics."""
    return run(argv)["metrics"]


def run(argv: list[str] | None = None) -> dict:
    """Run step 3 and return ``{"metrics", "run"}``: the last logged metrics and the
    :class:`Step3Run`, whose engines the caller keeps until the process group is shut down
    (:func:`chatrl.dist.run_program`)."""
    step3 = build(cli.parse(build_parser(), argv))
    return {"metrics": train(step3), "run": step3}


def build(args, score_fn=None) -> Step3Run:
    """Set up a step-3 run from parsed flags: distributed, prompts (and PTX text), the derived sizes,
    the models, the hybrid engine, the KL controller, the reward and the trainer, the tracker and
    the checkpoints. All ranks call it. ``score_fn``: see :func:`make_reward`."""
    s: Step3Settings = config.read(Step3Settings, args)
    algorithm, rollout = s.algorithm, s.rollout
    sampling_settings(s.sampling.temperature, s.sampling.top_k, s.sampling.top_p)  # bad flags fail before loading
    if s.ppo.rollout_is_cap:
        check_rollout_is(s.ppo.rollout_is_level, s.ppo.rollout_is_mode, s.ppo.rollout_is_cap, s.ppo.rollout_is_cap_low)
    critic_source = s.critic_source()  # before the reward: PPO without any reward names the critic first
    reward_path = s.reward_model_path() if score_fn is None else None
    episodes = s.episodes()
    budget = ({"--max_total_tokens": episodes.max_total_tokens} if episodes else
              {"--max_prompt_seq_len + --max_answer_seq_len": rollout.max_prompt_seq_len + rollout.max_answer_seq_len})
    check_context_window([s.actor.model_name_or_path, critic_source and critic_source[0], reward_path], budget,
                         s.actor.trust_remote_code)
    check_packing(s.packing, [s.actor.model_name_or_path, critic_source and critic_source[0], reward_path],
                  s.actor.trust_remote_code)
    if s.hybrid.enable_hybrid_engine and s.hybrid.inference_tp_size > 1:  # before any rank loads a model
        check_inference_tp(s.actor.model_name_or_path, s.hybrid.inference_tp_size, s.actor.trust_remote_code)
    make_env = load_environment(s.env.env, s.env.env_args) if s.env.env else None
    seed = s.actor_optim.seed
    info = program.start(f"step 3 ({algorithm.name})", s.log, seed, s.ckpt)
    tokenizer = load_tokenizer(s.actor.model_name_or_path, padding_side="left",
                               trust_remote_code=s.actor.trust_remote_code)
    check_startup(tokenizer, {**startup_conversations(s.data.data_path),
                              **({"tool_calls": DEFAULT_CONVERSATIONS["tool_calls"]} if episodes else {})},
                  "step 3", s.template_check.skip_template_check, log)
    if reward_path:
        check_tokenizers_compatible(tokenizer, load_tokenizer(reward_path), s.actor.model_name_or_path, reward_path)

    data = phase_data(3, s.data, tokenizer, seed, max_prompt_len=rollout.max_prompt_seq_len)
    check_reward_metadata(s.reward.reward_fn, [data.train[i]["metadata"] for i in range(len(data.train))],
                          f"--data_path {' '.join(s.data.data_path)}")
    loader = dist.seeded_loader(data.train, rollout.per_device_generation_batch_size,
                                PromptCollator(tokenizer.pad_token_id, with_metadata=True), info, seed, drop_last=True)
    # every derived size, and the loss aggregation where an unset default does not fit (said in plan.notes)
    plan = plan_ppo(PromptCounts(len(loader), len(data.train), info.world_size), rollout, s.ppo,
                    s.actor_optim, s.packing, ptx=bool(s.data.unsupervised_dataset_name))
    ptx_iter = None
    if s.data.unsupervised_dataset_name:
        unsup = phase_data(1, s.data, tokenizer, seed, data_paths=s.data.unsupervised_dataset_name,
                           data_split="10,0,0", max_seq_len=rollout.max_prompt_seq_len + rollout.max_answer_seq_len,
                           eval_fraction=0.05, eval_data_paths=None)
        ptx_loader = dist.seeded_loader(unsup.train, s.ppo.per_device_training_batch_size,
                                        SFTCollator(tokenizer.pad_token_id, mask_prompt=False), info, seed,
                                        drop_last=True, shuffle=True)
        ptx_iter = Cycle(ptx_loader, info.device)

    engines = build_engines(s, tokenizer, info, plan, reward_path, resuming=resume_path(s.ckpt, s.log.output_dir)
                            is not None)
    seed_rollouts(seed, info.rank)  # per-rank sampling: ranks given the same prompt answer differently
    hybrid, generate = make_generate(engines.actor, s, tokenizer)
    kl_ctl = (core.AdaptiveKLController(s.ppo.init_kl_coef, s.ppo.kl_target, plan.kl_horizon)
              if s.ppo.kl_ctl == "adaptive" else core.FixedKLController(s.ppo.init_kl_coef))
    reward = make_reward(s, engines.reward, reward_path, score_fn,
                         tokenizer.pad_token_id if s.packing.packing else None)
    several = info.world_size > 1
    ppo = replace(s.ppo, loss_agg_mode=plan.loss_agg_mode)  # the PPO block with the planned aggregation
    trainer = Trainer(engines.actor, engines.reference, engines.critic, reward, generate, kl_ctl, ppo,
                      tokenizer, gradient_accumulation_steps=s.actor_optim.gradient_accumulation_steps,
                      world_size=info.world_size,
                      answer_len=episodes.max_region_tokens if episodes else rollout.max_answer_seq_len,
                      all_reduce_sum=dist.all_reduce_sum if several else None,
                      all_reduce_max=dist.all_reduce_max if several else None, rank=info.rank, ema=engines.ema,
                      temperature=s.sampling.temperature, top_k=s.sampling.top_k, top_p=s.sampling.top_p,
                      packing=s.packing, env=make_env, episodes=episodes,
                      max_prompt_len=rollout.max_prompt_seq_len, weights=hybrid)
    critic_desc = (f"{plan.critic_steps} critic optimizer steps; critic ZeRO-{s.critic_zero.zero_stage}"
                   if engines.critic is not None else "no critic")
    opening = (f"step 3 ({algorithm.name}): {len(data.train)} prompts, {plan.total_buffers} experience buffers "
               f"of {rollout.generation_batches}×{rollout.per_device_generation_batch_size} prompts × "
               f"{s.ppo.samples_per_prompt} answers per rank × {info.world_size} ranks, {s.ppo.ppo_epochs} "
               f"epoch(s), {plan.actor_steps} actor optimizer steps, {critic_desc}; actor "
               f"ZeRO-{s.actor_zero.zero_stage}, hybrid engine {'on' if s.hybrid.enable_hybrid_engine else 'off'}; "
               f"{s.actor.dtype_note}{', fp32 LM head' if s.actor.fp32_lm_head else ''}; "
               f"reward: {' + '.join(name for _, name, _ in reward.parts)}"
               + (f" (reward model {reward_path})" if reward_path else "")
               + (f"; episodes of --env {s.env.env}: up to {episodes.max_turns} assistant turns, "
                  f"{episodes.max_total_tokens} tokens" if episodes else ""))
    trained = {"actor": engines.actor, **({"critic": engines.critic} if engines.critic is not None else {})}
    evidence = Step3Evidence(s, args, info, plan, trainer, engines.probes, loader, data.report)
    step3 = Step3Run(s, args, info, tokenizer, plan, loader, ptx_iter, engines, hybrid, kl_ctl, trainer, evidence)
    schedule = Schedule(plan.total_buffers, plan.buffers_per_epoch, rollout.generation_batches,
                        f"step 3 {algorithm.name}", tuple(plan.notes), plan.cap_note, unit="step")
    saved = Saved(trained, plan.layout, {"actor_ema": engines.ema.module} if engines.ema is not None else None,
                  hf_model=(engines.actor.module, tokenizer))
    step3.run = Run(s, info, schedule, loader, saved, evidence, opening=opening, state=lambda: {
        "kl_ctl": kl_ctl.state_dict(), "samples": step3.samples,
        "ptx_batches": ptx_iter.consumed if ptx_iter is not None else 0})
    return step3


def restore(run: Step3Run) -> tuple[int, int, dict | None]:
    """Start ``run``: load the checkpoint ``--resume`` / ``--resume_from_checkpoint`` name (weights,
    optimizers, RNG, data counts, certificate so far: :meth:`chatrl.run.Run.start`; then the KL
    controller and the PTX position); returns ``(step, rollouts so far, the checkpoint's state or None)``."""
    resumed = run.run.start()
    if not resumed:
        return 0, 0, None
    run.samples = resumed["samples"]
    run.kl_ctl.load_state_dict(resumed["kl_ctl"])
    if run.ptx_iter is not None:
        run.ptx_iter.skip(resumed["ptx_batches"])
    run.tracker.write(f"{run.samples} rollouts so far, KL coefficient {run.kl_ctl.value:.4g}")
    return resumed["step"], run.samples, resumed


def learn_from(run: Step3Run, rollouts: list, stats: PooledStats) -> tuple[object, dict]:
    """Steps 2 and 3 of the loop on one buffer's rollouts: experience, then learning; adds the
    rollout statistics and ``time/experience``, ``time/train`` to ``stats`` and returns
    ``(experience, agreement figures)``."""
    trainer = run.trainer
    t0 = time.time()
    exp, agreement = trainer.make_experience(rollouts, stats)
    t1 = time.time()
    agreement = trainer.learn(exp, stats, run.ptx_iter) or agreement
    summarize(exp, run.kl_ctl.value, trainer.stops, stats)
    for k, v in {"time/experience": t1 - t0, "time/train": time.time() - t1}.items():
        stats.add_weighted(k, v, 1.0)  # per rank, averaged over ranks
    return exp, agreement


def train(run: Step3Run) -> dict:
    """The loop over ``run``, the same for every algorithm: per experience buffer, rollouts (generate,
    reward), experience (log-probs, values, advantages), learning, then log, KL control and
    checkpoint; at the end the certificate and the HF folders. Returns the last logged metrics.

    Raises:
        chatrl.weight_version.WeightVersionError: rollouts of other weights than the trainer's (every
            rank; ``certificate.json`` is written first).
    """
    try:
        return _train(run)
    except WeightVersionError:
        run.evidence.failed()
        raise


def _train(step3: Step3Run) -> dict:
    s, info, plan, trainer, run = step3.settings, step3.info, step3.plan, step3.trainer, step3.run
    engines, kl_ctl, tokenizer = step3.engines, step3.kl_ctl, step3.tokenizer
    if s.ckpt.debug_nonfinite_steps:  # a testing hook: the reward is NaN at those steps
        trainer.reward = nonfinite_scores(trainer.reward, run.nonfinite)
    restore(step3)
    t_start, trend, total = time.time(), Trend(), plan.total_buffers

    def figures(step, metrics: dict, rss: float, t0: float) -> dict:  # after the non-finite guard
        if not step.skipped and "kl" in metrics:  # a skipped (non-finite) step tells the KL controller nothing
            kl_ctl.update(metrics["kl"], plan.rollouts_per_buffer)
        metrics["memory/rss_train_max_mb"] = dist.all_reduce_max(torch.tensor(rss)).item()
        metrics.update(skipped_steps=run.skipped, samples=step3.samples, actor_lr=engines.actor.get_lr()[0],
                       **({"critic_lr": engines.critic.get_lr()[0]} if engines.critic is not None else {}),
                       samples_per_s=plan.rollouts_per_buffer / (time.time() - t0),
                       elapsed_min=(time.time() - t_start) / 60)
        trend.add(metrics)
        n, exp = step.number, step.result
        if n % plan.print_answers_interval == 0 or n == total:  # the console's trend line
            run.tracker.write(trend.line(f"step 3 ({s.algorithm.name}) at step {n}/{total}"))
        if n % plan.print_answers_interval == 0 or n == 1:  # one rollout for the report (and console)
            p = exp.sequences[0, :exp.prompt_len][exp.attention_mask[0, :exp.prompt_len] > 0]
            a = exp.sequences[0, exp.prompt_len:][exp.action_mask[0] > 0]
            run.tracker.sample(n, tokenizer.decode(p, skip_special_tokens=True),
                               tokenizer.decode(a, skip_special_tokens=True), exp.scores[0].item(),
                               (exp.kl[0] * exp.action_mask[0]).sum().item() if exp.kl is not None else None,
                               show=s.rollout.print_answers,
                               turns=episode_turns(exp, 0) if exp.turns is not None else None)
        run.metrics = metrics
        return metrics

    for step in run:
        t0 = time.time()
        # 1. rollouts: N answers per prompt in the inference layout, their sampler log-probs and rewards
        rollouts = []
        for batch in step.batches():
            step.account(batch)
            rollouts.append(trainer.rollout(batch["input_ids"].to(info.device), batch["attention_mask"].to(info.device),
                                            batch["metadata"], step.number, batch.get("messages")))
        t1 = time.time()
        # 2. experience: log-probs, values, KL, the algorithm's advantages (the weights checked first);
        # 3. learning: policy (and critic, PTX) micro-steps in the training layout
        stats = PooledStats()  # every logged statistic, pooled over the global batch
        exp, agreement = learn_from(step3, rollouts, stats)
        rss = dist.resident_mb()
        for k, v in {"time/generate": t1 - t0, "memory/rss_train_mb": rss,
                     **{f"time/{k}": v for k, v in step3.hybrid.timings.items()}}.items():
            stats.add_weighted(k, v, 1.0)  # per rank, averaged over ranks
        step3.samples += plan.rollouts_per_buffer
        # 4. figures and KL control after the guard; the run logs, certifies, checkpoints
        metrics = {**stats.finish(dist.all_reduce_sum if info.world_size > 1 else None),
                   **{k: float(v) for k, v in agreement.items()}}  # agreement figures are already global
        step.done(figures, step, metrics, rss, t0, result=exp)

    out = s.log.output_dir

    def save():
        save_hf_model(engines.actor.module, tokenizer, f"{out}/actor")
        if engines.critic is not None:
            save_reward_model(engines.critic.module, tokenizer, f"{out}/critic")
        if engines.ema is not None:
            save_hf_model(engines.ema.module, tokenizer, f"{out}/actor_ema", dtype=torch_dtype(s.actor.dtype))

    run.finish(3, vars(step3.args), save=save)
    return run.metrics


if __name__ == "__main__":
    main()
