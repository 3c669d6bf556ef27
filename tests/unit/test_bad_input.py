"""Every bad input a user can give: a clear error naming the flag, file or row, or a counted skip.

One test per row of docs/bad_input.md. Each checks what the existing data/model tests leave out
(the user-facing entry point, the whole message, or another schema / file format); the table
names the existing tests that cover the rest.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from chatrl.checkpoint import RUN_MARKER, check_output_dir, write_run_marker
from chatrl.cli import parse
from chatrl.config import DataConfig, LoraConfig
from chatrl.data import build_phase_data, load_samples
from chatrl.distributed import dist
from chatrl.errors import UsageError
from chatrl.models.causal_lm import apply_lora, load_causal_lm, load_tokenizer, torch_dtype
from chatrl.sizes import BatchSizes
from tests.conftest import STORIES, TOKENIZERS


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer(str(TOKENIZERS / "gpt2"))


@pytest.fixture(scope="module")
def stories_tok():
    return load_tokenizer(str(STORIES))


def write_lines(path, rows) -> str:
    """Write ``rows`` as JSON lines; ``bytes`` items are written as they are (bad lines)."""
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return str(path)


def pair(i: int) -> dict:
    return {"prompt": f"Question {i}?", "chosen": f"Answer {i}.", "rejected": f"No {i}."}


def phase(n: int, paths: list[str], tok, max_prompt_len: int = 256, **fields):
    """``build_phase_data`` with all pair rows in phase ``n``, nothing held out and no cache; ``fields``
    set the other fields of the data block."""
    split = {1: "1,0,0", 2: "0,1,0", 3: "0,0,1"}[n]
    data = DataConfig(paths, **{"data_split": split, "eval_fraction": 0.0, "data_output_path": None,
                      **fields})
    return build_phase_data(n, data, tok, max_prompt_len=max_prompt_len)


# 1 -----------------------------------------------------------------------------------------------
def test_missing_data_path_is_named_with_the_cache_on_and_as_eval_entry(gpt2, tmp_path):
    good = write_lines(tmp_path / "good.jsonl", [pair(i) for i in range(4)])
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(FileNotFoundError) as err:  # the default path: cache key first
        build_phase_data(1, DataConfig([good, str(missing)], data_output_path=str(tmp_path / "cache")), gpt2)
    assert str(err.value) == f"data path not found: {missing}"
    with pytest.raises(FileNotFoundError) as err:
        phase(1, [good], gpt2, eval_data_path=[str(tmp_path / "eval.jsonl")])
    assert str(err.value) == f"data path not found: {tmp_path / 'eval.jsonl'}"


# 2 -----------------------------------------------------------------------------------------------
def test_empty_files_and_empty_folder_are_named(gpt2, tmp_path):
    zero = tmp_path / "zero.jsonl"
    zero.write_bytes(b"")
    no_rows = tmp_path / "list.json"
    no_rows.write_text("[]")
    (tmp_path / "empty_dir").mkdir()
    cases = [(zero, f"{zero}: empty data file"),
             (no_rows, f"{no_rows}: empty data file (no rows)"),
             (tmp_path / "empty_dir", f"{tmp_path / 'empty_dir'}: folder holds no .jsonl/.json/.parquet(.gz) file")]
    for path, message in cases:
        with pytest.raises(ValueError) as err:
            phase(1, [str(path)], gpt2)
        assert str(err.value) == message


# 3 -----------------------------------------------------------------------------------------------
def test_malformed_json_lines_counted_in_phase_report_and_bad_json_file_named(gpt2, tmp_path):
    rows = [pair(0), b'{"prompt": "x", "chosen": ', pair(1), b"not json at all", pair(2), pair(3)]
    path = write_lines(tmp_path / "some_bad.jsonl", rows)
    data = phase(1, [path], gpt2)
    assert len(data.train) == 4
    assert data.report.summary() == f"{path}: 6 rows, 4 used, skipped 2 malformed_json."
    whole = tmp_path / "broken.json"
    whole.write_text('[{"prompt": "x", "chosen": "a", ')
    with pytest.raises(ValueError) as err:
        phase(1, [str(whole)], gpt2)
    assert str(err.value).startswith(f"{whole}: not valid JSON (")
    assert str(err.value).endswith("one record per line belongs in a .jsonl file")


# 4 -----------------------------------------------------------------------------------------------
def test_wrong_schema_names_file_and_keys(gpt2, tmp_path):
    odd = write_lines(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}] * 2)
    with pytest.raises(ValueError) as err:
        phase(1, [odd], gpt2)
    assert str(err.value).startswith(f"{odd}: unknown data schema; saw keys ['answer', 'question'] (known: hh-rlhf")
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"rows": [pair(0)]}))
    with pytest.raises(ValueError) as err:
        phase(1, [str(wrapped)], gpt2)
    assert str(err.value) == f'{wrapped}: a .json data file must hold a list of records or {{"data": [...]}}'
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    a = write_lines(mixed / "a.jsonl", [pair(0)])
    b = write_lines(mixed / "b.jsonl", [{"instruction": "Say hi.", "input": "", "output": "Hi."}])
    with pytest.raises(ValueError) as err:
        phase(1, [str(mixed)], gpt2)
    assert str(err.value) == f"{str(mixed)!r}: files of different kinds in one entry: {{{a!r}: 'pairs', {b!r}: 'sft'}}"


# 5 -----------------------------------------------------------------------------------------------
def test_missing_fields_counted_per_schema_in_phase_report(gpt2, tmp_path):
    pairs = write_lines(tmp_path / "pairs.jsonl", [pair(0), {"prompt": "x", "chosen": "a"},
                                                   {"chosen": "a", "rejected": "b"}, pair(1)])
    two = phase(2, [pairs], gpt2)
    assert two.report.summary() == f"{pairs}: 4 rows, 2 used, skipped 2 missing_field."
    alpaca = write_lines(tmp_path / "alpaca.jsonl", [{"instruction": "Say hi.", "output": "Hi."},
                                                     {"instruction": "Say bye.", "input": "now"}])
    one = phase(1, [alpaca], gpt2)
    assert one.report.summary() == f"{alpaca}: 2 rows, 1 used, skipped 1 missing_field."


# 6 -----------------------------------------------------------------------------------------------
def test_empty_fields_counted_and_empty_rejected_kept(gpt2, tmp_path):
    rows = [pair(0), {"prompt": "  ", "chosen": "a", "rejected": "b"}, {"prompt": "x", "chosen": "", "rejected": "b"},
            {"prompt": "Silent?", "chosen": "No.", "rejected": ""}]
    path = write_lines(tmp_path / "empty_fields.jsonl", rows)
    two = phase(2, [path], gpt2)
    assert len(two.train) == 2  # an empty rejected answer is a real, dispreferred answer
    assert two.report.summary() == f"{path}: 4 rows, 2 used, skipped 2 empty_field."
    conv = write_lines(tmp_path / "sharegpt.jsonl", [
        {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]},
        {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "Hello."}]}])
    one = phase(1, [conv], gpt2)
    assert one.report.summary() == f"{conv}: 2 rows, 1 used, skipped 1 empty_field."


# 7 -----------------------------------------------------------------------------------------------
def test_non_utf8_rows_counted_and_non_utf8_json_file_named(gpt2, tmp_path):
    rows = [pair(0), b'{"prompt": "caf\xe9?", "chosen": "a", "rejected": "b"}', pair(1)]
    path = write_lines(tmp_path / "latin1.jsonl", rows)
    three = phase(3, [path], gpt2)
    assert three.report.summary() == f"{path}: 3 rows, 2 used, skipped 1 non_utf8."
    whole = tmp_path / "latin1.json"
    whole.write_bytes(b'[{"prompt": "caf\xe9?", "chosen": "a", "rejected": "b"}]')
    with pytest.raises(ValueError) as err:
        phase(1, [str(whole)], gpt2)
    assert str(err.value) == f"{whole}: not UTF-8 text"


# 8 -----------------------------------------------------------------------------------------------
def test_too_long_skipped_in_phase_2_and_left_cut_in_phase_3(gpt2, tmp_path):
    long_prompt = "Tell me about the weather today in a few words please. " * 6
    rows = [{"prompt": "Hi?", "chosen": "word " * 60, "rejected": "Short."},
            {"prompt": "Hi?", "chosen": "Short.", "rejected": "word " * 60},
            {"prompt": long_prompt, "chosen": "Sunny.", "rejected": "Rain."},
            {"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go."}]
    path = write_lines(tmp_path / "long.jsonl", rows)
    two = phase(2, [path], gpt2, max_seq_len=32)
    assert two.report.summary() == f"{path}: 4 rows, 2 used, skipped 2 too_long, truncated 1."
    assert max(len(two.train[i]["chosen_input_ids"]) for i in range(2)) <= 32
    three = phase(3, [path], gpt2, max_prompt_len=16)
    assert three.report.summary() == f"{path}: 4 rows, 4 used, truncated 1."
    assert sorted(len(three.train[i]["prompt_ids"]) for i in range(4))[-1] == 16


# 9 -----------------------------------------------------------------------------------------------
def test_source_of_only_identical_pairs_is_refused_for_phase_2_but_serves_phase_1(gpt2, tmp_path):
    rows = [{"prompt": "A?", "chosen": "same", "rejected": "same"}, {"prompt": "B?", "chosen": " x ", "rejected": "x"}]
    path = write_lines(tmp_path / "identical.jsonl", rows)
    with pytest.raises(ValueError) as err:
        load_samples(path)
    assert str(err.value) == f"{path!r}: no usable rows (all 2 pairs are identical)"
    with pytest.raises(ValueError) as err:
        phase(2, [path], gpt2)
    assert str(err.value) == f"{path!r}: no usable rows for phase 2 ({path}: 2 rows, 0 used, skipped 2 identical_pair)"
    assert phase(1, [path], gpt2).report.summary() == f"{path}: 2 rows, 2 used."


# 10 ----------------------------------------------------------------------------------------------
def test_finished_output_dir_message_names_folder_marker_and_both_flags(tmp_path):
    (tmp_path / "notes.txt").write_text("not a finished run")
    check_output_dir(str(tmp_path), overwrite=False)  # files, but no run marker: fine
    write_run_marker(str(tmp_path), {"step": 2})
    with pytest.raises(UsageError) as err:
        check_output_dir(str(tmp_path), overwrite=False)
    assert str(err.value) == (f"{tmp_path} already holds a finished run ({RUN_MARKER}); pass --overwrite_output_dir "
                              "to replace it or choose another --output_dir")


# 11 ----------------------------------------------------------------------------------------------
def test_reward_folder_without_value_head_names_the_folder(stories_tok):
    from chatrl.models.reward_model import MissingRewardHeadError, load_reward_model

    with pytest.raises(MissingRewardHeadError) as err:
        load_reward_model(str(STORIES), stories_tok, require_head=True)
    assert isinstance(err.value, ValueError)
    assert str(err.value) == (f"{STORIES} has no 'score.weight' (found no head): it is not a chatrl / HF "
                              "sequence-classification reward model. Train one with `python -m chatrl.step2_reward`.")


# 12 ----------------------------------------------------------------------------------------------
def test_incompatible_actor_and_reward_tokenizers_name_both_folders(gpt2, stories_tok):
    from chatrl.step3_ppo.engine import check_tokenizers_compatible

    actor, reward = str(TOKENIZERS / "gpt2"), str(STORIES)
    check_tokenizers_compatible(gpt2, gpt2, actor, actor)  # same tokenizer: fine
    with pytest.raises(ValueError) as err:
        check_tokenizers_compatible(gpt2, stories_tok, actor, reward)
    assert str(err.value).startswith(f"actor tokenizer ({actor}) and reward tokenizer ({reward}) differ "
                                     "(vocabulary or EOS)")


# 13 ----------------------------------------------------------------------------------------------
def test_bad_data_split_is_named_before_any_data_is_read(gpt2, tmp_path):
    missing = str(tmp_path / "never_read.jsonl")  # the flag is checked first
    cases = {"2,4": "--data_split needs three comma-separated weights (phase 1,2,3), got '2,4'",
             "a,b,c": "--data_split weights must be numbers, got 'a,b,c'",
             "1,-1,1": "--data_split weights must be finite and >= 0, got '1,-1,1'",
             "0,0,0": "--data_split weights must not all be zero, got '0,0,0'"}
    for value, message in cases.items():
        with pytest.raises(ValueError) as err:
            build_phase_data(2, DataConfig([missing], data_split=value,
                                           data_output_path=str(tmp_path / "cache")), gpt2)
        assert str(err.value) == message


# 14 ----------------------------------------------------------------------------------------------
def test_lora_module_name_matching_nothing_names_flag_value_and_model(stories_tok):
    model = load_causal_lm(str(STORIES), stories_tok)
    with pytest.raises(ValueError) as err:  # an OPT module name on a Llama model
        apply_lora(model, LoraConfig(lora_dim=4, lora_module_name="decoder.layers."))
    assert str(err.value) == "--lora_module_name 'decoder.layers.' matches no nn.Linear in LlamaForCausalLM"
    assert apply_lora(model, LoraConfig(lora_dim=0, lora_module_name="decoder.layers.")) is model  # LoRA off: unused


# 15 ----------------------------------------------------------------------------------------------
def test_unknown_dtype_and_zero_stage_name_the_flag(capsys):
    batch = BatchSizes(2, 1, 1)
    with pytest.raises(ValueError) as err:
        dist.deepspeed_config(batch, dtype="fp8")
    assert str(err.value) == "--dtype must be fp32, bf16 or fp16, got 'fp8'"
    with pytest.raises(ValueError) as err:
        dist.deepspeed_config(batch, zero_stage=5)
    assert str(err.value) == "--zero_stage must be 0, 1, 2 or 3, got 5"
    with pytest.raises(ValueError) as err:
        torch_dtype("fp8")
    assert str(err.value) == "--dtype must be one of ['bf16', 'fp16', 'fp32'], got 'fp8'"
    from chatrl.step1_sft.main import build_parser

    parser = build_parser()
    for argv, flag in ((["--dtype", "fp8"], "--dtype"), (["--zero-stage", "5"], "--zero_stage")):
        with pytest.raises(SystemExit) as exit_:
            parse(parser, ["--model_name_or_path", "m", "--data_path", "d", "--output_dir", "o", *argv])
        assert exit_.value.code == 2
        assert f"argument {flag}: invalid choice" in capsys.readouterr().err


# 16 ----------------------------------------------------------------------------------------------
def test_model_path_that_does_not_exist_is_named(stories_tok, tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(str(missing))
    assert str(err.value).startswith(f"model/tokenizer path not found: {missing} is not a local folder, "
                                     "and loading it as a hub name failed (")
    with pytest.raises(FileNotFoundError) as err:
        load_causal_lm(str(missing), stories_tok)
    assert str(err.value).startswith(f"model path not found: {missing} is not a local folder")
    (tmp_path / "empty_model").mkdir()
    with pytest.raises(OSError) as err:
        load_tokenizer(str(tmp_path / "empty_model"))
    assert str(err.value).startswith(f"{tmp_path / 'empty_model'} holds no tokenizer files: none of tokenizer.json")


def test_model_folder_without_tokenizer_files_names_them(tmp_path):
    """A model folder (config and weights) without its tokenizer said "You need to have sentencepiece or
    tiktoken installed" (both were installed); the message names the files looked for and found."""
    import shutil

    from chatrl.errors import UsageError

    folder = tmp_path / "weights_only"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(STORIES / name, folder / name)
    with pytest.raises(UsageError) as err:
        load_tokenizer(str(folder))
    assert isinstance(err.value, FileNotFoundError)
    assert str(err.value) == (
        f"{folder} holds no tokenizer files: none of tokenizer.json (fast tokenizer), tokenizer.model (SentencePiece), "
        "spiece.model (SentencePiece), vocab.json with merges.txt (BPE), vocab.txt (WordPiece), tiktoken.model; "
        "it holds config.json, generation_config.json, model.safetensors. Copy the tokenizer files of the model it "
        "was made from into it (with tokenizer_config.json and special_tokens_map.json when there are any), or give "
        "that model's folder")
    shutil.copy(TOKENIZERS / "gpt2" / "vocab.json", folder / "vocab.json")
    with pytest.raises(UsageError, match=r"\(vocab.json is there, merges.txt is not\)"):
        load_tokenizer(str(folder))
    shutil.copy(TOKENIZERS / "gpt2" / "merges.txt", folder / "merges.txt")
    shutil.copy(TOKENIZERS / "gpt2" / "tokenizer_config.json", folder / "tokenizer_config.json")
    assert load_tokenizer(str(folder)).eos_token_id == 50256


# 17 ----------------------------------------------------------------------------------------------
def test_unusable_source_is_named_among_good_ones(gpt2, tmp_path):
    good = write_lines(tmp_path / "good.jsonl", [pair(i) for i in range(3)])
    bad = write_lines(tmp_path / "bad.jsonl", [b'{"prompt": ', b'{"prompt": "\xff", "chosen": "a", "rejected": "b"}',
                                               {"prompt": 3, "chosen": "a", "rejected": "b"}])
    with pytest.raises(ValueError) as err:
        phase(1, [good, bad], gpt2)
    assert str(err.value) == (f"{bad!r}: no usable rows ({bad}: 3 rows, 0 used, skipped 1 malformed_json, "
                              "1 non_utf8, 1 wrong_type)")
    long = write_lines(tmp_path / "long_answers.jsonl", [{"prompt": "Hi?", "chosen": "word " * 40, "rejected": "No."}])
    with pytest.raises(ValueError) as err:
        phase(1, [good, long], gpt2, max_seq_len=16)
    assert str(err.value) == f"{long!r}: no usable rows for phase 1 ({long}: 1 rows, 0 used, skipped 1 too_long)"


# 20 ----------------------------------------------------------------------------------------------
def test_length_budget_beyond_the_context_window_is_named_at_start_up(tmp_path, capsys):
    """Every length flag of every step, chat and the scoring tool, before any loading."""
    import importlib.util

    from chatrl.models.tiny import TinySpec, make_tiny_model
    from chatrl.step1_sft.main import main as step1
    from chatrl.step2_reward.main import main as step2
    from chatrl.step2_reward.score import main as score
    from chatrl.step3_ppo.main import main as step3
    from tests.conftest import REPO

    opt = tmp_path / "opt64"
    make_tiny_model("opt", opt, TinySpec(hidden=32, layers=1, heads=2, ffn=64, max_positions=64))
    common = ["--data_path", str(tmp_path / "never_read.jsonl"), "--output_dir", str(tmp_path / "out")]
    (tmp_path / "never_read.jsonl").write_text("{}\n")
    for main in (step1, step2):
        with pytest.raises(ValueError) as err:
            main(["--model_name_or_path", str(opt), "--max_seq_len", "128", *common])
        assert str(err.value) == (f"--max_seq_len 128 exceeds the context window of {opt} (64 positions, "
                                  "its config's max_position_embeddings); lower --max_seq_len")
    with pytest.raises(ValueError) as err:
        step3(["--actor_model_name_or_path", str(STORIES), "--critic_model_name_or_path", str(opt),
               "--max_prompt_seq_len", "32", "--max_answer_seq_len", "48", *common])
    assert str(err.value).startswith(f"--max_prompt_seq_len + --max_answer_seq_len 80 exceeds the context window "
                                     f"of {opt} (64 positions")
    with pytest.raises(SystemExit):
        score(["--model", str(opt), "--prompt", "Hi", "--chosen", "Yes", "--max_seq_len", "65"])
    assert "--max_seq_len 65 exceeds the context window" in capsys.readouterr().err
    spec = importlib.util.spec_from_file_location("_chatrl_chat_18", REPO / "chat.py")
    chat = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = chat  # chat.py declares a dataclass block, which needs its module registered
    spec.loader.exec_module(chat)
    with pytest.raises(SystemExit):
        chat.main(["--path", str(opt), "--max_new_tokens", "64"])
    assert "--max_new_tokens + 1 prompt token 65 exceeds the context window" in capsys.readouterr().err


# 21 ----------------------------------------------------------------------------------------------
def test_empty_eval_split_is_cached_like_the_uncached_build_and_training_proceeds(stories_tok, tmp_path, caplog):
    """Both held-out rows too long → an empty eval split; the cache used to keep an
    entry that failed every rerun with IndexError."""
    import logging

    from tests.conftest import DATA
    from tests.launch import run_ranks

    entry = str(DATA / "hh-rlhf" / "helpful-base") + "[0:32]"
    kw = dict(data_split="1,0,0", max_seq_len=128)
    plain = build_phase_data(1, DataConfig([entry], data_output_path=None, **kw), stories_tok)
    assert (len(plain.train), len(plain.eval)) == (19, 0)
    for _ in range(2):  # the build that writes the entry, then a rerun that reads it
        with caplog.at_level(logging.WARNING, logger="chatrl.data.pipeline"):
            cached = build_phase_data(1, DataConfig([entry], data_output_path=str(tmp_path / "cache"), **kw),
                                      stories_tok)
        assert (len(cached.train), len(cached.eval)) == (19, 0)
        assert [x["input_ids"].tolist() for x in cached.train] == [x["input_ids"].tolist() for x in plain.train]
        assert "the eval split is empty" in caplog.text and "training proceeds without evaluation" in caplog.text
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []
    proc = run_ranks(["-m", "chatrl.step1_sft", "--model_name_or_path", str(STORIES), "--data_path", entry,
                      "--data_split", "1,0,0", "--max_seq_len", "128", "--max_steps", "1",
                      "--data_output_path", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "out"),
                      "--disable_progress_bar"], nprocs=1, timeout=300)
    assert "training proceeds without evaluation" in proc.stdout + proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1]
    assert not [k for r in rows for k in r if k.startswith("eval/")]  # nothing evaluated on 0 rows


@pytest.mark.parametrize("program", ["chatrl.step2_reward", "chatrl.step2_dpo"])
def test_a_three_row_data_set_for_step_2_trains_without_evaluating_on_0_pairs(tmp_path, program):
    """3 pairs under the default --data_split 2,4,4: step 2's part is 1 pair and none is held out. Step 2
    says once that it trains without
    evaluation, and then does: no evaluation on 0 pairs, no NaN accuracy, no NaN alert; DPO likewise. (It used to
    print "eval before training: accuracy nan … (0 pairs)", log eval/accuracy NaN at steps 0 and 1,
    fire the nonfinite alert and exit 0.)"""
    from tests.launch import run_ranks

    data = write_lines(tmp_path / "pairs.jsonl", [pair(i) for i in range(3)])
    proc = run_ranks(["-m", program, "--model_name_or_path", str(STORIES), "--data_path", data,
                      "--data_output_path", str(tmp_path / "cache"), "--max_seq_len", "64", "--per_device_train_batch_size", "2",
                      "--max_steps", "1", "--output_dir", str(tmp_path / "out"), "--disable_progress_bar"],
                     nprocs=1, timeout=300)
    text = proc.stdout + proc.stderr
    assert text.count("training proceeds without evaluation") == 1, text[-3000:]
    assert "eval before training" not in text and "nan" not in text.lower() and "nonfinite" not in text, text[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1]
    assert not [k for r in rows for k in r if k.startswith(("eval/", "alert/"))]
    assert all(math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    marker = json.loads((tmp_path / "out" / "chatrl_run.json").read_text())
    assert marker["metrics"] == {} and marker["initial_metrics"] == {}


# 22 ----------------------------------------------------------------------------------------------
def test_sampling_flags_temperature_0_is_greedy_and_bad_values_fail_before_loading(tmp_path):
    """Step 3 used to fail after loading all four models."""
    from chatrl.errors import UsageError
    from chatrl.models.causal_lm import sampling_settings
    from chatrl.step3_ppo.main import main as step3

    assert sampling_settings(0.0, 50, 0.9) == {"do_sample": False}
    missing = str(tmp_path / "no_such_model")  # never read: the flags are checked first
    for flag, value, message in (("--temperature", "-1", "--temperature must be >= 0 (0: greedy decoding), got -1.0"),
                                 ("--top_p", "0", "--top_p must be in (0, 1] (1: no nucleus filter), got 0.0"),
                                 ("--top_k", "-2", "--top_k must be >= 0 (0: no top-k filter), got -2")):
        with pytest.raises(UsageError) as err:
            step3(["--actor_model_name_or_path", missing, "--critic_model_name_or_path", missing, "--data_path",
                   str(tmp_path), "--output_dir", str(tmp_path / "out"), flag, value])
        assert str(err.value) == message


# 23 ----------------------------------------------------------------------------------------------
def test_resume_layout_is_recorded_and_another_is_refused(tmp_path):
    """The check LoopCheckpoints.resume runs before loading anything (the 2-rank → 1-rank
    run is tests/stages/test_resume.py::test_resume_with_another_world_size_is_refused_naming_both_layouts)."""
    import json

    from chatrl.checkpoint import check_resume_layout
    from chatrl.errors import UsageError

    saved = BatchSizes(2, 1, 2).layout()
    assert saved == {"world_size": 2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}
    (tmp_path / "complete.json").write_text(json.dumps({"step": 2, "layout": saved}))
    check_resume_layout(tmp_path, BatchSizes(2, 1, 2).layout())
    for world, accum in ((1, 1), (2, 2)):
        with pytest.raises(UsageError, match="it was written with world_size 2, per_device_train_batch_size 2"):
            check_resume_layout(tmp_path, BatchSizes(2, accum, world).layout())
    (tmp_path / "complete.json").write_text(json.dumps({"step": 2}))  # an older checkpoint: accepted
    check_resume_layout(tmp_path, BatchSizes(2, 1, 1).layout())
