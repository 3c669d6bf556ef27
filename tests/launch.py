"""Run a Python module or script over N CPU ranks (torchrun) from a test, with a hard timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from chatrl.distributed.dist import free_port

REPO = Path(__file__).resolve().parents[1]


def run_ranks(args: list[str], nprocs: int = 2, timeout: float = 300, env: dict | None = None,
              check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m torch.distributed.run --nproc_per_node N <args>`` on CPU and return the result.

    ``args`` is what follows the launcher: ``["-m", "chatrl.step1_sft", "--flag", ...]`` or a script
    path. Output is captured; with ``check`` a non-zero exit raises with the tail of the log.
    """
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs),
           "--master_port", str(free_port()), *args] if nprocs > 1 else [sys.executable, *args]
    proc = subprocess.run(cmd, env=full_env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return proc
