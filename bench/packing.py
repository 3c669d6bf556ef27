"""Benchmark padding-free training: samples/s and peak memory, packed rows against padded batches, on real
data, printed as JSON.

For each stage the training computation of the program runs on the same samples both ways, in one
process per measurement (so that its peak resident memory is its own), one rank, no DeepSpeed (the
model code, as ``bench/step2.py``): chatrl's own collators, forwards and losses, AdamW. Padded and
packed measurements alternate, ``--repeats`` times; the JSON gives the median samples/s of each, the
ratio packed / padded, the peak resident memory (``ru_maxrss``) and the share of computed positions
that were padding.

* ``step1``: SFT on helpful-base + Alpaca (``--seq_len`` tokens), ``--batch`` examples per step;
* ``step2``: the reward model on helpful-base pairs, ``--batch`` pairs per step;
* ``dpo``: DPO (policy and a frozen reference copy) on helpful-base pairs;
* ``step3``: step 3's training phase (PPO: the actor's and the critic's micro-steps, after the
  experience passes, timed apart) on rollouts made of helpful-base prompts (their last
  ``--prompt_len`` tokens) and the dataset's chosen answers cut to ``--answer_len`` tokens (answers
  of the lengths a chat model gives, ending with EOS when they fit), ``--batch`` rollouts per
  micro-batch, 2 micro-batches per optimizer step.

    .venv/bin/python bench/packing.py                                   # tiny OPT (h64, 2 layers), GPT-2 BPE
    .venv/bin/python bench/packing.py --model ../shared/models/stories260K --out bench/results/packing_stories.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("CHATRL_SHARED", REPO.parent / "shared"))
HB = str(SHARED / "data" / "hh-rlhf" / "helpful-base")
ALPACA = str(SHARED / "data" / "alpaca-instructions")
STAGES = ("step1", "step2", "dpo", "step3")


class LocalEngine:
    """The DeepSpeed engine calls chatrl's training code makes, on one process: ``backward`` divides
    by the accumulation steps, ``step`` applies AdamW at the accumulation boundary (counted, or set)."""

    def __init__(self, model, gas: int, lr: float = 1e-4):
        import torch

        self.module, self.gas, self.micro, self.boundary = model, gas, 0, None
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def eval(self):
        self.module.eval()

    def backward(self, loss):
        (loss / self.gas).backward()

    def set_gradient_accumulation_boundary(self, boundary: bool):
        self.boundary = boundary

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.boundary if self.boundary is not None else (self.micro + 1) % self.gas == 0

    def step(self):
        if self.is_gradient_accumulation_boundary():
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        self.micro += 1


def data_config(paths, split, a):
    from chatrl.config import DataConfig

    return DataConfig(data_path=paths, data_split=split, data_output_path=a.cache, max_seq_len=a.seq_len)


def ordered(dataset, n: int, seed: int = 1234) -> list:
    """``n`` items of ``dataset`` in a seeded random order (the loaders' shuffle), cycling if needed."""
    import torch

    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    return [dataset[order[i % len(order)]] for i in range(n)]


def padded_positions(batches: list[dict]) -> tuple[int, int]:
    """(positions computed, real tokens) over collated batches."""
    computed = real = 0
    for b in batches:
        computed += b["input_ids"].numel()
        real += int(b["packed"].length.sum()) if b.get("packed") is not None else int(b["attention_mask"].sum())
    return computed, real


def run_steps(steps: list, one_step, warmup: int) -> float:
    """Seconds for ``steps[warmup:]`` (each a list of micro-batches) through ``one_step``."""
    for i, micro in enumerate(steps):
        if i == warmup:
            t0 = time.perf_counter()
        one_step(micro)
    return time.perf_counter() - t0


def bench_step1(a, packed: bool) -> dict:
    import torch

    from chatrl.data import SFTCollator, phase_data
    from chatrl.data.collate import MicroBatches, PackedSFTCollator
    from chatrl.logprobs import IGNORE_INDEX
    from chatrl.models import load_causal_lm, load_tokenizer
    from chatrl.step1_sft.loss import sft_nll

    tok = load_tokenizer(a.model_dir)
    data = phase_data(1, data_config([HB, ALPACA], "10,0,0", a), tok, 1234)
    collate = PackedSFTCollator(tok.pad_token_id) if packed else SFTCollator(tok.pad_token_id)
    micro_batches = MicroBatches(collate, a.batch, 0, "cpu")
    items = ordered(data.train, (a.warmup + a.steps) * a.batch)
    steps = [micro_batches(items[i:i + a.batch]) for i in range(0, len(items), a.batch)]
    engine = LocalEngine(load_causal_lm(a.model_dir, tok).train(), 1)

    def one_step(micro):
        n = sum(int((m["labels"][:, 1:] != IGNORE_INDEX).sum()) for m in micro)
        for m in micro:
            nll, _ = sft_nll(engine, m["input_ids"], m["attention_mask"], m["labels"], packed=m.get("packed"))
            engine.backward(nll / n)
            engine.step()

    seconds = run_steps(steps, one_step, a.warmup)
    return {"samples_per_s": a.steps * a.batch / seconds, "positions": padded_positions(sum(steps[a.warmup:], []))}


def bench_pairs(a, packed: bool, dpo: bool) -> dict:
    import copy

    from chatrl.data import PairCollator, phase_data
    from chatrl.data.collate import MicroBatches, PackedPairCollator
    from chatrl.models import load_causal_lm, load_tokenizer
    from chatrl.reward_model import load_reward_model, pairwise_losses
    from chatrl.step2_dpo.batch import (
        DPOCollator,
        IndexedPairs,
        PackedDPOCollator,
        batch_answer_logps,
        split_pairs,
    )
    from chatrl.step2_dpo.loss import DPOConfig, preference_loss
    from chatrl.step2_dpo.reference import batch_logps

    tok = load_tokenizer(a.model_dir)
    data = phase_data(2, data_config([HB], "0,10,0", a), tok, 1234)
    if dpo:
        collate = PackedDPOCollator(tok.pad_token_id) if packed else DPOCollator(tok.pad_token_id)
        pairs = IndexedPairs(data.train)
    else:
        collate = PackedPairCollator(tok.pad_token_id) if packed else PairCollator(tok.pad_token_id)
        pairs = data.train
    micro_batches = MicroBatches(collate, a.batch, 0, "cpu")
    items = ordered(pairs, (a.warmup + a.steps) * a.batch)
    steps = [micro_batches(items[i:i + a.batch]) for i in range(0, len(items), a.batch)]
    if dpo:
        policy = load_causal_lm(a.model_dir, tok)
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
        engine = LocalEngine(policy.train(), 1)
        settings = DPOConfig()
    else:
        engine = LocalEngine(load_reward_model(a.model_dir, tok, require_head=False).train(), 1)

    def one_step(micro):
        for m in micro:
            if dpo:
                ref = split_pairs(batch_logps(reference, m, "cpu")[0])
                logps, n = batch_answer_logps(engine, m, "cpu")
                losses, _, _ = preference_loss(settings, *split_pairs(logps), *ref, *split_pairs(n))
            else:
                _, scores = engine(m["input_ids"], m["attention_mask"], packed=m.get("packed"))
                losses = pairwise_losses(*split_pairs(scores))
            engine.backward(losses.sum() / a.batch)
            engine.step()

    seconds = run_steps(steps, one_step, a.warmup)
    return {"samples_per_s": a.steps * a.batch / seconds, "positions": padded_positions(sum(steps[a.warmup:], []))}


def rollouts(a, tok, items) -> list:
    """Experience-layout rollouts from pairs: the prompt's last ``--prompt_len`` tokens (left-padded),
    the chosen answer's first ``--answer_len`` tokens (right-padded)."""
    import torch

    from chatrl.step3_ppo.trainer import Experience

    prompts = [x["chosen_input_ids"][:x["prompt_len"]][-a.prompt_len:] for x in items]
    answers = [x["chosen_input_ids"][x["prompt_len"]:][:a.answer_len] for x in items]
    P, A = max(len(p) for p in prompts), max(len(x) for x in answers)
    seq = torch.full((len(items), P + A), tok.pad_token_id)
    mask = torch.zeros_like(seq)
    for i, (p, x) in enumerate(zip(prompts, answers, strict=True)):
        seq[i, P - len(p):P], mask[i, P - len(p):P] = p, 1
        seq[i, P:P + len(x)], mask[i, P:P + len(x)] = x, 1
    action = mask[:, P:].clone()
    g = torch.Generator().manual_seed(len(items))
    return Experience(seq, mask, P, action, torch.zeros(action.shape), torch.randn(len(items), generator=g))


def bench_step3(a, packed: bool) -> dict:
    import copy
    from types import SimpleNamespace

    from chatrl.config import PackingConfig, PPOConfig
    from chatrl.data import phase_data
    from chatrl.models import load_causal_lm, load_tokenizer
    from chatrl.reward_model import load_reward_model
    from chatrl.rl.stats import PooledStats
    from chatrl.step3_ppo.trainer import Trainer

    tok = load_tokenizer(a.model_dir)
    data = phase_data(2, data_config([HB], "0,10,0", a), tok, 1234)
    per_buffer = 2 * a.batch  # two micro-batches: one optimizer step
    items = ordered(data.train, (a.warmup + a.steps) * per_buffer)
    buffers = [rollouts(a, tok, items[i:i + per_buffer]) for i in range(0, len(items), per_buffer)]
    actor = load_causal_lm(a.model_dir, tok)
    reference = copy.deepcopy(actor).eval().requires_grad_(False)
    critic = load_reward_model(a.model_dir, tok, require_head=False)
    settings = PPOConfig(per_device_training_batch_size=a.batch)
    trainer = Trainer(LocalEngine(actor, 2), reference, LocalEngine(critic, 2), None, None, SimpleNamespace(value=0.1),
                      settings, tok, gradient_accumulation_steps=2, answer_len=a.answer_len,
                      packing=PackingConfig(packing=packed))
    t_exp = t_train = 0.0
    for i, exp in enumerate(buffers):
        t0 = time.perf_counter()
        exp, _ = trainer.make_experience([exp], PooledStats())
        t1 = time.perf_counter()
        trainer.learn(exp, PooledStats())
        if i >= a.warmup:
            t_exp, t_train = t_exp + t1 - t0, t_train + time.perf_counter() - t1
    n = a.steps * per_buffer
    computed = sum(b.sequences.numel() for b in buffers[a.warmup:])
    real = sum(int(b.attention_mask.sum()) for b in buffers[a.warmup:])
    return {"samples_per_s": n / t_train, "experience_samples_per_s": n / t_exp,
            "positions": (real if packed else computed, real)}


def worker(a) -> None:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    packed = a.mode == "packed"
    if a.worker == "step1":
        out = bench_step1(a, packed)
    elif a.worker in ("step2", "dpo"):
        out = bench_pairs(a, packed, dpo=a.worker == "dpo")
    else:
        out = bench_step3(a, packed)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out), flush=True)


def measure(a, stage: str, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", stage, "--mode", mode, "--model_dir", a.model_dir, "--cache", a.cache,
           *[f"--{k}={getattr(a, k)}" for k in ("batch", "seq_len", "prompt_len", "answer_len", "steps", "warmup",
                                                 "threads")]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{stage} {mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="causal-LM folder (default: a tiny random OPT, h64, 2 layers)")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--batch", type=int, default=8, help="samples (pairs, rollouts) per micro-batch")
    p.add_argument("--seq_len", type=int, default=256, help="steps 1, 2, DPO: max tokens per sequence")
    p.add_argument("--prompt_len", type=int, default=128, help="step 3: max prompt tokens")
    p.add_argument("--answer_len", type=int, default=64, help="step 3: max answer tokens")
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per measurement")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: as each of 2 ranks on 2 cores)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    with tempfile.TemporaryDirectory() as work:
        a.cache = str(Path(work) / "cache")
        a.model_dir = a.model
        if a.model_dir is None:
            from chatrl.tiny import TinySpec, make_tiny_model

            a.model_dir = str(Path(work) / "opt")
            make_tiny_model("opt", a.model_dir, TinySpec(hidden=64, layers=2, heads=4, ffn=256))
        runs: dict = {s: {"padded": [], "packed": []} for s in a.stages}
        for r in range(a.repeats):
            for stage in a.stages:
                for mode in (("padded", "packed") if r % 2 == 0 else ("packed", "padded")):
                    runs[stage][mode].append(measure(a, stage, mode))
                    print(f"repeat {r + 1}/{a.repeats} {stage} {mode}: {runs[stage][mode][-1]}", file=sys.stderr,
                          flush=True)
    results = {}
    for stage, modes in runs.items():
        row = {}
        for mode, got in modes.items():
            computed, real = got[0]["positions"]
            row[mode] = {"samples_per_s": statistics.median(g["samples_per_s"] for g in got),
                         "samples_per_s_all": [round(g["samples_per_s"], 3) for g in got],
                         "peak_rss_mb": max(g["peak_rss_mb"] for g in got),
                         "positions_computed": computed, "padding_share": round(1 - real / computed, 4)}
            if "experience_samples_per_s" in got[0]:
                row[mode]["experience_samples_per_s"] = statistics.median(g["experience_samples_per_s"] for g in got)
        row["ratio_packed_vs_padded"] = row["packed"]["samples_per_s"] / row["padded"]["samples_per_s"]
        row["peak_rss_ratio"] = row["packed"]["peak_rss_mb"] / row["padded"]["peak_rss_mb"]
        if "experience_samples_per_s" in row["padded"]:
            row["experience_ratio"] = row["packed"]["experience_samples_per_s"] / row["padded"]["experience_samples_per_s"]
        results[stage] = row
    doc = {"bench": "packing", "model": a.model or "tiny-opt(h64,l2,gpt2-bpe)", "batch": a.batch, "seq_len": a.seq_len,
           "prompt_len": a.prompt_len, "answer_len": a.answer_len, "steps": a.steps, "warmup": a.warmup,
           "repeats": a.repeats, "threads": a.threads, "date": time.strftime("%Y-%m-%d"), "results": results}
    text = json.dumps(doc, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
