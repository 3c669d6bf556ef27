"""Step 2, alternative: direct preference optimisation of the step-1 actor (DPO, IPO, hinge, SimPO).

Read top to bottom: flags, set-up (distributed, data, policy, DeepSpeed engine, reference),
evaluation before training, the training loop with evaluation every ``--eval_interval`` steps and
at each epoch end, an optional greedy-answer EOS check, then the HF-format save (a causal LM that
``chat.py`` and step 3 load).

Maths: :mod:`chatrl.step2_dpo.loss` (per-pair losses of Rafailov et al. 2023, Azar et al. 2023,
Zhao et al. 2023, Meng et al. 2024; label smoothing of cDPO). The reference: see
:mod:`chatrl.step2_dpo.reference`. An optimizer step's loss is the mean over its pairs, all ranks:
each micro-batch's pair losses are summed and divided by the step's pair count over every
micro-batch and rank (times accumulation × ranks, which DeepSpeed divides by), so the gradient does
not depend on how the pairs are cut into micro-batches (``--max_tokens_per_micro_batch``) or laid out
(``--packing``: rows without padding, docs/packing.md).

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
import logging
import time
from dataclasses import dataclass

import torch

from chatrl import cli, config, dist, program
from chatrl.certificate import SupervisedEvidence, sequence_chunks
from chatrl.checkpoint import LoopCheckpoints, batches_from, resume_path, write_run_marker
from chatrl.config import setting, uses
from chatrl.data import phase_data
from chatrl.data.collate import MicroBatches
from chatrl.generation import eos_rate
from chatrl.models import check_packing, load_tokenizer
from chatrl.resilience import set_progress
from chatrl.sizes import BatchSizes, plan_steps
from chatrl.step2_dpo.batch import (
    DPOCollator,
    IndexedPairs,
    PackedDPOCollator,
    batch_answer_logps,
    split_pairs,
)
from chatrl.step2_dpo.loss import DPOConfig, preference_loss, reward_stats
from chatrl.step2_dpo.reference import build_reference, reference_kind
from chatrl.tracking import Tracker
from chatrl.trainable import load_trainable
from chatrl.weights import save_hf_model, save_snapshot_if_due

log = logging.getLogger("chatrl.step2_dpo")

# Sums kept per batch for the metrics, in this order (see stats_row / describe).
STAT_KEYS = ("count", "loss", "correct", "chosen", "rejected", "margin", "logps_chosen", "logps_rejected")


@dataclass
class ReferenceConfig:
    """DPO's reference model."""

    precompute_ref_log_probs: bool = setting(False, "score the training and eval pairs with the reference once "
                                                    "before training, then free it")


@dataclass
class DPOSettings(config.TrainingSettings):
    """DPO's blocks: the training blocks (with the frozen reference's ZeRO flags), DPO's loss and reference, the EOS check."""

    optim: config.OptimConfig = uses(config.OptimConfig, defaults={"learning_rate": 5e-6})
    zero: config.ZeroConfig = uses(config.ZeroConfig, only=("zero_stage", "offload", "offload_reference_model",
                                                            "partition_frozen_models", "local_rank"))
    dpo: DPOConfig = uses(DPOConfig, title="DPO")
    reference: ReferenceConfig = uses(ReferenceConfig, title="DPO")
    eos_check: config.EosCheckConfig = uses(config.EosCheckConfig, title="evaluation")
    snapshots: config.SnapshotConfig = uses(config.SnapshotConfig)


def build_parser() -> argparse.ArgumentParser:
    """DPO's flags (:class:`DPOSettings`)."""
    return config.program_parser(DPOSettings, "chatrl step 2 (alternative): direct preference optimisation (DPO, "
                                              "IPO, hinge, SimPO)", prog="python -m chatrl.step2_dpo")


def stats_row(losses, chosen_r, rejected_r, logps_c, logps_r) -> torch.Tensor:
    """The :data:`STAT_KEYS` sums of one batch's pairs, float64 ``(8,)`` on CPU."""
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


def pair_forward(engine, batch, reference, settings: DPOConfig, device, split: str = "train"):
    """Policy log-probs (with gradients), reference log-probs and the loss of one DPO batch.

    Returns ``(losses (B,), chosen_rewards, rejected_rewards, logps_chosen, logps_rejected)``.
    """
    ref = reference.logps(batch, split)
    logps, n_tokens = batch_answer_logps(engine, batch, device)
    pc, pr = split_pairs(logps)
    nc, nr = split_pairs(n_tokens)
    rc, rr = ref if ref is not None else (None, None)
    losses, chosen_r, rejected_r = preference_loss(settings, pc, pr, rc, rr, nc, nr)
    return losses, chosen_r, rejected_r, pc, pr


@torch.no_grad()
def evaluate(engine, reference, settings: DPOConfig, dataset, collate, batch: config.BatchConfig, info) -> dict:
    """``eval/*`` metrics (module docstring) over the eval split, summed over ranks; policy without dropout."""
    engine.eval()
    total = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
    batches = dist.eval_batches(dataset, collate, batch.per_device_eval_batch_size, info.rank, info.world_size)
    for n_batch, (b, real) in enumerate(batches):
        if batch.eval_iters and n_batch >= batch.eval_iters:
            break
        losses, cr, rr, lc, lr = pair_forward(engine, b, reference, settings, info.device, "eval")
        real = real.to(losses.device)
        if real.any():
            total += stats_row(losses[real], cr[real], rr[real], lc[real], lr[real])
    engine.train()
    total = dist.all_reduce_sum(total)
    return {**metrics_from(total, "eval"), "eval/pairs": total[0].item()}


def describe(m: dict, prefix: str = "eval") -> str:
    """One line of ``prefix/*`` metrics for the log."""
    return (f"loss {m[f'{prefix}/loss']:.4f}, rewards/accuracy {m[f'{prefix}/rewards/accuracy']:.4f}, "
            f"rewards/margin {m[f'{prefix}/rewards/margin']:.4f}, logps chosen {m[f'{prefix}/logps/chosen']:.2f} "
            f"rejected {m[f'{prefix}/logps/rejected']:.2f}")


def chosen_prompts(pairs, n: int) -> list:
    """The prompt ids of the first ``n`` pairs (for the EOS check)."""
    return [pairs[i]["chosen_input_ids"][: pairs[i]["prompt_len"]] for i in range(min(n, len(pairs)))]


def one_batch_loss(dataset, collate, settings: DPOConfig):
    """The loss of a global batch as one micro-batch on one rank, by its definition (the loss-scale
    probe's reference): every rank's pairs collated together, the mean per-pair loss, with the
    reference log-probs the loop computed for them (``parts``: per rank, ``(sample_index, ref)`` per
    micro-batch, ``ref`` the reference's ``(chosen, rejected)`` log-probs or None), in parts of
    :data:`chatrl.certificate.PROBE_CHUNK` pairs (each part's summed loss over the pair count)."""

    def loss(model, parts: list):
        micro = [m for part in parts for m in part]
        rows = [dataset[i] for idx, _ in micro for i in idx.tolist()]
        refs = [ref for _, ref in micro]
        rc, rr = (None, None) if refs[0] is None else (torch.cat([r[0] for r in refs]), torch.cat([r[1] for r in refs]))
        for k in sequence_chunks(len(rows)):
            b = collate(rows[k.start:k.stop])
            logps, n_tokens = batch_answer_logps(model, b, next(model.parameters()).device)
            (pc, pr), (nc, nr) = split_pairs(logps), split_pairs(n_tokens)
            ref = (None, None) if rc is None else (rc[k.start:k.stop].to(pc.device), rr[k.start:k.stop].to(pc.device))
            yield preference_loss(settings, pc, pr, *ref, nc, nr)[0].sum() / len(rows)

    return loss


def main(argv: list[str] | None = None) -> dict:
    """Run DPO; returns the final metrics (also written to ``OUTPUT_DIR/logs/metrics.jsonl``)."""
    return run(argv)["metrics"]


def run(argv: list[str] | None = None) -> dict:
    """Run DPO and return ``{"metrics", "engine", "reference", "tokenizer", "settings"}`` (for in-process checks)."""
    parser = build_parser()
    args = cli.parse(parser, argv)
    try:
        s: DPOSettings = config.read(DPOSettings, args)
    except ValueError as err:
        parser.error(str(err))
    check_packing(s.packing, s.model.model_name_or_path, s.model.trust_remote_code)
    info = program.start("step 2 (DPO)", s.log, s.optim.seed, s.ckpt)

    tokenizer = load_tokenizer(s.model.model_name_or_path, trust_remote_code=s.model.trust_remote_code)
    # Phase-2 pairs; over-long prompts are cut from the left, identical pairs skipped and counted.
    data = phase_data(2, s.data, tokenizer, s.optim.seed)
    train_pairs, eval_pairs = IndexedPairs(data.train), IndexedPairs(data.eval)
    collate = DPOCollator(tokenizer.pad_token_id, padding_side="right")  # eval and reference precompute batches
    # training: each optimizer step's pairs, cut into micro-batches by count or token budget, padded or packed
    loader = dist.seeded_loader(train_pairs, s.batch.per_device_train_batch_size, list, info, s.optim.seed)
    micro_batches = MicroBatches(PackedDPOCollator(tokenizer.pad_token_id) if s.packing.packing else collate,
                                 s.batch.per_device_train_batch_size, s.packing.max_tokens_per_micro_batch,
                                 info.device, dist.all_reduce_max)

    batch = BatchSizes(s.batch.per_device_train_batch_size, s.optim.gradient_accumulation_steps, info.world_size)
    plan = plan_steps(len(loader), len(train_pairs), batch, s.optim.num_train_epochs, s.optim.max_steps,
                      s.optim.num_warmup_steps, what="pairs")
    steps_per_epoch, total_steps = plan.steps_per_epoch, plan.total_steps
    ref_kind = reference_kind(s.dpo, s.lora)
    # the frozen reference, when it is a copy: the policy's weights as loaded, before LoRA
    model, ref_model = load_trainable("causal_lm", tokenizer, s.model, s.lora,
                                      keep_copy="base" if ref_kind == "copy" else None)
    evidence = SupervisedEvidence.start("step 2 (DPO)", model, s.model.dtype,
                                        not s.certificate.disable_loss_scale_probe,
                                        resume_path(s.ckpt, s.log.output_dir) is not None, s.log.output_dir,
                                        loader, steps_per_epoch, batch.gradient_accumulation_steps, data.report)
    engine = dist.trained_engine(model, s.optim, s.lora, s.zero, s.model.dtype, batch, total_steps,
                                 plan.num_warmup_steps)
    reference = build_reference(ref_kind, s.zero, s.model.dtype, ref_model, engine, batch, info)
    del ref_model

    tracker = Tracker.for_run(s.log, info.is_main)
    tracker.write(f"step 2 (DPO, {s.dpo.loss_type}, β {s.dpo.beta}, ε {s.dpo.label_smoothing}): "
                  f"{len(train_pairs)} pairs, {total_steps} optimizer steps of global batch {batch.global_batch} "
                  f"pairs ({info.world_size} ranks × {batch.per_device_batch} × {batch.gradient_accumulation_steps} "
                  f"accumulation), ZeRO-{s.zero.zero_stage}, {s.model.dtype_note}, reference: {reference.kind}")
    for note in plan.notes:  # defaults that adapted to a short run, said once
        tracker.write(note)
    if s.reference.precompute_ref_log_probs and reference.kind != "none":
        t_ref = time.time()
        for split, pairs in (("train", train_pairs), ("eval", eval_pairs)):
            reference.precompute(split, pairs, collate, s.batch.per_device_eval_batch_size, info.rank,
                                 info.world_size)
        reference.release()
        tracker.write(f"reference log-probs of {len(train_pairs)} + {len(eval_pairs)} pairs precomputed in "
                      f"{time.time() - t_ref:.1f} s; the reference model is released")
    ckpt = LoopCheckpoints(s.ckpt, s.log.output_dir, {"model": engine}, batch.layout(),
                           extra_state={"data_accounting": evidence.accounting})
    eos = s.eos_check
    step, resumed = 0, ckpt.resume()
    if resumed:
        step, initial = resumed["step"], resumed["initial_metrics"]
        evidence.cert.restore(resumed.get("certificate"))
        metrics = dict(initial)
        tracker.resumed_at(step)
        tracker.write(f"resumed from {resumed['path']} at optimizer step {step}")
    elif data.evaluates:  # else the data layer said once that training proceeds without evaluation
        metrics = evaluate(engine, reference, s.dpo, eval_pairs, collate, s.batch, info)
        if eos.eval_eos_samples:  # the same prompts as the check at the end: the share before vs after DPO
            metrics["eval/eos_rate"] = eos_rate(engine, chosen_prompts(data.eval, eos.eval_eos_samples), tokenizer,
                                                eos.eval_max_new_tokens, s.zero.zero_stage, info)
        initial = dict(metrics)
        tracker.log(metrics, step=0)
        tracker.write(f"eval before training: {describe(metrics)}"
                      + (f", greedy answers ending in EOS {metrics['eval/eos_rate']:.1%}" if eos.eval_eos_samples
                         else ""))
    else:
        metrics, initial = {}, {}
    tracker.bar(total_steps, "step 2 DPO", initial=step)

    engine.train()  # from_pretrained returns eval mode; dropout must be on whether or not we evaluated first
    t0, first_step = time.time(), step
    scale_base = info.world_size * batch.gradient_accumulation_steps
    while step < total_steps:
        it = batches_from(loader, step, steps_per_epoch, batch.gradient_accumulation_steps)
        for _ in range(steps_per_epoch - step % steps_per_epoch):
            stats = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
            micro = micro_batches([x for _ in range(batch.gradient_accumulation_steps) for x in next(it)])
            n_global = dist.all_reduce_sum(torch.tensor(float(sum(len(m["sample_index"]) for m in micro)))).item()
            probe_items = []
            for i, m in enumerate(micro):
                evidence.accounting.record(step // steps_per_epoch, m)
                if s.packing.max_tokens_per_micro_batch:  # their number varies: the last one ends the step
                    engine.set_gradient_accumulation_boundary(i == len(micro) - 1)
                if evidence.probe.active:  # the reference log-probs of the probe's one micro-batch (constants)
                    ref = reference.logps(m, "train")
                    probe_items.append((m["sample_index"], None if ref is None else tuple(r.cpu() for r in ref)))
                losses, chosen_r, rejected_r, lc, lr = pair_forward(engine, m, reference, s.dpo, info.device)
                loss = losses.sum() * (scale_base / max(n_global, 1.0))
                if step + 1 in s.ckpt.debug_nonfinite_steps:
                    loss = loss * float("nan")
                engine.backward(loss)
                engine.step()
                stats += stats_row(losses, chosen_r, rejected_r, lc, lr)
            step += 1
            set_progress(optimizer_step=step)
            tracker.advance()
            if evidence.probe.active:  # the first optimizer step against the same batch as one micro-batch on one rank
                evidence.check_loss_scale(engine.get_global_grad_norm(), probe_items,
                                          one_batch_loss(train_pairs, collate, s.dpo))
            state = {"epoch": step // steps_per_epoch, "initial_metrics": initial, "certificate": evidence.cert.state()}
            ckpt.after_step(step, state)
            if step % s.log.log_interval == 0 or step == total_steps:
                tracker.log({**metrics_from(dist.all_reduce_sum(stats), "train"),
                             "train/lr": engine.lr_scheduler.get_last_lr()[0], "train/skipped_steps": ckpt.skipped,
                             "train/pairs_per_s": (step - first_step) * batch.global_batch / (time.time() - t0)},
                            step)
            epoch_end = step % steps_per_epoch == 0
            due = (s.log.eval_interval and step % s.log.eval_interval == 0) or epoch_end or step == total_steps
            if due and data.evaluates:
                metrics = evaluate(engine, reference, s.dpo, eval_pairs, collate, s.batch, info)
                tracker.log(metrics, step)
                tracker.write(f"step {step}: eval {describe(metrics)}")
            ckpt.save_if_due(step, total_steps, state)
            save_snapshot_if_due(s.snapshots.save_hf_interval, step, total_steps, engine.module, tokenizer,
                                 s.log.output_dir)  # the policy as an HF folder, for python -m chatrl.eval
            if step >= total_steps or ckpt.stop_here(step):
                break
        if ckpt.stop_here(step):
            ckpt.note_stop(step, tracker)
            return {"metrics": metrics, "engine": engine, "reference": reference, "tokenizer": tokenizer,
                    "settings": s}
    evidence.finish(step)

    if eos.eval_eos_samples and data.evaluates:  # the EOS check reads the eval split's prompts
        rate = eos_rate(engine, chosen_prompts(data.eval, eos.eval_eos_samples), tokenizer, eos.eval_max_new_tokens,
                        s.zero.zero_stage, info)
        metrics["eval/eos_rate"] = rate
        tracker.log({"eval/eos_rate": rate}, step)
        before = initial.get("eval/eos_rate")
        tracker.write(f"greedy answers ending in EOS within {eos.eval_max_new_tokens} tokens: {rate:.1%}"
                      + (f" (before DPO: {before:.1%})" if before is not None else ""))
    if plan.cap_note:
        tracker.write(plan.cap_note)
    tracker.close()
    save_hf_model(engine.module, tokenizer, s.log.output_dir)
    if info.is_main:
        write_run_marker(s.log.output_dir, {"step": "2-dpo", "steps": step, "metrics": metrics,
                                            "initial_metrics": initial, "args": vars(args)})
    return {"metrics": metrics, "engine": engine, "reference": reference, "tokenizer": tokenizer, "settings": s}


if __name__ == "__main__":
    main()
