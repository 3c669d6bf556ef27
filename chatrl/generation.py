"""Generation checks shared by the training steps: left-padding prompts and the share of greedy
answers that end their turn (steps 1 and DPO report it after training)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from chatrl.dist import DistInfo, all_reduce_sum
from chatrl.models import base_model, stop_token_ids


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as a left-padded batch: ``(ids (B, P), attention_mask (B, P))``, ``P`` the longest prompt.

    Raises:
        ValueError: no prompt.
    """
    if not prompts:
        raise ValueError("left_pad: no prompt")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.no_grad()
def eos_rate(engine, prompts: Sequence[Sequence[int]], tokenizer, max_new_tokens: int, zero_stage: int,
             info: DistInfo) -> float:
    """Share of greedy answers to ``prompts`` that end their turn within ``max_new_tokens`` (EOS or the
    chat template's end-of-turn token, :func:`chatrl.models.stop_token_ids`); NaN without prompts.

    Every rank calls it with the same ``prompts`` and answers its share (``prompts[rank::world]``,
    padded with a one-token prompt so that every rank generates as many rows: synced decoding under
    ZeRO-3 needs it); the counts are summed over ranks.

    Args:
        engine: a DeepSpeed engine (or module) of a causal LM; left in train mode afterwards.
        prompts: token ids of each prompt (no answer).
        tokenizer: the model's (pad and stop ids).
        max_new_tokens: the answer budget. zero_stage: the engine's ZeRO stage. info: this rank.
    """
    if not prompts:
        return math.nan
    engine.eval()
    mine = list(prompts[info.rank::info.world_size])
    per_rank = math.ceil(len(prompts) / info.world_size)
    batch = mine + [list(prompts[0][:1])] * (per_rank - len(mine))
    ids, mask = left_pad(batch, tokenizer.pad_token_id)
    stops = stop_token_ids(tokenizer, engine)
    out = base_model(getattr(engine, "module", engine)).generate(
        input_ids=ids.to(info.device), attention_mask=mask.to(info.device), max_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id,
        synced_gpus=zero_stage == 3 and info.world_size > 1)
    answers = out[:, ids.shape[1]:]
    ended = torch.isin(answers, torch.tensor(stops, device=answers.device)).any(dim=1)[: len(mine)]
    engine.train()
    counts = all_reduce_sum(torch.tensor([ended.sum().item(), len(mine)], dtype=torch.float64))
    return counts[0].item() / max(counts[1].item(), 1)
