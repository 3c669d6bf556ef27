"""Multi-turn data: conversations laid out turn by turn (chatrl.data.turns), every assistant turn
trained in step 1 (--train_all_assistant_turns) on the ShareGPT and Open-Assistant data of
../shared with user, system and tool turns masked, message-list schemas and conversation pairs
whose last assistant turn differs (DPO and the reward model), truncation of conversations."""

from __future__ import annotations

import json

import pytest

from chatrl.config import DataConfig
from chatrl.data import SFTCollator, build_phase_data, encode_prompt
from chatrl.data.examples import conversation_example
from chatrl.data.schema import RowSkip, adapt_hh, adapt_messages, adapt_pairs
from chatrl.data.sources import read_source
from chatrl.data.turns import encode_conversation, observation_ids
from chatrl.logprobs import IGNORE_INDEX
from chatrl.models.causal_lm import end_of_turn_token_id, load_tokenizer
from tests.conftest import DATA, STORIES, TOKENIZERS


@pytest.fixture(scope="module", params=["qwen2", "stories260K"])
def tok(request):
    return load_tokenizer(str(TOKENIZERS / "qwen2" if request.param == "qwen2" else STORIES))


def U(c):
    return {"role": "user", "content": c}


def A(c):
    return {"role": "assistant", "content": c}


def T(c):
    return {"role": "tool", "content": c}


def labelled_turns(tok, batch, row: int) -> list[str]:
    """The texts of the runs of labelled tokens of one collated row, end-of-turn tokens included."""
    ids, labels = batch["input_ids"][row].tolist(), batch["labels"][row].tolist()
    runs, cur = [], []
    for i, lab in zip(ids, labels, strict=True):
        if lab != IGNORE_INDEX:
            assert lab == i  # labels are the ids themselves, aligned
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def test_conversation_ids_train_each_assistant_turn_and_append_observations(tok):
    conv = [U("What is 12*34?"), A("<calc>12*34</calc>"), T("408"), A("408")]
    ids = encode_conversation(tok, conv)
    eot = end_of_turn_token_id(tok)
    prompt = encode_prompt(tok, conv[:1])
    assert ids.ids[:len(prompt)] == prompt  # the first prompt is what generation starts from
    (a0, b0), (a1, b1) = ids.turns
    assert a0 == len(prompt) and ids.ids[b0 - 1] == eot and ids.ids[b1 - 1] == eot
    assert ids.trained == [0] * a0 + [1] * (b0 - a0) + [0] * (a1 - b0) + [1] * (b1 - a1)
    # between the turns: exactly the observation ids of the tool turn (and the next generation prompt)
    assert ids.ids[b0:a1] == observation_ids(tok, conv[:2], conv[2:3])
    assert "408" in tok.decode(ids.ids[b0:a1])
    assert tok.decode(ids.ids[a1:b1 - 1]).strip() == "408"


def test_conversation_example_truncates_from_the_left_and_keeps_the_last_turn():
    ids = [1, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    turns = [(2, 4), (6, 8), (8, 10)]
    full = conversation_example(ids, turns, 10, bos_token_id=1)
    assert full == {"input_ids": ids, "prompt_len": 8, "trained_spans": [2, 4, 6, 8, 8, 10]}
    # cut 3 tokens after the BOS (10, 11, 12): turn 0 is gone, turns 1 and 2 shift by 3
    cut = conversation_example(ids, turns, 7, bos_token_id=1)
    assert cut == {"input_ids": [1, 13, 14, 15, 16, 17, 18], "prompt_len": 5, "trained_spans": [3, 5, 5, 7]}
    no_bos = conversation_example(ids, turns, 8)
    assert no_bos["input_ids"] == ids[2:] and no_bos["trained_spans"] == [0, 2, 4, 6, 6, 8]
    assert conversation_example(ids, turns, 2) == "too_long"  # the last turn needs one prompt token besides


def test_sharegpt_sft_trains_every_assistant_turn(tmp_path, tok):
    rows = json.loads((DATA / "sharegpt-dpo" / "dpo_en_demo.json").read_text())
    multi = [r for r in rows if len(r["conversations"]) >= 5][:3]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(multi))
    samples = read_source(str(path)).samples
    data = build_phase_data(1, DataConfig([str(path)], data_split="10,0,0", eval_fraction=0.0,
                                          max_seq_len=100_000, data_output_path=None), tok)
    off = build_phase_data(1, DataConfig([str(path)], data_split="10,0,0", eval_fraction=0.0,
                                         max_seq_len=100_000, data_output_path=None), tok, all_turns="false")
    collate = SFTCollator(tok.pad_token_id)
    batch, last_only = collate([data.train[i] for i in range(3)]), collate([off.train[i] for i in range(3)])
    eot = tok.convert_ids_to_tokens(end_of_turn_token_id(tok))
    for row, s in enumerate(samples):
        answers = [m["content"].strip() for m in s.messages if m["role"] == "assistant"] + [s.chosen]
        assert len(answers) >= 2
        got = labelled_turns(tok, batch, row)
        assert [g.removesuffix(eot).strip() for g in got] == answers, got
        assert all(g.endswith(eot) for g in got)  # every turn's end-of-turn token is trained
        # the user and system turns are masked: none of their text is in a labelled run
        for m in s.messages:
            if m["role"] != "assistant":
                assert not any(m["content"].strip()[:30] in g for g in got)
        # --train_all_assistant_turns false: the same ids, the last answer only
        assert last_only["input_ids"][row].tolist() == batch["input_ids"][row].tolist()
        assert [g.removesuffix(eot).strip() for g in labelled_turns(tok, last_only, row)] == [s.chosen]


def test_oasst_sft_trains_every_assistant_turn_of_its_paths(tmp_path, tok):
    rows = [json.loads(x) for x in (DATA / "oasst" / "en_100_tree.jsonl").read_text().splitlines()]
    path = tmp_path / "oa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:10]))
    samples = read_source(str(path)).samples
    data = build_phase_data(1, DataConfig([str(path)], data_split="10,0,0", eval_fraction=0.0,
                                          max_seq_len=100_000, data_output_path=None), tok)
    assert len(data.train) == len(samples)
    eot = tok.convert_ids_to_tokens(end_of_turn_token_id(tok))
    batch = SFTCollator(tok.pad_token_id)([data.train[i] for i in range(len(samples))])
    # the split picks rows in its own order: compare the multisets of trained turn lists
    want = sorted([m["content"].strip() for m in s.messages if m["role"] == "assistant"] + [s.chosen] for s in samples)
    got = sorted([g.removesuffix(eot).strip() for g in labelled_turns(tok, batch, row)] for row in range(len(samples)))
    assert got == want
    assert sum(len(w) > 1 for w in want) >= 3  # conversations with earlier assistant turns, each trained


def test_message_lists_and_conversation_pairs():
    sft = adapt_messages({"messages": [U("Hi"), A("Hello."), U("Bye"), A("Goodbye.")]})
    assert sft[0].messages == (U("Hi"), A("Hello."), U("Bye")) and sft[0].chosen == "Goodbye."
    assert sft[0].conversation
    pair = adapt_hh({"chosen": [U("Hi"), A("Hello."), U("Bye"), A("Goodbye.")],
                     "rejected": [U("Hi"), A("Hello."), U("Bye"), A("Go away.")]})[0]
    assert pair.messages == (U("Hi"), A("Hello."), U("Bye")) and (pair.chosen, pair.rejected) == ("Goodbye.", "Go away.")
    trl = adapt_pairs({"prompt": [U("Hi"), A("Hello."), U("Bye")], "chosen": [A("Goodbye.")],
                       "rejected": [A("Go away.")]}, pairs=True)[0]
    assert trl == pair
    with pytest.raises(RowSkip, match="differ before their last assistant turn"):
        adapt_hh({"chosen": [U("Hi"), A("Hello."), U("Bye"), A("Goodbye.")],
                  "rejected": [U("Hi"), A("Hey."), U("Bye"), A("Go away.")]})
    with pytest.raises(RowSkip, match="does not end with an assistant turn"):
        adapt_messages({"messages": [U("Hi")]})
    with pytest.raises(RowSkip, match="role 'robot'"):
        adapt_messages({"messages": [U("Hi"), {"role": "robot", "content": "x"}]})


def test_conversation_pairs_share_the_turn_by_turn_prompt(tmp_path, tok):
    rows = [{"chosen": [U(f"Hi {i}"), A("Hello."), U("Bye"), A("Goodbye.")],
             "rejected": [U(f"Hi {i}"), A("Hello."), U("Bye"), A("Go away.")]} for i in range(4)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = build_phase_data(2, DataConfig([str(path)], data_split="0,10,0", eval_fraction=0.0,
                                          data_output_path=None), tok)
    item = data.train[0]
    prompt = encode_conversation(tok, [U("Hi 0"), A("Hello."), U("Bye")], generation_prompt=True).ids
    n = item["prompt_len"]
    assert n == len(prompt)
    assert item["chosen_input_ids"][:n].tolist() == prompt == item["rejected_input_ids"][:n].tolist()
    eot = end_of_turn_token_id(tok)
    assert item["chosen_input_ids"][-1] == eot and item["rejected_input_ids"][-1] == eot
    # the earlier assistant turn ends with its end-of-turn token inside the prompt, as step 1 trains it
    assert eot in prompt
