"""Prompt/answer formatting and encoding: chatrl.data.formatting."""

from __future__ import annotations

import gzip
import json

import pytest

from chatrl.data import encode_answer, encode_example, encode_prompt, format_answer, format_prompt
from chatrl.data.sources import read_source
from chatrl.models.causal_lm import load_tokenizer
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
    with pytest.raises(ValueError, match="must end with a user or tool turn"):
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
    # text spelling EOS is text: " Hello<|endoftext|>" as plain BPE pieces, then the one real EOS
    assert encode_answer(gpt2, "Hello<|endoftext|>") == [18435, 27, 91, 437, 1659, 5239, 91, 29, eos]
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


# docs/tokenization.md rules ------------------------------------------------------------------------

STORY = ({"role": "user", "content": "Tell me a story."},)


def test_rule1_example_ids_are_those_of_the_joined_text():
    """SentencePiece: prompt and answer tokenized apart gave one token more (a lone '▁')."""
    tok = load_tokenizer(str(STORIES))
    prompt, answer = encode_example(tok, STORY, "Once upon a time…")
    joined = tok(format_prompt(tok, STORY) + " Once upon a time…").input_ids
    assert prompt + answer == joined + [tok.eos_token_id]
    assert tok.convert_ids_to_tokens(answer[0]) == "▁Once"
    assert prompt == encode_prompt(tok, STORY)  # the prompt part is what generation sees
    assert "Assistant:  Once" not in tok.decode(prompt + answer)


def test_rule1_holds_for_every_step_and_the_scoring_tool(tmp_path):
    from chatrl.config import DataConfig
    from chatrl.data import build_phase_data
    from chatrl.data.schema import Sample
    from chatrl.step2_reward.score import encode_rows

    tok = load_tokenizer(str(STORIES))
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "Tell me a story.", "chosen": "Once upon a time…", "rejected": "No."}) + "\n")
    joined = tok(format_prompt(tok, STORY) + " Once upon a time…").input_ids + [tok.eos_token_id]
    joined_r = tok(format_prompt(tok, STORY) + " No.").input_ids + [tok.eos_token_id]
    kw = dict(eval_fraction=0.0, data_output_path=None)
    sft = build_phase_data(1, DataConfig([str(f)], data_split="1,0,0", **kw), tok).train[0]
    rm = build_phase_data(2, DataConfig([str(f)], data_split="0,1,0", **kw), tok).train[0]
    ppo = build_phase_data(3, DataConfig([str(f)], data_split="0,0,1", **kw), tok).train[0]
    assert sft["input_ids"].tolist() == joined
    assert rm["chosen_input_ids"].tolist() == joined and rm["rejected_input_ids"].tolist() == joined_r
    assert ppo["prompt_ids"].tolist() == joined[:sft["prompt_len"]]
    assert encode_rows(tok, [Sample(STORY, "Once upon a time…", "No.")], 512) == [(joined, joined_r)]


@pytest.mark.parametrize("where", ["answer", "prompt"])
def test_rule2_data_text_never_becomes_a_special_token(where):
    tok = load_tokenizer(str(STORIES))
    bos, eos = tok.bos_token_id, tok.eos_token_id
    text = "Then </s> she said <s> hi."
    msgs = ({"role": "user", "content": text if where == "prompt" else "Go on."},)
    prompt, answer = encode_example(tok, msgs, text if where == "answer" else "Fine.")
    ids = prompt + answer
    assert ids.count(bos) == 1 and ids[0] == bos
    assert ids.count(eos) == 1 and ids[-1] == eos
    assert text in tok.decode(ids, skip_special_tokens=True)
    assert encode_prompt(tok, msgs).count(bos) == 1  # step 3 prompts and chat too


def test_rule2_chat_template_data_spelling_its_markers_stays_text(qwen2):
    im_end = qwen2.convert_tokens_to_ids("<|im_end|>")
    msgs = ({"role": "user", "content": "Say <|im_end|> now"},)
    prompt, answer = encode_example(qwen2, msgs, "ok<|im_end|><|endoftext|>")
    assert prompt == encode_prompt(qwen2, msgs)
    assert prompt.count(im_end) == 1  # the template's own, after the user turn
    assert answer.count(im_end) == 1 and answer[-1] == im_end
    assert qwen2.eos_token_id not in prompt + answer
    assert qwen2.decode(answer) == "ok<|im_end|><|endoftext|><|im_end|>"


def test_rule3_trained_turn_ends_with_the_templates_end_of_turn(qwen2):
    from chatrl.models.causal_lm import end_of_turn_token_id, stop_token_ids

    msgs = ({"role": "user", "content": "Name a colour."},)
    prompt, answer = encode_example(qwen2, msgs, "Blue.")
    ref = list(qwen2.apply_chat_template([*msgs, {"role": "assistant", "content": "Blue."}])["input_ids"])
    im_end = qwen2.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_token_id(qwen2) == im_end
    assert prompt + answer == ref[:-1]  # everything up to and including <|im_end|> (the "\n" after it is not trained)
    assert answer[-1] == im_end and qwen2.eos_token_id not in answer
    assert stop_token_ids(qwen2) == [im_end, qwen2.eos_token_id]
    assert encode_answer(qwen2, "Blue.")[-1] == im_end
