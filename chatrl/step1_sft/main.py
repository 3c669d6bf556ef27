"""Step 1: supervised fine-tuning of the actor on prompt → answer pairs.

Read top to bottom: flags, set-up (distributed, data, model, DeepSpeed engine), the training loop
with evaluation every ``--eval_interval`` steps and at each epoch end, then the HF-format save.

Loss: next-token cross-entropy over the answer tokens (the prompt is masked unless
``--include_prompt_loss``), each token of an optimizer step weighted equally across micro-batches
and ranks (see :mod:`chatrl.step1_sft.loss`). Eval perplexity is ``exp`` of the token-weighted
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
from chatrl.checkpoint import LoopCheckpoints, batches_from, write_run_marker
from chatrl.config import setting, uses
from chatrl.data import SFTCollator, phase_data
from chatrl.generation import eos_rate
from chatrl.logprobs import IGNORE_INDEX
from chatrl.models import check_context_window, load_tokenizer
from chatrl.resilience import set_progress
from chatrl.sizes import BatchSizes, plan_steps
from chatrl.step1_sft.loss import sft_nll
from chatrl.tracking import Tracker
from chatrl.trainable import load_trainable
from chatrl.weights import save_hf_model

log = logging.getLogger("chatrl.step1")


@dataclass
class SFTConfig:
    """Step 1."""

    include_prompt_loss: bool = setting(False, "also train on prompt tokens (off: loss over answer tokens only)")


@dataclass
class Step1Settings(config.TrainingSettings):
    """Step 1's blocks: the training blocks, step 1's learning rate, the SFT options and the EOS check."""

    optim: config.OptimConfig = uses(config.OptimConfig, defaults={"learning_rate": 1e-3})
    sft: SFTConfig = uses(SFTConfig)
    eos_check: config.EosCheckConfig = uses(config.EosCheckConfig)


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


def main(argv: list[str] | None = None) -> dict:
    """Run step 1; returns the final metrics (also written to ``OUTPUT_DIR/logs/metrics.jsonl``)."""
    return run(argv)["metrics"]


def run(argv: list[str] | None = None) -> dict:
    """Run step 1 and return ``{"metrics", "engine", "tokenizer", "settings"}`` (the engine for in-process checks)."""
    args = cli.parse(build_parser(), argv)
    s: Step1Settings = config.read(Step1Settings, args)
    check_context_window(s.model.model_name_or_path, {"--max_seq_len": s.data.max_seq_len}, s.model.trust_remote_code)
    info = program.start("step 1 (SFT)", s.log, s.optim.seed)

    tokenizer = load_tokenizer(s.model.model_name_or_path, trust_remote_code=s.model.trust_remote_code)
    data = phase_data(1, s.data, tokenizer, s.optim.seed)
    collate = SFTCollator(tokenizer.pad_token_id, mask_prompt=not s.sft.include_prompt_loss)
    loader = dist.seeded_loader(data.train, s.batch.per_device_train_batch_size, collate, info, s.optim.seed)

    batch = BatchSizes(s.batch.per_device_train_batch_size, s.optim.gradient_accumulation_steps, info.world_size)
    plan = plan_steps(len(loader), len(data.train), batch, s.optim.num_train_epochs, s.optim.max_steps,
                      s.optim.num_warmup_steps, what="samples")
    steps_per_epoch, total_steps = plan.steps_per_epoch, plan.total_steps
    model = load_trainable("causal_lm", tokenizer, s.model, s.lora).model
    engine = dist.trained_engine(model, s.optim, s.lora, s.zero, s.model.dtype, batch, total_steps,
                                 plan.num_warmup_steps)

    tracker = Tracker.for_run(s.log, info.is_main)
    tracker.write(f"step 1: {len(data.train)} samples, {total_steps} optimizer steps of global batch "
                  f"{batch.global_batch} ({info.world_size} ranks × {batch.per_device_batch} × "
                  f"{batch.gradient_accumulation_steps} accumulation), ZeRO-{s.zero.zero_stage}, {s.model.dtype_note}")
    ckpt = LoopCheckpoints(s.ckpt, s.log.output_dir, {"model": engine}, batch.layout())
    step, resumed, metrics = 0, ckpt.resume(), {}
    if resumed:
        step = resumed["step"]
        tracker.resumed_at(step)
        tracker.write(f"resumed from {resumed['path']} at optimizer step {step}")
    else:
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
            micro = [{k: v.to(info.device) for k, v in next(it).items()}
                     for _ in range(batch.gradient_accumulation_steps)]
            n_local = sum(int((m["labels"][:, 1:] != IGNORE_INDEX).sum()) for m in micro)
            n_global = dist.all_reduce_sum(torch.tensor(float(n_local))).item()
            step_nll = 0.0
            for m in micro:
                nll, _ = sft_nll(engine, m["input_ids"], m["attention_mask"], m["labels"])
                if step + 1 in s.ckpt.debug_nonfinite_steps:
                    nll = nll * float("nan")
                engine.backward(nll * (scale_base / max(n_global, 1.0)))
                engine.step()
                step_nll += nll.item()
            step += 1
            set_progress(optimizer_step=step)
            tracker.advance()
            ckpt.after_step(step, {"epoch": step // steps_per_epoch})
            if step % s.log.log_interval == 0 or step == total_steps:
                loss = dist.all_reduce_sum(torch.tensor(step_nll)).item() / max(n_global, 1.0)
                tracker.log({"train/loss": loss, "train/lr": engine.lr_scheduler.get_last_lr()[0],
                             "train/skipped_steps": ckpt.skipped,
                             "train/tokens": n_global, "train/samples_per_s":
                             (step - first_step) * batch.global_batch / (time.time() - t0)}, step)
            epoch_end = step % steps_per_epoch == 0
            if (s.log.eval_interval and step % s.log.eval_interval == 0) or epoch_end or step == total_steps:
                metrics = evaluate(engine, data.eval, collate, s.batch, info)
                tracker.log(metrics, step)
                tracker.write(f"step {step}: eval loss {metrics['eval/loss']:.4f} ppl {metrics['eval/ppl']:.2f}")
            ckpt.save_if_due(step, total_steps, {"epoch": step // steps_per_epoch})
            if step >= total_steps or ckpt.stop_here(step):
                break
        if ckpt.stop_here(step):
            ckpt.note_stop(step, tracker)
            return {"metrics": metrics, "engine": engine, "tokenizer": tokenizer, "settings": s}

    if s.eos_check.eval_eos_samples:
        rate = eos_rate(engine, eval_prompts(data.eval, s.eos_check.eval_eos_samples), tokenizer,
                        s.eos_check.eval_max_new_tokens, s.zero.zero_stage, info)
        metrics["eval/eos_rate"] = rate
        tracker.log({"eval/eos_rate": rate}, step)
        tracker.write(f"greedy answers ending in EOS within {s.eos_check.eval_max_new_tokens} tokens: {rate:.1%}")
    tracker.close()
    save_hf_model(engine.module, tokenizer, s.log.output_dir)
    if info.is_main:
        write_run_marker(s.log.output_dir, {"step": 1, "steps": step, "metrics": metrics, "args": vars(args)})
    return {"metrics": metrics, "engine": engine, "tokenizer": tokenizer, "settings": s}


if __name__ == "__main__":
    main()
