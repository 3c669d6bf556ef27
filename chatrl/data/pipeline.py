"""``build_phase_data``: the entry point the three steps call for their tokenized data.

Sources are read and adapted (:mod:`chatrl.data.sources`), split between phases and evaluation
(:mod:`chatrl.data.split`), formatted and tokenized (:mod:`chatrl.data.formatting`,
:mod:`chatrl.data.examples`), cached on disk (:mod:`chatrl.data.cache`) and returned as torch
datasets, with a :class:`SkipReport` of what was used and what was skipped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chatrl.checkpoint import Cycle
from chatrl.config import DataConfig, RolloutConfig
from chatrl.data.cache import Columns, cache_key, load_or_build, to_hf_dataset, tokenizer_fingerprint
from chatrl.data.collate import PromptCollator, SFTCollator
from chatrl.data.examples import PHASE_COLUMNS, tokenize_samples
from chatrl.data.formatting import FORMAT_VERSION
from chatrl.data.report import SkipReport
from chatrl.data.schema import KIND_PAIRS, KIND_PROMPTS, KIND_SFT
from chatrl.data.sources import Source, fingerprint_entry, read_source
from chatrl.data.split import parse_data_split, phase_rows
from chatrl.distributed import dist

log = logging.getLogger(__name__)

# Which source kinds an explicit evaluation entry may feed to each phase.
_EVAL_KINDS = {1: (KIND_PAIRS, KIND_SFT), 2: (KIND_PAIRS,), 3: (KIND_PAIRS, KIND_SFT, KIND_PROMPTS)}


class TokenizedDataset(torch.utils.data.Dataset):
    """A ``torch`` view of a ``datasets.Dataset`` of token examples.

    Items are dicts: id columns (and phase 1's ``trained_spans``) as ``LongTensor (T,)``,
    ``prompt_len`` as ``int``, phase 3's
    ``metadata`` as a ``dict`` and ``messages`` (its prompt turns) as a list (the reward metadata of the prompt's row, ``{}`` if none).
    ``hf`` is the underlying ``datasets.Dataset``.
    """

    def __init__(self, hf):
        self.hf = hf

    def __len__(self) -> int:
        return len(self.hf)

    def __getitem__(self, i: int) -> dict:
        row = self.hf[int(i)]
        return {k: int(v) if k == "prompt_len" else json.loads(v) if k in ("metadata", "messages")
                else torch.tensor(v, dtype=torch.long) for k, v in row.items()}


@dataclass(frozen=True)
class PhaseData:
    """What :func:`build_phase_data` returns: ``train`` and ``eval`` datasets and the ``report``."""

    train: TokenizedDataset
    eval: TokenizedDataset
    report: SkipReport

    @property
    def evaluates(self) -> bool:
        """Whether the eval split holds a row: a step evaluates only then (an empty split was said once
        at build time, "training proceeds without evaluation"; nothing is evaluated on 0 rows, no NaN)."""
        return len(self.eval) > 0


def _add_rows(src: Source, rows, label: str, phase: int, tokenizer, max_seq_len: int, max_prompt_len: int,
              columns: Columns, report: SkipReport, all_turns: str = "auto") -> None:
    """Tokenize the samples of ``src`` from raw ``rows`` into ``columns``, counting into ``report``."""
    by_row: dict[int, list[int]] = {}
    for i, r in enumerate(src.sample_rows):
        by_row.setdefault(r, []).append(i)
    report.add_rows(label, len(rows))
    picked = []
    for r in rows:
        r = int(r)
        if r in src.row_skips:
            report.skip(label, src.row_skips[r])
        picked.extend(by_row.get(r, []))
    results = tokenize_samples(phase, [src.samples[i] for i in picked], tokenizer, max_seq_len, max_prompt_len,
                               all_turns)
    for ex, truncated in results:
        if isinstance(ex, str):
            report.skip(label, ex)
            continue
        report.use(label)
        if truncated:
            report.truncate(label)
        for k in PHASE_COLUMNS[phase]:
            columns[k].append(ex[k])


def _build(phase: int, data_paths: Sequence[str], tokenizer, weights, max_seq_len: int, max_prompt_len: int,
           eval_fraction: float, eval_data_paths: Sequence[str] | None, seed: int, all_turns: str = "auto"):
    train: Columns = {k: [] for k in PHASE_COLUMNS[phase]}
    evals: Columns = {k: [] for k in PHASE_COLUMNS[phase]}
    report = SkipReport()
    hold_out = eval_data_paths is None
    for entry in data_paths:
        src = read_source(entry)
        tr, ev = phase_rows(src.n_rows, src.kind, phase, weights, seed, eval_fraction, hold_out)
        if len(tr) + len(ev) == 0:
            continue
        _add_rows(src, tr, entry, phase, tokenizer, max_seq_len, max_prompt_len, train, report, all_turns)
        _add_rows(src, ev, entry, phase, tokenizer, max_seq_len, max_prompt_len, evals, report, all_turns)
        if report.counts(entry).used == 0:
            raise ValueError(f"{entry!r}: no usable rows for phase {phase} ({report.describe(entry)})")
    for entry in eval_data_paths or []:
        src = read_source(entry)
        if src.kind not in _EVAL_KINDS[phase]:
            raise ValueError(f"evaluation entry {entry!r} holds {src.kind} data, which phase {phase} cannot use")
        label = f"eval:{entry}"
        _add_rows(src, range(src.n_rows), label, phase, tokenizer, max_seq_len, max_prompt_len, evals, report,
                  all_turns)
        if report.counts(label).used == 0:
            raise ValueError(f"evaluation entry {entry!r}: no usable rows ({report.describe(label)})")
    if not train[PHASE_COLUMNS[phase][0]]:
        raise ValueError(f"phase {phase} gets no training rows from {list(data_paths)} with these "
                         f"--data_split weights {weights}: SFT-only data feeds phase 1, prompt-only data phase 3")
    return train, evals, report


def phase_cache_key(phase: int, data_paths: Sequence[str], tokenizer, *, data_split: str = "2,4,4",
                    max_seq_len: int = 512, max_prompt_len: int = 256, eval_fraction: float = 0.05,
                    eval_data_paths: Sequence[str] | None = None, seed: int = 1234,
                    all_turns: str = "auto") -> str:
    """The cache key of :func:`build_phase_data` with these arguments (sha256 hex, 64 chars).

    Raises:
        FileNotFoundError / ValueError: an entry cannot be read, or ``data_split`` is invalid.
    """
    spec = {
        "format_version": FORMAT_VERSION,
        "phase": phase,
        "data": [fingerprint_entry(e) for e in data_paths],
        "eval_data": None if eval_data_paths is None else [fingerprint_entry(e) for e in eval_data_paths],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_seq_len": max_seq_len,
        "max_prompt_len": max_prompt_len,
        "data_split": list(parse_data_split(data_split)),
        "eval_fraction": eval_fraction,
        "seed": seed,
        **({"all_turns": all_turns} if phase == 1 else {}),
    }
    return cache_key(spec)


def build_phase_data(phase: int, data: DataConfig, tokenizer, *, seed: int = 1234, max_prompt_len: int = 256,
                     all_turns: str = "auto") -> PhaseData:
    """Tokenized train and eval data of one phase, blended from several ``--data_path`` entries.

    Items of ``train``/``eval`` (see :class:`TokenizedDataset`):

    - phase 1: ``{"input_ids": (T,), "prompt_len": int, "trained_spans": (2S,)}``, prompt + answer +
      EOS (or a conversation's turns), ``T ≤ max_seq_len``, the trained token ranges;
    - phase 2: ``{"chosen_input_ids": (Tc,), "rejected_input_ids": (Tr,), "prompt_len": int}``;
    - phase 3: ``{"prompt_ids": (P,), "metadata": dict, "messages": list}``, ``P ≤ max_prompt_len``.

    Args:
        phase: 1 (SFT), 2 (reward model) or 3 (PPO).
        data: the program's :class:`chatrl.config.DataConfig`: ``data_path``, the entries (see
            :mod:`chatrl.data.sources`; all are blended, train rows in entry order, shuffling is the
            sampler's job); ``data_split``, the phase weights for pair sources; ``max_seq_len``, the
            longest prompt + answer (phases 1–2; prompts are cut from the left to fit);
            ``eval_fraction``, the share of each source's phase part held out for evaluation;
            ``eval_data_path``, explicit evaluation entries (then no rows are held out of training);
            ``data_output_path``, the token cache folder (``None`` disables it; every rank must see
            it, a shared file system on multi-node runs: rank 0 writes it, the others read it).
        tokenizer: a tokenizer prepared by :func:`chatrl.models.causal_lm.prepare_tokenizer`.
        seed: seed of the phase split.
        max_prompt_len: longest prompt in phase 3 (cut from the left, counted as ``truncated``).
        all_turns: phase 1's ``--train_all_assistant_turns`` (:func:`chatrl.data.examples.tokenize_samples`).

    Raises:
        FileNotFoundError: a missing path. ValueError: a bad ``data_split``, phase or length,
            an empty file, an unknown schema, a source with no usable rows, or no training rows.
    """
    data_paths, data_split, max_seq_len = data.data_path, data.data_split, data.max_seq_len
    eval_fraction, eval_data_paths, cache_dir = data.eval_fraction, data.eval_data_path, data.data_output_path
    if phase not in PHASE_COLUMNS:
        raise ValueError(f"phase must be 1, 2 or 3, got {phase}")
    if not data_paths:
        raise ValueError("--data_path needs at least one entry")
    if max_seq_len < 2 or max_prompt_len < 1:
        raise ValueError(f"max_seq_len must be >= 2 and max_prompt_len >= 1, got {max_seq_len}, {max_prompt_len}")
    weights = parse_data_split(data_split)

    def build():
        return _build(phase, data_paths, tokenizer, weights, max_seq_len, max_prompt_len, eval_fraction,
                      eval_data_paths, seed, all_turns)

    if cache_dir is None:
        train_cols, eval_cols, report = build()
        train, evals = to_hf_dataset(phase, train_cols), to_hf_dataset(phase, eval_cols)
    else:
        key = phase_cache_key(phase, data_paths, tokenizer, data_split=data_split, max_seq_len=max_seq_len,
                              max_prompt_len=max_prompt_len, eval_fraction=eval_fraction,
                              eval_data_paths=eval_data_paths, seed=seed, all_turns=all_turns)
        train, evals, report = load_or_build(phase, key, cache_dir, build)
    if dist.is_main():
        log.info("phase %d data: %d train, %d eval. %s", phase, len(train), len(evals), report.summary())
        if len(evals) == 0 and phase != 3:
            log.warning("phase %d: the eval split is empty (no held-out or --eval_data_path row is usable); "
                        "training proceeds without evaluation", phase)
    return PhaseData(TokenizedDataset(train), TokenizedDataset(evals), report)


def prompt_batches(data: DataConfig, rollout: RolloutConfig, tokenizer, info: dist.DistInfo,
                   seed: int) -> tuple[PhaseData, torch.utils.data.DataLoader]:
    """Step 3's prompts (phase 3 of ``--data_path``, each cut from the left to ``--max_prompt_seq_len``)
    and this rank's seeded loader of them, ``--per_device_generation_batch_size`` prompts per batch
    with their metadata and messages (:class:`chatrl.data.collate.PromptCollator`), the last partial
    batch dropped. Returns ``(the phase data, the loader)``."""
    prompts = build_phase_data(3, data, tokenizer, seed=seed, max_prompt_len=rollout.max_prompt_seq_len)
    loader = dist.seeded_loader(prompts.train, rollout.per_device_generation_batch_size,
                                PromptCollator(tokenizer.pad_token_id, with_metadata=True), info, seed, drop_last=True)
    return prompts, loader


def ptx_batches(data: DataConfig, tokenizer, info: dist.DistInfo, seed: int, batch_size: int,
                max_seq_len: int) -> Cycle | None:
    """Step 3's PTX text (``--unsupervised_dataset_name``, step-1 style data, all of it trained, cut
    to ``max_seq_len`` tokens) as endless batches of ``batch_size`` on this rank's device, or None
    without it."""
    if not data.unsupervised_dataset_name:
        return None
    unsup = build_phase_data(1, data.ptx_text(max_seq_len), tokenizer, seed=seed)
    loader = dist.seeded_loader(unsup.train, batch_size, SFTCollator(tokenizer.pad_token_id, mask_prompt=False), info,
                                seed, drop_last=True, shuffle=True)
    return Cycle(loader, info.device)
