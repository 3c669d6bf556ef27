"""Step 3's rollout records: what a training step learned from, token by token (``--save_rollouts N``).

Every N-th step writes ``OUTPUT_DIR/rollouts/step_NNNNNN/``:

* ``rankR.safetensors`` (one per rank, that rank's experience buffer): ``sequences`` ``(B, P + A)``
  int64, ``attention_mask`` and ``action_mask`` (int8), and ``(B, A)`` float32 per token:
  ``sampler_logp`` (the sampler's log-prob of each sampled token), ``logp`` (the trainer's at
  experience time), ``ref_logp``, ``entropy``, ``kl`` (per-token KL estimate), ``advantages``, and
  when the algorithm has them ``values``, ``returns``, ``rewards`` (per-token), ``is_weights``;
  ``(E, B, A)`` per PPO epoch: ``ratio`` and ``clip`` (int8: -1 lower clip, +1 upper clip);
  ``(B,)``: ``scores``, ``reward/<source>`` (each reward part, unweighted), ``weight_version``
  (int64) and ``weight_checksum`` (float64, :mod:`chatrl.evidence.weight_version`);
* ``rankR.json``: ``prompt_len`` and each rollout's metadata;
* ``index.json`` (rank 0): the step, the ranks, the run's flags (``args``), the tokenizer's folder,
  and the step's figures: ``actor_loss``, ``critic_loss`` (the logged means), the gradient norm of
  every actor and critic optimizer step (DeepSpeed's), the KL coefficient used, and the step's
  logged metrics.

:func:`write_step` writes (every rank its own file; ``index.json`` last, so a folder with it is
complete), :func:`read_step` reads back; ``python -m chatrl.tools.inspector`` draws them and
``python -m chatrl.tools.replay`` trains on them again, comparing what it computes with what was recorded
(:func:`compare_rank`, :func:`compare_figures`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

ROLLOUTS_DIR = "rollouts"
INDEX_FILE = "index.json"

#: Per-token (or per-rollout) fields of an Experience kept in a record, in the inspector's order.
TENSOR_FIELDS = ("sequences", "attention_mask", "action_mask", "sampler_logp", "logp", "ref_logp", "entropy",
                 "values", "kl", "rewards", "advantages", "returns", "is_weights", "scores", "weight_version",
                 "weight_checksum", "turn_rewards", "turns")
_INT8 = ("attention_mask", "action_mask")
_KEEP_DTYPE = ("sequences", "weight_version", "weight_checksum", "turns")


def resolve_output(output: str | os.PathLike) -> Path:
    """Step 3's folder: ``output`` itself, or ``output/step3_rlhf`` (a ``train.py`` output folder)."""
    p = Path(output)
    if not (p / ROLLOUTS_DIR).is_dir() and (p / "step3_rlhf" / ROLLOUTS_DIR).is_dir():
        return p / "step3_rlhf"
    return p


def step_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """``OUTPUT_DIR/rollouts/step_NNNNNN``."""
    return Path(output_dir) / ROLLOUTS_DIR / f"step_{step:06d}"


def recorded_steps(output_dir: str | os.PathLike) -> list[int]:
    """The steps with a complete record (an ``index.json``), in order."""
    root = Path(output_dir) / ROLLOUTS_DIR
    if not root.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit() and (p / INDEX_FILE).is_file())


def experience_tensors(exp, trace: dict | None = None) -> dict[str, torch.Tensor]:
    """The record's tensors of one rank's buffer ``exp`` (a :class:`chatrl.step3_ppo.trainer.Experience`)
    and the trainer's ``trace`` of learning on it (``ratio``, ``clip`` per epoch)."""
    out = {}
    for name in TENSOR_FIELDS:
        t = getattr(exp, name, None)
        if t is None:
            continue
        t = t.detach().cpu()
        out[name] = t.to(torch.int8) if name in _INT8 else t if name in _KEEP_DTYPE else t.float()
    for name, t in exp.reward_parts.items():
        out[name] = t.detach().cpu().float()
    for name in ("ratio", "clip"):
        if trace and trace.get(name):
            out[name] = torch.stack(trace[name]).cpu()
    return {k: v.contiguous() for k, v in out.items()}


def write_step(output_dir: str | os.PathLike, step: int, rank: int, world_size: int, exp, trace: dict | None,
               index: dict | None, barrier=None) -> Path:
    """Write this rank's record of ``step``; rank 0 (``index`` given) writes ``index.json`` after
    ``barrier()`` (every rank calls it when given: all files are in place first). Returns the folder."""
    from safetensors.torch import save_file

    folder = step_dir(output_dir, step)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(experience_tensors(exp, trace), str(folder / f"rank{rank}.safetensors"))
    (folder / f"rank{rank}.json").write_text(json.dumps({"prompt_len": int(exp.prompt_len),
                                                         "metadata": exp.metadata}, default=str))
    if barrier is not None:
        barrier()
    if rank == 0 and index is not None:
        tmp = folder / (INDEX_FILE + ".tmp")
        tmp.write_text(json.dumps({"step": step, "world_size": world_size, **index}, indent=1, default=str))
        os.replace(tmp, folder / INDEX_FILE)
    return folder


def read_step(output_dir: str | os.PathLike, step: int) -> tuple[dict, list[dict]]:
    """``(index, ranks)``: the step's ``index.json`` and, per rank, ``{"tensors": {...}, "prompt_len",
    "metadata"}``.

    Raises:
        FileNotFoundError: no complete record of ``step`` (naming the steps that have one).
    """
    from safetensors.torch import load_file

    folder = step_dir(output_dir, step)
    if not (folder / INDEX_FILE).is_file():
        have = recorded_steps(output_dir)
        raise FileNotFoundError(f"{output_dir}: no rollout record of step {step} (recorded steps: "
                                f"{', '.join(map(str, have)) or 'none; run step 3 with --save_rollouts N'})")
    index = json.loads((folder / INDEX_FILE).read_text())
    ranks = []
    for r in range(int(index["world_size"])):
        side = json.loads((folder / f"rank{r}.json").read_text())
        ranks.append({"tensors": load_file(str(folder / f"rank{r}.safetensors")), **side})
    return index, ranks


#: The quantities a replay compares per token, in the order they are computed (the first differing one
#: is named).
PER_TOKEN = ("ref_logp", "logp", "entropy", "values", "kl", "rewards", "advantages", "returns", "is_weights")


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


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


def compare_rank(rank_record: dict, exp, trace: dict, atol: float) -> list[tuple[int, str]]:
    """This rank's differences between its record and the replayed experience ``exp`` (step 3's
    ``Experience``: the attributes of :data:`PER_TOKEN`) and training trace (``ratio``, ``clip``), as
    ``(order, message)`` (order: computation order of the quantity)."""
    out, t = [], rank_record["tensors"]
    names = [*PER_TOKEN, "ratio", "clip"]
    for order, name in enumerate(names):
        if name not in t:
            continue
        replayed = getattr(exp, name, None) if name in PER_TOKEN else (
            torch.stack(trace[name]) if trace.get(name) else None)
        d = _first_difference(name, t[name], replayed, atol)
        if d:
            out.append((order + 1, f"{name} on rank {_rank()} {d[0]}: recorded {d[1]!r}, replayed {d[2]!r}"))
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
        same = b is not None and (abs(a - b) <= atol or (math.isnan(a) and math.isnan(b)))
        if a is not None and not same:
            out.append((base + 2 + order, f"{key}: recorded {a!r}, replayed {b!r}"))
    return out
