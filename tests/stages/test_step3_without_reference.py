"""Step 3 at a KL coefficient of 0 builds no reference model, and learns exactly as with one.

GRPO on stories260K in this process (one rank), two steps, on 1-digit additions with a reward that
differs between the answers of one prompt (their length in characters, so that the run learns):
once as it runs (no reference: its weights and its forward per buffer saved), once with the reference
forced back in. Every logged figure but the KL, and every recorded per-token quantity (sampler and
trainer log-probs, entropy, advantages, ratios) are bit-equal; the run without a reference logs no
``kl`` (it is not measured) and says why in its log.
"""

import json
import logging

import pytest
import torch

from tests.conftest import STORIES, forget_process_group
from tests.stages.test_step3_critic_free import arith_task

#: Figures that differ between two identical runs (wall times, memory) or by design (the KL).
UNSTABLE = ("time/", "memory/", "samples_per_s", "elapsed_", "kl")


def answer_chars(prompts, answers, metadata):
    """The answer's length in characters, over 10: differs between an untrained model's answers."""
    return [len(a) / 10 for a in answers]


@pytest.fixture(scope="module", autouse=True)
def _one_rank_group_left_behind():
    """The mains here start a one-rank process group in this process and set its environment; both go
    afterwards (as in ``tests/stages/test_in_process.py``)."""
    import os

    saved = dict(os.environ)
    yield
    forget_process_group()
    os.environ.clear()
    os.environ.update(saved)


def _grpo(tmp_path, name: str, *extra: str) -> dict:
    from chatrl.step3_ppo.main import run

    out = tmp_path / name
    result = run(["--actor_model_name_or_path", str(STORIES), "--rl_algorithm", "grpo",
                  "--reward_fn", "tests.stages.test_step3_without_reference:answer_chars",
                  "--data_path", str(arith_task(tmp_path)), "--data_split", "0,0,10",
                  "--data_output_path", str(tmp_path / "cache"), "--max_prompt_seq_len", "64",
                  "--max_answer_seq_len", "6", "--per_device_generation_batch_size", "2",
                  "--per_device_training_batch_size", "8", "--num_samples_per_prompt", "4", "--max_steps", "2",
                  "--actor_zero_stage", "0", "--num_warmup_steps", "0", "--actor_learning_rate", "1e-3",
                  "--enable_hybrid_engine", "--save_rollouts", "1", "--seed", "3", "--output_dir", str(out),
                  "--disable_progress_bar", *extra])
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return {"run": result["run"], "rows": [r for r in rows if "actor_loss" in r], "out": out}


def _stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(UNSTABLE)}


def test_no_reference_at_kl_0_and_the_same_learning(tmp_path, monkeypatch, caplog):
    from chatrl.evidence.rollout_records import read_step
    from chatrl.step3_ppo import engine

    with caplog.at_level(logging.INFO, logger="chatrl.step3_ppo.engine"):
        lean = _grpo(tmp_path, "lean", "--init_kl_coef", "0")
    assert lean["run"].engines.reference is None
    assert lean["run"].trainer.reference is None
    assert any("no reference model: the KL coefficient is 0" in r.getMessage() for r in caplog.records)
    assert len(lean["rows"]) == 2 and all("kl" not in r for r in lean["rows"])

    monkeypatch.setattr(engine, "needs_reference", lambda settings: True)  # as before: the reference built
    full = _grpo(tmp_path, "full", "--init_kl_coef", "0")
    assert full["run"].engines.reference is not None
    assert all("kl" in r for r in full["rows"])
    assert [_stable(r) for r in lean["rows"]] == [_stable(r) for r in full["rows"]]
    assert lean["rows"][1]["actor_loss"] != 0.0  # the comparison is of a run that learns
    for step in (1, 2):
        _, lean_ranks = read_step(lean["out"], step)
        _, full_ranks = read_step(full["out"], step)
        a, b = lean_ranks[0]["tensors"], full_ranks[0]["tensors"]
        assert set(b) - set(a) == {"ref_logp", "kl"}
        for name in a:
            assert torch.equal(a[name], b[name]), name
        assert {"logp", "sampler_logp", "entropy", "advantages", "ratio"} <= set(a)


def test_the_reference_is_built_for_any_kl_coefficient_above_0():
    from types import SimpleNamespace

    from chatrl.step3_ppo.engine import needs_reference

    assert not needs_reference(SimpleNamespace(ppo=SimpleNamespace(init_kl_coef=0.0)))
    assert needs_reference(SimpleNamespace(ppo=SimpleNamespace(init_kl_coef=1e-4)))
