#!/usr/bin/env python
"""Regenerate the learning curves CI guards (``tests/reference_curves/<setup>.json``).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/reference_curves.py                 # every set-up
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/reference_curves.py --setups ppo dpo

Each set-up (``tests/reference_curves/curves.py``) runs once per reference seed on 2 CPU ranks (one
at a time), and its file is rewritten with the first seed's figures and the bands the seeds give.
Commit the files with the change that moved the curves: the diff shows what moved, and by how much.
Prints one JSON line per set-up (its figures per seed and the run time).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reference_curves.curves import HERE, SEEDS, SETUPS, reference, run_setup, sft_base  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", nargs="+", choices=sorted(SETUPS), default=list(SETUPS), help="set-ups to regenerate")
    p.add_argument("--work", default=None, help="work folder (default: a temporary one, removed at the end)")
    a = p.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="chatrl_curves_"))
    try:
        base = sft_base(work)
        for name in a.setups:
            t0 = time.time()
            runs = {seed: run_setup(name, seed, work / f"{name}_seed{seed}", base) for seed in SEEDS}
            (HERE / f"{name}.json").write_text(json.dumps(reference(name, runs), indent=1) + "\n", encoding="utf-8")
            print(json.dumps({"setup": name, "seconds": round(time.time() - t0, 1), "runs": runs}), flush=True)
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
