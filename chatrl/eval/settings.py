"""The evaluation's settings: :class:`EvalConfig` (what to compare, on which prompts, with which judges,
how the figures are computed), the program's blocks (:class:`EvalSettings`), and :class:`EvalPipelineConfig`,
the block ``train.py`` composes to evaluate after step 3 or DPO."""

from __future__ import annotations

from dataclasses import dataclass

from chatrl import config
from chatrl.config import REQUIRED, setting, uses


@dataclass
class EvalConfig:
    """What to compare, on which prompts and with which judges."""

    models: list = setting(REQUIRED, "the models to compare, the first being the baseline: HF causal-LM folders "
                                     "(each with its tokenizer), a DPO output with snapshots/ (its snapshots, then "
                                     "the model), or a step-3 output folder (its snapshots/step_N in step order, "
                                     "then actor/, then actor_ema/ when saved); LABEL=PATH names one",
                           nargs="+", type=str, path="model")
    prompts: list = setting(REQUIRED, "prompt sources: data files/folders or hub data sets in any schema the data "
                                      "layer reads (the prompt of each row; multi-turn conversations stay whole)",
                            nargs="+", type=str, path="data")
    prompts_schema: str | None = setting(None, "force the prompts' schema (hh, pairs, sharegpt, prompts, oasst, "
                                               "alpaca) instead of detecting it", type=str)
    prompts_split: str | None = setting(None, "take only step 3's held-out rows: the phase-3 evaluation rows of "
                                              "this --data_split (e.g. 2,4,4; prompt-only files give their held-out "
                                              "share); unset: every row", type=str)
    split_seed: int = setting(1234, "the --seed of the run whose split --prompts_split reproduces")
    eval_fraction: float = setting(0.05, "the --eval_fraction of that run (share of each phase held out)",
                                   unit="fraction")
    max_prompts: int = setting(0, "evaluate on the first N prompts only (0: all)", unit="prompts")
    judge: str | None = setting(None, "the judge of the win rates: a reward-model folder (step 2's output), or "
                                      "module:function / file.py:function (a reward function f(prompts, answers, "
                                      "metadata), or a pairwise judge f(prompts, first, second) -> P(first is "
                                      "better) marked with f.pairwise = True); unset: no win rates", type=str,
                                path="model")
    gold_judge: str | None = setting(None, "a second judge (e.g. a reward model trained on other data, train.py "
                                           "--gold-reward-model): its win rates beside the judge's, and the "
                                           "over-optimisation check over a checkpoint series", type=str,
                                     path="model")
    reference: str | None = setting(None, "the reference model of the KL figure (step 3's: step 1's actor); "
                                          "unset: no KL", type=str, path="model")
    seeds: list = setting([1, 2], "sampled answers: one per prompt, model and seed (none: greedy answers only)",
                          nargs="*", type=int)
    no_greedy: bool = setting(False, "skip the greedy answers (only sampled ones)")
    pairs: str = setting("baseline", "which pairs: each model against the first (baseline) or every pair (all)",
                         choices=("baseline", "all"))
    bootstrap_samples: int = setting(1000, "bootstrap resamples of the prompts for each interval", unit="resamples")
    bootstrap_seed: int = setting(0, "seed of the bootstrap resamples")
    confidence: float = setting(0.95, "coverage of the intervals", unit="probability")
    tie_margin: float = setting(0.0, "score differences of a pointwise judge up to this count as ties (half a "
                                     "win each)")
    judge_max_seq_len: int = setting(512, "prompt + answer tokens a reward-model judge reads (longer prompts lose "
                                          "their oldest tokens)", unit="tokens")
    judge_batch_size: int = setting(16, "answers per judge forward pass", unit="answers")
    shown_answers: int = setting(3, "prompts whose answers eval.json and the report show side by side",
                                 unit="prompts")
    output_dir: str = setting(REQUIRED, "where eval.json and answers.jsonl go", type=str, path="file")
    device: str | None = setting(None, "cpu, cuda, cuda:1, ... (default: cuda if available)", type=str)
    disable_progress_bar: bool = setting(False, "no progress bar")


@dataclass
class EvalSettings:
    """The blocks of ``python -m chatrl.eval``."""

    eval: EvalConfig = uses(EvalConfig, title="evaluation")
    rollout: config.RolloutConfig = uses(config.RolloutConfig, only=("max_prompt_seq_len", "max_answer_seq_len",
                                                                      "per_device_generation_batch_size"),
                                         defaults={"per_device_generation_batch_size": 16},
                                         title="generation")
    sampling: config.SamplingConfig = uses(config.SamplingConfig, title="sampled answers")
    model: config.ModelConfig = uses(config.ModelConfig, only=("dtype", "trust_remote_code"))


@dataclass
class EvalPipelineConfig:
    """train.py: the evaluation after step 3 (or DPO)."""

    skip_eval: bool = setting(False, "do not evaluate the chat model against step 1's after the last step")
    gold_reward_model: str | None = setting(None, "also train a gold reward model with this backbone (hub name, "
                                                  "short name or folder) on step 1's share of the preference data "
                                                  "(disjoint from step 2's), as a second judge and the "
                                                  "over-optimisation check (OUTPUT/step2_gold_reward)", type=str,
                                            path="model")
    eval_args: str = setting("", "extra flags for python -m chatrl.eval, as one quoted string (local paths in them "
                                 "are read from the folder train.py is run from)")
