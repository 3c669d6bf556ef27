"""Held-out exact-match accuracy of a causal LM on prompt rows with a reference answer
(``scripts/make_arith_task.py``'s or ``scripts/make_tool_task.py``'s ``eval.jsonl``): greedy answers,
scored by the built-in ``exact_match`` reward. With ``--env`` (``calculator``), greedy multi-turn
episodes of that environment (the model may call its tool), scored by the environment's final
reward. Prints one JSON line ``{"accuracy", "n", "model", "env"}``; with ``--baseline`` (another
model on the same rows) also the baseline's accuracy and the paired gain in points with its 95 %
bootstrap interval (rows resampled, :func:`paired_gain`).

Usage::

    python scripts/eval_exact_match.py --model OUTPUT/step3_rlhf/actor --data data/arith/eval.jsonl
    python scripts/eval_exact_match.py --model OUTPUT/step3_rlhf/actor --baseline OUTPUT/step1_actor --data data/arith/eval.jsonl
    python scripts/eval_exact_match.py --model OUTPUT/step3_rlhf/actor --data data/calc/eval.jsonl --env calculator
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def evaluate(model_dir: str, rows: list[dict], max_new_tokens: int = 6, batch_size: int = 64,
             dtype: str | None = None) -> float:
    """Share of ``rows`` whose greedy answer's final number equals ``row["reference"]``; the model in
    ``dtype`` (``fp32``, ``bf16``; default: the dtype it was saved in)."""
    scores = row_scores(model_dir, rows, max_new_tokens, batch_size, dtype)
    return sum(scores) / max(len(rows), 1)


def paired_gain(after: list[float], before: list[float], n_boot: int = 2000, seed: int = 0,
                level: float = 0.95) -> tuple[float, float, float]:
    """The mean of ``after − before`` over the same rows (each 0 or 1: a gain in points / 100) and its
    percentile bootstrap interval over rows resampled with replacement (Efron & Tibshirani 1993, ch. 13):
    ``(gain, low, high)``.

    Raises:
        ValueError: the two lists differ in length or are empty."""
    import numpy as np

    if len(after) != len(before) or not after:
        raise ValueError(f"paired_gain: {len(after)} and {len(before)} scores: the same rows, at least one")
    d = np.asarray(after, dtype=float) - np.asarray(before, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(d), size=(n_boot, len(d)))
    boots = d[idx].mean(axis=1)
    tail = (1 - level) / 2 * 100
    return float(d.mean()), float(np.percentile(boots, tail)), float(np.percentile(boots, 100 - tail))


def row_scores(model_dir: str, rows: list[dict], max_new_tokens: int = 6, batch_size: int = 64,
               dtype: str | None = None) -> list[float]:
    """Each row's exact-match score (1.0 or 0.0) of ``model_dir``'s greedy answer (see :func:`evaluate`)."""
    from transformers import AutoModelForCausalLM

    from chatrl.data.formatting import encode_prompt
    from chatrl.models.causal_lm import fit_embeddings, load_tokenizer, stop_token_ids, torch_dtype
    from chatrl.rewards.builtin import exact_match

    tok = load_tokenizer(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype) if dtype else "auto").eval()
    fit_embeddings(model, tok)  # the pad id load_tokenizer adds where pad == EOS lies past the vocabulary
    scores: list[float] = []
    for i in range(0, len(rows), batch_size):
        part = rows[i:i + batch_size]
        ids = [encode_prompt(tok, [{"role": "user", "content": r["prompt"]}]) for r in part]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=stop_token_ids(tok, model), pad_token_id=tok.pad_token_id)
        answers = tok.batch_decode(out[:, width:], skip_special_tokens=True)
        scores += exact_match([r["prompt"] for r in part], answers, [{"reference": r["reference"]} for r in part])
    return scores


def evaluate_episodes(model_dir: str, rows: list[dict], env: str = "calculator", max_turns: int = 3,
                      max_new_tokens: int = 16, batch_size: int = 64) -> float:
    """Share of ``rows`` whose greedy episode with ``env`` the environment rewards (its summed
    reward, 1 for a right final answer with the calculator); the episodes are played as step 3
    plays them (:func:`chatrl.envs.rollout.run_episodes`, token-in/token-out), one process."""
    from transformers import AutoModelForCausalLM

    from chatrl.envs import load_environment
    from chatrl.envs.rollout import Episodes, run_episodes
    from chatrl.models.causal_lm import fit_embeddings, load_tokenizer, stop_token_ids
    from chatrl.sizes import plan_episodes

    tok = load_tokenizer(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    fit_embeddings(model, tok)
    stops = stop_token_ids(tok)

    def generate(ids, mask):
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=stops, pad_token_id=tok.pad_token_id)
        fill = out.new_full((out.shape[0], ids.shape[1] + max_new_tokens - out.shape[1]), tok.pad_token_id)
        return torch.cat([out, fill], dim=1), torch.zeros(out.shape[0], max_new_tokens)

    episodes = Episodes(load_environment(env), plan_episodes(256, max_new_tokens, max_turns, None))
    total = 0.0
    for i in range(0, len(rows), batch_size):
        part = [{"messages": [{"role": "user", "content": r["prompt"]}], "metadata": {"reference": r["reference"]},
                 "seed": i + j} for j, r in enumerate(rows[i:i + batch_size])]
        ep = run_episodes(generate, tok, episodes, part, stop_ids=stops, device="cpu")
        total += float((ep.final_rewards + ep.turn_rewards.sum(dim=1)).sum())
    return total / max(len(rows), 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder of the model (e.g. step 3's actor/)")
    p.add_argument("--data", required=True, help="JSONL prompt rows with 'prompt' and 'reference'")
    p.add_argument("--max_new_tokens", type=int, default=6, help="answer tokens (per turn with --env)")
    p.add_argument("--env", default=None, help="play greedy episodes of this environment (calculator) instead")
    p.add_argument("--max_turns", type=int, default=3, help="assistant turns per episode with --env")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="the model's dtype (default: as saved)")
    p.add_argument("--baseline", default=None, help="another model on the same rows: the paired gain and its interval")
    a = p.parse_args(argv)
    rows = [json.loads(x) for x in Path(a.data).read_text().splitlines() if x.strip()]
    bad = [i for i, r in enumerate(rows) if "prompt" not in r or "reference" not in r]
    if bad:
        sys.exit(f"{a.data}: rows {bad[:5]} lack 'prompt' or 'reference'")
    if a.baseline and a.env:
        sys.exit("eval_exact_match.py: --baseline compares greedy single answers; it does not take --env")
    if a.env:
        acc = evaluate_episodes(a.model, rows, a.env, a.max_turns, a.max_new_tokens)
        print(json.dumps({"accuracy": acc, "n": len(rows), "model": a.model, "env": a.env}))
        return
    after = row_scores(a.model, rows, a.max_new_tokens, dtype=a.dtype)
    out = {"accuracy": sum(after) / len(rows), "n": len(rows), "model": a.model, "env": None,
           "max_new_tokens": a.max_new_tokens}
    if a.baseline:
        before = row_scores(a.baseline, rows, a.max_new_tokens, dtype=a.dtype)
        gain, low, high = paired_gain(after, before)
        out.update(baseline=a.baseline, baseline_accuracy=sum(before) / len(rows), gain_points=round(100 * gain, 2),
                   gain_95ci_points=[round(100 * low, 2), round(100 * high, 2)])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
