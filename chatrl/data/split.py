"""Splitting each source's rows between the three phases, and holding out evaluation rows.

As DeepSpeed-Chat's ``--data_split 2,4,4``: per source, a fixed permutation of the raw row
indices (a numpy Generator seeded by ``seed``, never Python's ``hash``) is cut by the normalised
weights into three disjoint parts for phases 1 (SFT), 2 (reward model) and 3 (PPO), so that no
phase trains on another's rows. SFT-only sources go wholly to phase 1, prompt-only sources wholly
to phase 3. Each part then holds out ``eval_fraction`` of its rows for evaluation.
"""

from __future__ import annotations

import numpy as np

from chatrl.data.schema import KIND_PAIRS, KIND_PROMPTS, KIND_SFT

PHASES = (1, 2, 3)


def parse_data_split(text: str) -> tuple[float, float, float]:
    """Parse ``--data_split`` (``"2,4,4"``) into three normalised weights summing to 1.

    Raises:
        ValueError (naming ``--data_split``): not three comma-separated numbers, a negative or
            non-finite weight, or all weights zero.
    """
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 3:
        raise ValueError(f"--data_split needs three comma-separated weights (phase 1,2,3), got {text!r}")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--data_split weights must be numbers, got {text!r}") from None
    if any(not np.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"--data_split weights must be finite and >= 0, got {text!r}")
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"--data_split weights must not all be zero, got {text!r}")
    return tuple(w / total for w in weights)  # type: ignore[return-value]


def phase_parts(n_rows: int, weights: tuple[float, float, float], seed: int) -> list[np.ndarray]:
    """Three disjoint arrays of row indices covering ``range(n_rows)``, one per phase.

    The permutation is ``np.random.default_rng(seed).permutation(n_rows)``; phase ``k`` gets the
    slice between the rounded cumulative weights ``round(n · Σ_{j<k} w_j)`` and
    ``round(n · Σ_{j≤k} w_j)``.
    """
    perm = np.random.default_rng(seed).permutation(n_rows)
    bounds = np.round(np.cumsum((0.0, *weights)) * n_rows).astype(int)
    bounds[-1] = n_rows
    bounds = np.clip(bounds, 0, n_rows)
    return [perm[bounds[k]:bounds[k + 1]] for k in range(3)]


def n_eval_rows(n: int, eval_fraction: float) -> int:
    """Rows held out of a part of ``n`` rows: ``round(n · eval_fraction)``, at least 1 when
    ``n ≥ 2`` and ``eval_fraction > 0``, and never all of them."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if eval_fraction == 0 or n < 2:
        return 0
    return min(max(1, round(n * eval_fraction)), n - 1)


def phase_rows(n_rows: int, kind: str, phase: int, weights: tuple[float, float, float], seed: int,
               eval_fraction: float = 0.05, hold_out: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(train, eval)`` raw row indices of one source for ``phase``.

    Args:
        n_rows: raw rows of the source.
        kind: ``"pairs"`` (split by ``weights``), ``"sft"`` (all to phase 1) or ``"prompts"``
            (all to phase 3).
        phase: 1, 2 or 3.
        weights: normalised weights from :func:`parse_data_split`.
        seed: permutation seed.
        eval_fraction: share of the part held out (see :func:`n_eval_rows`).
        hold_out: ``False`` when evaluation data comes from elsewhere: ``eval`` is then empty.

    Raises:
        ValueError: a phase outside 1–3 or an unknown kind.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be 1, 2 or 3, got {phase}")
    empty = np.zeros(0, dtype=np.int64)
    if kind == KIND_PAIRS:
        part = phase_parts(n_rows, weights, seed)[phase - 1]
    elif kind in (KIND_SFT, KIND_PROMPTS):
        if phase != (1 if kind == KIND_SFT else 3):
            return empty, empty
        part = np.random.default_rng(seed).permutation(n_rows)
    else:
        raise ValueError(f"unknown source kind {kind!r}")
    n_eval = n_eval_rows(len(part), eval_fraction) if hold_out else 0
    return part[n_eval:].astype(np.int64), part[:n_eval].astype(np.int64)
