"""Benchmark padding-free training: samples/s and memory, packed rows against padded batches, on real
data, printed as JSON.

Each stage's training computation runs on the same samples both ways (chatrl's own collators,
forwards and losses, AdamW; one rank, no DeepSpeed: the model code, as ``bench/step2.py``). One
process per repeat holds both set-ups (the same initial weights) and alternates them step by step,
each optimizer step timed on its own, so that both see the same machine (this one is shared: its
load moves by the minute); the first ``--warmup`` steps are not counted. Memory: each set-up also
runs alone in its own process for ``--memory_steps`` steps, whose peak resident size
(``ru_maxrss``, and above what the set-up left resident) is reported; within the alternating
process each step's peak above what was resident before it is recorded too (``step_peak_mb``; the
allocator keeps memory freed by the other set-up's step, so it reads low for the second). The JSON
gives per mode the median over ``--repeats`` processes of samples/s, the median ratio packed /
padded, the memory figures and the share of computed positions that were padding.

* ``step1``: SFT on helpful-base + Alpaca (``--seq_len`` tokens), ``--batch`` examples per step;
* ``step2``: the reward model on helpful-base pairs, ``--batch`` pairs per step;
* ``dpo``: DPO (policy and a frozen reference copy) on helpful-base pairs;
* ``step3``: step 3's training phase (PPO: the actor's and the critic's micro-steps; the experience
  passes before it are timed apart) on rollouts made of helpful-base prompts (their last
  ``--prompt_len`` tokens) and the dataset's chosen answers cut to ``--answer_len`` tokens (answers
  of the lengths a chat model gives, ending with EOS when they fit), ``--batch`` rollouts per
  micro-batch, 2 micro-batches per optimizer step.

    .venv/bin/python bench/packing.py                                   # tiny OPT (h64, 2 layers), GPT-2 BPE
    .venv/bin/python bench/packing.py --hidden 512 --layers 8 --steps 6 6 3 3   # the larger OPT: body-dominated
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


def positions(batch: dict) -> tuple[int, int]:
    """(positions computed, real tokens) of a collated batch."""
    real = int(batch["packed"].length.sum()) if batch.get("packed") is not None else int(batch["attention_mask"].sum())
    return batch["input_ids"].numel(), real


def step1_runner(a, tok, items, packed: bool):
    """``(run(i), samples per step, positions)``: optimizer step ``i`` of step 1 (the program's loss)."""
    from chatrl.data import SFTCollator
    from chatrl.data.collate import MicroBatches, PackedSFTCollator
    from chatrl.logprobs import IGNORE_INDEX
    from chatrl.models.causal_lm import load_causal_lm
    from chatrl.step1_sft.loss import sft_nll

    collate = PackedSFTCollator(tok.pad_token_id) if packed else SFTCollator(tok.pad_token_id)
    steps = [MicroBatches(collate, a.batch, 0, "cpu")(items[i:i + a.batch]) for i in range(0, len(items), a.batch)]
    engine = LocalEngine(load_causal_lm(a.model_dir, tok).train(), 1)

    def run(i):
        micro = steps[i]
        n = sum(int((m["labels"][:, 1:] != IGNORE_INDEX).sum()) for m in micro)
        for m in micro:
            nll, _ = sft_nll(engine, m["input_ids"], m["attention_mask"], m["labels"], packed=m.get("packed"))
            engine.backward(nll / n)
            engine.step()

    return run, a.batch, [positions(m) for micro in steps for m in micro]


def pairs_runner(a, tok, items, packed: bool, dpo: bool):
    """As :func:`step1_runner` for step 2 (``dpo`` False) or DPO: ``--batch`` pairs per step."""
    import copy

    import torch

    from chatrl.data import PairCollator
    from chatrl.data.collate import MicroBatches, PackedPairCollator
    from chatrl.models.causal_lm import load_causal_lm
    from chatrl.models.reward_model import load_reward_model, pairwise_losses
    from chatrl.step2_dpo.batch import DPOCollator, PackedDPOCollator, batch_answer_logps, split_pairs
    from chatrl.step2_dpo.loss import DPOConfig, preference_loss
    from chatrl.step2_dpo.reference import batch_logps

    if dpo:
        collate = PackedDPOCollator(tok.pad_token_id) if packed else DPOCollator(tok.pad_token_id)
        policy = load_causal_lm(a.model_dir, tok)
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
        engine, settings = LocalEngine(policy.train(), 1), DPOConfig()
    else:
        collate = PackedPairCollator(tok.pad_token_id) if packed else PairCollator(tok.pad_token_id)
        torch.manual_seed(0)  # the same fresh head in both set-ups
        engine = LocalEngine(load_reward_model(a.model_dir, tok, require_head=False).train(), 1)
    steps = [MicroBatches(collate, a.batch, 0, "cpu")(items[i:i + a.batch]) for i in range(0, len(items), a.batch)]

    def run(i):
        for m in steps[i]:
            if dpo:
                ref = split_pairs(batch_logps(reference, m, "cpu")[0])
                logps, n = batch_answer_logps(engine, m, "cpu")
                losses, _, _ = preference_loss(settings, *split_pairs(logps), *ref, *split_pairs(n))
            else:
                _, scores = engine(m["input_ids"], m["attention_mask"], packed=m.get("packed"))
                losses = pairwise_losses(*split_pairs(scores))
            engine.backward(losses.sum() / a.batch)
            engine.step()

    return run, a.batch, [positions(m) for micro in steps for m in micro]


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


def step3_runner(a, tok, items, packed: bool):
    """As :func:`step1_runner` for step 3: ``run(i)`` makes buffer ``i``'s experience (timed apart, in
    ``run.experience_s``) and learns from it (PPO, actor and critic)."""
    import copy
    import time
    from types import SimpleNamespace

    import torch

    from chatrl.config import PackingConfig, PPOConfig
    from chatrl.models.causal_lm import load_causal_lm
    from chatrl.models.reward_model import load_reward_model
    from chatrl.rl.stats import PooledStats
    from chatrl.step3_ppo.engine import RLHFEngines
    from chatrl.step3_ppo.trainer import OptimizerStep, Trainer

    per_buffer = 2 * a.batch  # two micro-batches: one optimizer step
    buffers = [rollouts(a, tok, items[i:i + per_buffer]) for i in range(0, len(items), per_buffer)]
    actor = load_causal_lm(a.model_dir, tok)
    reference = copy.deepcopy(actor).eval().requires_grad_(False)
    torch.manual_seed(0)
    critic = load_reward_model(a.model_dir, tok, require_head=False)
    trainer = Trainer(RLHFEngines(LocalEngine(actor, 2), reference, LocalEngine(critic, 2)), None, None,
                      SimpleNamespace(value=0.1), PPOConfig(per_device_training_batch_size=a.batch), tok,
                      step=OptimizerStep(2, answer_len=a.answer_len), packing=PackingConfig(packing=packed))

    def run(i):
        t0 = time.perf_counter()
        exp, _ = trainer.make_experience([buffers[i]], PooledStats())
        run.experience_s.append(time.perf_counter() - t0)
        trainer.learn(exp, PooledStats())

    run.experience_s = []
    return run, per_buffer, [(b.sequences.numel() if not packed else int(b.attention_mask.sum()),
                              int(b.attention_mask.sum())) for b in buffers]


def memory_mb(field: str) -> float:
    """``VmHWM`` / ``VmRSS`` of this process in MiB (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) / 1024 for x in f if x.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0.0


def reset_peak() -> None:
    """Start a new peak resident size (Linux ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def worker(a) -> None:
    """One repeat of one stage: both set-ups, alternating step by step; prints one RESULT line."""
    import torch
    import transformers

    from chatrl.data import build_phase_data
    from chatrl.models.causal_lm import load_tokenizer

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(a.model_dir)
    n_steps = a.warmup + a.steps
    modes = (a.only,) if a.only else ("padded", "packed")
    if a.worker == "step1":
        data = build_phase_data(1, data_config([HB, ALPACA], "10,0,0", a), tok, seed=1234)
        items = ordered(data.train, n_steps * a.batch)
        runners = {m: step1_runner(a, tok, items, m == "packed") for m in modes}
    elif a.worker == "step3":
        data = build_phase_data(2, data_config([HB], "0,10,0", a), tok, seed=1234)
        items = ordered(data.train, n_steps * 2 * a.batch)
        runners = {m: step3_runner(a, tok, items, m == "packed") for m in modes}
    else:
        from chatrl.step2_dpo.batch import IndexedPairs

        data = build_phase_data(2, data_config([HB], "0,10,0", a), tok, seed=1234)
        items = ordered(IndexedPairs(data.train), n_steps * a.batch)
        runners = {m: pairs_runner(a, tok, items, m == "packed", a.worker == "dpo") for m in modes}
    if a.only:  # memory alone: this set-up's own process, its peak above what the set-up left resident
        setup = memory_mb("VmRSS")
        for i in range(n_steps):
            runners[a.only][0](i)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print("RESULT " + json.dumps({"process_peak_mb": peak, "setup_mb": setup, "training_peak_mb": peak - setup}),
              flush=True)
        return
    seconds = {m: 0.0 for m in runners}
    peak = {m: 0.0 for m in runners}
    for i in range(n_steps):
        for mode in (("padded", "packed") if i % 2 == 0 else ("packed", "padded")):
            run = runners[mode][0]
            reset_peak()
            before = memory_mb("VmRSS")
            t0 = time.perf_counter()
            run(i)
            if i >= a.warmup:
                seconds[mode] += time.perf_counter() - t0
                peak[mode] = max(peak[mode], memory_mb("VmHWM") - before)
    out = {}
    for mode, (run, per_step, pos) in runners.items():
        computed, real = (sum(p[k] for p in pos) for k in (0, 1))
        out[mode] = {"samples_per_s": a.steps * per_step / seconds[mode], "step_peak_mb": peak[mode],
                     "positions": [computed, real]}
        if hasattr(run, "experience_s"):
            out[mode]["experience_samples_per_s"] = a.steps * per_step / sum(run.experience_s[a.warmup:])
            out[mode]["train_samples_per_s"] = a.steps * per_step / (seconds[mode] - sum(run.experience_s[a.warmup:]))
    out["process_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out), flush=True)


def measure(a, stage: str, only: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", stage, "--model_dir", a.model_dir, "--cache", a.cache,
           *[f"--{k}={getattr(a, k)}" for k in ("batch", "seq_len", "prompt_len", "answer_len", "warmup", "threads")],
           f"--worker_steps={a.memory_steps if only else a.stage_steps[stage]}", *(["--only", only] if only else [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{stage} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default=None, help="causal-LM folder (default: a random OPT of --hidden, --layers)")
    p.add_argument("--hidden", type=int, default=64, help="the random OPT's hidden size (max(4, hidden / 64) heads; FFN 4 × hidden)")
    p.add_argument("--layers", type=int, default=2, help="the random OPT's layers")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--batch", type=int, default=8, help="samples (pairs, rollouts) per micro-batch")
    p.add_argument("--seq_len", type=int, default=256, help="steps 1, 2, DPO: max tokens per sequence")
    p.add_argument("--prompt_len", type=int, default=128, help="step 3: max prompt tokens")
    p.add_argument("--answer_len", type=int, default=64, help="step 3: max answer tokens")
    p.add_argument("--steps", nargs=4, type=int, default=[16, 24, 3, 6], metavar=("STEP1", "STEP2", "DPO", "STEP3"),
                   help="timed optimizer steps per repeat of each stage")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="speed repeats (0: memory alone)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: as each of 2 ranks on 2 cores)")
    p.add_argument("--memory_steps", type=int, default=2, help="steps of each set-up run alone for its peak memory")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--only", default=None, choices=("padded", "packed"), help=argparse.SUPPRESS)
    p.add_argument("--worker_steps", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        a.steps = a.worker_steps
        return worker(a)
    a.stage_steps = dict(zip(STAGES, a.steps, strict=True))
    with tempfile.TemporaryDirectory() as work:
        a.cache = str(Path(work) / "cache")
        a.model_dir = a.model
        if a.model_dir is None:
            from chatrl.models.tiny import TinySpec, make_tiny_model

            a.model_dir = str(Path(work) / "opt")
            make_tiny_model("opt", a.model_dir, TinySpec(hidden=a.hidden, layers=a.layers, heads=max(4, a.hidden // 64),
                                                         ffn=4 * a.hidden))
        runs: dict = {s: [] for s in a.stages}
        for r in range(a.repeats):
            for stage in a.stages:
                runs[stage].append(measure(a, stage))
                print(f"repeat {r + 1}/{a.repeats} {stage}: {runs[stage][-1]}", file=sys.stderr, flush=True)
        memory = {s: {m: measure(a, s, only=m) for m in ("padded", "packed")} for s in a.stages}
        print(f"memory: {memory}", file=sys.stderr, flush=True)
    results = {}
    for stage, got in runs.items():
        row = {}
        if not got:  # --repeats 0: memory alone
            for mode in ("padded", "packed"):
                row[mode] = {"alone_process_peak_mb": memory[stage][mode]["process_peak_mb"],
                             "alone_training_peak_mb": memory[stage][mode]["training_peak_mb"]}
            row["alone_process_peak_ratio"] = row["packed"]["alone_process_peak_mb"] / row["padded"]["alone_process_peak_mb"]
            results[stage] = row
            continue
        for mode in ("padded", "packed"):
            computed, real = got[0][mode]["positions"]
            row[mode] = {"samples_per_s": statistics.median(g[mode]["samples_per_s"] for g in got),
                         "samples_per_s_all": [round(g[mode]["samples_per_s"], 3) for g in got],
                         "step_peak_mb": statistics.median(g[mode]["step_peak_mb"] for g in got),
                         "positions_computed": computed, "padding_share": round(1 - real / computed, 4)}
            for k in ("experience_samples_per_s", "train_samples_per_s"):
                if k in got[0][mode]:
                    row[mode][k] = statistics.median(g[mode][k] for g in got)
        ratios = [g["packed"]["samples_per_s"] / g["padded"]["samples_per_s"] for g in got]
        row["ratio_packed_vs_padded"] = statistics.median(ratios)
        row["ratios_all"] = [round(x, 3) for x in ratios]
        row["step_peak_ratio"] = row["packed"]["step_peak_mb"] / max(row["padded"]["step_peak_mb"], 1e-9)
        for k, name in (("train_samples_per_s", "train_ratio"), ("experience_samples_per_s", "experience_ratio")):
            if k in row["padded"]:
                row[name] = statistics.median(g["packed"][k] / g["padded"][k] for g in got)
        row["process_peak_mb"] = max(g["process_peak_mb"] for g in got)
        for mode in ("padded", "packed"):  # each set-up alone in its own process
            row[mode]["alone_process_peak_mb"] = memory[stage][mode]["process_peak_mb"]
            row[mode]["alone_training_peak_mb"] = memory[stage][mode]["training_peak_mb"]
        row["alone_process_peak_ratio"] = (memory[stage]["packed"]["process_peak_mb"]
                                           / memory[stage]["padded"]["process_peak_mb"])
        results[stage] = row
    doc = {"bench": "packing", "model": a.model or f"random-opt(h{a.hidden},l{a.layers},gpt2-bpe)", "batch": a.batch, "seq_len": a.seq_len,
           "prompt_len": a.prompt_len, "answer_len": a.answer_len, "steps": a.stage_steps, "warmup": a.warmup,
           "repeats": a.repeats, "threads": a.threads, "date": time.strftime("%Y-%m-%d"),
           "load_avg_1min_at_end": os.getloadavg()[0], "results": results}
    text = json.dumps(doc, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
