"""Step 1 resumes exactly: a run stopped after checkpoint k and resumed gives the same losses as an
uninterrupted run, and a half-written checkpoint is skipped."""

import json
import shutil

import pytest

from tests.conftest import DATA, STORIES
from tests.launch import run_ranks


def _run(tmp_path, out, *extra):
    run_ranks(["-m", "chatrl.step1_sft", "--model_name_or_path", str(STORIES), "--data_path",
               str(DATA / "hh-rlhf" / "helpful-base[0:400]"), "--data_split", "10,0,0", "--max_seq_len", "128",
               "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", "6",
               "--eval_iters", "1", "--zero_stage", "3", "--learning_rate", "3e-3", "--dropout", "0.1",
               "--save_interval", "2", "--data_output_path", str(tmp_path / "cache"), "--output_dir", str(out),
               "--disable_progress_bar", *extra], timeout=400)
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.mark.slow
def test_step1_resume_follows_the_uninterrupted_trajectory(tmp_path):
    straight = _run(tmp_path, tmp_path / "straight")
    out = tmp_path / "resumed"
    first = _run(tmp_path, out, "--stop_after_steps", "5")  # "crashes" after step 5; checkpoint at step 4
    assert sorted(first) == [1, 2, 3, 4, 5]
    assert not (out / "chatrl_run.json").exists()
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_2", "step_4"]
    # a checkpoint cut off mid-write (no completion marker) must be skipped
    shutil.copytree(out / "checkpoints" / "step_4", out / "checkpoints" / "step_5")
    (out / "checkpoints" / "step_5" / "complete.json").unlink()
    resumed = _run(tmp_path, out, "--resume")
    for step in (5, 6):
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6), (step, resumed, straight)
    assert (out / "chatrl_run.json").exists()
