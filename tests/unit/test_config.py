"""The typed configuration (chatrl.config): every program's parser is generated from its blocks,
every flag has help, DeepSpeed-Chat's names and the dash spellings parse, presets parse, and the
derived sizes of each step are checked."""

import argparse
import importlib
import sys
from pathlib import Path

import pytest

from chatrl import config
from chatrl.cli import parse
from chatrl.pipeline import plan as planning
from chatrl.pipeline import presets as pipeline_presets

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import chat  # noqa: E402
import train  # noqa: E402

PROGRAMS = {
    "step1": "chatrl.step1_sft.main", "step2": "chatrl.step2_reward.main", "score": "chatrl.step2_reward.score",
    "step3": "chatrl.step3_ppo.main", "dpo": "chatrl.step2_dpo.main", "eval": "chatrl.eval.main",
    "check_template": "chatrl.tools.check_template",
}


def parsers() -> dict[str, argparse.ArgumentParser]:
    out = {name: importlib.import_module(mod).build_parser() for name, mod in PROGRAMS.items()}
    out["train.py"] = train.build_parser()
    out["chat.py"] = chat.build_parser()
    return out


@pytest.mark.parametrize("program", [*PROGRAMS, "train.py", "chat.py"])
def test_every_flag_has_help(program):
    p = parsers()[program]
    missing = [a.option_strings[0] for a in p._actions if a.option_strings and not (a.help or "").strip()]
    assert not missing, f"{program}: flags without help: {missing}"
    assert "--" in p.format_help()  # --help renders (a stray % in a help text would raise here)


def test_step3_keeps_deepspeed_chat_flag_names_and_prefixes():
    dests = {a.dest for a in parsers()["step3"]._actions}
    for name in ("actor_model_name_or_path", "critic_model_name_or_path", "reward_model_name_or_path",
                 "actor_zero_stage", "critic_zero_stage", "actor_learning_rate", "critic_learning_rate",
                 "actor_weight_decay", "critic_weight_decay", "actor_lora_dim", "critic_lora_module_name",
                 "actor_dropout", "critic_gradient_checkpointing", "per_device_generation_batch_size",
                 "per_device_training_batch_size", "generation_batches", "ppo_epochs", "unsupervised_dataset_name",
                 "unsup_coef", "enable_hybrid_engine", "inference_tp_size", "tp_gather_partition_size",
                 "release_inference_cache", "offload_reference_model", "init_kl_coef", "kl_ctl", "enable_ema",
                 "lr_scheduler_type", "num_warmup_steps", "save_interval", "print_answers"):
        assert name in dests, name
    # shared settings are one flag, not one per model
    assert "dtype" in dests and "actor_dtype" not in dests and "actor_lr_scheduler_type" not in dests
    assert "learning_rate" not in dests and "zero_stage" not in dests


def test_defaults_and_dash_spellings(tmp_path):
    p = parsers()
    base3 = ["--actor-model-name-or-path", "a", "--critic_model_name_or_path", "c", "--data-path", "Dahoas/rm-static",
             "--output-dir", str(tmp_path)]
    a3 = parse(p["step3"], [*base3, "--actor-zero-stage", "3", "--per-device-generation-batch-size", "8"])
    assert a3.actor_zero_stage == 3 and a3.critic_zero_stage == 0 and a3.per_device_generation_batch_size == 8
    # a run-length default is unset here; the size plan adapts it (chatrl.sizes.warmup_steps: 100, cut to a short run)
    assert (a3.actor_learning_rate, a3.critic_learning_rate, a3.num_warmup_steps) == (9.65e-6, 5e-6, None)
    base = ["--model_name_or_path", "m", "--data_path", "Dahoas/rm-static", "--output_dir", str(tmp_path)]
    a1, a2 = parse(p["step1"], base), parse(p["step2"], base)
    assert (a1.learning_rate, a2.learning_rate) == (1e-3, 5e-5)
    # one default for the data cache, whichever step reads it
    assert a1.data_output_path == a2.data_output_path == a3.data_output_path
    # the typed PPO block read back from the flags is what the trainer takes
    ppo = config.from_args(config.PPOConfig, parse(p["step3"], [*base3, "--cliprange", "0.1", "--whiten_advantages"]))
    assert isinstance(ppo, config.PPOConfig) and ppo.cliprange == 0.1 and ppo.whiten_advantages
    assert ppo.per_device_training_batch_size == 4 and ppo.ppo_epochs == 1
    model = config.from_args(config.ModelConfig, parse(p["step3"], [*base3, "--critic_dropout", "0.0"]), "critic_")
    assert model.model_name_or_path == "c" and model.dropout == 0.0 and model.dtype == "fp32"


def test_add_block_refuses_unknown_default_and_to_argv_unknown_flag():
    with pytest.raises(ValueError, match="learning_rat"):
        config.add_block(config.new_parser("x"), config.OptimConfig, defaults={"learning_rat": 1.0})
    with pytest.raises(KeyError, match="actor_zero_stage"):
        config.to_argv(parsers()["step1"], {"actor_zero_stage": 3})


def _preset_plans(tmp_path):
    for deployment in ("single_gpu", "single_node", "multi_node", "cpu"):
        for actor_b, reward_b in ((0.125, 0.35), (1.3, 0.35), (6.7, 1.3), (13, 0.35), (66, 7)):
            yield f"{deployment}-{actor_b}b", pipeline_presets.size_preset(actor_b, reward_b, deployment, None, None)
    yield "demo", pipeline_presets.demo_plan(tmp_path)[2]


def test_every_train_preset_parses_with_each_steps_parser(tmp_path):
    p = parsers()
    models = {"step1": ["--model_name_or_path", "m"], "step2": ["--model_name_or_path", "m"],
              "step3": ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c"]}
    n = 0
    for name, presets in _preset_plans(tmp_path):
        for s in (1, 2, 3):
            parser = p[f"step{s}"]
            argv = [*models[f"step{s}"], *planning.command_flags(presets[s], parser), "--output_dir", str(tmp_path / "o")]
            if "--data_path" not in argv:
                argv += ["--data_path", "Dahoas/rm-static"]
            args = parser.parse_args(argv)  # SystemExit on any unknown or malformed flag
            assert args.output_dir == str(tmp_path / "o"), name
            n += 1
    assert n == 21 * 3
    demo = pipeline_presets.demo_plan(tmp_path)[2][3]  # presets stay data until the command line is written
    assert demo["actor_zero_stage"] == 3 and demo["enable_hybrid_engine"] is True
