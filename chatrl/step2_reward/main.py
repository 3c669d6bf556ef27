"""Step 2: train a reward model on preference pairs.

Read top to bottom: flags, set-up (distributed, data, model, DeepSpeed engine), evaluation before
training, the training loop with evaluation every ``--eval_interval`` steps and at each epoch end,
then the HF-format save.

Model: :class:`chatrl.models.reward_model.RewardModel`, a causal-LM backbone with a bias-free
scalar head; a sequence's score is the head's value at its last real token (from the mask).
Loss: ``mean(-log σ(r_chosen - r_rejected [- margin]))`` over the pairs of an optimizer step, all
ranks (InstructGPT eq. 1; the margin of Llama 2 eq. 2 when the data carries one): each micro-batch's
pair losses are summed and divided by the step's pair count over every micro-batch and rank (times
accumulation × ranks, which DeepSpeed divides by), so every pair weighs the same whatever the split:
how the pairs are cut into micro-batches (``--max_tokens_per_micro_batch``) or laid out
(``--packing``: rows without padding, docs/packing.md).

Metrics (``OUTPUT_DIR/logs/metrics.jsonl``, TensorBoard with ``--enable_tensorboard``):

============================  ===============================================================
``train/loss``                mean pairwise loss of the optimizer step's pairs, all ranks
``train/accuracy``            share of the step's pairs with ``r_chosen > r_rejected``
``train/lr``                  learning rate after the step
``train/pairs_per_s``         training pairs per second since the start, all ranks
``eval/accuracy``             share of eval pairs with ``r_chosen > r_rejected`` (ties are wrong)
``eval/chosen_score``         mean end score of the chosen answers
``eval/rejected_score``       mean end score of the rejected answers
``eval/margin``               mean ``r_chosen - r_rejected``
``eval/loss``                 mean pairwise loss on the eval split
``eval/pairs``                eval pairs scored (all ranks)
============================  ===============================================================

Run ``python -m chatrl.step2_reward --help`` for the flags.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from chatrl import cli, config, program
from chatrl.config import setting, uses
from chatrl.data import PairCollator, build_phase_data
from chatrl.data.collate import PackedPairCollator
from chatrl.distributed import dist
from chatrl.models.reward_model import pair_stats, pairwise_losses, save_reward_model
from chatrl.models.trainable import load_trainable
from chatrl.run import Evaluation, Run, Saved, SupervisedData, sequence_chunks

log = logging.getLogger("chatrl.step2")


@dataclass
class Step2Config:
    """Step 2."""

    num_padding_at_beginning: int | None = setting(None, "accepted for DeepSpeed-Chat compatibility and ignored: the "
                                                         "end score is found from the attention mask, whatever the "
                                                         "padding", type=int)


@dataclass
class Step2Settings(config.TrainingSettings):
    """Step 2's blocks: the training blocks, step 2's learning rate and its DeepSpeed-Chat flags."""

    optim: config.OptimConfig = uses(config.OptimConfig, defaults={"learning_rate": 5e-5})
    step2: Step2Config = uses(Step2Config)


def build_parser():
    """Step 2's flags (:class:`Step2Settings`)."""
    return config.program_parser(Step2Settings, "chatrl step 2: reward model training on preference pairs",
                                 prog="python -m chatrl.step2_reward")


def split_pairs(end_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2B,)`` scores of a :class:`~chatrl.data.PairCollator` batch → ``(chosen (B,), rejected (B,))``."""
    b = end_scores.shape[0] // 2
    return end_scores[:b], end_scores[b:]


@torch.no_grad()
def evaluate(engine, dataset, collate, batch: config.BatchConfig, info) -> dict:
    """Pairwise accuracy, mean scores, mean margin and loss over the eval split, summed over ranks.

    Returns a dict of ``eval/*`` floats (see the module docstring); ``eval/pairs`` is 0 and the
    rest NaN when the eval split is empty.
    """
    engine.eval()
    keys = ("count", "correct", "chosen", "rejected", "margin", "loss")
    total = torch.zeros(len(keys), dtype=torch.float64)
    batches = dist.eval_batches(dataset, collate, batch.per_device_eval_batch_size, info.rank, info.world_size)
    for n_batch, (b, real) in enumerate(batches):
        if batch.eval_iters and n_batch >= batch.eval_iters:
            break
        _, scores = engine(b["input_ids"].to(info.device), b["attention_mask"].to(info.device))
        chosen, rejected = split_pairs(scores.float().cpu())
        chosen, rejected = chosen[real], rejected[real]
        if chosen.numel():
            s = pair_stats(chosen, rejected)
            s["loss"] = -torch.nn.functional.logsigmoid(chosen - rejected).double().sum()
            total += torch.stack([s[k] for k in keys])
    engine.train()
    count, correct, chosen, rejected, margin, loss = dist.all_reduce_sum(total).tolist()
    n = count if count else float("nan")
    return {"eval/accuracy": correct / n, "eval/chosen_score": chosen / n, "eval/rejected_score": rejected / n,
            "eval/margin": margin / n, "eval/loss": loss / n, "eval/pairs": count}


def describe_eval(m: dict) -> str:
    """One line of ``eval/*`` metrics for the log."""
    return (f"accuracy {m['eval/accuracy']:.4f}, chosen {m['eval/chosen_score']:.4f}, "
            f"rejected {m['eval/rejected_score']:.4f}, margin {m['eval/margin']:.4f} "
            f"({int(m['eval/pairs'])} pairs)")


def one_batch_loss(dataset, collate):
    """The loss of a global batch as one micro-batch on one rank, by its definition (the loss-scale
    probe's reference): every rank's ``sample_index`` collated together, the mean pairwise loss, in
    parts of :data:`chatrl.run.PROBE_CHUNK` pairs (each part's summed loss over the pair count)."""

    def loss(model, parts: list):
        rows = [dataset[i] for part in parts for idx in part for i in idx.tolist()]
        for pairs in sequence_chunks(len(rows)):
            b = collate(rows[pairs.start:pairs.stop])
            chosen, rejected = split_pairs(model(b["input_ids"], b["attention_mask"]).end_scores)
            yield pairwise_losses(chosen, rejected, b.get("margin")).sum() / len(rows)

    return loss


def main(argv: list[str] | None = None) -> dict:
    """Run step 2; returns the final metrics (also written to ``OUTPUT_DIR/logs/metrics.jsonl``)."""
    return run(argv)["metrics"]


def run(argv: list[str] | None = None) -> dict:
    """Run step 2 and return ``{"metrics", "engine"}`` (the engine for the caller to keep until the
    process group is shut down)."""
    args = cli.parse(build_parser(), argv)
    s: Step2Settings = config.read(Step2Settings, args)
    info, tokenizer = program.start_training("step 2 (reward model)", s)
    if s.step2.num_padding_at_beginning is not None and info.is_main:
        log.info("--num_padding_at_beginning is not needed: end scores are read from the attention mask")

    # Over-long prompts are cut from the left to fit max_seq_len; identical pairs are skipped and counted.
    data = build_phase_data(2, s.data, tokenizer, seed=s.optim.seed)
    collate = PairCollator(tokenizer.pad_token_id, padding_side="right")  # eval batches
    # training: each optimizer step's pairs, cut into micro-batches by count or token budget, padded or packed
    train = SupervisedData.of(s, info, data.train,
                              PackedPairCollator(tokenizer.pad_token_id) if s.packing.packing else collate, "pairs")
    batch = train.batch
    model = load_trainable("reward", tokenizer, s.model, s.lora, require_head=False).model
    engine, evidence = train.engine("step 2 (reward model)", s, model, data.report)

    def evaluation(step: int) -> dict:
        return evaluate(engine, data.eval, collate, s.batch, info)

    def figures(stats: torch.Tensor) -> dict:  # the step's, logged when due
        loss_sum, correct, pairs = dist.all_reduce_sum(stats).tolist()
        return {"train/loss": loss_sum / pairs, "train/accuracy": correct / pairs,
                "train/lr": engine.lr_scheduler.get_last_lr()[0], "train/skipped_steps": run.skipped,
                "train/pairs_per_s": run.per_second(batch.global_batch)}

    run = Run(s, info, train.schedule("step 2 reward model"), train.loader,
              Saved({"model": engine}, batch.layout()), evidence, opening=f"step 2: {len(data.train)} pairs, "
                                f"{train.describe(info, s.zero.zero_stage, s.model.dtype_note)}",
              evaluation=Evaluation(evaluation, describe_eval) if data.evaluates else None)
    engine.train()  # from_pretrained returns eval mode; dropout must be on whether or not we evaluated first
    scale_base = info.world_size * batch.gradient_accumulation_steps
    for step in run:
        stats = torch.zeros(3, dtype=torch.float64)  # loss summed over pairs, correct, pairs
        micro = train.micro_batches(step.samples())
        n_global = dist.all_reduce_sum(torch.tensor(float(sum(len(m["sample_index"]) for m in micro)))).item()
        for i, m in enumerate(micro):
            step.account(m)
            if s.packing.max_tokens_per_micro_batch:  # their number varies: the last one ends the step
                engine.set_gradient_accumulation_boundary(i == len(micro) - 1)
            _, scores = engine(m["input_ids"], m["attention_mask"], packed=m.get("packed"))
            chosen, rejected = split_pairs(scores)
            losses = pairwise_losses(chosen, rejected, m.get("margin"))
            # DeepSpeed divides by scale_base
            loss = step.nonfinite(losses.sum() * (scale_base / max(n_global, 1.0)))
            engine.backward(loss)
            engine.step()
            stats += torch.tensor([losses.sum().item(), (chosen > rejected).sum().item(), chosen.numel()],
                                  dtype=torch.float64)
        if step.probing:  # the first optimizer step against the same batch as one micro-batch on one rank
            step.probe([m["sample_index"] for m in micro], one_batch_loss(data.train, collate))
        step.done(figures, stats)

    run.finish(2, vars(args), save=lambda: save_reward_model(engine.module, tokenizer, s.log.output_dir))
    return {"metrics": run.metrics, "engine": engine}


if __name__ == "__main__":
    main()
