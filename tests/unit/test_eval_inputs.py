"""The evaluation's inputs and judges: held-out prompts are step 3's evaluation rows (multi-turn
conversations whole), model folders expand to checkpoint series, a pairwise judge asked in both orders
cancels its position bias, and a reward-model judge re-encodes text with its own tokenizer."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from chatrl.data.sources import read_source
from chatrl.data.split import parse_data_split, phase_rows
from chatrl.errors import UsageError
from chatrl.eval.inputs import expand_models, load_prompts
from chatrl.eval.judges import FunctionJudge, RewardModelJudge, ScoreCache, compare, load_judge
from tests.conftest import DATA, STORIES

HERE = Path(__file__).resolve().parent


def test_held_out_prompts_are_step3s_evaluation_rows():
    entry = str(DATA / "hh-rlhf" / "helpful-base")
    prompts = load_prompts([entry], split="2,4,4", split_seed=1234, eval_fraction=0.05)
    src = read_source(entry)
    _, held_out = phase_rows(src.n_rows, src.kind, 3, parse_data_split("2,4,4"), 1234, 0.05)
    assert [p.row for p in prompts] == [r for r in held_out.tolist() if r not in src.row_skips]
    assert len(prompts) == 47  # round(0.05 × 942 phase-3 rows)
    assert all(p.messages[-1]["role"] == "user" for p in prompts)
    assert any(len(p.messages) > 1 for p in prompts)  # multi-turn transcripts stay whole
    assert len(load_prompts([entry], split="2,4,4", max_prompts=5)) == 5
    every = load_prompts([entry + "[0:30]"])
    assert [p.row for p in every][:3] == [0, 1, 2]


def test_prompts_of_other_schemas_and_bad_entries(tmp_path):
    sharegpt = load_prompts([str(DATA / "sharegpt-dpo")])
    assert any(len(p.messages) >= 3 for p in sharegpt) and all(p.messages[-1]["role"] == "user" for p in sharegpt)
    plain = load_prompts([str(DATA / "prompts")])
    assert len(plain) == 250 and plain[0].messages == ({"role": "user", "content": "Can you tell me about GLaDOS?"},)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('"same"\n"same"\n"other"\n')
    assert [p.messages[0]["content"] for p in load_prompts([str(dup)])] == ["same", "other"]
    with pytest.raises(UsageError, match="--prompts .*nowhere"):
        load_prompts([str(tmp_path / "nowhere.jsonl")])
    with pytest.raises(UsageError, match="--prompts_split"):
        load_prompts([str(dup)], split="1,2")
    sft = str(DATA / "alpaca-instructions")
    with pytest.raises(UsageError, match="SFT-only data feeds no phase-3 row"):
        load_prompts([sft], split="2,4,4")


def _hf_folder(path: Path) -> Path:
    shutil.copytree(STORIES, path, ignore=shutil.ignore_patterns("LICENSE", "SOURCE.md"))
    return path


def test_model_folders_expand_to_checkpoint_series(tmp_path):
    dpo = _hf_folder(tmp_path / "step2_dpo")  # a DPO output: the model itself, with snapshots
    for step in (20, 10):
        _hf_folder(dpo / "snapshots" / f"step_{step}")
    (dpo / "snapshots" / "step_30").mkdir()  # unfinished: no config.json
    (dpo / "chatrl_run.json").write_text(json.dumps({"steps": 25}))
    got = expand_models([str(STORIES), str(dpo), f"mine={STORIES}"])
    assert [(c.label, c.step, c.run is not None) for c in got] == [
        ("stories260K", None, False), ("step2_dpo@10", 10, True), ("step2_dpo@20", 20, True),
        ("step2_dpo", 25, True), ("mine", None, False)]
    with pytest.raises(UsageError, match="no config.json"):
        expand_models([str(tmp_path)])


def test_a_pairwise_judge_in_both_orders_cancels_its_position_bias():
    judge = load_judge(f"{HERE / 'eval_judges.py'}:first_position_biased", "--judge")
    assert judge.pairwise
    prompts = [({"role": "user", "content": "q"},)] * 4
    a = ["short", "a longer answer", "same", "equal"]
    b = ["a longer answer", "short", "same", "EQUAL"]
    # asked alone (b first), the judge prefers b 0.9 / 0.7 / - / 0.8 of the time: position bias
    assert judge.prefer(prompts[:1], b[:1], a[:1]) == [pytest.approx(0.9)]
    out = compare(judge, prompts, a, b)
    assert out == pytest.approx(np.array([0.6, 0.4, 0.5, 0.5]))  # 0.5 ± 0.1 by length, bias gone


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, tiny_opt):
    """A random-head reward model on tiny OPT (GPT-2 BPE: another tokenizer than stories260K's)."""
    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, save_reward_model

    out = tmp_path_factory.mktemp("judge_rm") / "rm"
    tok = load_tokenizer(str(tiny_opt))
    save_reward_model(load_reward_model(str(tiny_opt), tok, require_head=False), tok, out)
    return out


def test_a_reward_model_judge_reads_text_with_its_own_tokenizer(reward_model):
    from chatrl.data.schema import Sample
    from chatrl.models.reward_model import encode_rows, score_sequences

    judge = RewardModelJudge(str(reward_model), max_seq_len=64, batch_size=2)
    prompts = [({"role": "user", "content": "Hi there"},),
               ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "And now?"})]
    answers = ["Once upon a time", "A tree."]
    got = judge.score(prompts, answers)
    enc = encode_rows(judge.rm.tokenizer, [Sample(p, a) for p, a in zip(prompts, answers, strict=True)], 64)
    want = score_sequences(judge.rm.model, [e[0] for e in enc], judge.rm.tokenizer.pad_token_id, 8, judge.rm.device)
    assert got == pytest.approx(want, abs=1e-6)
    cache = ScoreCache(judge)  # one score per (prompt, text): two models' equal answers get the same score
    cache.fill(prompts, [answers, ["A tree.", "A tree."]])
    assert cache(1, "A tree.") == pytest.approx(got[1], abs=1e-6) and len(cache.scores) == 3
    with pytest.raises(UsageError, match="does not fit --judge_max_seq_len"):
        RewardModelJudge(str(reward_model), max_seq_len=4).score(prompts[:1], ["a much longer answer than four"])


def test_function_judge_errors(tmp_path):
    with pytest.raises(UsageError, match="--judge nomodule:fn"):
        FunctionJudge("nomodule:fn")
    with pytest.raises(UsageError, match="--gold_judge .*is not a reward model"):
        RewardModelJudge(str(STORIES), "--gold_judge")


def test_a_built_in_rule_reward_judges_with_each_prompt_rows_reference(tmp_path):
    """train.py's evaluation of a rule-reward run passed `--judge exact_match`, refused as "no such
    folder"; and a function judge was given empty metadata, so exact_match had no reference to
    compare with. The held-out prompts now carry their rows' metadata to the judge."""
    from chatrl.eval.judges import conversation_key

    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "reference": str(i + 1)}) + "\n"
                            for i in range(3)))
    prompts = load_prompts([str(rows)])
    assert [p.metadata["reference"] for p in prompts] == ["1", "2", "3"]
    judge = load_judge("exact_match", "--judge")
    assert isinstance(judge, FunctionJudge)
    judge.metadata = {conversation_key(p.messages): p.metadata for p in prompts}
    conversations = [p.messages for p in prompts]
    assert judge.score(conversations, ["1", "5", "The answer is 3."]) == [1.0, 0.0, 1.0]
    with pytest.raises(UsageError, match="or a built-in reward"):
        load_judge("exact_mach", "--judge")


def test_every_reward_kind_is_a_judge():
    """The judges read the reward kinds' registry: a registered kind's value judges through its source,
    with the prompt as a transcript and its row's metadata, and so does a reward server's URL (read as a
    module name before, which failed to import)."""
    from chatrl.eval.judges import SourceJudge, conversation_key, transcript
    from chatrl.rewards import kinds
    from tests.unit.test_rewards import LengthKind

    assert isinstance(load_judge("http://127.0.0.1:9/score", "--judge"), SourceJudge)
    seen = []

    class Seen(LengthKind):
        def source(self, target, settings, context):
            inner = super().source(target, settings, context)
            return lambda batch: seen.append(batch) or inner(batch)

    kinds.register(Seen())
    try:
        judge = load_judge("length:2", "--gold_judge")
        assert isinstance(judge, SourceJudge)
        prompts = [({"role": "user", "content": "Hi"},), ({"role": "user", "content": "Yo"},)]
        judge.metadata = {conversation_key(prompts[0]): {"reference": "x"}}
        assert judge.score(prompts, ["ab", "abcde"]) == [0.0, -3.0]
        assert seen[0].prompts == [transcript(p) for p in prompts]
        assert seen[0].metadata == [{"reference": "x"}, {}]
    finally:
        kinds.KINDS.pop("length")


def test_snapshots_are_written_every_interval_but_the_last_and_listed_in_step_order(tmp_path, capsys):
    from chatrl.cli import parse
    from chatrl.distributed.weights import list_snapshots, save_snapshot_if_due
    from chatrl.models.causal_lm import load_causal_lm, load_tokenizer
    from chatrl.step3_ppo.main import build_parser

    tok = load_tokenizer(str(STORIES))
    model = load_causal_lm(str(STORIES), tok)
    written = [step for step in range(1, 13) if save_snapshot_if_due(5, step, 12, model, tok, tmp_path)]
    assert written == [5, 10] and save_snapshot_if_due(0, 10, 12, model, tok, tmp_path) is None
    assert [(s, p.name) for s, p in list_snapshots(tmp_path)] == [(5, "step_5"), (10, "step_10")]
    assert (tmp_path / "snapshots" / "step_5" / "tokenizer.json").exists()
    with pytest.raises(SystemExit):
        parse(build_parser(), ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--data_path",
                               "Dahoas/rm-static", "--output_dir", str(tmp_path / "o"), "--save_hf_interval", "-1"])
    assert "--save_hf_interval must be >= 0 (0: no snapshots), got -1" in capsys.readouterr().err
