"""Every program at --dtype bf16 over 2 CPU ranks at ZeRO-3 (docs/precision.md): step 1 learns to end its
answers and exports bf16 safetensors; step 2's reward model learns and its bf16 export scores the same in
plain transformers, the scoring tool and the reward server; DPO learns; the critic-free step 3 without
the hybrid engine has ratio exactly 1 and KL exactly 0 at its first step (the trainer recomputes the
old log-probs) with the fp32 LM head and sequence-level importance masking on; chat answers.

PPO in bf16 (hybrid engine, EMA, PTX, LoRA, resume to the last bit) is tests/stages/test_resume.py's
bf16 case; its learning test is tests/stages/test_step3.py's; the hybrid engine's bf16 greedy share
is tests/stages/test_hybrid_engine.py's; ZeRO 0/2/3 bf16 curves are tests/stages/test_step1.py's.
"""

import io
import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import DATA, REPO, STORIES
from tests.launch import run_ranks

HB = str(DATA / "hh-rlhf" / "helpful-base")


def _rows(out):
    return [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


def _bf16_export(folder):
    """The weights' dtypes in the folder's safetensors and the dtype its config.json records."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    cfg = json.loads((folder / "config.json").read_text())
    return dtypes, cfg.get("dtype", cfg.get("torch_dtype"))


# Measured with the same flags at --dtype fp32 (2026-12-01): 0.0% -> 93.8% of 32 greedy answers end in EOS
# (eval perplexity 69.0 -> 12.0); bf16 reached 96.9%.
STEP1_FP32_EOS_GAIN = 0.938


@pytest.mark.slow
def test_step1_bf16_learns_to_end_answers_and_exports_bf16(tmp_path):
    out = tmp_path / "sft"
    run_ranks(["-m", "chatrl.step1_sft", "--model_name_or_path", str(STORIES), "--data_path",
               str(DATA / "alpaca-instructions"), f"{HB}[0:600]", "--data_split", "10,0,0", "--max_seq_len", "256",
               "--per_device_train_batch_size", "8", "--learning_rate", "2e-3", "--num_warmup_steps", "5",
               "--max_steps", "60", "--eval_iters", "1", "--eval_eos_samples", "32", "--eval_max_new_tokens", "64",
               "--zero_stage", "3", "--dtype", "bf16", "--data_output_path", str(tmp_path / "cache"),
               "--output_dir", str(out), "--disable_progress_bar"], timeout=600)
    rows = _rows(out)
    evals = [r["eval/ppl"] for r in rows if "eval/ppl" in r]
    assert evals[-1] < 0.6 * evals[0], evals
    eos = json.loads((out / "chatrl_run.json").read_text())["metrics"]["eval/eos_rate"]
    print(f"bf16 step 1: greedy answers ending in EOS {eos:.1%} (fp32: {STEP1_FP32_EOS_GAIN:.1%})")
    assert eos >= 0.9 * STEP1_FP32_EOS_GAIN, eos  # before training: 0% (stories260K never emits EOS)
    assert _bf16_export(out) == ({"BF16"}, "bfloat16")


@pytest.mark.slow
def test_step2_bf16_learns_and_its_export_scores_the_same_everywhere(tmp_path, tiny_opt):
    from transformers import AutoModelForSequenceClassification

    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, score_sequences
    from chatrl.rewards import RewardBatch
    from chatrl.rewards.model import TextRewardModel
    from chatrl.step2_reward.score import main as score_main

    out = tmp_path / "rm"
    data = [f"{DATA / 'hh-rlhf' / s / 'test.jsonl.gz'}[0:{n}]" for s, n in
            {"helpful-base": 1000, "helpful-rejection-sampled": 1000, "harmless-base": 300}.items()]
    run_ranks(["-m", "chatrl.step2_reward", "--model_name_or_path", str(tiny_opt), "--data_path", *data,
               "--data_split", "2,4,4", "--eval_fraction", "0.15", "--max_seq_len", "256",
               "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "16", "--learning_rate", "5e-4",
               "--zero_stage", "3", "--dtype", "bf16", "--num_padding_at_beginning", "1",
               "--data_output_path", str(tmp_path / "cache"), "--output_dir", str(out), "--disable_progress_bar"],
              timeout=400)
    evals = [r for r in _rows(out) if "eval/accuracy" in r]
    # fp32, the same flags (tests/stages/test_step2_reward.py): accuracy rises by more than 0.03
    assert evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"] + 0.03, evals
    assert _bf16_export(out) == ({"BF16"}, "bfloat16")

    tok = load_tokenizer(str(out))
    seqs = [tok("Human: hi there\n\nAssistant: hello, how can I help?").input_ids,
            tok("Human: what is 2+2?\n\nAssistant: 4").input_ids, tok("Human: tell me a joke").input_ids]
    ours = load_reward_model(str(out), tok, dtype="bf16", require_head=True).eval()
    mine = torch.tensor(score_sequences(ours, seqs, tok.pad_token_id, 8, "cpu"))
    hf = AutoModelForSequenceClassification.from_pretrained(out, num_labels=1).eval()
    assert hf.dtype == torch.bfloat16  # plain transformers loads the export in the dtype it was saved in
    ids = torch.full((3, max(map(len, seqs))), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    from chatrl.models.precision import FP32_SDPA

    same_body = AutoModelForSequenceClassification.from_pretrained(out, num_labels=1,
                                                                   attn_implementation=FP32_SDPA).eval()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()
        body = same_body(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()
    # HF's attention runs in bf16, chatrl's in float32 on CPU (docs/precision.md), whose rounding through the
    # layers moves a score by a few bf16 steps of the largest; with chatrl's attention, within one
    assert mine.std() > 1e-3 and (theirs - mine).abs().max() <= mine.abs().max() * 2 ** -4, (mine, theirs)
    assert (body - mine).abs().max() <= mine.abs().max() * 2 ** -8, (mine, body)
    # the scoring tool and the reward server's text source: the same scores for the same texts
    prompt, good, bad = "How do I boil an egg?", "Put it in boiling water for 8 minutes.", "No."
    buf = io.StringIO()
    score_main(["--model", str(out), "--prompt", prompt, "--chosen", good, "--rejected", bad, "--dtype", "bf16"],
               out=buf)
    printed = json.loads(buf.getvalue().splitlines()[0])
    text = TextRewardModel(str(out), dtype="bf16")
    assert text.model.hf.dtype == torch.bfloat16
    got = text(RewardBatch([prompt, prompt], [good, bad], [{}, {}])).tolist()
    assert got == pytest.approx([printed["chosen"], printed["rejected"]], abs=1e-6)


# The same flags at --dtype fp32 (2026-12-01): eval margin 0 -> 5.50 at step 4 (bf16: 5.44), loss 0.693 -> 0.055.
DPO_FP32_MARGIN_GAIN = 5.50


@pytest.mark.slow
def test_dpo_bf16_zero3_learns(tmp_path):
    """15 pairs (the rows of helpful-base[0:32] that fit 128 tokens), trained and evaluated on: the margin
    after 4 steps reaches 90% of fp32's."""
    out = tmp_path / "dpo"
    run_ranks(["-m", "chatrl.step2_dpo", "--model_name_or_path", str(STORIES), "--data_path", f"{HB}[0:32]",
               "--eval_data_path", f"{HB}[0:32]", "--data_split", "0,10,0", "--max_seq_len", "128",
               "--per_device_train_batch_size", "4", "--learning_rate", "5e-4", "--num_train_epochs", "10",
               "--max_steps", "4", "--zero_stage", "3", "--dtype", "bf16",
               "--data_output_path", str(tmp_path / "cache"), "--output_dir", str(out), "--disable_progress_bar"],
              timeout=400)
    evals = [r for r in _rows(out) if "eval/loss" in r]
    assert evals[0]["eval/loss"] == pytest.approx(0.6931472, abs=1e-6)  # policy = reference: every pair a tie
    assert evals[-1]["step"] == 4 and evals[-1]["eval/loss"] < 0.1, evals
    assert evals[-1]["eval/rewards/margin"] >= 0.9 * DPO_FP32_MARGIN_GAIN, evals
    assert _bf16_export(out) == ({"BF16"}, "bfloat16")


@pytest.mark.slow
def test_critic_free_bf16_first_step_exact_with_fp32_head_and_sequence_masking(tmp_path):
    """GRPO, hybrid engine off, the whole buffer one micro-batch, --separate_experience_pass: the trainer's
    experience forward and its first training forward see the same weights and inputs, so the ratio
    is exactly 1 and the KL to the identical reference exactly 0, in bf16 too."""
    out = tmp_path / "grpo"
    run_ranks(["-m", "chatrl.step3_ppo", "--actor_model_name_or_path", str(STORIES), "--data_path",
               str(DATA / "prompts"), "--data_split", "0,0,10", "--data_output_path", str(tmp_path / "cache"),
               "--output_dir", str(out), "--disable_progress_bar", "--rl_algorithm", "grpo",
               "--num_samples_per_prompt", "4", "--reward_fn", f"{REPO / 'bench' / 'precision_gap.py'}:share_of_e",
               "--max_prompt_seq_len", "32", "--max_answer_seq_len", "8", "--per_device_generation_batch_size", "2",
               "--per_device_training_batch_size", "8", "--max_steps", "2", "--num_warmup_steps", "0",
               "--actor_zero_stage", "3", "--dtype", "bf16", "--separate_experience_pass", "--fp32_lm_head",
               "--rollout_is_cap", "2", "--rollout_is_level", "sequence", "--rollout_is_mode", "mask"], timeout=400)
    rows = [r for r in _rows(out) if "kl" in r]
    first = rows[0]
    assert first["ratio_mean"] == 1.0 and first["approx_kl"] == 0.0 and first["kl"] == 0.0, first
    # the sampler's log-probs are logged against the trainer's (plain generate's KV-cache decoding against one
    # full forward; with attention and the LM head in fp32 on this CPU, they can agree to the bit)
    assert 0 <= first["rollout/logp_diff_mean"] <= first["rollout/logp_diff_max"] < 1.0
    assert 0 <= first["rollout/is_outside_frac"] <= 1 and first["is_weight_mean"] > 0
    assert rows[1]["kl"] != 0.0  # the first step moved the actor
    assert _bf16_export(out / "actor") == ({"BF16"}, "bfloat16")


def test_chat_answers_in_bf16(tmp_path, tiny_opt):
    proc = subprocess.run([sys.executable, "chat.py", "--path", str(tiny_opt), "--dtype", "bf16",
                           "--max_new_tokens", "8", "--seed", "0", "--greedy"], input="Hello there\n", cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ", bf16)" in proc.stdout and "Assistant:" in proc.stdout, proc.stdout
