"""Train.py's planning, chat.py's history trimming, and the shared CLI's flag spellings."""

import importlib.util
import sys

import pytest

from chatrl.checkpoint import check_output_dir, write_run_marker
from chatrl.cli import normalize_argv
from chatrl.models import load_tokenizer
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
    with pytest.raises(FileExistsError, match="--overwrite_output_dir"):
        check_output_dir(str(tmp_path), overwrite=False)
    check_output_dir(str(tmp_path), overwrite=True)


def test_model_names_and_sizes():
    assert train.resolve_model("opt-13b") == "facebook/opt-13b"
    assert train.resolve_model("OPT-1.3b") == "facebook/opt-1.3b"
    assert train.resolve_model("meta-llama/Llama-2-7b-hf") == "meta-llama/Llama-2-7b-hf"
    assert train.resolve_model(str(STORIES)) == str(STORIES.resolve())
    assert train.size_in_billions("facebook/opt-350m") == pytest.approx(0.35)
    assert train.size_in_billions("facebook/opt-13b") == 13.0
    assert train.size_in_billions("meta-llama/Llama-2-7b-hf") == 7.0


def test_size_presets_scale_with_model_and_deployment():
    small = train.size_preset(1.3, 0.35, "single_gpu", None, None)
    big = train.size_preset(13, 0.35, "single_node", None, None)
    huge_one_gpu = train.size_preset(13, 0.35, "single_gpu", None, None)
    assert small[1]["lora_dim"] == 128 and not small[1]["offload"]
    assert big[3]["actor_zero_stage"] == 3 and big[3]["inference_tp_size"] == 2
    assert huge_one_gpu[1]["offload"] and huge_one_gpu[3]["offload_reference_model"]
    forced = train.size_preset(13, 0.35, "single_node", 2, 1)
    assert forced[1]["zero_stage"] == 2 and forced[2]["zero_stage"] == 1


def test_multi_node_needs_a_hostfile(tmp_path):
    with pytest.raises(SystemExit, match="hostfile"):
        train.launcher("multi_node", None, str(tmp_path / "missing"), None)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=8\nnode2 slots=8\n")
    cmd, _ = train.launcher("multi_node", None, str(hostfile), 29600)
    assert cmd[-4:] == ["--hostfile", str(hostfile), "--master_port", "29600"]


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
    _, _, presets = train.demo_plan(tmp_path)
    for step, values in presets.items():
        paths = values["data_path"]
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


def test_chat_temperature_0_is_greedy_decoding(monkeypatch, capsys):
    """--temperature 0 crashed in transformers; it means greedy decoding."""
    greedy = _chat_answer(monkeypatch, capsys, "--greedy")
    assert _chat_answer(monkeypatch, capsys, "--temperature", "0", "--seed", "1") == greedy
    assert _chat_answer(monkeypatch, capsys, "--temperature", "0", "--seed", "2") == greedy
    with pytest.raises(SystemExit):
        chat.main(["--path", str(STORIES), "--temperature", "-1"])
    assert "--temperature must be >= 0" in capsys.readouterr().err
