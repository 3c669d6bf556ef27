"""GPU tier (one CUDA GPU; skipped elsewhere): NCCL initialisation, steps 1–3 in bf16 for a few steps on
a small OPT and a small Llama, and the hybrid engine against HF ``generate`` in bf16.

Each test starts the real programs as one rank (``python -m chatrl.stepN_...``: a one-process group
on NCCL) and reads their metrics logs and saved folders.
"""

import json
import math

import pytest

from tests.conftest import DATA
from tests.launch import run_ranks

pytestmark = pytest.mark.gpu  # (tests/gpu/conftest.py skips them without CUDA)
GPU_ENV = {"DS_ACCELERATOR": "cuda", "OMP_NUM_THREADS": "4"}
HH = str(DATA / "hh-rlhf" / "helpful-base[0:400]")


def _gpu(args, timeout=300):
    return run_ranks(args, nprocs=1, timeout=timeout, env=GPU_ENV)


def _rows(out):
    return [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_nccl_process_group_and_all_reduce(tmp_path):
    script = tmp_path / "nccl.py"
    script.write_text(
        "import torch\nfrom chatrl.distributed import dist\n"
        "info = dist.init_distributed()\n"
        "t = torch.ones(4, device=info.device)\n"
        "s = dist.all_reduce_sum(t)\n"
        "print('NCCL', torch.distributed.get_backend(), info.device.type, s.sum().item())\n"
        "dist.shutdown()\ndist.exit_now()\n")
    proc = _gpu([str(script)])
    assert "NCCL nccl cuda 4.0" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_steps_1_2_3_in_bf16(tmp_path, tiny_models, family):
    model = tiny_models[family]
    common = ["--dtype", "bf16", "--data_output_path", str(tmp_path / "cache"), "--disable_progress_bar",
              "--data_split", "2,4,4"]
    s1, s2, s3 = tmp_path / "step1", tmp_path / "step2", tmp_path / "step3"
    _gpu(["-m", "chatrl.step1_sft", "--model_name_or_path", str(model), "--data_path", HH, "--max_seq_len", "128",
          "--per_device_train_batch_size", "4", "--max_steps", "6", "--learning_rate", "3e-3", "--zero_stage", "3",
          "--eval_iters", "1", "--output_dir", str(s1), *common])
    _gpu(["-m", "chatrl.step2_reward", "--model_name_or_path", str(model), "--data_path", HH, "--max_seq_len", "128",
          "--per_device_train_batch_size", "4", "--max_steps", "6", "--learning_rate", "5e-4", "--zero_stage", "2",
          "--eval_iters", "1", "--output_dir", str(s2), *common])
    _gpu(["-m", "chatrl.step3_ppo", "--actor_model_name_or_path", str(s1), "--critic_model_name_or_path", str(s2),
          "--data_path", HH, "--max_prompt_seq_len", "64", "--max_answer_seq_len", "32",
          "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4", "--max_steps", "3",
          "--actor_zero_stage", "3", "--critic_zero_stage", "3", "--enable_hybrid_engine",
          "--output_dir", str(s3), *common])
    loss1 = [r["train/loss"] for r in _rows(s1) if "train/loss" in r]
    assert len(loss1) == 6 and all(math.isfinite(x) for x in loss1) and loss1[-1] < loss1[0], loss1
    loss2 = [r["train/loss"] for r in _rows(s2) if "train/loss" in r]
    assert len(loss2) == 6 and all(math.isfinite(x) for x in loss2), loss2
    rows3 = _rows(s3)
    assert [r["step"] for r in rows3] == [1, 2, 3]
    assert all(math.isfinite(r[k]) for r in rows3 for k in ("actor_loss", "critic_loss", "kl", "reward/score_mean"))
    assert rows3[0]["kl"] == pytest.approx(0.0, abs=1e-3)  # actor == reference before the first update
    for out in (s1, s2, s3 / "actor", s3 / "critic"):
        assert (out / "model.safetensors").exists(), out


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_hybrid_engine_matches_hf_generate_in_bf16(tiny_models, family):
    proc = _gpu(["tests/gpu/hybrid_bf16_worker.py", "--model", str(tiny_models[family])])
    line = [x for x in proc.stdout.splitlines() if x.startswith("GPU_HYBRID_RESULT ")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(line[-1].split(" ", 1)[1])
    for check in result["checks"]:
        assert check["tokens_equal"], check
        # bf16 has an 8-bit mantissa: allow a few units in the last place of the largest logit
        assert check["max_logit_diff"] <= 0.02 * max(1.0, check["logit_scale"]), check
