"""Exact replay of a recorded step-3 training step.

    python -m chatrl.replay OUTPUT --step N

Reads the rollout record of step ``N`` (``--save_rollouts``, :mod:`chatrl.rollout_records`), builds
the run again from its recorded flags, loads the checkpoint of step ``N - 1`` (the weights,
optimizer states and KL coefficient the step started from; step 1 starts from the models as
loaded), feeds each rank its recorded rollouts (tokens, sampler log-probs, scores and reward parts)
through the trainer's experience and learning passes (:func:`chatrl.step3_ppo.main.learn_from`),
and compares, in the order they are computed: the weight stamps of the rollouts against the
checkpoint's weights, the reference log-probs, the trainer's log-probs, the entropy, the values,
the KL, the per-token rewards, the advantages, the returns, the importance weights, the ratios and
clip flags of every PPO epoch, the gradient norm of every actor and critic optimizer step, and the
step's actor and critic losses. Equal (bit for bit by default, ``--atol`` to loosen) prints the
figures and exits 0; otherwise the first differing quantity is named, with where and both values,
and the exit code is 1.

Run it as it is: a record of several ranks is replayed under ``torch.distributed.run`` with the
same number of ranks (started by the command itself). The replay writes its own logs under
``OUTPUT/replay/step_N``; the run's folder is left as it was.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from chatrl import cli, config, dist
from chatrl.checkpoint import CHECKPOINT_DIR
from chatrl.rl.stats import PooledStats
from chatrl.rollout_records import read_step, resolve_output
from chatrl.step3_ppo.main import build, build_parser, learn_from, restore
from chatrl.step3_ppo.trainer import Experience
from chatrl.weight_version import WeightVersionError

#: The compared quantities, in the order they are computed (the first differing one is named).
PER_TOKEN = ("ref_logp", "logp", "entropy", "values", "kl", "rewards", "advantages", "returns", "is_weights")


def replay_argv(index: dict, output: Path, step: int) -> list[str]:
    """Step 3's command line for the replay: the recorded flags, its own output folder, the checkpoint
    of step ``step - 1`` (none for step 1), no records, checkpoints or testing stops.

    Raises:
        FileNotFoundError: the checkpoint of step ``step - 1`` is gone (naming it).
    """
    values = dict(index["args"])
    ckpt = output / CHECKPOINT_DIR / f"step_{step - 1}"
    if step > 1 and not (ckpt / "complete.json").is_file():
        raise FileNotFoundError(f"{ckpt}: the checkpoint step {step} started from is gone (removed by "
                                "--save_total_limit?); replay a step whose previous checkpoint is kept")
    values.update(output_dir=str(output / "replay" / f"step_{step}"), overwrite_output_dir=True,
                  resume=False, resume_from_checkpoint=str(ckpt) if step > 1 else None, save_rollouts=0,
                  save_interval=0, stop_after_steps=0, debug_nonfinite_steps=[], disable_progress_bar=True,
                  enable_tensorboard=False, print_answers=False)
    parser = build_parser()
    known = {a.dest for a in parser._actions}
    return config.to_argv(parser, {k: v for k, v in values.items() if k in known})


def recorded_experience(rank_record: dict, device) -> Experience:
    """The rollouts of one rank's record as the trainer's :class:`Experience` (what generation and
    the reward gave; everything after them is computed again)."""
    t = {k: v.to(device) for k, v in rank_record["tensors"].items()}
    return Experience(t["sequences"], t["attention_mask"].long(), int(rank_record["prompt_len"]),
                      t["action_mask"].long(), t["sampler_logp"], t["scores"],
                      {k: v for k, v in t.items() if k.startswith("reward/")}, list(rank_record["metadata"]),
                      weight_version=t.get("weight_version"), weight_checksum=t.get("weight_checksum"),
                      turn_rewards=t.get("turn_rewards"), turns=t.get("turns"))


def _first_difference(name: str, recorded: torch.Tensor, replayed: torch.Tensor | None, atol: float):
    """None when equal (within ``atol``), else ``(where, recorded value, replayed value)``."""
    if replayed is None:
        return ("missing in the replay", "", "")
    a, b = recorded.float().cpu(), replayed.detach().float().cpu()
    if a.shape != b.shape:
        return (f"shape {tuple(a.shape)} vs {tuple(b.shape)}", "", "")
    diff = (a - b).abs()
    bad = ~(diff <= atol) & ~(torch.isnan(a) & torch.isnan(b))
    if not bad.any():
        return None
    at = tuple(int(i) for i in bad.nonzero()[0])
    return (f"at {at} ({int(bad.sum())} of {bad.numel()} elements differ)", float(a[at]), float(b[at]))


def compare_rank(rank_record: dict, exp: Experience, trace: dict, atol: float) -> list[tuple[int, str]]:
    """This rank's differences as ``(order, message)`` (order: computation order of the quantity)."""
    out, t = [], rank_record["tensors"]
    names = [*PER_TOKEN, "ratio", "clip"]
    for order, name in enumerate(names):
        if name not in t:
            continue
        replayed = getattr(exp, name, None) if name in PER_TOKEN else (
            torch.stack(trace[name]) if trace.get(name) else None)
        d = _first_difference(name, t[name], replayed, atol)
        if d:
            out.append((order + 1, f"{name} on rank {dist.get_rank()} {d[0]}: recorded {d[1]!r}, replayed {d[2]!r}"))
    return out


def compare_figures(figures: dict, trace: dict, metrics: dict, atol: float) -> list[tuple[int, str]]:
    """The step's global figures (rank 0's view): gradient norms per optimizer step, then the losses."""
    out, base = [], len(PER_TOKEN) + 3
    for order, key in enumerate(("actor_grad_norm", "critic_grad_norm")):
        rec, got = list(figures.get(key) or []), list(trace.get(key) or [])
        if len(rec) != len(got):
            out.append((base + order, f"{key}: {len(rec)} optimizer steps recorded, {len(got)} replayed"))
            continue
        for i, (a, b) in enumerate(zip(rec, got, strict=True)):
            if not abs(a - b) <= atol:
                out.append((base + order, f"{key} of optimizer step {i + 1}: recorded {a!r}, replayed {b!r}"))
                break
    for order, key in enumerate(("actor_loss", "critic_loss")):
        a, b = figures.get(key), metrics.get(key)
        if a is not None and not (b is not None and (abs(a - b) <= atol or (math.isnan(a) and math.isnan(b)))):
            out.append((base + 2 + order, f"{key}: recorded {a!r}, replayed {b!r}"))
    return out


def replay(output: str | os.PathLike, step: int, atol: float = 0.0) -> dict:
    """Replay step ``step`` of the run in ``output`` on this rank (every rank of the recorded world
    calls it); returns ``{"ok", "first", "differences", "metrics"}`` (the same on every rank)."""
    folder = resolve_output(output)
    index, ranks = read_step(folder, step)
    world = int(index["world_size"])
    if int(os.environ.get("WORLD_SIZE", "1")) != world:
        raise SystemExit(f"chatrl.replay: the record was made by {world} ranks; this replay runs on "
                         f"{os.environ.get('WORLD_SIZE', '1')} (run `python -m chatrl.replay` without a launcher)")
    run = build(cli.parse(build_parser(), replay_argv(index, folder, step)))
    done, _, _ = restore(run)
    if done != step - 1:
        raise SystemExit(f"chatrl.replay: the checkpoint holds step {done}, not step {step - 1}")
    record = ranks[run.info.rank]
    exp = recorded_experience(record, run.info.device)
    run.trainer.trace_learning(True)
    stats, diffs = PooledStats(), []
    metrics: dict = {}
    try:
        exp, agreement = learn_from(run, [exp], stats)
        metrics = {**stats.finish(dist.all_reduce_sum if run.info.world_size > 1 else None),
                   **{k: float(v) for k, v in agreement.items()}}
        diffs = compare_rank(record, exp, run.trainer.learning_trace(), atol)
    except WeightVersionError as err:
        diffs = [(0, f"weight version: {err}")]
    if run.info.is_main and not (diffs and diffs[0][0] == 0):
        diffs += compare_figures(index.get("figures") or {}, run.trainer.learning_trace(), metrics, atol)
    gathered = [None] * run.info.world_size
    if run.info.world_size > 1:
        torch.distributed.all_gather_object(gathered, diffs)
    else:
        gathered = [diffs]
    everything = sorted(d for part in gathered for d in part)
    result = {"ok": not everything, "first": everything[0][1] if everything else None,
              "differences": [m for _, m in everything], "metrics": metrics, "figures": index.get("figures")}
    if run.info.is_main:
        Path(run.settings.log.output_dir, "replay.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def _under_launcher() -> bool:
    return "WORLD_SIZE" in os.environ or "RANK" in os.environ


def main(argv: list[str] | None = None) -> None:
    """``python -m chatrl.replay OUTPUT --step N [--atol X]``: exit 0 when the replay matches, 1 when not."""
    p = argparse.ArgumentParser(prog="python -m chatrl.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", help="step 3's --output_dir (or train.py's --output-dir), run with --save_rollouts")
    p.add_argument("--step", type=int, required=True, help="the recorded step to replay")
    p.add_argument("--atol", type=float, default=0.0, help="largest difference counted as equal (default 0: bit for bit)")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        index, _ = read_step(resolve_output(a.output), a.step)
    except FileNotFoundError as e:
        raise SystemExit(f"chatrl.replay: {e}") from None
    world = int(index["world_size"])
    if world > 1 and not _under_launcher():  # the record's ranks, started here
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
               str(dist.free_port()), "-m", "chatrl.replay", str(a.output), "--step", str(a.step), "--atol", str(a.atol)]
        raise SystemExit(subprocess.call(cmd))

    def program():
        result = replay(a.output, a.step, a.atol)
        if dist.is_main():
            if result["ok"]:
                fig = result["figures"] or {}
                print(f"chatrl.replay: step {a.step} replayed exactly: actor_loss {fig.get('actor_loss')!r}, "
                      f"critic_loss {fig.get('critic_loss')!r}, actor gradient norms {fig.get('actor_grad_norm')}, "
                      f"critic gradient norms {fig.get('critic_grad_norm')}", flush=True)
            else:
                print(f"chatrl.replay: step {a.step} differs; first differing quantity: {result['first']}", flush=True)
                for line in result["differences"][1:8]:
                    print(f"  then: {line}", flush=True)
        if not result["ok"]:
            dist.shutdown()
            dist.exit_now(1)
        return result

    dist.run_program(program)


if __name__ == "__main__":
    main()
