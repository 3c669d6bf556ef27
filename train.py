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
    OUTPUT/eval/                 the chat model against step 1's (eval.json, answers.jsonl; docs/evaluation.md)
    OUTPUT/logs/stepN.log        each step's full log (logs/eval.log: the evaluation's)
    OUTPUT/report.html           the run report (curves, samples, alerts, evaluation), refreshed after each step

A step whose output already holds a finished run is skipped (``--overwrite`` redoes it); an
unfinished one (a crash, a killed job) resumes from its newest checkpoint when the same command is
run again. Steps write checkpoints every ``--save_interval`` steps (the presets set it). Per-step
flags pass through with ``--step1-args "…"`` (and ``--step2-args``, ``--step3-args``); they come
last, so they override the presets.

``--step2-method dpo`` replaces steps 2 and 3 by direct preference optimisation of the step-1 actor
(``OUTPUT/step2_dpo/``, the chat model; ``--step2-args`` pass through to it) and stops there.

After step 3 (or DPO) the chat model is evaluated against step 1's on the prompts step 3 held out
(``python -m chatrl.eval``; ``--skip-eval`` skips it, ``--eval-args "…"`` passes flags through):
win rates with intervals judged by step 2's reward model, and with ``--gold-reward-model`` a second,
gold reward model trained on other data beside step 2 and the over-optimisation check.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from chatrl import cli, config
from chatrl.checkpoint import RUN_MARKER, list_checkpoints
from chatrl.cli import normalize_argv
from chatrl.config import setting, to_argv, uses
from chatrl.distributed import multinode
from chatrl.distributed.dist import free_port
from chatrl.errors import UsageError
from chatrl.eval.main import build_parser as eval_parser
from chatrl.eval.settings import EvalPipelineConfig
from chatrl.models import model_zoo
from chatrl.models.precision import DTYPE_CHOICES, resolve_dtype
from chatrl.packing import BLOCK_MASK_FAMILIES, POSITION_ID_FAMILIES
from chatrl.rewards import check_reward_metadata, kinds, split_weight
from chatrl.rl import algorithms
from chatrl.step1_sft.main import build_parser as step1_parser
from chatrl.step2_dpo.main import build_parser as dpo_parser
from chatrl.step2_reward.main import build_parser as step2_parser
from chatrl.step3_ppo.main import build_parser as step3_parser
from chatrl.tools.report import report_note
from chatrl.tracking import METRICS_FILE, read_metrics, results_line

REPO = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("CHATRL_SHARED", REPO.parent / "shared"))

DEFAULT_DATA = ["Dahoas/rm-static", "Dahoas/full-hh-rlhf", "Dahoas/synthetic-instruct-gptj-pairwise",
                "yitingxie/rlhf-reward-datasets"]
STEP_MODULES = {1: "chatrl.step1_sft", 2: "chatrl.step2_reward", 3: "chatrl.step3_ppo"}
STEP_NAMES = {1: "supervised fine-tuning", 2: "reward model", 3: "RLHF"}


def resolve_model(name: str) -> str:
    """A local folder stays as it is (made absolute); a short name (``opt-1.3b``), a packaged model
    (``smollm2-135m-instruct``) or a ``.gguf`` file becomes what transformers loads
    (:func:`chatrl.models.model_zoo.resolve`); others (hub names) pass through.

    Raises:
        SystemExit: a packaged model not fetched yet, or a GGUF file that does not convert (one line).
    """
    if Path(name).is_dir():
        return str(Path(name).resolve())
    try:
        return model_zoo.resolve(name)
    except UsageError as err:
        raise SystemExit(f"train.py: {err}") from None


def size_in_billions(name: str) -> float:
    """Parameter count read from a name such as ``facebook/opt-1.3b`` or ``Llama-2-7b`` (1.0 when unknown)."""
    m = re.search(r"(\d+(?:\.\d+)?)\s*([bm])\b", name.lower().replace("-hf", ""))
    if not m:
        return 1.0
    return float(m.group(1)) / (1000.0 if m.group(2) == "m" else 1.0)


Presets = dict[int | str, dict]
"""Per step, ``{flag name: value}`` (``True`` a bare switch, ``False``/``None`` omitted, a list its items):
presets stay data until :func:`command_flags` writes them as a command line. An optional ``"dpo"``
entry overrides step 1's settings for ``--step2-method dpo`` (:func:`dpo_plan`)."""


def step_parsers() -> dict[int, argparse.ArgumentParser]:
    """Each step's own parser: presets are written as its flag names and checked against it."""
    return {1: step1_parser(), 2: step2_parser(), 3: step3_parser(), "dpo": dpo_parser()}


def command_flags(values: dict, parser: argparse.ArgumentParser) -> list[str]:
    """A step's ``{flag name: value}`` as command-line flags, each name checked against its parser
    (:func:`chatrl.config.to_argv`)."""
    return to_argv(parser, values)


def packing_family(name: str) -> str | None:
    """The model family of ``name`` if ``--packing`` serves it (:mod:`chatrl.packing`: its packed path is
    tested to give the padded numbers), else None: read from a local folder's ``config.json``, or
    from a hub name (``facebook/opt-1.3b``, ``meta-llama/Llama-2-7b-hf``, ``Qwen/Qwen2-7B``)."""
    config_file = Path(name) / "config.json"
    if config_file.is_file():
        family = json.loads(config_file.read_text()).get("model_type")
    else:
        base = name.lower().rsplit("/", 1)[-1]
        family = "opt" if base.startswith("opt-") else "llama" if "llama" in base else "qwen2" if "qwen2" in base else None
    return family if family in POSITION_ID_FAMILIES + BLOCK_MASK_FAMILIES else None


def with_packing(presets: Presets, actor: str, reward: str) -> Presets:
    """Padding-free micro-batches (``--packing``) in each step whose models are all of a family it
    serves (:func:`packing_family`): step 1 the actor, step 2 the reward model, step 3 both."""
    models = {1: (actor,), 2: (reward,), 3: (actor, reward)}
    for s, names in models.items():
        if all(packing_family(n) for n in names):
            presets[s]["packing"] = True
    return presets


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
    hh-rlhf + Alpaca data from ../shared, 2 CPU ranks, actor under ZeRO-3 with the hybrid engine.

    Warm-ups are fractions of each step's run (10 of step 1's 114 steps, 10 of step 2's 91, 5 of step
    3's 40), so that a shortened demo (``--step3-args "--max_steps 3"``) still fits; intervals longer
    than a shortened run simply do not fire. Step 3 records the batches of steps 20 and 40
    (``--save_rollouts``) for ``python -m chatrl.tools.inspector`` and ``python -m chatrl.tools.replay``."""
    data = [str(SHARED / "data" / "hh-rlhf" / "helpful-base"), str(SHARED / "data" / "hh-rlhf" / "harmless-base")]
    model = str(SHARED / "models" / "stories260K")
    # fp32: in bf16 (--dtype bf16) the demo's step-2 accuracy and step-3 EOS rate came out lower (docs/precision.md)
    common = {"data_path": data, "data_split": "2,4,4", "data_output_path": output / "data_cache", "dtype": "fp32"}
    step1 = {**common, "data_path": [*data, str(SHARED / "data" / "alpaca-instructions")], "zero_stage": 3,
             "max_seq_len": 256, "per_device_train_batch_size": 16, "learning_rate": "2e-3", "num_warmup_steps": 0.08,
             "num_train_epochs": 2, "eval_interval": 50, "eval_eos_samples": 32, "save_interval": 25}
    step2 = {**common, "zero_stage": 3, "max_seq_len": 256, "per_device_train_batch_size": 8,
             "learning_rate": "2e-3", "num_warmup_steps": 0.1, "num_train_epochs": 1, "eval_interval": 50,
             "save_interval": 25}
    step3 = {**common, "actor_zero_stage": 3, "critic_zero_stage": 3, "enable_hybrid_engine": True,
             "max_prompt_seq_len": 128, "max_answer_seq_len": 48, "per_device_generation_batch_size": 16,
             "per_device_training_batch_size": 16, "actor_learning_rate": "3e-4", "critic_learning_rate": "1e-3",
             "num_warmup_steps": 0.125, "max_steps": 40, "init_kl_coef": 0.1, "print_answers": True,
             "save_interval": 10, "save_hf_interval": 10,
             "save_rollouts": 20}  # records of steps 20 and 40 (python -m chatrl.tools.inspector)
    # --step2-method dpo: DPO takes step 1's settings; its warm-up stays the 10 steps of its 46 it always had
    return model, model, {1: step1, 2: step2, 3: step3, "dpo": {"num_warmup_steps": 0.2}}


REAL_MODEL = "smollm2-135m-instruct"


def smollm2_plan(output: Path) -> tuple[str, str, Presets]:
    """The real-model run on this machine (``--preset smollm2``): SmolLM2-135M-Instruct, fetched and
    converted by ``python -m chatrl.models.model_zoo smollm2-135m-instruct``, as actor, reward-model and
    gold-judge backbone; real hh-rlhf helpfulness pairs from ../shared (helpful-base and
    helpful-online, 3,491 pairs, ``--data_split 2,4,4``: step 1 and the gold judge see the first share,
    step 2 the second, step 3's prompts and the evaluation the third); 2 CPU ranks at ZeRO-0 (a 135M
    model fits every rank; ZeRO-0 is the fastest stage on 2 CPU ranks), the hybrid engine for
    generation, every step's dtype ``auto`` (bf16 on a CPU with AVX512-BF16, else fp32).

    The model is already a chat model: step 1 fine-tunes it gently (learning rate 1e-5, 16 steps of 16
    conversations) on the chosen answers, so it keeps ending its turns; each step is capped in steps so
    that the whole preset, evaluation included, takes about an hour on 2 CPU cores (71 minutes measured
    with other work beside step 1; ``docs/real_model.md`` has the figures)."""
    pairs = [str(SHARED / "data" / "hh-rlhf" / "helpful-base"), str(SHARED / "data" / "hh-rlhf" / "helpful-online")]
    common = {"data_path": pairs, "data_split": "2,4,4", "data_output_path": output / "data_cache", "zero_stage": 0}
    # micro-batches of 4 (8 sequences of a pair in step 2) with 2 accumulated: the same global batch of 16 as
    # 8 × 1, and about 5 GB less resident memory per rank (a 8 × 320 bf16 micro-batch of step 1 peaked at 8.8 GB)
    sizes = {"max_seq_len": 256, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
             "num_warmup_steps": 0.1, "num_train_epochs": 1, "max_steps": 16, "eval_interval": 8, "save_interval": 8}
    step1 = {**common, **sizes, "learning_rate": "1e-5", "eval_eos_samples": 32}
    step2 = {**common, **sizes, "learning_rate": "2e-5"}
    step3 = {"data_path": pairs, "data_split": "2,4,4", "data_output_path": output / "data_cache",
             "actor_zero_stage": 0, "critic_zero_stage": 0, "enable_hybrid_engine": True,
             "max_prompt_seq_len": 192, "max_answer_seq_len": 64, "per_device_generation_batch_size": 4,
             "per_device_training_batch_size": 4, "actor_learning_rate": "2e-6", "critic_learning_rate": "1e-5",
             "num_warmup_steps": 0.1, "max_steps": 20, "init_kl_coef": 0.05, "print_answers": True,
             "save_interval": 10, "save_hf_interval": 10, "save_rollouts": 10}
    return REAL_MODEL, REAL_MODEL, {1: step1, 2: step2, 3: step3, "dpo": {"learning_rate": "1e-6", "max_steps": 16}}


PRESET_PLANS = {"demo": demo_plan, "smollm2": smollm2_plan}
PRESETS = {"demo": "the offline end-to-end run on this machine: stories260K, real data, 2 CPU ranks",
           "smollm2": "the real chat model SmolLM2-135M-Instruct on real data, 2 CPU ranks, about an hour "
                      "(python -m chatrl.models.model_zoo smollm2-135m-instruct first; docs/real_model.md)"}

# The demo's evaluation (python -m chatrl.eval flags beside those eval_flags derives from the runs): step 3's
# 93 held-out prompts, a greedy and a sampled answer per model (5 models: step 1, three snapshots, the final
# actor; 34 s of one core), larger batches for the tiny models.
DEMO_EVAL = {"seeds": [1], "per_device_generation_batch_size": 32, "judge_batch_size": 32}
# The real-model run's: step 3's held-out prompts, a greedy and a sampled answer per model (step 1, the snapshots,
# the final actor), judged by step 2's reward model and the gold judge trained on step 1's share of the pairs.
SMOLLM2_EVAL = {"seeds": [1], "per_device_generation_batch_size": 16, "judge_batch_size": 16}
PRESET_EVAL = {"demo": DEMO_EVAL, "smollm2": SMOLLM2_EVAL}
PRESET_GOLD = {"smollm2": REAL_MODEL}
"""The gold judge's backbone a preset trains when ``--gold-reward-model`` is not given."""


@dataclass
class PipelineConfig:
    """train.py: which models and steps, where, and how launched."""

    preset: str | None = setting(None, "; ".join(f"{k}: {v}" for k, v in PRESETS.items()),
                                 choices=tuple(PRESETS), type=str)
    actor_model: str | None = setting(None, "hub name, short name (opt-1.3b, opt-13b, llama2-7b) or local folder",
                                      type=str, path="model")
    reward_model: str | None = setting(None, "as --actor-model; the reward model's and critic's backbone", type=str,
                                       path="model")
    deployment_type: str = setting("single_gpu", "where it runs; sizes the presets",
                                   choices=("single_gpu", "single_node", "multi_node", "cpu"))
    step: list = setting([1, 2, 3], "steps to run, in order", nargs="+", choices=(1, 2, 3), type=int)
    output_dir: str = setting(str(REPO / "output"), "where every step writes", path="file")
    data_path: list | None = setting(None, "data sets for all steps (default: DeepSpeed-Chat's four)", nargs="+",
                                     type=str, path="data")
    actor_zero_stage: int | None = setting(None, "ZeRO stage of steps 1 and 3's actor (default: by size)",
                                           choices=(0, 1, 2, 3), type=int)
    reward_zero_stage: int | None = setting(None, "ZeRO stage of step 2 and step 3's critic (default: by size)",
                                            choices=(0, 1, 2, 3), type=int)
    num_gpus: int | None = setting(None, "GPUs per node (default: all the launcher sees)", type=int)
    hostfile: str = setting("/job/hostfile", "DeepSpeed hostfile for --deployment-type multi_node", path="file")
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
    step1_args: str = setting("", "extra flags for step 1, as one quoted string (local paths in them are read from "
                                  "the folder train.py is run from)")
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
    evaluation: EvalPipelineConfig = uses(EvalPipelineConfig, title="evaluation")


# DPO's settings on train.py's path (beside step 1's actor set-up and a tenth of its learning rate):
# DeepSpeed-Chat's β and one epoch, and RPO's SFT term on the chosen answers, which keeps the answers
# ending with EOS as step 1 taught (docs/dpo.md, "EOS after DPO").
DPO_DEFAULTS = {"num_train_epochs": 1, "beta": 0.1, "rpo_alpha": 1.0, "eval_eos_samples": 32}


def dpo_plan(out: Path, presets: Presets, dirs: dict, models: Presets, steps: list[int]) -> list[int]:
    """Re-plan step 2 as DPO of the step-1 actor (``chatrl.step2_dpo`` into ``OUTPUT/step2_dpo``), in place;
    returns the steps to run (step 3 dropped: the DPO model is the chat model). The DPO step uses
    step 1's actor settings (ZeRO stage, LoRA, batch sizes) on step 2's preference data, with
    :data:`DPO_DEFAULTS`, a learning rate a tenth of step 1's and the preset's own ``"dpo"`` entries
    (names checked against the DPO parser when the command line is written)."""
    if 3 in steps:
        print("train.py: --step2-method dpo stops after step 2 (the DPO model is the chat model); step 3 is skipped",
              flush=True)
    step1 = presets[1]
    lr = float(step1["learning_rate"]) / 10 if step1.get("learning_rate") is not None else 5e-6
    presets[2] = {**step1, **{k: v for k, v in presets[2].items() if k in ("data_path", "data_split")},
                  "learning_rate": f"{lr:g}", **DPO_DEFAULTS, **presets.get("dpo", {})}
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
    """The DeepSpeed launcher command and environment for a deployment (multi_node: see chatrl.distributed.multinode)."""
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
             nodes: tuple[dict[str, int], int | None] | None = None, name: str | None = None) -> tuple[float, float]:
    """Run one step, streaming its output to the terminal and ``log_path`` (appended: a resumed step
    keeps the log of its earlier attempts); returns seconds taken and the peak resident memory of its
    largest process in MiB (:func:`wait_peak`: the launcher's and every rank's, 0 where unknown).

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
        try:
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
            code, peak = wait_peak(proc)
        except KeyboardInterrupt:
            _wind_down(proc, log)
            raise Interrupted(step, name or STEP_NAMES[step], step_dir, log_path) from None
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
        # the cause first: a rank's own error above the lost connections it left the others with
        secondary = ("Connection reset", "Connection closed", "another rank has probably died")
        failures.sort(key=lambda f: any(x in f for x in secondary))
        why = "".join(f"\n  {f}" for f in dict.fromkeys(failures))
        raise SystemExit(f"train.py: step {step} ({name or STEP_NAMES[step]}) failed with exit code {code}{why}\n"
                         f"  {resume}\n  full log: {log_path}")
    return time.time() - t0, peak


def wait_peak(proc: subprocess.Popen) -> tuple[int, float]:
    """Wait for ``proc``; its exit code and the peak resident memory (MiB) of the largest process of its
    tree: ``wait4``'s ``ru_maxrss`` (KiB on Linux) covers the child and every descendant it waited for,
    so a launcher's figure is its largest rank's. 0 where ``os.wait4`` is missing (Windows)."""
    if not hasattr(os, "wait4"):
        return proc.wait(), 0.0
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_maxrss / 1024


class Interrupted(Exception):
    """Ctrl-C stopped a step: which one, its folder and its log."""

    def __init__(self, step: int, name: str, step_dir: Path, log_path: Path):
        super().__init__(step)
        self.step, self.name, self.step_dir, self.log_path = step, name, step_dir, log_path

    def message(self, overwrite: bool) -> str:
        """One line: what was kept and saved, and that the same command resumes (train.py passes --resume)."""
        ckpts = list_checkpoints(self.step_dir)
        saved = (f"its newest checkpoint is {ckpts[-1]} (the same command resumes from it)" if ckpts and not overwrite
                 else f"its newest checkpoint is {ckpts[-1]} (run without --overwrite to resume from it)" if ckpts
                 else "no checkpoint of it was written yet (the same command starts it again)")
        return (f"train.py: interrupted (Ctrl-C) in step {self.step} ({self.name}); finished steps are kept, {saved}; "
                f"log: {self.log_path}")


def _wind_down(proc: subprocess.Popen, log, grace_s: float = 30.0) -> None:
    """After Ctrl-C: pass it on to the step (a terminal sends it to the whole job already), log what the
    ranks still print (their one line each) without showing it, and end the step within ``grace_s``."""
    import signal
    import threading

    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
    reader = threading.Thread(target=lambda: [log.write(line) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(timeout=5)


def _last_logged_step(step_dir: Path) -> int | None:
    """The step of the last complete row of a step's metrics log (None without one)."""
    steps = [row["step"] for row in read_metrics(step_dir / METRICS_FILE) if "step" in row]
    return steps[-1] if steps else None


_RANK_EXIT = re.compile(r"--local_rank=(\d+).*exits with return code = (-?\d+)")
_RANK_FAILED = re.compile(r"^chatrl: rank \d+ failed .*")
# a usage error of a step program (argparse's line, or a UsageError): the cause, printed by rank 0
_USAGE_ERROR = re.compile(r"^(?:python -m chatrl\.[\w.]+|chatrl): error: .*")


def _failure_lines(line: str) -> list[str]:
    """What a step's output says about a failing rank: the launcher's exit line, chatrl's own report
    or a usage error (the cause, which the pipeline's last lines repeat)."""
    m = _RANK_EXIT.search(line)
    if m:
        code = int(m.group(2))
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return [f"local rank {m.group(1)} {how}"]
    m = _RANK_FAILED.search(line.strip()) or _USAGE_ERROR.search(line.strip())
    if not m:
        return []
    text = m.group(0)
    return [text if len(text) <= 400 else text[:399] + "…"]


_PROGRESS = re.compile(r"\d+/\d+ \[[\d:<?]+.*(it/s|s/it)")
_NOISE = re.compile(r"Warning|^\s+return |warn\(|UserWarning|FutureWarning|\[INFO\]|\[WARNING\]|real_accelerator|return func|"
                    r"^\s*$|it/s\]|shm_comm_op|Loading weights|Writing model|Saving the dataset|W\d{4} |torch.distributed")


def _worth_showing(line: str) -> bool:
    return not _NOISE.search(line)


@dataclass
class StepRun:
    """One step of a planned pipeline: its program and its whole command line (flags checked)."""

    step: int
    name: str
    module: str
    out_dir: Path
    argv: list[str]  # the program's flags: presets, then --stepN-args (local paths absolute)
    finished: bool  # its output holds a finished run and --overwrite is off: skipped


@dataclass
class Pipeline:
    """What :func:`plan` decides before anything runs."""

    settings: PipelineSettings
    out: Path
    launcher: list[str]
    env: dict
    nodes: tuple | None
    dirs: dict
    runs: list[StepRun]
    messages: list[str]  # printed before the first step
    step3_needs: tuple[int, ...] = (1, 2)  # the steps whose output step 3 reads


def check_step_flags(step: int, name: str, parser, argv: list[str]) -> argparse.Namespace:
    """Parse a step's whole command line with its own parser before anything is launched, so that a
    bad or misspelt flag in ``--stepN-args`` (no abbreviations) or a missing local data path stops
    train.py at once with one line naming the step.

    Returns the parsed flags.

    Raises:
        SystemExit: naming the step and the parser's message.
    """
    parser.raise_errors = True
    try:
        return cli.parse(parser, argv)
    except UsageError as e:
        raise SystemExit(f"train.py: step {step} ({name}) flags: {e}") from None
    finally:
        parser.raise_errors = False


def user_flags_win(a: PipelineConfig, presets: Presets) -> None:
    """A flag the user gives wins over the preset's value, in place: ``--data-path`` replaces every
    step's data (step 1's extra SFT data included); ``--actor-model`` and ``--reward-model`` are read
    by :func:`plan`."""
    if a.data_path:
        for s in (1, 2, 3):
            presets[s]["data_path"] = list(a.data_path)


_KINDS = {"sft": "SFT rows ({prompt, chosen}), which feed step 1 only", "pairs": "preference pairs",
          "prompts": "prompt rows ({prompt, reference}), which feed step 3 only"}


def check_step_data(step: int, name: str, phase: int, args: argparse.Namespace, sources: dict) -> None:
    """Check before step 1 that a step's local data gives it training rows, and with rule rewards that
    step 3's prompt rows hold what they read (:func:`chatrl.rewards.check_reward_metadata`): SFT rows
    feed step 1 only, prompt rows step 3 only, preference pairs every step by ``--data_split``, so a
    run with a rule reward gives step 1 and step 3 their data as one list
    (``--data-path sft.jsonl prompts.jsonl``). Skipped when an entry is a hub name (read later).
    ``sources`` caches each entry's :func:`chatrl.data.sources.read_source`.

    Raises:
        SystemExit: one line naming the step, its data and what feeds it.
    """
    from chatrl.data.sources import read_source
    from chatrl.data.split import parse_data_split, phase_rows

    entries = list(args.data_path or [])
    if not entries or not all(cli.looks_local(e.split("[", 1)[0]) for e in entries):
        return
    metadata, kinds = [], []
    try:
        weights = parse_data_split(args.data_split)
        for entry in entries:
            if entry not in sources:
                sources[entry] = read_source(entry)
            src = sources[entry]
            kinds.append(src.kind)
            rows = set(phase_rows(src.n_rows, src.kind, phase, weights, getattr(args, "seed", 1234),
                                  getattr(args, "eval_fraction", 0.05))[0].tolist())
            metadata += [sm.metadata for sm, r in zip(src.samples, src.sample_rows, strict=True) if r in rows]
    except (OSError, ValueError) as e:
        raise SystemExit(f"train.py: step {step} ({name}) data: {e}") from None
    if not metadata:
        held = "; ".join(f"{e} holds {_KINDS.get(k, k)}" for e, k in zip(entries, kinds, strict=True))
        raise SystemExit(f"train.py: step {step} ({name}) gets no training rows from its data ({held}): give each "
                         "step its rows in one --data-path list, e.g. --data-path sft.jsonl prompts.jsonl "
                         "(docs/critic_free.md)")
    if phase == 3:
        try:
            check_reward_metadata(getattr(args, "reward_fn", None) or [], metadata, "--data-path " + " ".join(entries))
        except UsageError as e:
            raise SystemExit(f"train.py: step {step} ({name}): {e}") from None


def plan(argv: list[str] | None = None, cwd: str | os.PathLike | None = None) -> Pipeline:
    """train.py's whole plan from its command line, nothing launched: the steps, their programs and
    checked command lines, the launcher.

    Every local path the user gives (``--data-path`` entries with their row slices, ``--reward-fn``
    files, ``--hostfile``, model folders, ``--output-dir``, and the path flags inside ``--stepN-args``)
    is made absolute against ``cwd`` (the caller's folder; the steps run from the repository); hub
    names and module specs are left alone (:func:`chatrl.cli.resolve_path`).

    Raises:
        SystemExit: a bad combination of flags, a missing demo asset, or a step's command line its
            parser refuses (naming the step).
    """
    cwd = Path.cwd() if cwd is None else Path(cwd)
    parser = build_parser()
    known = {x.dest for x in parser._actions}
    raw = cli.resolve_argv(normalize_argv(sys.argv[1:] if argv is None else list(argv), known), parser, cwd)
    settings: PipelineSettings = config.read(PipelineSettings, parser.parse_args(raw))
    a = settings.pipeline
    out = Path(a.output_dir).resolve()
    for entry in a.data_path or []:  # refused here, in one line, before any step starts
        path = entry.split("[", 1)[0] if entry.endswith("]") else entry
        if cli.looks_local(path) and not Path(path).expanduser().exists():
            raise SystemExit(f"train.py: --data-path {entry}: no such file or folder")
    for flag, spec in kinds.specs(settings.reward):  # a misspelt reward stops train.py before step 1
        try:
            kinds.check(spec, flag)
        except ValueError as e:  # UsageError, a bad weight
            raise SystemExit("train.py: " + str(e).replace(flag, flag.replace("_", "-"))) from None
    steps, rl_flags, skip2 = plan_pipeline(settings)
    deployment = a.deployment_type
    if a.preset == "demo":
        for needed in (SHARED / "models" / "stories260K", SHARED / "data" / "hh-rlhf"):
            if not needed.exists():
                raise SystemExit(f"the demo reads offline assets from {SHARED}; {needed} is missing "
                                 "(set CHATRL_SHARED to the shared/ folder)")
        actor, reward, presets = demo_plan(out)
        deployment = "cpu"
    if a.preset == "smollm2":
        for needed in (SHARED / "data" / "hh-rlhf",):
            if not needed.exists():
                raise SystemExit(f"the smollm2 preset reads its data from {SHARED}; {needed} is missing "
                                 "(set CHATRL_SHARED to the shared/ folder)")
        name, _, presets = smollm2_plan(out)
        actor = reward = resolve_model(name)
        deployment = "cpu"
    if a.preset:
        user_flags_win(a, presets)
        actor = resolve_model(a.actor_model) if a.actor_model else actor
        reward = resolve_model(a.reward_model) if a.reward_model else reward
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
    presets = with_packing(presets, actor, reward)
    # every step's dtype: a preset may pin one (the demo: fp32), a --dtype given wins; DPO takes step 1's
    for preset in (presets[s] for s in (1, 2, 3)):
        preset["dtype"] = a.dtype if a.dtype != "auto" else preset.get("dtype", a.dtype)
    if (a.node_rank is not None or a.master_addr) and deployment != "multi_node":
        raise SystemExit("train.py: --node-rank and --master-addr are for --deployment-type multi_node")
    cmd, env = launcher(deployment, a.num_gpus, a.hostfile, a.master_port, a.node_rank, a.master_addr)
    nodes = (multinode.read_hostfile(a.hostfile), a.node_rank) if deployment == "multi_node" else None
    dirs = {1: out / "step1_actor", 2: out / "step2_reward", 3: out / "step3_rlhf"}
    models = {1: {"model_name_or_path": actor}, 2: {"model_name_or_path": reward},
              3: {"actor_model_name_or_path": str(dirs[1]),
                  "critic_model_name_or_path": None if skip2 else str(dirs[2]), **rl_flags}}
    dtypes = {resolve_dtype(presets[s]["dtype"], "cpu" if deployment == "cpu" else None) for s in steps}
    messages = [f"train.py: steps {steps} → {out} ({deployment}; actor {actor}; "
                f"{', '.join(d + (f' ({why})' if why else '') for d, why in sorted(dtypes))}; "
                f"{'reward ' + reward if not skip2 else 'step 3 ' + settings.rl.rl_algorithm})"]
    if skip2:
        messages.append(skip2)
    modules, names, parsers = dict(STEP_MODULES), dict(STEP_NAMES), step_parsers()
    names[3] = f"RLHF, {settings.rl.rl_algorithm}"  # step 3 names its algorithm in every message
    if a.step2_method == "dpo":
        steps = dpo_plan(out, presets, dirs, models, steps)
        modules[2], names[2], parsers[2] = "chatrl.step2_dpo", "direct preference optimisation", parsers["dpo"]
    runs, sources = [], {}
    for s in steps:
        extra = cli.resolve_argv(shlex.split(getattr(a, f"step{s}_args")), parsers[s], cwd)
        # An unfinished step continues from its newest checkpoint; --overwrite starts it afresh.
        values = {**models[s], **presets[s], "output_dir": str(dirs[s]), "overwrite_output_dir": a.overwrite,
                  "resume": not a.overwrite}
        step_argv = [*command_flags(values, parsers[s]), *extra]
        finished = (dirs[s] / RUN_MARKER).exists() and not a.overwrite
        if not finished:
            parsed = check_step_flags(s, names[s], parsers[s], step_argv)
            check_step_data(s, names[s], 2 if modules[s] == "chatrl.step2_dpo" else s, parsed, sources)
        runs.append(StepRun(s, names[s], modules[s], dirs[s], step_argv, finished))
    return Pipeline(settings, out, cmd, env, nodes, dirs, runs, messages, (1,) if skip2 else (1, 2))


def main(argv: list[str] | None = None) -> None:
    """``python train.py …``: :func:`plan`, then each step through the launcher, a report after each,
    and a summary of every step's results at the end."""
    pipe = plan(argv)
    a, out, dirs = pipe.settings.pipeline, pipe.out, pipe.dirs
    for line in pipe.messages:
        print(line, flush=True)
    times = {}
    for r in pipe.runs:
        s = r.step
        if r.finished:
            print(f"step {s} ({r.name}): {r.out_dir} already holds a finished run; skipped "
                  "(--overwrite to redo)", flush=True)
            continue
        if s == 3:
            for need in pipe.step3_needs:
                if not (dirs[need] / "config.json").exists():
                    raise SystemExit(f"step 3 needs step {need}'s output in {dirs[need]}; run --step {need} first")
        step_cmd = [*pipe.launcher, "--module", r.module, *r.argv]
        node = f".node{a.node_rank}" if a.node_rank is not None else ""  # nodes may share the output folder
        log_path = out / "logs" / f"step{s}{node}.log"
        ckpts = [] if a.overwrite else list_checkpoints(r.out_dir)
        print(f"step {s} ({r.name}) → {r.out_dir}  (log: {log_path})"
              + (f"; resuming from {ckpts[-1].name}" if ckpts else ""), flush=True)
        try:
            times[s], peak = run_step(s, step_cmd, pipe.env, log_path, r.out_dir, pipe.nodes, r.name)
        except Interrupted as stop:  # one line: what is kept and how to go on
            print(("\n" if sys.stdout.isatty() else "") + stop.message(a.overwrite), flush=True)
            raise SystemExit(130) from None
        except BaseException:  # a failed step: its curves and alerts help to see why
            print(report_note(out), flush=True)
            raise
        print(f"step {s} {record_cost(out, f'step{s}', times[s], peak)}", flush=True)
        print(report_note(out), flush=True)  # OUTPUT/report.html (python -m chatrl.tools.report OUTPUT refreshes it)
    evaluate_pipeline(pipe)
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
    for line in results_summary(pipe.runs):
        print(line, flush=True)


def results_summary(runs: list[StepRun]) -> list[str]:
    """The pipeline's last lines: each step's results from its metrics log
    (:func:`chatrl.tracking.results_line`: step 1's eval perplexity before → after and EOS rate,
    step 2's eval accuracy before → after, step 3's score and EOS rate trends (:func:`chatrl.tracking.step_trend`),
    KL max)."""
    lines = []
    for r in runs:
        found = results_line(read_metrics(r.out_dir / METRICS_FILE))
        if found:
            lines.append(f"  step {r.step} ({r.name}): {found}")
    return ["results:", *lines] if lines else []


# ---------------------------------------------------------------------------------------------- evaluation
def disjoint_split(data_split: str) -> str:
    """The ``--data_split`` whose phase-2 rows are ``data_split``'s phase-1 rows: ``"a,b,c"`` → ``"0,a,b+c"``.

    :func:`chatrl.data.split.phase_parts` cuts one seeded permutation at the cumulative weights, so
    both splits cut it at the same first boundary: a gold reward model trained with it sees pairs that
    step 2's reward model never saw (those whose chosen answers step 1 trained on), and none of step 3's
    prompts.
    """
    w = [float(x) for x in data_split.split(",")]
    return f"0,{w[0]:g},{w[1] + w[2]:g}"


def _marker_args(folder: Path) -> dict:
    try:
        return dict(json.loads((folder / RUN_MARKER).read_text(encoding="utf-8")).get("args") or {})
    except (OSError, ValueError):
        return {}


def gold_backbone(s: PipelineSettings) -> str | None:
    """The gold judge's backbone: ``--gold-reward-model``, else the preset's (:data:`PRESET_GOLD`), else None."""
    return s.evaluation.gold_reward_model or PRESET_GOLD.get(s.pipeline.preset)


def gold_reward_run(pipe: Pipeline, cwd: str | os.PathLike | None = None) -> StepRun:
    """The gold reward model's run (``--gold-reward-model``): step 2's program with step 2's presets for
    the gold backbone and ``--step2-args`` (with the reward-model method), into ``OUTPUT/step2_gold_reward``,
    on the other share of the preference data: the rows step 1 trained on (:func:`disjoint_split` of the
    split step 2 uses, same seed), so that it never sees step 2's pairs or step 3's prompts.

    Raises:
        SystemExit: its command line is refused by step 2's parser (naming the run).
    """
    s = pipe.settings
    a = s.pipeline
    gold = resolve_model(gold_backbone(s))
    if a.preset:
        presets = dict(PRESET_PLANS[a.preset](pipe.out)[2][2])
        if a.data_path:  # the user's data wins over the preset's, as for the steps
            presets["data_path"] = list(a.data_path)
    else:
        size = size_in_billions(gold)
        presets = {"data_path": a.data_path or DEFAULT_DATA,
                   **size_preset(size, size, a.deployment_type, a.actor_zero_stage, a.reward_zero_stage)[2]}
    if a.reward_zero_stage is not None:
        presets["zero_stage"] = a.reward_zero_stage
    presets["dtype"] = a.dtype if a.dtype != "auto" else presets.get("dtype", a.dtype)  # as step 2's (plan)
    folder = pipe.out / "step2_gold_reward"
    parser = step2_parser()
    values = {**presets, "model_name_or_path": gold, "output_dir": str(folder), "overwrite_output_dir": a.overwrite,
              "resume": not a.overwrite}
    extra = cli.resolve_argv(shlex.split(a.step2_args), parser, Path.cwd() if cwd is None else Path(cwd)) \
        if a.step2_method == "reward" else []
    argv = [*command_flags(values, parser), *extra]
    split = parser.parse_args(argv).data_split  # what step 2 uses (its preset, or --step2-args)
    argv += ["--data_split", disjoint_split(split)]
    finished = (folder / RUN_MARKER).exists() and not a.overwrite
    if not finished:
        check_step_flags(2, "gold reward model", parser, argv)
    return StepRun(2, "gold reward model", STEP_MODULES[2], folder, argv, finished)


def eval_flags(pipe: Pipeline, gold: Path | None) -> dict:
    """``python -m chatrl.eval``'s flags for the pipeline: step 1's actor against the chat model (step 3's
    output with its snapshots and EMA actor, or DPO's), on the prompts step 3 holds out of the same data
    and split, judged by step 2's reward model (or the single ``--reward-fn`` of a run without one, and
    DPO's gold reward model), the gold reward model as second judge, KL to step 1's actor."""
    s, out, dirs = pipe.settings, pipe.out, pipe.dirs
    dpo = s.pipeline.step2_method == "dpo"
    final = dirs[2] if dpo else dirs[3]
    run = _marker_args(final)
    step2 = _marker_args(gold if dpo and gold is not None else dirs[2])
    skip2 = plan_pipeline(s)[2]
    judge = (str(gold) if gold is not None else None) if dpo else (
        str(dirs[2]) if not skip2 else split_weight(s.reward.reward_fn[0], "--reward-fn")[1]
        if len(s.reward.reward_fn) == 1 and not s.reward.reward_url else None)
    answer = int(run.get("max_answer_seq_len") or run.get("eval_max_new_tokens") or 64)
    prompt = int(run.get("max_prompt_seq_len") or max(1, int(run.get("max_seq_len") or 256) - answer))
    return {"models": [str(dirs[1]), str(final)], "prompts": run.get("data_path"),
            "prompts_split": run.get("data_split") or "2,4,4", "split_seed": run.get("seed", 1234),
            "judge": judge, "gold_judge": str(gold) if gold is not None and not dpo else None,
            "reference": run.get("actor_model_name_or_path") or str(dirs[1]),
            "max_answer_seq_len": answer, "max_prompt_seq_len": prompt,
            "judge_max_seq_len": step2.get("max_seq_len"), "dtype": run.get("dtype"),
            "output_dir": str(out / "eval"), "disable_progress_bar": True,
            **PRESET_EVAL.get(s.pipeline.preset, {})}


def evaluate_pipeline(pipe: Pipeline) -> None:
    """Evaluate the pipeline's chat model against step 1's (``python -m chatrl.eval``, :func:`eval_flags`)
    once step 3 (or DPO) has finished, after training the gold reward model when asked
    (:func:`gold_reward_run`); the table is printed, ``OUTPUT/eval/`` written and the report refreshed.
    Skipped with ``--skip-eval``, on nodes other than the first, and when ``OUTPUT/eval`` is newer
    than the models (``--overwrite`` or ``--eval-args`` redo it).

    Raises:
        SystemExit: the gold reward model's training or the evaluation failed (names the log), or Ctrl-C.
    """
    s, out, dirs = pipe.settings, pipe.out, pipe.dirs
    a = s.pipeline
    final = dirs[2] if a.step2_method == "dpo" else dirs[3]
    if s.evaluation.skip_eval or (a.node_rank or 0) != 0 or not (final / RUN_MARKER).exists() \
            or not (dirs[1] / "config.json").exists():
        return
    gold = None
    if gold_backbone(s):
        r = gold_reward_run(pipe)
        gold = r.out_dir
        if not r.finished:
            log_path = out / "logs" / "step2_gold.log"
            print(f"step 2 ({r.name}) → {r.out_dir}  (log: {log_path})", flush=True)
            try:
                took, peak = run_step(2, [*pipe.launcher, "--module", r.module, *r.argv], pipe.env, log_path,
                                      r.out_dir, pipe.nodes, r.name)
            except Interrupted as stop:
                print(("\n" if sys.stdout.isatty() else "") + stop.message(a.overwrite), flush=True)
                raise SystemExit(130) from None
            print(f"step 2 ({r.name}) {record_cost(out, 'gold_reward', took, peak)}", flush=True)
    result = out / "eval" / "eval.json"
    newest = max((f / RUN_MARKER).stat().st_mtime for f in (final, dirs[1], gold) if f is not None and
                 (f / RUN_MARKER).exists())
    if result.exists() and result.stat().st_mtime > newest and not a.overwrite and not s.evaluation.eval_args:
        print(f"evaluation: {result} is newer than the models; skipped (--overwrite redoes it)", flush=True)
        return
    parser = eval_parser()
    flags, extra = eval_flags(pipe, gold), shlex.split(s.evaluation.eval_args)
    cmd = [sys.executable, "-m", "chatrl.eval", *command_flags(flags, parser),
           *cli.resolve_argv(extra, parser, Path.cwd())]
    log_path = out / "logs" / "eval.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"evaluation: {dirs[1].name} against {final.name} (log: {log_path})", flush=True)
    if flags["judge"] is None and not any(x.split("=")[0] in ("--judge", "--gold_judge", "--gold-judge") for x in extra):
        print("evaluation: no judge, so no win rate ('-'): " + (
            "DPO trains no reward model; --gold-reward-model BACKBONE trains one to judge with"
            if a.step2_method == "dpo" else "this run has no reward model nor a single --reward-fn")
            + ", or --eval-args \"--judge PATH\" names one", flush=True)
    t0 = time.time()
    with open(log_path, "a", encoding="utf-8", buffering=1) as log:
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')}\n$ " + shlex.join(cmd) + "\n")
        # the steps' environment: on CPU one intra-op thread, as each rank has
        proc = subprocess.Popen(cmd, env={**os.environ, **pipe.env}, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            log.write(line)
            if _worth_showing(line) and not _PROGRESS.search(line):
                print(f"  {line.rstrip()}", flush=True)
        code, peak = wait_peak(proc)
    print(report_note(out), flush=True)
    if code != 0:
        raise SystemExit(f"train.py: the evaluation failed with exit code {code}; the models are saved. Full log: "
                         f"{log_path}; rerun the same command to evaluate again (finished steps are skipped)")
    print(f"evaluation {record_cost(out, 'evaluation', time.time() - t0, peak)}: {result}", flush=True)


def record_cost(out: Path, part: str, seconds: float, peak_mib: float) -> str:
    """Keep what a part of the pipeline cost in ``OUTPUT/logs/costs.json`` (``{part: {"wall_s",
    "peak_rss_mib", "finished"}}``, the last run of each part): the figures the docs quote per step.
    Returns the words train.py prints after the part's name ("done in … min; peak resident memory …")."""
    path = out / "logs" / "costs.json"
    try:
        costs = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        costs = {}
    costs[part] = {"wall_s": round(seconds, 1), "peak_rss_mib": round(peak_mib, 1),
                   "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs, indent=1) + "\n", encoding="utf-8")
    return f"done in {seconds / 60:.1f} min; peak resident memory of a process {peak_mib / 1024:.2f} GiB"


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # between steps (planning, a report): nothing of a step is lost
        print("\ntrain.py: interrupted (Ctrl-C); finished steps are kept; the same command continues", flush=True)
        raise SystemExit(130) from None
