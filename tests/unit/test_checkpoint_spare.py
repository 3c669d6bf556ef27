"""Checkpoint pruning: --save_total_limit keeps the newest checkpoints, and those a caller spares
(step 3 spares the checkpoint a recorded step starts from, which ``python -m chatrl.tools.replay`` needs)."""

from pathlib import Path

from chatrl.checkpoint import list_checkpoints, save_checkpoint


class FolderEngine:
    """What save_checkpoint asks of a DeepSpeed engine: write its state under a folder."""

    def save_checkpoint(self, path, tag, save_latest):
        (Path(path) / tag).mkdir(parents=True, exist_ok=True)


def test_pruning_keeps_the_newest_and_the_spared(tmp_path):
    for step in (10, 19, 20, 30, 39, 40):
        save_checkpoint({"model": FolderEngine()}, tmp_path, step, {}, keep=2,
                        spare=lambda s: (s + 1) % 20 == 0)  # the starts of recorded steps 20 and 40
    assert sorted(int(p.name[5:]) for p in list_checkpoints(tmp_path)) == [19, 39, 40]
    for step in (50, 60):
        save_checkpoint({"model": FolderEngine()}, tmp_path / "plain", step, {}, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path / "plain")] == ["step_60"]
