"""Prompt rows carrying a reference answer and metadata for reward functions, and the synthetic
arithmetic task (scripts/make_arith_task.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from chatrl.config import DataConfig
from chatrl.data import PromptCollator, build_phase_data
from chatrl.data.schema import RowSkip, adapt_prompt, detect_schema
from chatrl.models.causal_lm import load_tokenizer
from chatrl.rewards.builtin import exact_match, regex_format
from tests.conftest import REPO, TOKENIZERS


def load_script():
    spec = importlib.util.spec_from_file_location("make_arith_task", REPO / "scripts" / "make_arith_task.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prompt_rows_with_reference_and_metadata():
    (s,) = adapt_prompt({"prompt": "What is 2+2?", "reference": 4, "metadata": {"level": 1}})
    assert s.messages == ({"role": "user", "content": "What is 2+2?"},) and s.metadata == {"level": 1, "reference": 4}
    assert adapt_prompt({"prompt": "hi"})[0].metadata is None
    assert adapt_prompt({"text": "hi", "metadata": {"reference": "4"}, "reference": "4"})[0].metadata == {"reference": "4"}
    for row, msg in [({"prompt": "q", "metadata": [1]}, "metadata is a list"),
                     ({"prompt": "q", "reference": True}, "reference is a bool"),
                     ({"prompt": "q", "reference": "4", "metadata": {"reference": "5"}}, "differ")]:
        with pytest.raises(RowSkip, match=msg) as info:
            adapt_prompt(row)
        assert info.value.reason == "wrong_type"
    assert detect_schema([{"prompt": "q", "reference": "1", "metadata": {}}], "f") == ("prompts", "prompts")


def test_metadata_reaches_step_3_batches_and_bad_rows_are_counted(tmp_path):
    rows = [{"prompt": "What is 1 + 2?", "reference": "3", "metadata": {"op": "+"}},
            {"prompt": "What is 5 - 2?", "reference": "3"},
            {"prompt": "Say hi."},
            {"prompt": "What is 2 * 2?", "metadata": "not an object"}]
    path = tmp_path / "arith.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"prompt": "What is 9 - 9?", "reference": 0}) + "\n")
    tok = load_tokenizer(str(TOKENIZERS / "gpt2"))

    def build():
        return build_phase_data(3, DataConfig([str(path)], data_split="0,0,1",
                                              eval_data_path=[str(held_out)],
                                              data_output_path=str(tmp_path / "c")), tok)

    data = build()
    assert data.eval[0]["metadata"] == {"reference": 0}
    assert data.report.skipped(str(path)) == {"wrong_type": 1}
    metas = sorted((data.train[i]["metadata"] for i in range(len(data.train))), key=json.dumps)
    assert sorted(map(json.dumps, metas)) == sorted(map(json.dumps, [{}, {"op": "+", "reference": "3"},
                                                                      {"reference": "3"}]))
    batch = PromptCollator(tok.pad_token_id, with_metadata=True)([data.train[i] for i in range(3)])
    assert batch["input_ids"].shape[0] == 3 and sorted(map(json.dumps, batch["metadata"])) == sorted(
        map(json.dumps, metas))
    assert set(PromptCollator(tok.pad_token_id)([data.train[0]])) == {"input_ids", "attention_mask"}
    again = build()
    assert [again.train[i]["metadata"] for i in range(3)] == [data.train[i]["metadata"] for i in range(3)]  # cached


def test_arith_task_rows_are_correct_distinct_and_held_out():
    mod = load_script()
    train, evals = mod.make_task(300, 50, seed=1, max_operand=20, ops=("+", "-", "*"))
    assert len(train) == 300 and len(evals) == 50
    keys = [(r["metadata"]["a"], r["metadata"]["op"], r["metadata"]["b"]) for r in train + evals]
    assert len(set(keys)) == 350  # no problem repeats, so the held-out problems are unseen
    for r in train + evals:
        a, op, b = r["metadata"]["a"], r["metadata"]["op"], r["metadata"]["b"]
        assert int(r["reference"]) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert r["prompt"] == f"What is {a} {op} {b}? Answer with the number only."
    meta = [{**r["metadata"], "reference": r["reference"]} for r in evals]
    answers = [r["reference"] for r in evals]
    assert exact_match([], answers, meta) == [1.0] * 50 and regex_format([], answers, meta) == [1.0] * 50
    assert exact_match([], ["0" if a != "0" else "1" for a in answers], meta) == [0.0] * 50
    with pytest.raises(ValueError, match="only 8 distinct ones exist"):
        mod.make_task(5, 5, max_operand=1, ops=("+", "-"))


def test_arith_task_second_operand_range():
    """--max_second_operand: b stays in [0, B], a spans [0, max_operand], problems stay distinct."""
    mod = load_script()
    train, evals = mod.make_task(150, 50, seed=2, max_operand=99, ops=("+",), max_second_operand=1)
    keys = [(r["metadata"]["a"], r["metadata"]["b"]) for r in train + evals]
    assert len(set(keys)) == 200 == len(keys)
    assert {b for _, b in keys} == {0, 1} and max(a for a, _ in keys) > 90
    assert all(int(r["reference"]) == r["metadata"]["a"] + r["metadata"]["b"] for r in train + evals)
    with pytest.raises(ValueError, match=r"only 200 distinct ones exist with --max_operand 99, --max_second_operand 1"):
        mod.make_task(150, 51, max_operand=99, ops=("+",), max_second_operand=1)
    with pytest.raises(ValueError, match="max_second_operand >= 0"):
        mod.make_task(1, 1, max_operand=9, max_second_operand=-1)


def test_arith_script_writes_files_and_refuses_to_overwrite(tmp_path, capsys):
    mod = load_script()
    mod.main(["--output_dir", str(tmp_path), "--train", "20", "--eval", "5", "--with_answers"])
    rows = [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and all(r["chosen"] == r["reference"] for r in rows)
    assert json.loads(capsys.readouterr().out)["n_eval"] == 5
    with pytest.raises(SystemExit):
        mod.main(["--output_dir", str(tmp_path), "--train", "20", "--eval", "5"])
    assert "already exist" in capsys.readouterr().err
