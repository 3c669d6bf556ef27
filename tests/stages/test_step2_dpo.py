"""DPO (``python -m chatrl.step2_dpo``) end to end on stories260K.

* the reference: a frozen copy whose weights are bit-identical after training, precomputed
  log-probs giving the same losses, and with LoRA the policy with adapters disabled (no copy);
* ZeRO 0, 2 and 3 follow the same loss curve over 2 ranks, and a stopped run resumes exactly;
* after a short step 1, DPO raises held-out preference accuracy above chance (weakly); the share of
  greedy answers ending with EOS is reported (DPO here loses it: see docs/dpo.md).
"""

import json

import pytest

from tests.conftest import DATA, STORIES
from tests.launch import run_ranks
from tests.stages.test_resume import _losses, _straight_stopped_resumed, _supervised_flags

HB = DATA / "hh-rlhf" / "helpful-base"


def _rows(out):
    return [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dpo_reference_is_frozen_precomputable_and_adapter_free_with_lora(tmp_path):
    result = tmp_path / "result.json"
    run_ranks(["tests/stages/dpo_worker.py", str(result), str(tmp_path)], nprocs=1, timeout=600)
    r = json.loads(result.read_text())
    assert r["copy_kind"] == "copy" and r["copy_ref_identical"] and not r["copy_ref_requires_grad"]
    assert r["copy_policy_moved"]
    assert r["pre_kind"] == "precomputed"
    assert r["pre_losses"] == pytest.approx(r["copy_losses"], abs=1e-6)
    assert len(r["copy_losses"]) == 3 and r["copy_eval0_loss"] == pytest.approx(0.6931472, abs=1e-6)
    assert r["lora_kind"] == "adapters_disabled"
    assert r["lora_base_identical"] and r["lora_adapters_moved"]
    assert r["lora_ref_max_diff"] == 0.0  # adapters off = the starting model, exactly
    assert r["lora_policy_diff"] > 1e-3   # while the policy with adapters on has moved


@pytest.mark.slow
def test_dpo_zero_stages_agree_and_resume_is_exact(tmp_path):
    flags = [*_supervised_flags("chatrl.step2_dpo", 300, "0,10,0", 5, tmp_path), "--save_total_limit", "1",
             "--beta", "0.1"]
    keys = ["train/loss", "train/rewards/accuracy", "train/rewards/margin", "train/lr"]
    straight, resumed, _, _ = _straight_stopped_resumed(tmp_path, flags, keys, 3, ["step_2"])
    for step in (3, 4, 5):
        for k in keys:
            assert resumed[step][k] == pytest.approx(straight[step][k], abs=1e-6), (step, k)
    z3 = [straight[s]["train/loss"] for s in sorted(straight)]
    assert len(set(z3)) > 1
    for stage in ("0", "2"):
        out = tmp_path / f"z{stage}"
        run_ranks([*flags, "--zero_stage", stage, "--save_interval", "0", "--output_dir", str(out)], timeout=400)
        curve = _losses(out, ["train/loss"])
        assert [curve[s]["train/loss"] for s in sorted(curve)] == pytest.approx(z3, abs=2e-4), stage


@pytest.mark.slow
def test_dpo_after_step1_on_stories260k_prefers_chosen_and_reports_eos(tmp_path):
    common = ["--max_seq_len", "256", "--per_device_eval_batch_size", "32", "--eval_eos_samples", "32",
              "--eval_max_new_tokens", "64", "--data_output_path", str(tmp_path / "cache"), "--disable_progress_bar"]
    sft = tmp_path / "sft"
    # Alpaca's short answers teach stories260K to stop (hh-rlhf alone: 0% EOS after 31 steps).
    run_ranks(["-m", "chatrl.step1_sft", "--model_name_or_path", str(STORIES), "--data_path",
               str(DATA / "alpaca-instructions"), f"{HB}[0:600]", "--data_split", "10,0,0",
               "--per_device_train_batch_size", "16", "--learning_rate", "2e-3", "--num_warmup_steps", "5",
               "--max_steps", "60", "--eval_iters", "1", "--output_dir", str(sft), *common], nprocs=1, timeout=600)
    eos_sft = json.loads((sft / "chatrl_run.json").read_text())["metrics"]["eval/eos_rate"]

    dpo = tmp_path / "dpo"
    run_ranks(["-m", "chatrl.step2_dpo", "--model_name_or_path", str(sft), "--data_path", f"{HB}[600:1600]",
               "--data_split", "0,10,0", "--eval_fraction", "0.2", "--per_device_train_batch_size", "8",
               "--learning_rate", "5e-4", "--beta", "0.1", "--max_steps", "40", "--eval_interval", "20",
               "--output_dir", str(dpo), *common], nprocs=1, timeout=600)
    evals = [r for r in _rows(dpo) if "eval/rewards/accuracy" in r]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and first["eval/rewards/accuracy"] == 0.0 and first["eval/loss"] == pytest.approx(
        0.6931472, abs=1e-6)  # policy = reference before training: every reward is 0, every pair a tie
    assert last["eval/pairs"] == first["eval/pairs"] > 50
    # A weak but real signal on held-out pairs (seen: accuracy 0.53 and margin 0.06 at step 20).
    assert last["eval/rewards/accuracy"] > 0.5 and last["eval/rewards/margin"] > 0, evals
    marker = json.loads((dpo / "chatrl_run.json").read_text())
    eos_dpo = marker["metrics"]["eval/eos_rate"]
    # Step 1 taught the model to stop. DPO here does NOT keep it (seen: 84% of step 1's greedy answers to
    # these prompts end with EOS, 0% after DPO at lr 5e-4, 31% at lr 1e-4): an open problem recorded in
    # docs/dpo.md, reported, not asserted.
    print(f"greedy answers ending in EOS: after step 1 {eos_sft:.1%} (its eval prompts), after DPO {eos_dpo:.1%}")
    assert eos_sft >= 0.5, eos_sft
    assert 0.0 <= eos_dpo <= 1.0

    # The DPO folder is an HF causal LM (what chat.py and step 3 load).
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(dpo).config.architectures == ["LlamaForCausalLM"]
