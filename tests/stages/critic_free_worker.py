"""Critic-free maths and the reward failure check over 2 real gloo ranks.

Usage (under torchrun, 2 ranks): critic_free_worker.py RESULT_JSON. Each rank trains its half of
the same 8 answers (one group of 4 each, micro-batch 2, accumulation 2) with the global normaliser,
the gradients are summed over ranks and compared with the 1-process gradient of all 8 answers for
every aggregation mode; REINFORCE++ advantages and logp_diff are compared with the whole batch; and
a reward that fails on rank 1 (no server) must raise on both ranks. Rank 0 writes the results.
"""

import json
import sys
import time

import torch
import torch.distributed as tdist

from chatrl.rewards import (
    FunctionReward,
    HttpReward,
    RewardBatch,
    RewardError,
    WeightedReward,
    score_on_all_ranks,
)
from chatrl.rl.loss import GLOBAL_LOSS_AGG_MODES, logp_diff
from chatrl.rl.stats import PooledStats
from chatrl.tools.reward_server import make_server
from tests.unit.test_critic_free import ToyBatch, critic_free_advantages, step_grad, toy_setup


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    tdist.all_reduce(t, op=tdist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t


def main():
    out = sys.argv[1]
    tdist.init_process_group("gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    assert world == 2
    result = {"grad_diff": {}}
    W, tokens, mask, old, ref, scores = toy_setup()
    rows = slice(4 * rank, 4 * rank + 4)
    for mode in GLOBAL_LOSS_AGG_MODES:
        full_adv = critic_free_advantages("grpo", scores, mask, 4)
        local_adv = torch.zeros_like(full_adv)  # only this rank's rows are read
        local_adv[rows] = critic_free_advantages("grpo", scores[rows], mask[rows], 4)
        grad = step_grad(ToyBatch(W, tokens, mask, old, ref, local_adv), rows, 2, 2, mode, all_reduce_sum)
        grad = all_reduce_sum(grad)
        one = step_grad(ToyBatch(W, tokens, mask, old, ref, full_adv), slice(0, 8), 8, 1, mode)
        result["grad_diff"][mode] = (grad - one).abs().max().item()
        result["grad_norm"] = one.norm().item()

    rpp = critic_free_advantages("reinforce_pp", scores[rows], mask[rows], 4, all_reduce_sum=all_reduce_sum)
    gathered = [torch.zeros_like(rpp) for _ in range(world)]
    tdist.all_gather(gathered, rpp)
    whole = critic_free_advantages("reinforce_pp", scores, mask, 4)
    result["reinforce_pp_diff"] = (torch.cat(gathered) - whole).abs().max().item()

    sampler = old + 0.01 * torch.arange(8.0).unsqueeze(1)  # row r differs by 0.01 r
    diff = logp_diff(sampler[rows], old[rows], mask[rows], all_reduce_sum, all_reduce_max)
    whole_diff = logp_diff(sampler, old, mask)
    result["logp_diff"] = {k: (v.item(), whole_diff[k].item()) for k, v in diff.items()}

    # Logged statistics pooled over the two ranks: rank 0 scores 0, rank 1 scores 1 (std 0.5 over both);
    # a token mean over ranks holding 6 and 7 tokens.
    stats = PooledStats()
    stats.add_std("reward/score_std", torch.full((3,), float(rank)))
    stats.add_mean("entropy", torch.full((2, 5), float(rank)), mask[rows][:2])
    result["pooled"] = stats.finish(all_reduce_sum)
    result["pooled_tokens"] = all_reduce_sum(mask[rows][:2].sum().double().reshape(1)).item()
    result["pooled_rank1_tokens"] = mask[4:6].sum().item()

    # Rank 0 asks a working server; rank 1 a port where nothing listens.
    reward = WeightedReward([(1.0, FunctionReward("exact_match"))])
    server = make_server(reward, "127.0.0.1", 0)
    import threading

    threading.Thread(target=server.serve_forever, daemon=True).start()
    from chatrl.distributed.dist import free_port

    port = server.server_address[1] if rank == 0 else free_port()  # nothing listens there
    source = HttpReward(f"http://127.0.0.1:{port}/", timeout=2, retries=1)
    batch = RewardBatch(["q"], ["7"], [{"reference": "7"}], step=11)
    t0 = time.time()
    try:
        score_on_all_ranks(lambda: source(batch), rank=rank, world_size=world, all_reduce_sum=all_reduce_sum, step=11)
        msg = "no error"
    except RewardError as exc:
        msg = str(exc)
    msgs = [None] * world
    tdist.all_gather_object(msgs, {"msg": msg, "seconds": time.time() - t0})
    result["reward_failure"] = msgs
    server.shutdown()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
