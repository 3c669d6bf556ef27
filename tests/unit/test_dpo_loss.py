"""DPO maths: hand-derived loss values for every loss type, label smoothing, answer masks, and
per-sequence answer log-probs that do not depend on the padding around them."""

import math

import pytest
import torch

from chatrl.step2_dpo.batch import DPOCollator, IndexedPairs, split_pairs
from chatrl.step2_dpo.loss import DPOConfig, answer_logps, preference_loss, reward_stats

# Two pairs. Pair 0: h = (-10 + 11) - (-12 + 11) = 2. Pair 1: h = (-5 + 5) - (-4 + 5) = -1.
PC, PR = torch.tensor([-10.0, -5.0]), torch.tensor([-12.0, -4.0])
RC, RR = torch.tensor([-11.0, -5.0]), torch.tensor([-11.0, -5.0])


def _loss(**kw):
    return preference_loss(DPOConfig(**kw), PC, PR, RC, RR)


def test_sigmoid_loss_and_rewards_by_hand():
    losses, chosen, rejected = _loss(beta=0.1)
    # -log σ(0.2) = log(1 + e^-0.2) = log(1.8187307531) ; -log σ(-0.1) = log(1 + e^0.1) = log(2.1051709181)
    assert losses.tolist() == pytest.approx([0.5981388693, 0.7443966600], abs=1e-7)
    assert chosen.tolist() == pytest.approx([0.1, 0.0], abs=1e-7)     # β (π_c - ref_c)
    assert rejected.tolist() == pytest.approx([-0.1, 0.1], abs=1e-7)  # β (π_r - ref_r)


def test_label_smoothing_is_the_conservative_mixture():
    losses, _, _ = _loss(beta=0.1, label_smoothing=0.1)
    # pair 0: 0.9 · log(1 + e^-0.2) + 0.1 · log(1 + e^0.2) = 0.9 · 0.5981388693 + 0.1 · 0.7981388693
    # pair 1: 0.9 · log(1 + e^0.1) + 0.1 · log(1 + e^-0.1) = 0.9 · 0.7443966600 + 0.1 · 0.6443966600
    assert losses.tolist() == pytest.approx([0.6181388693, 0.7343966600], abs=1e-7)


def test_ipo_loss_by_hand():
    s = DPOConfig(beta=0.1, loss_type="ipo")
    losses, chosen, _ = preference_loss(s, PC, PR, RC, RR, torch.tensor([2, 1]), torch.tensor([1, 4]))
    # per-token log-ratios: pair 0: 1/2 - (-1)/1 = 1.5; pair 1: 0/1 - 1/4 = -0.25; 1/(2β) = 5
    # (1.5 - 5)² = 12.25, (-0.25 - 5)² = 27.5625
    assert losses.tolist() == pytest.approx([12.25, 27.5625], abs=1e-6)
    assert chosen.tolist() == pytest.approx([0.1, 0.0], abs=1e-7)  # rewards stay β · summed log-ratio


def test_hinge_loss_by_hand():
    losses, _, _ = _loss(beta=0.1, loss_type="hinge")
    assert losses.tolist() == pytest.approx([0.8, 1.1], abs=1e-6)  # max(0, 1 - βh)
    losses, _, _ = _loss(beta=1.0, loss_type="hinge")
    assert losses.tolist() == pytest.approx([0.0, 2.0], abs=1e-6)


def test_simpo_is_reference_free_and_length_normalised():
    s = DPOConfig(beta=2.0, loss_type="simpo", simpo_gamma=0.5)
    assert s.reference_free
    # chosen -10 over 5 tokens = -2, rejected -12 over 4 tokens = -3: β Δ̄ - γ = 2·1 - 0.5 = 1.5
    losses, chosen, rejected = preference_loss(s, PC[:1], PR[:1], chosen_len=torch.tensor([5]),
                                               rejected_len=torch.tensor([4]))
    assert losses.item() == pytest.approx(math.log(1 + math.exp(-1.5)), abs=1e-7)  # 0.2014132779
    assert losses.item() == pytest.approx(0.2014132779, abs=1e-7)
    assert (chosen.item(), rejected.item()) == pytest.approx((-4.0, -6.0))
    # reference log-probs are ignored
    again, _, _ = preference_loss(s, PC[:1], PR[:1], RC[:1] + 7, RR[:1], torch.tensor([5]), torch.tensor([4]))
    assert again.item() == losses.item()


def test_gradient_of_sigmoid_loss_matches_the_paper():
    # ∂L/∂π_c = -β σ(-βh) (Rafailov et al. 2023, eq. 8 with one pair)
    pc = PC[:1].clone().requires_grad_(True)
    losses, _, _ = preference_loss(DPOConfig(beta=0.1), pc, PR[:1], RC[:1], RR[:1])
    losses.sum().backward()
    assert pc.grad.item() == pytest.approx(-0.1 * torch.sigmoid(torch.tensor(-0.2)).item(), abs=1e-7)


def test_rpo_adds_the_chosen_answers_per_token_nll_by_hand():
    nc, nr = torch.tensor([2, 1]), torch.tensor([1, 4])
    pc = PC.clone().requires_grad_(True)
    losses, chosen, rejected = preference_loss(DPOConfig(beta=0.1, rpo_alpha=0.5), pc, PR, RC, RR, nc, nr)
    # sigmoid losses above + α · (−log π(y_w) / |y_w|): 0.5 · 10/2 = 2.5 and 0.5 · 5/1 = 2.5
    assert losses.tolist() == pytest.approx([3.0981388693, 3.2443966600], abs=1e-6)
    assert chosen.tolist() == pytest.approx([0.1, 0.0], abs=1e-7)  # rewards unchanged by the NLL term
    assert rejected.tolist() == pytest.approx([-0.1, 0.1], abs=1e-7)
    losses[0].backward()
    # ∂/∂log π(y_w) = −β σ(−βh) − α / |y_w| (h = 2 for pair 0)
    expected = -0.1 * torch.sigmoid(torch.tensor(-0.2)).item() - 0.5 / 2
    assert pc.grad.tolist() == pytest.approx([expected, 0.0], abs=1e-7)
    # SimPO too (its own reference-free loss, plus the same term)
    s = DPOConfig(beta=2.0, loss_type="simpo", simpo_gamma=0.5, rpo_alpha=1.0)
    simpo, _, _ = preference_loss(s, PC[:1], PR[:1], chosen_len=torch.tensor([5]), rejected_len=torch.tensor([4]))
    assert simpo.item() == pytest.approx(0.2014132779 + 10 / 5, abs=1e-6)
    with pytest.raises(ValueError, match="--rpo_alpha needs"):
        preference_loss(DPOConfig(rpo_alpha=1.0), PC, PR, RC, RR)


def test_every_setting_changes_the_loss():
    """No dead option: each field of DPOConfig, moved from the default, changes the losses."""
    from dataclasses import fields

    g = torch.Generator().manual_seed(1)
    pc, pr = -20 * torch.rand(6, generator=g), -20 * torch.rand(6, generator=g)
    rc, rr = pc + torch.randn(6, generator=g), pr + torch.randn(6, generator=g)
    nc, nr = torch.randint(1, 9, (6,), generator=g), torch.randint(1, 9, (6,), generator=g)
    variants = {"beta": {"beta": 0.3}, "label_smoothing": {"label_smoothing": 0.2},
                "loss_type": {"loss_type": "ipo"}, "rpo_alpha": {"rpo_alpha": 1.0}}
    assert set(variants) | {"simpo_gamma"} == {f.name for f in fields(DPOConfig)}  # a new field needs a row here
    base = preference_loss(DPOConfig(), pc, pr, rc, rr, nc, nr)[0]
    for name, kw in variants.items():
        moved = preference_loss(DPOConfig(**kw), pc, pr, rc, rr, nc, nr)[0]
        assert (moved - base).abs().max().item() > 1e-4, name
    simpo = preference_loss(DPOConfig(loss_type="simpo"), pc, pr, rc, rr, nc, nr)[0]
    gamma = preference_loss(DPOConfig(loss_type="simpo", simpo_gamma=1.5), pc, pr, rc, rr, nc, nr)[0]
    assert (gamma - simpo).abs().max().item() > 1e-4, "simpo_gamma"
    for loss_type in ("hinge", "simpo"):
        other = preference_loss(DPOConfig(loss_type=loss_type), pc, pr, rc, rr, nc, nr)[0]
        assert (other - base).abs().max().item() > 1e-4, loss_type


def test_bad_settings_and_inputs_raise():
    with pytest.raises(ValueError, match="--loss_type"):
        DPOConfig(loss_type="kto")
    with pytest.raises(ValueError, match="--beta"):
        DPOConfig(beta=0.0)
    with pytest.raises(ValueError, match="--label_smoothing"):
        DPOConfig(label_smoothing=0.5)
    with pytest.raises(ValueError, match="--label_smoothing applies"):
        DPOConfig(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="--rpo_alpha"):
        DPOConfig(rpo_alpha=-0.1)
    with pytest.raises(ValueError, match="reference"):
        preference_loss(DPOConfig(), PC, PR)
    with pytest.raises(ValueError, match="token counts"):
        preference_loss(DPOConfig(loss_type="simpo"), PC, PR)
    with pytest.raises(ValueError, match="token counts"):
        preference_loss(DPOConfig(loss_type="ipo"), PC, PR, RC, RR)
    with pytest.raises(ValueError, match="disagree"):
        preference_loss(DPOConfig(), PC, PR, RC[:1], RR)


def test_reward_stats_count_ties_as_wrong():
    s = reward_stats(torch.tensor([1.0, 0.5, 2.0]), torch.tensor([0.0, 0.5, 4.0]))
    assert s["count"].item() == 3 and s["correct"].item() == 1
    assert s["margin"].item() == pytest.approx(-1.0)  # 1 + 0 - 2


def test_answer_logps_by_hand():
    # vocab 2, uniform logits except position 1 which predicts token 1 with p = e^1 / (e^1 + 1)
    logits = torch.zeros(1, 3, 2)
    logits[0, 1, 1] = 1.0
    ids = torch.tensor([[0, 1, 1]])
    mask = torch.tensor([[0, 1, 1]])  # prompt is token 0; answer tokens 1 and 2
    logps, n = answer_logps(logits, ids, mask)
    assert n.tolist() == [2]
    assert logps.item() == pytest.approx(math.log(0.5) + 1.0 - math.log(math.e + 1.0), abs=1e-6)


def _pairs():
    g = torch.Generator().manual_seed(0)
    rows = []
    for p_len, c_len, r_len in ((3, 4, 2), (7, 1, 5), (1, 6, 6), (5, 3, 9)):
        prompt = torch.randint(3, 500, (p_len,), generator=g)
        rows.append({"chosen_input_ids": torch.cat([prompt, torch.randint(3, 500, (c_len,), generator=g)]),
                     "rejected_input_ids": torch.cat([prompt, torch.randint(3, 500, (r_len,), generator=g)]),
                     "prompt_len": p_len})
    return IndexedPairs(rows)


def test_collator_answer_mask_follows_prompt_len_on_both_padding_sides():
    pairs = _pairs()
    for side in ("left", "right"):
        b = DPOCollator(pad_token_id=1, padding_side=side)([pairs[0], pairs[1]])
        assert b["index"].tolist() == [0, 1]
        assert b["answer_mask"].sum(1).tolist() == [4, 1, 2, 5]  # answer lengths: chosen rows, then rejected
        assert bool((b["answer_mask"] <= b["attention_mask"]).all())
        # the first answer token of row 0 follows its 3 prompt tokens
        first = int(b["attention_mask"][0].argmax()) if side == "left" else 0
        assert b["answer_mask"][0, first:first + 3].tolist() == [0, 0, 0]
        assert b["answer_mask"][0, first + 3].item() == 1


@pytest.mark.parametrize("pad", [0, 2])
def test_the_answers_eos_is_scored_and_pads_are_not_even_when_pad_is_eos(pad):
    """EOS (id 2) ends both answers; with pad = EOS (GPT-2 style) the mask still comes from lengths."""
    pair = {"chosen_input_ids": torch.tensor([5, 6, 7, 2]), "rejected_input_ids": torch.tensor([5, 6, 8, 9, 9, 2]),
            "prompt_len": 2}
    for side in ("left", "right"):
        b = DPOCollator(pad_token_id=pad, padding_side=side)([pair])
        off = 2 if side == "left" else 0  # the chosen row's 2 pads come first when left-padded
        assert b["answer_mask"][0].tolist() == ([0, 0] * (side == "left") + [0, 0, 1, 1] + [0, 0] * (side == "right"))
        assert b["answer_mask"][1].tolist() == [0, 0, 1, 1, 1, 1]
        # logits: uniform over 10 tokens, except that the position before each row's final EOS gives EOS logit 3
        logits = torch.zeros(2, 6, 10)
        logits[0, off + 2, 2] = 3.0
        logits[1, 4, 2] = 3.0
        logps, n = answer_logps(logits, b["input_ids"], b["answer_mask"])
        eos = 3.0 - math.log(math.exp(3.0) + 9)  # log p(EOS) where its logit is 3
        uniform = -math.log(10)
        assert n.tolist() == [2, 4]
        assert logps.tolist() == pytest.approx([uniform + eos, 3 * uniform + eos], abs=1e-6)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_answer_logps_are_padding_invariant(family, tiny_models):
    """Batch of 1 vs batch of 4, left and right padding: the same per-sequence log-probs within 1e-5 (fp32)."""
    from chatrl.models.causal_lm import causal_lm_logits, load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(tiny_models[family]))
    model = load_causal_lm(str(tiny_models[family]), tok, dtype="fp32").eval()
    pairs = _pairs()

    def logps(items, side):
        b = DPOCollator(tok.pad_token_id, padding_side=side)(items)
        with torch.no_grad():
            logits = causal_lm_logits(model, b["input_ids"], b["attention_mask"])
        lp, n = answer_logps(logits, b["input_ids"], b["answer_mask"])
        return split_pairs(lp), split_pairs(n)

    alone = [logps([pairs[i]], "right") for i in range(4)]
    alone_c = torch.cat([a[0][0] for a in alone])
    alone_r = torch.cat([a[0][1] for a in alone])
    assert alone_c.abs().min() > 1.0  # real sums over several tokens of a random model, not zeros
    for side in ("left", "right"):
        (c, r), (nc, nr) = logps([pairs[i] for i in range(4)], side)
        assert nc.tolist() == [4, 1, 6, 3] and nr.tolist() == [2, 5, 6, 9]
        assert (c - alone_c).abs().max().item() < 1e-5, side
        assert (r - alone_r).abs().max().item() < 1e-5, side


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_answer_logps_with_the_head_on_answer_positions_equal_full_logits(family, tiny_models):
    """batch_answer_logps (the LM head on the positions that predict answer tokens, padded at either
    side or packed) gives the log-probs, counts and gradients of answer_logps over full logits."""
    from chatrl.models.causal_lm import causal_lm_logits, load_causal_lm, load_tokenizer
    from chatrl.step2_dpo.batch import PackedDPOCollator, batch_answer_logps

    tok = load_tokenizer(str(tiny_models[family]))
    model = load_causal_lm(str(tiny_models[family]), tok, dtype="fp32").eval()
    pairs = _pairs()

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out

    plain = DPOCollator(tok.pad_token_id)(pairs)
    logits = causal_lm_logits(model, plain["input_ids"], plain["attention_mask"])
    want, want_n = answer_logps(logits, plain["input_ids"], plain["answer_mask"])
    want.sum().backward()
    want_grads = grads()
    assert want_n.tolist() == [4, 1, 6, 3, 2, 5, 6, 9]
    for collate in (DPOCollator(tok.pad_token_id, "left"), DPOCollator(tok.pad_token_id, "right"),
                    PackedDPOCollator(tok.pad_token_id)):
        got, n = batch_answer_logps(model, collate(pairs), "cpu")
        assert n.tolist() == want_n.tolist()
        # sums of up to 9 tokens' log-probs near -100: float32 rounding of another summation order
        assert ((got - want).abs() <= 1e-5 + 1e-6 * want.abs()).all(), (type(collate).__name__, got - want)
        got.sum().backward()
        for name, g in grads().items():
            assert (g - want_grads[name]).abs().max().item() < 1e-5 * max(1.0, want_grads[name].abs().max().item()), name


def test_answer_logps_of_a_bf16_model_are_float32_sums_of_its_logits(tiny_models):
    """The fp32 island of DPO's training path (docs/precision.md): a bf16 model's answer log-probs come
    out float32, equal to answer_logps over the model's own bf16 logits (log-softmax in float32)."""
    from chatrl.models.causal_lm import causal_lm_logits, load_causal_lm, load_tokenizer
    from chatrl.step2_dpo.batch import batch_answer_logps

    tok = load_tokenizer(str(tiny_models["llama"]))
    model = load_causal_lm(str(tiny_models["llama"]), tok, dtype="bf16").eval()
    b = DPOCollator(tok.pad_token_id)(_pairs())
    with torch.no_grad():
        logits = causal_lm_logits(model, b["input_ids"], b["attention_mask"])
        got, n = batch_answer_logps(model, b, "cpu")
    want, want_n = answer_logps(logits, b["input_ids"], b["answer_mask"])
    assert logits.dtype == torch.bfloat16 and got.dtype == torch.float32
    assert n.tolist() == want_n.tolist()
    assert ((got - want).abs() <= 1e-4 * want.abs()).all(), got - want
