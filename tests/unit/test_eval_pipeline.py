"""train.py's evaluation: the gold reward model's split is disjoint from step 2's and step 3's, its run is
step 2's program on it, and the evaluation's command line follows the finished runs (their data, split,
seed and lengths)."""

import importlib.util
import json
import sys

import numpy as np

from chatrl.checkpoint import write_run_marker
from chatrl.data.split import parse_data_split, phase_parts
from chatrl.pipeline import evaluation
from chatrl.pipeline import plan as planning
from chatrl.pipeline import presets as pipeline_presets
from tests.conftest import REPO, STORIES


def _train():
    spec = importlib.util.spec_from_file_location("_chatrl_train_eval", REPO / "train.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_chatrl_train_eval"] = mod
    spec.loader.exec_module(mod)
    return mod


train = _train()


def test_the_gold_split_takes_step1s_rows():
    assert evaluation.disjoint_split("2,4,4") == "0,2,8" and evaluation.disjoint_split("1,1,2") == "0,1,3"
    for n in (10, 941, 2354):
        steps = phase_parts(n, parse_data_split("2,4,4"), 1234)
        gold = phase_parts(n, parse_data_split(evaluation.disjoint_split("2,4,4")), 1234)
        assert np.array_equal(gold[1], steps[0])  # the gold model's pairs are step 1's rows
        assert not set(gold[1]) & (set(steps[1]) | set(steps[2]))  # none of step 2's pairs or step 3's prompts


def test_the_gold_reward_model_is_step2_on_the_other_rows(tmp_path):
    pipe = train.plan(["--preset", "demo", "--output-dir", str(tmp_path / "out"), "--gold-reward-model",
                       str(STORIES), "--step2-args", "--data_split 1,1,2 --seed 7"])
    run = evaluation.gold_reward_run(pipe)
    a = train.step2_parser().parse_args(run.argv)
    assert run.module == "chatrl.step2_reward" and run.out_dir == tmp_path / "out" / "step2_gold_reward"
    assert a.model_name_or_path == str(STORIES) and a.output_dir == str(run.out_dir)
    assert (a.data_split, a.seed) == ("0,1,3", 7)  # step 2's own split (--step2-args wins), disjoint; its seed
    assert a.data_path == pipeline_presets.demo_plan(tmp_path)[2][2]["data_path"] and not run.finished
    assert a.dtype == "fp32"  # the demo pins fp32 for every step: the gold judge too


def test_the_gold_reward_model_takes_step2s_dtype(tmp_path):
    # the smollm2 preset leaves --dtype auto: step 2 and the gold judge both get it (the gold judge ran fp32)
    pipe = train.plan(["--preset", "smollm2", "--output-dir", str(tmp_path / "out")])
    step2 = train.step2_parser().parse_args(next(r for r in pipe.runs if r.step == 2).argv)
    gold = train.step2_parser().parse_args(evaluation.gold_reward_run(pipe).argv)
    assert step2.dtype == gold.dtype == "auto"
    pipe = train.plan(["--preset", "smollm2", "--output-dir", str(tmp_path / "out"), "--dtype", "fp32"])
    assert train.step2_parser().parse_args(evaluation.gold_reward_run(pipe).argv).dtype == "fp32"


def _finished(dirs, step3_args, step2_args=None):
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    write_run_marker(str(dirs[2]), {"step": 2, "args": step2_args or {"max_seq_len": 256}})
    write_run_marker(str(dirs[3]), {"step": 3, "args": step3_args})


def test_the_evaluation_follows_the_finished_runs(tmp_path):
    out = tmp_path / "out"
    pipe = train.plan(["--preset", "demo", "--output-dir", str(out), "--gold-reward-model", "m",
                       "--eval-args", "--seeds 1"])
    assert pipe.settings.evaluation.gold_reward_model == "m" and pipe.settings.evaluation.eval_args == "--seeds 1"
    args3 = {"data_path": ["a.jsonl", "b.jsonl"], "data_split": "2,4,4", "seed": 7, "max_answer_seq_len": 48,
             "max_prompt_seq_len": 128, "actor_model_name_or_path": "/x/step1_actor", "dtype": "fp32"}
    _finished(pipe.dirs, args3)
    argv = planning.command_flags(evaluation.eval_flags(pipe, out / "step2_gold_reward"), train.eval_parser())
    a = train.eval_parser().parse_args(argv)
    assert a.models == [str(pipe.dirs[1]), str(pipe.dirs[3])] and a.prompts == ["a.jsonl", "b.jsonl"]
    assert (a.prompts_split, a.split_seed, a.max_answer_seq_len, a.max_prompt_seq_len) == ("2,4,4", 7, 48, 128)
    assert a.judge == str(pipe.dirs[2]) and a.gold_judge == str(out / "step2_gold_reward")
    assert a.reference == "/x/step1_actor" and a.judge_max_seq_len == 256 and a.disable_progress_bar
    assert a.seeds == pipeline_presets.DEMO_EVAL["seeds"]


def test_the_judge_without_step2_and_after_dpo(tmp_path):
    # a rule reward needs prompt rows with references: step 1 its SFT rows, step 3 its prompt rows (one list)
    sft, prompts = tmp_path / "sft.jsonl", tmp_path / "prompts.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"What is {a} + 1?", "chosen": str(a + 1)}) + "\n" for a in range(40)))
    prompts.write_text("".join(json.dumps({"prompt": f"What is {a} + 2?", "reference": str(a + 2)}) + "\n"
                               for a in range(40)))
    rule = train.plan(["--preset", "demo", "--output-dir", str(tmp_path / "r"), "--reward-fn", "exact_match",
                       "--rl-algorithm", "grpo", "--data-path", str(sft), str(prompts)])
    _finished(rule.dirs, {"data_path": ["a.jsonl"]})
    assert evaluation.eval_flags(rule, None)["judge"] == "exact_match"  # the one function is the judge
    weighted = train.plan(["--preset", "demo", "--output-dir", str(tmp_path / "w"), "--reward-fn",
                           "0.5*exact_match", "--rl-algorithm", "grpo", "--data-path", str(sft),
                           str(prompts)])
    _finished(weighted.dirs, {"data_path": ["a.jsonl"]})
    assert evaluation.eval_flags(weighted, None)["judge"] == "exact_match"  # the weight is no part of its name
    dpo = train.plan(["--preset", "demo", "--output-dir", str(tmp_path / "d"), "--step2-method", "dpo"])
    assert dpo.dirs[2].name == "step2_dpo"
    dpo.dirs[2].mkdir(parents=True)
    write_run_marker(str(dpo.dirs[2]), {"step": "2-dpo", "args": {"data_path": ["a.jsonl"], "max_seq_len": 256,
                                                                   "eval_max_new_tokens": 64}})
    f = evaluation.eval_flags(dpo, None)  # no reward model: no judge (win rates) unless a gold one is trained
    assert f["judge"] is None and f["models"] == [str(dpo.dirs[1]), str(dpo.dirs[2])]
    assert (f["max_answer_seq_len"], f["max_prompt_seq_len"]) == (64, 192)
    assert evaluation.eval_flags(dpo, tmp_path / "gold")["judge"] == str(tmp_path / "gold")
