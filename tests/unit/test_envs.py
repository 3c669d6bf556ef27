"""Environments of step 3's multi-turn episodes: the calculator's parser (values, limits, and a fuzz
test of thousands of random and hostile call strings: no crash, no hang, no exception), the
guessing game, loading an environment by name, and the episode loop's ids and masks, token by
token, for a two-tool-call episode (trained ids = sampled ids; the episode = sampled ids +
observation ids, exactly what step 1 trains for the same conversation), and the tool chat's ids
(the template's rendering of its messages after every turn, however an answer ended)."""

from __future__ import annotations

import random
import string
import time

import pytest
import torch

from chatrl.conversation import ToolSession
from chatrl.data.formatting import encode_example
from chatrl.data.turns import encode_conversation, observation_ids
from chatrl.envs import EnvError, check_step, load_environment
from chatrl.envs.calculator import (
    MAX_DEPTH,
    CalcError,
    CalculatorEnv,
    call,
    evaluate,
    find_call,
    format_number,
)
from chatrl.envs.guess import GuessNumberEnv
from chatrl.envs.rollout import Episodes, run_episodes
from chatrl.errors import UsageError
from chatrl.models.causal_lm import load_tokenizer, stop_token_ids
from chatrl.sizes import EpisodePlan
from tests.conftest import STORIES, TOKENIZERS

# ----------------------------------------------------------------------------- the calculator


@pytest.mark.parametrize("expr,value", [("12*34", "408"), ("12 * 34 + 5", "413"), ("(1+2)*3", "9"), ("-(-3)", "3"),
                                        ("7/2", "3.5"), ("1/3", "0.3333333333"), ("2/3", "0.6666666667"),
                                        ("-1/8", "-0.125"), ("1/3*3", "1"), ("0.1+0.2", "0.3"), ("007", "7"),
                                        ("123456789*987654321", "121932631112635269")])
def test_calculator_values(expr, value):
    assert call(expr) == value


@pytest.mark.parametrize("expr,message", [("1/0", "division by zero"), ("1+", "ends too early"), ("", "empty"),
                                          ("1e5", "unexpected character 'e'"), ("__import__('os')", "unexpected"),
                                          ("1 2", "unexpected '2'"), ("(1", "not closed"), ("9" * 31, "30 digits"),
                                          ("1" * 201, "longer than 200"), ("1.2.3", "bad number"),
                                          ("(" * 40 + "1" + ")" * 40, f"deeper than {MAX_DEPTH}"),
                                          ("-" * 50 + "1", f"deeper than {MAX_DEPTH}"),
                                          ("*".join(["99999999999999999999"] * 9), "too large"), ("١٢", "unexpected")])
def test_calculator_refuses_with_a_message(expr, message):
    with pytest.raises(CalcError, match=message):
        evaluate(expr)
    assert call(expr).startswith("error: ")


def test_format_number_and_find_call():
    from fractions import Fraction
    assert format_number(Fraction(-5, 2)) == "-2.5" and format_number(Fraction(10)) == "10"
    assert find_call("I will use <calc>2+2</calc> now <calc>3</calc>") == "2+2"
    assert find_call("<calc>2+2") == "2+2" and find_call("no call") is None


HOSTILE = ["", "<calc>", "</calc>", "<calc></calc>", "<calc><calc>1</calc></calc>", "<calc>" * 500,
           "<calc>" + "(" * 10_000 + "</calc>", "<calc>" + "9" * 100_000 + "</calc>", "<calc>1/0</calc>",
           "<calc>" + "1*" * 99 + "1</calc>", "<calc>" + "-" * 199 + "1</calc>", "<calc>\x00\x01\x02</calc>",
           "<calc>1e308**1e308</calc>", "<calc>__import__('os').system('echo x')</calc>", "<calc>lambda: 0</calc>",
           "<calc>" + "99999999999999999999*" * 9 + "9</calc>", "<calc>(1/3)" + "/3" * 90 + "</calc>",
           "<calc>١٢٣+٤</calc>", "<calc>½+¼</calc>", "<calc>１２＋３</calc>", "<calc>" + " " * 199 + "1</calc>",
           "<calc>.</calc>", "<calc>..</calc>", "<calc>1..2</calc>", "\ud800<calc>1</calc>", "<CALC>1</CALC>",
           "<calc>" + "(1+" * 60 + "1" + ")" * 60 + "</calc>", "<calc>" + "0." + "0" * 29 + "1/3" + "</calc>"]


def _random_call(rng: random.Random) -> str:
    alphabet = string.digits * 4 + "+-*/()() ..." + "<>/calc" + "\n\t" + "e_x^%=" + "١½２"
    body = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
    pick = rng.random()
    if pick < 0.5:
        return f"<calc>{body}</calc>"
    if pick < 0.7:
        return f"text {body} <calc>{body[:rng.randint(0, 50)]}"
    return body


def test_fuzz_hostile_and_random_calls_never_crash_or_hang():
    """Thousands of random and hostile call strings through the environment's step: each returns a
    well-formed step (a tool turn, or the end of the episode) in bounded time, never an exception."""
    rng = random.Random(0)
    texts = HOSTILE + [_random_call(rng) for _ in range(5000)]
    worst, t_all = 0.0, time.perf_counter()
    for i, text in enumerate(texts):
        env = CalculatorEnv(max_calls=10**9)
        env.reset({"messages": [{"role": "user", "content": "q"}], "metadata": {"reference": "7"}, "seed": i})
        t0 = time.perf_counter()
        new, reward, done, info = check_step(env.step([{"role": "assistant", "content": text}], text), "fuzz")
        worst = max(worst, time.perf_counter() - t0)
        if new is not None:
            assert len(new) == 1 and new[0]["role"] == "tool" and not done and reward == 0.0
            assert len(new[0]["content"]) < 200  # a bounded answer, not an echo of a huge number
        else:
            assert done and reward in (0.0, 1.0)
    assert worst < 0.5, worst  # no call takes long (measured: well under 10 ms)
    assert time.perf_counter() - t_all < 60


def test_calculator_episode_rewards_the_final_answer():
    env = CalculatorEnv(max_calls=1)
    msgs = env.reset({"messages": [{"role": "user", "content": "12*34?"}], "metadata": {"reference": "408"}})
    assert msgs == [{"role": "user", "content": "12*34?"}]
    assert env.step(msgs, "<calc>12*34</calc>")[:3] == ([{"role": "tool", "content": "408"}], 0.0, False)
    assert env.step(msgs, "The answer is 408.")[:3] == (None, 1.0, True)
    assert env.step(msgs, "409")[:3] == (None, 0.0, True)
    assert env.step(msgs, "<calc>1</calc>")[:3] == (None, 0.0, True)  # a second call: more than max_calls
    with pytest.raises(ValueError, match="no reference number"):
        CalculatorEnv().reset({"messages": [], "metadata": {}})
    assert CalculatorEnv(system_prompt=True).reset({"messages": [], "metadata": {"reference": 1}})[0]["role"] == "system"


def test_guess_number_game():
    env = GuessNumberEnv(1, 100)
    opening = env.reset({"messages": [], "metadata": {"secret": 42}, "seed": 0})
    assert opening[0]["role"] == "user" and "between 1 and 100" in opening[0]["content"]
    assert env.step(opening, "50")[:3] == ([{"role": "user", "content": "lower"}], 0.0, False)
    assert env.step(opening, "I guess 10")[:3] == ([{"role": "user", "content": "higher"}], 0.0, False)
    assert env.step(opening, "no idea")[0][0]["content"] == "Please answer with a number."
    assert env.step(opening, "42")[:3] == (None, 1.0, True)
    # without a secret in the row: drawn from the episode's seed, the same for the same seed
    a, b = GuessNumberEnv(), GuessNumberEnv()
    a.reset({"seed": 7})
    b.reset({"seed": 7})
    assert a.secret == b.secret


def test_loading_environments_by_name(tmp_path):
    assert isinstance(load_environment("calculator")(), CalculatorEnv)
    assert load_environment("guess_number", '{"low": 3, "high": 4}')().high == 4
    f = tmp_path / "myenv.py"
    f.write_text("class Echo:\n    def reset(self, row):\n        return row['messages']\n"
                 "    def step(self, messages, text):\n        return None, 0.5, True, {}\n")
    assert load_environment(f"{f}:Echo")().step([], "x")[1] == 0.5
    with pytest.raises(UsageError, match="expected module:class"):
        load_environment("nope")
    with pytest.raises(UsageError, match="cannot import"):
        load_environment("no_such_module_xyz:Env")
    with pytest.raises(UsageError, match="not JSON"):
        load_environment("calculator", "{max_calls: 2}")
    with pytest.raises(UsageError, match="unexpected keyword argument 'bogus'"):
        load_environment("calculator", '{"bogus": 1}')


def test_check_step_names_what_is_wrong():
    with pytest.raises(EnvError, match="expected \\(new_messages"):
        check_step([None, 1.0, True, {}], "e")
    with pytest.raises(EnvError, match="not a finite number"):
        check_step((None, float("nan"), True, {}), "e")
    with pytest.raises(EnvError, match="done is a int"):
        check_step((None, 1.0, 1, {}), "e")
    with pytest.raises(EnvError, match="an assistant turn"):
        check_step(([{"role": "assistant", "content": "x"}], 0.0, False, {}), "e")


# ----------------------------------------------------------------------------- the episode loop


class ScriptedSampler:
    """A stand-in for the hybrid engine's generate: call ``t`` returns ``turns[t]`` for every row
    (padded with the pad id), with log-prob ``-(t + 1) / 10 - j / 100`` for token ``j``."""

    def __init__(self, turns: list[list[int]], pad: int, width: int):
        self.turns, self.pad, self.width, self.calls, self.inputs = turns, pad, width, 0, []

    def __call__(self, ids, mask):
        self.inputs.append([row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)])
        t = self.turns[self.calls]
        self.calls += 1
        new = torch.full((ids.shape[0], self.width), self.pad, dtype=torch.long)
        new[:, :len(t)] = torch.tensor(t)
        logp = torch.zeros(ids.shape[0], self.width)
        logp[:, :len(t)] = torch.tensor([-(self.calls / 10) - j / 100 for j in range(len(t))])
        return torch.cat([ids, new], dim=1), logp


@pytest.mark.parametrize("tok_name", ["qwen2", "stories260K"])
def test_two_tool_call_episode_ids_and_masks_token_by_token(tok_name):
    tok = load_tokenizer(str(TOKENIZERS / "qwen2" if tok_name == "qwen2" else STORIES), padding_side="left")
    question = {"role": "user", "content": "What is 12*34+5?"}
    answers = ["<calc>12*34</calc>", "<calc>408+5</calc>", "413"]
    # the ids the "model" samples: each turn's canonical ids (content + end-of-turn token)
    history = [question]
    sampled = []
    for i, a in enumerate(answers):
        sampled.append(encode_example(tok, history, a)[1])
        history = history + [{"role": "assistant", "content": a}] + (
            [{"role": "tool", "content": ["408", "413"][i]}] if i < 2 else [])
    sampler = ScriptedSampler(sampled, tok.pad_token_id, width=max(map(len, sampled)) + 3)
    ep = run_episodes(sampler, tok, Episodes(load_environment("calculator"), EpisodePlan(4, 512, 64)), [
        {"messages": [question], "metadata": {"reference": "413"}, "seed": 0}], stop_ids=stop_token_ids(tok),
        device="cpu")
    prompt = encode_conversation(tok, [question], generation_prompt=True).ids
    obs1 = observation_ids(tok, history[:2], [{"role": "tool", "content": "408"}])
    obs2 = observation_ids(tok, history[:4], [{"role": "tool", "content": "413"}])
    P = ep.prompt_len
    assert P == len(prompt) and ep.sequences[0, :P].tolist() == prompt
    region = ep.sequences[0, P:].tolist()
    expected = sampled[0] + obs1 + sampled[1] + obs2 + sampled[2]
    assert region == expected  # the episode = sampled ids and observation ids, appended in order
    trained: list[int] = []
    for seg, is_sampled in ((sampled[0], 1), (obs1, 0), (sampled[1], 1), (obs2, 0), (sampled[2], 1)):
        trained += [is_sampled] * len(seg)
    assert ep.action_mask[0].tolist() == trained  # token by token: sampled ids trained, observations not
    assert [i for i, m in zip(region, trained, strict=True) if m] == sampled[0] + sampled[1] + sampled[2]
    assert ep.attention_mask[0].tolist() == [1] * (P + len(region))
    # the ids step 1 trains for the same conversation are exactly the episode's, with the same mask
    conv = encode_conversation(tok, history)
    assert conv.ids == prompt + expected and conv.trained == [0] * P + trained
    # log-probs sit on sampled ids only; the observation tokens' are 0
    lp = ep.sampler_logp[0].tolist()
    assert lp[:len(sampled[0])] == pytest.approx([-0.1 - j / 100 for j in range(len(sampled[0]))])
    assert all(v == 0.0 for v, m in zip(lp, trained, strict=True) if not m)
    # the second turn was generated from the prompt, turn 1 and observation 1: never re-tokenized
    assert sampler.inputs[1] == [prompt + sampled[0] + obs1]
    # rewards: the calls 0, the final answer 1, no per-turn reward; three turns, the last one ended
    assert ep.final_rewards.tolist() == [1.0] and ep.turn_rewards.abs().sum() == 0
    assert ep.turns.tolist() == [3] and ep.ended.tolist() == [True] and ep.answers == ["413"]
    assert [m["role"] for m in ep.messages[0]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]


def test_episodes_end_on_budget_turns_and_unfinished_turns():
    tok = load_tokenizer(str(TOKENIZERS / "qwen2"), padding_side="left")
    eot = stop_token_ids(tok)[0]
    call_ids = tok("<calc>1+1</calc>", add_special_tokens=False)["input_ids"]
    row = {"messages": [{"role": "user", "content": "1+1?"}], "metadata": {"reference": "2"}, "seed": 0}
    env = load_environment("calculator", '{"max_calls": 100}')
    # --max_turns 2: two calls, the episode stops after the second turn (the tool's answer is not appended)
    ep = run_episodes(ScriptedSampler([call_ids + [eot]] * 2, tok.pad_token_id, 20), tok,
                      Episodes(env, EpisodePlan(2, 512, 64)), [row], stop_ids=[eot], device="cpu")
    assert ep.turns.tolist() == [2] and ep.action_mask.sum().item() == 2 * (len(call_ids) + 1)
    assert ep.sequences[0, -1].item() == eot
    # a turn without a stop token ends the episode, not ended (--penalty_no_eos applies)
    ep = run_episodes(ScriptedSampler([call_ids], tok.pad_token_id, len(call_ids)), tok,
                      Episodes(env, EpisodePlan(3, 512, 64)), [row], stop_ids=[eot], device="cpu")
    assert ep.turns.tolist() == [1] and ep.ended.tolist() == [False]
    # a turn ending with another stop token (ChatML's EOS <|endoftext|>, not <|im_end|>) ends the episode:
    # the model closed the conversation, and no observation follows it
    eos = tok.eos_token_id
    assert eos != eot and eos in stop_token_ids(tok)
    ep = run_episodes(ScriptedSampler([call_ids + [eos]], tok.pad_token_id, 20), tok,
                      Episodes(env, EpisodePlan(3, 512, 64)), [row], stop_ids=stop_token_ids(tok), device="cpu")
    assert ep.turns.tolist() == [1] and ep.ended.tolist() == [True] and ep.sequences[0, -1].item() == eos
    # --max_total_tokens: the turn is cut at the budget
    prompt_len = len(encode_conversation(tok, row["messages"], generation_prompt=True).ids)
    ep = run_episodes(ScriptedSampler([call_ids + [eot]], tok.pad_token_id, 20), tok,
                      Episodes(env, EpisodePlan(3, prompt_len + 3, 64)), [row], stop_ids=[eot], device="cpu")
    assert ep.sequences.shape[1] == prompt_len + 3 and ep.ended.tolist() == [False]


def test_an_environment_error_is_an_env_error():
    tok = load_tokenizer(str(TOKENIZERS / "qwen2"), padding_side="left")

    class Broken:
        def reset(self, row):
            return row["messages"]

        def step(self, messages, text):
            raise KeyError("boom")

    with pytest.raises(EnvError, match="KeyError: 'boom'"):
        run_episodes(ScriptedSampler([[stop_token_ids(tok)[0]]], tok.pad_token_id, 2), tok,
                     Episodes(Broken, EpisodePlan(2, 64, 16)),
                     [{"messages": [{"role": "user", "content": "x"}], "metadata": {}, "seed": 0}],
                     stop_ids=stop_token_ids(tok), device="cpu")


# ----------------------------------------------------------------------------- the tool chat (chat.py --env)


@pytest.mark.parametrize("tok_name", ["qwen2", "stories260K"])
def test_tool_chat_ids_are_the_templates_rendering_after_every_turn_however_a_reply_ended(tok_name):
    tok = load_tokenizer(str(TOKENIZERS / "qwen2" if tok_name == "qwen2" else STORIES), padding_side="left")
    stops = stop_token_ids(tok)
    eot = stops[0]
    session = ToolSession(tok, load_environment("calculator"), max_turns=4, stop_ids=stops)

    def rendered(generation_prompt: bool) -> list[int]:
        return encode_conversation(tok, session.messages, generation_prompt=generation_prompt).ids

    def content_ids(text: str) -> list[int]:  # the answer's canonical ids, without its end-of-turn token
        ids = encode_example(tok, session.messages, text)[1]
        assert ids[-1] == eot
        return ids[:-1]

    # a tool call ended by the end-of-turn token, its observation, then a reply cut by the token budget
    assert session.user("What is 12*34?") == rendered(True)
    assert session.answer(content_ids("<calc>12*34</calc>") + [eot]) == [{"role": "tool", "content": "408"}]
    assert session.ids.ids == rendered(True)
    cut = content_ids("It is four hundred")
    assert session.answer(cut) is None
    assert session.messages[-1]["content"] == "It is four hundred"
    assert session.ids.ids == rendered(False)  # the cut reply is closed: ... four hundred<eot>
    assert session.ids.ids[-len(cut) - 1:] == cut + [eot]
    # the next user turn follows a closed turn
    assert session.user("and 2+2?") == rendered(True)
    # a reply ended by a stop id that is not the end-of-turn token (ChatML's <|endoftext|>, stories260K's
    # declared BOS): that id is replaced by the end-of-turn token
    others = [i for i in stops if i != eot]
    if others:
        four = content_ids("4")
        assert session.answer(four + [others[0]] + four) is None  # ids after the stop are dropped
        assert session.messages[-1]["content"] == "4"
        assert session.ids.ids == rendered(False) and session.ids.ids[-len(four) - 1:] == four + [eot]
        assert session.user("thanks") == rendered(True)
    # a whole reply ended by the end-of-turn token is kept as sampled
    done = content_ids("You are welcome")
    assert session.answer(done + [eot] + done) is None
    assert session.ids.ids == rendered(False) and session.ids.ids[-len(done) - 1:] == done + [eot]
