"""The pipeline's presets: each step's flags per deployment and model size (DeepSpeed-Chat's training
scripts), the offline demo and the real-model run, padding-free batches where a family serves them,
and DPO in place of steps 2 and 3. Presets stay ``{flag name: value}`` data until
:func:`chatrl.pipeline.plan.command_flags` writes a step's command line."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from chatrl.packing import BLOCK_MASK_FAMILIES, POSITION_ID_FAMILIES

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("CHATRL_SHARED", REPO.parent / "shared"))

DEFAULT_DATA = ["Dahoas/rm-static", "Dahoas/full-hh-rlhf", "Dahoas/synthetic-instruct-gptj-pairwise",
                "yitingxie/rlhf-reward-datasets"]


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
