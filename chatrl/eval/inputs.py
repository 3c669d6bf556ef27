"""What an evaluation reads: the held-out prompts (:func:`load_prompts`) and the models to compare
(:func:`expand_models`: plain HF folders, DPO outputs and step-3 outputs with their snapshots)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from chatrl.checkpoint import RUN_MARKER
from chatrl.data.sources import read_source
from chatrl.data.split import parse_data_split, phase_rows
from chatrl.distributed.weights import list_snapshots
from chatrl.errors import UsageError
from chatrl.models.causal_lm import load_tokenizer


@dataclass(frozen=True)
class EvalPrompt:
    """One prompt: its conversation (ending with a user turn), the entry and raw row it comes from, and
    the row's metadata (a prompt row's ``reference`` and the like: what a function judge reads)."""

    messages: tuple[dict, ...]
    source: str
    row: int
    metadata: dict | None = field(default=None, compare=False, hash=False)


def load_prompts(entries: list[str], schema: str | None = None, split: str | None = None, split_seed: int = 1234,
                 eval_fraction: float = 0.05, max_prompts: int = 0) -> list[EvalPrompt]:
    """The prompts of ``entries`` (``--prompts``): every row's prompt conversation, or with ``split``
    only step 3's held-out rows, the rows :func:`chatrl.data.split.phase_rows` gives phase 3's
    evaluation for that ``--data_split``, ``--seed`` and ``--eval_fraction`` (the prompts step 3
    never trained on). Repeated conversations are kept once; ``max_prompts > 0`` keeps the first N.

    Raises:
        UsageError: an entry that does not exist or cannot be read, an unknown schema (naming the
            file and the keys it holds), a bad ``split``, or no prompt at all.
    """
    out: list[EvalPrompt] = []
    seen: set[str] = set()
    try:
        weights = parse_data_split(split) if split else None
    except ValueError as e:
        raise UsageError(f"--prompts_split: {e}") from None
    for entry in entries:
        try:
            src = read_source(entry, schema)
        except UsageError as e:
            raise UsageError(f"--prompts {entry}: {e}") from None
        except (FileNotFoundError, ValueError) as e:
            raise UsageError(f"--prompts {entry}: {e}") from None
        if weights is None:
            rows = range(src.n_rows)
        else:
            rows = phase_rows(src.n_rows, src.kind, 3, weights, split_seed, eval_fraction)[1].tolist()
        first_sample = {}
        for i, r in enumerate(src.sample_rows):
            first_sample.setdefault(r, i)
        for r in rows:
            i = first_sample.get(int(r))
            if i is None:  # a skipped row (no usable prompt)
                continue
            messages = tuple(dict(m) for m in src.samples[i].messages)
            key = json.dumps(messages, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(EvalPrompt(messages, entry, int(r), dict(src.samples[i].metadata or {})))
    if not out:
        how = (f"phase 3's held-out rows of --prompts_split {split} (SFT-only data feeds no phase-3 row)"
               if split else "their rows")
        raise UsageError(f"--prompts {' '.join(entries)}: no usable prompt in {how}")
    return out[:max_prompts] if max_prompts > 0 else out


@dataclass(frozen=True)
class Candidate:
    """A model to evaluate.

    Attributes:
        label: its name in the table and files. path: its HF folder (or hub name).
        run: the training output it belongs to (its checkpoint series), or None for a lone model.
        step: its optimizer step within ``run`` (a snapshot's N, the final model's last step), or None.
        in_series: whether it is a point of the run's checkpoint series (the EMA actor is not).
    """

    label: str
    path: str
    run: str | None = None
    step: int | None = None
    in_series: bool = True


def _final_step(folder: Path) -> int | None:
    try:
        marker = json.loads((folder / RUN_MARKER).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return marker.get("steps") if isinstance(marker.get("steps"), int) else None


def _expand_one(entry: str) -> list[Candidate]:
    label, sep, path_text = entry.partition("=")
    if not sep or not label or os.path.exists(entry):
        label, path_text = "", entry
    path = Path(path_text)
    if not path.exists():  # a hub name: loaded (or refused) with the others
        return [Candidate(label or path_text, path_text)]
    if not path.is_dir():
        raise UsageError(f"--models {entry}: not a folder (give an HF model folder or a step-3 output folder)")
    name = label or path.resolve().name
    last = _final_step(path)
    if (path / "actor" / "config.json").is_file():  # a step-3 output: snapshots, the actor, the EMA actor
        found = [Candidate(f"{name}@{step}", str(d), str(path), step) for step, d in list_snapshots(path)]
        found.append(Candidate(name, str(path / "actor"), str(path), last))
        if (path / "actor_ema" / "config.json").is_file():
            found.append(Candidate(f"{name} (EMA)", str(path / "actor_ema"), str(path), last, in_series=False))
        return found
    if not (path / "config.json").is_file():
        raise UsageError(f"--models {entry}: no config.json there; give an HF causal-LM folder (a step's output) or "
                         "a step-3 output folder (with actor/)")
    snaps = list_snapshots(path)
    if snaps:  # a DPO output: its snapshots, then the model
        return [*(Candidate(f"{name}@{step}", str(d), str(path), step) for step, d in snaps),
                Candidate(name, str(path), str(path), last)]
    if not label and name in ("actor", "actor_ema"):
        name = f"{path.resolve().parent.name}/{name}"
    return [Candidate(name, str(path))]


def expand_models(entries: list[str]) -> list[Candidate]:
    """The models named by ``--models``, expanded and labelled (repeated labels get ``#2``, ``#3``).

    Raises:
        UsageError: an entry that is a file, or a folder that is neither a model nor a step output.
    """
    out: list[Candidate] = []
    counts: dict[str, int] = {}
    for entry in entries:
        for c in _expand_one(entry):
            counts[c.label] = counts.get(c.label, 0) + 1
            if counts[c.label] > 1:
                c = Candidate(f"{c.label}#{counts[c.label]}", c.path, c.run, c.step, c.in_series)
            out.append(c)
    return out


def load_model_tokenizer(path: str, flag: str, trust_remote_code: bool = False):
    """The tokenizer of the model at ``path`` (prepared with a pad token, left padding for generation).

    Raises:
        UsageError: no tokenizer can be loaded from ``path`` (names the flag and the folder).
    """
    try:
        return load_tokenizer(path, padding_side="left", trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        has_files = Path(path).is_dir() and any((Path(path) / f).exists() for f in
                                                 ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        why = "" if has_files else ("The folder holds no tokenizer (tokenizer.json / tokenizer_config.json); chatrl's "
                                    "steps save one beside the weights: copy the base model's tokenizer files into it. ")
        detail = (str(e).strip().splitlines() or [""])[0][:240]
        raise UsageError(f"{flag} {path}: cannot load its tokenizer. {why}({type(e).__name__}: {detail})") from None

