"""Jobs whose ranks sit on several hosts: the DeepSpeed hostfile, the launcher's two multi-node modes,
and naming the node a lost connection points to.

The DeepSpeed launcher (``deepspeed --hostfile H ...``) starts a multi-node job in one of two ways:

* **ssh mode** (the default, ``--launcher pdsh``): run once, on the first host; it reaches every
  host of the hostfile over passwordless ssh (``pdsh``), ``cd``s to the same path there and runs
  ``deepspeed.launcher.launch`` with that host's node rank. Environment variables reach the other
  hosts only if their names start with ``NCCL``/``PYTHON``/… or they are listed in ``.deepspeed_env``.
* **no-ssh mode** (``--no_ssh --node_rank N --master_addr HOST0``): run once on every host, each
  with its own node rank; what a scheduler (Slurm's ``srun``, Kubernetes) does. Nothing is copied
  between hosts; ``--master_addr`` is required (without it the launcher asks the first host over ssh).

Global ranks follow the hostfile's order: host ``i`` holds the ranks after the slots of hosts
``0 … i-1`` (``deepspeed.launcher.launch``'s ``global_rank_mapping``). See docs/multi_node.md.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path


def read_hostfile(path: str | Path) -> dict[str, int]:
    """Hosts and their slots (ranks per host), in order, from a DeepSpeed hostfile.

    Parsed by DeepSpeed's own launcher code, so that this reads exactly what the launcher reads:
    one ``host slots=N`` line per node; ``#`` comments and blank lines are ignored.

    Raises:
        SystemExit: the file is missing, empty, names a host twice or has a malformed line (the
            message names the file).
    """
    from deepspeed.launcher.runner import fetch_hostfile

    if not Path(path).is_file():
        raise SystemExit(f"hostfile {path} does not exist (one 'host slots=N' line per node)")
    try:
        hosts = fetch_hostfile(str(path))
    except ValueError as e:
        raise SystemExit(f"hostfile {path}: {e} (expected one 'host slots=N' line per node)") from None
    return dict(hosts)


def global_ranks(hosts: dict[str, int]) -> dict[str, list[int]]:
    """Host → the global ranks it runs, in the launcher's order (hostfile order, slots consecutive)."""
    out, first = {}, 0
    for host, slots in hosts.items():
        out[host] = list(range(first, first + slots))
        first += slots
    return out


def launcher_flags(hostfile: str | Path, node_rank: int | None, master_addr: str | None) -> list[str]:
    """The DeepSpeed launcher flags for a multi-node job.

    ``node_rank`` None: ssh mode (this process starts every node). Otherwise no-ssh mode: this process
    starts node ``node_rank`` only and every node's process must be started with the same hostfile,
    ``master_addr`` (default: the hostfile's first host, which runs global rank 0) and port.

    Raises:
        SystemExit: the hostfile is unusable or ``node_rank`` is not one of its nodes.
    """
    hosts = read_hostfile(hostfile)
    flags = ["--hostfile", str(hostfile)]
    if master_addr:
        flags += ["--master_addr", master_addr]
    if node_rank is None:
        return flags
    if not 0 <= node_rank < len(hosts):
        raise SystemExit(f"--node-rank {node_rank}: {hostfile} lists {len(hosts)} nodes (0 … {len(hosts) - 1})")
    if not master_addr:
        flags += ["--master_addr", next(iter(hosts))]
    return [*flags, "--no_ssh", "--node_rank", str(node_rank)]


# gloo's "Connection closed by peer [ADDR]:PORT" or "Read error [ADDR]:PORT: Connection reset by peer"
_LOST = re.compile(r"Connection (?:closed|reset) by peer|Connection refused|Broken pipe")
_PEER_ADDR = re.compile(r"\[([^\]\s]+)\]:(\d+)")


def _addresses(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


def lost_peer(failures: list[str], hosts: dict[str, int], this_node: int | None) -> str | None:
    """Which other node a lost connection points to, from a step's failure lines.

    ``failures`` are the lines a failed step printed (chatrl's per-rank report holds gloo's
    ``Connection closed by peer [ADDR]:PORT``). The candidates are the hosts other than
    ``this_node``; when some of them resolve to ``ADDR``, only those (all of them when the line
    gives no address). Returns a sentence naming the
    node(s) with their node ranks and global ranks, or None when no line reports a lost connection.
    """
    lost = [line for line in failures if _LOST.search(line)]
    if not lost:
        return None
    found = [m.group(1) for m in map(_PEER_ADDR.search, lost) if m]
    addr = found[0] if found else "another node"
    ranks = global_ranks(hosts)
    others = [(i, h) for i, h in enumerate(hosts) if i != this_node]
    matching = [(i, h) for i, h in others if addr in _addresses(h) or addr == h]
    named = matching or others
    what = "; ".join(f"{h} (node {i}, global rank{'s' if len(ranks[h]) > 1 else ''} "
                     f"{_span(ranks[h])})" for i, h in named)
    if len(named) == 1:
        return f"lost the connection to {addr}: {what} has stopped (killed, crashed or unreachable)"
    return f"lost the connection to {addr}: one of the other nodes has stopped: {what}"


def _span(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}–{ranks[-1]}"
