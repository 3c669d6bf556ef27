"""chatrl's DPO loss next to TRL's ``DPOTrainer`` on identical inputs (sigmoid and IPO).

Three phases, each run by ``bench/peers/dpo_loss_vs_trl.sh`` in its own interpreter:

``prepare`` (chatrl's venv)
    Writes a reference model (stories260K with chatrl's tokenizer set-up: a ``<pad>`` distinct
    from EOS) and a policy (the same weights plus seeded noise, so that the log-ratios are not
    zero) into WORK/, and a few hh-rlhf pairs as text.
``trl`` (TRL's venv, TRL 1.12.0; see ../shared/baselines/trl/setup_venv.sh)
    Builds a ``DPOTrainer`` per loss type on those models and pairs and takes TRL's own collated
    batch (its tokenization, its right padding, its completion mask). It runs the policy and the
    reference once on it and keeps their logits: the identical inputs. TRL's loss is
    ``DPOTrainer._compute_loss`` with the policy and the reference replaced by stubs that return
    those logits (the loss functions alone), and, for information, with the real models (the
    whole chain in TRL's venv). Saves the batch, the logits and the losses to WORK/trl.pt.
``compare`` (chatrl's venv)
    Computes chatrl's loss from the same logits, token ids and completion masks with
    :func:`chatrl.step2_dpo.loss.answer_logps` and :func:`chatrl.step2_dpo.loss.preference_loss`
    (the bar: within 1e-5 of TRL's), and the whole chain with chatrl's own forward
    (:func:`chatrl.models.causal_lm.causal_lm_logits`; TRL's venv may pin another transformers version),
    and prints one JSON object.

Both sides run in fp32 (``DPOConfig(bf16=False)``: TRL 1.12 defaults to bf16 autocast, which moves
real-token logits of this model by up to 0.6). TRL is never imported by chatrl or its tests: only the ``trl`` phase imports it, in TRL's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

LOSS_TYPES = ("sigmoid", "ipo")
BETA = 0.1
N_PAIRS = 8


def prepare(work: Path, shared: Path) -> None:
    import torch

    from chatrl.data import load_samples
    from chatrl.data.formatting import format_answer, format_prompt
    from chatrl.models.causal_lm import load_causal_lm, load_tokenizer

    stories = shared / "models" / "stories260K"
    tok = load_tokenizer(str(stories))
    ref = load_causal_lm(str(stories), tok, dtype="fp32")
    ref.save_pretrained(work / "reference")
    tok.save_pretrained(work / "reference")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    ref.save_pretrained(work / "policy")
    tok.save_pretrained(work / "policy")
    rows = []
    for s in load_samples(f"{shared / 'data' / 'hh-rlhf' / 'helpful-base' / 'test.jsonl.gz'}[0:40]"):
        prompt = format_prompt(tok, s.messages)
        chosen, rejected = format_answer(tok, s.chosen), format_answer(tok, s.rejected)
        if len(prompt) + max(len(chosen), len(rejected)) < 600 and chosen != rejected:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        if len(rows) == N_PAIRS:
            break
    (work / "pairs.json").write_text(json.dumps(rows))


def run_trl(work: Path) -> None:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    class Stub(torch.nn.Module):
        """Stands in for a model in TRL's loss code: returns fixed logits whatever it is called with."""

        def __init__(self, logits):
            super().__init__()
            self.logits = logits

        def forward(self, **kwargs):
            from types import SimpleNamespace

            return SimpleNamespace(logits=self.logits)

    rows = json.loads((work / "pairs.json").read_text())
    out = {"trl_version": trl.__version__, "losses": {}}
    for loss_type in LOSS_TYPES:
        tok = AutoTokenizer.from_pretrained(work / "policy")
        policy = AutoModelForCausalLM.from_pretrained(work / "policy", dtype=torch.float32)
        reference = AutoModelForCausalLM.from_pretrained(work / "reference", dtype=torch.float32)
        cfg = DPOConfig(output_dir=str(work / "trl_out"), beta=BETA, loss_type=[loss_type], report_to="none",
                        per_device_train_batch_size=N_PAIRS, max_length=None, use_cpu=True, disable_dropout=True,
                        bf16=False)  # TRL defaults to bf16 autocast; chatrl runs this in fp32
        trainer = DPOTrainer(model=policy, ref_model=reference, args=cfg, processing_class=tok,
                             train_dataset=Dataset.from_list(rows))
        batch = next(iter(trainer.get_train_dataloader()))
        batch = {k: v for k, v in batch.items() if torch.is_tensor(v)}
        trainer.model.eval()
        trainer.ref_model.eval()
        with torch.no_grad():
            full_chain = trainer._compute_loss(trainer.model, dict(batch), return_outputs=False).item()
            fwd = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}
            logits = {"policy": trainer.model(**fwd).logits, "reference": trainer.ref_model(**fwd).logits}
            trainer.ref_model = Stub(logits["reference"])
            loss = trainer._compute_loss(Stub(logits["policy"]), dict(batch), return_outputs=False).item()
        out["losses"][loss_type] = {"identical_logits": loss, "full_chain": full_chain}
        out["batch"] = {k: v.cpu() for k, v in batch.items()}
        out["logits"] = logits
    torch.save(out, work / "trl.pt")


def compare(work: Path) -> dict:
    import torch

    from chatrl.models.causal_lm import causal_lm_logits, load_causal_lm, load_tokenizer
    from chatrl.step2_dpo.batch import split_pairs
    from chatrl.step2_dpo.loss import DPOConfig, answer_logps, preference_loss

    trl_out = torch.load(work / "trl.pt", weights_only=True)
    batch = trl_out["batch"]
    ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]

    def losses_from(logits: dict) -> dict:
        pol, n = answer_logps(logits["policy"], ids, completion)
        ref, _ = answer_logps(logits["reference"], ids, completion)
        (pc, pr), (rc, rr), (nc, nr) = split_pairs(pol), split_pairs(ref), split_pairs(n)
        return {t: preference_loss(DPOConfig(beta=BETA, loss_type=t), pc, pr, rc, rr, nc, nr)[0].mean().item()
                for t in LOSS_TYPES}

    tok = load_tokenizer(str(work / "policy"))
    own = {}
    for name in ("policy", "reference"):
        model = load_causal_lm(str(work / name), tok, dtype="fp32").eval()
        with torch.no_grad():
            own[name] = causal_lm_logits(model, ids, mask)
    same, chain = losses_from(trl_out["logits"]), losses_from(own)
    n_answer = int(completion[:, 1:].sum())
    result = {"bench": "dpo_loss_vs_trl", "trl_version": trl_out["trl_version"], "beta": BETA,
              "pairs": ids.shape[0] // 2, "answer_tokens": n_answer,
              "padding_side": "right" if bool(mask[:, 0].all()) else "left",
              "max_abs_logit_diff_own_forward_vs_trl_venv_real_tokens": max(
                  (own[k] - trl_out["logits"][k])[mask.bool()].abs().max().item() for k in own),
              "max_abs_answer_logp_diff_own_forward_vs_trl_venv": max(
                  (answer_logps(own[k], ids, completion)[0]
                   - answer_logps(trl_out["logits"][k], ids, completion)[0]).abs().max().item() for k in own),
              "loss_types": {}}
    for t in LOSS_TYPES:
        theirs = trl_out["losses"][t]
        result["loss_types"][t] = {
            "identical_logits": {"chatrl": same[t], "trl": theirs["identical_logits"],
                                 "abs_diff": abs(same[t] - theirs["identical_logits"]),
                                 "within_1e-5": abs(same[t] - theirs["identical_logits"]) < 1e-5},
            "full_chain": {"chatrl": chain[t], "trl": theirs["full_chain"],
                           "abs_diff": abs(chain[t] - theirs["full_chain"])}}
    result["all_within_1e-5"] = all(v["identical_logits"]["within_1e-5"] for v in result["loss_types"].values())
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["prepare", "trl", "compare"])
    p.add_argument("--work", required=True, help="scratch folder shared by the three phases")
    p.add_argument("--shared", default=os.environ.get("CHATRL_SHARED", "../shared"), help="offline assets")
    a = p.parse_args(argv)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.phase == "prepare":
        prepare(work, Path(a.shared))
    elif a.phase == "trl":
        run_trl(work)
    else:
        result = compare(work)
        print(json.dumps(result, indent=2))
        return 0 if result["all_within_1e-5"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
