"""A small pipeline that resumes where it was killed: steps 1, 2, DPO and 3 in one process, in order.

Usage (under torchrun, 2 ranks): resume_worker.py OUT_ROOT WORK_DIR

Each program trains a few steps into ``OUT_ROOT/NAME`` with a checkpoint after every step and
``--resume``, as ``train.py`` runs them: a program whose folder holds a finished run is skipped, an
unfinished one continues from its newest checkpoint. So the same command, run again after a rank
was killed, finishes the pipeline. Step 1 trains with dropout (its RNG state must come back), DPO
and step 3 start from step 1's model, step 3's critic and reward model from step 2's, with the
hybrid engine and a LoRA actor under ZeRO-3.
"""

import sys
from pathlib import Path

from chatrl.checkpoint import RUN_MARKER
from chatrl.distributed import dist
from chatrl.distributed.dist import run_program
from tests.conftest import DATA, STORIES

HH = str(DATA / "hh-rlhf" / "helpful-base")
STEPS = 4


def programs(out: Path, cache: Path) -> list[tuple[str, str, list[str]]]:
    """``(name, module, argv)`` of the pipeline, in order."""
    common = ["--data_output_path", str(cache), "--save_interval", "1", "--resume", "--disable_progress_bar",
              "--max_steps", str(STEPS), "--seed", "11"]
    supervised = [*common, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                  "--max_seq_len", "96", "--eval_iters", "1", "--per_device_eval_batch_size", "2",
                  "--learning_rate", "2e-3"]
    return [
        ("sft", "chatrl.step1_sft.main", ["--model_name_or_path", str(STORIES), "--data_path", f"{HH}[0:96]",
                                          "--data_split", "10,0,0", "--zero_stage", "3", "--dropout", "0.1",
                                          *supervised]),
        ("reward", "chatrl.step2_reward.main", ["--model_name_or_path", str(STORIES), "--data_path", f"{HH}[0:160]",
                                                "--data_split", "0,10,0", "--zero_stage", "2", "--dropout", "0",
                                                *supervised]),
        ("dpo", "chatrl.step2_dpo.main", ["--model_name_or_path", str(out / "sft"), "--data_path", f"{HH}[0:160]",
                                          "--data_split", "0,10,0", "--zero_stage", "0", "--dropout", "0",
                                          *supervised]),
        ("ppo", "chatrl.step3_ppo.main", ["--actor_model_name_or_path", str(out / "sft"),
                                          "--critic_model_name_or_path", str(out / "reward"),
                                          "--data_path", f"{HH}[0:64]", "--data_split", "0,0,10",
                                          "--max_prompt_seq_len", "24", "--max_answer_seq_len", "8",
                                          "--per_device_generation_batch_size", "4",
                                          "--per_device_training_batch_size", "2", "--actor_zero_stage", "3",
                                          "--critic_zero_stage", "2", "--enable_hybrid_engine", "--actor_lora_dim",
                                          "4", "--actor_learning_rate", "2e-3", "--critic_learning_rate", "2e-3",
                                          "--num_warmup_steps", "0", *common]),
    ]


def main():
    out, work = Path(sys.argv[1]), Path(sys.argv[2])
    import importlib

    dist.init_distributed()
    for name, module, argv in programs(out, work / "cache"):
        folder = out / name
        if (folder / RUN_MARKER).exists():
            continue  # finished by an earlier attempt
        importlib.import_module(module).run([*argv, "--output_dir", str(folder)])
        dist.barrier()


if __name__ == "__main__":
    run_program(main)
