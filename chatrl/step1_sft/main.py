"""Step 1: supervised fine-tuning of the actor on prompt → answer pairs.

Read top to bottom: flags, set-up (distributed, the chat-template check on a few data rows, data,
model, DeepSpeed engine), the training loop
with evaluation every ``--eval_interval`` steps and at each epoch end, then the HF-format save.

Loss: next-token cross-entropy over the answer tokens (the prompt is masked unless
``--include_prompt_loss``; every assistant turn of a conversation with ``--train_all_assistant_turns``,
``docs/multi_turn.md``), each token of an optimizer step weighted equally across micro-batches
and ranks (see :mod:`chatrl.step1_sft.loss`), so the step's gradient does not depend on how its
samples are cut into micro-batches (``--max_tokens_per_micro_batch``) or laid out (``--packing``:
rows without padding, docs/packing.md). Eval perplexity is ``exp`` of the token-weighted
mean NLL over the eval split, summed over ranks.

Run ``python -m chatrl.step1_sft --help`` for the flags.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from chatrl import cli, config, program
from chatrl.config import setting, uses
from chatrl.data import SFTCollator, build_phase_data
from chatrl.data.collate import PackedSFTCollator
from chatrl.data.examples import ALL_TURNS_CHOICES
from chatrl.data.template_check import check_startup, startup_conversations
from chatrl.distributed import dist
from chatrl.generation import eos_rate
from chatrl.models.trainable import load_trainable
from chatrl.run import Evaluation, Run, Saved, SupervisedData, sequence_chunks
from chatrl.step1_sft.loss import full_nll, labelled_tokens, only_rows, sft_nll

log = logging.getLogger("chatrl.step1")


@dataclass
class SFTConfig:
    """Step 1."""

    include_prompt_loss: bool = setting(False, "also train on prompt tokens (off: loss over answer tokens only)")
    train_all_assistant_turns: str = setting(
        "auto", "train every assistant turn of a conversation, with user, system and tool turns masked: auto (for "
                "conversation data: ShareGPT, Open-Assistant, message lists), true (every multi-turn row, hh-rlhf "
                "transcripts laid out turn by turn too), false (the last answer only); docs/multi_turn.md",
        choices=ALL_TURNS_CHOICES)


@dataclass
class Step1Settings(config.TrainingSettings):
    """Step 1's blocks: the training blocks, step 1's learning rate, the SFT options and the EOS check."""

    optim: config.OptimConfig = uses(config.OptimConfig, defaults={"learning_rate": 1e-3})
    sft: SFTConfig = uses(SFTConfig)
    eos_check: config.EosCheckConfig = uses(config.EosCheckConfig)
    template_check: config.TemplateCheckConfig = uses(config.TemplateCheckConfig)


def build_parser():
    """Step 1's flags (:class:`Step1Settings`)."""
    return config.program_parser(Step1Settings, "chatrl step 1: supervised fine-tuning (SFT) of the actor",
                                 prog="python -m chatrl.step1_sft")


@torch.no_grad()
def evaluate(engine, dataset, collate, batch: config.BatchConfig, info) -> dict:
    """Token-weighted eval loss and perplexity over the whole eval split, summed over ranks
    (NaN, with ``eval/tokens`` 0, when the eval split is empty)."""
    engine.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for i, (b, real) in enumerate(dist.eval_batches(dataset, collate, batch.per_device_eval_batch_size,
                                                    info.rank, info.world_size)):
        if batch.eval_iters and i >= batch.eval_iters:
            break
        b = {k: v.to(info.device) for k, v in b.items()}
        labels = only_rows(b["labels"], real.to(info.device))
        nll, n = sft_nll(engine, b["input_ids"], b["attention_mask"], labels)
        total += torch.tensor([nll.item(), n.item()], dtype=torch.float64)
    engine.train()
    nll_sum, n_tokens = dist.all_reduce_sum(total).tolist()
    loss = nll_sum / n_tokens if n_tokens else math.nan
    return {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 50.0)), "eval/tokens": n_tokens}


def describe_eval(m: dict) -> str:
    """One line of ``eval/*`` metrics for the log."""
    return f"loss {m['eval/loss']:.4f} ppl {m['eval/ppl']:.2f}"


def eval_prompts(dataset, n: int) -> list:
    """The prompt ids of the first ``n`` rows of a phase-1 dataset (for the EOS check)."""
    return [dataset[i]["input_ids"][: dataset[i]["prompt_len"]] for i in range(min(n, len(dataset)))]


def one_batch_loss(dataset, collate):
    """The loss of a global batch as one micro-batch on one rank, by its definition (the loss-scale
    probe's reference, :class:`chatrl.evidence.certificate.LossScaleProbe`): every rank's ``sample_index``
    collated together, the mean next-token NLL over all labelled tokens, all logits computed. Yields it
    in parts of :data:`chatrl.run.PROBE_CHUNK` sequences, each the part's summed NLL over the
    whole batch's labelled-token count (their sum is that mean)."""

    def loss(model, parts: list):
        b = collate([dataset[i] for part in parts for idx in part for i in idx.tolist()])
        n = max(labelled_tokens(b["labels"]), 1)
        for rows in sequence_chunks(len(b["input_ids"])):
            k = slice(rows.start, rows.stop)
            yield full_nll(model, b["input_ids"][k], b["attention_mask"][k], b["labels"][k])[0] / n

    return loss


def main(argv: list[str] | None = None) -> dict:
    """Run step 1; returns the final metrics (also written to ``OUTPUT_DIR/logs/metrics.jsonl``)."""
    return run(argv)["metrics"]


def run(argv: list[str] | None = None) -> dict:
    """Run step 1 and return ``{"metrics", "engine", "tokenizer", "settings", "certificate"}`` (the
    engine for in-process checks)."""
    args = cli.parse(build_parser(), argv)
    s: Step1Settings = config.read(Step1Settings, args)
    info, tokenizer = program.start_training("step 1 (SFT)", s)
    all_turns = s.sft.train_all_assistant_turns
    check_startup(tokenizer, startup_conversations(s.data.data_path, turn_by_turn=all_turns == "true"), "step 1",
                  s.template_check.skip_template_check, log)
    data = build_phase_data(1, s.data, tokenizer, seed=s.optim.seed, all_turns=all_turns)
    collate = SFTCollator(tokenizer.pad_token_id, mask_prompt=not s.sft.include_prompt_loss)  # eval batches
    # training: each optimizer step's samples, cut into micro-batches by count or token budget, padded or packed
    train = SupervisedData.of(s, info, data.train, PackedSFTCollator(tokenizer.pad_token_id, mask_prompt=not
                              s.sft.include_prompt_loss) if s.packing.packing else collate, "samples")
    batch = train.batch
    model = load_trainable("causal_lm", tokenizer, s.model, s.lora).model
    engine, evidence = train.engine("step 1 (SFT)", s, model, data.report)

    def evaluation(step: int) -> dict:
        return evaluate(engine, data.eval, collate, s.batch, info)

    run = Run(s, info, train.schedule("step 1 SFT"), train.loader,
              Saved({"model": engine}, batch.layout(), hf_model=(engine.module, tokenizer)), evidence,
              opening=f"step 1: {len(data.train)} samples, "
                      f"{train.describe(info, s.zero.zero_stage, s.model.dtype_note)}",
              evaluation=Evaluation(evaluation, describe_eval) if data.evaluates else None)
    def figures(step_nll: float, n_global: float) -> dict:  # the step's, logged when due
        return {"train/loss": dist.all_reduce_sum(torch.tensor(step_nll)).item() / max(n_global, 1.0),
                "train/lr": engine.lr_scheduler.get_last_lr()[0], "train/skipped_steps": run.skipped,
                "train/tokens": n_global, "train/samples_per_s": run.per_second(batch.global_batch)}

    engine.train()  # from_pretrained returns eval mode; dropout must be on whether or not we evaluated first
    scale_base = info.world_size * batch.gradient_accumulation_steps
    for step in run:
        micro = train.micro_batches(step.samples())
        for m in micro:
            step.account(m)
        n_local = sum(labelled_tokens(m["labels"]) for m in micro)
        n_global = dist.all_reduce_sum(torch.tensor(float(n_local))).item()
        step_nll = 0.0
        for i, m in enumerate(micro):
            if s.packing.max_tokens_per_micro_batch:  # their number varies: the last one ends the step
                engine.set_gradient_accumulation_boundary(i == len(micro) - 1)
            nll, _ = sft_nll(engine, m["input_ids"], m["attention_mask"], m["labels"], packed=m.get("packed"))
            nll = step.nonfinite(nll)
            engine.backward(nll * (scale_base / max(n_global, 1.0)))
            engine.step()
            step_nll += nll.item()
        if step.probing:  # the first optimizer step against the same batch as one micro-batch on one rank
            step.probe([m["sample_index"].cpu() for m in micro], one_batch_loss(data.train, collate))
        step.done(figures, step_nll, n_global)

    def eos_check():  # the EOS check reads the eval split's prompts
        if s.eos_check.eval_eos_samples and data.evaluates:
            rate = eos_rate(engine, eval_prompts(data.eval, s.eos_check.eval_eos_samples), tokenizer,
                            s.eos_check.eval_max_new_tokens, s.zero.zero_stage, info)
            run.metrics["eval/eos_rate"] = rate
            run.tracker.log({"eval/eos_rate": rate}, run.step)
            run.tracker.write(f"greedy answers ending in EOS within {s.eos_check.eval_max_new_tokens} tokens: "
                              f"{rate:.1%}")

    run.finish(1, vars(args), before_save=eos_check)
    return {"metrics": run.metrics, "engine": engine, "tokenizer": tokenizer, "settings": s,
            "certificate": evidence.cert}


if __name__ == "__main__":
    main()
