"""Step 3: RLHF with PPO (Ouyang et al., 2022; Stiennon et al., 2020) on the step-1 actor and step-2 reward model.

Read top to bottom: flags, set-up (distributed, prompts, the four models, the hybrid engine), the
loop (make experience → PPO epochs on it → log), then the HF-format saves of ``actor/``,
``critic/`` and (``--enable_ema``) ``actor_ema/`` under ``--output_dir``. The maths lives in
:mod:`chatrl.step3_ppo.core`; ``docs/ppo.md`` lists the implementation details and metrics.

Run ``python -m chatrl.step3_ppo --help`` for the flags (DeepSpeed-Chat's names).
"""

from __future__ import annotations

import logging
import time

import torch

from chatrl import cli
from chatrl.tracking import Tracker, setup_logging

log = logging.getLogger("chatrl.step3")


def build_parser():
    p = cli.new_parser("chatrl step 3: RLHF fine-tuning of the actor with PPO", prog="python -m chatrl.step3_ppo")
    g = p.add_argument_group("models")
    g.add_argument("--actor_model_name_or_path", required=True, help="step-1 output (actor and reference)")
    g.add_argument("--critic_model_name_or_path", required=True, help="step-2 output (critic initialisation)")
    g.add_argument("--reward_model_name_or_path", default=None, help="frozen reward model (default: the critic's)")
    g.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    g.add_argument("--actor_dropout", type=float, default=None, help="override the actor's dropout (RL passes run in eval mode)")
    g.add_argument("--critic_dropout", type=float, default=None)
    g.add_argument("--actor_gradient_checkpointing", action="store_true")
    g.add_argument("--critic_gradient_checkpointing", action="store_true")
    g.add_argument("--trust_remote_code", action="store_true")
    g.add_argument("--enable_ema", action="store_true", help="keep an exponential moving average of the actor")
    g.add_argument("--ema_beta", type=float, default=0.992)
    g = p.add_argument_group("LoRA")
    for who in ("actor", "critic"):
        g.add_argument(f"--{who}_lora_dim", type=int, default=0)
        g.add_argument(f"--{who}_lora_module_name", default="layers.")
        g.add_argument(f"--{who}_lora_learning_rate", type=float, default=5e-4)
    g.add_argument("--only_optimize_lora", action="store_true")
    g = p.add_argument_group("data")
    g.add_argument("--data_path", nargs="+", required=True, help="as step 1; the step-3 share of each set is used")
    g.add_argument("--data_split", default="2,4,4")
    g.add_argument("--data_output_path", default="/tmp/chatrl_data")
    g.add_argument("--max_prompt_seq_len", type=int, default=256, help="prompt tokens (longer prompts keep their end)")
    g.add_argument("--max_answer_seq_len", type=int, default=256, help="generated tokens per answer")
    g.add_argument("--unsupervised_dataset_name", nargs="*", default=None, help="text for the PTX loss (step-1 style data)")
    g.add_argument("--unsup_coef", type=float, default=27.8, help="PTX loss coefficient")
    g = p.add_argument_group("optimisation")
    g.add_argument("--per_device_generation_batch_size", type=int, default=4, help="prompts per rank per generation")
    g.add_argument("--per_device_training_batch_size", type=int, default=4, help="rollouts per PPO micro-batch")
    g.add_argument("--generation_batches", type=int, default=1, help="generation batches per experience buffer")
    g.add_argument("--ppo_epochs", type=int, default=1, help="passes over each experience buffer")
    g.add_argument("--num_train_epochs", type=int, default=1, help="passes over the prompts")
    g.add_argument("--max_steps", type=int, default=0, help="stop after this many experience buffers (0: no limit)")
    g.add_argument("--actor_learning_rate", type=float, default=9.65e-6)
    g.add_argument("--critic_learning_rate", type=float, default=5e-6)
    g.add_argument("--actor_weight_decay", type=float, default=0.0)
    g.add_argument("--critic_weight_decay", type=float, default=0.0)
    g.add_argument("--lr_scheduler_type", default="cosine")
    g.add_argument("--num_warmup_steps", type=int, default=100)
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--gradient_clipping", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("PPO")
    g.add_argument("--init_kl_coef", type=float, default=0.1, help="β of the per-token KL penalty")
    g.add_argument("--kl_ctl", default="fixed", choices=["fixed", "adaptive"], help="adaptive: Ziegler et al. 2019")
    g.add_argument("--kl_target", type=float, default=6.0, help="adaptive controller's target KL (nats per answer)")
    g.add_argument("--kl_horizon", type=float, default=10000, help="adaptive controller's horizon (rollouts)")
    g.add_argument("--kl_estimator", default="k1", choices=["k1", "k3", "abs", "mse"])
    g.add_argument("--clip_reward_value", type=float, default=5.0)
    g.add_argument("--cliprange", type=float, default=0.2)
    g.add_argument("--cliprange_value", type=float, default=0.2)
    g.add_argument("--gamma", type=float, default=1.0)
    g.add_argument("--lam", type=float, default=0.95)
    g.add_argument("--whiten_advantages", action="store_true")
    g.add_argument("--penalty_no_eos", type=float, default=0.0, help="subtracted from the score of answers without EOS")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top_k", type=int, default=0)
    g.add_argument("--top_p", type=float, default=1.0)
    g = p.add_argument_group("distributed and hybrid engine")
    g.add_argument("--actor_zero_stage", type=int, default=0, choices=[0, 1, 2, 3])
    g.add_argument("--critic_zero_stage", type=int, default=0, choices=[0, 1, 2, 3])
    g.add_argument("--offload", action="store_true")
    g.add_argument("--offload_reference_model", action="store_true")
    g.add_argument("--offload_reward_model", action="store_true")
    g.add_argument("--enable_hybrid_engine", action="store_true")
    g.add_argument("--inference_tp_size", type=int, default=1)
    g.add_argument("--tp_gather_partition_size", type=int, default=8)
    g.add_argument("--release_inference_cache", action="store_true")
    g.add_argument("--unpin_actor_parameters", action="store_true", help="accepted for DeepSpeed-Chat compatibility")
    g.add_argument("--local_rank", type=int, default=-1)
    cli.add_log_args(p)
    cli.add_checkpoint_args(p)
    g = p.add_argument_group("step 3 logging")
    g.add_argument("--print_answers", action="store_true", help="print a prompt and its answer every interval")
    g.add_argument("--print_answers_interval", type=int, default=10,
                   help="steps between the rollouts recorded in logs/samples.jsonl (and printed with --print_answers)")
    return p


def make_generate(actor_engine, args, tokenizer):
    """The rollout function: the hybrid engine's generate with the sampling flags bound."""
    from chatrl.hybrid_engine import HybridEngine

    hybrid = HybridEngine(actor_engine, enable=args.enable_hybrid_engine, inference_tp_size=args.inference_tp_size,
                          tp_gather_partition_size=args.tp_gather_partition_size,
                          release_inference_cache=args.release_inference_cache)

    def generate(ids, mask):
        return hybrid.generate(ids, mask, max_new_tokens=args.max_answer_seq_len, do_sample=True,
                               temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)

    return hybrid, generate


def reduce_stats(stats: dict) -> dict:
    """Mean of each statistic over ranks (every rank holds the same number of rollouts)."""
    from chatrl.dist import all_reduce_mean

    keys = sorted(stats)
    vals = all_reduce_mean(torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64))
    return dict(zip(keys, vals.tolist(), strict=False))


def main(argv: list[str] | None = None) -> dict:
    """Run step 3; returns the last logged metrics."""
    args = cli.parse(build_parser(), argv)
    from transformers import set_seed

    from chatrl import dist
    from chatrl.data import PromptCollator, SFTCollator, build_phase_data
    from chatrl.models import load_tokenizer
    from chatrl.resilience import LoopCheckpoints, batches_from, set_progress
    from chatrl.step2_reward.model import save_reward_model
    from chatrl.step3_ppo import core
    from chatrl.step3_ppo.engine import build_engines, check_tokenizers_compatible
    from chatrl.step3_ppo.trainer import PPOSettings, PPOTrainer, summarize

    set_progress("step 3 (PPO)")
    info = dist.init_distributed()
    setup_logging(info.rank)
    cli.check_output_dir(args.output_dir, args.overwrite_output_dir)
    set_seed(args.seed)
    tokenizer = load_tokenizer(args.actor_model_name_or_path, padding_side="left",
                               trust_remote_code=args.trust_remote_code)
    reward_path = args.reward_model_name_or_path or args.critic_model_name_or_path
    check_tokenizers_compatible(tokenizer, load_tokenizer(reward_path), args.actor_model_name_or_path, reward_path)

    data = build_phase_data(3, args.data_path, tokenizer, data_split=args.data_split,
                            max_prompt_len=args.max_prompt_seq_len, seed=args.seed, cache_dir=args.data_output_path)
    sampler = torch.utils.data.DistributedSampler(data.train, num_replicas=info.world_size, rank=info.rank,
                                                  shuffle=True, seed=args.seed)
    # Private generators: creating an iterator must not draw from the global RNG (exact resume).
    loader = torch.utils.data.DataLoader(data.train, batch_size=args.per_device_generation_batch_size, sampler=sampler,
                                         collate_fn=PromptCollator(tokenizer.pad_token_id), drop_last=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    steps_per_epoch = len(loader) // args.generation_batches
    if steps_per_epoch == 0:
        raise ValueError(f"{len(data.train)} step-3 prompts give no experience buffer of "
                         f"{args.generation_batches} × {args.per_device_generation_batch_size} per rank × "
                         f"{info.world_size} ranks; lower --per_device_generation_batch_size")
    total_buffers = steps_per_epoch * args.num_train_epochs
    if args.max_steps:
        total_buffers = min(total_buffers, args.max_steps)
    micro_per_buffer = -(-args.generation_batches * args.per_device_generation_batch_size
                         // args.per_device_training_batch_size)
    total_opt_steps = total_buffers * args.ppo_epochs * micro_per_buffer // args.gradient_accumulation_steps

    ptx_iter = None
    if args.unsupervised_dataset_name:
        unsup = build_phase_data(1, args.unsupervised_dataset_name, tokenizer, data_split="10,0,0",
                                 max_seq_len=args.max_prompt_seq_len + args.max_answer_seq_len, seed=args.seed,
                                 cache_dir=args.data_output_path)
        ptx_loader = torch.utils.data.DataLoader(
            unsup.train, batch_size=args.per_device_training_batch_size, drop_last=True,
            sampler=torch.utils.data.DistributedSampler(unsup.train, info.world_size, info.rank, seed=args.seed),
            collate_fn=SFTCollator(tokenizer.pad_token_id, mask_prompt=False),
            generator=torch.Generator().manual_seed(args.seed))
        ptx_iter = Cycle(ptx_loader, info.device)

    engines = build_engines(args, tokenizer, info, total_opt_steps)
    hybrid, generate = make_generate(engines.actor, args, tokenizer)
    kl_ctl = (core.AdaptiveKLController(args.init_kl_coef, args.kl_target, args.kl_horizon)
              if args.kl_ctl == "adaptive" else core.FixedKLController(args.init_kl_coef))
    settings = PPOSettings(args.kl_estimator, args.clip_reward_value, args.cliprange, args.cliprange_value, args.gamma,
                           args.lam, args.whiten_advantages, args.ppo_epochs, args.per_device_training_batch_size,
                           args.penalty_no_eos, args.unsup_coef, args.ema_beta)
    reward_engine = engines.reward

    step = 0

    @torch.no_grad()
    def score_fn(seq, mask, prompt_len):
        mb = args.per_device_training_batch_size
        scores = torch.cat([reward_engine(seq[i:i + mb], mask[i:i + mb]).end_scores for i in range(0, len(seq), mb)])
        return scores * float("nan") if step + 1 in args.debug_nonfinite_steps else scores

    trainer = PPOTrainer(engines.actor, engines.critic, engines.reference, score_fn, generate, kl_ctl, settings,
                         tokenizer.eos_token_id, tokenizer.pad_token_id, ema=engines.ema,
                         on_actor_step=hybrid.mark_weights_stale)
    tracker = Tracker(args.output_dir, info.is_main, args.enable_tensorboard, args.tensorboard_path,
                      progress=not args.disable_progress_bar)
    tracker.write(f"step 3: {len(data.train)} prompts, {total_buffers} experience buffers of "
                  f"{args.generation_batches}×{args.per_device_generation_batch_size} rollouts per rank × "
                  f"{info.world_size} ranks, {args.ppo_epochs} PPO epoch(s); actor ZeRO-{args.actor_zero_stage}, "
                  f"critic ZeRO-{args.critic_zero_stage}, hybrid engine {'on' if args.enable_hybrid_engine else 'off'}")
    trained = {"actor": engines.actor, "critic": engines.critic}
    ckpt = LoopCheckpoints(args, trained, {"actor_ema": engines.ema.module} if engines.ema is not None else None)
    resumed, samples = ckpt.resume(), 0

    def state() -> dict:
        return {"epoch": step // steps_per_epoch, "kl_ctl": kl_ctl.state_dict(), "samples": samples,
                "ptx_batches": ptx_iter.consumed if ptx_iter is not None else 0}

    if resumed:
        step, samples = resumed["step"], resumed["samples"]
        kl_ctl.load_state_dict(resumed["kl_ctl"])
        if ptx_iter is not None:
            ptx_iter.skip(resumed["ptx_batches"])
        hybrid.mark_weights_stale()
        tracker.resumed_at(step)
        tracker.write(f"resumed from {resumed['path']} at step {step} ({samples} rollouts so far, "
                      f"KL coefficient {kl_ctl.value:.4g})")
    tracker.bar(total_buffers, "step 3 PPO", initial=step)
    t_start, metrics = time.time(), {}
    while step < total_buffers:
        it = batches_from(loader, step, steps_per_epoch, args.generation_batches)
        for _ in range(steps_per_epoch - step % steps_per_epoch):
            t0 = time.time()
            stats: dict = {}
            for _ in range(args.generation_batches):
                batch = {k: v.to(info.device) for k, v in next(it).items()}
                exp, times = trainer.make_experience(batch["input_ids"], batch["attention_mask"])
                t1 = time.time()
                learned = trainer.learn(exp, ptx_iter)
                times["time/train"] = time.time() - t1
                for k, v in {**summarize(exp, kl_ctl.value, tokenizer.eos_token_id), **learned, **times,
                             **{f"time/{k}": v for k, v in hybrid.timings.items()}}.items():
                    stats[k] = stats.get(k, 0.0) + float(v) / args.generation_batches
            step += 1
            set_progress(optimizer_step=step)
            rollouts = args.generation_batches * args.per_device_generation_batch_size * info.world_size
            samples += rollouts
            metrics = reduce_stats(stats)
            if not ckpt.after_step(step, state()):  # a skipped (non-finite) step tells the KL controller nothing
                kl_ctl.update(metrics["kl"], rollouts)
            metrics["skipped_steps"] = ckpt.skipped
            metrics["samples"] = samples
            metrics["samples_per_s"] = rollouts / (time.time() - t0)
            metrics["elapsed_min"] = (time.time() - t_start) / 60
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
            if step >= total_buffers or step == args.stop_after_steps:
                break
        if step == args.stop_after_steps:
            tracker.write(f"stopping after step {step} (--stop_after_steps), without the final save")
            tracker.close()
            return metrics
    tracker.close()
    hybrid.exit_inference()
    out = args.output_dir
    dist.save_hf_model(engines.actor.module, tokenizer, f"{out}/actor")
    save_reward_model(engines.critic.module, tokenizer, f"{out}/critic")
    if engines.ema is not None:
        dist.save_hf_model(engines.ema.module, tokenizer, f"{out}/actor_ema")
    if info.is_main:
        cli.write_run_marker(out, {"step": 3, "steps": step, "metrics": metrics, "args": vars(args)})
    return metrics


class Cycle:
    """Endless batches of ``loader`` (a DistributedSampler's), epoch after epoch, on ``device``.

    ``consumed`` counts the batches handed out; a resumed run calls :meth:`skip` with it to
    continue where the checkpoint was taken.
    """

    def __init__(self, loader, device):
        self.loader, self.device, self.consumed = loader, device, 0
        self._it, self._epoch = None, 0

    def __iter__(self):
        return self

    def _next_raw(self) -> dict:
        while True:
            if self._it is None:
                self.loader.sampler.set_epoch(self._epoch)
                self._it = iter(self.loader)
            try:
                batch = next(self._it)
                self.consumed += 1
                return batch
            except StopIteration:
                self._it, self._epoch = None, self._epoch + 1

    def __next__(self) -> dict:
        return {k: v.to(self.device) for k, v in self._next_raw().items()}

    def skip(self, n: int) -> None:
        """Hand out (and drop) ``n`` batches."""
        for _ in range(n):
            self._next_raw()


if __name__ == "__main__":
    main()
