"""Unit checks of the shared fault logic: the non-finite guard's counting, the ZeRO-0 step guard, the
checkpoint schedule, and the PTX batch cycle's resume position."""

import types

import pytest
import torch

from chatrl.checkpoint import Cycle, LoopCheckpoints, batches_from
from chatrl.config import CheckpointConfig
from chatrl.distributed.resilience import NonFiniteError, NonFiniteGuard, skip_nonfinite_steps


def test_guard_counts_skipped_optimizer_steps_and_stops_after_k_in_a_row():
    actor, critic = types.SimpleNamespace(skipped_steps=0), types.SimpleNamespace(skipped_steps=0)
    guard = NonFiniteGuard({"actor": actor, "critic": critic}, max_in_a_row=3)
    assert guard.after_step(1) is False
    actor.skipped_steps, critic.skipped_steps = 2, 1  # one bad buffer: 3 optimizer steps skipped
    assert guard.after_step(2) is True and guard.skipped == 3 and guard.in_a_row == 1
    assert guard.after_step(3) is False and guard.in_a_row == 0  # a good step resets the run
    actor.skipped_steps += 1
    guard.after_step(4)
    actor.skipped_steps += 1
    guard.after_step(5)
    actor.skipped_steps += 1
    with pytest.raises(NonFiniteError, match=r"3 training steps in a row \(up to step 6\).*--max_nonfinite_steps 3"):
        guard.after_step(6)
    assert guard.skipped == 6


def test_guard_with_zero_limit_never_stops():
    e = types.SimpleNamespace(skipped_steps=0)
    guard = NonFiniteGuard({"m": e}, max_in_a_row=0)
    for step in range(1, 20):
        e.skipped_steps += 1
        assert guard.after_step(step)
    assert guard.skipped == 19


def test_plain_optimizer_skips_a_nonfinite_step_and_keeps_its_state():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = skip_nonfinite_steps(torch.optim.Adam([w], lr=0.1))
    w.grad = torch.tensor([1.0, 1.0])
    opt.step()
    assert opt.overflow is False
    after_good, state = w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}
    w.grad = torch.tensor([float("nan"), 1.0])
    opt.step()
    assert opt.overflow is True and w.grad is None
    assert torch.equal(w.detach(), after_good)
    assert all(torch.equal(opt.state[w][k], v) for k, v in state.items())
    w.grad = torch.tensor([float("inf"), 0.0])
    opt.step()
    assert opt.overflow is True and torch.equal(w.detach(), after_good)


def test_plain_optimizer_clips_to_max_norm_with_the_guards_norm():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = skip_nonfinite_steps(torch.optim.SGD([w], lr=1.0), max_norm=1.0)
    w.grad = torch.tensor([3.0, 4.0])  # norm 5: scaled by 1 / (5 + 1e-6), DeepSpeed's and torch's rule
    opt.step()
    assert torch.allclose(w.detach(), torch.tensor([1.0 - 0.6, 2.0 - 0.8]), atol=1e-6)
    w.grad = torch.tensor([0.3, 0.4])  # norm 0.5 < 1: unchanged
    opt.step()
    assert torch.allclose(w.detach(), torch.tensor([0.1, 0.8]), atol=1e-6)


def test_the_guard_keeps_the_schedules_step_tracking_and_no_warning_is_raised():
    """The guard wraps ZeRO-0's optimizer after its learning-rate schedule was built (DeepSpeed's
    engine steps the schedule after each optimizer step); torch warned "optimizer.step() has been
    overridden" at the schedule's first step, once per trained model and rank."""
    import warnings

    w = torch.nn.Parameter(torch.tensor([1.0]))
    base = torch.optim.SGD([w], lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(base, lambda s: 0.5 * (s + 1))
    opt = skip_nonfinite_steps(base)
    w.grad = torch.tensor([1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        schedule.step()
    assert base._opt_called is True  # the schedule's tracking ran inside the guarded step
    assert w.item() == pytest.approx(1.0 - 0.5) and base.param_groups[0]["lr"] == pytest.approx(1.0)


@pytest.mark.parametrize("interval,total,due", [(2, 7, [2, 4, 6]), (3, 6, [3]), (0, 5, [])])
def test_checkpoint_is_due_every_interval_but_not_after_the_last_step(interval, total, due):
    ckpt = LoopCheckpoints(CheckpointConfig(save_interval=interval), "out", {}, {"world_size": 1})
    assert [s for s in range(1, total + 1) if ckpt.due(s, total)] == due


def test_cycle_skip_resumes_at_the_same_batch_across_epochs():
    data = list(range(10))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)

    def loader():
        return torch.utils.data.DataLoader(data, batch_size=3, sampler=sampler, drop_last=True,
                                           collate_fn=lambda b: {"x": torch.tensor(b)},
                                           generator=torch.Generator().manual_seed(3))

    straight = Cycle(loader(), "cpu")
    seen = [next(straight)["x"].tolist() for _ in range(8)]  # 3 batches per epoch: crosses two epoch ends
    assert seen[0] != seen[3]  # each epoch is shuffled anew
    resumed = Cycle(loader(), "cpu")
    resumed.skip(5)
    assert resumed.consumed == 5
    assert [next(resumed)["x"].tolist() for _ in range(3)] == seen[5:]


class _Evil:
    def __reduce__(self):
        return (print, ("code ran while loading a checkpoint",))


def test_engine_checkpoint_reads_are_weights_only(tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from chatrl.checkpoint import _weights_only_loads

    good, evil = tmp_path / "good.pt", tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "stage": ZeroStageEnum.weights}, good)
    torch.save({"x": _Evil()}, evil)
    engine = types.SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    with _weights_only_loads(engine):
        assert engine.checkpoint_engine.load(str(good))["stage"] == ZeroStageEnum.weights
        with pytest.raises(Exception, match="Weights only load failed"):
            engine.checkpoint_engine.load(str(evil))
    assert "load" not in vars(engine.checkpoint_engine)  # DeepSpeed's own method is back afterwards


def test_batches_from_gives_a_resumed_step_the_same_batches():
    data = list(range(20))

    def loader():
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=5)
        return torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler, generator=torch.Generator())

    steps_per_epoch, per_step = 2, 2  # 5 batches per epoch on this rank, 2 per step, the 5th unused
    straight = []
    for epoch in range(2):
        it = batches_from(loader(), epoch * steps_per_epoch, steps_per_epoch, per_step)
        straight += [[next(it).tolist() for _ in range(per_step)] for _ in range(steps_per_epoch)]
    for step in range(4):
        it = batches_from(loader(), step, steps_per_epoch, per_step)
        assert [next(it).tolist() for _ in range(per_step)] == straight[step], step
    assert straight[0] != straight[2]  # epochs differ


def test_failure_report_names_rank_step_and_progress_but_not_usage_errors(capsys, monkeypatch):
    from chatrl.distributed.resilience import report_failure, set_progress

    monkeypatch.setenv("RANK", "1")
    set_progress("step 2 (reward model)", 7)
    with pytest.raises(RuntimeError), report_failure():
        raise RuntimeError("[/src/gloo/pair.cc:537] Read error [127.0.0.1]:4000: Connection reset by peer\nmore")
    err = capsys.readouterr().err
    assert ("chatrl: rank 1 failed in step 2 (reward model) after optimizer step 7: RuntimeError: "
            "Read error [127.0.0.1]:4000: Connection reset by peer\n") in err
    assert "another rank has probably died" in err
    with pytest.raises(SystemExit), report_failure():
        raise SystemExit(2)  # argparse has printed its own message
    assert capsys.readouterr().err == ""


def test_ctrl_c_is_one_line_saying_what_was_saved_and_how_to_go_on(capsys, monkeypatch):
    """Ctrl-C printed a raw KeyboardInterrupt traceback per rank; now rank 0 prints one line and the
    process exits with 130 (the shells' code for SIGINT)."""
    from chatrl.distributed import resilience
    from chatrl.distributed.resilience import report_failure, set_progress

    monkeypatch.setattr(resilience, "_PROGRESS", dict(resilience._PROGRESS, saved=None, resumes=False))
    monkeypatch.setenv("RANK", "0")
    set_progress("step 3 (grpo)", 5)
    with pytest.raises(SystemExit) as exit_, report_failure():
        raise KeyboardInterrupt
    assert exit_.value.code == 130
    assert capsys.readouterr().err == ("chatrl: interrupted (Ctrl-C) in step 3 (grpo) after optimizer step 5; nothing "
                                       "saved yet (no checkpoint written: --save_interval); the same command starts "
                                       "again\n")
    set_progress(saved="out/checkpoints/step_4", saved_step=4, resumes=True)
    with pytest.raises(SystemExit), report_failure():
        raise KeyboardInterrupt
    assert capsys.readouterr().err == ("chatrl: interrupted (Ctrl-C) in step 3 (grpo) after optimizer step 5; saved: "
                                       "the checkpoint out/checkpoints/step_4 (optimizer step 4); the same command "
                                       "resumes from it\n")
    set_progress(resumes=False)
    with pytest.raises(SystemExit), report_failure():
        raise KeyboardInterrupt
    assert capsys.readouterr().err.endswith("(optimizer step 4); the same command with --resume continues from it\n")
    monkeypatch.setenv("RANK", "1")  # the other ranks say nothing
    with pytest.raises(SystemExit) as exit_, report_failure():
        raise KeyboardInterrupt
    assert exit_.value.code == 130 and capsys.readouterr().err == ""


def test_train_py_stops_a_step_on_ctrl_c_with_one_line(tmp_path):
    """train.py on Ctrl-C: the step is told, winds down within the grace time, and one line says what is
    kept (a real child process that prints a line per step and its own line on SIGINT)."""
    import os
    import signal
    import sys
    import threading
    import time

    from tests.unit.test_entry_points import train

    script = ("import signal, sys, time\n"
              "def stop(*a):\n    print('chatrl: interrupted (Ctrl-C) in step 1 (SFT) after optimizer step 1'); sys.exit(130)\n"
              "signal.signal(signal.SIGINT, stop)\n"
              "for i in range(600):\n    print(f'step {i}', flush=True); time.sleep(0.1)\n")
    step_dir, log = tmp_path / "step1_actor", tmp_path / "logs" / "step1.log"
    (step_dir / "checkpoints" / "step_2").mkdir(parents=True)
    (step_dir / "checkpoints" / "step_2" / "complete.json").write_text("{}")

    def interrupt():
        while not (log.exists() and "step 3" in log.read_text()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.time()
    with pytest.raises(train.Interrupted) as stop:
        train.run_step(1, [sys.executable, "-c", script], {}, log, step_dir)
    assert time.time() - t0 < 30
    assert "chatrl: interrupted (Ctrl-C) in step 1" in log.read_text()  # the step's own line is in its log
    assert stop.value.message(overwrite=False) == (
        f"train.py: interrupted (Ctrl-C) in step 1 (supervised fine-tuning); finished steps are kept, its newest "
        f"checkpoint is {step_dir / 'checkpoints' / 'step_2'} (the same command resumes from it); log: {log}")
