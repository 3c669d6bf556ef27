"""Which setting of which program can change the loss, and how to change it on a tiny run.

Every flag of every training program (its settings dataclass, :func:`chatrl.config.setting_flags`)
is in exactly one of two places:

* :data:`TABLE`: a non-default value (and, when the setting only acts together with another, a
  context of extra flags given to the baseline and the variant alike; :data:`FIXED_SAMPLER` in a
  context: step 3's answers come from a sampler of varied lengths); the setting must move the
  first optimizer step's gradient, the loss of the first two steps, or the weights they leave, of a
  tiny run by more than rounding
  (``tests/stages/settings_worker.py``, ``test_certificate.py::test_every_setting_that_can_change_the_loss_changes_it``);
* :data:`CANNOT_CHANGE` (with :func:`cannot_change`): settings that cannot change the loss, each with
  the reason.

A new setting that is in neither fails ``tests/unit/test_settings_table.py``; one in the table that
moves nothing (read nowhere) fails the stage test.
"""

from __future__ import annotations

from tests.stages.loop_runs import ALPACA, HH

PERTURBED = "@perturbed"  # stories260K with every weight moved a little (the worker makes it)
FIXED_SAMPLER = "@fixed_sampler"  # in a context: step 3's answers from loop_runs.answer_sampler (lengths vary)
REWARD_MODEL = "@reward_model"  # stories260K as a reward model with a fresh head (the worker makes it)
REWARD_URL = "@reward_url"  # a reward server on rank 0 (the worker starts it)
LORA, ACTOR_LORA, CRITIC_LORA = ["--lora_dim", "4"], ["--actor_lora_dim", "4"], ["--critic_lora_dim", "4"]

# -------------------------------------------------------------------------------------- steps 1, 2, DPO
_SUPERVISED = {
    # flag: (value, context flags)
    "model_name_or_path": (PERTURBED, []),
    "dtype": ("bf16", []),
    "dropout": ("0.1", []),
    "disable_dropout": (True, ["--dropout", "0.1"]),
    "lora_dim": ("4", []),
    "lora_module_name": ("mlp", LORA),
    "only_optimize_lora": (True, LORA),
    "lora_learning_rate": ("0.05", LORA),
    "data_path": ([f"{HH}[128:256]"], []),
    "eval_data_path": ([f"{HH}[300:310]"], []),  # given: nothing is held out of training
    "eval_fraction": ("0.5", []),
    "max_seq_len": ("40", []),
    "per_device_train_batch_size": ("3", []),
    "learning_rate": ("3e-2", []),
    "weight_decay": ("0.5", []),
    "gradient_accumulation_steps": ("2", []),
    "num_train_epochs": ("2", []),  # the schedule spans the epochs (the baseline: one, no --max_steps)
    "max_steps": ("3", []),  # the schedule spans these steps instead of the epoch
    "lr_scheduler_type": ("linear", []),
    "num_warmup_steps": ("1", []),
    "gradient_clipping": ("1e-4", []),
    "seed": ("8", []),
    "debug_nonfinite_steps": (["1"], []),
}

TABLE: dict[str, dict[str, tuple]] = {
    "sft": {**_SUPERVISED, "data_split": ("10,10,0", []), "include_prompt_loss": (True, [])},
    "reward": {**_SUPERVISED, "data_split": ("0,10,10", [])},
    "dpo": {**_SUPERVISED, "data_split": ("0,10,10", []), "beta": ("0.5", []), "label_smoothing": ("0.2", []),
            "loss_type": ("ipo", []), "rpo_alpha": ("1.0", []), "simpo_gamma": ("1.0", ["--loss_type", "simpo"])},
}

# ---------------------------------------------------------------------------------------------- step 3
ADAPTIVE, PTX = ["--kl_ctl", "adaptive"], ["--unsupervised_dataset_name", f"{ALPACA}[0:32]"]
TABLE["ppo"] = {
    "actor_model_name_or_path": (PERTURBED, []),
    "critic_model_name_or_path": (REWARD_MODEL, []),  # else the critic starts from the actor
    "reward_model_name_or_path": (REWARD_MODEL, []),  # summed with the reward function
    "reward_fn": (["regex_format"], []),
    "reward_url": ([REWARD_URL], []),
    "dtype": ("bf16", []),
    "actor_learning_rate": ("3e-2", []),
    "critic_learning_rate": ("3e-2", []),
    "actor_weight_decay": ("0.5", []),
    "critic_weight_decay": ("0.5", []),
    "actor_lora_dim": ("4", []),
    "critic_lora_dim": ("4", []),
    "actor_lora_module_name": ("mlp", ACTOR_LORA),
    "critic_lora_module_name": ("mlp", CRITIC_LORA),
    "actor_lora_learning_rate": ("0.05", ACTOR_LORA),
    "critic_lora_learning_rate": ("0.05", CRITIC_LORA),
    "only_optimize_lora": (True, ACTOR_LORA),
    "data_path": ([f"{HH}[128:256]"], []),
    "data_split": ("0,10,10", []),
    "unsupervised_dataset_name": ([f"{ALPACA}[0:32]"], []),
    "unsup_coef": ("1e-3", PTX),  # PTX gradients as small as the policy's (Adam normalises each step's scale)
    "max_prompt_seq_len": ("12", []),
    "max_answer_seq_len": ("4", []),
    "per_device_generation_batch_size": ("2", []),
    "generation_batches": ("2", []),
    "per_device_training_batch_size": ("1", []),  # four micro-batches per buffer: four optimizer steps, not two
    "gradient_accumulation_steps": ("2", []),
    "num_train_epochs": ("2", []),
    "max_steps": ("3", []),
    "lr_scheduler_type": ("linear", []),
    "num_warmup_steps": ("1", []),
    "gradient_clipping": ("1e-4", []),
    "seed": ("8", []),
    "ppo_epochs": ("2", []),
    "init_kl_coef": ("0.5", []),
    "kl_ctl": ("adaptive", []),
    # the KL is 0 at step 1 (actor = reference), so the target acts on the coefficient of step 3
    "kl_target": ("0.01", [*ADAPTIVE, "--stop_after_steps", "3"]),
    "kl_horizon": ("10", ADAPTIVE),
    "kl_estimator": ("k3", []),
    "kl_in": ("loss", []),
    # k3's gradient (1 - r) against k2's d: they differ once the actor has left the reference (the second
    # micro-batch of step 1); a large coefficient makes the KL term's share of the gradient count
    "kl_loss_estimator": ("k3", ["--kl_in", "loss", "--init_kl_coef", "10"]),
    "clip_reward_value": ("0.01", []),
    "cliprange": ("1e-4", []),
    "cliprange_low": ("1e-4", []),
    "cliprange_high": ("1e-4", []),
    "cliprange_value": ("1e-5", []),
    "gamma": ("0.5", []),
    "lam": ("0.5", []),
    "whiten_advantages": (True, []),
    "penalty_no_eos": ("1.0", []),
    "rl_algorithm": ("rloo", ["--num_samples_per_prompt", "2"]),
    "num_samples_per_prompt": ("2", []),
    "grpo_no_std_scaling": (True, ["--rl_algorithm", "grpo", "--num_samples_per_prompt", "2"]),
    "loss_agg_mode": ("seq-mean-token-mean", [FIXED_SAMPLER]),  # answers of unequal length: the modes differ
    "rollout_is_cap": ("1.0", []),  # weights min(exp(old - sampler), 1): below 1 where the sampler was likelier
    # mask mode with the band [1/C, C] = [1, 1]: a token (or answer) whose ratio is not exactly 1 leaves the loss
    "rollout_is_mode": ("mask", ["--rollout_is_cap", "1.0"]),
    "rollout_is_level": ("sequence", ["--rollout_is_cap", "1.0", "--rollout_is_mode", "mask"]),
    "rollout_is_cap_low": ("0.5", ["--rollout_is_cap", "1.0", "--rollout_is_mode", "mask"]),
    "temperature": ("0.7", []),
    "top_k": ("5", []),
    "top_p": ("0.5", []),
    "debug_nonfinite_steps": (["1"], []),
}

# ---------------------------------------------------------------------------- settings that cannot
_COMMON_CANNOT = {
    # where things are written, what is logged, how often
    "output_dir": "where results go", "overwrite_output_dir": "whether a finished folder may be replaced",
    "data_output_path": "the token cache's folder (keyed by every input)",
    "log_interval": "logging", "enable_tensorboard": "logging", "tensorboard_path": "logging",
    "disable_progress_bar": "logging", "eval_interval": "evaluation only (step 3 has none)",
    # checkpoints and faults: a resumed run follows the uninterrupted one bit for bit (the kill test)
    "save_interval": "checkpoints", "save_total_limit": "checkpoints", "resume": "checkpoints (kill test)",
    "resume_from_checkpoint": "checkpoints (kill test)", "stop_after_steps": "testing: ends the run early",
    "max_nonfinite_steps": "when to give up after skipped steps, not what a step computes",
    "disable_loss_scale_probe": "a check on a copy of the weights",
    # placement and layout: the same numbers (the batch-shape invariance test holds ZeRO 0/2/3 equal)
    "zero_stage": "layout (invariance test)", "offload": "placement", "local_rank": "set by the launcher",
    "trust_remote_code": "permission to run a hub model's code",
    "gradient_checkpointing": "recomputes activations: the same numbers",
    # in fp32, the table's dtype, the LM head computes in fp32 already; in bf16 it changes the logits'
    # rounding (docs/precision.md's gap table, tests/stages/test_bf16.py)
    "fp32_lm_head": "a no-op in fp32",
    # padding-free layout: the padded path's loss and gradient (tests/unit/test_packing_parity.py)
    "packing": "layout: packed rows give the padded numbers (packing parity tests)",
    "max_tokens_per_micro_batch": "layout: micro-batches by token budget give the step's loss and gradient "
                                  "(packing parity tests)",
}
_SUPERVISED_CANNOT = {**_COMMON_CANNOT, "per_device_eval_batch_size": "evaluation", "eval_iters": "evaluation"}
_EOS_CHECK = {"eval_eos_samples": "evaluation", "eval_max_new_tokens": "evaluation"}

CANNOT_CHANGE: dict[str, dict[str, str]] = {
    "sft": {**_SUPERVISED_CANNOT, **_EOS_CHECK, "skip_template_check": "a start-up check",
            "train_all_assistant_turns": "conversation rows only: the table's hh-rlhf rows are prompt/answer pairs "
                                         "(every-turn training: tests/stages/test_multi_turn.py)"},
    "reward": {**_SUPERVISED_CANNOT, "num_padding_at_beginning": "accepted for DeepSpeed-Chat and ignored: the end "
                                                                  "score is read from the mask"},
    "dpo": {**_SUPERVISED_CANNOT, **_EOS_CHECK, "precompute_ref_log_probs": "the same reference log-probs, computed ahead",
            "offload_reference_model": "placement", "partition_frozen_models": "placement of frozen models",
            "save_hf_interval": "snapshots only"},
    "ppo": {**{k: v for k, v in _COMMON_CANNOT.items() if k not in ("zero_stage", "gradient_checkpointing")},
            "actor_zero_stage": "layout (invariance test)", "critic_zero_stage": "layout (invariance test)",
            "actor_gradient_checkpointing": "recomputes activations", "critic_gradient_checkpointing": "recomputes",
            "actor_dropout": "every RL forward pass runs in eval mode (docs/ppo.md, detail 1)",
            "critic_dropout": "every RL forward pass runs in eval mode",
            "offload_reference_model": "placement", "offload_reward_model": "placement",
            "partition_frozen_models": "placement of frozen models",
            "separate_experience_pass": "the same experience, from separate forward passes",
            "enable_ema": "the EMA copy is only saved", "ema_beta": "the EMA copy is only saved",
            "inference_tp_size": "the same distribution, sampled from a tensor-parallel copy (the agreement "
                                 "property bounds its rounding)",
            "enable_hybrid_engine": "the same answers: the inference copy decodes what HF generate decodes, token for "
                                    "token (tests/stages/test_hybrid_engine.py); measured equal by the stage test's run",
            "tp_gather_partition_size": "how the inference copy is gathered", "release_inference_cache": "memory",
            "unpin_actor_parameters": "accepted for DeepSpeed-Chat and ignored",
            "debug_stale_weights": "testing: the weight-version check stops the run (test_certificate)",
            "reward_http_timeout": "transport", "reward_http_retries": "transport",
            "reward_http_batch_size": "transport", "print_answers": "logging", "print_answers_interval": "logging",
            "logp_diff_bound": "the certificate's bound", "save_rollouts": "records", "save_hf_interval": "snapshots only",
            "skip_template_check": "a start-up check",
            # multi-turn episodes need an environment and its rows (the table's runs have neither); their
            # learning is tested by tests/stages/test_multi_turn.py
            "env": "needs an environment's rows", "env_args": "needs --env", "max_turns": "needs --env",
            "max_total_tokens": "needs --env"},
}


def cannot_change(program: str) -> dict[str, str]:
    """The settings of ``program`` that cannot change its loss, with why."""
    return CANNOT_CHANGE[program]
