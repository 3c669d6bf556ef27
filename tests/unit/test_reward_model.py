"""Reward model: end score read from the mask, padding invariance, the pairwise loss, HF round trip."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from chatrl.models.causal_lm import position_ids_from_mask
from chatrl.models.reward_model import (
    MissingRewardHeadError,
    RewardModel,
    gather_end_scores,
    last_token_index,
    load_reward_model,
    pair_stats,
    pairwise_loss,
    save_reward_model,
    with_lora,
)


@functools.cache
def _tok(path):
    """The prepared tokenizer of ``path``, loaded once (0.5 s each); tests do not modify it."""
    from chatrl.models.causal_lm import load_tokenizer

    return load_tokenizer(str(path))


def _rm(path, seed=0):
    """A reward model on ``path`` with a head large enough that scores differ visibly between tokens."""
    tok = _tok(path)
    rm = load_reward_model(str(path), tok, require_head=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        rm.hf.score.weight.normal_(0.0, 1.0)
    return rm.eval(), tok


def _pad(rows, pad_id, side, width=None):
    width = width or max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, sl] = torch.tensor(r)
        mask[i, sl] = 1
    return ids, mask


# ---------------------------------------------------------------- pure functions


def test_last_token_index_left_right_and_full():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 4, 4, 1]
    values = torch.arange(20.0).view(4, 5)
    assert gather_end_scores(values, mask).tolist() == [2.0, 9.0, 14.0, 16.0]


def test_last_token_index_rejects_empty_row():
    with pytest.raises(ValueError, match="no real token"):
        last_token_index(torch.tensor([[1, 1], [0, 0]]))


def test_position_ids_follow_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 0, 0]]


def test_pairwise_loss_hand_values():
    # diff 0 → log 2; diff log(3) → -log(3/4) = log(4/3); margin 1 on a diff of 1 → log 2
    assert pairwise_loss(torch.tensor([0.0]), torch.tensor([0.0])).item() == pytest.approx(math.log(2), abs=1e-7)
    assert pairwise_loss(torch.tensor([math.log(3)]), torch.tensor([0.0])).item() == pytest.approx(
        math.log(4 / 3), abs=1e-6)
    loss = pairwise_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0]), margin=torch.tensor([1.0, 0.0]))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pairwise_loss_finite_for_huge_margins(dtype):
    chosen = torch.tensor([1e4, -1e4, 5e3], dtype=dtype, requires_grad=True)
    rejected = torch.tensor([0.0, 0.0, -5e3], dtype=dtype, requires_grad=True)
    loss = pairwise_loss(chosen, rejected)
    # per pair: softplus(-1e4) = 0, softplus(1e4) = 1e4, softplus(-1e4) = 0 (exactly, in float32);
    # bf16 stores 1e4 as 9984, so the expected mean follows the stored value
    big = chosen[0].float().item()
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(big / 3, rel=1e-6)
    loss.backward()
    assert torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all()
    assert chosen.grad.float().tolist() == pytest.approx([0.0, -1 / 3, 0.0], abs=2e-3)  # bf16 grad rounding


def test_pair_stats():
    s = pair_stats(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 3.0]))
    assert {k: v.item() for k, v in s.items()} == {"count": 3.0, "correct": 1.0, "chosen": 3.0, "rejected": 3.0,
                                                    "margin": 0.0}


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_end_score_independent_of_padding_and_batch(family, side, tiny_opt, tiny_llama):
    rm, tok = _rm(tiny_opt if family == "opt" else tiny_llama)
    short = tok("Human: hi\n\nAssistant: hello!")["input_ids"] + [tok.eos_token_id]
    long = tok("Human: tell me a long story please\n\nAssistant: once upon a time there was a fox")["input_ids"]
    with torch.no_grad():
        alone = rm(torch.tensor([short]), torch.ones(1, len(short), dtype=torch.long)).end_scores
        ids, mask = _pad([short, long, short], tok.pad_token_id, side, width=len(long) + 5)
        out = rm(ids, mask)
    assert out.values.shape == ids.shape and out.end_scores.shape == (3,)
    assert (out.end_scores[0] - alone[0]).abs().item() < 1e-5
    assert (out.end_scores[2] - alone[0]).abs().item() < 1e-5
    # the values at pads are zeroed and the score is a real token's value, not a constant
    assert (out.values[mask == 0] == 0).all()
    assert abs(out.end_scores[0].item() - out.end_scores[1].item()) > 1e-4


@pytest.mark.parametrize("side", ["left", "right"])
def test_bos_eos_pad_same_id_reads_last_answer_token(side, tiny_opt):
    """OPT-style ids: BOS, EOS and pad all 2-like; only the mask says where the answer ends."""
    rm, tok = _rm(tiny_opt)
    e = tok.eos_token_id
    rm.hf.config.pad_token_id = e  # the worst case: nothing distinguishes a pad id from BOS / EOS
    answer = tok("Human: hi\n\nAssistant: hello there")["input_ids"]
    seq = [e, *answer, e]  # BOS ... answer ... EOS, all the same id at both ends
    with torch.no_grad():
        alone = rm(torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))
        ids, mask = _pad([seq, seq + [7, 8, 9]], e, side, width=len(seq) + 6)
        out = rm(ids, mask)
    last = alone.values[0, -1]
    assert (alone.end_scores[0] - last).abs().item() == 0.0
    assert (out.end_scores[0] - last).abs().item() < 1e-5
    # and it is not the BOS's value, nor what a pad-id lookup would pick (the token before EOS)
    assert (last - alone.values[0, 0]).abs().item() > 1e-3
    assert (last - alone.values[0, -2]).abs().item() > 1e-3


@pytest.mark.parametrize("family", ["opt", "llama"])
def test_saved_folder_scores_same_with_hf_seq_cls(family, tiny_opt, tiny_llama, tmp_path):
    from transformers import AutoModelForSequenceClassification

    rm, tok = _rm(tiny_opt if family == "opt" else tiny_llama, seed=3)
    rows = [tok("Human: hi\n\nAssistant: hello")["input_ids"] + [tok.eos_token_id],
            tok("Human: what is 2+2?\n\nAssistant: it is four, of course")["input_ids"] + [tok.eos_token_id]]
    ids, mask = _pad(rows, tok.pad_token_id, "right")
    with torch.no_grad():
        ours = rm(ids, mask).end_scores
    save_reward_model(rm, tok, tmp_path / "rm")
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", num_labels=1).eval()
    assert type(hf).__name__ == ("OPT" if family == "opt" else "Llama") + "ForSequenceClassification"
    assert hf.config.pad_token_id == tok.pad_token_id != tok.eos_token_id
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
        # left padding: HF reads the same token when given positions that follow the mask
        lids, lmask = _pad(rows, tok.pad_token_id, "left")
        theirs_left = hf(input_ids=lids, attention_mask=lmask,
                         position_ids=position_ids_from_mask(lmask)).logits.squeeze(-1)
    assert (theirs - ours).abs().max().item() < 1e-5
    assert (theirs_left - ours).abs().max().item() < 1e-5
    # and our own loader with a required head reads the same model back
    again = load_reward_model(str(tmp_path / "rm"), tok, require_head=True).eval()
    with torch.no_grad():
        assert (again(ids, mask).end_scores - ours).abs().max().item() < 1e-6


def test_require_head_rejects_causal_lm_and_wrong_shape(tiny_opt, tmp_path):
    from safetensors.torch import load_file, save_file

    tok = _tok(tiny_opt)
    with pytest.raises(MissingRewardHeadError, match="no 'score.weight'"):
        load_reward_model(str(tiny_opt), tok, require_head=True)
    rm, _ = _rm(tiny_opt)
    save_reward_model(rm, tok, tmp_path / "rm")
    state = load_file(tmp_path / "rm" / "model.safetensors")
    state["score.weight"] = torch.zeros(2, state["score.weight"].shape[1])
    save_file(state, tmp_path / "rm" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingRewardHeadError, match=r"shape \(2, 64\)"):
        load_reward_model(str(tmp_path / "rm"), tok, require_head=True)


def test_fresh_head_from_causal_lm_and_head_kept_from_reward_folder(tiny_opt, tmp_path):
    tok = _tok(tiny_opt)
    rm, _ = _rm(tiny_opt, seed=5)
    save_reward_model(rm, tok, tmp_path / "rm")
    again = load_reward_model(str(tmp_path / "rm"), tok, require_head=False)
    assert torch.equal(again.hf.score.weight, rm.hf.score.weight)
    fresh = load_reward_model(str(tiny_opt), tok, require_head=False)
    assert 0.0 < fresh.hf.score.weight.std().item() < 0.1  # HF's normal(0, 0.02) init, not the saved head


def test_lora_merged_on_save_and_head_trainable(tiny_opt, tmp_path):
    from chatrl.config import LoraConfig

    rm, tok = _rm(tiny_opt)
    lora = with_lora(rm, LoraConfig(lora_dim=4, lora_module_name="layers.", only_optimize_lora=True))
    assert isinstance(lora, RewardModel)
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert any(n.endswith("score.weight") for n in trainable)
    assert all("lora_" in n or n.endswith("score.weight") for n in trainable)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.5)
    ids = torch.tensor([tok("Human: hi\n\nAssistant: hello")["input_ids"]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        before = rm(ids, mask).end_scores  # rm shares modules with lora: adapters are active here too
        with lora.hf.disable_adapter():
            plain = lora(ids, mask).end_scores
        ours = lora(ids, mask).end_scores
    assert (ours - plain).abs().item() > 1e-4  # the adapters change the score
    assert torch.equal(before, ours)
    save_reward_model(lora, tok, tmp_path / "rm")
    merged = load_reward_model(str(tmp_path / "rm"), tok, require_head=True).eval()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        assert (merged(ids, mask).end_scores - ours).abs().item() < 1e-5
