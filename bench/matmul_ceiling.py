"""This CPU's matrix-product rate in bf16 and fp32 with the shapes step 3's models use, and the training
phase's achieved FLOP/s against it, printed as JSON.

The ceiling: every matrix product of one PPO training micro-step of the larger PPO set-up (OPT, hidden
512, 8 layers, FFN 2048, vocabulary 50272; 4 rollouts of 128 + 64 tokens; the actor's LM head on the 65
answer positions; the critic's body; forward, then the backward's two products per linear layer) is
timed alone on one thread (what one rank uses on this 2-core machine), and the rates are weighted by
each product's share of the step's FLOPs: the rate a step would reach if it were nothing but its matrix
products, back to back.

The achieved rate: the FLOPs of step 3's training phase (the actor's and the critic's forward and
backward of each micro-step; 2 FLOPs per multiply-add; attention's two products per head included)
divided by the phase's measured seconds, ``time/train`` of a step-3 metrics log of that set-up
(``--metrics``, e.g. a run of ``bench/step3.py --side_by_side --hidden 512 --layers 8 --dtype bf16``),
or of a short run made here (``--run``: ZeRO-0, hybrid engine, ``--steps`` steps, the first dropped).

Where the rest goes (``--model_only``): the same micro-step's model computation alone, in this process
on one thread, no DeepSpeed, no second rank: random OPT actor and critic of the set-up in the run's
dtype (chatrl's loaders' attention: float32 on CPU for bf16), the actor's LM head and log-softmax on
the answer positions, the critic's scalar head, forward and backward (``model_step``), then the
optimizer's work as DeepSpeed's bf16 ZeRO-0 does it (``optimizer``: the gradients copied to float32,
fused AdamW on float32 master weights, the bf16 weights refreshed from them; fp32: AdamW alone). The
training phase's time less these two is the run's own: the gradient all-reduce, two ranks sharing
the memory bandwidth, the loss and statistics code.

    .venv/bin/python bench/matmul_ceiling.py                       # the ceiling, bf16 and fp32
    .venv/bin/python bench/matmul_ceiling.py --run --dtype bf16    # and step 3's training phase against it
    .venv/bin/python bench/matmul_ceiling.py --model_only --dtype bf16 --metrics RUN/out/logs/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Setup:
    """The larger PPO set-up of docs/performance.md."""

    hidden: int = 512
    layers: int = 8
    ffn: int = 2048
    heads: int = 8
    vocab: int = 50272
    batch: int = 4
    prompt: int = 128
    answer: int = 64

    @property
    def tokens(self) -> int:
        return self.batch * (self.prompt + self.answer)


def products(s: Setup) -> list[tuple[str, int, int, int, int]]:
    """``(name, m, k, n, count)`` of every matrix product ``(m × k) @ (k × n)`` in one training micro-step
    of the actor and the critic (the critic: the same body, a scalar head)."""
    t, h, f, d = s.tokens, s.hidden, s.ffn, s.hidden // s.heads
    seq = s.prompt + s.answer
    head_rows = s.batch * (s.answer + 1)
    linear = [("qkvo", h, h, 4), ("fc1", h, f, 1), ("fc2", f, h, 1)]
    out = []
    for name, k, n, per_layer in linear:
        c = per_layer * s.layers * 2  # actor and critic
        out += [(f"{name} fwd", t, k, n, c), (f"{name} bwd dx", t, n, k, c), (f"{name} bwd dw", k, t, n, c)]
    att = s.batch * s.heads * s.layers * 2
    out += [("attn qk fwd", seq, d, seq, att), ("attn av fwd", seq, seq, d, att),
            ("attn bwd", seq, seq, d, 4 * att)]  # two products per forward product
    out += [("lm head fwd", head_rows, h, s.vocab, 1), ("lm head bwd dx", head_rows, s.vocab, h, 1),
            ("lm head bwd dw", h, head_rows, s.vocab, 1)]
    return out


def step_flops(s: Setup) -> float:
    """FLOPs of one training micro-step (2 per multiply-add)."""
    return sum(2.0 * m * k * n * c for _, m, k, n, c in products(s))


def rate(m: int, k: int, n: int, dtype: torch.dtype, seconds: float = 0.3) -> float:
    """GFLOP/s of ``(m × k) @ (k × n)`` in ``dtype`` on this thread: the best of repeated timings."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(2):
        a @ b
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end or best == float("inf"):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / best / 1e9


def ceiling(s: Setup, dtype: torch.dtype) -> dict:
    """Per product its rate, and the FLOP-weighted rate of the step (total FLOPs / sum of their times)."""
    rows, total_s = [], 0.0
    for name, m, k, n, c in products(s):
        g = rate(m, k, n, dtype)
        flops = 2.0 * m * k * n * c
        total_s += flops / (g * 1e9)
        rows.append({"product": name, "shape": [m, k, n], "count": c, "gflops": round(g, 1),
                     "flop_share": None})
    total = step_flops(s)
    for row, (_, m, k, n, c) in zip(rows, products(s), strict=True):
        row["flop_share"] = round(2.0 * m * k * n * c / total, 4)
    return {"gflops": round(total / total_s / 1e9, 1), "products": rows}


def run_step3(dtype: str, steps: int, work: Path, batch: int = 4) -> Path:
    """The larger set-up's step 3 at ZeRO-0 with the hybrid engine, ``batch`` rollouts per rank (generated
    and trained as one micro-batch); returns its metrics log."""
    import subprocess

    from bench.step3 import make_side_by_side_setup

    a = argparse.Namespace(hidden=512, layers=8)
    setup = make_side_by_side_setup(work, a)
    out = work / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "chatrl.step3_ppo",
           "--actor_model_name_or_path", setup["sft"], "--critic_model_name_or_path", setup["rm"],
           "--data_path", setup["prompts"], "--data_split", "0,0,10", "--data_output_path", str(work / "cache"),
           "--max_prompt_seq_len", "128", "--max_answer_seq_len", "64", "--per_device_generation_batch_size", str(batch),
           "--per_device_training_batch_size", str(batch), "--max_steps", str(steps), "--num_warmup_steps", "0",
           "--temperature", "0.7", "--actor_zero_stage", "0", "--critic_zero_stage", "0", "--enable_hybrid_engine",
           "--seed", "1", "--dtype", dtype, "--disable_progress_bar", "--output_dir", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, env=env, cwd=REPO, check=True, capture_output=True)
    return out / "logs" / "metrics.jsonl"


def achieved(metrics: Path, s: Setup, skip: int) -> dict:
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    rows = [r for r in rows if "time/train" in r][skip:]
    train_s = sum(r["time/train"] for r in rows) / len(rows)
    return {"steps": len(rows), "train_s_per_step": round(train_s, 3),
            "gflops": round(step_flops(s) / train_s / 1e9, 1)}


def model_only(s: Setup, dtype: str, repeats: int = 5, bf16_sdpa: bool = False) -> dict:
    """Seconds of one micro-step's model computation and of the optimizer's work, medians of ``repeats``
    after a warm-up (module docstring), and the model step's GFLOP/s. ``bf16_sdpa``: the models attend
    with transformers' SDPA in their own dtype instead of chatrl's attention (the island's effect)."""
    import statistics

    from transformers import OPTConfig, OPTForCausalLM, OPTModel

    from chatrl.models.precision import attention_kwargs

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    cfg = OPTConfig(vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                    ffn_dim=s.ffn, max_position_embeddings=1024, word_embed_proj_dim=s.hidden, dropout=0.0,
                    **({} if bf16_sdpa else attention_kwargs(dtype, "cpu")))
    torch.manual_seed(0)
    actor, critic = OPTForCausalLM(cfg).to(dt), OPTModel(cfg).to(dt)
    head = torch.nn.Linear(s.hidden, 1, bias=False).to(dt)
    seq = s.prompt + s.answer
    ids = torch.randint(3, s.vocab, (s.batch, seq))
    mask = torch.ones_like(ids)
    mask[:, : s.prompt // 4] = 0  # left padding, as rollouts have

    def model_step() -> None:
        hidden = actor.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, s.prompt - 1:-1]
        logits = actor.lm_head(hidden).float()  # the answer positions only, as chatrl's trainer
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, s.prompt:, None])
        (-logp.mean()).backward()
        values = head(critic(input_ids=ids, attention_mask=mask).last_hidden_state[:, s.prompt - 1:-1]).float()
        values.pow(2).mean().backward()

    params = [p for m in (actor, critic, head) for p in m.parameters()]
    master = [p.detach().float().clone() for p in params] if dt != torch.float32 else params
    opt = torch.optim.AdamW(master, lr=1e-6, fused=True)

    def optimizer_step() -> None:
        if dt != torch.float32:
            for p, m in zip(params, master, strict=True):
                m.grad = p.grad.float()
        opt.step()
        if dt != torch.float32:
            for p, m in zip(params, master, strict=True):
                p.data.copy_(m)
                m.grad = None

    times: dict[str, list[float]] = {"model_step": [], "optimizer": []}
    for i in range(repeats + 1):
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        model_step()
        t1 = time.perf_counter()
        optimizer_step()
        t2 = time.perf_counter()
        if i:  # the first is the warm-up
            times["model_step"].append(t1 - t0)
            times["optimizer"].append(t2 - t1)
    out = {k: round(statistics.median(v), 3) for k, v in times.items()}
    out["model_step_gflops"] = round(step_flops(s) / out["model_step"] / 1e9, 1)
    out["parameters_m"] = round(sum(p.numel() for p in params) / 1e6, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="the training run's dtype")
    p.add_argument("--metrics", default=None, help="a step-3 metrics.jsonl of the larger set-up (one micro-step "
                                                   "per step: 4 rollouts per rank, 1 PPO epoch)")
    p.add_argument("--run", action="store_true", help="run step 3 here (ZeRO-0, --steps steps) and read its log")
    p.add_argument("--steps", type=int, default=6, help="--run: step-3 steps (default 6)")
    p.add_argument("--skip", type=int, default=1, help="first steps left out (warm-up)")
    p.add_argument("--batch", type=int, default=4, help="rollouts per rank in a micro-step (default 4, the larger "
                                                         "PPO set-up; DeepSpeed-Chat's default is 16)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (one per rank on this machine)")
    p.add_argument("--model_only", action="store_true", help="also time the micro-step's model computation and "
                                                             "the optimizer's work alone (module docstring)")
    p.add_argument("--bf16_sdpa", action="store_true", help="--model_only: attend with transformers' SDPA in the "
                                                            "model's dtype instead of chatrl's fp32 attention on CPU")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    s = Setup(batch=a.batch)
    result = {"bench": "matmul_ceiling", "date": time.strftime("%Y-%m-%d"), "threads": a.threads,
              "cpu": torch.cpu.get_capabilities().get("cpu_name") if hasattr(torch.cpu, "get_capabilities") else None,
              "setup": vars(s) | {"tokens": s.tokens}, "step_gflop": round(step_flops(s) / 1e9, 2),
              "ceiling": {name: ceiling(s, dt) for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))}}
    result["ceiling_bf16_over_fp32"] = round(result["ceiling"]["bf16"]["gflops"] / result["ceiling"]["fp32"]["gflops"], 2)
    metrics = Path(a.metrics) if a.metrics else None
    with tempfile.TemporaryDirectory(prefix="chatrl_ceiling_") as tmp:
        if a.run:
            metrics = run_step3(a.dtype, a.steps, Path(tmp), a.batch)
        if metrics is not None:
            got = achieved(metrics, s, a.skip)
            got["dtype"] = a.dtype
            got["share_of_ceiling"] = round(got["gflops"] / result["ceiling"][a.dtype]["gflops"], 3)
            result["training_phase"] = got
    if a.model_only:
        alone = model_only(s, a.dtype, bf16_sdpa=a.bf16_sdpa)
        alone["share_of_ceiling"] = round(alone["model_step_gflops"] / result["ceiling"][a.dtype]["gflops"], 3)
        if "training_phase" in result:
            alone["rest_of_training_phase_s"] = round(result["training_phase"]["train_s_per_step"]
                                                      - alone["model_step"] - alone["optimizer"], 3)
        result["model_only"] = alone | {"dtype": a.dtype, "attention": "bf16 sdpa" if a.bf16_sdpa else "chatrl's"}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
