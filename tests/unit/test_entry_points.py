"""Train.py's planning, chat.py's history trimming, and the shared CLI's flag spellings."""

import importlib.util
import sys

import pytest

from chatrl.checkpoint import check_output_dir, write_run_marker
from chatrl.cli import normalize_argv
from chatrl.errors import UsageError
from chatrl.models.causal_lm import load_tokenizer
from chatrl.pipeline import evaluation
from chatrl.pipeline import plan as planning
from chatrl.pipeline import presets as pipeline_presets
from tests.conftest import REPO, STORIES


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_chatrl_{name}", REPO / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"_chatrl_{name}"] = mod
    spec.loader.exec_module(mod)
    return mod


train = _load("train")
chat = _load("chat")


def test_dash_and_underscore_flags_are_the_same():
    assert normalize_argv(["--per-device-train-batch-size", "4", "--data-path=a-b.jsonl", "-x", "val-ue"]) == [
        "--per_device_train_batch_size", "4", "--data_path=a-b.jsonl", "-x", "val-ue"]


def test_finished_output_is_not_clobbered(tmp_path):
    check_output_dir(str(tmp_path), overwrite=False)  # empty folder: fine
    write_run_marker(str(tmp_path), {"step": 1})
    with pytest.raises(UsageError, match="--overwrite_output_dir"):
        check_output_dir(str(tmp_path), overwrite=False)
    check_output_dir(str(tmp_path), overwrite=True)


def test_model_names_and_sizes():
    assert planning.resolve_model("opt-13b") == "facebook/opt-13b"
    assert planning.resolve_model("OPT-1.3b") == "facebook/opt-1.3b"
    assert planning.resolve_model("meta-llama/Llama-2-7b-hf") == "meta-llama/Llama-2-7b-hf"
    assert planning.resolve_model(str(STORIES)) == str(STORIES.resolve())
    assert pipeline_presets.size_in_billions("facebook/opt-350m") == pytest.approx(0.35)
    assert pipeline_presets.size_in_billions("facebook/opt-13b") == 13.0
    assert pipeline_presets.size_in_billions("meta-llama/Llama-2-7b-hf") == 7.0


def test_size_presets_scale_with_model_and_deployment():
    small = pipeline_presets.size_preset(1.3, 0.35, "single_gpu", None, None)
    big = pipeline_presets.size_preset(13, 0.35, "single_node", None, None)
    huge_one_gpu = pipeline_presets.size_preset(13, 0.35, "single_gpu", None, None)
    assert small[1]["lora_dim"] == 128 and not small[1]["offload"]
    assert big[3]["actor_zero_stage"] == 3 and big[3]["inference_tp_size"] == 2
    assert huge_one_gpu[1]["offload"] and huge_one_gpu[3]["offload_reference_model"]
    forced = pipeline_presets.size_preset(13, 0.35, "single_node", 2, 1)
    assert forced[1]["zero_stage"] == 2 and forced[2]["zero_stage"] == 1


def test_presets_turn_packing_on_for_the_families_it_serves(tmp_path):
    """--packing where every model of a step is of a family whose packed path is tested (OPT, Llama,
    Qwen2), read from a local folder's config or a hub name; off otherwise."""
    from transformers import GPT2Config

    assert pipeline_presets.packing_family("facebook/opt-1.3b") == "opt"
    assert pipeline_presets.packing_family("meta-llama/Llama-2-7b-hf") == "llama" and pipeline_presets.packing_family("Qwen/Qwen2-7B") == "qwen2"
    assert pipeline_presets.packing_family(str(STORIES)) == "llama"  # the demo's model, from its config.json
    GPT2Config(n_embd=16, n_layer=1, n_head=2).save_pretrained(tmp_path)
    assert pipeline_presets.packing_family(str(tmp_path)) is None and pipeline_presets.packing_family("EleutherAI/gpt-j-6b") is None
    demo = pipeline_presets.with_packing(pipeline_presets.demo_plan(tmp_path / "out")[2], str(STORIES), str(STORIES))
    assert all(demo[s]["packing"] for s in (1, 2, 3))
    mixed = pipeline_presets.with_packing(pipeline_presets.size_preset(1.3, 0.35, "single_gpu", None, None), "facebook/opt-1.3b",
                               str(tmp_path))
    assert mixed[1]["packing"] and "packing" not in mixed[2] and "packing" not in mixed[3]


def test_multi_node_needs_a_hostfile(tmp_path):
    with pytest.raises(SystemExit, match="hostfile"):
        planning.launcher("multi_node", None, str(tmp_path / "missing"), None)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=8\nnode2 slots=8\n")
    cmd, _ = planning.launcher("multi_node", None, str(hostfile), 29600)
    assert cmd[-4:] == ["--hostfile", str(hostfile), "--master_port", "29600"]


def test_the_evaluation_takes_the_cores_the_cpu_ranks_held(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for ranks in (2, 3):
        cmd, env = planning.launcher("cpu", ranks, "", 29600)
        pipe = planning.Pipeline(None, tmp_path, cmd, env, None, {}, [], [])
        assert env["OMP_NUM_THREADS"] == "1"  # each rank: one intra-op thread
        assert pipe.eval_env == {**env, "OMP_NUM_THREADS": str(ranks)}  # the evaluation alone: all of them
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert pipe.eval_env["OMP_NUM_THREADS"] == "5"
    cmd, env = planning.launcher("single_gpu", None, "", 29600)
    assert planning.Pipeline(None, tmp_path, cmd, env, None, {}, [], []).eval_env == {"OMP_NUM_THREADS": "5"}


def test_chat_history_is_trimmed_from_the_oldest_turn_and_keeps_markers_intact():
    tok = load_tokenizer(str(STORIES), padding_side="left")
    marker_msg = "please repeat: \n\nAssistant: hello"
    history = [{"role": "user", "content": "first question " * 20}, {"role": "assistant", "content": "first answer " * 20},
               {"role": "user", "content": "second question"}, {"role": "assistant", "content": "second answer"},
               {"role": "user", "content": marker_msg}]
    full_ids, kept = chat.prompt_ids_within(tok, history, budget=10_000)
    assert kept == history
    ids, kept = chat.prompt_ids_within(tok, history, budget=len(full_ids) - 1)
    assert kept == history[2:]  # the oldest exchange went, whole
    assert kept[-1]["content"] == marker_msg
    assert marker_msg in tok.decode(ids)
    ids, kept = chat.prompt_ids_within(tok, history, budget=8)  # only the newest turn, cut from the left
    assert kept == history[-1:] and len(ids) == 8


def test_missing_local_data_path_is_refused_at_parse_time(tmp_path):
    from chatrl.cli import parse
    from chatrl.step1_sft.main import build_parser

    good = tmp_path / "d.jsonl"
    good.write_text('{"prompt": "a", "chosen": "b"}\n')
    args = parse(build_parser(), ["--model_name_or_path", "m", "--data_path", str(good) + "[0:1]",
                                  "Dahoas/rm-static", "--output_dir", str(tmp_path / "o")])
    assert args.data_path[1] == "Dahoas/rm-static"  # hub names are left to the data layer
    with pytest.raises(SystemExit):
        parse(build_parser(), ["--model_name_or_path", "m", "--data_path", "nope.jsonl", "--output_dir", "o"])


def test_demo_plan_uses_each_data_set_once_per_step(tmp_path):
    _, _, presets = pipeline_presets.demo_plan(tmp_path)
    for step in (1, 2, 3):
        paths = presets[step]["data_path"]
        assert len(paths) == len(set(paths)), (step, paths)
    assert any("alpaca" in p for p in presets[1]["data_path"]) and not any("alpaca" in p for p in presets[2]["data_path"])


@pytest.mark.parametrize("module", ["chatrl.step1_sft.main", "chatrl.step2_reward.main", "chatrl.step3_ppo.main"])
def test_checkpoint_flags_are_checked_at_parse_time(tmp_path, module, capsys):
    import importlib

    from chatrl.cli import parse

    build = importlib.import_module(module).build_parser
    base = (["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c"] if "step3" in module
            else ["--model_name_or_path", "m"])
    base += ["--data_path", "Dahoas/rm-static", "--output_dir", str(tmp_path / "o")]
    args = parse(build(), [*base, "--save_interval", "5", "--resume"])
    assert args.save_interval == 5 and args.resume and args.save_total_limit == 2 and args.max_nonfinite_steps == 10
    for bad, says in [(["--save_total_limit", "0"], "--save_total_limit must be >= 1"),
                      (["--save_interval", "-1"], "--save_interval must be >= 0"),
                      (["--resume_from_checkpoint", str(tmp_path)], "not a complete chatrl checkpoint"),
                      (["--resume_from_checkpoint", str(tmp_path / "nope")], "no such folder")]:
        with pytest.raises(SystemExit):
            parse(build(), [*base, *bad])
        assert says in capsys.readouterr().err


def _chat_answer(monkeypatch, capsys, *flags) -> str:
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO("Tell me a story.\n"))
    chat.main(["--path", str(STORIES), "--max_new_tokens", "12", "--device", "cpu", *flags])
    return capsys.readouterr().out.split("Assistant:", 1)[1]


def test_terminal_chat_prints_one_space_after_assistant(monkeypatch, capsys):
    """The answer streamed right after "Assistant:" read "Assistant:He"; it reads "Assistant: He"."""
    answer = _chat_answer(monkeypatch, capsys, "--greedy")
    assert answer.startswith(" ") and not answer.startswith("  ") and answer.strip()


def test_chat_temperature_0_is_greedy_decoding(monkeypatch, capsys):
    """--temperature 0 crashed in transformers; it means greedy decoding."""
    greedy = _chat_answer(monkeypatch, capsys, "--greedy")
    assert _chat_answer(monkeypatch, capsys, "--temperature", "0", "--seed", "1") == greedy
    assert _chat_answer(monkeypatch, capsys, "--temperature", "0", "--seed", "2") == greedy
    with pytest.raises(SystemExit):
        chat.main(["--path", str(STORIES), "--temperature", "-1"])
    assert "--temperature must be >= 0" in capsys.readouterr().err


def _parsers():
    """Every chatrl program's parser, with a flag prefix it must refuse and the flag it abbreviates."""
    from chatrl.step1_sft.main import build_parser as step1
    from chatrl.step2_dpo.main import build_parser as dpo
    from chatrl.step2_reward.main import build_parser as step2
    from chatrl.step2_reward.score import build_parser as score
    from chatrl.step3_ppo.main import build_parser as step3
    from chatrl.tools.reward_server import build_parser as server

    base = ["--model_name_or_path", "m", "--data_path", "Dahoas/rm-static", "--output_dir", "o"]
    base3 = ["--actor_model_name_or_path", "a", "--data_path", "Dahoas/rm-static", "--output_dir", "o"]
    return [(step1(), [*base, "--learning_rat", "1e-3"], "--learning_rate"),
            (step2(), [*base, "--per_device_train_batch", "2"], "--per_device_train_batch_size"),
            (dpo(), [*base, "--bet", "0.2"], "--beta"),
            (step3(), [*base3, "--actor_learning_rat", "1e-5"], "--actor_learning_rate"),
            (score(), ["--model", "m", "--promp", "p"], "--prompt"),
            (chat.build_parser(), ["--path", "p", "--max_new_token", "5"], "--max_new_tokens"),
            (server(), ["--reward_fn", "exact_match", "--por", "0"], "--port"),
            (train.build_parser(), ["--preset", "demo", "--step1-arg", "x"], "--step1_args")]


def test_no_program_accepts_abbreviations_and_a_usage_error_is_one_line_from_rank_0(monkeypatch, capsys):
    """A prefix of a flag (`--learning_rat`) was accepted silently (argparse abbreviations); every chatrl
    program refuses it now, naming the flag it resembles, in one line (no usage dump), on rank 0 only."""
    for parser, argv, meant in _parsers():
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and not parser.allow_abbrev
        assert f"unrecognized arguments: {argv[-2]} {argv[-1]}" in err and f"→ {meant}?" in err, err
        assert "usage:" not in err and len(err.strip().splitlines()) == 2, err
        monkeypatch.setenv("RANK", "1")  # the other ranks of a launch exit quietly with the same code
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(argv)
        assert exit_.value.code == 2 and capsys.readouterr().err == ""
    from chatrl.tools import report

    with pytest.raises(SystemExit):
        report.main(["o", "--ou", "x.html"])
    assert "unrecognized arguments: --ou" in capsys.readouterr().err


def test_train_py_checks_every_step_command_before_launching(tmp_path):
    """A typo or a missing data path in --stepN-args stops train.py at once, naming the step, before
    step 1 runs (before: the step's usage on every rank, ~100 lines, and a summary without the cause)."""
    out = ["--output-dir", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as e:
        train.plan(["--preset", "demo", *out, "--step1-args", "--learning_rat 1e-3"])
    assert str(e.value) == ("train.py: step 1 (supervised fine-tuning) flags: unrecognized arguments: --learning_rat "
                            "1e-3 (did you mean: --learning_rat → --learning_rate?)")
    with pytest.raises(SystemExit) as e:
        train.plan(["--preset", "demo", *out, "--step3-args", "--unsupervised_dataset_name nope.jsonl"])
    assert str(e.value).startswith("train.py: step 3 (RLHF, ppo) flags: --unsupervised_dataset_name ")
    assert str(e.value).endswith("nope.jsonl: no such file or folder")
    # the cause of a step that fails anyway is among the pipeline's last lines
    assert train._failure_lines("python -m chatrl.step1_sft: error: --data_path x.jsonl: no such file or folder\n") \
        == ["python -m chatrl.step1_sft: error: --data_path x.jsonl: no such file or folder"]


def test_train_py_reads_local_paths_from_the_callers_folder(tmp_path):
    """`cd DATA && python REPO/train.py … --data-path rows.jsonl.gz[0:128]` failed in step 1 (the steps run
    from the repository). Every local path is now made absolute against the caller's folder before
    the steps start; hub names and module specs are left alone."""
    import gzip

    data = tmp_path / "DATA"
    (data / "model").mkdir(parents=True)
    (data / "model" / "config.json").write_text("{}")
    with gzip.open(data / "rows.jsonl.gz", "wt") as f:
        f.write('{"prompt": "What is 1 + 1?", "reference": "2"}\n')
    (data / "ptx.jsonl").write_text('{"prompt": "a", "chosen": "b"}\n')
    (data / "my_reward.py").write_text("def score(p, a, m):\n    return [0.0] * len(a)\n")
    (data / "hosts").write_text("node-a slots=2\nnode-b slots=2\n")
    pipe = train.plan(["--actor-model", "model", "--data-path", "rows.jsonl.gz[0:128]", "Dahoas/rm-static",
                       "--rl-algorithm", "grpo", "--reward-fn", "my_reward.py:score",
                       "chatrl.rewards.builtin:regex_format", "exact_match",
                       "--deployment-type", "multi_node", "--hostfile", "hosts", "--node-rank", "1",
                       "--output-dir", "out", "--step", "1", "3",
                       "--step3-args", "--unsupervised_dataset_name ptx.jsonl --reward_fn 0.5*my_reward.py:score "
                                       "--tensorboard_path=tb --critic_model_name_or_path facebook/opt-350m"],
                      cwd=data)
    assert pipe.out == data / "out" and pipe.nodes[0] == {"node-a": 2, "node-b": 2}
    assert str(data / "hosts") in pipe.launcher
    step1, step3 = (" ".join(r.argv) for r in pipe.runs)
    assert f"--model_name_or_path {data / 'model'} " in step1 and f"--output_dir {data / 'out' / 'step1_actor'}" in step1
    assert f"--data_path {data / 'rows.jsonl.gz'}[0:128] Dahoas/rm-static " in step1
    assert f"--reward_fn {data / 'my_reward.py'}:score chatrl.rewards.builtin:regex_format exact_match " in step3
    assert f"--unsupervised_dataset_name {data / 'ptx.jsonl'} --reward_fn 0.5*{data / 'my_reward.py'}:score" in step3
    assert f"--tensorboard_path={data / 'tb'} --critic_model_name_or_path facebook/opt-350m" in step3


def test_demo_warmups_are_fractions_that_keep_the_demos_steps_and_fit_a_short_run(tmp_path):
    """The demo's warm-ups were 10 / 10 / 5 steps (and DPO's 10): presets the steps saw as given values,
    so `--preset demo --step3-args "--max_steps 3"` was refused. As fractions of each run they give the
    same steps on the demo's runs (114, 91, 40; DPO 46) and fit any shorter one."""
    from chatrl.sizes import warmup_steps

    _, _, presets = pipeline_presets.demo_plan(tmp_path)
    dirs, models = {1: tmp_path / "s1", 2: tmp_path / "s2", 3: tmp_path / "s3"}, {1: {}, 2: {}, 3: {}}
    for step, total, before in ((1, 114, 10), (2, 91, 10), (3, 40, 5)):
        fraction = presets[step]["num_warmup_steps"]
        assert warmup_steps(fraction, 0, total, "steps") == (before, None)
        assert warmup_steps(fraction, 0, 3, "steps")[0] < 3
    pipeline_presets.dpo_plan(tmp_path, presets, dirs, models, [1, 2])
    assert warmup_steps(presets[2]["num_warmup_steps"], 0, 46, "steps") == (10, None)


def test_train_py_dtype_auto_by_default_the_demo_pins_fp32_and_a_given_dtype_wins(tmp_path):
    """train.py's --dtype defaults to auto; the demo preset pins fp32 (its bf16 figures came out lower,
    docs/precision.md); a --dtype the user gives wins over a preset's; DPO takes step 1's dtype."""
    out = ["--output-dir", str(tmp_path / "o")]

    def dtypes(argv):
        runs = train.plan(argv).runs
        return {r.step: r.argv[r.argv.index("--dtype") + 1] for r in runs}

    assert dtypes(["--preset", "demo", *out]) == {1: "fp32", 2: "fp32", 3: "fp32"}
    assert dtypes(["--preset", "demo", *out, "--dtype", "bf16"]) == {1: "bf16", 2: "bf16", 3: "bf16"}
    assert dtypes(["--preset", "demo", *out, "--step2-method", "dpo"]) == {1: "fp32", 2: "fp32"}
    from tests.conftest import DATA, STORIES

    own = ["--actor-model", str(STORIES), "--reward-model", str(STORIES), "--deployment-type", "cpu",
           "--data-path", str(DATA / "hh-rlhf" / "helpful-base"), *out]
    assert dtypes(own) == {1: "auto", 2: "auto", 3: "auto"}  # each step resolves it and prints its choice


def test_a_data_path_given_with_the_demo_preset_wins_and_a_missing_one_is_refused(tmp_path):
    """`train.py --preset demo --data-path X` ran the whole demo on the preset's data without a word,
    even with a misspelt X; the user's --data-path now feeds every step, and one that does not exist
    is refused in one line before any step starts."""
    rows = tmp_path / "mine.jsonl"
    rows.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' * 40)
    out = ["--output-dir", str(tmp_path / "o")]
    runs = train.plan(["--preset", "demo", *out, "--data-path", str(rows)]).runs
    for r in runs:
        i = r.argv.index("--data_path")
        assert r.argv[i + 1:i + 3] == [str(rows), "--data_split"], (r.step, r.argv[i:i + 4])
    with pytest.raises(SystemExit) as e:
        train.plan(["--preset", "demo", *out, "--data-path", str(tmp_path / "mine.jsonl.gz")])
    assert str(e.value) == f"train.py: --data-path {tmp_path / 'mine.jsonl.gz'}: no such file or folder"


def test_a_rule_reward_run_gets_its_data_and_reward_checked_before_step_1(tmp_path):
    """With `--reward-fn exact_match` one data file failed in step 3 after step 1 had run (SFT rows feed
    step 1 only, prompt rows step 3 only), and a misspelt --reward-fn failed in step 3 too. The
    documented way, `--data-path sft.jsonl prompts.jsonl`, plans; the others stop train.py before
    step 1, in one line each."""
    sft, prompts, bare = tmp_path / "sft.jsonl", tmp_path / "prompts.jsonl", tmp_path / "bare.jsonl"
    sft.write_text("".join(f'{{"prompt": "What is {i} + 1?", "chosen": "{i + 1}"}}\n' for i in range(40)))
    prompts.write_text("".join(f'{{"prompt": "What is {i} + 1?", "reference": "{i + 1}"}}\n' for i in range(40)))
    bare.write_text("".join(f'{{"prompt": "What is {i} + 1?"}}\n' for i in range(40)))
    base = ["--actor-model", str(STORIES), "--deployment-type", "cpu", "--rl-algorithm", "grpo",
            "--output-dir", str(tmp_path / "o")]
    pipe = train.plan([*base, "--reward-fn", "exact_match", "--data-path", str(sft), str(prompts)])
    assert [r.step for r in pipe.runs] == [1, 3]
    with pytest.raises(SystemExit) as e:
        train.plan([*base, "--reward-fn", "exact_match", "--data-path", str(prompts)])
    assert str(e.value) == (f"train.py: step 1 (supervised fine-tuning) gets no training rows from its data ({prompts} "
                            "holds prompt rows ({prompt, reference}), which feed step 3 only): give each step its "
                            "rows in one --data-path list, e.g. --data-path sft.jsonl prompts.jsonl (docs/critic_free.md)")
    with pytest.raises(SystemExit) as e:
        train.plan([*base, "--reward-fn", "exact_match", "--data-path", str(sft)])
    assert str(e.value).startswith("train.py: step 3 (RLHF, grpo) gets no training rows from its data (")
    with pytest.raises(SystemExit) as e:
        train.plan([*base, "--reward-fn", "exact_match", "--data-path", str(sft), str(bare)])
    assert str(e.value).startswith('train.py: step 3 (RLHF, grpo): --reward_fn exact_match scores each answer against '
                                   'its prompt row\'s "reference", and 38 of the 38 step-3 prompt rows')
    with pytest.raises(SystemExit) as e:
        train.plan([*base, "--reward-fn", "exact_mach", "--data-path", str(sft), str(prompts)])
    assert str(e.value) == ("train.py: --reward-fn 'exact_mach': expected module:function, path/to/file.py:function or "
                            "one of ['exact_match', 'regex_format']")
    flags = evaluation.eval_flags(pipe, None)
    assert flags["judge"] == "exact_match"  # the evaluation judges with the run's reward function


def test_chat_refuses_a_mistyped_model_folder_in_one_line(tmp_path, monkeypatch, capsys):
    """`chat.py --path output/step3_rlhf/actr` was a 40-line traceback from the loader."""
    (tmp_path / "output" / "step3_rlhf").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        chat.main(["--path", "output/step3_rlhf/actr"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2].endswith("error: --path output/step3_rlhf/actr: no such folder (a trained model's folder, e.g. "
                            "output/step3_rlhf/actor)")
    monkeypatch.chdir(tmp_path / "output")  # the README's command before any run: no output/ here
    with pytest.raises(SystemExit) as e:
        chat.main(["--path", "output/step3_rlhf/actor"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-2].endswith(
        "error: --path output/step3_rlhf/actor: no such folder (a trained model's folder, e.g. output/step3_rlhf/actor)")
