"""DPO's reference model, checked in one process on stories260K (a few optimizer steps per run).

Usage: dpo_worker.py RESULT_JSON WORK_DIR

Three runs of ``chatrl.step2_dpo.main.run``:

1. frozen copy: the reference's weights after training are bit-identical to the starting model's,
   while the policy's moved, and before training (eval, no dropout) the loss is exactly log 2;
2. ``--precompute_ref_log_probs``: the same train losses as run 1 (the table holds the same numbers);
3. LoRA with ``--only_optimize_lora``: the reference is the policy with adapters disabled (no
   second model), its log-probs equal the starting model's exactly, the base weights are
   bit-identical after training and the adapters moved.

Writes the findings to RESULT_JSON for the test to assert on.
"""

import json
import sys

import torch

from chatrl.distributed.dist import run_program
from chatrl.distributed.weights import full_state_dict
from chatrl.models.causal_lm import load_causal_lm, load_tokenizer
from chatrl.step2_dpo.main import run
from chatrl.step2_dpo.reference import batch_logps
from tests.conftest import DATA, STORIES


def _flags(work, name, *extra):
    return ["--model_name_or_path", f"{work}/base", "--data_path", str(DATA / "hh-rlhf" / "helpful-base[0:120]"),
            "--data_split", "0,1,0", "--eval_fraction", "0.2", "--max_seq_len", "256",
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--eval_iters", "1",
            "--learning_rate", "3e-3", "--max_steps", "3", "--dropout", "0.1", "--data_output_path", f"{work}/cache",
            "--output_dir", f"{work}/{name}", "--disable_progress_bar", *extra]


def _losses(out):
    rows = [json.loads(x) for x in open(f"{out}/logs/metrics.jsonl")]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main():
    result_path, work = sys.argv[1], sys.argv[2]
    # stories260K with its <pad> row added once and saved, so that every load of it is the same weights
    tok = load_tokenizer(str(STORIES))
    base = load_causal_lm(str(STORIES), tok)
    base.save_pretrained(f"{work}/base")
    tok.save_pretrained(f"{work}/base")
    start = {k: v.clone() for k, v in base.state_dict().items()}
    out = {}

    res = run(_flags(work, "copy"))
    ref = res["reference"]
    out["copy_kind"] = ref.kind
    out["copy_ref_identical"] = _same(full_state_dict(ref.engine.module), start)
    out["copy_ref_requires_grad"] = any(p.requires_grad for p in ref.engine.module.parameters())
    policy = full_state_dict(res["engine"].module)
    out["copy_policy_moved"] = not _same(policy, start)
    out["copy_losses"] = _losses(f"{work}/copy")
    out["copy_eval0_loss"] = [json.loads(x) for x in open(f"{work}/copy/logs/metrics.jsonl")][0]["eval/loss"]

    res = run(_flags(work, "pre", "--precompute_ref_log_probs"))
    out["pre_kind"] = res["reference"].kind
    out["pre_losses"] = _losses(f"{work}/pre")

    res = run(_flags(work, "lora", "--lora_dim", "8", "--only_optimize_lora", "--lora_learning_rate", "3e-2"))
    engine, ref = res["engine"], res["reference"]
    out["lora_kind"] = ref.kind
    state = full_state_dict(engine.module)
    base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in state.items()
            if "lora_" not in k}
    out["lora_base_identical"] = _same(base, start)
    out["lora_adapters_moved"] = any(v.abs().sum().item() > 0 for k, v in state.items() if "lora_B" in k)
    # The adapters-disabled reference scores a batch exactly as the untouched starting model does.
    from chatrl.config import DataConfig
    from chatrl.data import build_phase_data
    from chatrl.step2_dpo.batch import DPOCollator, IndexedPairs

    data = build_phase_data(2, DataConfig([str(DATA / "hh-rlhf" / "helpful-base[0:120]")],
                                          data_split="0,1,0", max_seq_len=256, eval_fraction=0.2,
                                          data_output_path=f"{work}/cache"), tok)
    batch = DPOCollator(tok.pad_token_id)([IndexedPairs(data.eval)[i] for i in range(4)])
    fresh = load_causal_lm(f"{work}/base", tok).eval()
    want, _ = batch_logps(fresh, batch, "cpu")
    ref_c, ref_r = ref.logps(batch)
    out["lora_ref_max_diff"] = (torch.cat([ref_c, ref_r]) - want).abs().max().item()
    engine.eval()
    now, _ = batch_logps(engine, batch, "cpu")
    out["lora_policy_diff"] = (now - want).abs().max().item()
    with open(result_path, "w") as f:
        json.dump(out, f)
    return res


if __name__ == "__main__":
    run_program(main)
