"""build_phase_data: tokenized phases, truncation, evaluation sets, and the token cache."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from chatrl.config import DataConfig
from chatrl.data import build_phase_data, encode_answer, encode_prompt
from chatrl.data.examples import pair_example, sft_example
from chatrl.data.pipeline import phase_cache_key
from chatrl.models.causal_lm import load_tokenizer
from tests.conftest import DATA, REPO, TOKENIZERS

USER = "Please answer the following question about the weather in a few words."


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer(str(TOKENIZERS / "gpt2"))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def msgs(text):
    return ({"role": "user", "content": text},)


@pytest.fixture
def pairs_file(tmp_path):
    rows = [{"prompt": f"Question {i}?", "chosen": f"Answer {i}.", "rejected": f"No {i}."} for i in range(20)]
    return write_jsonl(tmp_path / "pairs.jsonl", rows)


def as_lists(ds, key):
    return sorted(ds[i][key].tolist() for i in range(len(ds)))


def test_each_phase_holds_the_expected_tokens(gpt2, pairs_file):
    p = [encode_prompt(gpt2, msgs(f"Question {i}?")) for i in range(20)]
    c = [encode_answer(gpt2, f"Answer {i}.") for i in range(20)]
    r = [encode_answer(gpt2, f"No {i}.") for i in range(20)]
    one = build_phase_data(1, DataConfig([pairs_file], data_split="1,0,0", eval_fraction=0.0,
                                         data_output_path=None), gpt2)
    assert (len(one.train), len(one.eval)) == (20, 0)
    assert as_lists(one.train, "input_ids") == sorted(p[i] + c[i] for i in range(20))
    item = one.train[0]
    assert item["input_ids"].dtype == torch.long and isinstance(item["prompt_len"], int)
    i = next(k for k in range(20) if p[k] + c[k] == item["input_ids"].tolist())
    assert item["prompt_len"] == len(p[i]) and item["input_ids"][-1].item() == gpt2.eos_token_id
    two = build_phase_data(2, DataConfig([pairs_file], data_split="0,1,0", eval_fraction=0.1,
                                         data_output_path=None), gpt2)
    assert (len(two.train), len(two.eval)) == (18, 2)
    assert as_lists(two.train, "chosen_input_ids") + as_lists(two.eval, "chosen_input_ids") != []
    got = sorted(as_lists(two.train, "rejected_input_ids") + as_lists(two.eval, "rejected_input_ids"))
    assert got == sorted(p[i] + r[i] for i in range(20))
    three = build_phase_data(3, DataConfig([pairs_file], data_split="2,4,4", data_output_path=None), gpt2)
    assert (len(three.train), len(three.eval)) == (7, 1)
    assert all(three.train[k]["prompt_ids"].tolist() in p for k in range(7))
    assert three.report.summary() == f"{pairs_file}: 8 rows, 8 used."


def test_truncation_keeps_answer_end_and_counts_too_long(gpt2, tmp_path):
    long_prompt = " ".join([USER] * 8)
    rows = [{"prompt": long_prompt, "chosen": "It is sunny.", "rejected": "Rain."},
            {"prompt": "Hi?", "chosen": "word " * 80, "rejected": "Short."}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    p = encode_prompt(gpt2, msgs(long_prompt))
    c, r = encode_answer(gpt2, "It is sunny."), encode_answer(gpt2, "Rain.")
    max_len = len(c) + 5
    one = build_phase_data(1, DataConfig([path], data_split="1,0,0", eval_fraction=0.0,
                                         max_seq_len=max_len, data_output_path=None), gpt2)
    assert len(one.train) == 1
    assert one.train[0]["input_ids"].tolist() == p[-5:] + c
    assert one.train[0]["prompt_len"] == 5
    assert one.report.skipped(path) == {"too_long": 1} and one.report.counts(path).truncated == 1
    two = build_phase_data(2, DataConfig([path], data_split="0,1,0", eval_fraction=0.0,
                                         max_seq_len=max_len, data_output_path=None), gpt2)
    item = two.train[0]
    assert item["chosen_input_ids"].tolist() == p[-5:] + c  # the prompt fits the longer answer
    assert item["rejected_input_ids"].tolist() == p[-5:] + r
    three = build_phase_data(3, DataConfig([path], data_split="0,0,1", eval_fraction=0.0,
                                           data_output_path=None), gpt2, max_prompt_len=4)
    assert sorted(three.train[k]["prompt_ids"].tolist() for k in range(2)) == sorted(
        [p[-4:], encode_prompt(gpt2, msgs("Hi?"))[-4:]])
    assert three.report.summary() == f"{path}: 2 rows, 2 used, truncated 2."


def test_example_rules_keep_bos_and_detect_identical():
    assert sft_example([1, 7, 3, 4, 5], [8, 9, 2], 5) == {"input_ids": [4, 5, 8, 9, 2], "prompt_len": 2,
                                                          "trained_spans": [2, 5]}
    assert sft_example([1, 7, 3, 4, 5], [8, 9, 2], 5, bos_token_id=1) == {"input_ids": [1, 5, 8, 9, 2],
                                                                            "prompt_len": 2, "trained_spans": [2, 5]}
    assert sft_example([1, 7], [8, 9, 2], 3) == "too_long"
    assert pair_example([3, 4, 5], [8, 2], [8, 9, 2], 5) == {
        "chosen_input_ids": [4, 5, 8, 2], "rejected_input_ids": [4, 5, 8, 9, 2], "prompt_len": 2}
    assert pair_example([3, 4, 5], [8, 2], [8, 2], 5) == "identical_pair"


def test_pair_identical_after_tokenization_is_skipped(tmp_path):
    qwen2 = load_tokenizer(str(TOKENIZERS / "qwen2"))  # NFC-normalises: é and e + U+0301 are one token
    rows = [{"prompt": "Coffee place?", "chosen": "caf\u00e9", "rejected": "cafe\u0301"},
            {"prompt": "Tea place?", "chosen": "tea room", "rejected": "bar"},
            {"prompt": "Same?", "chosen": "yes", "rejected": " yes "}]
    path = write_jsonl(tmp_path / "nfc.jsonl", rows)
    two = build_phase_data(2, DataConfig([path], data_split="0,1,0", eval_fraction=0.0,
                                         data_output_path=None), qwen2)
    assert len(two.train) == 1
    assert two.report.summary() == f"{path}: 3 rows, 1 used, skipped 2 identical_pair."
    one = build_phase_data(1, DataConfig([path], data_split="1,0,0", eval_fraction=0.0,
                                         data_output_path=None), qwen2)
    assert len(one.train) == 3  # identical pairs still teach their chosen answer


def test_source_kinds_eval_paths_and_errors(gpt2, pairs_file, tmp_path):
    alpaca = str(DATA / "alpaca-instructions" / "instruction-data.json")
    prompts = str(DATA / "prompts")
    one = build_phase_data(1, DataConfig([pairs_file, alpaca, prompts], max_seq_len=1024,
                                         data_output_path=None), gpt2)
    assert list(one.report.sources) == [pairs_file, alpaca]
    assert (len(one.train), len(one.eval)) == (3 + 1045, 1 + 55)
    three = build_phase_data(3, DataConfig([pairs_file, alpaca, prompts], data_output_path=None), gpt2)
    assert list(three.report.sources) == [pairs_file, prompts]
    evals = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "E?", "chosen": "e", "rejected": "f"}] * 3)
    two = build_phase_data(2, DataConfig([pairs_file], eval_data_path=[evals], data_output_path=None), gpt2)
    assert (len(two.train), len(two.eval)) == (8, 3)
    assert two.report.describe(f"eval:{evals}") == f"eval:{evals}: 3 rows, 3 used"
    with pytest.raises(ValueError, match="phase 2 gets no training rows"):
        build_phase_data(2, DataConfig([alpaca, prompts], data_output_path=None), gpt2)
    with pytest.raises(ValueError, match="phase 2 cannot use"):
        build_phase_data(2, DataConfig([pairs_file], eval_data_path=[alpaca], data_output_path=None), gpt2)
    with pytest.raises(ValueError, match="--data_split"):
        build_phase_data(1, DataConfig([pairs_file], data_split="1,2", data_output_path=None), gpt2)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        build_phase_data(1, DataConfig([str(tmp_path / "missing.jsonl")], data_output_path=None), gpt2)


def test_cache_round_trip(gpt2, pairs_file, tmp_path):
    cache = tmp_path / "cache"
    first = build_phase_data(2, DataConfig([pairs_file], data_output_path=str(cache)), gpt2)
    [key] = os.listdir(cache)
    assert sorted(os.listdir(cache / key)) == ["eval", "report.json", "train"]
    (cache / key / "report.json").write_text(json.dumps({"marker": {"rows": 1, "used": 1, "skipped": {},
                                                                   "truncated": 0}}))
    second = build_phase_data(2, DataConfig([pairs_file], data_output_path=str(cache)), gpt2)
    assert second.report.summary() == "marker: 1 rows, 1 used."  # read from disk, not rebuilt
    assert len(second.train) == len(first.train) == 7
    for k in range(7):
        assert second.train[k]["chosen_input_ids"].tolist() == first.train[k]["chosen_input_ids"].tolist()
        assert second.train[k]["prompt_len"] == first.train[k]["prompt_len"]


def test_cache_key_changes_with_every_input(gpt2, pairs_file, tmp_path):
    qwen_template = load_tokenizer(str(TOKENIZERS / "qwen2")).chat_template
    base = {"data_split": "2,4,4", "max_seq_len": 512, "max_prompt_len": 256, "eval_fraction": 0.05,
            "eval_data_paths": None, "seed": 1234}
    extra_token = copy.deepcopy(gpt2)
    extra_token.add_tokens(["<extra>"])
    templated = copy.deepcopy(gpt2)
    templated.chat_template = qwen_template
    keys = {"base": phase_cache_key(2, [pairs_file], gpt2, **base)}
    assert phase_cache_key(2, [pairs_file], gpt2, **base) == keys["base"]
    for name, value in [("data_split", "2,4,5"), ("max_seq_len", 256), ("max_prompt_len", 128),
                        ("eval_fraction", 0.1), ("eval_data_paths", [pairs_file]), ("seed", 1)]:
        keys[name] = phase_cache_key(2, [pairs_file], gpt2, **{**base, name: value})
    keys["phase"] = phase_cache_key(3, [pairs_file], gpt2, **base)
    keys["slice"] = phase_cache_key(2, [pairs_file + "[0:10]"], gpt2, **base)
    keys["tokenizer"] = phase_cache_key(2, [pairs_file], extra_token, **base)
    keys["template"] = phase_cache_key(2, [pairs_file], templated, **base)
    with open(pairs_file, "a") as f:
        f.write(json.dumps({"prompt": "x", "chosen": "y", "rejected": "z"}) + "\n")
    keys["bytes"] = phase_cache_key(2, [pairs_file], gpt2, **base)
    assert len(set(keys.values())) == len(keys) == 12


def test_cache_key_same_across_processes(gpt2, tmp_path):
    gpt2.save_pretrained(tmp_path / "tok")  # tokenizer.json: a fast load in the subprocesses
    tok = load_tokenizer(str(tmp_path / "tok"))
    entry = str(DATA / "hh-rlhf" / "helpful-base") + "[0:100]"
    code = ("from chatrl.models.causal_lm import load_tokenizer; from chatrl.data.pipeline import phase_cache_key; "
            f"print(phase_cache_key(1, [{entry!r}], load_tokenizer({str(tmp_path / 'tok')!r})))")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed, "HF_HUB_OFFLINE": "1"})
             for seed in ("1", "987")]
    outs = [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in procs]
    assert outs[0] == outs[1] == phase_cache_key(1, [entry], tok)
