"""Run step 1 in-process over the launcher's ranks, then check the saved folder against the live engine.

Usage (under torchrun): step1_worker.py RESULT_JSON -- <step-1 flags>. Rank 0 writes RESULT_JSON with
the final metrics, the logit difference between the engine and the saved folder, and (with LoRA)
how far base and LoRA weights moved.
"""

import json
import sys

import torch

from chatrl.distributed.dist import is_main, run_program
from chatrl.distributed.weights import full_state_dict
from chatrl.models.causal_lm import causal_lm_logits
from chatrl.step1_sft.main import run


def main():
    out_path, rest = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    res = run(rest)
    engine, tok, s = res["engine"], res["tokenizer"], res["settings"]
    engine.eval()
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in
                                           [tok("Hello there, how are you?").input_ids, tok("Once upon").input_ids]],
                                          batch_first=True, padding_value=tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate([tok("Hello there, how are you?").input_ids, tok("Once upon").input_ids]):
        mask[i, :len(r)] = 1
    with torch.no_grad():
        live = causal_lm_logits(engine, ids, mask)
    trained = full_state_dict(engine.module)
    if not is_main():
        return res  # run_program leaves the group with the engine still referenced
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(s.log.output_dir).eval()
    with torch.no_grad():
        reloaded = causal_lm_logits(saved, ids, mask)
    m = mask.bool()
    result = {"metrics": res["metrics"], "max_logit_diff": (live[m] - reloaded[m]).abs().max().item(),
              "saved_has_lora_keys": any("lora" in k for k in saved.state_dict()),
              "saved_tied": bool(saved.config.tie_word_embeddings)
              and saved.get_output_embeddings().weight is saved.get_input_embeddings().weight,
              "saved_params": sum(p.numel() for p in saved.parameters()),
              "input_tied": bool(AutoModelForCausalLM.from_pretrained(s.model.model_name_or_path).config.tie_word_embeddings),
              "live_tied": bool(getattr(engine.module, "get_base_model", lambda: engine.module)().config.tie_word_embeddings)}
    if s.lora.lora_dim:
        base = AutoModelForCausalLM.from_pretrained(s.model.model_name_or_path).state_dict()
        moved_base, moved_lora = 0.0, 0.0
        for k, v in trained.items():
            if "lora_" in k:
                moved_lora = max(moved_lora, v.abs().max().item() if "lora_B" in k else 0.0)
            else:
                name = k.replace("base_model.model.", "").replace(".base_layer", "")
                ref = base[name]
                if ref.shape == v.shape:
                    moved_base = max(moved_base, (v - ref).abs().max().item())
        result.update(moved_base=moved_base, moved_lora=moved_lora)
    with open(out_path, "w") as f:
        json.dump(result, f)
    return res


if __name__ == "__main__":
    run_program(main)
