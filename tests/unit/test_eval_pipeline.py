"""train.py's evaluation: the gold reward model's split is disjoint from step 2's and step 3's, and the
evaluation's command line follows the finished runs (their data, split, seed and lengths)."""

import importlib.util
import sys

import numpy as np

from chatrl.checkpoint import write_run_marker
from chatrl.data.split import parse_data_split, phase_parts
from tests.conftest import REPO


def _train():
    spec = importlib.util.spec_from_file_location("_chatrl_train_eval", REPO / "train.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_chatrl_train_eval"] = mod
    spec.loader.exec_module(mod)
    return mod


train = _train()


def test_the_gold_split_takes_step1s_rows():
    assert train.disjoint_split("2,4,4") == "0,2,8" and train.disjoint_split("1,1,2") == "0,1,3"
    for n in (10, 941, 2354):
        steps = phase_parts(n, parse_data_split("2,4,4"), 1234)
        gold = phase_parts(n, parse_data_split(train.disjoint_split("2,4,4")), 1234)
        assert np.array_equal(gold[1], steps[0])  # the gold model's pairs are step 1's rows
        assert not set(gold[1]) & (set(steps[1]) | set(steps[2]))  # none of step 2's pairs or step 3's prompts


def _settings(argv):
    return train.config.read(train.PipelineSettings, train.build_parser().parse_args(train.normalize_argv(argv)))


def _pipeline(tmp_path, step3_args):
    out = tmp_path / "out"
    dirs = {1: out / "step1_actor", 2: out / "step2_reward", 3: out / "step3_rlhf"}
    for d in dirs.values():
        d.mkdir(parents=True)
    write_run_marker(str(dirs[2]), {"step": 2, "args": {"max_seq_len": 256}})
    write_run_marker(str(dirs[3]), {"step": 3, "args": step3_args})
    return out, dirs


def test_the_evaluation_follows_the_finished_runs(tmp_path):
    args3 = {"data_path": ["a.jsonl", "b.jsonl"], "data_split": "2,4,4", "seed": 7, "max_answer_seq_len": 48,
             "max_prompt_seq_len": 128, "actor_model_name_or_path": "/x/step1_actor", "dtype": "fp32"}
    out, dirs = _pipeline(tmp_path, args3)
    s = _settings(["--preset", "demo", "--gold-reward-model", "m", "--eval-args", "--seeds 1"])
    assert s.evaluation.gold_reward_model == "m" and s.evaluation.eval_args == "--seeds 1"
    flags = train.eval_flags(s, out, dirs, None, out / "step2_gold_reward")
    argv = train.command_flags(flags, train.eval_parser())
    a = train.eval_parser().parse_args(argv)
    assert a.models == [str(dirs[1]), str(dirs[3])] and a.prompts == ["a.jsonl", "b.jsonl"]
    assert (a.prompts_split, a.split_seed, a.max_answer_seq_len, a.max_prompt_seq_len) == ("2,4,4", 7, 48, 128)
    assert a.judge == str(dirs[2]) and a.gold_judge == str(out / "step2_gold_reward")
    assert a.reference == "/x/step1_actor" and a.judge_max_seq_len == 256 and a.disable_progress_bar
    # the reward from one --reward-fn and no step 2: that function judges
    rule = _settings(["--preset", "demo", "--reward-fn", "exact_match", "--rl-algorithm", "grpo"])
    assert train.eval_flags(rule, out, dirs, "skipped", None)["judge"] == "exact_match"
    # DPO: no step 2 reward model; the gold one judges when there is one
    dpo = _settings(["--preset", "demo", "--step2-method", "dpo"])
    dirs[2] = out / "step2_dpo"
    dirs[2].mkdir()
    write_run_marker(str(dirs[2]), {"step": "2-dpo", "args": {"data_path": ["a.jsonl"], "max_seq_len": 256,
                                                               "eval_max_new_tokens": 64}})
    f = train.eval_flags(dpo, out, dirs, None, None)
    assert f["judge"] is None and f["models"] == [str(dirs[1]), str(dirs[2])]
    assert (f["max_answer_seq_len"], f["max_prompt_seq_len"]) == (64, 192)
