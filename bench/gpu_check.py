"""The GPU check's measuring part (started by bench/gpu_check.sh once a CUDA GPU and an environment exist).

1. the GPU tier of the tests (``pytest -m gpu tests/gpu``: NCCL, bf16 steps 1–3 on a small OPT and a
   small Llama, the hybrid engine against HF ``generate`` in bf16), counted from its JUnit report;
2. the device's memory bandwidth: nominal (from the device properties or a table of data sheets) and
   reached by a device-to-device copy of 1 GiB;
3. ``bench/hybrid_engine.py`` on the OPT-1.3B configuration (hidden 2048, 24 layers, 32 heads, FFN
   8192, vocab 50272; random weights, bf16, ZeRO-3, one rank): new tokens/s of plain HF generate on the
   ZeRO-3 module and of the hybrid engine, and the share of the memory bandwidth the engine's decoding
   reaches. Decoding one token reads every weight once and the KV cache so far, so
   ``bytes/step = 2·params + 2·layers·hidden·batch·context·2`` (bf16, K and V; ``context`` averaged
   over the steps), and the bandwidth reached is ``steps · bytes/step / generate seconds``.

4. step 3 in bf16 on one GPU (``python -m chatrl.step3_ppo``, DeepSpeed-Chat's single-GPU set-up): a
   random-weight actor of OPT-1.3B's shape and a reward model and critic of OPT-350M's (hidden 1024,
   24 layers, 512-wide embeddings projected in and out), 256-token prompts and up to 256 new tokens,
   PPO with the hybrid engine, ZeRO-0, ``--step3-batch`` rollouts per step; reports samples/s (the
   loop's, the first step left out) and generated tokens/s (answer tokens over the generation phase's
   seconds). DeepSpeed-Chat's own figure for this set-up is about 3.1 samples/s on one A100-80G; the
   goal on one H200 is 7.5.

Writes one JSON summary (``--out``) and prints it. Exit code 0 only when every test passed and the
benchmarks ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPT_1_3B = {"hidden": 2048, "layers": 24, "heads": 32, "vocab": 50272}
# Data-sheet peak memory bandwidth (bytes/s) by device name, when the device properties lack the clock.
NOMINAL = {"GH200": 4.0e12, "H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
           "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12,
           "L40": 0.864e12, "L4": 0.3e12, "A10G": 0.6e12, "A10": 0.6e12, "RTX 4090": 1.008e12, "V100": 0.9e12}


def nominal_bandwidth(props) -> tuple[float | None, str]:
    """Peak bytes/s: 2 (double data rate) × memory clock × bus width, else the data-sheet table."""
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8, "device properties (2 × memory clock × bus width)"
    for name, bw in NOMINAL.items():  # longest, most specific names first in the table
        if name in props.name:
            return bw, f"data sheet ({name})"
    return None, "unknown device"


def copy_bandwidth(gib: float = 1.0, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy (each copy reads and writes ``gib`` GiB)."""
    import torch

    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * n * 2 * repeats / (time.perf_counter() - t0)


def run_tests(work: Path, timeout: float) -> dict:
    junit = work / "gpu_tests.xml"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", f"--junitxml={junit}"],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    out = {"exit_code": proc.returncode, "seconds": round(time.time() - t0, 1), "tail": proc.stdout[-1500:]}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        out.update(counts, passed=counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"])
    return out


def run_bench(a, timeout: float) -> dict:
    cmd = [sys.executable, "bench/hybrid_engine.py", "--hidden", str(OPT_1_3B["hidden"]), "--layers",
           str(OPT_1_3B["layers"]), "--heads", str(OPT_1_3B["heads"]), "--vocab", str(OPT_1_3B["vocab"]),
           "--batch", str(a.batch), "--prompt-tokens", str(a.prompt_tokens), "--new-tokens", str(a.new_tokens),
           "--nprocs", "1", "--modes", "plain,engine_tp1", "--dtype", "bf16"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-3000:]}
    return json.loads(lines[-1])


OPT_350M = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "ffn_dim": 4096,
            "word_embed_proj_dim": 512}
DS_CHAT_A100_SAMPLES_PER_S = 3.1  # DeepSpeed-Chat's step 3, OPT-1.3B + OPT-350M, one A100-80G


def make_step3_models(work: Path) -> dict:
    """Random-weight OPT-1.3B-shaped actor and OPT-350M-shaped reward model (also the critic), bf16, the
    GPT-2 tokenizer with a separate pad; 512 prompt rows of at least 256 tokens (left-cut to 256)."""
    import torch
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM, OPTForSequenceClassification

    shared = Path(os.environ.get("CHATRL_SHARED", REPO.parent / "shared"))
    tok = AutoTokenizer.from_pretrained(shared / "tokenizers" / "gpt2")
    tok.add_special_tokens({"pad_token": "<pad>"})
    vocab = len(tok) + (-len(tok)) % 8
    common = dict(vocab_size=vocab, max_position_embeddings=2048, pad_token_id=tok.pad_token_id,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        actor = OPTForCausalLM(OPTConfig(hidden_size=OPT_1_3B["hidden"], num_hidden_layers=OPT_1_3B["layers"],
                                         num_attention_heads=OPT_1_3B["heads"], ffn_dim=4 * OPT_1_3B["hidden"],
                                         word_embed_proj_dim=OPT_1_3B["hidden"], **common)).to(torch.bfloat16)
        actor.save_pretrained(work / "actor")
        del actor
        rm = OPTForSequenceClassification(OPTConfig(num_labels=1, **OPT_350M, **common)).to(torch.bfloat16)
        rm.save_pretrained(work / "reward")
        del rm
    torch.cuda.empty_cache()
    for name in ("actor", "reward"):
        tok.save_pretrained(work / name)
    words = " ".join(f"topic{i} and the question of number {i}" for i in range(60))
    rows = [json.dumps({"prompt": f"\n\nHuman: {i}: {words}\n\nAssistant:"}) for i in range(512)]
    (work / "prompts.jsonl").write_text("\n".join(rows) + "\n")
    return {"actor": str(work / "actor"), "reward": str(work / "reward"), "prompts": str(work / "prompts.jsonl")}


def step3_figures(rows: list[dict], skip: int = 1) -> dict:
    """samples/s and generated tokens/s of step 3's metrics rows (one per step), the first ``skip`` left out:
    samples/s = rollouts / loop seconds (each row's rollouts over its ``samples_per_s``); generated
    tokens/s = sum of ``answer_len × rollouts`` over the sum of ``time/generate``."""
    rows = [r for r in rows if "samples_per_s" in r]
    per_step = [r["samples"] - (rows[i - 1]["samples"] if i else 0) for i, r in enumerate(rows)]
    kept = list(zip(per_step, rows, strict=True))[skip:]
    samples = sum(n for n, _ in kept)
    loop_s = sum(n / r["samples_per_s"] for n, r in kept)
    tokens = sum(n * r["answer_len"] for n, r in kept)
    return {"steps": len(kept), "samples_per_s": samples / loop_s,
            "generated_tokens_per_s": tokens / sum(r["time/generate"] for _, r in kept),
            "answer_len": tokens / samples, "phase_s": {k: round(sum(r[f"time/{k}"] for _, r in kept), 2)
                                                        for k in ("generate", "experience", "train")}}


def run_step3(a, work: Path, timeout: float) -> dict:
    t0 = time.time()
    try:
        m = make_step3_models(work / "step3_models")
    except Exception as e:  # noqa: BLE001 - reported in the summary, the other checks still count
        return {"error": f"building the models: {type(e).__name__}: {e}"}
    out = work / "step3_out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "chatrl.step3_ppo",
           "--actor_model_name_or_path", m["actor"], "--critic_model_name_or_path", m["reward"],
           "--data_path", m["prompts"], "--data_split", "0,0,10", "--data_output_path", str(work / "step3_cache"),
           "--max_prompt_seq_len", "256", "--max_answer_seq_len", "256", "--per_device_generation_batch_size",
           str(a.step3_batch), "--per_device_training_batch_size", str(a.step3_batch), "--max_steps",
           str(a.step3_steps), "--num_warmup_steps", "0", "--actor_zero_stage", "0", "--critic_zero_stage", "0",
           "--enable_hybrid_engine", "--dtype", "bf16", "--disable_progress_bar", "--overwrite_output_dir",
           "--output_dir", str(out)]
    env = {**os.environ, "DS_ACCELERATOR": "cuda"}
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"step 3 ran over {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-3000:]}
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    figures = step3_figures(rows)
    figures.update(seconds=round(time.time() - t0, 1), batch=a.step3_batch, goal_samples_per_s=7.5,
                   deepspeed_chat_a100_samples_per_s=DS_CHAT_A100_SAMPLES_PER_S,
                   vs_deepspeed_chat_a100=round(figures["samples_per_s"] / DS_CHAT_A100_SAMPLES_PER_S, 2))
    return figures


def decode_bandwidth(bench: dict, a) -> dict:
    """Bytes/s the engine's decoding moves, from the benchmark's generate time and the model's sizes."""
    s = bench["setup"]
    engine = bench["engine_tp1"]
    seconds = engine["timings"].get("generate") or engine["seconds"]
    kv_per_step = 2 * s["layers"] * s["hidden"] * s["batch_per_rank"] * (a.prompt_tokens + a.new_tokens / 2) * 2
    per_step = 2 * s["params"] + kv_per_step
    return {"bytes_per_step": per_step, "weight_bytes": 2 * s["params"], "generate_seconds": seconds,
            "bytes_per_s": a.new_tokens * per_step / seconds}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--step3-batch", type=int, default=16, help="step 3: rollouts per step")
    p.add_argument("--step3-steps", type=int, default=4, help="step 3: steps (the first is left out)")
    a = p.parse_args()
    import deepspeed
    import torch
    import transformers

    if not torch.cuda.is_available():
        print("gpu_check: SKIP: torch sees no CUDA device", flush=True)
        return 0
    props = torch.cuda.get_device_properties(0)
    nominal, source = nominal_bandwidth(props)
    work = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/chatrl_gpu_check"))
    work.mkdir(parents=True, exist_ok=True)
    summary: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "device": {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                                "count": torch.cuda.device_count(), "nominal_bandwidth_gb_s":
                                    nominal and round(nominal / 1e9), "nominal_source": source},
                     "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                                  "deepspeed": deepspeed.__version__, "transformers": transformers.__version__}}
    summary["device"]["copy_bandwidth_gb_s"] = round(copy_bandwidth() / 1e9)
    torch.cuda.empty_cache()
    if not a.skip_tests:
        summary["tests"] = run_tests(work, timeout=270)
    bench = run_bench(a, timeout=120)
    summary["hybrid_engine_opt_1.3b_bf16"] = bench
    if "engine_tp1" in bench:
        bw = decode_bandwidth(bench, a)
        bw["fraction_of_nominal"] = nominal and round(bw["bytes_per_s"] / nominal, 3)
        bw["fraction_of_copy"] = round(bw["bytes_per_s"] / (summary["device"]["copy_bandwidth_gb_s"] * 1e9), 3)
        bw["bytes_per_s"] = round(bw["bytes_per_s"])
        summary["decode_bandwidth"] = bw
    torch.cuda.empty_cache()
    summary["step3_bf16_opt_1.3b_350m"] = step3 = run_step3(a, work, timeout=170)
    Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1), flush=True)
    tests_ok = a.skip_tests or (summary["tests"].get("exit_code") == 0 and summary["tests"].get("passed", 0) > 0)
    return 0 if tests_ok and "engine_tp1" in bench and "samples_per_s" in step3 else 1


if __name__ == "__main__":
    sys.exit(main())
