"""The evaluation after the pipeline's last step, planned: the gold reward model's run on the other share
of the preference data (:func:`gold_reward_run`) and ``python -m chatrl.eval``'s flags
(:func:`eval_flags`). train.py launches them (``evaluate_pipeline``)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from chatrl import cli
from chatrl.checkpoint import RUN_MARKER
from chatrl.pipeline.plan import (
    STEP_MODULES,
    Pipeline,
    PipelineSettings,
    StepRun,
    check_step_flags,
    command_flags,
    plan_pipeline,
    resolve_model,
)
from chatrl.pipeline.presets import (
    DEFAULT_DATA,
    PRESET_EVAL,
    PRESET_GOLD,
    PRESET_PLANS,
    size_in_billions,
    size_preset,
)
from chatrl.rewards import split_weight


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
    parser = pipe.step_parsers()[2]
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
