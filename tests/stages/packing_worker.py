"""The real step programs with micro-batches by count and padded, then by token budget and packed: the
gradient of the first optimizer step must be the same.

Usage (under torchrun, or alone for one rank): packing_worker.py RESULT_JSON WORK_DIR MODEL_DIR ZERO_STAGE.
Runs step 1, step 2, DPO, then step 3 with GRPO (step 2's model as reward) and with PPO (step 2's
model as reward and critic), each twice for one optimizer step in this process: ``A`` with the
default micro-batches (a fixed count, padded), ``B`` with ``--packing --max_tokens_per_micro_batch``
(a few sequences per micro-batch, a different number per step and rank). Every trained engine's
``step`` is wrapped to take the full gradient (``deepspeed.utils.safe_get_full_grad``: ZeRO-3
gathers it; every rank calls it) at its first accumulation boundary, before DeepSpeed applies it.
Rank 0 writes ``{program: [{"diff": max |g_A - g_B|, "max": max |g_A|, "micro": [A's, B's micro-steps]}]}``
(one entry per trained engine).
"""

import json
import sys
from pathlib import Path

import torch

from chatrl.distributed import dist
from chatrl.distributed.dist import is_main, run_program
from tests.conftest import DATA

HB = str(DATA / "hh-rlhf" / "helpful-base")
CAPTURED: list[dict] = []


def capturing(build):
    """``dist.trained_engine`` whose engines record their first accumulated gradient and micro-steps."""
    from deepspeed.utils import safe_get_full_grad

    def trained_engine(*args, **kwargs):
        engine = build(*args, **kwargs)
        slot = {"grad": None, "micro": 0}
        CAPTURED.append(slot)
        step = engine.step

        def step_and_capture(*a, **k):
            if slot["grad"] is None:
                slot["micro"] += 1
                if engine.is_gradient_accumulation_boundary():
                    parts = []
                    for p in engine.module.parameters():
                        g = safe_get_full_grad(p) if p.requires_grad else None
                        parts.append((g if g is not None else torch.zeros(p.ds_shape if hasattr(p, "ds_shape")
                                                                          else p.shape)).detach().float().flatten().cpu())
                    slot["grad"] = torch.cat(parts)
            return step(*a, **k)

        engine.step = step_and_capture
        return engine

    return trained_engine


def run_twice(name: str, run, flags: list[str], budget: int, work: Path, results: dict) -> None:
    got = []
    for variant, extra in (("A", []), ("B", ["--packing", "--max_tokens_per_micro_batch", str(budget)])):
        start = len(CAPTURED)
        run([*flags, *extra, "--output_dir", str(work / f"{name}_{variant}")])
        got.append(CAPTURED[start:])
    results[name] = [{"diff": (a["grad"] - b["grad"]).abs().max().item(), "max": a["grad"].abs().max().item(),
                      "micro": [a["micro"], b["micro"]]} for a, b in zip(*got, strict=True)]


def main():
    out, work, model, stage = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    from chatrl.step1_sft.main import run as step1
    from chatrl.step2_dpo.main import run as dpo
    from chatrl.step2_reward.main import run as step2
    from chatrl.step3_ppo.main import run as step3

    dist.trained_engine = capturing(dist.trained_engine)
    common = ["--data_output_path", str(work / "cache"), "--max_steps", "1", "--disable_progress_bar",
              "--num_warmup_steps", "0"]
    train = [*common, "--eval_iters", "1", "--per_device_eval_batch_size", "2", "--model_name_or_path", model,
             "--zero_stage", stage, "--max_seq_len", "64",
             "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
    results: dict = {}
    keep = []  # engines stay referenced until the process group is shut down
    run_twice("step1", lambda a: keep.append(step1(a)), [*train, "--data_path", f"{HB}[0:80]",
                                                         "--data_split", "10,0,0"], 96, work, results)
    run_twice("step2", lambda a: keep.append(step2(a)), [*train, "--data_path", f"{HB}[80:160]",
                                                         "--data_split", "0,10,0"], 160, work, results)
    run_twice("dpo", lambda a: keep.append(dpo(a)), [*train, "--data_path", f"{HB}[80:160]",
                                                     "--data_split", "0,10,0"], 160, work, results)
    reward = str(work / "step2_A")
    rl = [*common, "--actor_model_name_or_path", model, "--data_path", str(DATA / "prompts"), "--data_split", "0,0,10",
          "--actor_zero_stage", stage, "--critic_zero_stage", stage, "--max_prompt_seq_len", "32",
          "--max_answer_seq_len", "12", "--per_device_generation_batch_size", "4",
          "--per_device_training_batch_size", "4", "--gradient_accumulation_steps", "2", "--reward_model_name_or_path",
          reward]
    run_twice("grpo", lambda a: keep.append(step3(a)), [*rl, "--rl_algorithm", "grpo", "--num_samples_per_prompt", "2"],
              60, work, results)
    # PPO with token-mean in both (an unset aggregation adapts to it only with a token budget)
    run_twice("ppo", lambda a: keep.append(step3(a)), [*rl, "--critic_model_name_or_path", reward,
                                                       "--num_samples_per_prompt", "2", "--loss_agg_mode", "token-mean"],
              60, work, results)
    if is_main():
        Path(out).write_text(json.dumps(results))
    return keep


if __name__ == "__main__":
    run_program(main)
