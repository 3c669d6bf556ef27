"""Faults mid-run: a non-finite step is skipped at every ZeRO stage, K bad steps in a row stop the run
with a checkpoint, and a killed rank ends a ``train.py`` job within 60 s with a message, after which
the same command resumes the step from its last checkpoint and follows the uninterrupted run's losses."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings

import pytest

from tests.conftest import DATA, REPO, STORIES
from tests.launch import run_ranks


@pytest.mark.slow
def test_nonfinite_step_is_skipped_at_zero_0_2_3(tmp_path, tiny_opt):
    out = tmp_path / "result.json"
    run_ranks([str(REPO / "tests" / "stages" / "nonfinite_worker.py"), str(tiny_opt), str(out)], timeout=300)
    result = json.loads(out.read_text())
    for stage in ("zero0", "zero2", "zero3"):
        r = result[stage]
        assert r["moved_poisoned"] == 0.0, (stage, r)  # the poisoned step changed no weight
        assert r["moved_next"] > 1e-4 and r["finite"], (stage, r)  # and the next one trains normally
        assert r["lr_after"] == r["lr_before"], (stage, r)  # the schedule is held
        assert r["skipped_steps"] == 3 and r["guard_skipped"] == 3 and r["flag"], (stage, r)
        assert r["raised_at_second_in_a_row"], (stage, r)
    # the step after a skipped one moves the weights as much at every stage (optimizer state intact)
    assert result["zero0"]["moved_next"] == pytest.approx(result["zero3"]["moved_next"], rel=1e-4)


@pytest.mark.slow
def test_nonfinite_steps_in_a_row_stop_with_a_checkpoint(tmp_path):
    out = tmp_path / "out"
    proc = run_ranks(["-m", "chatrl.step1_sft", "--model_name_or_path", str(STORIES), "--data_path",
                      str(DATA / "hh-rlhf" / "helpful-base[0:200]"), "--data_split", "10,0,0", "--max_seq_len", "96",
                      "--per_device_train_batch_size", "4", "--max_steps", "8", "--eval_iters", "1",
                      "--zero_stage", "3", "--debug_nonfinite_steps", "2", "4", "5", "--max_nonfinite_steps", "2",
                      "--data_output_path", str(tmp_path / "cache"), "--output_dir", str(out),
                      "--disable_progress_bar"], timeout=300, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "2 training steps in a row (up to step 5) had non-finite loss" in log
    assert "chatrl: rank 0 failed in step 1 (SFT) after optimizer step 5: NonFiniteError" in log
    state = json.loads((out / "checkpoints" / "step_5" / "complete.json").read_text())
    assert state["stopped"] == "non-finite"
    rows = {r["step"]: r for r in map(json.loads, (out / "logs" / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in r}
    assert [rows[s]["train/skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 1, 2]
    assert rows[2]["train/lr"] == rows[1]["train/lr"]  # a skipped step does not advance the schedule
    assert not (out / "chatrl_run.json").exists()


def _train_py(out, cache):
    args = ("--max_steps 40 --max_seq_len 128 --per_device_train_batch_size 4 --data_split 10,0,0 "
            f"--eval_iters 1 --save_interval 2 --data_output_path {cache} --disable_progress_bar")
    return [sys.executable, str(REPO / "train.py"), "--actor-model", str(STORIES), "--reward-model", str(STORIES),
            "--deployment-type", "cpu", "--step", "1", "--data-path", str(DATA / "hh-rlhf" / "helpful-base[0:800]"),
            "--output-dir", str(out), "--step1-args", args]


@pytest.mark.slow
@pytest.mark.extended  # in CI: the certificate's kill-and-resume test (every step, bit for bit)
def test_killed_rank_ends_the_job_and_train_py_resumes(tmp_path):
    import psutil

    out, env = tmp_path / "out", {**os.environ, "HF_HUB_OFFLINE": "1"}
    ckpt = out / "step1_actor" / "checkpoints"
    proc = subprocess.Popen(_train_py(out, tmp_path / "cache"), env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while not (ckpt / "step_4").exists():
        assert proc.poll() is None and time.time() - t0 < 300, "no checkpoint within 300 s"
        time.sleep(0.2)
    def rank_of(p):
        try:
            return p.environ().get("RANK")
        except psutil.Error:  # a helper process that has just exited
            return None

    rank1 = [c for c in psutil.Process(proc.pid).children(recursive=True) if rank_of(c) == "1"]
    assert len(rank1) == 1
    rank1[0].kill()
    killed_at = time.time()
    log, _ = proc.communicate(timeout=120)
    assert time.time() - killed_at < 60
    assert proc.returncode != 0, log[-3000:]
    assert "step 1 (supervised fine-tuning) failed" in log, log[-3000:]
    assert "local rank 1 was killed by signal 9" in log
    newest = max(int(p.name[5:]) for p in ckpt.glob("step_*"))
    assert re.search(r"the last optimizer step logged was (\d+)", log)
    assert int(re.search(r"the last optimizer step logged was (\d+)", log).group(1)) >= newest
    # the surviving rank usually names the step it reached too, unless the launcher stops it first
    assert "rerun the same command to resume" in log

    again = subprocess.run(_train_py(out, tmp_path / "cache"), env=env, cwd=REPO, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from step_{newest}" in again.stdout
    step_log = (out / "logs" / "step1.log").read_text()
    assert f"resumed from {ckpt / f'step_{newest}'} at optimizer step {newest}" in step_log
    assert "local_rank=1" in step_log  # the first attempt's log is kept
    assert (out / "step1_actor" / "chatrl_run.json").exists()
    from chatrl.tools.report import find_steps

    assert f"run report: {out / 'report.html'}" in again.stdout  # written after the step, showing the resume
    assert find_steps(out)[0].resumes == [newest] and (out / "report.html").exists()

    # the killed-and-resumed run followed the uninterrupted run's trajectory
    straight = tmp_path / "straight"
    for attempt in (1, 2):  # the reference run is not what is tested; one CI run saw it exit 1 once, unexplained
        plain = subprocess.run(_train_py(straight, tmp_path / "cache"), env=env, cwd=REPO, capture_output=True,
                               text=True, timeout=600)
        if plain.returncode == 0 or attempt == 2:
            break
        warnings.warn(f"the uninterrupted reference run exited {plain.returncode}; rerunning it:\n"
                      f"{plain.stdout[-3000:]}{plain.stderr[-3000:]}", stacklevel=1)
        shutil.rmtree(straight, ignore_errors=True)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]

    def losses(root):
        rows = map(json.loads, (root / "step1_actor" / "logs" / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}

    resumed, uninterrupted = losses(out), losses(straight)
    assert sorted(resumed) == sorted(uninterrupted) == list(range(1, 41))
    for step in range(newest + 1, 41):
        assert resumed[step] == pytest.approx(uninterrupted[step], abs=1e-6), step


@pytest.mark.slow
def test_errors_a_user_causes_inside_the_ranks_are_one_line_each(tmp_path):
    """Errors found inside a rank arrived as 34-63-line tracebacks: a warm-up longer than the run (a
    per-step script's --num_warmup_steps 10 with a user's --max_steps 3) and a rule reward on prompt
    rows without references. Each is now one line naming the cause, and no traceback."""
    from pathlib import Path

    from chatrl.distributed.dist import free_port

    def run_ranks(args, check, timeout):  # under the DeepSpeed launcher, as the per-step scripts run them
        launcher = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--master_port",
                    str(free_port()), "--module", args[1]]
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO)}
        return subprocess.run([*launcher, *args[2:]], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?"}) + "\n" for i in range(64)))
    common = ["--data_output_path", str(tmp_path / "cache"), "--disable_progress_bar"]
    step1 = run_ranks(["-m", "chatrl.step1_sft", "--model_name_or_path", str(STORIES), "--data_path",
                       str(DATA / "hh-rlhf" / "helpful-base[0:200]"), "--data_split", "10,0,0", "--max_seq_len", "128",
                       "--per_device_train_batch_size", "4", "--max_steps", "3", "--num_warmup_steps", "10",
                       "--output_dir", str(tmp_path / "sft"), *common], check=False, timeout=300)
    step3 = run_ranks(["-m", "chatrl.step3_ppo", "--rl_algorithm", "grpo", "--reward_fn", "exact_match",
                       "--actor_model_name_or_path", str(STORIES), "--data_path", str(prompts), "--data_split", "0,0,10",
                       "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "8",
                       "--output_dir", str(tmp_path / "grpo"), *common], check=False, timeout=300)
    for proc, cause in ((step1, "chatrl: error: --num_warmup_steps 10 must be shorter than the run (3 optimizer steps)"),
                        (step3, 'chatrl: error: --reward_fn exact_match scores each answer against its prompt row\'s '
                                '"reference", and ')):
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and "Traceback" not in out, out[-3000:]
        lines = [x for x in out.splitlines() if x.startswith("chatrl: ")]
        assert lines and all(x.startswith(cause) for x in lines), lines
