"""Reward sources (chatrl.rewards): built-ins, Python functions, the weighted sum, the rank check."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from chatrl.config import RewardConfig
from chatrl.errors import UsageError
from chatrl.rewards import (
    FunctionReward,
    ModelReward,
    RewardBatch,
    RewardError,
    WeightedReward,
    build_reward,
    check_reward_metadata,
    check_scores,
    kinds,
    load_reward_fn,
    score_on_all_ranks,
    split_weight,
)
from chatrl.rewards.builtin import exact_match, extract_final_number, regex_format


def batch(answers, refs=None, step=3):
    refs = refs or [None] * len(answers)
    meta = [{} if r is None else {"reference": r} for r in refs]
    return RewardBatch([f"q{i}" for i in range(len(answers))], list(answers), meta, step=step)


def test_extract_final_number_and_exact_match():
    assert extract_final_number("so 3 + 4 = 7.") == 7
    assert extract_final_number("total: 1,234.5 dollars") == Fraction(2469, 2)
    assert extract_final_number("-12") == -12 and extract_final_number("none") is None
    answers = ["7", "the answer is 7.0", "8", "no idea", "3 + 4 = -7"]
    assert exact_match([""] * 5, answers, [{"reference": "7"}] * 4 + [{"reference": -7}]) == [1, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="row 1 has no 'reference'"):
        exact_match(["", ""], ["1", "2"], [{"reference": "1"}, {}])
    with pytest.raises(ValueError, match="holds no number"):
        exact_match([""], ["1"], [{"reference": "seven"}])


# (text, value read) — the table of docs/rewards.md
VALUE_CASES = [
    ("so 3 + 4 = 7.", 7), ("1/4", Fraction(1, 4)), ("3/4", Fraction(3, 4)), ("0.75", Fraction(3, 4)),
    ("1e-05", Fraction(1, 100000)), ("2.5E3", 2500), ("-12", -12), ("−3", -3), ("+4", 4), (".5", Fraction(1, 2)),
    ("1,234.5 dollars", Fraction(2469, 2)), ("1,000,000", 10**6), ("total 1,2345", 2345), ("50%", 50),
    ("The answer is 3/4, not 1/4", Fraction(3, 4)), ("Answer: 42", 42), ("#### 1,000", 1000),
    ("The answer is 3 + 4 = 7", 7), ("the answer is 7.0", 7), ("so it is -5", -5), ("3 - 5 = -2", -2),
    (r"\boxed{\frac{3}{4}}", Fraction(3, 4)), (r"$\dfrac34$", Fraction(3, 4)), (r"-\frac{3}{4}", Fraction(-3, 4)),
    (r"\frac{-3}{4}", Fraction(-3, 4)), (r"so \boxed{1\,234}", 1234), (r"\boxed{5 \text{ cm}}", 5),
    (r"\boxed{x = -2}", -2), (r"\boxed{-0.75} but 1/4 above", Fraction(-3, 4)), ("1 1/2", Fraction(3, 2)),
    ("-1 1/2", Fraction(-3, 2)), (r"2.5 \times 10^{3}", 2500), ("2.5 × 10^-3", Fraction(1, 400)),
    ("2*10^3", 2000), ("2^10 = 1024", 1024), ("H2O weighs 18", 18), ("2e400", 2 * 10**400),
    # no value: none, an expression, or a box that does not hold one number
    ("none", None), ("x - 5", None), ("2 * 3", None), ("2^10", None), (r"\sqrt{2}", None), ("5!", None),
    (r"2\pi", None), ("x2", None), ("3/4/2020", None), ("1/0", None), (r"\boxed{x+1}", None),
    (r"\boxed{2^{10}}", None), (r"\boxed{(3, 4)}", None), (r"\frac{x}{2}", None), ("the answer is x", None),
    # too large to be an answer (an exact fraction would take minutes, or pass Python's digit limit)
    ("2e401", None), ("9" * 5000, None),
]


@pytest.mark.parametrize("text, value", VALUE_CASES, ids=[c[0][:40] for c in VALUE_CASES])
def test_final_value_grammar(text, value):
    assert extract_final_number(text) == value


def test_exact_match_fractions_decimals_and_exponents():
    """The reported misreadings: "1/4" against "3/4" scored 1 (both read 4), "0.75" against "3/4"
    scored 0, a numeric reference 1e-05 read as -5."""
    answers = ["1/4", "0.75", "3/4", r"\boxed{\frac{3}{4}}", "the answer is 0.75.", "0.00001", "1e-5", "-5", "5"]
    refs = ["3/4", "3/4", "0.75", "3/4", "3/4", 1e-05, "1e-05", 1e-05, 1e-05]
    assert exact_match([""] * 9, answers, [{"reference": r} for r in refs]) == [0, 1, 1, 1, 1, 1, 1, 0, 0]


def _forms(v: Fraction) -> list[str]:
    """Ways a maths answer writes the value ``v``."""
    out = [f"{v.numerator}/{v.denominator}", rf"\frac{{{v.numerator}}}{{{v.denominator}}}",
           rf"so the answer is \boxed{{{v.numerator}/{v.denominator}}}", f"The answer is {v.numerator}/{v.denominator}."]
    if v.denominator == 1:
        n = v.numerator
        out += [str(n), f"{n:,}", f"{n}.0", f"x = {n}", f"#### {n}", f"{float(n):e}"]
    d = v.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d == 1:  # a terminating decimal
        dec = f"{float(v):.10f}".rstrip("0").rstrip(".")
        out += [dec, f"{float(v):e}", f"the answer is {dec}"]
    return out


def test_exact_match_never_rewards_a_wrong_value_and_matches_every_form_of_the_right_one():
    import random

    rng = random.Random(0)
    values = {Fraction(rng.randint(-3000, 3000), rng.choice([1, 1, 2, 3, 4, 5, 8, 10, 16, 25, 7, 100]))
              for _ in range(60)} | {Fraction(0), Fraction(1, 4), Fraction(3, 4), Fraction(1, 100000), Fraction(-5)}
    values = sorted(values)
    for v in values:
        for ref in _forms(v)[:2] + [float(v)] * (float(v) == v):
            right = _forms(v)
            assert exact_match([""] * len(right), right, [{"reference": ref}] * len(right)) == [1.0] * len(right), (v, ref)
            w = values[(values.index(v) + 1) % len(values)]  # the next value: another number, maybe close
            assert all(extract_final_number(a) == w for a in _forms(w)), w
            wrong = _forms(w) + [f"{v} + 1", f"{v} - 1", f"2 * {v}", f"{v}^2", f"x{v.numerator}"]
            assert exact_match([""] * len(wrong), wrong, [{"reference": ref}] * len(wrong)) == [0.0] * len(wrong)


def test_regex_format_default_and_per_row_pattern():
    meta = [{}, {}, {"format_regex": r"^\s*-?\d+\s*$"}, {"format_regex": r"^\s*-?\d+\s*$"}]
    assert regex_format([""] * 4, ["so 42", "42 apples", " -3 ", "x = 3"], meta) == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="row 0's format_regex"):
        regex_format([""], ["a"], [{"format_regex": "("}])


def test_load_reward_fn_builtin_module_file_and_errors(tmp_path):
    assert load_reward_fn("exact_match") is exact_match
    assert load_reward_fn("chatrl.rewards.builtin:regex_format") is regex_format
    f = tmp_path / "my_reward.py"
    f.write_text("def length(prompts, answers, metadata):\n    return [float(len(a)) for a in answers]\n"
                 "NOT_CALLABLE = 3\n")
    assert load_reward_fn(f"{f}:length")(["p"], ["abc"], [{}]) == [3.0]
    with pytest.raises(ValueError, match="expected module:function"):
        load_reward_fn("exact")
    with pytest.raises(ImportError, match="cannot import 'no_such_module_xyz'.*ModuleNotFoundError"):
        load_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ImportError, match="no file"):
        load_reward_fn(f"{tmp_path}/missing.py:f")
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        load_reward_fn("chatrl.rewards.builtin:nope")
    with pytest.raises(TypeError, match="not a function"):
        load_reward_fn(f"{f}:NOT_CALLABLE")


def test_function_reward_checks_what_the_function_returns():
    b = batch(["1", "2"])
    assert FunctionReward(lambda p, a, m: [0.5, 1])(b).tolist() == [0.5, 1.0]
    assert FunctionReward(lambda p, a, m: torch.tensor([0.5, 1.0]))(b).tolist() == [0.5, 1.0]
    for bad, msg in [(lambda p, a, m: [1.0], "returned 1 scores for 2 answers"),
                     (lambda p, a, m: [1.0, math.nan], "score 1 is not finite"),
                     (lambda p, a, m: [1.0, "x"], "score 1 is a str"),
                     (lambda p, a, m: 3.0, "returned a float"),
                     (lambda p, a, m: 1 / 0, "raised ZeroDivisionError")]:
        with pytest.raises(RewardError, match=f"--reward_fn '<lambda>' at step 3.*{msg}"):
            FunctionReward(bad)(b)


def test_metadata_reaches_the_function():
    seen = []
    FunctionReward(lambda p, a, m: seen.append((p, a, m)) or [0.0])(
        RewardBatch(["What is 2+2?"], ["4"], [{"reference": "4", "level": 1}]))
    assert seen == [(["What is 2+2?"], ["4"], [{"reference": "4", "level": 1}])]


def test_weighted_reward_sums_parts_and_model_adapter():
    b = batch(["7", "x"], refs=["7", "7"])
    b.sequences, b.attention_mask, b.prompt_len = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4), 2
    model = ModelReward(lambda s, m, p: torch.tensor([0.25, -1.0]))
    total, parts = WeightedReward([(1.0, model), (2.0, FunctionReward("exact_match")),
                                   (0.5, FunctionReward("exact_match"))])(b)
    assert total.tolist() == [0.25 + 2.0 + 0.5, -1.0]
    assert set(parts) == {"reward/model", "reward/exact_match", "reward/exact_match#2"}
    with pytest.raises(ValueError, match="no reward source"):
        WeightedReward([])
    with pytest.raises(RewardError, match="needs the batch's token ids"):
        model(batch(["a"]))


def test_build_reward_parses_weights():
    assert split_weight("0.2*regex_format", "--reward_fn") == (0.2, "regex_format")
    assert split_weight("exact_match", "--reward_fn") == (1.0, "exact_match")
    assert split_weight("1e-1 * http://h:1/", "--reward_url") == (0.1, "http://h:1/")
    r = build_reward(RewardConfig(reward_fn=["exact_match", "0.5*regex_format"], reward_url=["2*http://127.0.0.1:9/"]))
    assert [(w, n) for w, n, _ in r.parts] == [(1.0, "exact_match"), (0.5, "regex_format"), (2.0, "http")]
    assert not r.needs_reward_model
    with pytest.raises(ValueError, match="--reward_url 'ftp://x'"):
        build_reward(RewardConfig(reward_url=["ftp://x"]))


NUMERIC_RETURNS = [
    np.array([0.25, 3.0], dtype=np.float32), np.array([0.25, 3.0]), np.array([1, 3], dtype=np.int64),
    np.array([1, 3], dtype=np.uint8), [np.float32(0.25), np.int64(3)], (np.float16(0.25), np.int32(3)),
    [np.array(0.25), np.array([3.0])], torch.tensor([0.25, 3.0], dtype=torch.bfloat16),
    torch.tensor([[1], [3]]), [torch.tensor(0.25), torch.tensor([3], dtype=torch.int64)],
    np.array([np.float64(0.25), 3], dtype=object), [Fraction(1, 4), 3], [0.25, 3],
]


@pytest.mark.parametrize("values", NUMERIC_RETURNS, ids=lambda v: type(v).__name__)
def test_check_scores_accepts_every_real_numeric_scalar_and_array(values):
    """Python, NumPy and torch numbers, scalars in a list or whole arrays, of any int/float dtype."""
    got = check_scores(values, 2, "x")
    assert got.dtype == torch.float32 and got.shape == (2,)
    assert got[1].item() == 3.0 and got[0].item() in (0.25, 1.0)
    # through a reward function, as step 3 calls it
    fn = FunctionReward(lambda prompts, answers, meta: values, name="numpy")
    assert fn(batch(["a", "b"])).tolist() == got.tolist()


@pytest.mark.parametrize("values, message", [
    ([True, 1.0], "score 0 is a boolean"), ([1.0, np.bool_(False)], "score 1 is a boolean"),
    (np.array([True, False]), "returned booleans"), (torch.tensor([True, False]), "returned booleans"),
    ([torch.tensor(True), 1], "score 0 is a boolean"),
    ([1.0, float("nan")], r"score 1 is not finite \(nan\)"), (np.array([1.0, np.inf], dtype=np.float32), "not finite"),
    (torch.tensor([float("-inf"), 0.0]), "score 0 is not finite"), (["1", 2], "score 0 is a str"),
    ([1 + 2j, 1], "score 0 is a complex"), (np.array([1j, 2]), "complex"), (torch.tensor([1j, 2]), "complex"),
    (np.array(["a", "b"]), "dtype <U1"), ([None, 1], "NoneType"), ([np.array([1.0, 2.0]), 1], "array of 2 numbers"),
    (2.0, "returned a float, expected one number per answer"), (np.float32(2), "returned a float32"),
    ([1, 2, 3], "returned 3 scores for 2 answers"),
])
def test_check_scores_refuses_booleans_and_non_finite_or_non_real_values(values, message):
    with pytest.raises(RewardError, match=message):
        check_scores(values, 2, "x")


def test_score_on_all_ranks_fails_everywhere_when_one_rank_fails():
    from tests.unit.test_critic_free import simulate_ranks

    def ok():
        return torch.ones(2)

    def boom():
        raise RewardError("server down")

    assert score_on_all_ranks(ok, rank=0, world_size=1, all_reduce_sum=None, step=1).tolist() == [1.0, 1.0]

    def on_rank(rank, reduce):
        try:
            return score_on_all_ranks(boom if rank == 1 else ok, rank=rank, world_size=2, all_reduce_sum=reduce,
                                      step=5)
        except RewardError as exc:
            return str(exc)

    msgs = simulate_ranks(on_rank, 2)
    assert msgs[0] == "rank 0: reward failed at step 5 on rank(s) [1]; see their error"
    assert msgs[1] == "rank 1: reward failed at step 5: server down"


def test_reward_batch_from_tokens_decodes_prompt_and_answer_only():
    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.rewards import reward_batch_from_tokens
    from tests.conftest import TOKENIZERS

    tok = load_tokenizer(str(TOKENIZERS / "gpt2"))
    pad, eos = tok.pad_token_id, tok.eos_token_id
    p1, p2 = tok.encode("What is 2+2?"), tok.encode("Hi")
    a1, a2 = tok.encode(" 4"), tok.encode(" hello there")
    P = max(len(p1), len(p2))
    A = max(len(a1), len(a2)) + 2
    rows, masks, acts = [], [], []
    for p, a in ((p1, a1), (p2, a2)):
        answer = a + [eos] + [pad] * (A - len(a) - 1)
        rows.append([pad] * (P - len(p)) + p + answer)
        masks.append([0] * (P - len(p)) + [1] * len(p) + [1] * (len(a) + 1) + [0] * (A - len(a) - 1))
        acts.append([1] * (len(a) + 1) + [0] * (A - len(a) - 1))
    seq, mask, act = torch.tensor(rows), torch.tensor(masks), torch.tensor(acts)
    b = reward_batch_from_tokens(tok, seq, mask, act, P, [{"reference": "4"}, {}], step=7)
    assert b.prompts == ["What is 2+2?", "Hi"] and b.answers == [" 4", " hello there"]
    assert b.metadata == [{"reference": "4"}, {}] and b.step == 7 and b.prompt_len == P
    assert FunctionReward("exact_match")(RewardBatch(b.prompts[:1], b.answers[:1], b.metadata[:1])).tolist() == [1.0]
    with pytest.raises(ValueError, match="1 metadata rows for 2 sequences"):
        reward_batch_from_tokens(tok, seq, mask, act, P, [{}])


def test_reward_errors_a_user_causes_are_usage_errors_named_in_one_line(tmp_path):
    """An unknown --reward_fn and rule rewards on rows without their field were tracebacks of 34-63 lines
    per rank; each is a UsageError now (printed alone), and a missing reference is found before any
    answer is generated, naming the field, the rows and the fix."""
    from chatrl.errors import UsageError
    from chatrl.rewards import check_reward_metadata
    from chatrl.rewards.base import RewardBatch

    for spec in ("exact", "no_such_module_xyz:f", "chatrl.rewards.builtin:nope"):
        with pytest.raises(UsageError, match="--reward_fn"):
            load_reward_fn(spec)
    with pytest.raises(ImportError):  # still the kind of error it was
        load_reward_fn("no_such_module_xyz:f")
    rows = [{"reference": "2"}, {}, None, {"reference": 0}]
    with pytest.raises(UsageError) as err:
        check_reward_metadata(["0.5*exact_match", "regex_format"], rows, "--data_path p.jsonl")
    assert str(err.value) == ('--reward_fn exact_match scores each answer against its prompt row\'s "reference", and '
                              '2 of the 4 step-3 prompt rows of --data_path p.jsonl have none (row 1 first): give '
                              'prompt rows with a "reference" (scripts/make_arith_task.py writes them; docs/rewards.md)')
    check_reward_metadata(["chatrl.rewards.builtin:regex_format"], rows, "x")  # no field it cannot do without
    with pytest.raises(UsageError):
        check_reward_metadata(["chatrl.rewards.builtin:exact_match"], rows[1:2], "x")  # the long name too
    batch = RewardBatch(prompts=["p"], answers=["2"], metadata=[{}], step=1)
    with pytest.raises(UsageError, match="exact_match: row 0 has no 'reference'"):
        FunctionReward("exact_match")(batch)


def test_exact_match_scripts_paired_gain_and_interval():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "eval_exact_match.py"
    spec = importlib.util.spec_from_file_location("eval_exact_match", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    after, before = [1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]
    gain, low, high = script.paired_gain(after, before)
    # differences 1, 0, 0, 1: a resample's mean is k/4 with k ~ Binomial(4, 1/2); P(k = 0) = P(k = 4) = 1/16 > 2.5 %,
    # so the 95 % interval's ends are 0 and 1
    assert gain == 0.5 and (low, high) == (0.0, 1.0)
    assert script.paired_gain(before, before) == (0.0, 0.0, 0.0)  # no difference in any row: a point interval
    with pytest.raises(ValueError, match="the same rows"):
        script.paired_gain(after, before[:3])


class _Length:
    """A toy source: minus the distance of each answer's length to ``n`` characters."""

    def __init__(self, n):
        self.n, self.name = n, "length"

    def __call__(self, batch):
        return torch.tensor([-abs(len(a) - self.n) for a in batch.answers], dtype=torch.float32)


class LengthKind(kinds.RewardKind):
    name, summary = "length", "minus the distance of the answer's length to TARGET characters"

    def source(self, target, settings, context):
        return _Length(int(target.split(":", 1)[1]))


def test_each_reward_value_goes_to_the_kind_that_claims_it(tmp_path):
    """The registry (chatrl/rewards/kinds.py): built-ins by short name or path, module functions, HTTP
    servers and reward-model folders; a value no kind of its flag claims goes to the flag's first kind,
    whose check names the forms; a user's kind is asked first."""
    assert kinds.names()[:4] == ("function", "builtin", "http", "model")
    claimed = {("exact_match", "--reward_fn"): "builtin",
               ("chatrl.rewards.builtin:exact_match", "--reward_fn"): "builtin",
               ("mypkg.mod:score", "--reward_fn"): "function", ("exact_mach", "--reward_fn"): "function",
               ("http://h:1/x", "--reward_url"): "http", ("ftp://x", "--reward_url"): "http"}
    for (value, flag), name in claimed.items():
        assert kinds.resolve(value, flag)[1].name == name, value
    assert kinds.resolve("0.5*http://h:1/x", "--reward_url")[::2] == (0.5, "http://h:1/x")
    assert kinds.find(str(tmp_path)).name == "model" and kinds.find("http://h:1/").name == "http"
    assert kinds.find("no_colon_no_folder") is None
    with pytest.raises(UsageError, match="expected module:function"):
        kinds.check("exact_mach", "--reward_fn")
    with pytest.raises(UsageError, match="no reward kind reads --reward_grpc"):
        kinds.resolve("x", "--reward_grpc")
    with pytest.raises(UsageError, match="exact_match scores each answer against its prompt row's"):
        check_reward_metadata(["0.5*chatrl.rewards.builtin:exact_match"], [{"reference": 1}, {}], "r.jsonl")
    kinds.register(LengthKind())
    try:
        w, kind, target = kinds.resolve("2*length:3", "--reward_fn")
        assert (w, type(kind), target) == (2.0, LengthKind, "length:3")
        assert kinds.find("length:3", "--reward_url") is None  # it reads --reward_fn only
        r = build_reward(RewardConfig(reward_fn=["2*length:3", "exact_match"]))
        total, parts = r(batch(["abc", "7", "abcde"], refs=["0", "7", "0"]))
        assert parts["reward/length"].tolist() == [0.0, -2.0, -2.0]
        assert total.tolist() == [0.0, 2 * -2.0 + 1.0, 2 * -2.0]
    finally:
        kinds.KINDS.pop("length")
    assert "length" not in kinds.names()
