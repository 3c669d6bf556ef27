"""Step 1 end to end over 2 CPU ranks: loss and perplexity fall, the saved folder is the trained
model, LoRA-only training moves only LoRA, and ZeRO stages 0/2/3 follow the same loss curve."""

import json

import pytest

from tests.conftest import DATA, STORIES
from tests.launch import run_ranks

HH = str(DATA / "hh-rlhf" / "helpful-base")


def _metrics(out_dir):
    rows = [json.loads(line) for line in (out_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r["train/loss"] for r in rows if "train/loss" in r]
    evals = [r["eval/ppl"] for r in rows if "eval/ppl" in r]
    return train, evals


def _step1(tmp_path, name, model, *extra, steps=12):
    out = tmp_path / name
    result = tmp_path / f"{name}.json"
    run_ranks(["tests/stages/step1_worker.py", str(result), "--",
               "--model_name_or_path", str(model), "--data_path", HH, "--data_split", "10,0,0",
               "--max_seq_len", "128", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "16",
               "--eval_iters", "2", "--max_steps", str(steps), "--eval_interval", str(steps),
               "--data_output_path", str(tmp_path / "cache"), "--output_dir", str(out),
               "--disable_progress_bar", *extra], timeout=400)
    return out, json.loads(result.read_text())


@pytest.mark.slow
def test_step1_zero3_opt_learns_and_saves_exactly(tmp_path, tiny_opt):
    out, res = _step1(tmp_path, "opt", tiny_opt, "--zero_stage", "3", "--learning_rate", "3e-3")
    train, evals = _metrics(out)
    assert len(train) == 12 and len(evals) == 2
    assert sum(train[-3:]) / 3 < sum(train[:3]) / 3 - 0.5, train
    assert evals[-1] < evals[0] * 0.5, evals
    assert res["max_logit_diff"] < 1e-4
    assert (out / "model.safetensors").exists() and (out / "chatrl_run.json").exists()


@pytest.mark.slow
def test_step1_stories260k_lora_only_moves_lora_and_saves_merged(tmp_path):
    out, res = _step1(tmp_path, "lora", STORIES, "--zero_stage", "3", "--lora_dim", "8",
                      "--only_optimize_lora", "--lora_learning_rate", "1e-2", "--learning_rate", "1e-2",
                      "--enable_tensorboard")
    train, evals = _metrics(out)
    assert res["moved_base"] == 0.0
    assert res["moved_lora"] > 1e-3
    assert not res["saved_has_lora_keys"]
    # the export keeps the tie (one shared matrix, no extra 33,280 parameters) at ZeRO-3,
    # and exporting did not untie the live model's config
    assert res["input_tied"] and res["saved_tied"] and res["live_tied"]
    assert res["max_logit_diff"] < 1e-4
    assert evals[-1] < evals[0]
    assert list((out / "logs" / "tb").glob("events.out.tfevents.*"))


# ZeRO 0/2/3 loss curves agree to fp32 rounding. In bf16, ZeRO-2 and 3 agree as closely (measured
# 2026-12-01: equal to the last bit), while ZeRO-0 (DeepSpeed's bf16 data-parallel optimizer: bf16
# gradients accumulated and all-reduced whole, fp32 master weights) rounds elsewhere: at most 0.031
# apart over 6 steps of loss about 3 (2026-12-02, attention in fp32 on CPU; 0.028 before);
# BF16_STAGE_GAP states the tolerance (docs/precision.md).
BF16_STAGE_GAP = 4e-2


@pytest.mark.slow
# in CI: the certificate's batch-shape invariance test (ZeRO 0/2/3 through the real loops)
@pytest.mark.extended
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero_stages_follow_the_same_loss_curve(tmp_path, dtype):
    curves = {}
    for stage in ("0", "2", "3"):
        out, _ = _step1(tmp_path, f"z{stage}", STORIES, "--zero_stage", stage, "--dtype", dtype, steps=6)
        curves[stage] = _metrics(out)[0]
    print(dtype, "loss curves by ZeRO stage:", curves)
    assert curves["3"] == pytest.approx(curves["2"], abs=2e-4), curves
    for stage in ("2", "3"):
        assert curves[stage] == pytest.approx(curves["0"], abs=2e-4 if dtype == "fp32" else BF16_STAGE_GAP), \
            (stage, curves)
