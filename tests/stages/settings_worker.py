"""Every setting that can change the loss changes it: one launch runs the whole table.

Usage (under torchrun, 2 ranks): settings_worker.py RESULT_JSON WORK_DIR [--programs sft reward dpo ppo]

For each program, a tiny baseline run (two optimizer steps of its real loop, :mod:`tests.stages.loop_runs`)
per context of :data:`tests.stages.settings_table.TABLE` (the plain one twice: the runs must repeat
bit for bit), then one run per table entry with its setting at the table's value. A setting moved
the loss when the first optimizer step's gradient of any trained engine, a logged loss of the two
steps, or the weights the two steps leave (what the next loss is computed with: a learning-rate
schedule acts there first) differ from its baseline's. Rank 0 writes ``{program: {flag: {"distance", "moved", "error"}}}``
and ``"repeat"``: the distance between the two plain baselines.
"""

import argparse
import json
import math
import threading
import time
from pathlib import Path

import torch

from chatrl.distributed import dist
from chatrl.distributed.dist import run_program
from tests.stages.loop_runs import base_argv, run
from tests.stages.settings_table import FIXED_SAMPLER, PERTURBED, REWARD_MODEL, REWARD_URL, TABLE

LOSS_KEYS = ("train/loss", "actor_loss", "critic_loss", "ptx_loss")


#: A setting moved the loss when its run is further than this from its baseline (relative): above the
#: rounding of a re-associated float32 sum, so that a move is an effect of the setting, not of its order.
MOVED = 1e-6


def baseline_argv(program: str, out: Path, work: Path, context: list[str]) -> list[str]:
    """The tiny run of ``program`` a table entry is compared with (step 3: PPO, 4 prompts per rank,
    2 micro-batches of 2 per buffer), with ``context``'s flags (:data:`FIXED_SAMPLER` left out)."""
    context = [c for c in context if c != FIXED_SAMPLER]
    if program == "ppo":
        return base_argv("ppo", work, out, micro=2, gas=1, steps=2, rows=64,
                         extra=["--per_device_generation_batch_size", "4", "--max_steps", "0", *context])
    # one epoch (no --max_steps cap) of 64 SFT rows or 128 pair rows: 6 steps or more; one eval batch before
    return base_argv(program, work, out, micro=2, gas=1, steps=2, rows=64 if program == "sft" else 128,
                     extra=["--max_steps", "0", "--eval_fraction", "0.05", "--eval_iters", "1",
                            "--per_device_eval_batch_size", "2", *context])


def _flag_values(flag: str, value, paths: dict) -> list[str]:
    def sub(v):
        return {PERTURBED: paths["perturbed"], REWARD_MODEL: paths["reward_model"],
                REWARD_URL: paths["reward_url"]}.get(v, v)

    if value is True:
        return [f"--{flag}"]
    if isinstance(value, list):
        return [f"--{flag}", *[sub(v) for v in value]]
    return [f"--{flag}", sub(value)]


def variant_argv(program: str, flag: str, out: Path, work: Path, paths: dict) -> list[str]:
    """The baseline of ``flag``'s context with ``flag`` set to its table value (last: it wins)."""
    value, context = TABLE[program][flag]
    return [*baseline_argv(program, out, work, context), *_flag_values(flag, value, paths)]


def _tensors_distance(a: dict, b: dict) -> float:
    worst = 0.0
    if set(a) != set(b):
        return math.inf
    for i in a:
        ga, gb = a[i], b[i]
        if set(ga) != set(gb):
            return math.inf
        for k in ga:
            if ga[k].shape != gb[k].shape or not torch.equal(torch.isfinite(ga[k]), torch.isfinite(gb[k])):
                return math.inf
            fin = torch.isfinite(ga[k])
            d = (ga[k][fin] - gb[k][fin]).abs().max().item() if fin.any() else 0.0
            worst = max(worst, d / (gb[k][fin].abs().max().item() + 1e-30 if fin.any() else 1.0))
    return worst


def distance(a: dict, b: dict) -> float:
    """How far two runs' observables are: the largest relative difference of the first-step gradients
    (every trained engine), of the logged losses and of the final weights (rank 0 holds them; inf when
    shapes or names differ, or a value is finite in one run only)."""
    worst = max(_tensors_distance(a["grads"], b["grads"]), _tensors_distance(a["weights"] or {}, b["weights"] or {}))
    ra = {r["step"]: r for r in a["rows"]}
    rb = {r["step"]: r for r in b["rows"]}
    if sorted(ra) != sorted(rb):
        return math.inf
    for step in ra:
        for k in LOSS_KEYS:
            x, y = ra[step].get(k), rb[step].get(k)
            if x is None and y is None:
                continue
            if x is None or y is None or math.isfinite(x) != math.isfinite(y):
                return math.inf
            if math.isfinite(x):
                worst = max(worst, abs(x - y) / (abs(y) + 1e-30))
    return worst


def prepare(work: Path, info) -> dict:
    """The table's placeholders: a perturbed copy of stories260K, it as a reward model with a fresh
    head, and a reward server on rank 0 (its URL shared with every rank)."""
    from chatrl.distributed.weights import save_hf_model
    from chatrl.models.causal_lm import load_causal_lm, load_tokenizer
    from chatrl.models.reward_model import load_reward_model, save_reward_model
    from chatrl.rewards import FunctionReward, WeightedReward
    from chatrl.tools.reward_server import make_server
    from tests.conftest import STORIES
    from tests.stages.loop_runs import letter_reward

    perturbed, rm = work / "perturbed", work / "reward_model"
    tok = load_tokenizer(str(STORIES))
    model = load_causal_lm(str(STORIES), tok, "fp32")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_hf_model(model, tok, perturbed)  # rank 0 writes, every rank waits
    save_reward_model(load_reward_model(str(STORIES), tok, require_head=False), tok, rm)
    port = torch.zeros(1, dtype=torch.long)
    if info.is_main:
        server = make_server(WeightedReward([(1.0, FunctionReward(lambda p, a, m: [2 * x for x in letter_reward(p, a, m)],
                                                                   name="url"))]))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port[0] = server.server_address[1]
    port = dist.all_reduce_sum(port)
    return {"perturbed": str(perturbed), "reward_model": str(rm), "reward_url": f"http://127.0.0.1:{int(port)}/score"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("result")
    p.add_argument("work")
    p.add_argument("--programs", nargs="+", default=["sft", "reward", "dpo", "ppo"])
    p.add_argument("--only", nargs="*", default=None, help="flags to run (default: all of the table)")
    a = p.parse_args()
    info = dist.init_distributed()
    work = Path(a.work)
    paths = prepare(work, info)
    result, t0 = {"times": {}}, time.time()
    for program in a.programs:
        out: dict = {}
        baselines: dict[tuple, dict] = {}
        for i, (flag, (_, context)) in enumerate(TABLE[program].items()):
            if a.only and flag not in a.only:
                continue
            key, fixed = tuple(context), FIXED_SAMPLER in context
            if key not in baselines:
                baselines[key] = run(program, baseline_argv(program, work / f"{program}-base{len(baselines)}", work,
                                                            context), weights=True, fixed_sampler=fixed)
                if not context:
                    again = run(program, baseline_argv(program, work / f"{program}-again", work, context),
                                weights=True)
                    result.setdefault("repeat", {})[program] = distance(again, baselines[key])
            t = time.time()
            try:
                got = run(program, variant_argv(program, flag, work / f"{program}-{i}", work, paths), weights=True,
                          fixed_sampler=fixed)
                d = distance(got, baselines[key])
                out[flag] = {"distance": d, "moved": d > MOVED, "error": None}
            except Exception as err:  # noqa: BLE001 - recorded, the test names it
                out[flag] = {"distance": None, "moved": False, "error": f"{type(err).__name__}: {err}"[:800]}
            result["times"][f"{program}:{flag}"] = round(time.time() - t, 2)
        result[program] = out
    result["total_s"] = time.time() - t0
    if info.is_main:
        Path(a.result).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    run_program(main)
