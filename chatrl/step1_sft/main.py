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

from chatrl import cli, config
from chatrl.config import setting
from chatrl.tracking import Tracker, setup_logging

log = logging.getLogger("chatrl.step1")


@dataclass
class SFTConfig:
    """Step 1."""

    include_prompt_loss: bool = setting(False, "also train on prompt tokens (off: loss over answer tokens only)")
    eval_eos_samples: int = setting(0, "at the end, greedily answer this many eval prompts and report the share "
                                       "ending in EOS", unit="prompts")
    eval_max_new_tokens: int = setting(64, "answer budget of that EOS check", unit="tokens")


def build_parser():
    p = cli.new_parser("chatrl step 1: supervised fine-tuning (SFT) of the actor", prog="python -m chatrl.step1_sft")
    cli.add_model_args(p)
    cli.add_lora_args(p)
    cli.add_data_args(p, max_seq_len=512)
    cli.add_optim_args(p, lr=1e-3)
    cli.add_dist_args(p)
    cli.add_log_args(p)
    cli.add_checkpoint_args(p)
    config.add_block(p, SFTConfig)
    return p


@torch.no_grad()
def evaluate(engine, dataset, collate, args, info) -> dict:
    """Token-weighted eval loss and perplexity over the whole eval split, summed over ranks
    (NaN, with ``eval/tokens`` 0, when the eval split is empty)."""
    from chatrl.dist import all_reduce_sum, eval_batches
    from chatrl.step1_sft.loss import IGNORE_INDEX, sft_nll

    engine.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for i, (batch, real) in enumerate(eval_batches(dataset, collate, args.per_device_eval_batch_size,
                                                   info.rank, info.world_size)):
        if args.eval_iters and i >= args.eval_iters:
            break
        batch = {k: v.to(info.device) for k, v in batch.items()}
        labels = batch["labels"].masked_fill(~real.to(info.device)[:, None], IGNORE_INDEX)
        nll, n = sft_nll(engine, batch["input_ids"], batch["attention_mask"], labels)
        total += torch.tensor([nll.item(), n.item()], dtype=torch.float64)
    engine.train()
    nll_sum, n_tokens = all_reduce_sum(total).tolist()
    loss = nll_sum / n_tokens if n_tokens else math.nan
    return {"eval/loss": loss, "eval/ppl": math.exp(min(loss, 50.0)), "eval/tokens": n_tokens}


@torch.no_grad()
def eos_rate(engine, dataset, tokenizer, n_samples: int, max_new_tokens: int, zero_stage: int, info) -> float:
    """Share of greedy answers to the first ``n_samples`` eval prompts that end their turn (EOS or
    the chat template's end-of-turn token, :func:`chatrl.models.stop_token_ids`).

    Prompts are left-padded; generation is synced across ranks under ZeRO-3.
    """
    from chatrl.dist import all_reduce_sum
    from chatrl.models import base_model, stop_token_ids

    engine.eval()
    rows = [dataset[i] for i in range(min(n_samples, len(dataset)))]
    if not rows:
        return math.nan
    mine = rows[info.rank::info.world_size]
    per_rank = math.ceil(len(rows) / info.world_size)
    prompts = [r["input_ids"][: r["prompt_len"]] for r in mine] + [rows[0]["input_ids"][:1]] * (per_rank - len(mine))
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    out = base_model(engine.module).generate(
        input_ids=ids.to(info.device), attention_mask=mask.to(info.device), max_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id,
        synced_gpus=zero_stage == 3 and info.world_size > 1)
    answers = out[:, width:]
    ended = torch.isin(answers, torch.tensor(stop_token_ids(tokenizer), device=answers.device)).any(dim=1)[: len(mine)]
    engine.train()
    counts = all_reduce_sum(torch.tensor([ended.sum().item(), len(mine)], dtype=torch.float64))
    return counts[0].item() / max(counts[1].item(), 1)


def main(argv: list[str] | None = None) -> dict:
    """Run step 1; returns the final metrics (also written to ``OUTPUT_DIR/logs/metrics.jsonl``)."""
    return run(argv)["metrics"]


def run(argv: list[str] | None = None) -> dict:
    """Run step 1 and return ``{"metrics", "engine", "tokenizer", "args"}`` (the engine for in-process checks)."""
    args = cli.parse(build_parser(), argv)
    from transformers import get_scheduler, set_seed

    from chatrl import dist
    from chatrl.checkpoint import LoopCheckpoints, batches_from, check_output_dir, write_run_marker
    from chatrl.data import SFTCollator, build_phase_data
    from chatrl.models import (
        LoraSettings,
        apply_lora,
        check_context_window,
        enable_gradient_checkpointing,
        load_causal_lm,
        load_tokenizer,
        optimizer_param_groups,
    )
    from chatrl.resilience import set_progress
    from chatrl.sizes import BatchSizes, plan_steps
    from chatrl.step1_sft.loss import sft_nll
    from chatrl.weights import save_hf_model

    check_context_window(args.model_name_or_path, {"--max_seq_len": args.max_seq_len}, args.trust_remote_code)
    set_progress("step 1 (SFT)")
    info = dist.init_distributed()
    setup_logging(info.rank)
    check_output_dir(args.output_dir, args.overwrite_output_dir)
    set_seed(args.seed)

    tokenizer = load_tokenizer(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    data = build_phase_data(1, args.data_path, tokenizer, data_split=args.data_split, max_seq_len=args.max_seq_len,
                            eval_fraction=args.eval_fraction, eval_data_paths=args.eval_data_path,
                            seed=args.seed, cache_dir=args.data_output_path)
    collate = SFTCollator(tokenizer.pad_token_id, mask_prompt=not args.include_prompt_loss)
    loader = dist.seeded_loader(data.train, args.per_device_train_batch_size, collate, info, args.seed)

    model = load_causal_lm(args.model_name_or_path, tokenizer, dtype=args.dtype, dropout=args.dropout,
                           trust_remote_code=args.trust_remote_code)
    lora = LoraSettings(args.lora_dim, args.lora_module_name, args.only_optimize_lora, args.lora_learning_rate)
    model = apply_lora(model, lora)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)

    batch = BatchSizes(args.per_device_train_batch_size, args.gradient_accumulation_steps, info.world_size)
    plan = plan_steps(len(loader), len(data.train), batch, args.num_train_epochs, args.max_steps,
                      args.num_warmup_steps, what="samples")
    steps_per_epoch, total_steps = plan.steps_per_epoch, plan.total_steps
    optimizer = dist.make_optimizer(
        optimizer_param_groups(model, args.weight_decay, args.lora_learning_rate if lora.enabled else None),
        lr=args.learning_rate, offload=args.offload)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.num_warmup_steps,
                              num_training_steps=total_steps)
    ds_config = dist.deepspeed_config(batch, args.zero_stage, args.offload, args.dtype, args.gradient_clipping)
    engine = dist.initialize(model, ds_config, optimizer, scheduler)

    tracker = Tracker(args.output_dir, info.is_main, args.enable_tensorboard, args.tensorboard_path,
                      progress=not args.disable_progress_bar)
    tracker.write(f"step 1: {len(data.train)} samples, {total_steps} optimizer steps of global batch "
                  f"{batch.global_batch} ({info.world_size} ranks × {batch.per_device_batch} × "
                  f"{batch.gradient_accumulation_steps} accumulation), ZeRO-{args.zero_stage}, {args.dtype}")
    ckpt = LoopCheckpoints(args, {"model": engine})
    step, resumed, metrics = 0, ckpt.resume(), {}
    if resumed:
        step = resumed["step"]
        tracker.resumed_at(step)
        tracker.write(f"resumed from {resumed['path']} at optimizer step {step}")
    else:
        metrics = evaluate(engine, data.eval, collate, args, info)
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
            n_local = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro)
            n_global = dist.all_reduce_sum(torch.tensor(float(n_local))).item()
            step_nll = 0.0
            for m in micro:
                nll, _ = sft_nll(engine, m["input_ids"], m["attention_mask"], m["labels"])
                if step + 1 in args.debug_nonfinite_steps:
                    nll = nll * float("nan")
                engine.backward(nll * (scale_base / max(n_global, 1.0)))
                engine.step()
                step_nll += nll.item()
            step += 1
            set_progress(optimizer_step=step)
            tracker.advance()
            ckpt.after_step(step, {"epoch": step // steps_per_epoch})
            if step % args.log_interval == 0 or step == total_steps:
                loss = dist.all_reduce_sum(torch.tensor(step_nll)).item() / max(n_global, 1.0)
                tracker.log({"train/loss": loss, "train/lr": scheduler.get_last_lr()[0],
                             "train/skipped_steps": ckpt.skipped,
                             "train/tokens": n_global, "train/samples_per_s":
                             (step - first_step) * batch.global_batch / (time.time() - t0)}, step)
            epoch_end = step % steps_per_epoch == 0
            if (args.eval_interval and step % args.eval_interval == 0) or epoch_end or step == total_steps:
                metrics = evaluate(engine, data.eval, collate, args, info)
                tracker.log(metrics, step)
                tracker.write(f"step {step}: eval loss {metrics['eval/loss']:.4f} ppl {metrics['eval/ppl']:.2f}")
            ckpt.save_if_due(step, total_steps, {"epoch": step // steps_per_epoch})
            if step >= total_steps or ckpt.stop_here(step):
                break
        if ckpt.stop_here(step):
            ckpt.note_stop(step, tracker)
            return {"metrics": metrics, "engine": engine, "tokenizer": tokenizer, "args": args}

    if args.eval_eos_samples:
        rate = eos_rate(engine, data.eval, tokenizer, args.eval_eos_samples, args.eval_max_new_tokens,
                        args.zero_stage, info)
        metrics["eval/eos_rate"] = rate
        tracker.log({"eval/eos_rate": rate}, step)
        tracker.write(f"greedy answers ending in EOS within {args.eval_max_new_tokens} tokens: {rate:.1%}")
    tracker.close()
    save_hf_model(engine.module, tokenizer, args.output_dir)
    if info.is_main:
        write_run_marker(args.output_dir, {"step": 1, "steps": step, "metrics": metrics, "args": vars(args)})
    return {"metrics": metrics, "engine": engine, "tokenizer": tokenizer, "args": args}


if __name__ == "__main__":
    main()
