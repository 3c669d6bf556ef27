#!/usr/bin/env bash
# Make (or reuse) the separate TRL virtual environment of the peer benchmark at $TRL_VENV
# (default /tmp/trl_cpu/venv). An existing venv with trl 1.12.0 importable is reused as it is;
# one without it gets the pinned packages installed; nothing is ever deleted.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=${TRL_VENV:-/tmp/trl_cpu/venv}
ok() { "$VENV/bin/python" -c "import trl, sys; from trl.experimental.ppo import PPOTrainer; sys.exit(trl.__version__ != '1.12.0')" 2>/dev/null; }
if ok; then echo "TRL venv: $VENV (reused)"; exit 0; fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "$(grep '^torch==' "$HERE/requirements-trl.txt")"   # torch first: the CPU wheel
"$VENV/bin/pip" install -q -r "$HERE/requirements-trl.txt"
ok || { echo "TRL venv $VENV: trl 1.12.0 with trl.experimental.ppo is not importable after install" >&2; exit 1; }
echo "TRL venv: $VENV (installed)"
