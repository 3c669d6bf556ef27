#!/usr/bin/env python
"""Run the RLHF pipeline (step 1 SFT → step 2 reward model → step 3 PPO) with one command.

    python train.py --actor-model facebook/opt-13b --reward-model facebook/opt-350m --deployment-type single_node
    python train.py --actor-model opt-1.3b --reward-model opt-350m --deployment-type single_gpu --step 2 3
    python train.py --preset demo          # offline demo on this machine: real data, tiny models, 2 CPU ranks

Each step runs as its own program through the DeepSpeed launcher (a hostfile for multi-node); the
steps hand off only through HF folders under ``--output-dir``:

    OUTPUT/step1_actor/          step 1's actor (also step 3's reference)
    OUTPUT/step2_reward/         step 2's reward model (also step 3's critic initialisation)
    OUTPUT/step3_rlhf/actor/     the chat model; critic/ and (--enable_ema) actor_ema/ beside it
    OUTPUT/eval/                 the chat model against step 1's (eval.json, answers.jsonl; docs/evaluation.md)
    OUTPUT/logs/stepN.log        each step's full log (logs/eval.log: the evaluation's)
    OUTPUT/report.html           the run report (curves, samples, alerts, evaluation), refreshed after each step

A step whose output already holds a finished run is skipped (``--overwrite`` redoes it); an
unfinished one (a crash, a killed job) resumes from its newest checkpoint when the same command is
run again. Steps write checkpoints every ``--save_interval`` steps (the presets set it). Per-step
flags pass through with ``--step1-args "…"`` (and ``--step2-args``, ``--step3-args``); they come
last, so they override the presets.

``--step2-method dpo`` replaces steps 2 and 3 by direct preference optimisation of the step-1 actor
(``OUTPUT/step2_dpo/``, the chat model; ``--step2-args`` pass through to it) and stops there.

After step 3 (or DPO) the chat model is evaluated against step 1's on the prompts step 3 held out
(``python -m chatrl.eval``; ``--skip-eval`` skips it, ``--eval-args "…"`` passes flags through):
win rates with intervals judged by step 2's reward model, and with ``--gold-reward-model`` a second,
gold reward model trained on other data beside step 2 and the over-optimisation check.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from chatrl import cli, config
from chatrl.checkpoint import RUN_MARKER, list_checkpoints
from chatrl.distributed import multinode
from chatrl.eval.main import build_parser as eval_parser
from chatrl.pipeline import plan as planning
from chatrl.pipeline.evaluation import eval_flags, gold_backbone, gold_reward_run
from chatrl.pipeline.plan import STEP_NAMES, Pipeline, PipelineSettings, StepRun, command_flags
from chatrl.step1_sft.main import build_parser as step1_parser
from chatrl.step2_dpo.main import build_parser as dpo_parser
from chatrl.step2_reward.main import build_parser as step2_parser
from chatrl.step3_ppo.main import build_parser as step3_parser
from chatrl.tools.report import report_note
from chatrl.tracking import METRICS_FILE, read_metrics, results_line

REPO = Path(__file__).resolve().parent


def step_parsers() -> dict[int, argparse.ArgumentParser]:
    """Each step's own parser: presets are written as its flag names and checked against it."""
    return {1: step1_parser(), 2: step2_parser(), 3: step3_parser(), "dpo": dpo_parser()}


def build_parser() -> argparse.ArgumentParser:
    """train.py's flags (:class:`PipelineSettings`)."""
    p = config.program_parser(PipelineSettings, __doc__, prog="train.py")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    return p


def plan(argv: list[str] | None = None, cwd: str | os.PathLike | None = None) -> Pipeline:
    """train.py's whole plan from its command line, nothing launched (:func:`chatrl.pipeline.plan.plan`
    with train.py's parser and the steps' own).

    Raises:
        SystemExit: a bad combination of flags, a missing demo asset, or a step's command line its
            parser refuses (naming the step).
    """
    return planning.plan(build_parser(), step_parsers, argv, cwd)


def run_step(step: int, cmd: list[str], env: dict, log_path: Path, step_dir: Path,
             nodes: tuple[dict[str, int], int | None] | None = None, name: str | None = None) -> tuple[float, float]:
    """Run one step, streaming its output to the terminal and ``log_path`` (appended: a resumed step
    keeps the log of its earlier attempts); returns seconds taken and the peak resident memory of its
    largest process in MiB (:func:`wait_peak`: the launcher's and every rank's, 0 where unknown).

    Raises:
        SystemExit: the step failed; the message names the step, the ranks that failed and how,
            the last checkpoint to resume from, and the log (the step's own output was shown above).
            With ``nodes`` (hostfile hosts → slots, this node's rank) it also names this node and
            the node a lost connection points to.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    failures: list[str] = []
    with open(log_path, "a", encoding="utf-8", buffering=1) as log:  # line-buffered: a killed job keeps its log
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')}\n$ " + shlex.join(cmd) + "\n")
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        tty, drawn = sys.stdout.isatty(), False
        try:
            for line in proc.stdout:
                log.write(line)
                failures += _failure_lines(line)
                if _PROGRESS.search(line):  # a tqdm update: redraw in place on a terminal, else leave it to the log
                    if tty:
                        print(f"\r  [step {step}] {line.strip()[:150]}", end="", flush=True)
                        drawn = True
                elif _worth_showing(line):
                    print(("\n" if drawn else "") + f"  [step {step}] {line.rstrip()}", flush=True)
                    drawn = False
            code, peak = wait_peak(proc)
        except KeyboardInterrupt:
            _wind_down(proc, log)
            raise Interrupted(step, name or STEP_NAMES[step], step_dir, log_path) from None
    if code != 0:
        ckpts = list_checkpoints(step_dir)
        reached = _last_logged_step(step_dir)
        if nodes is not None:
            hosts, this = nodes
            if this is not None:
                host = list(hosts)[this]
                failures.insert(0, f"this is node {this} ({host}, global ranks "
                                   f"{multinode.global_ranks(hosts)[host]}) of {len(hosts)}")
            peer = multinode.lost_peer(failures, hosts, this)
            if peer:
                failures.append(peer)
        if reached is not None:
            failures.append(f"the last optimizer step logged was {reached}")
        resume = (f"the newest checkpoint is {ckpts[-1]}: rerun the same command to resume from it" if ckpts else
                  "no checkpoint was written (--save_interval): a rerun starts this step again")
        # the cause first: a rank's own error above the lost connections it left the others with
        secondary = ("Connection reset", "Connection closed", "another rank has probably died")
        failures.sort(key=lambda f: any(x in f for x in secondary))
        why = "".join(f"\n  {f}" for f in dict.fromkeys(failures))
        raise SystemExit(f"train.py: step {step} ({name or STEP_NAMES[step]}) failed with exit code {code}{why}\n"
                         f"  {resume}\n  full log: {log_path}")
    return time.time() - t0, peak


def wait_peak(proc: subprocess.Popen) -> tuple[int, float]:
    """Wait for ``proc``; its exit code and the peak resident memory (MiB) of the largest process of its
    tree: ``wait4``'s ``ru_maxrss`` (KiB on Linux) covers the child and every descendant it waited for,
    so a launcher's figure is its largest rank's. 0 where ``os.wait4`` is missing (Windows)."""
    if not hasattr(os, "wait4"):
        return proc.wait(), 0.0
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 1024


class Interrupted(Exception):
    """Ctrl-C stopped a step: which one, its folder and its log."""

    def __init__(self, step: int, name: str, step_dir: Path, log_path: Path):
        super().__init__(step)
        self.step, self.name, self.step_dir, self.log_path = step, name, step_dir, log_path

    def message(self, overwrite: bool) -> str:
        """One line: what was kept and saved, and that the same command resumes (train.py passes --resume)."""
        ckpts = list_checkpoints(self.step_dir)
        saved = (f"its newest checkpoint is {ckpts[-1]} (the same command resumes from it)" if ckpts and not overwrite
                 else f"its newest checkpoint is {ckpts[-1]} (run without --overwrite to resume from it)" if ckpts
                 else "no checkpoint of it was written yet (the same command starts it again)")
        return (f"train.py: interrupted (Ctrl-C) in step {self.step} ({self.name}); finished steps are kept, {saved}; "
                f"log: {self.log_path}")


def _wind_down(proc: subprocess.Popen, log, grace_s: float = 30.0) -> None:
    """After Ctrl-C: pass it on to the step (a terminal sends it to the whole job already), log what the
    ranks still print (their one line each) without showing it, and end the step within ``grace_s``."""
    import signal
    import threading

    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
    reader = threading.Thread(target=lambda: [log.write(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(timeout=5)


def _last_logged_step(step_dir: Path) -> int | None:
    """The step of the last complete row of a step's metrics log (None without one)."""
    steps = [row["step"] for row in read_metrics(step_dir / METRICS_FILE) if "step" in row]
    return steps[-1] if steps else None


_RANK_EXIT = re.compile(r"--local_rank=(\d+).*exits with return code = (-?\d+)")
_RANK_FAILED = re.compile(r"^chatrl: rank \d+ failed .*")
# a usage error of a step program (argparse's line, or a UsageError): the cause, printed by rank 0
_USAGE_ERROR = re.compile(r"^(?:python -m chatrl\.[\w.]+|chatrl): error: .*")


def _failure_lines(line: str) -> list[str]:
    """What a step's output says about a failing rank: the launcher's exit line, chatrl's own report
    or a usage error (the cause, which the pipeline's last lines repeat)."""
    m = _RANK_EXIT.search(line)
    if m:
        code = int(m.group(2))
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return [f"local rank {m.group(1)} {how}"]
    m = _RANK_FAILED.search(line.strip()) or _USAGE_ERROR.search(line.strip())
    if not m:
        return []
    text = m.group(0)
    return [text if len(text) <= 400 else text[:399] + "…"]


_PROGRESS = re.compile(r"\d+/\d+ \[[\d:<?]+.*(it/s|s/it)")
_NOISE = re.compile(r"Warning|^\s+return |warn\(|UserWarning|FutureWarning|\[INFO\]|\[WARNING\]|real_accelerator|return func|"
                    r"^\s*$|it/s\]|shm_comm_op|Loading weights|Writing model|Saving the dataset|W\d{4} |torch.distributed")


def _worth_showing(line: str) -> bool:
    return not _NOISE.search(line)


def main(argv: list[str] | None = None) -> None:
    """``python train.py …``: :func:`plan`, then each step through the launcher, a report after each,
    and a summary of every step's results at the end."""
    pipe = plan(argv)
    a, out, dirs = pipe.settings.pipeline, pipe.out, pipe.dirs
    for line in pipe.messages:
        print(line, flush=True)
    times = {}
    for r in pipe.runs:
        s = r.step
        if r.finished:
            print(f"step {s} ({r.name}): {r.out_dir} already holds a finished run; skipped "
                  "(--overwrite to redo)", flush=True)
            continue
        if s == 3:
            for need in pipe.step3_needs:
                if not (dirs[need] / "config.json").exists():
                    raise SystemExit(f"step 3 needs step {need}'s output in {dirs[need]}; run --step {need} first")
        step_cmd = [*pipe.launcher, "--module", r.module, *r.argv]
        node = f".node{a.node_rank}" if a.node_rank is not None else ""  # nodes may share the output folder
        log_path = out / "logs" / f"step{s}{node}.log"
        ckpts = [] if a.overwrite else list_checkpoints(r.out_dir)
        print(f"step {s} ({r.name}) → {r.out_dir}  (log: {log_path})"
              + (f"; resuming from {ckpts[-1].name}" if ckpts else ""), flush=True)
        try:
            times[s], peak = run_step(s, step_cmd, pipe.env, log_path, r.out_dir, pipe.nodes, r.name)
        except Interrupted as stop:  # one line: what is kept and how to go on
            print(("\n" if sys.stdout.isatty() else "") + stop.message(a.overwrite), flush=True)
            raise SystemExit(130) from None
        except BaseException:  # a failed step: its curves and alerts help to see why
            print(report_note(out), flush=True)
            raise
        print(f"step {s} {record_cost(out, f'step{s}', times[s], peak)}", flush=True)
        print(report_note(out), flush=True)  # OUTPUT/report.html (python -m chatrl.tools.report OUTPUT refreshes it)
    evaluate_pipeline(pipe)
    if a.step2_method == "dpo":
        if (dirs[2] / RUN_MARKER).exists():
            print(f"chat with the result: {sys.executable} {REPO / 'chat.py'} --path {dirs[2]}", flush=True)
    elif 3 in times or (dirs[3] / "actor" / "config.json").exists():
        print(f"chat with the result: {sys.executable} {REPO / 'chat.py'} --path {dirs[3] / 'actor'}", flush=True)
    if times:
        print("wall time per step (s): " + ", ".join(f"step {s}: {t:.0f}" for s, t in times.items()), flush=True)
    else:
        print("all requested steps were already finished (--overwrite redoes them)", flush=True)
        print(report_note(out), flush=True)
    for line in results_summary(pipe.runs):
        print(line, flush=True)


def results_summary(runs: list[StepRun]) -> list[str]:
    """The pipeline's last lines: each step's results from its metrics log
    (:func:`chatrl.tracking.results_line`: step 1's eval perplexity before → after and EOS rate,
    step 2's eval accuracy before → after, step 3's score and EOS rate trends (:func:`chatrl.tracking.step_trend`),
    KL max)."""
    lines = []
    for r in runs:
        found = results_line(read_metrics(r.out_dir / METRICS_FILE))
        if found:
            lines.append(f"  step {r.step} ({r.name}): {found}")
    return ["results:", *lines] if lines else []


def evaluate_pipeline(pipe: Pipeline) -> None:
    """Evaluate the pipeline's chat model against step 1's (``python -m chatrl.eval``, :func:`eval_flags`)
    once step 3 (or DPO) has finished, after training the gold reward model when asked
    (:func:`gold_reward_run`); the table is printed, ``OUTPUT/eval/`` written and the report refreshed.
    Skipped with ``--skip-eval``, on nodes other than the first, and when ``OUTPUT/eval`` is newer
    than the models (``--overwrite`` or ``--eval-args`` redo it).

    Raises:
        SystemExit: the gold reward model's training or the evaluation failed (names the log), or Ctrl-C.
    """
    s, out, dirs = pipe.settings, pipe.out, pipe.dirs
    a = s.pipeline
    final = dirs[2] if a.step2_method == "dpo" else dirs[3]
    if s.evaluation.skip_eval or (a.node_rank or 0) != 0 or not (final / RUN_MARKER).exists() \
            or not (dirs[1] / "config.json").exists():
        return
    gold = None
    if gold_backbone(s):
        r = gold_reward_run(pipe)
        gold = r.out_dir
        if not r.finished:
            log_path = out / "logs" / "step2_gold.log"
            print(f"step 2 ({r.name}) → {r.out_dir}  (log: {log_path})", flush=True)
            try:
                took, peak = run_step(2, [*pipe.launcher, "--module", r.module, *r.argv], pipe.env, log_path,
                                      r.out_dir, pipe.nodes, r.name)
            except Interrupted as stop:
                print(("\n" if sys.stdout.isatty() else "") + stop.message(a.overwrite), flush=True)
                raise SystemExit(130) from None
            print(f"step 2 ({r.name}) {record_cost(out, 'gold_reward', took, peak)}", flush=True)
    result = out / "eval" / "eval.json"
    newest = max((f / RUN_MARKER).stat().st_mtime for f in (final, dirs[1], gold) if f is not None and
                 (f / RUN_MARKER).exists())
    if result.exists() and result.stat().st_mtime > newest and not a.overwrite and not s.evaluation.eval_args:
        print(f"evaluation: {result} is newer than the models; skipped (--overwrite redoes it)", flush=True)
        return
    parser = eval_parser()
    flags, extra = eval_flags(pipe, gold), shlex.split(s.evaluation.eval_args)
    cmd = [sys.executable, "-m", "chatrl.eval", *command_flags(flags, parser),
           *cli.resolve_argv(extra, parser, Path.cwd())]
    log_path = out / "logs" / "eval.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"evaluation: {dirs[1].name} against {final.name} (log: {log_path})", flush=True)
    if flags["judge"] is None and not any(x.split("=")[0] in ("--judge", "--gold_judge", "--gold-judge") for x in extra):
        print("evaluation: no judge, so no win rate ('-'): " + (
            "DPO trains no reward model; --gold-reward-model BACKBONE trains one to judge with"
            if a.step2_method == "dpo" else "this run has no reward model nor a single --reward-fn")
            + ", or --eval-args \"--judge PATH\" names one", flush=True)
    t0 = time.time()
    with open(log_path, "a", encoding="utf-8", buffering=1) as log:
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')}\n$ " + shlex.join(cmd) + "\n")
        # on CPU the evaluation takes the cores the ranks held (Pipeline.eval_env)
        proc = subprocess.Popen(cmd, env={**os.environ, **pipe.eval_env}, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            if _worth_showing(line) and not _PROGRESS.search(line):
                print(f"  {line.rstrip()}", flush=True)
        code, peak = wait_peak(proc)
    print(report_note(out), flush=True)
    if code != 0:
        raise SystemExit(f"train.py: the evaluation failed with exit code {code}; the models are saved. Full log: "
                         f"{log_path}; rerun the same command to evaluate again (finished steps are skipped)")
    print(f"evaluation {record_cost(out, 'evaluation', time.time() - t0, peak)}: {result}", flush=True)


def record_cost(out: Path, part: str, seconds: float, peak_mib: float) -> str:
    """Keep what a part of the pipeline cost in ``OUTPUT/logs/costs.json`` (``{part: {"wall_s",
    "peak_rss_mib", "finished"}}``, the last run of each part): the figures the docs quote per step.
    Returns the words train.py prints after the part's name ("done in … min; peak resident memory …")."""
    path = out / "logs" / "costs.json"
    try:
        costs = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        costs = {}
    costs[part] = {"wall_s": round(seconds, 1), "peak_rss_mib": round(peak_mib, 1),
                   "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs, indent=1) + "\n", encoding="utf-8")
    return f"done in {seconds / 60:.1f} min; peak resident memory of a process {peak_mib / 1024:.2f} GiB"


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # between steps (planning, a report): nothing of a step is lost
        print("\ntrain.py: interrupted (Ctrl-C); finished steps are kept; the same command continues", flush=True)
        raise SystemExit(130) from None
