"""The hybrid engine over 2 CPU ranks: exactness against HF generate, stopping, memory, fallback.

Each test is one 2-rank launch of ``tests/stages/hybrid_worker.py``, which asserts on every rank
and prints ``HYBRID_RESULT {json}``; the values are checked again here.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import run_ranks

WORKER = "tests/stages/hybrid_worker.py"


def _run(*args: str, timeout: float = 240) -> dict:
    proc = run_ranks([WORKER, *args], nprocs=2, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("HYBRID_RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1])


@pytest.mark.slow
def test_opt_zero3_exact_stop_memory_and_zero2(tiny_opt):
    r = _run("--model", str(tiny_opt), "--checks", "exact,stop,memory", "--extra_stage", "2")
    assert r["exact"] == ["tp1", "tp2", "tp1_after_step", "tp2_after_step", "stop_plain", "stop_tp1", "stop_tp2"]
    assert r["max_logit_diff"] < 1e-4
    assert r["sampling_equal_hf"] is True
    assert set(r["timings"]) == {"gather", "shard", "generate", "release"}
    assert r["memory"]["worst_ratio"] < 1.10
    assert set(r["stop_seconds"]) == {"plain", "tp1", "tp2"}
    assert r["stage2_lora0"] == ["tp1", "tp2", "tp1_after_step", "tp2_after_step"]
    assert r["stage2_lora4"] == ["tp1_lora", "tp2_lora", "tp1_after_step_lora", "tp2_after_step_lora"]


@pytest.mark.slow
def test_llama_zero3_lora_exact_and_unsupported_fallback(tiny_llama):
    r = _run("--model", str(tiny_llama), "--lora", "4", "--checks", "exact,stop,fallback")
    assert r["exact"] == ["tp1_lora", "tp2_lora", "tp1_after_step_lora", "tp2_after_step_lora",
                          "stop_plain", "stop_tp1", "stop_tp2", "fallback_gpt2"]
    assert r["max_logit_diff"] < 1e-4
    assert r["fallback_warnings"] == 1


@pytest.mark.slow
def test_bf16_greedy_tokens_equal_plain_generation_on_a_stated_share():
    """stories260K in bf16 under ZeRO-3, 64 prompts over 2 ranks, 24 greedy tokens: the engine's answers
    against plain HF generate on the same bf16 weights. Measured (2026-12-02): TP 1 64 of 64 equal; TP 2
    41 of 64 (45 while the bf16 head was multiplied as ``W @ hᵀ``), the first divergence at the first token (TP 2 rounds each rank's partial sum of a
    row-parallel layer to bf16 before the all-reduce adds them; a near-tie then flips). fp32: 64 of 64
    at both (docs/precision.md)."""
    from tests.conftest import STORIES

    r = _run("--model", str(STORIES), "--checks", "share", "--dtype", "bf16", "--new_tokens", "24")
    share = r["share"]
    assert share["tp1"]["prompts"] == share["tp2"]["prompts"] == 64
    print("bf16 greedy share:", share)
    assert share["tp1"]["equal"] >= 60, share
    assert share["tp2"]["equal"] >= 32, share


def test_logits_processing_matches_hf_processors():
    """min_new_tokens, temperature, top-k and top-p give HF's scores (single process, no launch)."""
    import torch
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from chatrl.hybrid_engine import GenerationSettings
    from chatrl.hybrid_engine.decode import process_logits

    torch.manual_seed(0)
    logits = torch.randn(4, 97) * 3
    prompt = torch.zeros(4, 5, dtype=torch.long)
    for step, (temp, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.5, 5, 0.6)]):
        s = GenerationSettings(max_new_tokens=8, do_sample=True, temperature=temp, top_k=k, top_p=p,
                               eos_token_ids=(3, 7), pad_token_id=0, min_new_tokens=2)
        procs = LogitsProcessorList([MinNewTokensLengthLogitsProcessor(5, 2, [3, 7])])
        if temp != 1.0:
            procs.append(TemperatureLogitsWarper(temp))
        if k:
            procs.append(TopKLogitsWarper(k))
        if p < 1.0:
            procs.append(TopPLogitsWarper(p))
        ids = torch.cat([prompt, torch.ones(4, step, dtype=torch.long)], dim=1)
        want = procs(ids, logits.clone())
        got = process_logits(logits.clone(), s, step)
        assert torch.equal(torch.isinf(want), torch.isinf(got)), (temp, k, p)
        finite = ~torch.isinf(want)
        assert torch.allclose(want[finite], got[finite]), (temp, k, p)
