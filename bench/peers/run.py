"""Peer benchmark: TRL 1.12's SFT, reward, DPO and PPO trainers against chatrl's steps on one set-up.

    .venv/bin/python bench/peers/run.py                              # 3 interleaved repeats, all stages
    .venv/bin/python bench/peers/run.py --stages ppo --repeats 5     # step 3 only (e.g. after a speed-up)
    .venv/bin/python bench/peers/run.py --out bench/results/peers_$(date +%F).json
    .venv/bin/python bench/peers/run.py --packing                    # chatrl packed, and padded; TRL both ways
    .venv/bin/python bench/peers/run.py --stages grpo --grpo_kl off on   # GRPO on SmolLM2-135M-Instruct

The set-up, identical on both sides: a tiny random OPT (hidden 64, 2 layers, 4 heads, FFN 256; GPT-2
BPE with a separate pad token), hh-rlhf helpful-base pairs 0–999 for training and 1000–1199 for the
reward model's eval accuracy, sequences of 256 tokens (SFT, reward, DPO with β 0.1 and the policy's
initial copy as reference; TRL keeps the start of an over-long pair, chatrl cuts its prompt from the
left), prompts of 128 and answers of
64 tokens (PPO, temperature 0.7, one PPO epoch, one mini-batch), batch 4 per rank, 2 CPU ranks (gloo,
one thread each), fp32 (``--dtype bf16``: chatrl at ``--dtype bf16``, TRL's trainers with ``bf16=True``).
TRL runs under ``torchrun`` in its own venv (``setup_trl_venv.sh``, made or
reused first); chatrl runs its step programs under the DeepSpeed launcher, ZeRO-0 (like TRL's DDP).
Runs are interleaved (TRL, chatrl, TRL, chatrl, …) so that load on the machine hits both alike.
``--packing``: chatrl runs with ``--packing``, and each repeat also runs chatrl padded and, for SFT,
TRL with ``padding_free=True`` (each batch flattened into one row with restarting position ids; its
data set given already tokenized and cut, as TRL refuses ``max_length`` in that mode); TRL 1.12's DPO
switches its ``padding_free`` off ("temporarily unavailable"), so DPO is compared with TRL padded.

GRPO (``--stages grpo``) runs on a real chat model instead (``--grpo_model``, default the converted
SmolLM2-135M-Instruct of ``chatrl.models.model_zoo``): TRL's ``GRPOTrainer`` against ``chatrl.step3_ppo
--rl_algorithm grpo``, both on the same 2-digit additions ("What is 23 + 58? Answer with the number
only.", ``scripts/make_arith_task.py --ops +``, rendered by the model's chat template on both sides)
scored by chatrl's ``exact_match`` rule (TRL calls the same function), ``--grpo_prompts`` prompts ×
``--grpo_samples`` answers of at most ``--grpo_answer_len`` tokens per rank and step (one training
micro-batch of all of them, one epoch), temperature 1, AdamW at a constant learning rate
``--grpo_lr``, no weight decay, gradient clip 1, and the KL to the reference off (TRL's default, β
0; chatrl ``--init_kl_coef 0``) and/or on (β ``--grpo_beta`` as a loss term with GRPO's k3
estimator on both sides), per ``--grpo_kl``.

Measured per run: ``samples_per_s`` over the training loop from the end of its first step to the
end of its last (samples = steps × 4 × 2; PPO: rollouts), and ``wall_s`` from launch to exit
(start-up included), and ``peak_rss_mib``: the peak resident memory (``VmHWM``, polled every 0.5 s)
of every rank process (by ``LOCAL_RANK``) and of the largest process of the launch. Printed as JSON (and written to ``--out``): per stage both frameworks' figures,
their medians and the median of the per-repeat ratios chatrl / TRL (and over each other set-up of
the repeat), and the reward models' eval accuracies.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("CHATRL_SHARED", REPO.parent / "shared"))
HH = SHARED / "data" / "hh-rlhf" / "helpful-base" / "test.jsonl.gz"
ASSISTANT = "\n\nAssistant:"
BATCH, RANKS = 4, 2
STAGES = {"sft": "chatrl.step1_sft", "reward": "chatrl.step2_reward", "dpo": "chatrl.step2_dpo",
          "ppo": "chatrl.step3_ppo", "grpo": "chatrl.step3_ppo"}
#: The stages run and reported: GRPO once per KL setting of ``--grpo_kl``.
RUN_STAGES = ("sft", "reward", "dpo", "ppo", "grpo_kl_off", "grpo_kl_on")
#: Other set-ups a repeat may also run (``--also_chatrl_fp32``, ``--packing``), reported as chatrl's ratio over each.
EXTRA_RUNS = ("chatrl_fp32", "chatrl_padded", "trl_padding_free")


def prepare(work: Path, grpo_model: str | None = None) -> dict[str, Path]:
    """The tiny OPT, the reward-model initialisation (PPO's reward and value model) and the pairs; with
    ``grpo_model``, also its resolved folder and the GRPO prompt rows (``arith.jsonl``, 2-digit additions)."""
    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, save_reward_model
    from chatrl.models.tiny import TinySpec, make_tiny_model

    model, rm = work / "opt", work / "rm_init"
    make_tiny_model("opt", model, TinySpec(hidden=64, layers=2, heads=4, ffn=256))
    tok = load_tokenizer(str(model))
    assert tok.pad_token_id != tok.eos_token_id
    save_reward_model(load_reward_model(str(model), tok, require_head=False), tok, rm)
    with gzip.open(HH, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f][:1200]
    for name, part in (("train", rows[:1000]), ("eval", rows[1000:1200])):
        with open(work / f"pairs_{name}.jsonl", "w", encoding="utf-8") as f:
            for r in part:
                cut = r["chosen"].rfind(ASSISTANT) + len(ASSISTANT)
                prompt = r["chosen"][:cut]
                rejected = r["rejected"][cut:] if r["rejected"][:cut] == prompt else r["rejected"].rsplit(ASSISTANT, 1)[-1]
                f.write(json.dumps({"prompt": prompt, "chosen": r["chosen"][cut:], "rejected": rejected}) + "\n")
    out = {"model": model, "rm": rm}
    if grpo_model:
        from chatrl.models.model_zoo import resolve
        from scripts.make_arith_task import make_task

        train, _ = make_task(1000, 0, seed=0, max_operand=99, ops=("+",))
        (work / "arith.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
        out.update(grpo_model=Path(resolve(grpo_model)), arith=work / "arith.jsonl")
    return out


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
            "TRL_EXPERIMENTAL_SILENCE": "1", "WANDB_DISABLED": "true", "PYTHONPATH": str(REPO)}


def _tree_peaks(root: int, peaks: dict) -> None:
    """Update ``peaks`` with the ``VmHWM`` (MiB) of every live process under ``root``: key ``rankN`` for a
    process whose environment has ``LOCAL_RANK=N`` (a rank; the largest of several), ``pid`` otherwise."""
    parent = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                parent[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    for pid in parent:
        up, seen = pid, 0
        while up not in (root, 0, 1) and seen < 64:
            up, seen = parent.get(up, 0), seen + 1
        if up != root and pid != root:
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        hwm = next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmHWM:")), 0) / 1024
        rank = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"LOCAL_RANK=")), None)
        key = f"rank{rank}" if rank is not None else str(pid)
        peaks[key] = max(peaks.get(key, 0.0), hwm)


def _launch(cmd: list[str], log: Path, timeout: float) -> tuple[float, dict]:
    """Run ``cmd`` to its end; seconds from launch to exit and the peak resident memory in MiB per rank
    (``rankN``) and of the largest process of the launch (``max_any_process``)."""
    t0 = time.time()
    peaks: dict = {}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            _tree_peaks(proc.pid, peaks)
            if time.time() - t0 > timeout:
                proc.kill()
                raise TimeoutError(f"{cmd[:6]}… ran over {timeout} s; log: {log}")
            time.sleep(0.5)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:6]}… exited {proc.returncode}; log: {log}\n" + log.read_text()[-3000:])
    ranks = {k: round(v, 1) for k, v in sorted(peaks.items()) if k.startswith("rank")}
    return wall, {**ranks, "max_any_process": round(max(peaks.values(), default=0.0), 1)}


def run_trl(stage: str, a, paths: dict, work: Path, tag: str, padding_free: bool = False) -> dict:
    from chatrl.distributed.dist import free_port

    d = work / f"trl_{stage}_{tag}{'_padding_free' if padding_free else ''}"
    d.mkdir()
    if stage.startswith("grpo"):
        beta = a.grpo_beta if stage == "grpo_kl_on" else 0.0
        specific = ["grpo", "--model", str(paths["grpo_model"]), "--data", str(paths["arith"]),
                    "--steps", str(a.grpo_steps), "--batch", str(a.grpo_prompts * a.grpo_samples),
                    "--num_generations", str(a.grpo_samples), "--answer_len", str(a.grpo_answer_len),
                    "--learning_rate", str(a.grpo_lr), "--beta", str(beta)]
    else:
        steps = {"sft": a.sft_steps, "reward": a.reward_steps, "dpo": a.dpo_steps, "ppo": a.ppo_steps}[stage]
        specific = [stage, "--model", str(paths["model"]), "--reward_model", str(paths["rm"]), "--data", str(work),
                    "--steps", str(steps), "--batch", str(BATCH)]
    cmd = [str(Path(a.trl_venv) / "bin" / "python"), "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS),
           "--master_port", str(free_port()), str(HERE / "trl_stage.py"), *specific, "--out", str(d / "out"),
           "--result", str(d / "result.json"), "--dtype", a.dtype, *(["--padding_free"] if padding_free else [])]
    wall, peaks = _launch(cmd, d / "log", a.timeout)
    return {**json.loads((d / "result.json").read_text()), "wall_s": wall, "peak_rss_mib": peaks}


def run_chatrl(stage: str, a, paths: dict, work: Path, tag: str, dtype: str | None = None,
               packing: bool | None = None) -> dict:
    from chatrl.distributed.dist import free_port

    dtype = dtype or a.dtype
    packing = a.packing if packing is None else packing
    d = work / f"chatrl_{stage}_{tag}_{dtype}{'_packed' if packing else ''}"
    data = [f"{HH}[0:1000]"]
    common = ["--data_output_path", str(work / "chatrl_cache"), "--disable_progress_bar", "--seed", "1",
              "--output_dir", str(d / "out"), "--dtype", dtype, *(["--packing"] if packing else [])]
    if stage == "sft":
        flags = ["--model_name_or_path", str(paths["model"]), "--data_path", *data, "--data_split", "10,0,0",
                 "--max_seq_len", "256", "--per_device_train_batch_size", str(BATCH), "--learning_rate", "1e-3",
                 "--max_steps", str(a.sft_steps), "--eval_iters", "1", "--num_warmup_steps", "0"]
    elif stage == "reward":
        flags = ["--model_name_or_path", str(paths["model"]), "--data_path", *data, "--data_split", "0,10,0",
                 "--eval_data_path", f"{HH}[1000:1200]", "--max_seq_len", "256", "--per_device_train_batch_size",
                 str(BATCH), "--per_device_eval_batch_size", "8", "--learning_rate", "5e-4",
                 "--max_steps", str(a.reward_steps), "--num_warmup_steps", "0"]
    elif stage == "dpo":
        flags = ["--model_name_or_path", str(paths["model"]), "--data_path", *data, "--data_split", "0,10,0",
                 "--eval_data_path", f"{HH}[1000:1200]", "--max_seq_len", "256", "--per_device_train_batch_size",
                 str(BATCH), "--per_device_eval_batch_size", "8", "--learning_rate", "5e-6", "--beta", "0.1",
                 "--max_steps", str(a.dpo_steps), "--num_warmup_steps", "0"]
    elif stage.startswith("grpo"):
        per_rank = a.grpo_prompts * a.grpo_samples
        kl = (["--init_kl_coef", str(a.grpo_beta), "--kl_in", "loss", "--kl_loss_estimator", "k3"]
              if stage == "grpo_kl_on" else ["--init_kl_coef", "0"])
        data = [str(paths["arith"])]
        flags = ["--actor_model_name_or_path", str(paths["grpo_model"]), "--rl_algorithm", "grpo",
                 "--num_samples_per_prompt", str(a.grpo_samples), "--reward_fn", "exact_match",
                 "--data_path", *data, "--data_split", "0,0,10", "--max_prompt_seq_len", "128",
                 "--max_answer_seq_len", str(a.grpo_answer_len),
                 "--per_device_generation_batch_size", str(a.grpo_prompts),
                 "--per_device_training_batch_size", str(per_rank), "--max_steps", str(a.grpo_steps),
                 "--temperature", "1.0", "--actor_learning_rate", str(a.grpo_lr), "--lr_scheduler_type", "constant",
                 "--actor_weight_decay", "0", "--gradient_clipping", "1.0", "--num_warmup_steps", "0",
                 "--enable_hybrid_engine", *kl]
    else:
        flags = ["--actor_model_name_or_path", str(paths["model"]), "--critic_model_name_or_path", str(paths["rm"]),
                 "--data_path", *data, "--data_split", "0,0,10", "--max_prompt_seq_len", "128",
                 "--max_answer_seq_len", "64", "--per_device_generation_batch_size", str(BATCH),
                 "--per_device_training_batch_size", str(BATCH), "--max_steps", str(a.ppo_steps),
                 "--temperature", "0.7", "--actor_learning_rate", "3e-6", "--critic_learning_rate", "3e-6",
                 "--num_warmup_steps", "0", "--enable_hybrid_engine"]
    launcher = Path(sys.executable).with_name("deepspeed")
    zero = (["--actor_zero_stage", "0", "--critic_zero_stage", "0"] if stage == "ppo" else
            ["--actor_zero_stage", "0"] if stage.startswith("grpo") else ["--zero_stage", "0"])
    cmd = [str(launcher), "--num_gpus", str(RANKS), "--master_port", str(free_port()), "--module",
           STAGES[stage.split("_")[0]], *flags, *common, *zero]
    d.mkdir()
    wall, peaks = _launch(cmd, d / "log", a.timeout)
    rows = [json.loads(x) for x in (d / "out" / "logs" / "metrics.jsonl").read_text().splitlines()]
    key = "actor_loss" if stage in ("ppo", "grpo_kl_off", "grpo_kl_on") else "train/loss"
    train = [r for r in rows if key in r]
    per_step = a.grpo_prompts * a.grpo_samples * RANKS if stage.startswith("grpo") else BATCH * RANKS
    rate = (len(train) - 1) * per_step / (train[-1]["elapsed_s"] - train[0]["elapsed_s"])
    out = {"samples_per_s": rate, "steps": len(train), "wall_s": wall, "peak_rss_mib": peaks}
    if stage.startswith("grpo"):  # the step's phases, summed over the loop's steps after the first
        out["phase_s"] = {k: round(sum(r.get(f"time/{k}", 0.0) for r in train[1:]), 2)
                          for k in ("generate", "experience", "train")}
    if stage == "reward":
        last = [r for r in rows if "eval/accuracy" in r][-1]
        out.update(eval_accuracy=last["eval/accuracy"], eval_pairs=last.get("eval/pairs"))
    return out


def versions(a) -> dict:
    import deepspeed
    import torch
    import transformers

    trl = subprocess.run([str(Path(a.trl_venv) / "bin" / "python"), "-c",
                          "import trl,torch,transformers,accelerate;print(trl.__version__,torch.__version__,"
                          "transformers.__version__,accelerate.__version__)"],
                         capture_output=True, text=True, env=_env()).stdout.split()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    return {"chatrl": commit.strip(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "trl_venv": dict(zip(["trl", "torch", "transformers", "accelerate"], trl, strict=False))}


def _largest_rss(runs: list[dict]) -> dict:
    """Per key of the runs' ``peak_rss_mib`` (``rankN``, ``max_any_process``), the largest over the runs."""
    keys = sorted({k for r in runs for k in r.get("peak_rss_mib", {})})
    return {k: max(r.get("peak_rss_mib", {}).get(k, 0.0) for r in runs) for k in keys}


def cpu_flags() -> dict:
    """The CPU's model name and the vector flags that decide the dtypes' speed (``/proc/cpuinfo``)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = info.split("\n\n")[0]
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    flags = set(fields.get("flags\t\t", fields.get("flags", "")).split())
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return {"model": fields.get("model name\t", "").strip(), "flags": [f for f in wanted if f in flags]}


def summarise(runs: list[dict]) -> dict:
    out = {}
    for stage in RUN_STAGES:
        pairs = [(r["trl"], r["chatrl"]) for r in runs if r["stage"] == stage]
        if not pairs:
            continue
        trl, ours = [p[0]["samples_per_s"] for p in pairs], [p[1]["samples_per_s"] for p in pairs]
        out[stage] = {"trl_samples_per_s": trl, "chatrl_samples_per_s": ours,
                      "trl_median": statistics.median(trl), "chatrl_median": statistics.median(ours),
                      "median_ratio_chatrl_over_trl": statistics.median(o / t for t, o in zip(trl, ours, strict=True)),
                      "trl_wall_s": [p[0]["wall_s"] for p in pairs], "chatrl_wall_s": [p[1]["wall_s"] for p in pairs],
                      "median_wall_ratio_trl_over_chatrl": statistics.median(
                          p[0]["wall_s"] / p[1]["wall_s"] for p in pairs),
                      "trl_peak_rss_mib": _largest_rss([p[0] for p in pairs]),
                      "chatrl_peak_rss_mib": _largest_rss([p[1] for p in pairs])}
        for extra in EXTRA_RUNS:  # the same repeats' other set-ups: chatrl's ratio over each
            got = [(r[extra], r["chatrl"]) for r in runs if r["stage"] == stage and extra in r]
            if got:
                out[stage][f"{extra}_samples_per_s"] = [g[0]["samples_per_s"] for g in got]
                out[stage][f"{extra}_wall_s"] = [g[0]["wall_s"] for g in got]
                out[stage][f"median_ratio_chatrl_over_{extra}"] = statistics.median(
                    o["samples_per_s"] / e["samples_per_s"] for e, o in got)
        both = [r for r in runs if r["stage"] == stage and "trl_padding_free" in r]
        if both:  # TRL padded and padding-free in the same repeat: same data order, same seed
            out[stage]["trl_logged_losses"] = {"padded": both[0]["trl"].get("logged_losses"),
                                               "padding_free": both[0]["trl_padding_free"].get("logged_losses")}
        if stage == "reward":
            out[stage]["eval_accuracy"] = {"trl": [p[0].get("eval_accuracy") for p in pairs],
                                           "chatrl": [p[1].get("eval_accuracy") for p in pairs],
                                           "eval_pairs": {"trl": pairs[0][0].get("eval_pairs"),
                                                          "chatrl": pairs[0][1].get("eval_pairs")}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per framework and stage")
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    p.add_argument("--sft_steps", type=int, default=40, help="optimizer steps of SFT / step 1")
    p.add_argument("--reward_steps", type=int, default=125, help="optimizer steps of reward training (125: one epoch)")
    p.add_argument("--dpo_steps", type=int, default=20, help="optimizer steps of DPO / step 2 (DPO)")
    p.add_argument("--ppo_steps", type=int, default=10, help="PPO updates (experience buffers of 4 × 2 rollouts)")
    p.add_argument("--grpo_steps", type=int, default=4, help="GRPO steps (each: generation, scoring, one update)")
    p.add_argument("--grpo_model", default="smollm2-135m-instruct",
                   help="GRPO's policy: a model folder or a chatrl.models.model_zoo name (converted once if missing)")
    p.add_argument("--grpo_prompts", type=int, default=2, help="GRPO prompts per rank and step")
    p.add_argument("--grpo_samples", type=int, default=4, help="GRPO answers per prompt (the group)")
    p.add_argument("--grpo_answer_len", type=int, default=32, help="GRPO's longest answer, in tokens")
    p.add_argument("--grpo_lr", type=float, default=5e-6, help="GRPO's learning rate (constant, AdamW)")
    p.add_argument("--grpo_beta", type=float, default=0.04, help="GRPO's KL coefficient where the KL is on")
    p.add_argument("--grpo_kl", nargs="+", choices=["off", "on"], default=["off", "on"],
                   help="GRPO with the KL to the reference off (TRL's default) and/or on, on both sides")
    p.add_argument("--trl_venv", default=os.environ.get("TRL_VENV", "/tmp/trl_cpu/venv"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: chatrl at --dtype bf16, TRL's trainers with bf16=True (HF mixed precision)")
    p.add_argument("--also_chatrl_fp32", action="store_true",
                   help="with --dtype bf16: also run chatrl in fp32 in each repeat (chatrl's bf16/fp32 ratio)")
    p.add_argument("--packing", action="store_true",
                   help="chatrl with --packing; each repeat also runs chatrl padded and (SFT) TRL with padding_free=True")
    p.add_argument("--keep", help="keep the work folder (logs, outputs) here instead of a temporary one")
    a = p.parse_args()
    subprocess.run(["bash", str(HERE / "setup_trl_venv.sh")], check=True, env={**os.environ, "TRL_VENV": a.trl_venv},
                   stdout=sys.stderr)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(a.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        paths = prepare(work, a.grpo_model if "grpo" in a.stages else None)
        stages = [st for st in a.stages if st != "grpo"] + [f"grpo_kl_{k}" for k in a.grpo_kl if "grpo" in a.stages]
        runs = []
        for rep in range(a.repeats):
            for stage in stages:
                tag = f"r{rep}"
                trl = run_trl(stage, a, paths, work, tag)
                ours = run_chatrl(stage, a, paths, work, tag)
                runs.append({"stage": stage, "repeat": rep, "trl": trl, "chatrl": ours})
                if a.also_chatrl_fp32 and a.dtype != "fp32":
                    runs[-1]["chatrl_fp32"] = run_chatrl(stage, a, paths, work, tag, "fp32")
                if a.packing:  # TRL's own padding-free SFT, and chatrl padded, in the same repeat
                    if stage == "sft":
                        runs[-1]["trl_padding_free"] = run_trl(stage, a, paths, work, tag, padding_free=True)
                    runs[-1]["chatrl_padded"] = run_chatrl(stage, a, paths, work, tag, packing=False)
                print(f"[peers] {stage} repeat {rep}: TRL {trl['samples_per_s']:.2f} samples/s, "
                      f"chatrl {ours['samples_per_s']:.2f} samples/s", file=sys.stderr, flush=True)
                if a.out:  # what is measured so far survives an interrupted run
                    Path(a.out).write_text(json.dumps(report(a, started, load_before, runs, partial=True), indent=1))
    text = json.dumps(report(a, started, load_before, runs), indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


def report(a, started: str, load_before, runs: list[dict], partial: bool = False) -> dict:
    """The JSON document: versions, machine load, set-up, per-stage summary and every run."""
    return {"bench": "peers", "date": started, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "partial": partial, "versions": versions(a),
            "machine": {"cpus": os.cpu_count(), "cpu": cpu_flags(), "loadavg_before": load_before,
                        "loadavg_after": os.getloadavg()},
            "setup": {"model": "random OPT hidden 64, 2 layers, 4 heads, FFN 256, GPT-2 BPE + <pad>",
                      "data": "hh-rlhf helpful-base test pairs 0-999 train, 1000-1199 reward eval",
                      "ranks": RANKS, "batch_per_rank": BATCH, "seq_len": 256, "prompt_len": 128,
                      "answer_len": 64, "dtype": a.dtype, "chatrl_packing": a.packing, "chatrl_zero_stage": 0, "steps":
                      {"sft": a.sft_steps, "reward": a.reward_steps, "dpo": a.dpo_steps, "ppo": a.ppo_steps},
                      "samples_per_s": "training loop, end of step 1 to end of last step",
                      **({"grpo": {"model": str(a.grpo_model), "data": "2-digit additions (make_arith_task --ops +), "
                                   "chat template, exact_match reward", "prompts_per_rank": a.grpo_prompts,
                                   "samples_per_prompt": a.grpo_samples, "answer_len": a.grpo_answer_len,
                                   "lr": a.grpo_lr, "beta_when_kl_on": a.grpo_beta, "kl": a.grpo_kl,
                                   "steps": a.grpo_steps, "temperature": 1.0, "optimizer": "AdamW, constant lr, "
                                   "no weight decay, clip 1"}} if "grpo" in a.stages else {})},
            "stages": summarise(runs), "runs": runs}


if __name__ == "__main__":
    main()
