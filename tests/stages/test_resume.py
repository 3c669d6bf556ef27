"""Every step resumes exactly: a run stopped after checkpoint k and resumed logs the same losses as an
uninterrupted run (same seed, fp32, 2 ranks) to 1e-6, and a half-written checkpoint is skipped.

Each test runs the step three times: straight through, stopped with ``--stop_after_steps`` (as a
crash would stop it: no final save), then ``--resume`` in the same output folder.
"""

import json
import shutil

import pytest
import torch

from tests.conftest import DATA, STORIES
from tests.launch import run_ranks


def _losses(out, keys):
    """Per logged step, the values of ``keys`` (a resumed run's rows replace the stopped run's)."""
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: r[k] for k in keys} for r in rows if keys[0] in r}


def _straight_stopped_resumed(tmp_path, flags, keys, stop, ckpts, cut_off=None):
    straight = tmp_path / "straight"
    run_ranks([*flags, "--output_dir", str(straight)], timeout=400)
    out = tmp_path / "resumed"
    run_ranks([*flags, "--output_dir", str(out), "--stop_after_steps", str(stop)], timeout=400)
    assert sorted(_losses(out, keys)) == list(range(1, stop + 1))
    assert not (out / "chatrl_run.json").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ckpts
    if cut_off:  # a checkpoint cut off mid-write (no completion marker) must be skipped
        shutil.copytree(out / "checkpoints" / ckpts[-1], out / "checkpoints" / cut_off)
        (out / "checkpoints" / cut_off / "complete.json").unlink()
    proc = run_ranks([*flags, "--output_dir", str(out), "--resume"], timeout=400)
    assert "skipping incomplete checkpoint" in proc.stdout + proc.stderr or not cut_off
    assert (out / "chatrl_run.json").exists()
    return _losses(straight, keys), _losses(out, keys), straight, out


def _supervised_flags(module, rows, split, max_steps, tmp_path):
    """Steps 1 and 2 alike: stories260K, ZeRO-3, 2 ranks × batch 4 × accumulation 2, dropout 0.1, a checkpoint every 2."""
    return ["-m", module, "--model_name_or_path", str(STORIES), "--data_path",
            str(DATA / "hh-rlhf" / f"helpful-base[0:{rows}]"), "--data_split", split, "--max_seq_len", "128",
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", str(max_steps),
            "--eval_iters", "1", "--zero_stage", "3", "--learning_rate", "3e-3", "--dropout", "0.1",
            "--save_interval", "2", "--data_output_path", str(tmp_path / "cache"), "--disable_progress_bar"]


@pytest.mark.slow
@pytest.mark.extended  # in CI: the certificate's kill-and-resume test (steps 1, 2, DPO, 3)
def test_step1_resume_follows_the_uninterrupted_trajectory(tmp_path):
    flags = _supervised_flags("chatrl.step1_sft", 400, "10,0,0", 6, tmp_path)
    straight, resumed, *_ = _straight_stopped_resumed(tmp_path, flags, ["train/loss"], 5, ["step_2", "step_4"],
                                                      cut_off="step_5")
    for step in (5, 6):
        assert resumed[step]["train/loss"] == pytest.approx(straight[step]["train/loss"], abs=1e-6), step
    logs = tmp_path / "resumed" / "logs"
    steps = [json.loads(x)["step"] for x in (logs / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps)  # the stopped run's step-5 row was dropped at resume, not repeated
    assert (logs / "metrics.before-resume-1.jsonl").exists()


@pytest.mark.slow
@pytest.mark.extended  # in CI: the certificate's kill-and-resume test (steps 1, 2, DPO, 3)
def test_step2_resume_follows_the_uninterrupted_trajectory(tmp_path):
    flags = [*_supervised_flags("chatrl.step2_reward", 300, "0,10,0", 5, tmp_path), "--save_total_limit", "1"]
    keys = ["train/loss", "train/accuracy", "train/lr"]
    straight, resumed, *_ = _straight_stopped_resumed(tmp_path, flags, keys, 3, ["step_2"])
    for step in (3, 4, 5):
        for k in keys:
            assert resumed[step][k] == pytest.approx(straight[step][k], abs=1e-6), (step, k)


@pytest.mark.slow
# in CI: the certificate's kill-and-resume test (step 3 to the last bit)
@pytest.mark.extended
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_step3_resume_restores_critic_ema_kl_controller_and_ptx(tmp_path, dtype):
    """PPO with the hybrid engine, LoRA, the EMA, PTX and the adaptive KL controller, in fp32 and in bf16
    (resumed figures and saved weights equal to the last bit in bf16; the exports in bf16, the EMA's
    from its fp32 average, the critic scoring the same in plain transformers)."""
    from safetensors.torch import load_file

    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, save_reward_model

    tok = load_tokenizer(str(STORIES))
    save_reward_model(load_reward_model(str(STORIES), tok, require_head=False), tok, tmp_path / "critic")
    flags = ["-m", "chatrl.step3_ppo", "--actor_model_name_or_path", str(STORIES),
             "--critic_model_name_or_path", str(tmp_path / "critic"), "--data_path", str(DATA / "prompts"),
             "--data_output_path", str(tmp_path / "cache"), "--max_prompt_seq_len", "32",
             "--max_answer_seq_len", "12", "--per_device_generation_batch_size", "4",
             "--per_device_training_batch_size", "2", "--max_steps", "4", "--actor_zero_stage", "3",
             "--critic_zero_stage", "2", "--enable_hybrid_engine", "--actor_lora_dim", "4",
             "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3", "--num_warmup_steps", "0",
             "--enable_ema", "--unsupervised_dataset_name", str(DATA / "alpaca-instructions[0:64]"),
             "--unsup_coef", "0.5", "--kl_ctl", "adaptive", "--kl_target", "0.01", "--kl_horizon", "100",
             "--save_interval", "2", "--disable_progress_bar", "--dtype", dtype]
    keys = ["actor_loss", "critic_loss", "ptx_loss", "reward/score_mean", "kl", "kl_coef", "samples"]
    straight, resumed, s_dir, r_dir = _straight_stopped_resumed(tmp_path, flags, keys, 3, ["step_2"])
    state = json.loads((r_dir / "checkpoints" / "step_2" / "complete.json").read_text())
    assert state["samples"] == 16 and state["ptx_batches"] == 4 and state["kl_ctl"]["kind"] == "adaptive"
    assert straight[4]["kl_coef"] != straight[1]["kl_coef"]  # the controller moved: its state matters
    tol = 1e-6 if dtype == "fp32" else 0.0
    for step in (3, 4):
        for k in keys:
            assert resumed[step][k] == pytest.approx(straight[step][k], abs=tol), (step, k)
    for sub in ("actor", "actor_ema", "critic"):
        a, b = load_file(s_dir / sub / "model.safetensors"), load_file(r_dir / sub / "model.safetensors")
        assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= tol, sub
        assert {t.dtype for t in a.values()} == {torch.float32 if dtype == "fp32" else torch.bfloat16}, sub
    if dtype == "bf16":
        _bf16_ema_and_critic_exports(tmp_path, s_dir, tok)


def _bf16_ema_and_critic_exports(tmp_path, out, tok):
    """The bf16 EMA moved off the actor's start (a bf16 average of updates 0.008 times a weight's change
    would mostly round away); the critic export scores as chatrl's loader in plain transformers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from chatrl.models.reward_model import load_reward_model

    start = load_file(STORIES / "model.safetensors")
    ema = load_file(out / "actor_ema" / "model.safetensors")
    moved = max((ema[k].float() - start[k].float()).abs().max().item() for k in start if k in ema
                and ema[k].shape == start[k].shape)
    assert moved > 0, moved
    rows = [tok("Once upon a time there was a cat").input_ids, tok("The cat sat").input_ids]
    ids = torch.full((2, max(map(len, rows))), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    from chatrl.models.precision import FP32_SDPA

    ours = load_reward_model(str(out / "critic"), tok, dtype="bf16", require_head=True).eval()
    hf = AutoModelForSequenceClassification.from_pretrained(out / "critic", num_labels=1).eval()
    same_body = AutoModelForSequenceClassification.from_pretrained(out / "critic", num_labels=1,
                                                                   attn_implementation=FP32_SDPA).eval()
    assert hf.dtype == torch.bfloat16
    with torch.no_grad():
        mine = ours(ids, mask).end_scores
        theirs = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()
        body = same_body(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()
    # with chatrl's attention (fp32 on CPU) the same bf16 body: within one bf16 step (HF rounds the head's
    # output); plain transformers attends in bf16, whose rounding through the layers moves a small score more
    assert (body - mine).abs().max() <= mine.abs().max() * 2 ** -8 + 1e-6, (mine, body)
    assert (theirs - mine).abs().max() <= mine.abs().max() * 2 ** -4, (mine, theirs)


@pytest.mark.slow
def test_resume_with_another_world_size_is_refused_naming_both_layouts(tmp_path):
    """2 ranks checkpointed at step 2, resumed on 1 rank, silently retrained seen samples."""
    flags = ["-m", "chatrl.step1_sft", "--model_name_or_path", str(STORIES), "--data_path",
             str(DATA / "hh-rlhf" / "helpful-base[0:64]"), "--data_split", "1,0,0", "--max_seq_len", "128",
             "--per_device_train_batch_size", "2", "--max_steps", "4", "--eval_fraction", "0", "--save_interval", "2",
             "--data_output_path", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "out"),
             "--disable_progress_bar"]
    run_ranks([*flags, "--stop_after_steps", "2"], nprocs=2, timeout=400)
    complete = json.loads((tmp_path / "out" / "checkpoints" / "step_2" / "complete.json").read_text())
    assert complete["layout"] == {"world_size": 2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}
    proc = run_ranks([*flags, "--resume"], nprocs=1, timeout=400, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("it was written with world_size 2, per_device_train_batch_size 2, gradient_accumulation_steps 1; "
            "this run has world_size 1, per_device_train_batch_size 2, gradient_accumulation_steps 1") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "chatrl_run.json").exists()


@pytest.mark.slow
def test_ctrl_c_in_a_step_is_one_line_and_the_same_command_resumes(tmp_path):
    """Ctrl-C (SIGINT) during step 1, after its first checkpoint: no traceback, one line naming the
    checkpoint, exit code 130; the same command (with --resume) then continues from it and finishes."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.launch import REPO

    out = tmp_path / "sft"
    flags = _supervised_flags("chatrl.step1_sft", 200, "10,0,0", 40, tmp_path)
    cmd = [sys.executable, *flags, "--save_interval", "1", "--zero_stage", "0", "--resume", "--output_dir", str(out)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "checkpoints" / "step_1" / "complete.json").exists() and proc.poll() is None:
        assert time.time() < deadline, "no checkpoint within 300 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    lines = [x for x in stderr.splitlines() if x.startswith("chatrl: interrupted")]
    assert len(lines) == 1 and lines[0].startswith("chatrl: interrupted (Ctrl-C) in step 1 (SFT) after optimizer step ")
    saved = int(lines[0].split("(optimizer step ")[-1].split(")")[0])
    assert lines[0].endswith(f"saved: the checkpoint {out / 'checkpoints' / f'step_{saved}'} (optimizer step {saved}); "
                             "the same command resumes from it")
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{saved}'} at optimizer step {saved}" in again.stdout + again.stderr
    assert (out / "chatrl_run.json").exists()


@pytest.mark.slow
def test_ctrl_c_under_the_deepspeed_launcher_is_one_line_and_a_rerun_never_overwrites_the_checkpoints(tmp_path):
    """Ctrl-C in a terminal sends SIGINT to the whole job and the DeepSpeed launcher then sends SIGTERM
    to every rank: the ranks died before their one line (no chatrl line at all), and the same command
    (a per-step script, without --resume) then started from step 0 over the checkpoints. Now: the one
    line, and the same command refused in one line naming --resume and --overwrite_output_dir."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from chatrl.distributed.dist import free_port
    from tests.launch import REPO

    out = tmp_path / "sft"
    flags = _supervised_flags("chatrl.step1_sft", 200, "10,0,0", 40, tmp_path)[1:]  # without "-m"
    launcher = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--master_port", str(free_port())]
    cmd = [*launcher, "--module", *flags, "--save_interval", "1", "--zero_stage", "0", "--output_dir", str(out)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    # its own process group, as a terminal's foreground job; SIGINT ignored by the DeepSpeed runner as the
    # per-step scripts have it (`trap '' INT`: the runner's own KeyboardInterrupt traceback), not by the ranks
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.time() + 300
    while not (out / "checkpoints" / "step_2" / "complete.json").exists() and proc.poll() is None:
        assert time.time() < deadline, "no second checkpoint within 300 s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    output = proc.communicate(timeout=120)[0]
    lines = [x for x in output.splitlines() if x.startswith("chatrl: interrupted")]
    assert len(lines) == 1, output[-3000:]
    assert lines[0].startswith("chatrl: interrupted (Ctrl-C) in step 1 (SFT) after optimizer step ")
    assert "; saved: the checkpoint " in lines[0]  # step_1 at least (step_2 if its write had been recorded)
    assert lines[0].endswith("the same command with --resume continues from it")
    assert "Traceback" not in output, output[-3000:]
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2
    newest = sorted(kept, key=lambda n: int(n[5:]))[-1]
    assert again.stderr.strip().splitlines()[-2] == (
        f"python -m chatrl.step1_sft: error: --output_dir {out} holds the checkpoints of an unfinished run (newest: "
        f"{newest}); add --resume to continue from it, or --overwrite_output_dir to start afresh")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == kept


@pytest.mark.slow
def test_a_run_started_afresh_in_a_used_folder_keeps_nothing_of_the_earlier_run(tmp_path):
    """--overwrite_output_dir kept the earlier run's metrics rows before the new run's (the results line
    and the report compared two runs), its later checkpoints (a new step_2 beside an old step_4 was
    deleted at once, --save_total_limit keeping the newest) and its snapshots."""
    out = tmp_path / "sft"
    flags = [*_supervised_flags("chatrl.step1_sft", 200, "10,0,0", 6, tmp_path), "--zero_stage", "0",
             "--output_dir", str(out)]
    run_ranks(flags, nprocs=1, timeout=400)
    first = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    (out / "snapshots" / "step_3").mkdir(parents=True)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"]
    run_ranks([*flags[:flags.index("--max_steps") + 1], "3", *flags[flags.index("--max_steps") + 2:],
               "--overwrite_output_dir"], nprocs=1, timeout=400)
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in first) == 6 and max(r["step"] for r in rows) == 3
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps) and steps.count(0) == 1, steps
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]
    assert not (out / "snapshots").exists()
