"""Run step 3's program over the launcher's ranks and record every rank's sampled answers.

Usage (under torchrun): rollout_seed_worker.py RESULT_JSON -- <step-3 flags>. Rank 0 writes
RESULT_JSON with ``answers[rank]``: the generated token ids of each rollout, in order.
"""

import json
import sys

import torch

import chatrl.step3_ppo.main as step3
from chatrl.distributed import dist
from chatrl.distributed.dist import run_program
from chatrl.hybrid_engine import HybridEngine


def main():
    out_path, rest = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    seen = []
    make_sampler = HybridEngine.sampler

    def recording(hybrid, *args, **kwargs):
        sampler = make_sampler(hybrid, *args, **kwargs)
        generate = sampler.generate

        def gen(ids, mask):
            out = generate(ids, mask)  # (sequences, sampler log-probs)
            seen.append(out[0][:, ids.shape[1]:].cpu())
            return out

        sampler.generate = gen
        return sampler

    HybridEngine.sampler = recording
    step3.main(rest)
    mine = torch.cat(seen)
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    torch.distributed.all_gather(parts, mine)
    if dist.is_main():
        with open(out_path, "w") as f:
            json.dump({"answers": [p.tolist() for p in parts]}, f)


if __name__ == "__main__":
    run_program(main)
