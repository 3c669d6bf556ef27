"""Step 2 end to end over 2 CPU ranks with ZeRO-3, on four hh-rlhf subsets blended (step-2 phase):
eval accuracy rises above its value before training, the mean margin turns positive, and the saved
folder is the trained model for HF's sequence-classification class, our loader and the scoring CLI."""

import io
import json

import pytest
import torch

from tests.conftest import DATA
from tests.launch import run_ranks

# Rows per subset. Three subsets blended; harmless-base (where the shorter answer tends to win) is a
# smaller share, so that 100 optimizer steps of a random tiny model learn something measurable.
SUBSETS = {"helpful-base": 1000, "helpful-rejection-sampled": 1000, "harmless-base": 300}


@pytest.mark.slow
def test_step2_zero3_blended_hh_learns_and_saves_hf_seq_cls(tmp_path, tiny_opt):
    out = tmp_path / "rm"
    data = [f"{DATA / 'hh-rlhf' / s / 'test.jsonl.gz'}[0:{n}]" for s, n in SUBSETS.items()]
    run_ranks(["-m", "chatrl.step2_reward", "--model_name_or_path", str(tiny_opt), "--data_path", *data,
               "--data_split", "2,4,4", "--eval_fraction", "0.15", "--max_seq_len", "256",
               "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "16",
               "--learning_rate", "5e-4", "--zero_stage", "3", "--num_padding_at_beginning", "1",
               "--data_output_path", str(tmp_path / "cache"), "--output_dir", str(out), "--disable_progress_bar"],
              timeout=300)

    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    train = [r for r in rows if "train/loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == train[-1]["step"] > 50
    assert evals[0]["eval/pairs"] == evals[-1]["eval/pairs"] > 100
    assert evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"] + 0.03, evals
    assert evals[-1]["eval/margin"] > 0, evals
    assert evals[-1]["eval/margin"] == pytest.approx(
        evals[-1]["eval/chosen_score"] - evals[-1]["eval/rejected_score"], abs=1e-6)
    marker = json.loads((out / "chatrl_run.json").read_text())
    assert marker["step"] == 2 and marker["metrics"]["eval/accuracy"] == evals[-1]["eval/accuracy"]

    # The folder is an HF sequence-classification model with our scores, and a required head is there.
    from transformers import AutoModelForSequenceClassification

    from chatrl.data import PairCollator, load_samples
    from chatrl.data.examples import tokenize_samples
    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model
    from chatrl.step2_reward.score import main as score_main

    tok = load_tokenizer(str(out))
    hf = AutoModelForSequenceClassification.from_pretrained(out, num_labels=1).eval()
    ours = load_reward_model(str(out), tok, require_head=True).eval()
    assert hf.config.architectures == ["OPTForSequenceClassification"]
    entry = f"{DATA / 'hh-rlhf' / 'helpful-base' / 'test.jsonl.gz'}[2000:2008]"
    pairs = [ex for ex, _ in tokenize_samples(2, load_samples(entry), tok, max_seq_len=512, max_prompt_len=256)]
    assert all(isinstance(ex, dict) for ex in pairs)  # no pair of these rows is skipped
    batch = PairCollator(tok.pad_token_id)(pairs)
    with torch.no_grad():
        theirs = hf(**batch).logits.squeeze(-1)
        mine = ours(batch["input_ids"], batch["attention_mask"]).end_scores
    assert (theirs - mine).abs().max().item() < 1e-5
    assert mine.std().item() > 1e-3  # a trained head, not a constant

    # The scoring CLI reads the same folder and prints the same scores for the same pairs.
    buf = io.StringIO()
    summary = score_main(["--model", str(out), "--pairs", entry], out=buf)
    printed = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert summary["pairs"] == len(pairs) == len(printed) - 1
    n = len(pairs)
    assert [p["chosen"] for p in printed[:-1]] == pytest.approx(mine[:n].tolist(), abs=1e-5)
    assert [p["rejected"] for p in printed[:-1]] == pytest.approx(mine[n:].tolist(), abs=1e-5)
