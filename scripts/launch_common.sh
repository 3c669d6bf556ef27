# Sourced by the single-node per-step scripts, from the repository root.
# PORT: the DeepSpeed launcher's port, a free one (as train.py picks it; the launcher's default 29500 made
# two scripts, or a script beside another job, collide); MASTER_PORT=N chooses it.
PORT=${MASTER_PORT:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
# Ctrl-C reaches every rank, and rank 0 says in one line what was saved and how to go on (the scripts pass
# --resume, so running one again continues). Ignored here and by the launcher's front process, whose own
# KeyboardInterrupt traceback would otherwise follow that line; the launcher and the ranks still get it.
trap '' INT
