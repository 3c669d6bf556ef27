"""Exact replay of a recorded step-3 training step.

    python -m chatrl.tools.replay OUTPUT --step N [--atol X]

Reads the rollout record of step ``N`` (``--save_rollouts``, :mod:`chatrl.evidence.rollout_records`), builds
the run again from its recorded flags, loads the checkpoint of step ``N - 1``, trains on the recorded
rollouts (step 3's side: ``chatrl/step3_ppo/replay.py``), and compares, in the order they are
computed: the weight stamps of the rollouts against the checkpoint's weights, the reference
log-probs, the trainer's log-probs, the entropy, the values, the KL, the per-token rewards, the
advantages, the returns, the importance weights, the ratios and clip flags of every PPO epoch, the
gradient norm of every actor and critic optimizer step, and the step's actor and critic losses.
Equal (bit for bit by default, ``--atol`` to loosen) prints the figures and exits 0; otherwise the
first differing quantity is named, with where and both values, and the exit code is 1.

Run it as it is: it starts step 3's replay program with the record's number of ranks (under
``torch.distributed.run`` for more than one). The replay writes its own logs under
``OUTPUT/replay/step_N``; the run's folder is left as it was.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from chatrl.distributed.dist import free_port
from chatrl.evidence.rollout_records import read_step, resolve_output

#: The program each rank runs (step 3's side of the replay), started by module name.
RANK_PROGRAM = "chatrl.step3_ppo.replay"


def build_parser() -> argparse.ArgumentParser:
    """The replay's flags."""
    p = argparse.ArgumentParser(prog="python -m chatrl.tools.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", help="step 3's --output_dir (or train.py's --output-dir), run with "
                                  "--save_rollouts")
    p.add_argument("--step", type=int, required=True, help="the recorded step to replay")
    p.add_argument("--atol", type=float, default=0.0,
                   help="largest difference counted as equal (default 0: bit for bit)")
    return p


def rank_command(output: str, step: int, atol: float, world_size: int) -> list[str]:
    """The command line that replays ``step`` of ``output`` on ``world_size`` ranks."""
    args = ["-m", RANK_PROGRAM, str(output), "--step", str(step), "--atol", str(atol)]
    if world_size == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
            "--master_port", str(free_port()), *args]


def main(argv: list[str] | None = None) -> None:
    """``python -m chatrl.tools.replay OUTPUT --step N [--atol X]``: exit 0 when the replay matches, 1 when not.

    Raises:
        SystemExit: no such record (naming the recorded steps), a command under a launcher, or the
            replay's exit code.
    """
    a = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if "WORLD_SIZE" in os.environ or "RANK" in os.environ:
        raise SystemExit("chatrl.tools.replay starts the record's ranks itself: run `python -m chatrl.tools.replay` "
                         "without a launcher")
    try:
        index, _ = read_step(resolve_output(a.output), a.step)
    except FileNotFoundError as e:
        raise SystemExit(f"chatrl.tools.replay: {e}") from None
    raise SystemExit(subprocess.call(rank_command(a.output, a.step, a.atol, int(index["world_size"]))))


if __name__ == "__main__":
    main()
