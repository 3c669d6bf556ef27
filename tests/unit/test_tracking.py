"""The metrics log: rows per step, and a resume that drops the rows of steps it will redo."""

import json

from chatrl.tracking import Tracker


def _steps(path):
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def test_resume_drops_rows_after_the_checkpoint_and_keeps_the_old_log(tmp_path):
    t = Tracker(str(tmp_path), enabled=True, progress=False)
    for step in range(1, 6):
        t.log({"train/loss": 1.0 / step, "eval/ppl": float("nan")}, step)
    t.close()
    with open(tmp_path / "logs" / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train/lo')  # the crash cut the last line
    t = Tracker(str(tmp_path), enabled=True, progress=False)
    t.resumed_at(3)
    t.log({"train/loss": 0.3}, 4)
    t.close()
    log = tmp_path / "logs"
    assert _steps(log / "metrics.jsonl") == [1, 2, 3, 4]
    assert json.loads((log / "metrics.jsonl").read_text().splitlines()[-1])["train/loss"] == 0.3
    before = (log / "metrics.before-resume-1.jsonl").read_text()
    assert before.count("\n") == 5 and before.endswith('"train/lo')  # nothing lost, cut line included
    t = Tracker(str(tmp_path), enabled=True, progress=False)
    t.resumed_at(2)
    t.close()
    assert _steps(log / "metrics.jsonl") == [1, 2]
    assert (log / "metrics.before-resume-2.jsonl").exists()


def test_other_ranks_write_nothing(tmp_path):
    t = Tracker(str(tmp_path), enabled=False)
    t.log({"x": 1.0}, 1)
    t.resumed_at(0)
    t.close()
    assert not (tmp_path / "logs").exists()
