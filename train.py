#!/usr/bin/env python
"""Run the RLHF pipeline (step 1 SFT → step 2 reward model → step 3 PPO) with one command.

    python train.py --actor-model facebook/opt-13b --reward-model facebook/opt-350m --deployment-type single_node
    python train.py --actor-model opt-1.3b --reward-model opt-350m --deployment-type single_gpu --step 2 3
    python train.py --preset demo          # offline demo on this machine: real data, tiny models, 2 CPU ranks

Each step runs as its own program through the DeepSpeed launcher (a hostfile for multi-node); the
steps hand off only through HF folders under ``--output-dir``:

    OUTPUT/step1_actor/          step 1's actor (also step 3's reference)
    OUTPUT/step2_reward/         step 2's reward model (also step 3's critic initialisation)
    OUTPUT/step3_rlhf/actor/     the chat model; critic/ and (--enable_ema) actor_ema/ beside it
    OUTPUT/logs/stepN.log        each step's full log
    OUTPUT/report.html           the run report (curves, samples, alerts), refreshed after each step

A step whose output already holds a finished run is skipped (``--overwrite`` redoes it); an
unfinished one (a crash, a killed job) resumes from its newest checkpoint when the same command is
run again. Steps write checkpoints every ``--save_interval`` steps (the presets set it). Per-step
flags pass through with ``--step1-args "…"`` (and ``--step2-args``, ``--step3-args``); they come
last, so they override the presets.

``--step2-method dpo`` replaces steps 2 and 3 by direct preference optimisation of the step-1 actor
(``OUTPUT/step2_dpo/``, the chat model; ``--step2-args`` pass through to it) and stops there.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from chatrl import config, multinode
from chatrl.checkpoint import RUN_MARKER, list_checkpoints
from chatrl.cli import normalize_argv
from chatrl.config import setting, to_argv, uses
from chatrl.dist import free_port
from chatrl.precision import DTYPE_CHOICES, resolve_dtype
from chatrl.report import report_note
from chatrl.rl import algorithms
from chatrl.step1_sft.main import build_parser as step1_parser
from chatrl.step2_dpo.main import build_parser as dpo_parser
from chatrl.step2_reward.main import build_parser as step2_parser
from chatrl.step3_ppo.main import build_parser as step3_parser
from chatrl.tracking import METRICS_FILE, read_metrics

REPO = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("CHATRL_SHARED", REPO.parent / "shared"))

SHORT_NAMES = {
    **{f"opt-{s}": f"facebook/opt-{s}" for s in ("125m", "350m", "1.3b", "2.7b", "6.7b", "13b", "30b", "66b")},
    "llama2-7b": "meta-llama/Llama-2-7b-hf", "llama2-13b": "meta-llama/Llama-2-13b-hf",
    "llama2-70b": "meta-llama/Llama-2-70b-hf", "qwen2-0.5b": "Qwen/Qwen2-0.5B", "qwen2-1.5b": "Qwen/Qwen2-1.5B",
    "qwen2-7b": "Qwen/Qwen2-7B",
}
DEFAULT_DATA = ["Dahoas/rm-static", "Dahoas/full-hh-rlhf", "Dahoas/synthetic-instruct-gptj-pairwise",
                "yitingxie/rlhf-reward-datasets"]
STEP_MODULES = {1: "chatrl.step1_sft", 2: "chatrl.step2_reward", 3: "chatrl.step3_ppo"}
STEP_NAMES = {1: "supervised fine-tuning", 2: "reward model", 3: "RLHF"}


def resolve_model(name: str) -> str:
    """A local folder stays as it is; a short name (``opt-1.3b``) maps to its hub name; others pass through."""
    if Path(name).is_dir():
        return str(Path(name).resolve())
    return SHORT_NAMES.get(name.lower(), name)


def size_in_billions(name: str) -> float:
    """Parameter count read from a name such as ``facebook/opt-1.3b`` or ``Llama-2-7b`` (1.0 when unknown)."""
    m = re.search(r"(\d+(?:\.\d+)?)\s*([bm])\b", name.lower().replace("-hf", ""))
    if not m:
        return 1.0
    return float(m.group(1)) / (1000.0 if m.group(2) == "m" else 1.0)


Presets = dict[int, dict]
"""Per step, ``{flag name: value}`` (``True`` a bare switch, ``False``/``None`` omitted, a list its items):
presets stay data until :func:`command_flags` writes them as a command line."""


def step_parsers() -> dict[int, argparse.ArgumentParser]:
    """Each step's own parser: presets are written as its flag names and checked against it."""
    return {1: step1_parser(), 2: step2_parser(), 3: step3_parser(), "dpo": dpo_parser()}


def command_flags(values: dict, parser: argparse.ArgumentParser) -> list[str]:
    """A step's ``{flag name: value}`` as command-line flags, each name checked against its parser
    (:func:`chatrl.config.to_argv`)."""
    return to_argv(parser, values)


def size_preset(actor_b: float, reward_b: float, deployment: str, actor_zero: int | None,
                reward_zero: int | None, dtype: str = "auto") -> Presets:
    """Batch sizes, ZeRO stages, LoRA and offload for the model sizes and deployment.

    The figures follow DeepSpeed-Chat's published training scripts: ZeRO-3 and LoRA for large
    actors, gradient checkpointing above ~1B parameters, CPU offload of optimizer states and the
    reference model for actors that do not fit (e.g. 13B on one GPU, 66B+ on one node). ``dtype``
    (``--dtype``) is every step's: ``auto`` is bf16 where the device runs it natively, else fp32.
    """
    gpus = {"single_gpu": 1, "single_node": 8, "multi_node": 64, "cpu": 2}[deployment]
    big = actor_b >= 6
    az = actor_zero if actor_zero is not None else (3 if (actor_b >= 1.3 or gpus > 1) else 0)
    rz = reward_zero if reward_zero is not None else (3 if reward_b >= 6 or (gpus > 1 and reward_b >= 1.3) else 0)
    offload = (deployment == "single_gpu" and actor_b >= 6) or (deployment == "single_node" and actor_b >= 30)
    mb = 1 if actor_b >= 30 else 2 if big else 4 if actor_b >= 1 else 8
    lora = actor_b >= 1.3
    step1 = {"zero_stage": az, "dtype": dtype, "per_device_train_batch_size": mb, "per_device_eval_batch_size": mb,
             "learning_rate": "9.65e-6" if actor_b >= 1 else "1e-4", "num_train_epochs": 1 if big else 2,
             "save_interval": 200, "lora_dim": 128 if lora else None, "lora_module_name": "layers." if lora else None,
             "gradient_checkpointing": lora, "offload": offload}
    step2 = {"zero_stage": rz, "dtype": dtype, "per_device_train_batch_size": 4 if reward_b >= 1 else 8,
             "learning_rate": "5e-6" if reward_b >= 1 else "5e-5", "num_train_epochs": 1, "save_interval": 200,
             "gradient_checkpointing": reward_b >= 1.3}
    step3 = {"actor_zero_stage": az, "critic_zero_stage": rz, "dtype": dtype,
             "per_device_generation_batch_size": mb, "per_device_training_batch_size": mb,
             "enable_hybrid_engine": True, "max_prompt_seq_len": 256, "max_answer_seq_len": 256, "save_interval": 50,
             "actor_lora_dim": 128 if lora else None, "actor_lora_module_name": "layers." if lora else None,
             "actor_gradient_checkpointing": lora, "offload_reference_model": offload, "offload": offload}
    if gpus >= 8 and big:
        step3.update(inference_tp_size=2 if actor_b < 30 else 4, tp_gather_partition_size=4)
    return {1: step1, 2: step2, 3: step3}


def demo_plan(output: Path) -> tuple[str, str, Presets]:
    """The offline demo: stories260K (a real pretrained tiny Llama) as actor and reward backbone, real
    hh-rlhf + Alpaca data from ../shared, 2 CPU ranks, actor under ZeRO-3 with the hybrid engine."""
    data = [str(SHARED / "data" / "hh-rlhf" / "helpful-base"), str(SHARED / "data" / "hh-rlhf" / "harmless-base")]
    model = str(SHARED / "models" / "stories260K")
    common = {"data_path": data, "data_split": "2,4,4", "data_output_path": output / "data_cache"}
    step1 = {**common, "data_path": [*data, str(SHARED / "data" / "alpaca-instructions")], "zero_stage": 3,
             "max_seq_len": 256, "per_device_train_batch_size": 16, "learning_rate": "2e-3", "num_warmup_steps": 10,
             "num_train_epochs": 2, "eval_interval": 50, "eval_eos_samples": 32, "save_interval": 25}
    step2 = {**common, "zero_stage": 3, "max_seq_len": 256, "per_device_train_batch_size": 8,
             "learning_rate": "2e-3", "num_warmup_steps": 10, "num_train_epochs": 1, "eval_interval": 50,
             "save_interval": 25}
    step3 = {**common, "actor_zero_stage": 3, "critic_zero_stage": 3, "enable_hybrid_engine": True,
             "max_prompt_seq_len": 128, "max_answer_seq_len": 48, "per_device_generation_batch_size": 16,
             "per_device_training_batch_size": 16, "actor_learning_rate": "3e-4", "critic_learning_rate": "1e-3",
             "num_warmup_steps": 5, "max_steps": 40, "init_kl_coef": 0.1, "print_answers": True,
             "print_answers_interval": 10, "save_interval": 10}
    return model, model, {1: step1, 2: step2, 3: step3}


@dataclass
class PipelineConfig:
    """train.py: which models and steps, where, and how launched."""

    preset: str | None = setting(None, "demo: the offline end-to-end run on this machine (2 CPU ranks)",
                                 choices=("demo",), type=str)
    actor_model: str | None = setting(None, "hub name, short name (opt-1.3b, opt-13b, llama2-7b) or local folder",
                                      type=str)
    reward_model: str | None = setting(None, "as --actor-model; the reward model's and critic's backbone", type=str)
    deployment_type: str = setting("single_gpu", "where it runs; sizes the presets",
                                   choices=("single_gpu", "single_node", "multi_node", "cpu"))
    step: list = setting([1, 2, 3], "steps to run, in order", nargs="+", choices=(1, 2, 3), type=int)
    output_dir: str = setting(str(REPO / "output"), "where every step writes")
    data_path: list | None = setting(None, "data sets for all steps (default: DeepSpeed-Chat's four)", nargs="+",
                                     type=str)
    actor_zero_stage: int | None = setting(None, "ZeRO stage of steps 1 and 3's actor (default: by size)",
                                           choices=(0, 1, 2, 3), type=int)
    reward_zero_stage: int | None = setting(None, "ZeRO stage of step 2 and step 3's critic (default: by size)",
                                            choices=(0, 1, 2, 3), type=int)
    num_gpus: int | None = setting(None, "GPUs per node (default: all the launcher sees)", type=int)
    hostfile: str = setting("/job/hostfile", "DeepSpeed hostfile for --deployment-type multi_node")
    master_port: int | None = setting(None, "launcher port (default: a free one on single-node runs, 29500 across "
                                            "nodes)", type=int)
    node_rank: int | None = setting(None, "multi_node without ssh: start only this node of the hostfile (run train.py "
                                          "on every node, each with its own --node-rank; docs/multi_node.md). "
                                          "Default: ssh/pdsh from this host", type=int)
    master_addr: str | None = setting(None, "multi_node: address of the node running global rank 0 (default: the "
                                            "hostfile's first host)", type=str)
    overwrite: bool = setting(False, "redo steps whose output already holds a finished run")
    dtype: str = setting("auto", "every step's --dtype; auto: bf16 where the device computes it natively (a CUDA "
                                 "device with bf16, a CPU with AVX512-BF16 or AMX), else fp32 (docs/precision.md)",
                         choices=DTYPE_CHOICES)
    step1_args: str = setting("", "extra flags for step 1, as one quoted string")
    step2_args: str = setting("", "extra flags for step 2, as one quoted string")
    step3_args: str = setting("", "extra flags for step 3, as one quoted string")
    step2_method: str = setting("reward", "reward: step 2 trains a reward model for step 3's PPO; dpo: step 2 is "
                                          "direct preference optimisation of the step-1 actor (python -m "
                                          "chatrl.step2_dpo), and no step 3 runs", choices=("reward", "dpo"))


@dataclass
class PipelineSettings:
    """train.py's blocks: its own, and the step-3 settings it plans with (read through their blocks)."""

    pipeline: PipelineConfig = uses(PipelineConfig)
    rl: config.PPOConfig = uses(config.PPOConfig, only=("rl_algorithm", "num_samples_per_prompt"))
    reward: config.RewardConfig = uses(config.RewardConfig, only=("reward_fn", "reward_url"))


# DPO's settings on train.py's path (beside step 1's actor set-up and a tenth of its learning rate):
# DeepSpeed-Chat's β and one epoch, and RPO's SFT term on the chosen answers, which keeps the answers
# ending with EOS as step 1 taught (docs/dpo.md, "EOS after DPO").
DPO_DEFAULTS = {"num_train_epochs": 1, "beta": 0.1, "rpo_alpha": 1.0, "eval_eos_samples": 32}


def dpo_plan(out: Path, presets: Presets, dirs: dict, models: Presets, steps: list[int]) -> list[int]:
    """Re-plan step 2 as DPO of the step-1 actor (``chatrl.step2_dpo`` into ``OUTPUT/step2_dpo``), in place;
    returns the steps to run (step 3 dropped: the DPO model is the chat model). The DPO step uses
    step 1's actor settings (ZeRO stage, LoRA, batch sizes) on step 2's preference data, with
    :data:`DPO_DEFAULTS` and a learning rate a tenth of step 1's (names checked against the DPO
    parser when the command line is written)."""
    if 3 in steps:
        print("train.py: --step2-method dpo stops after step 2 (the DPO model is the chat model); step 3 is skipped",
              flush=True)
    step1 = presets[1]
    lr = float(step1["learning_rate"]) / 10 if step1.get("learning_rate") is not None else 5e-6
    presets[2] = {**step1, **{k: v for k, v in presets[2].items() if k in ("data_path", "data_split")},
                  "learning_rate": f"{lr:g}", **DPO_DEFAULTS}
    dirs[2] = out / "step2_dpo"
    models[2] = {"model_name_or_path": str(dirs[1])}
    return [s for s in steps if s != 3]


def plan_pipeline(s: PipelineSettings) -> tuple[list[int], dict, str | None]:
    """The steps to run, step 3's algorithm and reward flags (``{flag name: value}``), and why step 2
    is skipped (or ``None``).

    Step 2 (the reward model) is skipped when the reward comes from ``--reward-fn``/``--reward-url``
    alone: a critic-free algorithm needs no other model, and PPO's critic then starts from the
    step-1 actor with a fresh value head.
    """
    rules = [*s.reward.reward_fn, *s.reward.reward_url]
    flags = {"rl_algorithm": s.rl.rl_algorithm, "num_samples_per_prompt": s.rl.num_samples_per_prompt,
             "reward_fn": s.reward.reward_fn, "reward_url": s.reward.reward_url}
    steps = sorted(set(s.pipeline.step))
    if not rules:
        return steps, flags, None
    algorithm = algorithms.get(s.rl.rl_algorithm)
    critic = "; the critic starts from step 1's actor with a fresh value head" if algorithm.needs_critic else ""
    return ([x for x in steps if x != 2], flags,
            f"step 2 (reward model) skipped: the reward of {algorithm.name} comes from {' '.join(rules)}{critic}")


def build_parser() -> argparse.ArgumentParser:
    """train.py's flags (:class:`PipelineSettings`)."""
    p = config.program_parser(PipelineSettings, __doc__, prog="train.py")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    return p


def launcher(deployment: str, num_gpus: int | None, hostfile: str, master_port: int | None,
             node_rank: int | None = None, master_addr: str | None = None) -> tuple[list, dict]:
    """The DeepSpeed launcher command and environment for a deployment (multi_node: see chatrl.multinode)."""
    cmd = [str(Path(sys.executable).with_name("deepspeed"))]
    if not Path(cmd[0]).exists():
        cmd = ["deepspeed"]
    env = {}
    if deployment == "cpu":
        cmd += ["--num_gpus", str(num_gpus or 2)]
        env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    elif deployment == "single_gpu":
        cmd += ["--num_gpus", "1"]
    elif deployment == "single_node" and num_gpus:
        cmd += ["--num_gpus", str(num_gpus)]
    elif deployment == "multi_node":
        if not Path(hostfile).exists():
            raise SystemExit(f"--deployment-type multi_node needs a DeepSpeed hostfile; {hostfile} does not exist "
                             "(pass --hostfile PATH with one 'host slots=N' line per node)")
        cmd += multinode.launcher_flags(hostfile, node_rank, master_addr)
    if master_port is None and deployment != "multi_node":
        master_port = free_port()  # two jobs on one machine must not collide on the launcher's 29500
    if master_port:
        cmd += ["--master_port", str(master_port)]
    return cmd, env


def run_step(step: int, cmd: list[str], env: dict, log_path: Path, step_dir: Path,
             nodes: tuple[dict[str, int], int | None] | None = None, name: str | None = None) -> float:
    """Run one step, streaming its output to the terminal and ``log_path`` (appended: a resumed step
    keeps the log of its earlier attempts); returns seconds taken.

    Raises:
        SystemExit: the step failed; the message names the step, the ranks that failed and how,
            the last checkpoint to resume from, and the log (the step's own output was shown above).
            With ``nodes`` (hostfile hosts → slots, this node's rank) it also names this node and
            the node a lost connection points to.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    failures: list[str] = []
    with open(log_path, "a", encoding="utf-8", buffering=1) as log:  # line-buffered: a killed job keeps its log
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')}\n$ " + shlex.join(cmd) + "\n")
        proc = subprocess.Popen(cmd, env={**os.environ, **env}, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        tty, drawn = sys.stdout.isatty(), False
        for line in proc.stdout:
            log.write(line)
            failures += _failure_lines(line)
            if _PROGRESS.search(line):  # a tqdm update: redraw in place on a terminal, else leave it to the log
                if tty:
                    print(f"\r  [step {step}] {line.strip()[:150]}", end="", flush=True)
                    drawn = True
            elif _worth_showing(line):
                print(("\n" if drawn else "") + f"  [step {step}] {line.rstrip()}", flush=True)
                drawn = False
        code = proc.wait()
    if code != 0:
        ckpts = list_checkpoints(step_dir)
        reached = _last_logged_step(step_dir)
        if nodes is not None:
            hosts, this = nodes
            if this is not None:
                host = list(hosts)[this]
                failures.insert(0, f"this is node {this} ({host}, global ranks "
                                   f"{multinode.global_ranks(hosts)[host]}) of {len(hosts)}")
            peer = multinode.lost_peer(failures, hosts, this)
            if peer:
                failures.append(peer)
        if reached is not None:
            failures.append(f"the last optimizer step logged was {reached}")
        resume = (f"the newest checkpoint is {ckpts[-1]}: rerun the same command to resume from it" if ckpts else
                  "no checkpoint was written (--save_interval): a rerun starts this step again")
        why = "".join(f"\n  {f}" for f in dict.fromkeys(failures))
        raise SystemExit(f"train.py: step {step} ({name or STEP_NAMES[step]}) failed with exit code {code}{why}\n"
                         f"  {resume}\n  full log: {log_path}")
    return time.time() - t0


def _last_logged_step(step_dir: Path) -> int | None:
    """The step of the last complete row of a step's metrics log (None without one)."""
    steps = [row["step"] for row in read_metrics(step_dir / METRICS_FILE) if "step" in row]
    return steps[-1] if steps else None


_RANK_EXIT = re.compile(r"--local_rank=(\d+).*exits with return code = (-?\d+)")
_RANK_FAILED = re.compile(r"^chatrl: rank \d+ failed .*")


def _failure_lines(line: str) -> list[str]:
    """What a step's output says about a failing rank: the launcher's exit line or chatrl's own report."""
    m = _RANK_EXIT.search(line)
    if m:
        code = int(m.group(2))
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return [f"local rank {m.group(1)} {how}"]
    m = _RANK_FAILED.search(line.strip())
    if not m:
        return []
    text = m.group(0)
    return [text if len(text) <= 400 else text[:399] + "…"]


_PROGRESS = re.compile(r"\d+/\d+ \[[\d:<?]+.*(it/s|s/it)")
_NOISE = re.compile(r"Warning|^\s+return |warn\(|UserWarning|FutureWarning|\[INFO\]|\[WARNING\]|real_accelerator|return func|"
                    r"^\s*$|it/s\]|shm_comm_op|Loading weights|Writing model|Saving the dataset|W\d{4} |torch.distributed")


def _worth_showing(line: str) -> bool:
    return not _NOISE.search(line)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    known = {x.dest for x in parser._actions}
    settings: PipelineSettings = config.read(
        PipelineSettings, parser.parse_args(normalize_argv(sys.argv[1:] if argv is None else list(argv), known)))
    a = settings.pipeline
    out = Path(a.output_dir).resolve()
    steps, rl_flags, skip2 = plan_pipeline(settings)
    deployment = a.deployment_type
    if a.preset == "demo":
        for needed in (SHARED / "models" / "stories260K", SHARED / "data" / "hh-rlhf"):
            if not needed.exists():
                raise SystemExit(f"the demo reads offline assets from {SHARED}; {needed} is missing "
                                 "(set CHATRL_SHARED to the shared/ folder)")
        actor, reward, presets = demo_plan(out)
        deployment = "cpu"
        for s, stages in {1: {"zero_stage": a.actor_zero_stage}, 2: {"zero_stage": a.reward_zero_stage},
                          3: {"actor_zero_stage": a.actor_zero_stage, "critic_zero_stage": a.reward_zero_stage}}.items():
            presets[s].update({k: v for k, v in stages.items() if v is not None})  # explicit stages win
    else:
        if not a.actor_model or not (a.reward_model or skip2 or a.step2_method == "dpo"):
            raise SystemExit("train.py: pass --actor-model and --reward-model (or --preset demo)")
        actor = resolve_model(a.actor_model)
        reward = resolve_model(a.reward_model) if a.reward_model else actor
        presets = size_preset(size_in_billions(actor), size_in_billions(reward), deployment,
                              a.actor_zero_stage, a.reward_zero_stage, a.dtype)
        for s in (1, 2, 3):  # every step's parser has --data_path (DataConfig)
            presets[s] = {"data_path": a.data_path or DEFAULT_DATA, **presets[s]}
    for preset in presets.values():  # a preset that pins a dtype keeps it
        preset.setdefault("dtype", a.dtype)
    if (a.node_rank is not None or a.master_addr) and deployment != "multi_node":
        raise SystemExit("train.py: --node-rank and --master-addr are for --deployment-type multi_node")
    cmd, env = launcher(deployment, a.num_gpus, a.hostfile, a.master_port, a.node_rank, a.master_addr)
    nodes = (multinode.read_hostfile(a.hostfile), a.node_rank) if deployment == "multi_node" else None
    dirs = {1: out / "step1_actor", 2: out / "step2_reward", 3: out / "step3_rlhf"}
    models = {1: {"model_name_or_path": actor}, 2: {"model_name_or_path": reward},
              3: {"actor_model_name_or_path": str(dirs[1]),
                  "critic_model_name_or_path": None if skip2 else str(dirs[2]), **rl_flags}}
    dtypes = {resolve_dtype(p["dtype"], "cpu" if deployment == "cpu" else None) for p in presets.values()}
    print(f"train.py: steps {steps} → {out} ({deployment}; actor {actor}; "
          f"{', '.join(d + (f' ({why})' if why else '') for d, why in sorted(dtypes))}; "
          f"{'reward ' + reward if not skip2 else 'step 3 ' + settings.rl.rl_algorithm})", flush=True)
    if skip2:
        print(skip2, flush=True)
    modules, names, parsers = dict(STEP_MODULES), dict(STEP_NAMES), step_parsers()
    if a.step2_method == "dpo":
        steps = dpo_plan(out, presets, dirs, models, steps)
        modules[2], names[2], parsers[2] = "chatrl.step2_dpo", "direct preference optimisation", parsers["dpo"]
    times = {}
    for s in steps:
        if (dirs[s] / RUN_MARKER).exists() and not a.overwrite:
            print(f"step {s} ({names[s]}): {dirs[s]} already holds a finished run; skipped "
                  "(--overwrite to redo)", flush=True)
            continue
        if s == 3:
            for need in ((1,) if skip2 else (1, 2)):
                if not (dirs[need] / "config.json").exists():
                    raise SystemExit(f"step 3 needs step {need}'s output in {dirs[need]}; run --step {need} first")
        extra = shlex.split(getattr(a, f"step{s}_args"))
        # An unfinished step continues from its newest checkpoint; --overwrite starts it afresh.
        values = {**models[s], **presets[s], "output_dir": str(dirs[s]), "overwrite_output_dir": a.overwrite,
                  "resume": not a.overwrite}
        step_cmd = [*cmd, "--module", modules[s], *command_flags(values, parsers[s]), *extra]
        node = f".node{a.node_rank}" if a.node_rank is not None else ""  # nodes may share the output folder
        log_path = out / "logs" / f"step{s}{node}.log"
        ckpts = [] if a.overwrite else list_checkpoints(dirs[s])
        print(f"step {s} ({names[s]}) → {dirs[s]}  (log: {log_path})"
              + (f"; resuming from {ckpts[-1].name}" if ckpts else ""), flush=True)
        try:
            times[s] = run_step(s, step_cmd, env, log_path, dirs[s], nodes, names[s])
            print(f"step {s} done in {times[s] / 60:.1f} min", flush=True)
        finally:  # also after a failed step: its curves and alerts help to see why
            print(report_note(out), flush=True)  # OUTPUT/report.html (python -m chatrl.report OUTPUT refreshes it)
    if a.step2_method == "dpo":
        if (dirs[2] / RUN_MARKER).exists():
            print(f"chat with the result: {sys.executable} {REPO / 'chat.py'} --path {dirs[2]}", flush=True)
    elif 3 in times or (dirs[3] / "actor" / "config.json").exists():
        print(f"chat with the result: {sys.executable} {REPO / 'chat.py'} --path {dirs[3] / 'actor'}", flush=True)
    if times:
        print("wall time per step (s): " + ", ".join(f"step {s}: {t:.0f}" for s, t in times.items()), flush=True)
    else:
        print("all requested steps were already finished (--overwrite redoes them)", flush=True)
        print(report_note(out), flush=True)


if __name__ == "__main__":
    main()
