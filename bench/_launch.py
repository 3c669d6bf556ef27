"""Self-launch for the benchmarks that run over several ranks of one machine.

A benchmark started plainly (``.venv/bin/python bench/X.py``) starts itself again under torchrun
and reports what the ranks print; started by the launcher (its rank variables set), it measures.
:func:`self_launch` is the second start, shared by ``bench/collectives.py`` and
``bench/hybrid_engine.py``; each script keeps its own environment and its own reading of the output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def self_launch(script: str | os.PathLike, nprocs: int, argv: list[str], env: dict[str, str],
                capture: bool = False) -> subprocess.CompletedProcess:
    """Run ``script argv`` over ``nprocs`` ranks of this machine and wait for it to end.

    The command is ``python -m torch.distributed.run --nproc_per_node nprocs --master_port <a free
    local port> script argv`` (this interpreter), run from the repository root with ``env`` laid
    over this process's environment. With ``capture`` the ranks' stdout and stderr are returned as
    text in the result; otherwise they pass through. A non-zero exit is the caller's to report
    (``returncode``); nothing is raised for it.
    """
    from chatrl.distributed.dist import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs),
           "--master_port", str(free_port()), str(script), *argv]
    return subprocess.run(cmd, env={**os.environ, **env}, cwd=REPO, capture_output=capture, text=capture)
