"""train.py's whole plan from its command line, nothing launched (:func:`plan`): the settings
(:class:`PipelineSettings`), the steps to run (:func:`plan_pipeline`), each step's command line written
from the presets and checked by the step's own parser (:func:`check_step_flags`), each step's local data
checked (:func:`check_step_data`), and the DeepSpeed launcher (:func:`launcher`).

The step parsers come in as an argument (``step_parsers``): this module imports no step package.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chatrl import cli, config
from chatrl.checkpoint import RUN_MARKER
from chatrl.cli import normalize_argv
from chatrl.config import setting, to_argv, uses
from chatrl.data.sources import read_source
from chatrl.data.split import parse_data_split, phase_rows
from chatrl.distributed import multinode
from chatrl.distributed.dist import free_port
from chatrl.errors import UsageError
from chatrl.eval.settings import EvalPipelineConfig
from chatrl.models import model_zoo
from chatrl.models.precision import DTYPE_CHOICES, resolve_dtype
from chatrl.pipeline.presets import (
    DEFAULT_DATA,
    PRESETS,
    REPO,
    SHARED,
    Presets,
    demo_plan,
    dpo_plan,
    size_in_billions,
    size_preset,
    smollm2_plan,
    with_packing,
)
from chatrl.rewards import check_reward_metadata, kinds
from chatrl.rl import algorithms

StepParsers = Callable[[], dict]
"""A fresh parser per step (``{1: ..., 2: ..., 3: ..., "dpo": ...}``): train.py's ``step_parsers``."""

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


def command_flags(values: dict, parser: argparse.ArgumentParser) -> list[str]:
    """A step's ``{flag name: value}`` as command-line flags, each name checked against its parser
    (:func:`chatrl.config.to_argv`)."""
    return to_argv(parser, values)


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
    step_parsers: StepParsers | None = None  # fresh step parsers (the gold reward model reads step 2's)

    @property
    def eval_env(self) -> dict:
        """The evaluation's environment: the steps' one, except that on CPU this single process takes the
        intra-op threads of all the ranks it follows (``OMP_NUM_THREADS`` = ranks × 1), since it runs alone
        on the cores they held; a user's own ``OMP_NUM_THREADS`` wins."""
        env = dict(self.env)
        if env.get("OMP_NUM_THREADS") == "1" and "--num_gpus" in self.launcher:
            env["OMP_NUM_THREADS"] = self.launcher[self.launcher.index("--num_gpus") + 1]
        if os.environ.get("OMP_NUM_THREADS"):
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        return env


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


def plan(parser: argparse.ArgumentParser, step_parsers: StepParsers, argv: list[str] | None = None,
         cwd: str | os.PathLike | None = None) -> Pipeline:
    """train.py's whole plan from its command line, nothing launched: the steps, their programs and
    checked command lines, the launcher. ``parser`` is train.py's (flags :class:`PipelineSettings`),
    ``step_parsers`` gives each step's own (:data:`StepParsers`).

    Every local path the user gives (``--data-path`` entries with their row slices, ``--reward-fn``
    files, ``--hostfile``, model folders, ``--output-dir``, and the path flags inside ``--stepN-args``)
    is made absolute against ``cwd`` (the caller's folder; the steps run from the repository); hub
    names and module specs are left alone (:func:`chatrl.cli.resolve_path`).

    Raises:
        SystemExit: a bad combination of flags, a missing demo asset, or a step's command line its
            parser refuses (naming the step).
    """
    cwd = Path.cwd() if cwd is None else Path(cwd)
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
    return Pipeline(settings, out, cmd, env, nodes, dirs, runs, messages, (1,) if skip2 else (1, 2), step_parsers)
