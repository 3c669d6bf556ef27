"""Step 2, alternative: direct preference optimisation of the step-1 actor (DPO, IPO, hinge, SimPO).

Read top to bottom: flags, set-up (distributed, data, policy, DeepSpeed engine, reference),
evaluation before training, the training loop with evaluation every ``--eval_interval`` steps and
at each epoch end, an optional greedy-answer EOS check, then the HF-format save (a causal LM that
``chat.py`` and step 3 load).

Maths: :mod:`chatrl.step2_dpo.loss` (per-pair losses of Rafailov et al. 2023, Azar et al. 2023,
Zhao et al. 2023, Meng et al. 2024; label smoothing of cDPO). The reference: see
:mod:`chatrl.step2_dpo.reference`. A micro-batch's loss is the mean over its pairs; DeepSpeed
averages micro-batches and ranks.

Metrics (``OUTPUT_DIR/logs/metrics.jsonl``, TensorBoard with ``--enable_tensorboard``), for
``train/`` (the optimizer step's pairs, all ranks) and ``eval/`` (the held-out pairs):

==========================  ==================================================================
``loss``                    mean per-pair loss
``rewards/chosen``          mean implicit reward of the chosen answers, ``β (log π − log π_ref)``
``rewards/rejected``        the same for the rejected answers
``rewards/accuracy``        share of pairs whose chosen reward is above the rejected (ties wrong)
``rewards/margin``          mean ``rewards/chosen − rewards/rejected``
``logps/chosen``            mean summed log-prob of the chosen answers under the policy (nats)
``logps/rejected``          the same for the rejected answers
``eval/pairs``              eval pairs scored; ``eval/eos_rate`` with ``--eval_eos_samples`` (before
                            training and at the end, the same prompts)
==========================  ==================================================================

Run ``python -m chatrl.step2_dpo --help`` for the flags.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
from dataclasses import dataclass, fields

import torch

from chatrl import cli, config
from chatrl.config import setting
from chatrl.step1_sft.main import SFTConfig, eos_rate
from chatrl.step2_dpo.loss import LOSS_TYPES
from chatrl.tracking import Tracker, setup_logging

log = logging.getLogger("chatrl.step2_dpo")

# Sums kept per batch for the metrics, in this order (see stats_row / describe).
STAT_KEYS = ("count", "loss", "correct", "chosen", "rejected", "margin", "logps_chosen", "logps_rejected")


@dataclass
class DPOConfig:
    """DPO (DeepSpeed-Chat's names for ``--beta``, ``--label_smoothing``; TRL's for the others)."""

    beta: float = setting(0.1, "β: inverse temperature of the implicit reward β·log(π/π_ref); larger keeps the "
                               "policy closer to the reference")
    label_smoothing: float = setting(0.0, "ε in [0, 0.5): assumed share of flipped preference labels (conservative "
                                          "DPO; sigmoid and simpo losses)")
    loss_type: str = setting("sigmoid", "sigmoid: DPO; ipo: IPO (squared loss, target margin 1/(2β)); hinge: SLiC "
                                        "hinge; simpo: SimPO (reference-free, length-normalised log-probs)",
                             choices=LOSS_TYPES)
    simpo_gamma: float = setting(0.5, "γ: SimPO's target reward margin, in reward units (TRL's gamma_beta_ratio is "
                                      "γ/β)")
    rpo_alpha: float = setting(0.0, "α: weight of an SFT term on the chosen answer, α·(−log π(y_w|x)/|y_w|), "
                                    "added to each pair's loss (RPO, Pang et al. 2024; TRL's name); keeps the "
                                    "chosen answers and their EOS likely (docs/dpo.md). 0: plain DPO",
                               unit="loss weight")
    precompute_ref_log_probs: bool = setting(False, "score the training and eval pairs with the reference once "
                                                    "before training, then free it")
    disable_dropout: bool = setting(False, "DeepSpeed-Chat's spelling of --dropout 0.0")


def build_parser() -> argparse.ArgumentParser:
    p = cli.new_parser("chatrl step 2 (alternative): direct preference optimisation (DPO, IPO, hinge, SimPO)",
                       prog="python -m chatrl.step2_dpo")
    cli.add_model_args(p)
    cli.add_lora_args(p)
    cli.add_data_args(p, max_seq_len=512)
    cli.add_optim_args(p, lr=5e-6)
    config.add_block(p, config.ZeroConfig, only=("zero_stage", "offload", "offload_reference_model",
                                                 "partition_frozen_models", "local_rank"))
    cli.add_log_args(p)
    cli.add_checkpoint_args(p)
    config.add_block(p, DPOConfig, title="DPO")
    config.add_block(p, SFTConfig, only=("eval_eos_samples", "eval_max_new_tokens"),
                     title="evaluation")
    return p


def stats_row(losses, chosen_r, rejected_r, logps_c, logps_r) -> torch.Tensor:
    """The :data:`STAT_KEYS` sums of one batch's pairs, float64 ``(8,)`` on CPU."""
    from chatrl.step2_dpo.loss import reward_stats

    s = reward_stats(chosen_r.cpu(), rejected_r.cpu())
    return torch.stack([s["count"], losses.detach().double().sum().cpu(), s["correct"], s["chosen"],
                        s["rejected"], s["margin"], logps_c.detach().double().sum().cpu(),
                        logps_r.detach().double().sum().cpu()])


def metrics_from(total: torch.Tensor, prefix: str) -> dict:
    """``prefix/…`` means from summed :data:`STAT_KEYS` (NaN when no pair was counted)."""
    count, loss, correct, chosen, rejected, margin, lc, lr = total.tolist()
    n = count if count else float("nan")
    return {f"{prefix}/loss": loss / n, f"{prefix}/rewards/chosen": chosen / n,
            f"{prefix}/rewards/rejected": rejected / n, f"{prefix}/rewards/accuracy": correct / n,
            f"{prefix}/rewards/margin": margin / n, f"{prefix}/logps/chosen": lc / n,
            f"{prefix}/logps/rejected": lr / n}


def pair_forward(engine, batch, reference, settings, device, split: str = "train"):
    """Policy log-probs (with gradients), reference log-probs and the loss of one DPO batch.

    Returns ``(losses (B,), chosen_rewards, rejected_rewards, logps_chosen, logps_rejected)``.
    """
    from chatrl.models import causal_lm_logits
    from chatrl.step2_dpo.batch import split_pairs
    from chatrl.step2_dpo.loss import answer_logps, preference_loss

    ref = reference.logps(batch, split)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    logps, n_tokens = answer_logps(causal_lm_logits(engine, ids, mask), ids, batch["answer_mask"].to(device))
    pc, pr = split_pairs(logps)
    nc, nr = split_pairs(n_tokens)
    rc, rr = ref if ref is not None else (None, None)
    losses, chosen_r, rejected_r = preference_loss(settings, pc, pr, rc, rr, nc, nr)
    return losses, chosen_r, rejected_r, pc, pr


@torch.no_grad()
def evaluate(engine, reference, settings, dataset, collate, args, info) -> dict:
    """``eval/*`` metrics (module docstring) over the eval split, summed over ranks; policy without dropout."""
    from chatrl.dist import all_reduce_sum, eval_batches

    engine.eval()
    total = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
    batches = eval_batches(dataset, collate, args.per_device_eval_batch_size, info.rank, info.world_size)
    for n_batch, (batch, real) in enumerate(batches):
        if args.eval_iters and n_batch >= args.eval_iters:
            break
        losses, cr, rr, lc, lr = pair_forward(engine, batch, reference, settings, info.device, "eval")
        real = real.to(losses.device)
        if real.any():
            total += stats_row(losses[real], cr[real], rr[real], lc[real], lr[real])
    engine.train()
    total = all_reduce_sum(total)
    return {**metrics_from(total, "eval"), "eval/pairs": total[0].item()}


def describe(m: dict, prefix: str = "eval") -> str:
    return (f"loss {m[f'{prefix}/loss']:.4f}, rewards/accuracy {m[f'{prefix}/rewards/accuracy']:.4f}, "
            f"rewards/margin {m[f'{prefix}/rewards/margin']:.4f}, logps chosen {m[f'{prefix}/logps/chosen']:.2f} "
            f"rejected {m[f'{prefix}/logps/rejected']:.2f}")


class _ChosenAsSFT:
    """Eval pairs seen as phase-1 rows (``input_ids``, ``prompt_len``) for step 1's EOS check."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        row = self.pairs[i]
        return {"input_ids": row["chosen_input_ids"], "prompt_len": row["prompt_len"]}


def main(argv: list[str] | None = None) -> dict:
    """Run DPO; returns the final metrics (also written to ``OUTPUT_DIR/logs/metrics.jsonl``)."""
    return run(argv)["metrics"]


def run(argv: list[str] | None = None) -> dict:
    """Run DPO and return ``{"metrics", "engine", "reference", "tokenizer", "args"}`` (for in-process checks)."""
    args = cli.parse(build_parser(), argv)
    from transformers import get_scheduler, set_seed

    from chatrl import dist
    from chatrl.checkpoint import LoopCheckpoints, batches_from, check_output_dir, write_run_marker
    from chatrl.data import build_phase_data
    from chatrl.models import (
        LoraSettings,
        apply_lora,
        enable_gradient_checkpointing,
        load_causal_lm,
        load_tokenizer,
        optimizer_param_groups,
    )
    from chatrl.resilience import set_progress
    from chatrl.sizes import BatchSizes, plan_steps
    from chatrl.step2_dpo.batch import DPOCollator, IndexedPairs
    from chatrl.step2_dpo.loss import DPOSettings
    from chatrl.step2_dpo.reference import build_reference, reference_kind
    from chatrl.weights import save_hf_model

    try:
        settings = DPOSettings(**{f.name: getattr(args, f.name) for f in fields(DPOSettings)})
    except ValueError as err:
        build_parser().error(str(err))
    set_progress("step 2 (DPO)")
    info = dist.init_distributed()
    setup_logging(info.rank)
    check_output_dir(args.output_dir, args.overwrite_output_dir)
    set_seed(args.seed)
    dropout = 0.0 if args.disable_dropout else args.dropout

    tokenizer = load_tokenizer(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    # Phase-2 pairs; over-long prompts are cut from the left, identical pairs skipped and counted.
    data = build_phase_data(2, args.data_path, tokenizer, data_split=args.data_split, max_seq_len=args.max_seq_len,
                            eval_fraction=args.eval_fraction, eval_data_paths=args.eval_data_path,
                            seed=args.seed, cache_dir=args.data_output_path)
    train_pairs, eval_pairs = IndexedPairs(data.train), IndexedPairs(data.eval)
    collate = DPOCollator(tokenizer.pad_token_id, padding_side="right")
    loader = dist.seeded_loader(train_pairs, args.per_device_train_batch_size, collate, info, args.seed)

    model = load_causal_lm(args.model_name_or_path, tokenizer, dtype=args.dtype, dropout=dropout,
                           trust_remote_code=args.trust_remote_code)
    lora = LoraSettings(args.lora_dim, args.lora_module_name, args.only_optimize_lora, args.lora_learning_rate)
    ref_kind = reference_kind(settings, lora)
    ref_model = copy.deepcopy(model) if ref_kind == "copy" else None  # the frozen reference: the same weights
    model = apply_lora(model, lora)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)

    batch = BatchSizes(args.per_device_train_batch_size, args.gradient_accumulation_steps, info.world_size)
    plan = plan_steps(len(loader), len(train_pairs), batch, args.num_train_epochs, args.max_steps,
                      args.num_warmup_steps, what="pairs")
    steps_per_epoch, total_steps = plan.steps_per_epoch, plan.total_steps
    optimizer = dist.make_optimizer(
        optimizer_param_groups(model, args.weight_decay, args.lora_learning_rate if lora.enabled else None),
        lr=args.learning_rate, offload=args.offload)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.num_warmup_steps,
                              num_training_steps=total_steps)
    ds_config = dist.deepspeed_config(batch, args.zero_stage, args.offload, args.dtype, args.gradient_clipping)
    engine = dist.initialize(model, ds_config, optimizer, scheduler)
    reference = build_reference(ref_kind, args, ref_model, engine, batch, info)
    del ref_model

    tracker = Tracker(args.output_dir, info.is_main, args.enable_tensorboard, args.tensorboard_path,
                      progress=not args.disable_progress_bar)
    tracker.write(f"step 2 (DPO, {settings.loss_type}, β {settings.beta}, ε {settings.label_smoothing}): "
                  f"{len(train_pairs)} pairs, {total_steps} optimizer steps of global batch {batch.global_batch} "
                  f"pairs ({info.world_size} ranks × {batch.per_device_batch} × {batch.gradient_accumulation_steps} "
                  f"accumulation), ZeRO-{args.zero_stage}, {args.dtype}, reference: {reference.kind}")
    if args.precompute_ref_log_probs and reference.kind != "none":
        t_ref = time.time()
        for split, pairs in (("train", train_pairs), ("eval", eval_pairs)):
            reference.precompute(split, pairs, collate, args.per_device_eval_batch_size, info.rank, info.world_size)
        reference.release()
        tracker.write(f"reference log-probs of {len(train_pairs)} + {len(eval_pairs)} pairs precomputed in "
                      f"{time.time() - t_ref:.1f} s; the reference model is released")
    ckpt = LoopCheckpoints(args, {"model": engine})
    step, resumed = 0, ckpt.resume()
    if resumed:
        step, initial = resumed["step"], resumed["initial_metrics"]
        metrics = dict(initial)
        tracker.resumed_at(step)
        tracker.write(f"resumed from {resumed['path']} at optimizer step {step}")
    else:
        metrics = evaluate(engine, reference, settings, eval_pairs, collate, args, info)
        if args.eval_eos_samples:  # the same prompts as the check at the end: the share before vs after DPO
            metrics["eval/eos_rate"] = eos_rate(engine, _ChosenAsSFT(data.eval), tokenizer, args.eval_eos_samples,
                                                args.eval_max_new_tokens, args.zero_stage, info)
        initial = dict(metrics)
        tracker.log(metrics, step=0)
        tracker.write(f"eval before training: {describe(metrics)}"
                      + (f", greedy answers ending in EOS {metrics['eval/eos_rate']:.1%}" if args.eval_eos_samples
                         else ""))
    tracker.bar(total_steps, "step 2 DPO", initial=step)

    engine.train()  # from_pretrained returns eval mode; dropout must be on whether or not we evaluated first
    t0, first_step = time.time(), step
    while step < total_steps:
        it = batches_from(loader, step, steps_per_epoch, batch.gradient_accumulation_steps)
        for _ in range(steps_per_epoch - step % steps_per_epoch):
            stats = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
            for _ in range(batch.gradient_accumulation_steps):
                m = next(it)
                losses, chosen_r, rejected_r, lc, lr = pair_forward(engine, m, reference, settings, info.device)
                loss = losses.mean()
                if step + 1 in args.debug_nonfinite_steps:
                    loss = loss * float("nan")
                engine.backward(loss)
                engine.step()
                stats += stats_row(losses, chosen_r, rejected_r, lc, lr)
            step += 1
            set_progress(optimizer_step=step)
            tracker.advance()
            state = {"epoch": step // steps_per_epoch, "initial_metrics": initial}
            ckpt.after_step(step, state)
            if step % args.log_interval == 0 or step == total_steps:
                tracker.log({**metrics_from(dist.all_reduce_sum(stats), "train"),
                             "train/lr": scheduler.get_last_lr()[0], "train/skipped_steps": ckpt.skipped,
                             "train/pairs_per_s": (step - first_step) * batch.global_batch / (time.time() - t0)},
                            step)
            epoch_end = step % steps_per_epoch == 0
            if (args.eval_interval and step % args.eval_interval == 0) or epoch_end or step == total_steps:
                metrics = evaluate(engine, reference, settings, eval_pairs, collate, args, info)
                tracker.log(metrics, step)
                tracker.write(f"step {step}: eval {describe(metrics)}")
            ckpt.save_if_due(step, total_steps, state)
            if step >= total_steps or ckpt.stop_here(step):
                break
        if ckpt.stop_here(step):
            ckpt.note_stop(step, tracker)
            return {"metrics": metrics, "engine": engine, "reference": reference, "tokenizer": tokenizer,
                    "args": args}

    if args.eval_eos_samples:
        rate = eos_rate(engine, _ChosenAsSFT(data.eval), tokenizer, args.eval_eos_samples, args.eval_max_new_tokens,
                        args.zero_stage, info)
        metrics["eval/eos_rate"] = rate
        tracker.log({"eval/eos_rate": rate}, step)
        before = initial.get("eval/eos_rate")
        tracker.write(f"greedy answers ending in EOS within {args.eval_max_new_tokens} tokens: {rate:.1%}"
                      + (f" (before DPO: {before:.1%})" if before is not None else ""))
    tracker.close()
    save_hf_model(engine.module, tokenizer, args.output_dir)
    if info.is_main:
        write_run_marker(args.output_dir, {"step": "2-dpo", "steps": step, "metrics": metrics,
                                               "initial_metrics": initial, "args": vars(args)})
    return {"metrics": metrics, "engine": engine, "reference": reference, "tokenizer": tokenizer, "args": args}


if __name__ == "__main__":
    main()
