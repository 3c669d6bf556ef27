"""Where the end-of-turn token goes under DPO: greedy EOS share and the EOS log-probs, per model.

For each model folder given (e.g. step 1's output, then DPO outputs), on the held-out preference
pairs of the same data flags as ``chatrl.step2_dpo``, prints one JSON object with, per model:

* ``eos_rate``: share of greedy answers to the first ``--n_samples`` eval prompts that end with the
  end-of-turn token within ``--max_new_tokens`` (step 1's :func:`~chatrl.step1_sft.main.eos_rate`,
  the check ``--eval_eos_samples`` runs);
* ``eos_logp/chosen``, ``eos_logp/rejected``: mean ``log π(EOS | prompt, answer)`` of the final
  token of the chosen / rejected answers (nats);
* ``token_logp/chosen``, ``token_logp/rejected``: mean log-prob of the other answer tokens;
* ``logps/chosen``, ``logps/rejected``: mean summed answer log-probs (what DPO's loss sees);

and, once, the eval pairs' mean answer lengths and the share whose chosen answer is the longer.

Usage::

    python bench/dpo_eos.py --models output/sft output/dpo --data_path HB[600:1600] --data_split 0,10,0 \
        --eval_fraction 0.2 --max_seq_len 256
"""

from __future__ import annotations

import argparse
import json
import types

import torch


def answer_token_logps(model, batch) -> torch.Tensor:
    """``(2B, T-1)`` log-prob of each next token, 0 off the answer (:func:`chatrl.step2_dpo.loss.answer_logps`
    before the sum)."""
    from chatrl.models.causal_lm import causal_lm_logits

    logits = causal_lm_logits(model, batch["input_ids"], batch["attention_mask"])
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    return lp * batch["answer_mask"][:, 1:]


@torch.no_grad()
def probe(path: str, args) -> tuple[dict, dict]:
    from chatrl.config import DataConfig
    from chatrl.data import build_phase_data
    from chatrl.generation import eos_rate
    from chatrl.models.causal_lm import end_of_turn_token_id, load_causal_lm, load_tokenizer
    from chatrl.step2_dpo.batch import DPOCollator
    from chatrl.step2_dpo.main import chosen_prompts

    tok = load_tokenizer(path)
    model = load_causal_lm(path, tok, dtype="fp32").eval()
    data = build_phase_data(2, DataConfig(args.data_path, data_split=args.data_split,
                                          max_seq_len=args.max_seq_len, eval_fraction=args.eval_fraction,
                                          data_output_path=args.data_output_path), tok, seed=args.seed)
    pairs = data.eval
    collate = DPOCollator(tok.pad_token_id, padding_side="right")
    sums = {k: 0.0 for k in ("eos_c", "eos_r", "tok_c", "tok_r", "n_tok_c", "n_tok_r", "lp_c", "lp_r",
                             "len_c", "len_r", "c_longer")}
    n = len(pairs)
    for start in range(0, n, 16):
        items = [pairs[i] for i in range(start, min(n, start + 16))]
        b = collate(items)
        lp = answer_token_logps(model, b)
        lengths = b["attention_mask"].sum(1)          # right padding: the last real token is at length − 1
        last = lp[torch.arange(len(lengths)), lengths - 2]  # log p of that token (the answer's EOS)
        ends = b["input_ids"][torch.arange(len(lengths)), lengths - 1]
        if not bool((ends == end_of_turn_token_id(tok)).all()):
            raise ValueError(f"{path}: an eval answer does not end with the end-of-turn token")
        k = len(items)
        n_ans = b["answer_mask"].sum(1)
        rest = lp.sum(1) - last
        sums["eos_c"] += last[:k].sum().item()
        sums["eos_r"] += last[k:].sum().item()
        sums["tok_c"] += rest[:k].sum().item()
        sums["tok_r"] += rest[k:].sum().item()
        sums["n_tok_c"] += (n_ans[:k] - 1).sum().item()
        sums["n_tok_r"] += (n_ans[k:] - 1).sum().item()
        sums["lp_c"] += lp[:k].sum().item()
        sums["lp_r"] += lp[k:].sum().item()
        sums["len_c"] += n_ans[:k].sum().item()
        sums["len_r"] += n_ans[k:].sum().item()
        sums["c_longer"] += (n_ans[:k] > n_ans[k:]).sum().item()
    info = types.SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    rate = eos_rate(model, chosen_prompts(pairs, args.n_samples), tok, args.max_new_tokens, 0, info)
    row = {"eos_rate": rate, "eos_logp/chosen": sums["eos_c"] / n, "eos_logp/rejected": sums["eos_r"] / n,
           "token_logp/chosen": sums["tok_c"] / sums["n_tok_c"], "token_logp/rejected": sums["tok_r"] / sums["n_tok_r"],
           "logps/chosen": sums["lp_c"] / n, "logps/rejected": sums["lp_r"] / n}
    pair_stats = {"eval_pairs": n, "answer_tokens/chosen": sums["len_c"] / n, "answer_tokens/rejected": sums["len_r"] / n,
                  "chosen_longer_share": sums["c_longer"] / n}
    return row, pair_stats


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", required=True, help="model folders (HF causal LMs)")
    p.add_argument("--data_path", nargs="+", required=True, help="as chatrl.step2_dpo's --data_path")
    p.add_argument("--data_split", default="0,10,0", help="as chatrl.step2_dpo's")
    p.add_argument("--eval_fraction", type=float, default=0.2, help="as chatrl.step2_dpo's")
    p.add_argument("--max_seq_len", type=int, default=256, help="tokens")
    p.add_argument("--seed", type=int, default=1234, help="as chatrl.step2_dpo's (the eval split)")
    p.add_argument("--n_samples", type=int, default=32, help="greedy answers for eos_rate")
    p.add_argument("--max_new_tokens", type=int, default=64, help="tokens per greedy answer")
    p.add_argument("--data_output_path", default=None, help="tokenized-data cache folder")
    args = p.parse_args()
    out, pairs = {}, None
    for path in args.models:
        out[path], pairs = probe(path, args)
    print(json.dumps({"pairs": pairs, "models": out}, indent=1))


if __name__ == "__main__":
    main()
