"""Reading entries and adapting schemas: chatrl.data.sources / schema / report."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chatrl.data import Sample, SkipReport, load_samples
from chatrl.data.sources import read_source, split_entry
from tests.conftest import DATA

HELPFUL = DATA / "hh-rlhf" / "helpful-base"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


GOOD = [{"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"},
        {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Seven."}]


# --- bad rows ------------------------------------------------------------------------------------

BAD_LINES = {
    "malformed_json": b'{"prompt": "x", "chosen": "a", ',
    "non_utf8": b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}',
    "missing_field": json.dumps({"prompt": "x", "chosen": "a"}).encode(),
    "empty_field": json.dumps({"prompt": "   ", "chosen": "a", "rejected": "b"}).encode(),
    "wrong_type": json.dumps({"prompt": 3, "chosen": "a", "rejected": "b"}).encode(),
    "identical_pair": json.dumps({"prompt": "x", "chosen": " same ", "rejected": "same"}).encode(),
}


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_each_bad_row_kind_is_skipped_and_counted(tmp_path, reason):
    path = tmp_path / f"{reason}.jsonl"
    lines = [json.dumps(GOOD[0]).encode(), BAD_LINES[reason], json.dumps(GOOD[1]).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")
    report = SkipReport()
    samples = load_samples(str(path), report=report)
    assert [s.chosen for s in samples] == ["4", "Blue."]
    assert report.skipped(str(path)) == {reason: 1}
    counts = report.counts(str(path))
    assert (counts.rows, counts.used) == (3, 2)
    assert report.summary() == f"{path}: 3 rows, 2 used, skipped 1 {reason}."


def test_all_bad_source_names_file_and_reasons(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(BAD_LINES["malformed_json"] + b"\n" + BAD_LINES["wrong_type"] + b"\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl.*no usable rows.*1 malformed_json, 1 wrong_type"):
        load_samples(str(path))


def test_missing_empty_and_unknown_schema_errors(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_samples(str(missing))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_samples(str(missing) + "[0:10]")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.jsonl: empty"):
        load_samples(str(empty))
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ValueError, match=r"odd\.jsonl: unknown data schema; saw keys \['answer', 'question'\]"):
        load_samples(odd)
    with pytest.raises(ValueError, match="unsupported file type"):
        (tmp_path / "notes.txt").write_text("hi")
        load_samples(str(tmp_path / "notes.txt"))


def test_hub_name_offline_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="'Dahoas/rm-static' is neither a local file"):
        load_samples("Dahoas/rm-static")


# --- formats, folders, slices ----------------------------------------------------------------------


def test_file_formats_read_the_same_rows(tmp_path):
    rows = GOOD
    expected = [Sample(({"role": "user", "content": "What is 2+2?"},), "4", "5"),
                Sample(({"role": "user", "content": "Name a colour."},), "Blue.", "Seven.")]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "b.json").write_text(json.dumps({"data": rows}))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "e.parquet.gz").write_bytes(gzip.compress((tmp_path / "d.parquet").read_bytes()))
    for name in ("a.json", "b.json", "c.jsonl.gz", "d.parquet", "e.parquet.gz"):
        assert load_samples(str(tmp_path / name)) == expected, name
    # a folder is every data file inside, sorted: 5 files × 2 rows
    assert len(load_samples(str(tmp_path))) == 10


def test_row_slice_is_over_file_order_rows(tmp_path):
    rows = [{"prompt": f"q{i}", "chosen": f"a{i}", "rejected": f"b{i}"} for i in range(6)]
    write_jsonl(tmp_path / "1.jsonl", rows[:3])
    write_jsonl(tmp_path / "2.jsonl", rows[3:])
    assert split_entry(f"{tmp_path}[2:5]") == (str(tmp_path), slice(2, 5, None))
    assert [s.chosen for s in load_samples(f"{tmp_path}[2:5]")] == ["a2", "a3", "a4"]
    assert [s.chosen for s in load_samples(f"{tmp_path}[-2:]")] == ["a4", "a5"]
    with pytest.raises(ValueError, match="selects no rows"):
        load_samples(f"{tmp_path}[10:20]")
    report = SkipReport()
    load_samples(f"{HELPFUL}[0:1000]", report=report)
    assert report.describe(f"{HELPFUL}[0:1000]").endswith("1000 rows, 999 used, skipped 1 identical_pair")


# --- schemas ---------------------------------------------------------------------------------------


def test_hh_real_multiturn_row_parses():
    with gzip.open(HELPFUL / "test.jsonl.gz", "rt") as f:
        f.readline()
        row = json.loads(f.readline())  # the second row: a three-turn conversation about butterflies
    src = read_source(str(HELPFUL))
    sample = src.samples[1]
    assert [m["role"] for m in sample.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert sample.messages[0]["content"] == "How can I find out what types of butterflies are in my area?"
    assert sample.messages[1]["content"] == "Which location are you in?"
    assert sample.messages[2]["content"] == "I am in Oregon."
    assert row["chosen"].endswith("\n\nAssistant: " + sample.chosen)
    assert row["rejected"].endswith("\n\nAssistant: " + sample.rejected)


def test_hh_prompts_that_differ_use_common_prefix(tmp_path):
    row = {"chosen": "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: d",
           "rejected": "\n\nHuman: a\n\nAssistant: x"}
    [s] = load_samples(write_jsonl(tmp_path / "hh.jsonl", [row]))
    assert s == Sample(({"role": "user", "content": "a"},), "b\n\nHuman: c\n\nAssistant: d", "x")


def test_hh_empty_rejected_is_kept_empty_chosen_skipped(tmp_path):
    rows = [{"chosen": "\n\nHuman: hi\n\nAssistant: hello", "rejected": "\n\nHuman: hi\n\nAssistant: "},
            {"chosen": "\n\nHuman: hi\n\nAssistant: ", "rejected": "\n\nHuman: hi\n\nAssistant: hello"}]
    report = SkipReport()
    path = write_jsonl(tmp_path / "hh.jsonl", rows)
    assert load_samples(path, report=report) == [Sample(({"role": "user", "content": "hi"},), "hello", "")]
    assert report.skipped(path) == {"empty_field": 1}


def test_prompt_chosen_rejected_schemas(tmp_path):
    dahoas = {"prompt": "\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Tell a joke\n\nAssistant:",
              "response": " r", "chosen": " A joke.", "rejected": " No."}
    [s] = load_samples(write_jsonl(tmp_path / "d.jsonl", [dahoas]))
    assert s == Sample(({"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                        {"role": "user", "content": "Tell a joke"}), "A joke.", "No.")
    src = read_source(write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Say hi", "response": " hi "}]))
    assert (src.kind, src.schemas) == ("sft", {str(tmp_path / "sft.jsonl"): "pairs"})
    assert src.samples == [Sample(({"role": "user", "content": "Say hi"},), "hi", None)]


def test_alpaca_sharegpt_prompts_oasst_from_shared_data():
    alpaca = read_source(str(DATA / "alpaca-instructions" / "instruction-data.json"))
    assert alpaca.kind == "sft"
    assert alpaca.samples[0] == Sample(
        ({"role": "user", "content": "Evaluate the following phrase by transforming it into the spelling given."
                                     "\n\nfreind --> friend"},),
        'The spelling of the given phrase "freind" is incorrect, the correct spelling is "friend".')
    assert alpaca.samples[2].messages[0]["content"] == "Convert 45 kilometers to meters."  # empty input
    sharegpt = read_source(str(DATA / "sharegpt-dpo"))
    assert sharegpt.kind == "pairs"
    assert sharegpt.samples[0].chosen.startswith("That sounds like a fun and engaging idea!")
    assert sharegpt.samples[0].rejected.startswith("Hello! I'd be happy to help you")
    prompts = read_source(str(DATA / "prompts"))
    assert prompts.kind == "prompts"
    assert prompts.samples[0] == Sample(({"role": "user", "content": "Can you tell me about GLaDOS?"},))
    oasst = read_source(str(DATA / "oasst"))
    assert oasst.kind == "pairs"
    first = oasst.samples[0]
    assert first.messages == ({"role": "user", "content": "How can I find the best 401k plan for my needs?"},)
    assert first.chosen.startswith("The first step is to research your options.")
    assert first.rejected.startswith("The first step is to determine your financial goals.")


def test_sharegpt_sft_and_prompt_only_variants(tmp_path):
    conv = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                              {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Bye"},
                              {"from": "gpt", "value": "Goodbye."}]}
    src = read_source(write_jsonl(tmp_path / "sg.jsonl", [conv]))
    assert src.kind == "sft"
    assert src.samples == [Sample(({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}),
                                  "Goodbye.", conversation=True)]
    path = tmp_path / "p.jsonl"
    path.write_text('"First prompt"\n{"text": "Second prompt"}\n""\n')
    report = SkipReport()
    got = load_samples(str(path), report=report)
    assert [s.messages[0]["content"] for s in got] == ["First prompt", "Second prompt"]
    assert all(s.chosen is None and s.rejected is None for s in got)
    assert report.skipped(str(path)) == {"empty_field": 1}


@pytest.mark.parametrize("folder, rows, used, skipped", [
    ("hh-rlhf/helpful-base", 2354, 2352, {"identical_pair": 2}),
    ("hh-rlhf/harmless-base", 2312, 2308, {"empty_field": 4}),
    ("alpaca-instructions", 1100, 1100, {}),
    ("sharegpt-dpo", 300, 300, {}),
    ("prompts", 250, 250, {}),
    ("oasst", 100, 212, {}),
])
def test_shared_data_loads_with_counts(folder, rows, used, skipped):
    report = SkipReport()
    entry = str(DATA / folder)
    assert len(load_samples(entry, report=report)) == used
    counts = report.counts(entry)
    assert (counts.rows, counts.used, dict(counts.skipped)) == (rows, used, skipped)


def test_report_summary_paragraph():
    report = SkipReport()
    report.add_rows("helpful-base", 2354)
    report.use("helpful-base", 2352)
    report.skip("helpful-base", "identical_pair", 2)
    report.add_rows("prompts", 10)
    report.use("prompts", 10)
    report.truncate("prompts", 3)
    assert report.summary() == ("helpful-base: 2354 rows, 2352 used, skipped 2 identical_pair; "
                                "prompts: 10 rows, 10 used, truncated 3.")
    assert SkipReport.from_dict(report.to_dict()).summary() == report.summary()
