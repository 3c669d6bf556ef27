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
from dataclasses import dataclass

import torch

from chatrl import program
from chatrl.data import prompt_batches, ptx_batches
from chatrl.distributed import dist
from chatrl.hybrid_engine import HybridEngine
from chatrl.rewards import build_rlhf_reward, check_reward_metadata
from chatrl.rl.stats import PooledStats
from chatrl.run import Run, Schedule
from chatrl.step3_ppo.engine import RLHFEngines, actor_tokenizer, build_engines, seed_rollouts
from chatrl.step3_ppo.evidence import Step3Evidence
from chatrl.step3_ppo.settings import Step3Settings
from chatrl.step3_ppo.trainer import OptimizerStep, Trainer, summarize
from chatrl.tracking import Tracker, Trend

log = logging.getLogger("chatrl.step3")


def build_parser():
    """Step 3's flags: the blocks of :class:`~chatrl.step3_ppo.settings.Step3Settings`."""
    return Step3Settings.parser()


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
    plan: object  # the run's sizes (chatrl.sizes.PPOPlan)
    loader: object  # prompts, per_device_generation_batch_size per batch
    ptx_iter: object | None  # PTX text batches (--unsupervised_dataset_name; chatrl.checkpoint.Cycle)
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
    (:func:`chatrl.distributed.dist.run_program`)."""
    step3 = build(Step3Settings.parse(argv))
    return {"metrics": train(step3), "run": step3}


def build(args, score_fn=None) -> Step3Run:
    """Set up a step-3 run from parsed flags: the flags and models checked before anything loads,
    distributed, the tokenizer, prompts (and PTX text), the derived sizes, the models, the hybrid
    engine's sampler, the KL controller, the reward and the trainer, the tracker and the checkpoints.
    All ranks call it. ``score_fn``: a test hook replacing the reward (:func:`chatrl.rewards.build_rlhf_reward`)."""
    s = Step3Settings.read(args)
    s.check_flags()
    reward_path = s.reward_model_path() if score_fn is None else None
    episodes = s.episodes()
    s.check_models(reward_path, episodes)
    seed, rollout, ppo = s.actor_optim.seed, s.rollout, s.ppo
    info = program.start(f"step 3 ({s.algorithm.name})", s.log, seed, s.ckpt)
    tokenizer = actor_tokenizer(s, reward_path, episodes is not None)

    data, loader = prompt_batches(s.data, rollout, tokenizer, info, seed)
    check_reward_metadata(s.reward.reward_fn, [data.train[i]["metadata"] for i in range(len(data.train))],
                          f"--data_path {' '.join(s.data.data_path)}")
    plan = s.plan(len(loader), len(data.train), info.world_size)
    ptx_iter = ptx_batches(s.data, tokenizer, info, seed, ppo.per_device_training_batch_size,
                           rollout.max_prompt_seq_len + rollout.max_answer_seq_len)

    engines = build_engines(s, tokenizer, info, plan, reward_path)
    seed_rollouts(seed, info.rank)  # per-rank sampling: ranks given the same prompt answer differently
    hybrid = HybridEngine(engines.actor, s.hybrid)
    kl_ctl = ppo.kl_controller(plan.kl_horizon)
    reward = build_rlhf_reward(s.reward, engines.reward, reward_path, ppo.per_device_training_batch_size,
                               tokenizer.pad_token_id if s.packing.packing else None, episodes is not None, score_fn)
    step = OptimizerStep(s.actor_optim.gradient_accumulation_steps, plan.loss_agg_mode,
                         episodes.plan.max_region_tokens if episodes else rollout.max_answer_seq_len)
    trainer = Trainer(engines, reward, hybrid.sampler(rollout.max_answer_seq_len, s.sampling, tokenizer), kl_ctl,
                      ppo, tokenizer, step=step, ranks=dist.RankGroup.of(info), packing=s.packing, episodes=episodes)

    evidence = Step3Evidence(s, args, info, plan, trainer, engines.probes, loader, data.report)
    step3 = Step3Run(s, args, info, tokenizer, plan, loader, ptx_iter, engines, hybrid, kl_ctl, trainer, evidence)
    schedule = Schedule(plan.total_buffers, plan.buffers_per_epoch, rollout.generation_batches,
                        f"step 3 {s.algorithm.name}", tuple(plan.notes), plan.cap_note, unit="step")
    opening = s.opening(plan, info.world_size, len(data.train), [name for _, name, _ in reward.parts], reward_path,
                        engines.critic is not None, episodes)
    step3.run = Run(s, info, schedule, loader, engines.saved(plan.layout, tokenizer), evidence, opening=opening,
                    state=lambda: {"kl_ctl": kl_ctl.state_dict(), "samples": step3.samples,
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
        chatrl.evidence.weight_version.WeightVersionError: rollouts of other weights than the trainer's (every
            rank; ``certificate.json`` is written first).
    """
    with run.evidence.failing_on_stale_weights():
        return _train(run)


def _train(step3: Step3Run) -> dict:
    s, info, plan, trainer, run = step3.settings, step3.info, step3.plan, step3.trainer, step3.run
    engines, kl_ctl, tokenizer = step3.engines, step3.kl_ctl, step3.tokenizer
    if s.ckpt.debug_nonfinite_steps:  # a testing hook: the reward is NaN at those steps
        trainer.score_through(run.nonfinite)
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

    run.finish(3, vars(step3.args), save=lambda: engines.save_hf(s.log.output_dir, tokenizer, s.actor.dtype))
    return run.metrics


if __name__ == "__main__":
    main()
