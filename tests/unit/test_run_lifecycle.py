"""The run object (:mod:`chatrl.run`) is the one owner of a training run's lifecycle.

* Only it writes run markers, builds checkpoint schedules or stops a run, and the non-finite test
  hook is written once (a scan of the package's source).
* The certificate reads no field of a trainer: only its public methods (a scan of
  ``chatrl/evidence/certificate.py`` and step 3's evidence).
* Its behaviour on a fake engine and a four-example loader: the resume position, the cadence of
  logs, evaluations and checkpoints, the stop, the non-finite guard, the run marker and the
  observer's events, against step numbers derived by hand.
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader, DistributedSampler

from chatrl.config import CheckpointConfig, LogConfig
from chatrl.evidence.certificate import DataAccounting, RunObserver
from chatrl.run import Evaluation, Run, Saved, Schedule

CHATRL = Path(__file__).resolve().parents[2] / "chatrl"
STEP_PACKAGES = ("step1_sft", "step2_reward", "step2_dpo", "step3_ppo")
#: What only chatrl/run.py calls: the run marker, the checkpoint schedule, the stop.
LIFECYCLE_CALLS = {"write_run_marker", "LoopCheckpoints", "stop_here", "note_stop", "batches_from"}


def _called_names(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


def _nan_products(tree: ast.AST) -> int:
    """``x * float("nan")``: a non-finite hook written inline."""
    def is_nan(n):
        return (isinstance(n, ast.Call) and getattr(n.func, "id", "") == "float" and n.args
                and isinstance(n.args[0], ast.Constant) and n.args[0].value == "nan")
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)
               and (is_nan(n.left) or is_nan(n.right)))


def test_only_the_run_writes_markers_builds_checkpoint_schedules_and_stops():
    offenders = []
    for path in sorted(CHATRL.rglob("*.py")):
        if path.name == "run.py" and path.parent == CHATRL:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name in sorted(_called_names(tree) & LIFECYCLE_CALLS):
            offenders.append(f"{path.relative_to(CHATRL)} calls {name}")
        if path.parent.name in STEP_PACKAGES and _nan_products(tree):
            offenders.append(f"{path.relative_to(CHATRL)} writes the non-finite hook inline")
    assert offenders == []


def test_every_step_program_iterates_a_run_and_none_subclasses_it():
    for package in STEP_PACKAGES:
        tree = ast.parse((CHATRL / package / "main.py").read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.For) and isinstance(n.iter, ast.Name) and n.iter.id == "run"
                   for n in ast.walk(tree)), f"{package}/main.py has no `for step in run`"
        assert "Run" in _called_names(tree), package
        bases = [b for n in ast.walk(tree) if isinstance(n, ast.ClassDef) for b in n.bases]
        assert not any(getattr(b, "id", getattr(b, "attr", "")) == "Run" for b in bases), package


def _trainer_methods() -> set[str]:
    tree = ast.parse((CHATRL / "step3_ppo" / "trainer.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    return {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")
            and not any(getattr(d, "id", "") == "property" for d in f.decorator_list)}


def trainer_field_reads(source: str, methods: set[str]) -> list[str]:
    """Attribute uses of a trainer (``self.trainer``, ``trainer`` or a name bound to ``self.trainer``)
    that are not reads of one of ``methods`` (public methods: called, or handed on as a function)."""
    tree = ast.parse(source)
    aliases = {"trainer"}
    for node in ast.walk(tree):  # t = self.trainer; t, x = self.trainer, ...
        if isinstance(node, ast.Assign):
            targets, values = node.targets[0], node.value
            pairs = (zip(targets.elts, values.elts, strict=False) if isinstance(targets, ast.Tuple)
                     and isinstance(values, ast.Tuple) else [(targets, values)])
            for target, value in pairs:
                if (isinstance(target, ast.Name) and isinstance(value, ast.Attribute)
                        and value.attr == "trainer"):
                    aliases.add(target.id)
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        is_trainer = ((isinstance(owner, ast.Attribute) and owner.attr == "trainer")
                      or (isinstance(owner, ast.Name) and owner.id in aliases))
        # read as a method (called, or handed on: t.one_batch_actor_loss), never a field, never set
        if is_trainer and not (node.attr in methods and isinstance(node.ctx, ast.Load)):
            bad.append(f"line {node.lineno}: .{node.attr}")
    return sorted(bad)


def test_the_certificate_reads_no_field_of_a_trainer():
    methods = _trainer_methods()
    assert {"trace_learning", "learning_trace", "weight_versions", "first_optimizer_step_rows"} <= methods
    for path in (CHATRL / "evidence" / "certificate.py", CHATRL / "step3_ppo" / "evidence.py"):
        assert trainer_field_reads(path.read_text(encoding="utf-8"), methods) == [], path.name


def test_the_field_scan_sees_fields_read_and_set():
    """The scan finds what the certificate used to do: read ``t.gas``, set ``self.trainer.trace``."""
    source = ("class E:\n"
              "    def f(self, exp):\n"
              "        t = self.trainer\n"
              "        rows = exp.rows(slice(0, t.gas * t.mb))\n"
              "        self.trainer.trace = {}\n"
              "        return t.weight_versions()\n")
    found = trainer_field_reads(source, {"weight_versions"})
    assert found == ["line 4: .gas", "line 4: .mb", "line 5: .trace"]


# ------------------------------------------------------------------ behaviour, on fakes
class FakeEngine:
    """Counts finite steps in ``w``; a non-finite loss is a skipped optimizer step (as DeepSpeed counts)."""

    def __init__(self):
        self.w, self.skipped_steps = 0, 0

    def take(self, loss: torch.Tensor) -> None:
        if torch.isfinite(loss):
            self.w += 1
        else:
            self.skipped_steps += 1

    def save_checkpoint(self, path, tag, save_latest):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "w.json").write_text(json.dumps({"w": self.w, "skipped": self.skipped_steps}))

    def load_checkpoint(self, path, tag):
        saved = json.loads((Path(path) / "w.json").read_text())
        self.w, self.skipped_steps = saved["w"], saved["skipped"]


class Recorder(RunObserver):
    """An observer that keeps the run's events and closes the data accounting at the end."""

    def __init__(self, loader, steps_per_epoch):
        self.accounting = DataAccounting(loader, steps_per_epoch, 1)
        self.events, self.result = [], None

    def started(self, resumed):
        self.events.append(("started", resumed["step"] if resumed else None))

    def before_step(self, step):
        self.events.append(("before", step.number))

    def after_step(self, step):
        self.events.append(("after", step.number, step.skipped))

    def finish(self, steps):
        self.events.append(("finish", steps))
        self.result = self.accounting.finish(steps)


def _run(out: Path, **ckpt):
    """Five steps over four examples, two per batch, one batch per step (two steps an epoch); logs
    every 2 steps, evaluations at each epoch's end; the loss is NaN at step 4."""
    loader = DataLoader(list(range(4)), batch_size=2,
                        collate_fn=lambda xs: {"sample_index": torch.tensor(xs)},
                        sampler=DistributedSampler(list(range(4)), num_replicas=1, rank=0, shuffle=False))
    engine, observer, seen, saves = FakeEngine(), Recorder(loader, 2), [], []
    settings = SimpleNamespace(log=LogConfig(output_dir=str(out), log_interval=2, disable_progress_bar=True),
                               ckpt=CheckpointConfig(debug_nonfinite_steps=[4], max_nonfinite_steps=0,
                                                     **ckpt))
    info = SimpleNamespace(is_main=True, rank=0, world_size=1)
    run = Run(settings, info, Schedule(5, 2, 1, "test"), loader,
              Saved({"model": engine}, {"world_size": 1}), observer,
              evaluation=Evaluation(lambda step: {"eval/w": float(engine.w)}, lambda m: f"w {m['eval/w']}"))
    for step in run:
        batch = next(step.batches())
        step.account(batch)
        engine.take(step.nonfinite(torch.tensor(1.0)))
        seen.append((step.number, batch["sample_index"].tolist()))
        step.done(lambda w: {"train/w": w, "train/skipped": run.skipped}, engine.w)
    finished = run.finish("test", {"flag": 1}, save=lambda: saves.append(run.step))
    return run, engine, observer, seen, saves, finished


#: (step, name, value) logged by :func:`_run` over its five steps: figures every 2nd step and at the last
#: (step 4 skipped: w stays 3); evaluations before training, at each epoch's end and at the last step.
LOGGED = [(0, "eval/w", 0.0), (2, "train/skipped", 0.0), (2, "train/w", 2.0), (2, "eval/w", 2.0),
          (4, "train/skipped", 1.0), (4, "train/w", 3.0), (4, "eval/w", 3.0),
          (5, "train/skipped", 1.0), (5, "train/w", 4.0), (5, "eval/w", 4.0)]


def _logged(out: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], k, r[k]) for r in rows for k in sorted(r) if k.startswith(("train/", "eval/"))]


def test_a_whole_run_keeps_its_cadence(tmp_path):
    out = tmp_path / "run"
    run, engine, observer, seen, saves, finished = _run(out, save_interval=2)
    assert finished and saves == [5]
    assert seen == [(1, [0, 1]), (2, [2, 3]), (3, [0, 1]), (4, [2, 3]), (5, [0, 1])]
    assert engine.w == 4 and run.skipped == 1  # step 4's loss was NaN: its optimizer step skipped
    assert observer.events == [("started", None), ("before", 1), ("after", 1, False), ("before", 2),
                               ("after", 2, False), ("before", 3), ("after", 3, False), ("before", 4),
                               ("after", 4, True), ("before", 5), ("after", 5, False), ("finish", 5)]
    # figures every 2nd step and at the last; evaluations before training, at each epoch's end and at the last
    assert _logged(out) == LOGGED
    # never after the last step
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"]
    marker = json.loads((out / "chatrl_run.json").read_text())
    assert marker == {"step": "test", "steps": 5, "metrics": {"eval/w": 4.0},
                      "initial_metrics": {"eval/w": 0.0}, "args": {"flag": 1}}
    # every example as often as the order says
    assert observer.result.passed and observer.result.figure == 0.0


def test_a_stopped_run_resumes_where_its_checkpoint_left_it(tmp_path):
    out = tmp_path / "run"
    run, engine, observer, seen, saves, finished = _run(out, save_interval=2, stop_after_steps=3)
    assert not finished and run.stopped and saves == [] and not (out / "chatrl_run.json").exists()
    assert seen == [(1, [0, 1]), (2, [2, 3]), (3, [0, 1])] and ("finish", 3) not in observer.events
    run, engine, observer, seen, saves, finished = _run(out, save_interval=2, resume=True)
    assert finished and saves == [5]
    # from the step-2 checkpoint: step 3, epoch 1's first batch
    assert seen == [(3, [0, 1]), (4, [2, 3]), (5, [0, 1])]
    assert observer.events[:2] == [("started", 2), ("before", 3)] and observer.events[-1] == ("finish", 5)
    assert engine.w == 4 and run.skipped == 1  # 2 from the checkpoint, then steps 3 and 5
    # the log keeps the rows up to the checkpoint, then the resumed steps' (step 3's stopped rows are gone)
    assert _logged(out) == LOGGED
    marker = json.loads((out / "chatrl_run.json").read_text())
    # the initial metrics and the data counts came back with the checkpoint
    assert marker["steps"] == 5 and marker["initial_metrics"] == {"eval/w": 0.0}
    assert observer.result.passed and observer.result.figure == 0.0


def test_the_non_finite_hook_marks_only_the_listed_steps(tmp_path):
    run, *_ = _run(tmp_path / "run")
    run.step = 3  # taking step 4
    assert math.isnan(float(run.nonfinite(torch.tensor(2.0))))
    run.step = 4  # taking step 5
    x = torch.tensor(2.0)
    assert run.nonfinite(x) is x
