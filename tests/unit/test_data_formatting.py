"""Prompt/answer formatting and encoding: chatrl.data.formatting."""

from __future__ import annotations

import gzip
import json

import pytest

from chatrl.data import encode_answer, encode_prompt, format_answer, format_prompt
from chatrl.data.sources import read_source
from chatrl.models import load_tokenizer
from tests.conftest import DATA, STORIES, TOKENIZERS

HELPFUL = DATA / "hh-rlhf" / "helpful-base"
USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer(str(TOKENIZERS / "gpt2"))


@pytest.fixture(scope="module")
def qwen2():
    return load_tokenizer(str(TOKENIZERS / "qwen2"))


def test_human_assistant_convention(gpt2):
    msgs = ({"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"})
    assert format_prompt(gpt2, msgs) == "Be kind.\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: Bye\n\nAssistant:"
    assert format_prompt(gpt2, [USER]) == "\n\nHuman: hi\n\nAssistant:"
    assert format_answer(gpt2, "  Hello there \n") == " Hello there"
    with pytest.raises(ValueError, match="must end with a user turn"):
        format_prompt(gpt2, msgs[:3])
    with pytest.raises(ValueError, match="at least one message"):
        format_prompt(gpt2, [])


def test_hh_transcripts_round_trip_byte_for_byte(gpt2):
    with gzip.open(HELPFUL / "test.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    src = read_source(str(HELPFUL))
    sample, row = src.samples[1], rows[src.sample_rows[1]]  # multi-turn
    assert len(sample.messages) == 5
    prompt = format_prompt(gpt2, sample.messages)
    assert prompt + format_answer(gpt2, sample.chosen) == row["chosen"]
    assert prompt + format_answer(gpt2, sample.rejected) == row["rejected"]
    # every row of the file, the ones with empty answers included
    for s, r in zip(src.samples, src.sample_rows, strict=True):
        p = format_prompt(gpt2, s.messages)
        assert (p + format_answer(gpt2, s.chosen), p + format_answer(gpt2, s.rejected)) == \
            (rows[r]["chosen"], rows[r]["rejected"])


def test_chat_template_is_used_when_present(qwen2):
    assert format_prompt(qwen2, [USER]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert format_answer(qwen2, " Hello ") == "Hello"
    ids = encode_prompt(qwen2, [USER])
    assert ids == qwen2("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    assert ids[0] == qwen2.convert_tokens_to_ids("<|im_start|>")


def test_encode_answer_ends_with_exactly_one_eos(gpt2):
    eos = gpt2.eos_token_id
    assert eos == 50256
    assert encode_answer(gpt2, "Hello") == [18435, eos]  # " Hello" + EOS
    assert encode_answer(gpt2, "Hello<|endoftext|>") == [18435, eos]
    assert encode_prompt(gpt2, [USER]) == gpt2("\n\nHuman: hi\n\nAssistant:").input_ids


def test_llama_tokenizer_bos_on_prompt_only():
    tok = load_tokenizer(str(STORIES))
    prompt = encode_prompt(tok, [USER])
    answer = encode_answer(tok, "Yes.")
    assert prompt[0] == tok.bos_token_id == 1
    assert tok.bos_token_id not in prompt[1:]
    assert answer[-1] == tok.eos_token_id == 2 and answer.count(2) == 1
    assert tok.bos_token_id not in answer
    assert tok.pad_token_id not in prompt + answer
