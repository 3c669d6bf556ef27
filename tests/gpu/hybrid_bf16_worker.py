"""The hybrid engine in bf16 on one CUDA GPU against HF ``generate`` on the same weights.

One rank (started by tests/gpu/test_gpu.py): the actor under ZeRO-3 in bf16, greedy decoding through
the hybrid engine (TP 1) and through a plain HF model holding the gathered training weights on the
same GPU, before and after one optimizer step. Prints ``GPU_HYBRID_RESULT {json}``: whether the
tokens are equal, and the largest logit difference (bf16: both run the same HF modules, so they
are expected to agree to bf16 rounding).
"""

from __future__ import annotations

import argparse
import json

import torch

from chatrl.config import HybridEngineConfig
from chatrl.distributed import dist as cdist
from chatrl.distributed.dist import run_program
from chatrl.hybrid_engine import HybridEngine
from chatrl.models.causal_lm import load_causal_lm, load_tokenizer
from chatrl.sizes import BatchSizes
from tests.stages.hybrid_worker import prompts, reference_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--new_tokens", type=int, default=16)
    args = ap.parse_args()
    info = cdist.init_distributed()
    assert info.device.type == "cuda", info.device
    torch.manual_seed(0)
    tok = load_tokenizer(args.model, padding_side="left")
    model = load_causal_lm(args.model, tok, dtype="bf16")
    config = cdist.deepspeed_config(BatchSizes(2, 1, info.world_size), zero_stage=3, dtype="bf16")
    engine = cdist.initialize(model, config, torch.optim.AdamW(model.parameters(), lr=1e-2))
    he = HybridEngine(engine, HybridEngineConfig(enable_hybrid_engine=True, inference_tp_size=1))
    ids, mask = prompts(tok, info.rank, batch=4)
    ids, mask = ids.to(info.device), mask.to(info.device)
    n, eos, pad = args.new_tokens, tok.eos_token_id, tok.pad_token_id
    result = {"device": torch.cuda.get_device_name(), "dtype": "bf16", "checks": []}
    for phase in ("before_step", "after_step"):
        ref = reference_model(engine.module).to(info.device)
        seq, logits = he.generate(ids, mask, max_new_tokens=n, eos_token_id=eos, pad_token_id=pad, output_logits=True)
        he.exit_inference()
        with torch.no_grad():
            out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                               eos_token_id=eos, pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
        rseq = out.sequences
        rlogits = torch.stack([x.float() for x in out.logits], dim=1)
        steps = min(logits.shape[1], rlogits.shape[1])
        width = min(seq.shape[1], rseq.shape[1])
        result["checks"].append({"phase": phase, "tokens_equal": bool(torch.equal(seq[:, :width], rseq[:, :width])),
                                 "max_logit_diff": (logits[:, :steps].float() - rlogits[:, :steps]).abs().max().item(),
                                 "logit_scale": rlogits.abs().max().item()})
        if phase == "before_step":  # one optimizer step, so that the engine must pick up new weights
            batch = prompts(tok, info.rank, batch=2)
            b_ids, b_mask = batch[0].to(info.device), batch[1].to(info.device)
            loss = engine(input_ids=b_ids, attention_mask=b_mask, labels=b_ids.masked_fill(b_mask == 0, -100)).loss
            engine.backward(loss)
            engine.step()
    print("GPU_HYBRID_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    run_program(main)
