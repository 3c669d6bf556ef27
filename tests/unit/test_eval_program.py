"""``python -m chatrl.eval`` end to end in one process on tiny models (stories260K, a random-init Llama
with its tokenizer, one with GPT-2's): a model against itself is within noise, a pretrained model
beats a random one with a narrow interval, swapping the models mirrors every figure, the KL to the
reference is exact, a step-3 output expands to its checkpoint series with the over-optimisation
check, the report shows the evaluation, and bad input gets a clear error."""

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import DATA, STORIES

HERE = Path(__file__).resolve().parent
JUDGE = f"{HERE / 'eval_judges.py'}:english_words"
PROMPTS = str(DATA / "hh-rlhf" / "helpful-base") + "[0:40]"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Model folders: a random-init Llama with stories260K's tokenizer, one with GPT-2's, stories260K's
    weights without a tokenizer, and a step-3 output made of stories260K and the random model."""
    from chatrl.models.tiny import TinySpec, make_tiny_model

    root = tmp_path_factory.mktemp("eval_models")
    spec = TinySpec(hidden=64, layers=2, heads=4, ffn=128)
    make_tiny_model("llama", root / "random", spec, tokenizer_dir=STORIES)
    make_tiny_model("llama", root / "gpt2_tok", spec)
    (root / "no_tokenizer").mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(STORIES / f, root / "no_tokenizer" / f)
    run = root / "step3_rlhf"  # snapshots/step_5 is the random model, actor/ and actor_ema/ stories260K
    shutil.copytree(root / "random", run / "snapshots" / "step_5")
    for sub in ("actor", "actor_ema"):
        shutil.copytree(STORIES, run / sub, ignore=shutil.ignore_patterns("LICENSE", "SOURCE.md"))
    (run / "chatrl_run.json").write_text(json.dumps({"step": 3, "steps": 10}))
    return {"random": root / "random", "gpt2_tok": root / "gpt2_tok", "no_tokenizer": root / "no_tokenizer",
            "run": run}


def evaluate(out: Path, *flags: str) -> dict:
    from chatrl.eval.main import main

    return main(["--prompts", PROMPTS, "--max_prompts", "24", "--max_prompt_seq_len", "48",
                 "--max_answer_seq_len", "16", "--bootstrap_samples", "500", "--output_dir", str(out),
                 "--disable_progress_bar", *flags])


def by_pair(result: dict) -> dict:
    return {(p["a"], p["b"], p["decoding"]): p for p in result["pairs"]}


def test_a_model_against_itself_is_within_noise(tmp_path):
    r = evaluate(tmp_path, "--models", str(STORIES), str(STORIES), "--judge", JUDGE, "--seeds", "1", "2")
    assert [m["label"] for m in r["models"]] == ["stories260K", "stories260K#2"]
    assert {p["decoding"] for p in r["pairs"]} == {"greedy", "sampled"}
    for p in r["pairs"]:  # the same answers (same seeds): every comparison a tie
        w = p["judge"]["win_rate"]
        assert (w["value"], w["ci"], w["within_noise"], p["judge"]["ties"]) == (0.5, [0.5, 0.5], True, 1.0)
        assert p["judge"]["length_controlled"]["within_noise"]
    rows = [json.loads(x) for x in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 3 * 24 and {r["decoding"] for r in rows} == {"greedy", "seed1", "seed2"}
    assert json.loads((tmp_path / "eval.json").read_text())["pairs"] == r["pairs"]


def test_pretrained_beats_random_narrowly_and_swapping_the_models_mirrors_every_figure(tmp_path, models):
    flags = ["--judge", JUDGE, "--reference", str(STORIES), "--seeds", "1"]
    ab = evaluate(tmp_path / "ab", "--models", str(models["random"]), str(STORIES), *flags)
    ba = evaluate(tmp_path / "ba", "--models", str(STORIES), str(models["random"]), *flags)
    for group in ("greedy", "sampled"):
        p, q = by_pair(ab)[("random", "stories260K", group)], by_pair(ba)[("stories260K", "random", group)]
        w = p["judge"]["win_rate"]
        assert w["value"] >= 0.9 and w["ci"][0] >= 0.8 and not w["within_noise"], w  # seen: 1.0 [1.0, 1.0]
        for key in ("win_rate", "length_controlled"):
            x, y = p["judge"][key], q["judge"][key]
            if x["value"] is None:  # length explains the outcome, whichever model is B
                assert y["value"] is None and x.get("length_explains") and y.get("length_explains")
            else:
                assert y["value"] == pytest.approx(1 - x["value"], abs=1e-9)
            assert y["ci"] == pytest.approx([1 - x["ci"][1], 1 - x["ci"][0]], abs=1e-9)
        assert q["judge"]["ties"] == p["judge"]["ties"]
    for label, groups in ab["figures"].items():  # per-model figures do not depend on the order
        for group, figs in groups.items():  # (the KL up to float32 summation order)
            assert ba["figures"][label][group] == pytest.approx(figs, rel=1e-6, nan_ok=True), (label, group)
    kl = ab["figures"]["stories260K"]  # the reference itself: the same forward pass on both sides, exactly 0
    assert kl["greedy"]["kl"] == 0.0 and kl["sampled"]["kl"] == 0.0, kl
    assert ab["figures"]["random"]["sampled"]["kl"] > 1.0  # a random model is far from it


def test_a_step3_output_is_a_checkpoint_series_with_the_over_optimisation_check(tmp_path, models):
    from chatrl.tools.report import evaluation_html

    gold = f"{HERE / 'eval_judges.py'}:english_words"
    r = evaluate(tmp_path / "eval", "--models", str(STORIES), str(models["run"]), "--judge", JUDGE,
                 "--gold_judge", gold, "--reference", str(STORIES), "--seeds", "1", "--no_greedy")
    labels = [(m["label"], m["step"], m["in_series"]) for m in r["models"]]
    assert labels == [("stories260K", None, True), ("step3_rlhf@5", 5, True), ("step3_rlhf", 10, True),
                      ("step3_rlhf (EMA)", 10, False)]
    assert [(p["label"], p["step"]) for p in r["series"]] == [("step3_rlhf@5", 5), ("step3_rlhf", 10)]
    (check,) = r["over_optimisation"]
    # step 5 is the random model (it loses), the final actor is the baseline itself (a tie)
    assert r["series"][0]["gold_win_rate"] < 0.2 and r["series"][1]["gold_win_rate"] == 0.5
    assert check["peak"] == "step3_rlhf" and not check["proxy_rises_after_peak"]
    assert r["series"][1]["kl"] == 0.0  # the final actor is the reference's weights
    html, charts = evaluation_html(tmp_path)  # an evaluation's own folder holds eval.json
    assert charts == 1 and "Evaluation" in html and "over-optimisation check" in html
    assert "step3_rlhf@5" in html and "Answers side by side" in html


def test_models_with_other_tokenizers_are_compared_on_text(tmp_path, models, capsys):
    r = evaluate(tmp_path, "--models", str(STORIES), str(models["gpt2_tok"]), "--judge", JUDGE, "--reference",
                 str(STORIES), "--seeds", "1")
    assert r["figures"]["gpt2_tok"]["sampled"]["kl"] is None  # another vocabulary: no token-level KL
    assert r["figures"]["stories260K"]["sampled"]["kl"] == 0.0
    assert "no KL for gpt2_tok: its tokenizer differs from --reference's" in capsys.readouterr().out
    assert by_pair(r)[("stories260K", "gpt2_tok", "greedy")]["judge"]["win_rate"]["value"] is not None


@pytest.mark.parametrize("case", ["no_tokenizer", "schema", "judge_not_rm", "judge_missing", "judge_import",
                                  "judge_output", "seeds", "model_file"])
def test_bad_input_gets_a_clear_error(tmp_path, models, capsys, case):
    flags = ["--models", str(STORIES), str(models["random"]), "--judge", JUDGE]
    if case == "no_tokenizer":
        flags[2] = str(models["no_tokenizer"])
        expect = f"--models {models['no_tokenizer']}: cannot load its tokenizer. The folder holds no tokenizer"
    elif case == "schema":
        bad = tmp_path / "odd.jsonl"
        bad.write_text('{"question": "q", "answer_text": "a"}\n')
        flags += ["--prompts", str(bad)]
        expect = f"--prompts {bad}:"
    elif case == "judge_not_rm":
        flags[-1] = str(STORIES)
        expect = f"--judge {STORIES} is not a reward model"
    elif case == "judge_missing":
        flags[-1] = str(tmp_path / "nowhere")
        expect = "no such folder; a judge is a reward-model folder"
    elif case == "judge_import":
        flags[-1] = "nomodule:fn"
        expect = "--judge nomodule:fn: cannot import 'nomodule': ModuleNotFoundError"
    elif case == "judge_output":
        flags[-1] = f"{HERE / 'eval_judges.py'}:not_numbers"
        expect = "not_numbers returned"
    elif case == "seeds":
        flags += ["--no_greedy", "--seeds"]
        expect = "nothing to generate: --no_greedy and no --seeds"
    else:
        flags[2] = str(STORIES / "config.json")
        expect = "not a folder"
    with pytest.raises(SystemExit) as exit_info:
        evaluate(tmp_path / "out", *flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("chatrl: error: ") and expect in err, err
    if case == "schema":
        assert "question" in err and "answer_text" in err  # the keys it saw


def test_the_evaluation_estimates_its_time_after_the_first_batch_and_says_how_far_it_is():
    from chatrl.eval.main import AnswerProgress

    said, now = [], [0.0]
    p = AnswerProgress(240, said.append, lines=True, clock=lambda: now[0], every_s=30)
    for t, n in ((4, 16), (8, 16), (40, 100), (50, 108)):
        now[0] = t
        p(n)
    assert said == ["chatrl.eval: the first 16 answers took 4 s: about 60 s for all 240 (then the judges)",
                    "chatrl.eval: 132/240 answers (55%) in 40 s, about 33 s left",  # 40 / 132 × 108 = 32.7
                    "chatrl.eval: 240/240 answers (100%) in 50 s"]
    said.clear()
    now[0] = 0.0
    p = AnswerProgress(240, said.append, lines=False, clock=lambda: now[0])  # a progress bar shows the rest
    for t, n in ((31, 16), (200, 224)):
        now[0] = t
        p(n)
    assert said == ["chatrl.eval: the first 16 answers took 31 s: about 7.8 min for all 240 (then the judges)"]


def test_a_pair_without_a_judge_says_why_it_has_no_win_rate():
    from chatrl.eval.summary import format_table

    fig = {"answers": 2, "length_tokens": 3.0, "length_chars": 9.0, "eos_rate": 1.0, "distinct_1": 1.0,
           "distinct_2": 1.0, "kl": None}
    table = format_table({"figures": {"a": {"greedy": fig}, "b": {"greedy": fig}},
                          "pairs": [{"a": "a", "b": "b", "decoding": "greedy"}]})
    row = next(line for line in table.splitlines() if line.startswith("b vs a"))
    assert "no judge (--judge): no win rate" in row
