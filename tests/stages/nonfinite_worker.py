"""A NaN loss at one optimizer step is skipped at ZeRO 0, 2 and 3: weights, optimizer and schedule unchanged.

Usage (under torchrun): nonfinite_worker.py MODEL_DIR RESULT_JSON. Rank 0 writes, per ZeRO stage:
how far the weights moved in the poisoned step (must be 0), in the next step (must be > 0), the
engine's skipped-step count, the learning rate before and after the poisoned step, and whether the
guard raised on the 2nd bad step in a row.
"""

import json
import sys

import torch

from chatrl.distributed import dist
from chatrl.distributed.dist import run_program
from chatrl.distributed.resilience import NonFiniteError, NonFiniteGuard
from chatrl.distributed.weights import full_state_dict
from chatrl.models.causal_lm import causal_lm_logits, load_causal_lm, load_tokenizer
from chatrl.sizes import BatchSizes


def flat(engine) -> torch.Tensor:
    state = full_state_dict(engine.module)  # a collective under ZeRO-3: every rank calls it
    return torch.cat([v.flatten() for v in state.values()]) if dist.is_main() else None


def lm_step(engine, ids, mask, poison: bool) -> None:
    logits = causal_lm_logits(engine, ids, mask)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    if poison:
        loss = loss * float("nan")
    engine.backward(loss)
    engine.step()


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    info = dist.init_distributed()
    tok = load_tokenizer(model_dir)
    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(info.rank))
    mask = torch.ones_like(ids)
    result = {}
    for stage in (0, 2, 3):
        torch.manual_seed(0)
        model = load_causal_lm(model_dir, tok)
        opt = dist.make_optimizer(model.parameters(), lr=1e-2, offload=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        engine = dist.initialize(model, dist.deepspeed_config(BatchSizes(2, 1, info.world_size), stage, False,
                                                         "fp32", 1.0), opt, sched)
        guard = NonFiniteGuard({"model": engine}, max_in_a_row=2)

        def train_step(poison: bool, engine=engine):
            lm_step(engine, ids, mask, poison and info.rank == 1)  # one rank's loss is NaN: every rank must skip

        train_step(False)
        guard.after_step(1)
        w0, lr0 = flat(engine), sched.get_last_lr()[0]
        train_step(True)
        skipped_flag = guard.after_step(2)
        w1, lr1 = flat(engine), sched.get_last_lr()[0]
        train_step(False)
        guard.after_step(3)
        w2 = flat(engine)
        train_step(True)
        guard.after_step(4)
        train_step(True)
        try:
            guard.after_step(5)
            raised = False
        except NonFiniteError:
            raised = True
        if dist.is_main():
            result[f"zero{stage}"] = {
                "moved_poisoned": (w1 - w0).abs().max().item(), "moved_next": (w2 - w1).abs().max().item(),
                "finite": bool(torch.isfinite(w2).all()), "skipped_steps": engine.skipped_steps,
                "guard_skipped": guard.skipped, "flag": skipped_flag, "lr_before": lr0, "lr_after": lr1,
                "raised_at_second_in_a_row": raised}
        dist.barrier()
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    run_program(main)
