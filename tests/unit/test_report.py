"""The run report on a synthetic 3-step output folder written through the Tracker (with a resume),
the chat helpers shared by the terminal and web chat, and the web chat's request checks."""

import json
import re
from pathlib import Path

import pytest

from chatrl.checkpoint import write_run_marker
from chatrl.conversation import StopAtMarker
from chatrl.tracking import Tracker

pytest.importorskip("plotly", reason="the report needs plotly: pip install -e '.[web]'")


def make_output(root: Path) -> Path:
    """train.py's layout: step 1 (finished, resumed once), step 2 (finished), step 3 (running, EOS collapsing).

    Charts, hand-counted: step 1 loss (train+eval), ppl, lr → 3 (train/skipped_steps is constant,
    eval/eos_rate has one point); step 2 loss, accuracy → 2; step 3 score and reward, kl, entropy,
    answer_len, eos_rate, time per step → 6 (samples is not charted, reward/score_std is constant).
    """
    s1 = root / "step1_actor"
    t = Tracker(str(s1), enabled=True, progress=False)
    t.log({"eval/loss": 3.0, "eval/ppl": 20.09}, 0)
    for step in range(1, 7):
        t.log({"train/loss": 3.0 - 0.1 * step, "train/lr": 1e-3, "train/skipped_steps": 0}, step)
    t.close()
    t = Tracker(str(s1), enabled=True, progress=False)  # killed after step 6, resumed from the step-4 checkpoint
    t.resumed_at(4)
    for step in range(5, 11):
        t.log({"train/loss": 3.0 - 0.1 * step, "train/lr": 5e-4 + 1e-5 * step, "train/skipped_steps": 0}, step)
    t.log({"eval/loss": 2.3, "eval/ppl": 9.97}, 10)
    t.log({"eval/eos_rate": 0.875}, 10)
    t.close()
    write_run_marker(str(s1), {"step": 1, "steps": 10, "metrics": {}, "args": {"learning_rate": 1e-3, "zero_stage": 3}})
    s2 = root / "step2_reward"
    t = Tracker(str(s2), enabled=True, progress=False)
    t.log({"eval/accuracy": 0.45, "eval/loss": 0.70}, 0)
    for step in range(1, 6):
        t.log({"train/loss": 0.7 - 0.01 * step, "train/accuracy": 0.5 + 0.02 * step}, step)
    t.log({"eval/accuracy": 0.61, "eval/loss": 0.66}, 5)
    t.close()
    write_run_marker(str(s2), {"step": 2, "steps": 5, "metrics": {}, "args": {"zero_stage": 3}})
    s3 = root / "step3_rlhf"
    t = Tracker(str(s3), enabled=True, progress=False)
    for step in range(1, 13):
        eos = 0.9 if step <= 6 else 0.1
        t.log({"reward/score_mean": 0.2 + 0.01 * step, "reward/mean": 0.2, "reward/score_std": 0.1, "kl": 0.1 * step,
               "entropy": 2.0 - 0.01 * step, "answer_len": 20.0 + step, "eos_rate": eos, "samples": 32.0 * step,
               "time/generate": 3.0 + 0.3 * (step % 2), "time/train": 1.0 + 0.1 * (step % 2)}, step)
        if step % 5 == 0 or step == 1:
            t.sample(step, "\n\nHuman: say <b>hi</b>\n\nAssistant:", f"hi number {step}", 0.2 + 0.01 * step, 0.1 * step,
                     show=False)
    t.close()
    from chatrl.evidence.certificate import Certificate, Property

    c = Certificate(s1, "step 1 (SFT)")  # step 1 passes, step 2 fails its loss scale, step 3 has none yet
    c.add(Property("loss_scale", 2e-8, 1e-3, True, "loss scale (model) passed: ratio 1"))
    c.add(Property("data_accounting", 0.0, 0, True, "data accounting passed"))
    c.write()
    c = Certificate(s2, "step 2 (reward model)")
    c.add(Property("loss_scale", 0.5, 1e-3, False, "loss scale (model) failed: ratio 0.5"))
    c.write()
    logs = root / "logs"
    logs.mkdir()
    (logs / "step1.log").write_text("===== 2026\n$ deepspeed --module chatrl.step1_sft --learning_rate 1e-3\nrest\n")
    return root


def test_report_of_a_three_step_output(tmp_path):
    from chatrl.tools.report import build_html, find_steps, headlines, write_report

    out = make_output(tmp_path / "out")
    runs = find_steps(out)
    assert [r.number for r in runs] == [1, 2, 3]
    s1, s2, s3 = runs
    assert [r.get("step") for r in s1.rows if "train/loss" in r] == list(range(1, 11))  # the resumed run, joined
    assert s1.resumes == [4]
    heads = {name: value for run in runs for name, value in headlines(run)}
    assert heads["eval perplexity"] == "20.09 → 9.97"
    assert heads["greedy answers ending with EOS"] == "87.5%"
    assert heads["reward model eval accuracy (chosen > rejected)"] == "0.450 → 0.610"
    # step 3's trends as the console tells them (chatrl.tracking.step_trend): score mean of steps 1-5 0.23,
    # of steps 6-12 0.29; EOS rate 0.9 → (0.9 + 6 × 0.1) / 7
    assert heads["score: the weighted reward (mean of the first 5 steps → of the last 7)"] == "0.230 → 0.290 (rose)"
    assert heads["answers ending with EOS (mean of the first 5 steps → of the last 7)"] == "90.0% → 21.4% (fell)"
    assert heads["KL to the reference, nats per answer (last 7 steps)"] == "0.900"  # mean of 0.6 ... 1.2
    assert heads["time split (logged per-step timers)"] == "generate 75%, train 25%"  # 6 × (3 + 3.3) against 6 × (1 + 1.1)
    assert heads["constant over the run (not charted)"] == "reward/mean = 0.2, reward/score_std = 0.1"
    assert dict(headlines(s3))["state"].startswith("unfinished") and dict(headlines(s2))["state"] == "finished"
    # EOS 0.9 for steps 1-6, then 0.1: mean of the last 3 is below 0.45 at step 8 ((0.9 + 0.1 + 0.1) / 3)
    assert [(a.rule, a.step) for a in s3.alerts] == [("eos_collapse", 8)]
    doc, n_charts = build_html(out)
    assert n_charts == 3 + 2 + 6
    assert f'<meta name="chatrl-charts" content="{n_charts}">' in doc
    assert doc.count('class="chart"') == n_charts
    assert "eos_collapse" in doc and "EOS rate 0.37" in doc  # listed at the top with its figure
    # the verdict on step 3 first, in the console's words
    verdict = "score 0.230 → 0.290, rose; EOS rate 0.90 → 0.21, fell (mean of the first 5 steps → of the last 7)"
    assert verdict in doc and doc.index(verdict) < doc.index("Correctness certificate")
    # the certificates on top: every property with figure, bound and result; the failed one marked
    assert doc.index("Correctness certificate") < doc.index("Run-health alerts") < doc.index('id="step1_actor"')
    assert doc.count('<tr class="pass">') == 2 and doc.count('<tr class="fail">') == 1
    assert "1 property failed." in doc and "loss scale (model) failed: ratio 0.5" in doc
    assert "No certificate: step 3: RLHF" in doc
    assert doc.index("eos_collapse") < doc.index('id="step1_actor"')
    assert "say &lt;b&gt;hi&lt;/b&gt;" in doc and "hi number 10" in doc  # samples, escaped
    assert "--learning_rate 1e-3" in doc  # the command of step 1 from OUTPUT/logs/step1.log
    import plotly.offline

    assert doc.count(plotly.offline.get_plotlyjs()) == 1  # embedded once; the browser test checks for requests
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", doc.replace(plotly.offline.get_plotlyjs(), ""))
    path = write_report(out)
    assert path == out / "report.html" and path.stat().st_size < 10e6
    assert not list(out.glob("*.tmp"))


def test_report_of_one_step_folder_and_a_folder_without_logs(tmp_path):
    from chatrl.tools.report import build_html, report_note

    out = make_output(tmp_path / "out")
    _, n = build_html(out / "step2_reward")
    assert n == 2
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        build_html(tmp_path)
    assert report_note(tmp_path).startswith("run report not written: FileNotFoundError")


def test_report_command_line(tmp_path, capsys):
    from chatrl.tools.report import main

    out = make_output(tmp_path / "out")
    main([str(out)])
    assert str(out / "report.html") in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no logs/metrics.jsonl"):
        main([str(tmp_path / "out" / "logs")])


def test_long_runs_are_thinned_to_a_small_report(tmp_path):
    from chatrl.tools.report import _thin, write_report

    xs = list(range(1, 10_001))
    tx, ty = _thin(xs, [2.0 * x for x in xs], limit=2000)
    assert len(tx) == 2001 and tx[:3] == [1, 6, 11] and tx[-1] == 10_000 and ty[-1] == 20_000.0
    t = Tracker(str(tmp_path), enabled=True, progress=False)
    for step in range(1, 20_001):
        t.log({"kl": step * 1e-4, "entropy": 2.0 - step * 1e-5, "eos_rate": 0.9, "answer_len": 30.0 + step % 7}, step)
    t.close()
    assert write_report(tmp_path).stat().st_size < 6e6  # plotly.js (~4.7 MB) and 3 curves of ≤ 2001 points


def test_samples_are_trimmed_on_resume(tmp_path):
    t = Tracker(str(tmp_path), enabled=True, progress=False)
    for step in (1, 10, 20):
        t.sample(step, "p", "a", 0.0, 0.0, show=False)
    t.resumed_at(10)
    t.close()
    rows = [json.loads(x) for x in (tmp_path / "logs" / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 10]


@pytest.mark.parametrize("pieces, shown", [
    (["Hello", " there"], "Hello there"),
    (["Hi.\n", "\nHu", "man: next"], "Hi."),            # the marker split over pieces is never shown
    (["Hi.\n\nHuman: x", "more"], "Hi."),
    (["a\n\nHu", "go on"], "a\n\nHugo on"),            # a false start is released
    (["end\n\n"], "end\n\n"),                           # held back, released by flush
])
def test_stop_at_marker(pieces, shown):
    cut = StopAtMarker()
    text = "".join(cut.feed(p) for p in pieces) + cut.flush()
    assert text == shown


def test_web_chat_request_checks():
    from chatrl.tools.web_chat import check_request

    msgs = [{"role": "system", "content": " "}, {"role": "user", "content": "hi"}]
    model, messages, settings = check_request({"model": 1, "messages": msgs, "temperature": 0}, 2, 512,
                                              {"max_new_tokens": 40})
    assert model == 1 and messages == msgs[1:]  # an empty system prompt is left out
    assert settings == {"max_new_tokens": 40, "temperature": 0.0, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.0}
    for body, field in [({"model": 2, "messages": msgs}, "model"), ({"messages": []}, "messages"),
                        ({"messages": [{"role": "bot", "content": "x"}]}, r"messages\[0\]"),
                        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
                         "last message"),
                        ({"messages": msgs, "max_new_tokens": 512}, "max_new_tokens"),
                        ({"messages": msgs, "top_p": "high"}, "top_p"), ([], "JSON object")]:
        with pytest.raises(ValueError, match=field):
            check_request(body, 2, 512)


def test_web_chat_columns_say_which_model_is_rlhf_and_which_sft(tmp_path):
    """The web chat's columns were titled by folder only; each now says what its model is, from the
    run marker chatrl wrote (step 3's actor/ has it in its parent), else the flag that named it."""
    import json

    from chatrl.checkpoint import RUN_MARKER
    from chatrl.tools.web_chat import model_role

    out = tmp_path / "output"
    for folder, marker in (("step1_actor", {"step": 1}), ("step3_rlhf", {"step": 3, "args": {"rl_algorithm": "grpo"}}),
                           ("step2_dpo", {"step": "2-dpo"}), ("ppo", {"step": 3, "args": {}})):
        (out / folder).mkdir(parents=True)
        (out / folder / RUN_MARKER).write_text(json.dumps(marker))
    (out / "step3_rlhf" / "actor").mkdir()
    assert model_role(str(out / "step3_rlhf" / "actor")) == "RLHF (step 3, grpo)"
    assert model_role(str(out / "step3_rlhf" / "actor_ema")) == "RLHF EMA (step 3, grpo)"
    assert model_role(str(out / "ppo" / "actor")) == "RLHF (step 3, ppo)"
    assert model_role(str(out / "step1_actor")) == "SFT (step 1)"
    assert model_role(str(out / "step2_dpo")) == "DPO (step 2)"
    assert model_role(str(out / "step3_rlhf")) is None and model_role(str(tmp_path / "nope")) is None


def test_report_has_an_evaluation_section(tmp_path):
    """train.py's OUTPUT/eval/eval.json (chatrl.eval) gives a section: the pair table with intervals and
    the within-noise mark, the over-optimisation line, the KL / win-rate frontier (one chart more), and
    answers side by side (escaped)."""
    from chatrl.tools.report import build_html

    out = make_output(tmp_path / "out")
    before = build_html(out)[1]
    fig = {"answers": 4, "length_tokens": 10.0, "length_chars": 40.0, "eos_rate": 0.5, "distinct_1": 0.8,
           "distinct_2": 0.9, "kl": 1.5}
    wr = {"win_rate": {"value": 0.55, "ci": [0.45, 0.65], "within_noise": True},
          "length_controlled": {"value": 0.52, "ci": [0.42, 0.62], "within_noise": True}, "ties": 0.1}
    ev = {"baseline": "step1_actor", "prompts": {"count": 93}, "decodings": {"sampled": ["seed1", "seed2"]},
          "judges": {"judge": "step2_reward", "gold": "gold", "reference": "step1_actor"},
          "figures": {m: {"sampled": fig} for m in ("step1_actor", "step3_rlhf@10", "step3_rlhf")},
          "pairs": [{"a": "step1_actor", "b": b, "decoding": "sampled", "judge": wr, "gold": wr}
                    for b in ("step3_rlhf@10", "step3_rlhf")],
          "series": [{"run": "r", "label": b, "step": k, "kl": 1.0 + k / 10, "win_rate": 0.55, "ci": [0.45, 0.65],
                      "gold_win_rate": 0.5, "gold_ci": [0.4, 0.6]} for b, k in (("step3_rlhf@10", 10), ("step3_rlhf", 20))],
          "over_optimisation": [{"run": "r", "peak": "step3_rlhf",
                                 "message": "the gold judge's win rate is highest at the last checkpoint"}],
          "examples": [{"prompt": "\n\nHuman: <b>hi</b>\n\nAssistant:",
                        "answers": {"step1_actor": {"decoding": "greedy", "text": "hello", "judge_score": 0.1},
                                    "step3_rlhf": {"decoding": "greedy", "text": "hi!", "judge_score": 0.2}}}]}
    (out / "eval").mkdir()
    (out / "eval" / "eval.json").write_text(json.dumps(ev))
    doc, charts = build_html(out)
    assert charts == before + 1 and 'id="chart-eval-frontier"' in doc
    section = doc[doc.index('<section id="evaluation">'):]
    assert "<b>0.550</b> [0.450, 0.650]" in section and section.count("difference within noise") == 2
    assert "over-optimisation check (r)" in section and "&lt;b&gt;hi&lt;/b&gt;" in section
    assert "judge +0.200" in section and "gold peak" in section
