"""Every setting of every program, declared once: type, default, unit and a one-line doc.

A *block* is a dataclass for one concern (model, LoRA, data, optimisation, ZeRO, hybrid engine,
sampling, rollouts, PPO, logging, checkpoints). Each field is declared with :func:`setting`; a
program's command-line parser is generated from the blocks it uses by :func:`add_block`, and a
typed block is read back from the parsed flags by :func:`from_args`. Flag names are the field
names (DeepSpeed-Chat's where it has the concept); :func:`chatrl.cli.parse` also accepts the
dash spelling (``--zero-stage``).

A field is either *shared* (one flag per program: ``--dtype``) or *per model*
(``per_model=True``): step 3 composes a block for the actor and the critic with
``prefixes=("actor_", "critic_")``, which gives ``--actor_learning_rate`` and
``--critic_learning_rate`` next to one shared ``--lr_scheduler_type``. A program overrides a
default (step 1's learning rate is not step 2's) with ``defaults={"learning_rate": 1e-3}`` where
it composes the block: the help, unit and type stay those declared here.

A program declares its blocks once, as a dataclass of :func:`uses` fields; its parser is generated
from it (:func:`program_parser`) and its typed settings read back (:func:`read`), which the program
then hands, block by block, to the code that uses them::

    from chatrl import config

    @dataclass
    class MySettings:
        model: config.ModelConfig = config.uses(config.ModelConfig)
        optim: config.OptimConfig = config.uses(config.OptimConfig, defaults={"learning_rate": 5e-7})
        mine: MyStepConfig = config.uses(MyStepConfig)   # its own @dataclass of setting(...) fields

    parser = config.program_parser(MySettings, "my step", prog="python -m chatrl.my_step")
    s = config.read(MySettings, chatrl.cli.parse(parser, argv))
    s.optim.learning_rate
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from chatrl.errors import UsageError
from chatrl.models import precision
from chatrl.rl import algorithms, core
from chatrl.rl.loss import (
    KL_LOSS_ESTIMATORS,
    KL_PLACEMENTS,
    LOSS_AGG_MODES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
)

REQUIRED: Any = object()
"""Default of a flag that must be given."""


PATH_KINDS = ("file", "model", "data", "reward_fn")
"""What a flag's value names on the local disk (:func:`chatrl.cli.resolve_path` makes it absolute
against the caller's folder): ``file`` always a local path; ``model`` a local folder or a hub name;
``data`` data entries (local files or folders, optionally with a row slice, or hub names);
``reward_fn`` reward and environment specs (``[W*]file.py:fn`` names a file, ``module:fn`` and built-ins
do not)."""


def setting(default: Any, help: str, *, unit: str | None = None, choices: tuple | Callable[[], tuple] | None = None,
            nargs: str | None = None, per_model: bool = False, type: Any = None, path: str | None = None):
    """A block field: its default, one-line help, unit (shown in ``--help``), allowed values (a tuple,
    or a function returning them when the parser is built: a registry that can grow), and whether
    it exists once per trained model (``per_model``) when a block is composed with prefixes.

    ``default=REQUIRED`` makes the flag required. A ``bool`` default of False makes a switch
    (``store_true``). ``nargs`` as in argparse (list values). ``type`` overrides the element type
    inferred from the default (needed when the default is ``None``). ``path``: one of
    :data:`PATH_KINDS` when the value names something on the local disk (the parser records it in
    ``path_kinds``, so that ``train.py`` resolves it against the caller's folder).
    """
    if path is not None and path not in PATH_KINDS:
        raise ValueError(f"setting path kind {path!r}: expected one of {PATH_KINDS}")
    meta = {"help": help, "unit": unit, "choices": choices, "nargs": nargs, "per_model": per_model, "type": type,
            "path": path}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=None if default is REQUIRED else default, metadata={**meta, "required": default is REQUIRED})


# ----------------------------------------------------------------------------------------- blocks
@dataclass
class ModelConfig:
    """The model to load and how to hold it."""

    model_name_or_path: str = setting(REQUIRED, "HF hub name or local folder of a causal LM", per_model=True, type=str,
                                      path="model")
    dtype: str = setting("fp32", "dtype of the weights (training and inference); auto: bf16 where the device "
                                 "computes it natively (a CUDA device with bf16, a CPU with AVX512-BF16 or AMX), "
                                 "else fp32 (docs/precision.md)", choices=precision.DTYPE_CHOICES)
    fp32_lm_head: bool = setting(False, "compute the LM head, and so the logits, in fp32 whatever --dtype (step 3: in "
                                        "the sampler and the trainer alike, which narrows their log-prob gap in bf16; "
                                        "docs/precision.md)")
    gradient_checkpointing: bool = setting(False, "recompute activations in backward", per_model=True)
    dropout: float | None = setting(None, "override every dropout probability in the model config "
                                          "(unset: keep the config's)", unit="probability", per_model=True, type=float)
    trust_remote_code: bool = setting(False, "allow model code from the hub (off: safer)")
    disable_dropout: bool = setting(False, "DeepSpeed-Chat's spelling of --dropout 0.0")

    def __post_init__(self):
        # --dtype auto becomes the concrete dtype once, where the settings are read; the reason is kept
        # for the program's start-up line (dtype_note)
        self.dtype, self._dtype_reason = precision.resolve_dtype(self.dtype)

    @property
    def dtype_note(self) -> str:
        """The dtype for a start-up line: ``bf16``, or ``bf16 (--dtype auto: CPU with AVX512-BF16)``."""
        return f"{self.dtype} ({self._dtype_reason})" if self._dtype_reason else self.dtype

    @property
    def dropout_override(self) -> float | None:
        """The dropout probability to force on the model (0 with ``--disable_dropout``), or None: keep the config's."""
        return 0.0 if self.disable_dropout else self.dropout


@dataclass
class LoraConfig:
    """LoRA adapters (peft)."""

    lora_dim: int = setting(0, "LoRA rank; 0 disables LoRA", per_model=True)
    lora_module_name: str = setting("layers.", "LoRA wraps every nn.Linear whose qualified name contains this text",
                                    per_model=True)
    only_optimize_lora: bool = setting(False, "freeze all but the LoRA weights")
    lora_learning_rate: float = setting(5e-4, "learning rate of the LoRA weights", per_model=True)


@dataclass
class DataConfig:
    """Where the data comes from and how it is split and cut."""

    data_path: list = setting(REQUIRED, "hub data set names and/or local .jsonl/.json/.parquet files or folders "
                                        "(optionally .gz, optionally with a row slice 'path[a:b]'); several are "
                                        "blended", nargs="+", type=str, path="data")
    data_split: str = setting("2,4,4", "relative shares of each preference data set for steps 1,2,3 "
                                       "(DeepSpeed-Chat style)")
    data_output_path: str = setting(os.path.join(os.environ.get("TMPDIR", "/tmp"), "chatrl_data"),
                                    "tokenized-data cache folder (keyed by a hash of every input)", path="file")
    eval_data_path: list | None = setting(None, "explicit eval sources; by default a held-out share of each phase "
                                                "is used", nargs="*", type=str, path="data")
    eval_fraction: float = setting(0.05, "share of each phase held out for eval", unit="fraction")
    max_seq_len: int = setting(512, "max tokens of prompt + answer", unit="tokens")
    unsupervised_dataset_name: list | None = setting(None, "step 3: text for the PTX loss (step-1 style data); "
                                                           "unset: no PTX loss", nargs="*", type=str, path="data")

    def ptx_text(self, max_seq_len: int) -> DataConfig:
        """The data block of step 3's PTX text (``--unsupervised_dataset_name``): all of it phase 1's
        (``data_split`` 10,0,0), cut to ``max_seq_len`` tokens, 5% held out, in this block's cache."""
        return DataConfig(data_path=self.unsupervised_dataset_name, data_split="10,0,0",
                          data_output_path=self.data_output_path, eval_data_path=None, eval_fraction=0.05,
                          max_seq_len=max_seq_len)


@dataclass
class TemplateCheckConfig:
    """The chat-template check at start-up (steps 1 and 3, docs/multi_turn.md)."""

    skip_template_check: bool = setting(False, "do not stop when the chat-template check on a few data rows fails at "
                                               "start-up (python -m chatrl.tools.check_template); the skip is logged")


@dataclass
class EosCheckConfig:
    """Whether greedy answers end their turn (steps 1 and DPO)."""

    eval_eos_samples: int = setting(0, "at the end, greedily answer this many eval prompts and report the share "
                                       "ending in EOS", unit="prompts")
    eval_max_new_tokens: int = setting(64, "answer budget of that EOS check", unit="tokens")


@dataclass
class BatchConfig:
    """Batch sizes of steps 1-2 (step 3's are in :class:`RolloutConfig` and :class:`PPOConfig`)."""

    per_device_train_batch_size: int = setting(4, "micro-batch per rank", unit="samples")
    per_device_eval_batch_size: int = setting(8, "eval batch per rank", unit="samples")
    eval_iters: int = setting(0, "cap on eval batches per rank (0: whole eval split)", unit="batches")


@dataclass
class OptimConfig:
    """Optimizer, schedule and length of training."""

    learning_rate: float = setting(1e-3, "peak learning rate", per_model=True)
    weight_decay: float = setting(0.0, "AdamW weight decay (not on biases / norms)", per_model=True)
    gradient_accumulation_steps: int = setting(1, "micro-batches per optimizer step")
    num_train_epochs: int = setting(1, "passes over the training split (step 3: over the prompts)")
    max_steps: int = setting(0, "stop after this many optimizer steps (step 3: experience buffers); 0: no limit",
                             unit="steps")
    lr_scheduler_type: str = setting("cosine", "learning-rate schedule (transformers.get_scheduler)",
                                     choices=("linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                                              "constant_with_warmup"))
    num_warmup_steps: float | None = setting(
        None, "linear warm-up of the learning rate: a whole number of optimizer steps, or a fraction of the run "
              "below 1 (0.1: its first tenth). Unset: the program's default (0; step 3: DeepSpeed-Chat's 100), cut "
              "to a tenth of a shorter run, with a note (chatrl.sizes.warmup_steps)", unit="optimizer steps",
        type=float)
    gradient_clipping: float = setting(1.0, "global gradient-norm clip (0: off)")
    seed: int = setting(1234, "seed of data order, splits and initialisation")


@dataclass
class ZeroConfig:
    """DeepSpeed ZeRO and placement."""

    zero_stage: int = setting(0, "DeepSpeed ZeRO stage", choices=(0, 1, 2, 3), per_model=True)
    offload: bool = setting(False, "ZeRO-Offload: optimizer states (and stage-3 params) to CPU")
    offload_reference_model: bool = setting(False, "the frozen reference model's parameters on CPU (with ZeRO-3; "
                                                   "step 3 and DPO)")
    offload_reward_model: bool = setting(False, "step 3: reward model's parameters on CPU (with ZeRO-3)")
    partition_frozen_models: str = setting(
        "auto", "beside a ZeRO-3 model, ZeRO-3-partition the frozen reference (and step 3's reward model): "
        "'always' (DeepSpeed-Chat's rule; every forward all-gathers them), 'never' (a whole copy per rank), "
        "'auto' (whole unless its weights exceed 1/8 of a rank's device memory); --offload_reference_model / "
        "--offload_reward_model always partition their model", choices=("auto", "always", "never"))
    local_rank: int = setting(-1, "set by the DeepSpeed launcher; ignore")


@dataclass
class HybridEngineConfig:
    """The actor's inference layout for generation (see docs/hybrid_engine.md)."""

    enable_hybrid_engine: bool = setting(False, "generate with the hybrid engine (gathered/TP-sharded copy, KV cache)")
    inference_tp_size: int = setting(1, "tensor-parallel ranks per generation group", unit="ranks")
    tp_gather_partition_size: int = setting(8, "decoder layers per ZeRO-3 all-gather when building the copy",
                                            unit="layers")
    release_inference_cache: bool = setting(False, "free the inference copy after each rollout (ZeRO-3 memory back "
                                                   "for training; rebuilt at the next rollout)")
    unpin_actor_parameters: bool = setting(False, "accepted for DeepSpeed-Chat compatibility and ignored")
    debug_stale_weights: bool = setting(False, "testing: never refresh the inference copy once built (its version "
                                               "still follows the actor), as a sync that silently fails would; the "
                                               "weight-version check must stop the run")


@dataclass
class SamplingConfig:
    """How answers are sampled."""

    temperature: float = setting(1.0, "sampling temperature (0: greedy decoding)")
    top_k: int = setting(0, "sample among the k most likely tokens (0: off)", unit="tokens")
    top_p: float = setting(1.0, "nucleus sampling mass (1: off)", unit="probability")

    @property
    def scored(self) -> tuple[float, int, float]:
        """``(temperature, top_k, top_p)`` of the distribution the answers are drawn from, as a forward
        pass scores their log-probs: these settings, except greedy decoding (``--temperature 0``),
        scored at ``T = 1`` without filters (``docs/critic_free.md``, "Temperature, top-k and top-p")."""
        return (self.temperature, self.top_k, self.top_p) if self.temperature > 0 else (1.0, 0, 1.0)


@dataclass
class RolloutConfig:
    """Step 3's prompts and answers: sizes of one experience buffer."""

    max_prompt_seq_len: int = setting(256, "prompt tokens (longer prompts keep their end)", unit="tokens")
    max_answer_seq_len: int = setting(256, "generated tokens per answer", unit="tokens")
    per_device_generation_batch_size: int = setting(4, "prompts per rank per generation", unit="prompts")
    generation_batches: int = setting(1, "generation batches per experience buffer")
    print_answers: bool = setting(False, "print a prompt and its answer every --print_answers_interval steps")
    print_answers_interval: int | None = setting(None, "steps between the rollouts recorded in logs/samples.jsonl "
                                                       "(and printed with --print_answers); unset: 10, or a quarter "
                                                       "of a shorter run", unit="steps", type=int)


@dataclass
class EnvConfig:
    """Step 3's multi-turn episodes with an environment (docs/multi_turn.md)."""

    env: str | None = setting(None, "environment of multi-turn episodes: a built-in (calculator, guess_number), "
                                    "module:Class or file.py:Class, one instance per episode (unset: one answer "
                                    "per prompt)", type=str, path="reward_fn")
    env_args: str = setting("{}", "keyword arguments of the environment's class, a JSON object")
    max_turns: int | None = setting(None, "assistant turns per episode with --env (unset: 4)", unit="turns", type=int)
    max_total_tokens: int | None = setting(
        None, "bound on an episode's tokens (prompt, assistant turns, observations) with --env (unset: "
              "--max_prompt_seq_len + (2 --max_turns - 1) --max_answer_seq_len: an observation as long as a turn)",
        unit="tokens", type=int)


@dataclass
class PPOConfig:
    """Step 3's RL hyper-parameters, for every algorithm (PPO's defaults are DeepSpeed-Chat's; docs/ppo.md,
    docs/critic_free.md). What the trainer takes."""

    per_device_training_batch_size: int = setting(4, "rollouts per PPO micro-batch (also of the experience passes)",
                                                  unit="rollouts")
    ppo_epochs: int = setting(1, "passes over each experience buffer")
    init_kl_coef: float = setting(0.1, "beta of the per-token KL penalty")
    kl_ctl: str = setting("fixed", "KL coefficient controller (adaptive: Ziegler et al. 2019)",
                          choices=("fixed", "adaptive"))
    kl_target: float = setting(6.0, "adaptive controller's target KL", unit="nats per answer")
    kl_horizon: float | None = setting(None, "adaptive controller's horizon (unset: 10000, or the run's rollouts "
                                             "when fewer)", unit="rollouts", type=float)
    kl_estimator: str = setting("k1", "per-token KL estimator (Schulman's k1/k3, |log r|, squared)",
                                choices=("k1", "k3", "abs", "mse"))
    clip_reward_value: float = setting(5.0, "scores are clipped to +-this before the KL penalty")
    cliprange: float = setting(0.2, "PPO policy ratio clip epsilon")
    cliprange_value: float = setting(0.2, "ppo: value clip around the experience's values")
    gamma: float = setting(1.0, "ppo: discount factor of GAE")
    lam: float = setting(0.95, "ppo: lambda of GAE")
    whiten_advantages: bool = setting(False, "ppo: normalise advantages over the buffer's answer tokens")
    separate_experience_pass: bool = setting(
        False, "run the actor's and critic's experience forwards even when the rollout batch is one training "
               "micro-batch (by default the first training pass's forwards give the same old log-probs and "
               "values, saving two forward passes per rollout batch): the plain path, for checks")
    penalty_no_eos: float = setting(0.0, "subtracted from the score of answers without EOS")
    unsup_coef: float = setting(27.8, "PTX loss coefficient (with --unsupervised_dataset_name)")
    enable_ema: bool = setting(False, "keep an exponential moving average of the actor (saved as actor_ema/)")
    ema_beta: float = setting(0.992, "EMA decay per actor optimizer step")
    rl_algorithm: str = setting("ppo", "the RL algorithm (chatrl.rl.algorithms): ppo (actor-critic, GAE) or a "
                                       "critic-free one: grpo (group-relative), rloo (leave-one-out baseline), "
                                       "reinforce_pp (REINFORCE++, globally whitened); see docs/critic_free.md",
                                choices=algorithms.names)
    num_samples_per_prompt: int | None = setting(None, "answers sampled per prompt, one group (unset: the "
                                                       "algorithm's default: 4 for grpo and rloo, else 1)",
                                                 unit="answers", type=int)
    kl_in: str = setting("reward", "where the KL to the reference goes, with coefficient --init_kl_coef: reward "
                                   "(a per-token penalty, --kl_estimator) or loss (a loss term, --kl_loss_estimator)",
                         choices=KL_PLACEMENTS)
    kl_loss_estimator: str = setting(
        "k3+", "with --kl_in loss, the KL loss term: k3+ (k3's value, an unbiased KL, with k2's gradient), k2 "
               "(0.5 (log pi - log pi_ref)^2); both pull by grad KL(pi||pi_ref) on average; or k3 as written "
               "(GRPO's; its gradient is that of KL(pi_ref||pi)); docs/critic_free.md", choices=KL_LOSS_ESTIMATORS)
    loss_agg_mode: str | None = setting(None, "how the policy loss is averaged over the optimizer step: "
                                              "micro-batch-token-mean (each micro-batch's token mean, DeepSpeed-Chat's) "
                                              "or a global count, invariant to micro-batches and ranks (unset: the "
                                              "algorithm's, token-mean; PPO's critic follows: a token mean of the "
                                              "optimizer step, or of each micro-batch with micro-batch-token-mean)",
                                        choices=LOSS_AGG_MODES, type=str)
    cliprange_low: float | None = setting(None, "lower ratio clip epsilon (unset: --cliprange)", type=float)
    cliprange_high: float | None = setting(None, "upper ratio clip epsilon (unset: --cliprange_low; larger: DAPO's "
                                                 "clip-higher)", type=float)
    rollout_is_cap: float = setting(0.0, "importance-sampling correction of the gap between sampler and training "
                                         "log-probs: the upper bound of the ratio's band, weights capped at it (0: off)")
    rollout_is_level: str = setting("token", "the correction's ratio: per token, per answer (sequence: the product "
                                             "of its tokens' ratios) or per answer as their geometric mean",
                                    choices=ROLLOUT_IS_LEVELS)
    rollout_is_mode: str = setting("truncate", "a ratio above --rollout_is_cap is capped (truncate), or a ratio "
                                               "outside [--rollout_is_cap_low, --rollout_is_cap] gets weight 0 (mask: "
                                               "the token or the whole answer is dropped)", choices=ROLLOUT_IS_MODES)
    rollout_is_cap_low: float | None = setting(None, "lower bound of the band in mask mode (unset: 1 / "
                                                     "--rollout_is_cap)", type=float)
    grpo_no_std_scaling: bool = setting(False, "grpo: do not divide by the group's reward std (Dr. GRPO)")

    @property
    def algorithm(self) -> algorithms.Algorithm:
        """The :class:`chatrl.rl.algorithms.Algorithm` named by ``rl_algorithm``."""
        return algorithms.get(self.rl_algorithm)

    @property
    def samples_per_prompt(self) -> int:
        """``--num_samples_per_prompt``, or the algorithm's default group size when unset."""
        n = self.num_samples_per_prompt
        return self.algorithm.default_samples_per_prompt if n is None else n

    @property
    def loss_aggregation(self) -> str:
        """``--loss_agg_mode``, or the algorithm's default when unset."""
        return self.loss_agg_mode or self.algorithm.loss_agg_mode

    def kl_controller(self, horizon: float) -> core.FixedKLController | core.AdaptiveKLController:
        """The KL coefficient's controller (``--kl_ctl``), starting at ``--init_kl_coef``: adaptive
        (Ziegler et al. 2019), steering toward ``--kl_target`` over ``horizon`` rollouts (the planned
        :attr:`chatrl.sizes.PPOPlan.kl_horizon`), or fixed."""
        if self.kl_ctl == "adaptive":
            return core.AdaptiveKLController(self.init_kl_coef, self.kl_target, horizon)
        return core.FixedKLController(self.init_kl_coef)

    @property
    def clip_bounds(self) -> tuple[float, float]:
        """``(eps_low, eps_high)`` of the ratio clip: ``--cliprange_low``/``--cliprange_high``, each
        defaulting to the other and then to ``--cliprange``."""
        low = self.cliprange if self.cliprange_low is None else self.cliprange_low
        return low, (low if self.cliprange_high is None else self.cliprange_high)


@dataclass
class RewardConfig:
    """Step 3's reward: the reward model, Python functions, HTTP servers, summed with weights (docs/rewards.md)."""

    reward_fn: list = setting([], "reward functions, each [WEIGHT*]module:function, file.py:function or a built-in "
                                  "(exact_match, regex_format); no reward model is loaded when only functions or "
                                  "URLs are given", nargs="+", type=str, path="reward_fn")
    reward_url: list = setting([], "reward servers, each [WEIGHT*]http://host:port/path "
                                   "(python -m chatrl.tools.reward_server)", nargs="+", type=str)
    reward_http_timeout: float = setting(60.0, "timeout of one reward request", unit="s")
    reward_http_retries: int = setting(2, "retries of a failed reward request")
    reward_http_batch_size: int = setting(256, "answers per reward request", unit="answers")


@dataclass
class PackingConfig:
    """Padding-free training (docs/packing.md)."""

    packing: bool = setting(False, "lay the sequences of each training micro-batch end to end in rows, position ids "
                                   "restarting at each sequence: no padding is computed and every per-sequence "
                                   "number equals the padded batch's (model families opt, llama, qwen2; generation "
                                   "keeps its padded decode)")
    max_tokens_per_micro_batch: int = setting(0, "cut each optimizer step's samples into consecutive micro-batches "
                                                 "of at most this many tokens (packed: their sum; padded: count x "
                                                 "longest; a longer sample goes alone) instead of a fixed number of "
                                                 "samples each; the step's samples, its loss and its gradient stay "
                                                 "the same (0: --per_device_train_batch_size / "
                                                 "--per_device_training_batch_size samples each)", unit="tokens")

    def __post_init__(self):
        """Raises: ValueError: a negative ``--max_tokens_per_micro_batch``."""
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError(f"--max_tokens_per_micro_batch must be >= 0, got {self.max_tokens_per_micro_batch}")


@dataclass
class LogConfig:
    """Output folder, metrics and progress."""

    output_dir: str = setting(REQUIRED, "folder of the HF-format result, its logs and checkpoints", type=str,
                              path="file")
    overwrite_output_dir: bool = setting(False, "allow replacing a finished run's output")
    eval_interval: int = setting(0, "evaluate every N optimizer steps (0: per epoch only)", unit="steps")
    log_interval: int = setting(1, "log training metrics every N optimizer steps", unit="steps")
    enable_tensorboard: bool = setting(False, "also write TensorBoard events")
    tensorboard_path: str | None = setting(None, "TensorBoard folder (unset: OUTPUT_DIR/logs/tb)", type=str,
                                           path="file")
    disable_progress_bar: bool = setting(False, "no tqdm bar on rank 0")


@dataclass
class CheckpointConfig:
    """Resumable checkpoints and fault handling."""

    save_interval: int = setting(0, "write a resumable checkpoint every N optimizer steps to OUTPUT_DIR/checkpoints "
                                    "(0: off)", unit="steps")
    save_total_limit: int = setting(2, "keep only the newest N checkpoints (N >= 1)")
    resume: bool = setting(False, "continue from the newest complete checkpoint, if any")
    resume_from_checkpoint: str | None = setting(None, "continue from this checkpoint folder "
                                                       "(OUTPUT_DIR/checkpoints/step_N); wins over --resume", type=str,
                                                 path="file")
    stop_after_steps: int = setting(0, "testing: stop after N optimizer steps without the final save, as a crash "
                                       "would", unit="steps")
    max_nonfinite_steps: int = setting(10, "steps with non-finite loss or gradients are skipped; stop (with a "
                                           "checkpoint) after this many in a row (0: never stop)", unit="steps")
    debug_nonfinite_steps: list = setting([], "testing: make the loss (step 3: the reward) NaN at these steps (tests the non-finite "
                                              "guard)", nargs="*", type=int)


@dataclass
class SnapshotConfig:
    """HF-format snapshots of the trained model during training (step 3 and DPO), for ``python -m chatrl.eval``."""

    save_hf_interval: int = setting(0, "write an HF-format copy of the trained model every N optimizer steps "
                                       "(step 3: experience buffers) to OUTPUT_DIR/snapshots/step_N, which the "
                                       "evaluation reads as a checkpoint series (0: off)", unit="steps")


@dataclass
class CertificateConfig:
    """The run's correctness certificate (OUTPUT_DIR/certificate.json) and step 3's rollout records
    (docs/certificate.md)."""

    disable_loss_scale_probe: bool = setting(False, "skip the loss-scale check of the first optimizer step (it keeps a "
                                                    "copy of the initial weights on rank 0 until then)")
    logp_diff_bound: float | None = setting(None, "step 3: bound on the largest per-token sampler/trainer log-prob gap "
                                                  "of the run (unset: the dtype's, docs/certificate.md)", unit="nats",
                                            type=float)
    save_rollouts: int = setting(0, "step 3: write every N-th step's batch (tokens, masks, log-probs, rewards, "
                                    "advantages, ratios, clip flags, weight version) to OUTPUT_DIR/rollouts, for "
                                    "python -m chatrl.tools.inspector and chatrl.tools.replay (0: off)", unit="steps")


# ------------------------------------------------------------------------------------- generation
class Parser(argparse.ArgumentParser):
    """The command-line parser of every chatrl program.

    * No abbreviations: ``--learning_rat`` is an unknown flag, not ``--learning_rate`` (argparse's
      ``allow_abbrev``, on by default, accepted any unambiguous prefix silently).
    * A usage error is one line, ``PROG: error: MESSAGE``, with the closest flag name when the
      message names an unknown one, printed by rank 0 only (``RANK`` of a multi-rank launch; the
      other ranks exit quietly with the same code 2), instead of the whole usage on every rank.
    * ``raise_errors = True`` makes a usage error raise :class:`chatrl.errors.UsageError` instead
      (``train.py`` checks a step's command line before launching it).
    """

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.raise_errors = False
        self.path_kinds: dict[str, str] = {}  # flag name → what it names on disk (PATH_KINDS)

    def error(self, message: str):
        """Report a usage error (see the class docstring) and exit with code 2, or raise UsageError."""
        unknown = [t.split("=", 1)[0] for t in message.split() if t.startswith("--")] \
            if message.startswith("unrecognized arguments") else []
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        hints = [f"{u} → {m[0]}?" for u in unknown if (m := difflib.get_close_matches(u, known, n=1, cutoff=0.6))]
        if hints:
            message += f" (did you mean: {', '.join(hints)})"
        if self.raise_errors:
            raise UsageError(message)
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")
        raise SystemExit(2)


def new_parser(description: str, prog: str | None = None,
               formatter_class=argparse.ArgumentDefaultsHelpFormatter) -> Parser:
    """An empty :class:`Parser` whose ``--help`` shows every flag's default."""
    return Parser(prog=prog, description=description, formatter_class=formatter_class)


def _flag_names(block, prefixes: tuple[str, ...], only, exclude):
    for f in fields(block):
        if (only is not None and f.name not in only) or (exclude and f.name in exclude):
            continue
        for prefix in (prefixes if f.metadata.get("per_model") and prefixes else ("",)):
            yield f, prefix + f.name


def add_block(p: argparse.ArgumentParser, block, *, prefixes: tuple[str, ...] = (), only=None, exclude=None,
              defaults: dict | None = None, title: str | None = None) -> argparse._ArgumentGroup:
    """Add the flags of ``block`` (a dataclass of :func:`setting` fields) as one argument group.

    Args:
        prefixes: with several trained models (step 3: ``("actor_", "critic_")``), each
            ``per_model`` field becomes one flag per prefix; shared fields stay one flag.
        only, exclude: field names to keep / drop (a program uses part of a block).
        defaults: flag name → default for this program (e.g. ``{"actor_learning_rate": 9.65e-6}``).
        title: the group's title in ``--help`` (default: the block's docstring).

    Raises:
        ValueError: a key of ``defaults`` that is not a flag of this block.
    """
    defaults = dict(defaults or {})
    g = p.add_argument_group(title or (block.__doc__ or block.__name__).strip().splitlines()[0])
    present = {a.dest for a in p._actions}
    for f, name in _flag_names(block, prefixes, only, exclude):
        m = f.metadata
        default = f.default_factory() if f.default is MISSING else f.default
        overridden = name in defaults  # a program's default makes a required field optional there
        default = defaults.pop(name, default)
        if name in present:  # a shared field of a block composed once per model: one flag
            if overridden and p.get_default(name) != default:
                raise ValueError(f"--{name}: two defaults for one shared flag ({p.get_default(name)!r}, {default!r})")
            continue
        who = name[:-len(f.name)].rstrip("_")
        help_text = m["help"] + (f" [{who}]" if who else "") + (f" ({m['unit']})" if m.get("unit") else "")
        kwargs: dict = {"dest": name, "help": help_text}
        if m.get("required") and not overridden:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        if isinstance(default, bool) and not m.get("type"):
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = m.get("type") or type(default)
            if m.get("choices"):
                choices = m["choices"]
                kwargs["choices"] = list(choices() if callable(choices) else choices)
            if m.get("nargs"):
                kwargs["nargs"] = m["nargs"]
        g.add_argument(f"--{name}", **kwargs)
        if m.get("path"):
            if not hasattr(p, "path_kinds"):
                p.path_kinds = {}
            p.path_kinds[name] = m["path"]
    if defaults:
        raise ValueError(f"defaults for unknown flags of {block.__name__}: {sorted(defaults)}")
    return g


@dataclass(frozen=True)
class Use:
    """How a program composes one block (see :func:`add_block` for the arguments)."""

    block: type
    prefix: str = ""
    only: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    defaults: dict | None = None
    title: str | None = None


def uses(block, *, prefix: str = "", only=None, exclude=None, defaults: dict | None = None,
         title: str | None = None):
    """A field of a program's settings dataclass: the program uses ``block``.

    Args:
        prefix: for a block composed once per trained model (step 3: ``"actor_"``, ``"critic_"``),
            its ``per_model`` fields become ``PREFIX + name`` flags; its shared fields are one
            flag, added by the first use.
        only, exclude: field names the program has / does not have (the others keep their
            declared default in the typed block).
        defaults: field name → this program's default (the help, unit and type stay the block's).
        title: the flag group's title in ``--help``.
    """
    return field(default=None, metadata={"use": Use(block, prefix, tuple(only) if only else None,
                                                    tuple(exclude) if exclude else None, dict(defaults or {}),
                                                    title)})


def _uses(settings_cls) -> list[tuple[str, Use]]:
    out = [(f.name, f.metadata["use"]) for f in fields(settings_cls) if "use" in f.metadata]
    if not out:
        raise TypeError(f"{settings_cls.__name__} declares no config.uses(...) field")
    return out


def program_parser(settings_cls, description: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The command-line parser of a program whose blocks ``settings_cls`` declares (:func:`uses`).

    Raises:
        ValueError: a default for a field the block does not have, or two defaults for one shared flag.
    """
    p = new_parser(description, prog=prog)
    for _, use in _uses(settings_cls):
        prefixes = (use.prefix,) if use.prefix else ()
        defaults = {}
        for name, value in (use.defaults or {}).items():
            f = next((f for f in fields(use.block) if f.name == name), None)
            if f is None:
                raise ValueError(f"defaults for unknown field {name!r} of {use.block.__name__}")
            defaults[(use.prefix if f.metadata.get("per_model") else "") + name] = value
        add_block(p, use.block, prefixes=prefixes, only=use.only, exclude=use.exclude, defaults=defaults,
                  title=use.title)
    return p


def setting_flags(settings_cls) -> dict[str, str]:
    """Every flag of the program whose blocks ``settings_cls`` declares (:func:`uses`), mapped to the
    block field it sets (``"actor_optim.learning_rate"``); a shared field of a block used twice is one
    flag, named after its first use."""
    out: dict[str, str] = {}
    for name, use in _uses(settings_cls):
        prefixes = (use.prefix,) if use.prefix else ()
        for f, flag in _flag_names(use.block, prefixes, use.only, use.exclude):
            out.setdefault(flag, f"{name}.{f.name}")
    return out


def read(settings_cls, args: argparse.Namespace):
    """The typed settings of a program: each :func:`uses` field read back as its block (:func:`from_args`)."""
    return settings_cls(**{name: from_args(use.block, args, use.prefix) for name, use in _uses(settings_cls)})


@dataclass
class TrainingSettings:
    """The blocks of a program that trains one model on a data set (steps 1 and 2, DPO): each program
    adds its own blocks and overrides a block's defaults (``optim = uses(OptimConfig, defaults=...)``)."""

    model: ModelConfig = uses(ModelConfig)
    lora: LoraConfig = uses(LoraConfig)
    data: DataConfig = uses(DataConfig, exclude=("unsupervised_dataset_name",), defaults={"max_seq_len": 512})
    batch: BatchConfig = uses(BatchConfig)
    optim: OptimConfig = uses(OptimConfig)
    zero: ZeroConfig = uses(ZeroConfig, only=("zero_stage", "offload", "local_rank"))
    packing: PackingConfig = uses(PackingConfig)
    log: LogConfig = uses(LogConfig)
    ckpt: CheckpointConfig = uses(CheckpointConfig)
    certificate: CertificateConfig = uses(CertificateConfig, only=("disable_loss_scale_probe",))


def from_args(block, args: argparse.Namespace, prefix: str = ""):
    """The typed ``block`` read from parsed flags: ``per_model`` fields from ``PREFIX + name``,
    shared ones from ``name``; fields the program does not have keep their declared default."""
    values = {}
    for f in fields(block):
        name = (prefix + f.name) if f.metadata.get("per_model") else f.name
        if hasattr(args, name):
            values[f.name] = getattr(args, name)
    return block(**values)


def to_argv(parser: argparse.ArgumentParser, values: dict) -> list[str]:
    """Command-line flags for ``values`` (flag name → value), checked against ``parser``.

    ``True`` gives the bare switch, ``False``/``None``/an empty list omit the flag, a list gives its items.

    Raises:
        KeyError: a name that is not one of ``parser``'s flags.
    """
    known = {a.dest for a in parser._actions}
    out: list[str] = []
    for name, value in values.items():
        if name not in known:
            raise KeyError(f"{name}: not a flag of {parser.prog}")
        if value is None or value is False or (isinstance(value, (list, tuple)) and not value):
            continue
        out.append(f"--{name}")
        if value is not True:
            out += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return out
