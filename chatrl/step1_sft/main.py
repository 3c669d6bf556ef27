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
import time
from dataclasses import dataclass

import torch

from chatrl import cli, config, dist, program
from chatrl.certificate import SupervisedEvidence, sequence_chunks
from chatrl.checkpoint import LoopCheckpoints, batches_from, resume_path, write_run_marker
from chatrl.config import setting, uses
from chatrl.data import SFTCollator, phase_data
from chatrl.data.collate import MicroBatches, PackedSFTCollator
from chatrl.data.examples import ALL_TURNS_CHOICES
from chatrl.data.template_check import check_startup, startup_conversations
from chatrl.generation import eos_rate
from chatrl.logprobs import IGNORE_INDEX
from chatrl.models import causal_lm_logits, check_context_window, check_packing, load_tokenizer
from chatrl.resilience import set_progress
from chatrl.sizes import BatchSizes, plan_steps
from chatrl.step1_sft.loss import sft_nll, token_nll
from chatrl.tracking import Tracker
from chatrl.trainable import load_trainable
from chatrl.weights import save_hf_model

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
        labels = b["labels"].masked_fill(~real.to(info.device)[:, None], IGNORE_INDEX)
        nll, n = sft_nll(engine, b["input_ids"], b["attention_mask"], labels)
        total += torch.tensor([nll.item(), n.item()], dtype=torch.float64)
    engine.train()
    nll_sum, n_tokens = dist.all_reduce_sum(total).tolist()
    loss = nll_sum / n_tokens if n_tokens else math.nan
    return {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 50.0)), "eval/tokens": n_tokens}


def eval_prompts(dataset, n: int) -> list:
    """The prompt ids of the first ``n`` rows of a phase-1 dataset (for the EOS check)."""
    return [dataset[i]["input_ids"][: dataset[i]["prompt_len"]] for i in range(min(n, len(dataset)))]


def one_batch_loss(dataset, collate):
    """The loss of a global batch as one micro-batch on one rank, by its definition (the loss-scale
    probe's reference, :class:`chatrl.certificate.LossScaleProbe`): every rank's ``sample_index``
    collated together, the mean next-token NLL over all labelled tokens, all logits computed. Yields it
    in parts of :data:`chatrl.certificate.PROBE_CHUNK` sequences, each the part's summed NLL over the
    whole batch's labelled-token count (their sum is that mean)."""

    def loss(model, parts: list):
        b = collate([dataset[i] for part in parts for idx in part for i in idx.tolist()])
        n = (b["labels"][:, 1:] != IGNORE_INDEX).sum().clamp(min=1)
        for rows in sequence_chunks(len(b["input_ids"])):
            ids, mask = b["input_ids"][rows.start:rows.stop], b["attention_mask"][rows.start:rows.stop]
            yield token_nll(causal_lm_logits(model, ids, mask), b["labels"][rows.start:rows.stop])[0] / n

    return loss


def main(argv: list[str] | None = None) -> dict:
    """Run step 1; returns the final metrics (also written to ``OUTPUT_DIR/logs/metrics.jsonl``)."""
    return run(argv)["metrics"]


def run(argv: list[str] | None = None) -> dict:
    """Run step 1 and return ``{"metrics", "engine", "tokenizer", "settings"}`` (the engine for in-process checks)."""
    args = cli.parse(build_parser(), argv)
    s: Step1Settings = config.read(Step1Settings, args)
    check_context_window(s.model.model_name_or_path, {"--max_seq_len": s.data.max_seq_len}, s.model.trust_remote_code)
    check_packing(s.packing, s.model.model_name_or_path, s.model.trust_remote_code)
    info = program.start("step 1 (SFT)", s.log, s.optim.seed, s.ckpt)

    tokenizer = load_tokenizer(s.model.model_name_or_path, trust_remote_code=s.model.trust_remote_code)
    all_turns = s.sft.train_all_assistant_turns
    check_startup(tokenizer, startup_conversations(s.data.data_path, turn_by_turn=all_turns == "true"), "step 1",
                  s.template_check.skip_template_check, log)
    data = phase_data(1, s.data, tokenizer, s.optim.seed, all_turns=all_turns)
    collate = SFTCollator(tokenizer.pad_token_id, mask_prompt=not s.sft.include_prompt_loss)  # eval batches
    # training: each optimizer step's samples, cut into micro-batches by count or token budget, padded or packed
    loader = dist.seeded_loader(data.train, s.batch.per_device_train_batch_size, list, info, s.optim.seed)
    micro_batches = MicroBatches(PackedSFTCollator(tokenizer.pad_token_id, mask_prompt=not s.sft.include_prompt_loss)
                                 if s.packing.packing else collate, s.batch.per_device_train_batch_size,
                                 s.packing.max_tokens_per_micro_batch, info.device, dist.all_reduce_max)

    batch = BatchSizes(s.batch.per_device_train_batch_size, s.optim.gradient_accumulation_steps, info.world_size)
    plan = plan_steps(len(loader), len(data.train), batch, s.optim.num_train_epochs, s.optim.max_steps,
                      s.optim.num_warmup_steps, what="samples")
    steps_per_epoch, total_steps = plan.steps_per_epoch, plan.total_steps
    model = load_trainable("causal_lm", tokenizer, s.model, s.lora).model
    evidence = SupervisedEvidence.start("step 1 (SFT)", model, s.model.dtype,
                                        not s.certificate.disable_loss_scale_probe,
                                        resume_path(s.ckpt, s.log.output_dir) is not None, s.log.output_dir,
                                        loader, steps_per_epoch, batch.gradient_accumulation_steps, data.report)
    engine = dist.trained_engine(model, s.optim, s.lora, s.zero, s.model.dtype, batch, total_steps,
                                 plan.num_warmup_steps)

    tracker = Tracker.for_run(s.log, info.is_main)
    tracker.write(f"step 1: {len(data.train)} samples, {total_steps} optimizer steps of global batch "
                  f"{batch.global_batch} ({info.world_size} ranks × {batch.per_device_batch} × "
                  f"{batch.gradient_accumulation_steps} accumulation), ZeRO-{s.zero.zero_stage}, {s.model.dtype_note}")
    for note in plan.notes:  # defaults that adapted to a short run, said once
        tracker.write(note)
    ckpt = LoopCheckpoints(s.ckpt, s.log.output_dir, {"model": engine}, batch.layout(),
                           extra_state={"data_accounting": evidence.accounting})
    step, resumed, metrics = 0, ckpt.resume(), {}
    if resumed:
        step = resumed["step"]
        evidence.cert.restore(resumed.get("certificate"))
        tracker.resumed_at(step)
        tracker.write(f"resumed from {resumed['path']} at optimizer step {step}")
    elif data.evaluates:  # else the data layer said once that training proceeds without evaluation
        metrics = evaluate(engine, data.eval, collate, s.batch, info)
        tracker.log(metrics, step=0)
        tracker.write(f"eval before training: loss {metrics['eval/loss']:.4f} ppl {metrics['eval/ppl']:.2f}")
    tracker.bar(total_steps, "step 1 SFT", initial=step)

    engine.train()  # from_pretrained returns eval mode; dropout must be on whether or not we evaluated first
    t0, first_step = time.time(), step
    scale_base = info.world_size * batch.gradient_accumulation_steps
    while step < total_steps:
        it = batches_from(loader, step, steps_per_epoch, batch.gradient_accumulation_steps)
        for _ in range(steps_per_epoch - step % steps_per_epoch):
            micro = micro_batches([x for _ in range(batch.gradient_accumulation_steps) for x in next(it)])
            for m in micro:
                evidence.accounting.record(step // steps_per_epoch, m)
            n_local = sum(int((m["labels"][:, 1:] != IGNORE_INDEX).sum()) for m in micro)
            n_global = dist.all_reduce_sum(torch.tensor(float(n_local))).item()
            step_nll = 0.0
            for i, m in enumerate(micro):
                if s.packing.max_tokens_per_micro_batch:  # their number varies: the last one ends the step
                    engine.set_gradient_accumulation_boundary(i == len(micro) - 1)
                nll, _ = sft_nll(engine, m["input_ids"], m["attention_mask"], m["labels"], packed=m.get("packed"))
                if step + 1 in s.ckpt.debug_nonfinite_steps:
                    nll = nll * float("nan")
                engine.backward(nll * (scale_base / max(n_global, 1.0)))
                engine.step()
                step_nll += nll.item()
            step += 1
            set_progress(optimizer_step=step)
            tracker.advance()
            if evidence.probe.active:  # the first optimizer step against the same batch as one micro-batch on one rank
                evidence.check_loss_scale(engine.get_global_grad_norm(), [m["sample_index"].cpu() for m in micro],
                                          one_batch_loss(data.train, collate))
            state = {"epoch": step // steps_per_epoch, "certificate": evidence.cert.state()}
            ckpt.after_step(step, state)
            if step % s.log.log_interval == 0 or step == total_steps:
                loss = dist.all_reduce_sum(torch.tensor(step_nll)).item() / max(n_global, 1.0)
                tracker.log({"train/loss": loss, "train/lr": engine.lr_scheduler.get_last_lr()[0],
                             "train/skipped_steps": ckpt.skipped,
                             "train/tokens": n_global, "train/samples_per_s":
                             (step - first_step) * batch.global_batch / (time.time() - t0)}, step)
            epoch_end = step % steps_per_epoch == 0
            due = (s.log.eval_interval and step % s.log.eval_interval == 0) or epoch_end or step == total_steps
            if due and data.evaluates:
                metrics = evaluate(engine, data.eval, collate, s.batch, info)
                tracker.log(metrics, step)
                tracker.write(f"step {step}: eval loss {metrics['eval/loss']:.4f} ppl {metrics['eval/ppl']:.2f}")
            ckpt.save_if_due(step, total_steps, state)
            if step >= total_steps or ckpt.stop_here(step):
                break
        if ckpt.stop_here(step):
            ckpt.note_stop(step, tracker)
            return {"metrics": metrics, "engine": engine, "tokenizer": tokenizer, "settings": s}
    evidence.finish(step)

    if s.eos_check.eval_eos_samples and data.evaluates:  # the EOS check reads the eval split's prompts
        rate = eos_rate(engine, eval_prompts(data.eval, s.eos_check.eval_eos_samples), tokenizer,
                        s.eos_check.eval_max_new_tokens, s.zero.zero_stage, info)
        metrics["eval/eos_rate"] = rate
        tracker.log({"eval/eos_rate": rate}, step)
        tracker.write(f"greedy answers ending in EOS within {s.eos_check.eval_max_new_tokens} tokens: {rate:.1%}")
    if plan.cap_note:
        tracker.write(plan.cap_note)
    tracker.close()
    save_hf_model(engine.module, tokenizer, s.log.output_dir)
    if info.is_main:
        write_run_marker(s.log.output_dir, {"step": 1, "steps": step, "metrics": metrics, "args": vars(args)})
    return {"metrics": metrics, "engine": engine, "tokenizer": tokenizer, "settings": s, "certificate": evidence.cert}


if __name__ == "__main__":
    main()
