"""Certificates of healthy and deliberately broken runs, in one launch (2 ranks).

Usage (under torchrun): certificate_worker.py RESULT_JSON WORK_DIR

Runs, each in this process (``tests.stages.loop_runs``'s tiny set-ups, stories260K):

* ``records``: step 3 (PPO), hybrid engine with the actor's LoRA merged into its tensor-parallel
  inference copy (TP 2), actor ZeRO-3, three steps, ``--save_rollouts 2``: every property passes
  (the loss-scale probe of the actor and the critic on); step 2 is recorded, with the checkpoint of
  step 1 (the replay and the inspector read them);
* ``plain``: step 3 without the hybrid engine (the training module samples, its LoRA unmerged), ZeRO-0;
* ``stale``: ``--debug_stale_weights`` (the inference copy is never refreshed): the weight-version
  check must stop the run at the first step whose rollouts come from stale weights (step 2);
* ``dropped_flag``: step 3 at ``--temperature 0.5`` whose trainer scores at temperature 1 (the flag
  dropped on the training side): the agreement property must fail;
* ``sft_ok``: step 1, accumulation 2: the loss-scale property passes;
* ``loss_twice``: the same with the loss divided by the accumulation steps a second time;
* ``skipped_data``: step 1 whose loader skips one batch at the start.

Rank 0 writes ``{case: {"certificate": certificate.json or None, "error": message or None}}``.
"""

import json
import sys
from pathlib import Path

from chatrl import cli
from chatrl.distributed import dist
from chatrl.distributed.dist import run_program
from chatrl.evidence.certificate import read_certificate
from chatrl.evidence.weight_version import WeightVersionError
from tests.stages.loop_runs import base_argv


def step3(out: Path, work: Path, extra: list[str], steps: int = 3, temperature_on_trainer: float | None = None,
          probe: bool = False):
    from chatrl.step3_ppo.main import build, build_parser, train

    argv = base_argv("ppo", work, out, micro=2, gas=1, steps=steps, extra=["--max_steps", str(steps), *extra])
    i = argv.index("--stop_after_steps")
    del argv[i:i + 2]  # run to the end: the certificate is written there
    if probe:
        argv.remove("--disable_loss_scale_probe")
    run = build(cli.parse(build_parser(), argv))
    if temperature_on_trainer is not None:
        run.trainer.temperature = temperature_on_trainer  # the trainer does not read --temperature
    train(run)


def step1(out: Path, work: Path, patch: str | None = None):
    import chatrl.run as lifecycle
    import chatrl.step1_sft.main as sft

    argv = base_argv("sft", work, out, micro=2, gas=2, steps=2, extra=["--max_steps", "2"])
    i = argv.index("--stop_after_steps")
    del argv[i:i + 2]
    argv.remove("--disable_loss_scale_probe")
    saved = sft.sft_nll, lifecycle.batches_from  # the run draws each step's batches
    if patch == "loss_twice":
        sft.sft_nll = lambda *a, **kw: (lambda nll, n: (nll / 2, n))(*saved[0](*a, **kw))  # divided by gas once more
    elif patch == "skipped_data":
        def skipping(loader, step, steps_per_epoch, batches_per_step):
            it = saved[1](loader, step, steps_per_epoch, batches_per_step)
            if step == 0:
                next(it)  # a batch drawn and never fed to the loss
            return it
        lifecycle.batches_from = skipping
    try:
        sft.run(argv)
    finally:
        sft.sft_nll, lifecycle.batches_from = saved


def main():
    result_path, work = Path(sys.argv[1]), Path(sys.argv[2])
    info = dist.init_distributed()
    cases = {
        "records": lambda out: step3(out, work, ["--enable_hybrid_engine", "--inference_tp_size", "2", "--actor_lora_dim",
                                                 "4", "--actor_zero_stage", "3", "--save_rollouts", "2"], probe=True),
        "plain": lambda out: step3(out, work, ["--actor_lora_dim", "4"], steps=2),
        "stale": lambda out: step3(out, work, ["--enable_hybrid_engine", "--actor_zero_stage", "3",
                                               "--debug_stale_weights"]),
        "dropped_flag": lambda out: step3(out, work, ["--temperature", "0.5"], steps=2, temperature_on_trainer=1.0),
        "sft_ok": lambda out: step1(out, work),
        "loss_twice": lambda out: step1(out, work, "loss_twice"),
        "skipped_data": lambda out: step1(out, work, "skipped_data"),
    }
    result = {}
    for name, case in cases.items():
        out = work / name
        error = None
        try:
            case(out)
        except WeightVersionError as err:
            error = str(err)
        dist.barrier()
        result[name] = {"certificate": read_certificate(out), "error": error}
    if info.is_main:
        result_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    run_program(main)
