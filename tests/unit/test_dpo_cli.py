"""The DPO program's flags and train.py's ``--step2-method dpo`` plan."""

import pytest

from chatrl.cli import parse
from chatrl.pipeline import plan as planning
from chatrl.pipeline import presets as pipeline_presets
from chatrl.step2_dpo.main import build_parser

BASE = ["--model_name_or_path", "m", "--data_path", "Dahoas/rm-static", "--output_dir", "o"]


def test_dpo_flags_parse_with_deepspeed_chat_names_and_both_spellings():
    args = parse(build_parser(), [*BASE, "--beta", "0.2", "--label-smoothing", "0.1", "--loss_type", "ipo",
                                  "--precompute_ref_log_probs", "--offload_reference_model", "--zero_stage", "3",
                                  "--lora_dim", "8", "--only_optimize_lora"])
    assert (args.beta, args.label_smoothing, args.loss_type) == (0.2, 0.1, "ipo")
    assert args.precompute_ref_log_probs and args.offload_reference_model and args.zero_stage == 3
    with pytest.raises(SystemExit):
        parse(build_parser(), [*BASE, "--loss_type", "kto"])


def test_every_dpo_flag_has_help():
    p = build_parser()
    dpo = [a for g in p._action_groups if g.title == "DPO" for a in g._group_actions]
    assert {a.dest for a in dpo} >= {"beta", "label_smoothing", "loss_type", "simpo_gamma", "rpo_alpha",
                                     "precompute_ref_log_probs"}
    # every loss setting is a flag of the DPO block, read back typed by the program
    from dataclasses import fields

    from chatrl import config
    from chatrl.step2_dpo.loss import DPOConfig
    from chatrl.step2_dpo.main import DPOSettings

    assert {f.name for f in fields(DPOConfig)} <= {a.dest for a in dpo}
    s = config.read(DPOSettings, parse(build_parser(), [*BASE, "--rpo-alpha", "0.5"]))
    assert s.dpo.rpo_alpha == 0.5 and s.dpo == DPOConfig(rpo_alpha=0.5)
    assert all(a.help for a in dpo)
    offload = next(a for a in p._actions if a.dest == "offload_reference_model")
    assert "reference" in offload.help


def test_bad_dpo_settings_are_usage_errors(capsys):
    from chatrl.step2_dpo.main import run

    with pytest.raises(SystemExit):
        run([*BASE, "--loss_type", "hinge", "--label_smoothing", "0.1"])
    assert "--label_smoothing applies" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run([*BASE, "--rpo_alpha", "-1"])
    assert "--rpo_alpha must be >= 0, got -1.0" in capsys.readouterr().err


def _dpo_argv(models: dict, presets: dict, out: str) -> list[str]:
    return planning.command_flags({**models, **presets, "output_dir": out}, build_parser())


def test_train_py_dpo_plan_runs_dpo_on_the_step1_actor_and_no_step3(tmp_path):
    presets = pipeline_presets.size_preset(1.3, 0.35, "single_gpu", None, None)
    data = ["Dahoas/rm-static"]
    for s in (1, 2, 3):
        presets[s] = {"data_path": data, **presets[s]}
    dirs = {1: tmp_path / "step1_actor", 2: tmp_path / "step2_reward", 3: tmp_path / "step3_rlhf"}
    models = {1: {"model_name_or_path": "a"}, 2: {"model_name_or_path": "r"}, 3: {}}
    steps = pipeline_presets.dpo_plan(tmp_path, presets, dirs, models, [1, 2, 3])
    assert steps == [1, 2]
    assert dirs[2] == tmp_path / "step2_dpo" and models[2] == {"model_name_or_path": str(dirs[1])}
    args = parse(build_parser(), _dpo_argv(models[2], presets[2], str(dirs[2])))
    assert args.lora_dim == 128 and args.zero_stage == 3 and args.gradient_checkpointing  # step 1's actor set-up
    assert args.learning_rate == pytest.approx(9.65e-7) and args.beta == 0.1 and args.num_train_epochs == 1
    assert args.rpo_alpha == 1.0 and args.eval_eos_samples == 32  # the SFT term that keeps EOS (docs/dpo.md)
    assert args.data_path == data


def test_train_py_dpo_plan_of_every_preset_parses_with_the_dpo_parser(tmp_path):
    plans = [pipeline_presets.size_preset(a, r, d, None, None) for d in ("single_gpu", "single_node", "multi_node", "cpu")
             for a, r in ((0.125, 0.35), (1.3, 0.35), (6.7, 1.3), (13, 0.35), (66, 7))]
    plans.append(pipeline_presets.demo_plan(tmp_path)[2])
    for presets in plans:
        for s in (1, 2, 3):
            presets[s].setdefault("data_path", ["Dahoas/rm-static"])
        dirs = {1: tmp_path / "s1", 2: tmp_path / "s2", 3: tmp_path / "s3"}
        models = {1: {}, 2: {}, 3: {}}
        assert pipeline_presets.dpo_plan(tmp_path, presets, dirs, models, [1, 2, 3]) == [1, 2]
        args = parse(build_parser(), _dpo_argv(models[2], presets[2], "o"))  # SystemExit on a bad flag
        assert args.model_name_or_path == str(tmp_path / "s1") and args.rpo_alpha == 1.0


def test_train_py_dpo_plan_of_the_demo_uses_pair_data_only(tmp_path):
    _, _, presets = pipeline_presets.demo_plan(tmp_path)
    dirs = {1: tmp_path / "s1", 2: tmp_path / "s2", 3: tmp_path / "s3"}
    pipeline_presets.dpo_plan(tmp_path, presets, dirs, {1: {}, 2: {}, 3: {}}, [1, 2])
    args = parse(build_parser(), _dpo_argv({"model_name_or_path": "m"}, presets[2], "o"))
    assert all("hh-rlhf" in d for d in args.data_path) and len(args.data_path) == 2
    assert args.zero_stage == 3 and args.learning_rate == pytest.approx(2e-4)
