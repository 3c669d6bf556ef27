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

from chatrl import cli, config, program
from chatrl.config import setting, uses
from chatrl.data import build_phase_data
from chatrl.distributed import dist
from chatrl.generation import eos_rate
from chatrl.models.trainable import load_trainable
from chatrl.run import Evaluation, Run, Saved, SupervisedData, sequence_chunks
from chatrl.step2_dpo.batch import (
    DPOCollator,
    IndexedPairs,
    PackedDPOCollator,
    batch_answer_logps,
    split_pairs,
)
from chatrl.step2_dpo.loss import DPOConfig, preference_loss, reward_stats
from chatrl.step2_dpo.reference import build_reference, reference_kind

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


def describe_eval(m: dict) -> str:
    """The eval line: :func:`describe`, and the EOS share when measured (before training)."""
    eos = f", greedy answers ending in EOS {m['eval/eos_rate']:.1%}" if "eval/eos_rate" in m else ""
    return describe(m) + eos


def precompute_reference(reference, tracker, splits: tuple, collate, batch: config.BatchConfig, info) -> None:
    """``--precompute_ref_log_probs``: the reference's log-probs of the training and eval pairs
    (``splits``), computed once, then the reference model released."""
    t_ref = time.time()
    for split, pairs in zip(("train", "eval"), splits, strict=True):
        reference.precompute(split, pairs, collate, batch.per_device_eval_batch_size, info.rank,
                             info.world_size)
    reference.release()
    tracker.write(f"reference log-probs of {len(splits[0])} + {len(splits[1])} pairs precomputed in "
                  f"{time.time() - t_ref:.1f} s; the reference model is released")


def chosen_prompts(pairs, n: int) -> list:
    """The prompt ids of the first ``n`` pairs (for the EOS check)."""
    return [pairs[i]["chosen_input_ids"][: pairs[i]["prompt_len"]] for i in range(min(n, len(pairs)))]


def eos_share(engine, tokenizer, s: DPOSettings, pairs, info) -> float:
    """The share of greedy answers to the prompts of the first ``--eval_eos_samples`` ``pairs`` that
    end their turn within ``--eval_max_new_tokens`` (:func:`chatrl.generation.eos_rate`; a collective)."""
    eos = s.eos_check
    return eos_rate(engine, chosen_prompts(pairs, eos.eval_eos_samples), tokenizer, eos.eval_max_new_tokens,
                    s.zero.zero_stage, info)


def eos_check(run, engine, tokenizer, s: DPOSettings, data, info) -> None:
    """At the end, with ``--eval_eos_samples`` and an eval split: the share of greedy answers that end
    their turn (:func:`eos_share`), logged and kept in the run's metrics beside the share before DPO."""
    eos = s.eos_check
    if eos.eval_eos_samples and data.evaluates:
        rate = run.metrics["eval/eos_rate"] = eos_share(engine, tokenizer, s, data.eval, info)
        run.tracker.log({"eval/eos_rate": rate}, run.step)
        before = run.initial.get("eval/eos_rate")
        run.tracker.write(f"greedy answers ending in EOS within {eos.eval_max_new_tokens} tokens: {rate:.1%}"
                          + (f" (before DPO: {before:.1%})" if before is not None else ""))


def one_batch_loss(dataset, collate, settings: DPOConfig):
    """The loss of a global batch as one micro-batch on one rank, by its definition (the loss-scale
    probe's reference): every rank's pairs collated together, the mean per-pair loss, with the
    reference log-probs the loop computed for them (``parts``: per rank, ``(sample_index, ref)`` per
    micro-batch, ``ref`` the reference's ``(chosen, rejected)`` log-probs or None), in parts of
    :data:`chatrl.run.PROBE_CHUNK` pairs (each part's summed loss over the pair count)."""

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


def policy_and_reference(s: DPOSettings, tokenizer, train: SupervisedData, report, info) -> tuple:
    """The policy's engine, the certificate's evidence (made before the engine wraps the policy) and
    the reference (:func:`chatrl.step2_dpo.reference.build_reference`; when it is a copy, the policy's
    weights as loaded, before LoRA). Returns ``(engine, evidence, reference)``."""
    ref_kind = reference_kind(s.dpo, s.lora)
    model, ref_model = load_trainable("causal_lm", tokenizer, s.model, s.lora,
                                      keep_copy="base" if ref_kind == "copy" else None)
    engine, evidence = train.engine("step 2 (DPO)", s, model, report)
    reference = build_reference(ref_kind, s.zero, s.model.dtype, ref_model, engine, train.batch, info)
    return engine, evidence, reference


def run(argv: list[str] | None = None) -> dict:
    """Run DPO and return ``{"metrics", "engine", "reference", "tokenizer", "settings"}`` (for in-process checks)."""
    parser = build_parser()
    args = cli.parse(parser, argv)
    try:
        s: DPOSettings = config.read(DPOSettings, args)
    except ValueError as err:
        parser.error(str(err))
    info, tokenizer = program.start_training("step 2 (DPO)", s, context_window=False)
    # Phase-2 pairs; over-long prompts are cut from the left, identical pairs skipped and counted.
    data = build_phase_data(2, s.data, tokenizer, seed=s.optim.seed)
    train_pairs, eval_pairs = IndexedPairs(data.train), IndexedPairs(data.eval)
    collate = DPOCollator(tokenizer.pad_token_id, padding_side="right")  # eval and reference precompute batches
    # training: each optimizer step's pairs, cut into micro-batches by count or token budget, padded or packed
    train = SupervisedData.of(s, info, train_pairs,
                              PackedDPOCollator(tokenizer.pad_token_id) if s.packing.packing else collate,
                              "pairs")
    batch, eos = train.batch, s.eos_check
    engine, evidence, reference = policy_and_reference(s, tokenizer, train, data.report, info)

    def evaluation(step: int) -> dict:
        metrics = evaluate(engine, reference, s.dpo, eval_pairs, collate, s.batch, info)
        if step == 0 and eos.eval_eos_samples:  # the prompts of the check at the end: before vs after
            metrics["eval/eos_rate"] = eos_share(engine, tokenizer, s, data.eval, info)
        return metrics

    def figures(stats: torch.Tensor) -> dict:  # the step's, logged when due
        return {**metrics_from(dist.all_reduce_sum(stats), "train"),
                "train/lr": engine.lr_scheduler.get_last_lr()[0], "train/skipped_steps": run.skipped,
                "train/pairs_per_s": run.per_second(batch.global_batch)}

    run = Run(s, info, train.schedule("step 2 DPO"), train.loader,
              Saved({"model": engine}, batch.layout(), hf_model=(engine.module, tokenizer)), evidence,
              opening=f"step 2 (DPO, {s.dpo.loss_type}, β {s.dpo.beta}, ε {s.dpo.label_smoothing}): "
                      f"{len(train_pairs)} pairs, {train.describe(info, s.zero.zero_stage, s.model.dtype_note)},"
                      f" reference: {reference.kind}",
              evaluation=Evaluation(evaluation, describe_eval) if data.evaluates else None)
    if s.reference.precompute_ref_log_probs and reference.kind != "none":
        precompute_reference(reference, run.tracker, (train_pairs, eval_pairs), collate, s.batch, info)
    engine.train()  # from_pretrained returns eval mode; dropout must be on whether or not we evaluated first
    scale_base = info.world_size * batch.gradient_accumulation_steps
    for step in run:
        stats = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
        micro = train.micro_batches(step.samples())
        n_global = dist.all_reduce_sum(torch.tensor(float(sum(len(m["sample_index"]) for m in micro)))).item()
        probe_items = []
        for i, m in enumerate(micro):
            step.account(m)
            if s.packing.max_tokens_per_micro_batch:  # their number varies: the last one ends the step
                engine.set_gradient_accumulation_boundary(i == len(micro) - 1)
            if step.probing:  # the reference log-probs of the probe's one micro-batch (constants)
                ref = reference.logps(m, "train")
                probe_items.append((m["sample_index"], None if ref is None else tuple(r.cpu() for r in ref)))
            losses, chosen_r, rejected_r, lc, lr = pair_forward(engine, m, reference, s.dpo, info.device)
            engine.backward(step.nonfinite(losses.sum() * (scale_base / max(n_global, 1.0))))
            engine.step()
            stats += stats_row(losses, chosen_r, rejected_r, lc, lr)
        if step.probing:  # the first optimizer step against the same batch as one micro-batch on one rank
            step.probe(probe_items, one_batch_loss(train_pairs, collate, s.dpo))
        step.done(figures, stats)

    run.finish("2-dpo", vars(args), before_save=lambda: eos_check(run, engine, tokenizer, s, data, info))
    return {"metrics": run.metrics, "engine": engine, "reference": reference, "tokenizer": tokenizer,
            "settings": s}


if __name__ == "__main__":
    main()
