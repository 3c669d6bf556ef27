"""Step 3's side of ``python -m chatrl.tools.replay`` (:mod:`chatrl.tools.replay`, which documents the command and
starts this program on each rank of the record): builds the run again from its recorded flags, loads
the checkpoint of step ``N - 1`` (the weights, optimizer states and KL coefficient the step started
from; step 1 starts from the models as loaded), feeds each rank its recorded rollouts (tokens, sampler
log-probs, scores and reward parts) through the trainer's experience and learning passes
(:func:`chatrl.step3_ppo.main.learn_from`) and compares what they compute with the record
(:func:`chatrl.evidence.rollout_records.compare_rank`, :func:`chatrl.evidence.rollout_records.compare_figures`). The
replay writes its own logs under ``OUTPUT/replay/step_N``; the run's folder is left as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from chatrl import cli, config
from chatrl.checkpoint import CHECKPOINT_DIR
from chatrl.distributed import dist
from chatrl.evidence.rollout_records import compare_figures, compare_rank, read_step, resolve_output
from chatrl.evidence.weight_version import WeightVersionError
from chatrl.rl.stats import PooledStats
from chatrl.step3_ppo.main import build, build_parser, learn_from, restore
from chatrl.step3_ppo.trainer import Experience


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


def replay(output: str | os.PathLike, step: int, atol: float = 0.0) -> dict:
    """Replay step ``step`` of the run in ``output`` on this rank (every rank of the recorded world
    calls it); returns ``{"ok", "first", "differences", "metrics"}`` (the same on every rank)."""
    folder = resolve_output(output)
    index, ranks = read_step(folder, step)
    world = int(index["world_size"])
    if int(os.environ.get("WORLD_SIZE", "1")) != world:
        raise SystemExit(f"chatrl.tools.replay: the record was made by {world} ranks; this replay runs on "
                         f"{os.environ.get('WORLD_SIZE', '1')} (run `python -m chatrl.tools.replay` without a launcher)")
    run = build(cli.parse(build_parser(), replay_argv(index, folder, step)))
    done, _, _ = restore(run)
    if done != step - 1:
        raise SystemExit(f"chatrl.tools.replay: the checkpoint holds step {done}, not step {step - 1}")
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


def main(argv: list[str] | None = None) -> None:
    """The rank program of ``python -m chatrl.tools.replay OUTPUT --step N [--atol X]`` (which starts it, under
    ``torch.distributed.run`` for a record of several ranks): exit 0 when the replay matches, 1 when not."""
    p = argparse.ArgumentParser(prog="python -m chatrl.step3_ppo.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", help="step 3's --output_dir (or train.py's --output-dir), run with --save_rollouts")
    p.add_argument("--step", type=int, required=True, help="the recorded step to replay")
    p.add_argument("--atol", type=float, default=0.0, help="largest difference counted as equal (default 0: bit for bit)")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)

    def program():
        result = replay(a.output, a.step, a.atol)
        if dist.is_main():
            if result["ok"]:
                fig = result["figures"] or {}
                print(f"chatrl.tools.replay: step {a.step} replayed exactly: actor_loss {fig.get('actor_loss')!r}, "
                      f"critic_loss {fig.get('critic_loss')!r}, actor gradient norms {fig.get('actor_grad_norm')}, "
                      f"critic gradient norms {fig.get('critic_grad_norm')}", flush=True)
            else:
                print(f"chatrl.tools.replay: step {a.step} differs; first differing quantity: {result['first']}", flush=True)
                for line in result["differences"][1:8]:
                    print(f"  then: {line}", flush=True)
        if not result["ok"]:
            dist.shutdown()
            dist.exit_now(1)
        return result

    dist.run_program(program)


if __name__ == "__main__":
    main()
