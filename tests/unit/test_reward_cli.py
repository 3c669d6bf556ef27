"""Step 2's program helpers and the scoring entry point, on a tiny saved reward model."""

from __future__ import annotations

import io
import json

import pytest
import torch

from chatrl.distributed.dist import shard_for_eval
from chatrl.step2_reward.main import build_parser, split_pairs
from chatrl.step2_reward.score import encode_rows, prompt_messages


def test_shard_for_eval_covers_rows_once_and_pads_equal():
    shards = [shard_for_eval(5, r, 2) for r in range(2)]
    assert shards == [[0, 2, 4], [1, 3, -1]]
    assert sorted(i for s in shards for i in s if i >= 0) == list(range(5))


def test_split_pairs_chosen_first():
    c, r = split_pairs(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert c.tolist() == [1.0, 2.0] and r.tolist() == [3.0, 4.0]


def test_parser_accepts_deepspeed_chat_flags_and_dashes():
    from chatrl.cli import parse

    args = parse(build_parser(), ["--model-name-or-path", "m", "--data_path", "d", "--output_dir", "o",
                                  "--num_padding_at_beginning", "1", "--eval_interval", "5", "--eval-iters", "3",
                                  "--zero_stage", "3", "--lora_dim", "8", "--disable_dropout"])
    assert (args.model_name_or_path, args.eval_interval, args.eval_iters, args.zero_stage, args.lora_dim) == \
        ("m", 5, 3, 3, 8)
    assert args.num_padding_at_beginning == 1 and args.disable_dropout


def test_prompt_messages_plain_and_transcript():
    assert prompt_messages("Hi there ") == ({"role": "user", "content": "Hi there"},)
    msgs = prompt_messages("\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant:")
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[-1]["content"] == "c"


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory, tiny_opt):
    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, save_reward_model

    tok = load_tokenizer(str(tiny_opt))
    rm = load_reward_model(str(tiny_opt), tok, require_head=False)
    torch.manual_seed(1)
    with torch.no_grad():
        rm.hf.score.weight.normal_(0.0, 1.0)
    out = tmp_path_factory.mktemp("score") / "rm"
    save_reward_model(rm, tok, out)
    return out, tok, rm.eval()


def test_encode_rows_cuts_prompt_from_left_and_skips_too_long(reward_dir):
    from chatrl.data import Sample, encode_answer, encode_prompt

    _, tok, _ = reward_dir
    s = Sample(({"role": "user", "content": "one two three four five six seven eight"},), "yes", "no")
    p, c = encode_prompt(tok, s.messages), encode_answer(tok, "yes")
    (chosen, rejected), = encode_rows(tok, [s], max_seq_len=len(c) + 3)
    assert chosen == p[-3:] + c  # the prompt's last 3 tokens survive, the answer keeps its EOS
    assert rejected[:3] == p[-3:] and rejected[-1] == tok.eos_token_id
    assert encode_rows(tok, [s], max_seq_len=len(c)) == [None]  # no room for one prompt token


def test_score_cli_prints_the_models_scores(reward_dir):
    from chatrl.data import encode_answer, encode_prompt
    from chatrl.step2_reward.score import main

    out_dir, tok, rm = reward_dir
    buf = io.StringIO()
    summary = main(["--model", str(out_dir), "--prompt", "How do I boil an egg?",
                    "--chosen", "Put it in boiling water for eight minutes.", "--rejected", "No."], out=buf)
    row, last = [json.loads(line) for line in buf.getvalue().splitlines()]
    p = encode_prompt(tok, ({"role": "user", "content": "How do I boil an egg?"},))
    with torch.no_grad():
        expect = [rm(torch.tensor([p + encode_answer(tok, a)]), torch.ones(1, len(p) + len(encode_answer(tok, a)),
                                                                         dtype=torch.long)).end_scores.item()
                  for a in ("Put it in boiling water for eight minutes.", "No.")]
    assert row["chosen"] == pytest.approx(expect[0], abs=1e-5)
    assert row["rejected"] == pytest.approx(expect[1], abs=1e-5)
    assert row["margin"] == pytest.approx(expect[0] - expect[1], abs=1e-5)
    assert summary == last and summary["pairs"] == 1 and summary["skipped"] == 0
    assert summary["accuracy"] == float(expect[0] > expect[1])


def test_score_cli_needs_pairs_or_prompt_and_chosen(reward_dir):
    from chatrl.step2_reward.score import main

    with pytest.raises(SystemExit):
        main(["--model", str(reward_dir[0]), "--prompt", "hi"], out=io.StringIO())


def test_score_cli_refuses_a_causal_lm_folder(tiny_opt):
    from chatrl.models.reward_model import MissingRewardHeadError
    from chatrl.step2_reward.score import main

    with pytest.raises(MissingRewardHeadError):
        main(["--model", str(tiny_opt), "--prompt", "hi", "--chosen", "hello"], out=io.StringIO())


def test_score_cli_indexes_rows_by_file_position_and_counts_skips(reward_dir, tmp_path):
    """The second row is "index": 1 and the empty chosen row is counted as empty_field."""
    from chatrl.step2_reward.score import main

    f = tmp_path / "two.jsonl"
    f.write_text(json.dumps({"prompt": "Give an example.", "chosen": "", "rejected": "No."}) + "\n"
                 + json.dumps({"prompt": "Name a color.", "chosen": "Blue.", "rejected": "Dog."}) + "\n")
    buf = io.StringIO()
    summary = main(["--model", str(reward_dir[0]), "--pairs", str(f)], out=buf)
    row, last = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert row["index"] == 1
    assert summary == last and summary["pairs"] == 1
    assert summary["skipped"] == 1 and summary["skip_reasons"] == {"empty_field": 1}


def test_unknown_schema_prints_the_message_alone(reward_dir, tmp_path):
    """A usage error is one line, no traceback (scoring tool and step 2)."""
    from tests.launch import run_ranks

    f = tmp_path / "qa.jsonl"
    f.write_text(json.dumps({"question": "Why?", "answer": "Because."}) + "\n")
    message = f"{f}: unknown data schema; saw keys ['answer', 'question']"
    score = run_ranks(["-m", "chatrl.step2_reward.score", "--model", str(reward_dir[0]), "--pairs", str(f)],
                      nprocs=1, check=False, timeout=300)
    step2 = run_ranks(["-m", "chatrl.step2_reward", "--model_name_or_path", str(reward_dir[0]), "--data_path", str(f),
                       "--data_output_path", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "out")],
                      nprocs=1, check=False, timeout=300)
    for proc in (score, step2):
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert message in proc.stderr
        assert "Traceback" not in proc.stderr
