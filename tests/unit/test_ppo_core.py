"""Unit tests of the pure RL maths (chatrl.rl.core, chatrl.logprobs, PPO's policy loss): hand-derived values
and references."""

from __future__ import annotations

import math

import pytest
import torch

from chatrl.logprobs import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from chatrl.rl import core
from chatrl.rl.loss import PolicyLossSettings, policy_loss, step_normalizers

GARBAGE = 1e6


def prefix_mask(lengths: list[int], width: int) -> torch.Tensor:
    """(B, width) float mask with `lengths[b]` leading ones per row."""
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


def fill_masked(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(mask.bool(), x, torch.full_like(x, value))


def compute_rewards(score, logp, ref_logp, mask, kl_coef=0.1, clip_reward_value=5.0, kl_kind="k1"):
    """PPO's KL-shaped rewards as the trainer computes them: the masked KL, then the rewards."""
    kl = core.masked_kl(logp, ref_logp, mask, kl_kind)
    return core.compute_rewards(score, kl, mask, kl_coef, clip_reward_value), kl


def actor_loss(logp, old_logp, advantages, mask, clip_eps=0.2):
    """PPO's actor loss as the trainer computes it: the policy loss over one micro-batch's own tokens."""
    norm = step_normalizers(mask, mask.shape[0], 1, "micro-batch-token-mean")[0]
    return policy_loss(logp, old_logp, advantages, mask, norm,
                       PolicyLossSettings("micro-batch-token-mean", cliprange_low=clip_eps))



# ----------------------------------------------------------------------------- action mask


def test_action_mask_hand_cases():
    eos = 2
    ids = torch.tensor(
        [
            [2, 5, 6, 7],  # EOS first: one action, the EOS
            [5, 6, 7, 2],  # EOS last
            [5, 6, 7, 8],  # no EOS: all ones
            [5, 2, 6, 2],  # EOS twice: only the first counts
            [5, 2, 2, 2],  # pad == EOS after the real end
        ]
    )
    expected = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.float32
    )
    mask = core.action_mask_from_tokens(ids, eos)
    assert mask.dtype == torch.float32
    assert torch.equal(mask, expected)


def test_action_mask_with_attention_mask_and_several_eos_ids():
    ids = torch.tensor([[5, 6, 0, 0], [5, 9, 7, 7], [5, 6, 7, 8]])
    attn = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    # Row 0: no EOS, padding follows the attention mask; row 1: second EOS id 9 ends it.
    mask = core.action_mask_from_tokens(ids, [2, 9], attn)
    assert torch.equal(mask, torch.tensor([[1.0, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]))
    # An EOS id under a 0 of the attention mask does not count.
    ids = torch.tensor([[2, 5, 6]])
    assert torch.equal(
        core.action_mask_from_tokens(ids, 2, torch.tensor([[0, 1, 1]])), torch.tensor([[0.0, 1, 1]])
    )


def test_action_mask_errors():
    with pytest.raises(ValueError, match=r"\(B, A\)"):
        core.action_mask_from_tokens(torch.tensor([1, 2, 3]), 2)
    with pytest.raises(ValueError, match="shapes must match"):
        core.action_mask_from_tokens(torch.tensor([[1, 2, 3]]), 2, torch.ones(1, 2))
    with pytest.raises(ValueError, match="integer"):
        core.action_mask_from_tokens(torch.tensor([[1.0, 2.0]]), 2)


# ----------------------------------------------------------------------------- log-probs, entropy


def test_logprobs_and_entropy_match_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 3
    labels = torch.randint(0, 11, (3, 5))
    ref = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(logprobs_from_logits(logits, labels), ref, atol=1e-6)
    probs = torch.softmax(logits, -1)
    ref_h = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.allclose(entropy_from_logits(logits), ref_h, atol=1e-5)
    # Uniform logits: entropy log V, log-prob -log V.
    flat = torch.zeros(1, 2, 11)
    assert torch.allclose(entropy_from_logits(flat), torch.full((1, 2), math.log(11)))
    assert torch.allclose(logprobs_from_logits(flat, labels[:1, :2]), torch.full((1, 2), -math.log(11)))


def test_logprobs_bf16_input_gives_fp32_and_gradients():
    torch.manual_seed(1)
    logits = (torch.randn(2, 4, 7) * 4).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 7, (2, 4))
    out = logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(out, ref, atol=1e-6)
    out.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad.float()).all()


def test_logprobs_errors():
    with pytest.raises(ValueError, match=r"\(B, T, V\)"):
        logprobs_from_logits(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must be"):
        logprobs_from_logits(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        logprobs_from_logits(torch.zeros(1, 2, 4), torch.tensor([[0, 4]]))


def test_ptx_loss_matches_cross_entropy_and_ignores_padding():
    torch.manual_seed(2)
    logits = torch.randn(2, 4, 9)
    labels = torch.randint(0, 9, (2, 4))
    labels[1, 2:] = -100
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 9), labels.reshape(-1), ignore_index=-100)
    assert torch.allclose(core.ptx_loss(logits, labels), ref, atol=1e-6)
    assert core.ptx_loss(logits, torch.full((2, 4), -100)).item() == 0.0


# ----------------------------------------------------------------------------- masked statistics


def test_masked_mean_sum_var_values():
    x = torch.tensor([[1.0, 2.0, GARBAGE], [3.0, GARBAGE, GARBAGE]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert core.masked_sum(x, m).item() == 6.0
    assert core.masked_mean(x, m).item() == 2.0
    assert torch.equal(core.masked_mean(x, m, dim=1), torch.tensor([1.5, 3.0]))
    assert core.masked_var(x, m, unbiased=True).item() == pytest.approx(1.0)
    assert core.masked_var(x, m, unbiased=False).item() == pytest.approx(2.0 / 3.0)
    # Nothing valid: 0, not NaN.
    assert core.masked_mean(x, torch.zeros_like(m)).item() == 0.0
    assert core.masked_var(x, torch.zeros_like(m)).item() == 0.0
    with pytest.raises(ValueError, match="shapes must match"):
        core.masked_mean(x, m[:, :2])


def test_whiten_one_valid_token_is_finite():
    x = torch.tensor([[3.5, GARBAGE, GARBAGE], [GARBAGE, GARBAGE, GARBAGE]])
    m = torch.tensor([[1.0, 0, 0], [0, 0, 0]])
    assert core.masked_var(x, m, unbiased=True).item() == 0.0
    out = core.masked_whiten(x, m)
    assert torch.isfinite(out).all()
    assert torch.equal(out, torch.zeros_like(x))
    kept = core.masked_whiten(x, m, shift_mean=False)
    assert torch.isfinite(kept).all()
    assert kept[0, 0].item() == pytest.approx(3.5) and kept.flatten()[1:].abs().sum() == 0
    # No valid token at all: zeros.
    assert torch.equal(core.masked_whiten(x, torch.zeros_like(m)), torch.zeros_like(x))


def test_whiten_masked_equals_whiten_of_unpadded_values():
    torch.manual_seed(3)
    lengths = [4, 1, 0, 6]
    mask = prefix_mask(lengths, 6)
    x = fill_masked(torch.randn(4, 6) * 2 + 1, mask, GARBAGE)
    flat = x[mask.bool()]
    expected_valid = (flat - flat.mean()) / torch.sqrt(flat.var(unbiased=True) + core.WHITEN_EPS)
    out = core.masked_whiten(x, mask)
    assert torch.allclose(out[mask.bool()], expected_valid, atol=1e-6)
    assert torch.equal(out[~mask.bool()], torch.zeros(int((~mask.bool()).sum())))
    kept = core.masked_whiten(x, mask, shift_mean=False)
    assert torch.allclose(kept[mask.bool()], expected_valid + flat.mean(), atol=1e-5)


# ----------------------------------------------------------------------------- KL


def test_kl_penalty_hand_values():
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.5)]])
    # Token 0: log(pi/ref) = log 2, r = ref/pi = 0.5. Token 1: log(pi/ref) = -log 2, r = 2.
    l2 = math.log(2.0)
    expected = {
        "k1": [l2, -l2],
        "k3": [(0.5 - 1) + l2, (2 - 1) - l2],
        "abs": [l2, l2],
        "mse": [0.5 * l2**2, 0.5 * l2**2],
        "k2": [0.5 * l2**2, 0.5 * l2**2],
    }
    for kind, values in expected.items():
        got = core.kl_penalty(logp, ref, kind)
        assert torch.allclose(got, torch.tensor([values]), atol=1e-6), kind
    assert core.kl_penalty(logp, ref, "k3").min() > 0
    with pytest.raises(ValueError, match="unknown kind"):
        core.kl_penalty(logp, ref, "k4")


def test_kl_is_exactly_zero_when_policy_equals_reference():
    torch.manual_seed(4)
    logp = -torch.rand(3, 7) * 5
    for kind in core.KL_KINDS:
        assert torch.equal(core.kl_penalty(logp, logp.clone(), kind), torch.zeros(3, 7)), kind
    _, kl = compute_rewards(torch.zeros(3), logp, logp.clone(), torch.ones(3, 7), kl_kind="k3")
    assert torch.equal(kl, torch.zeros(3, 7))


# ----------------------------------------------------------------------------- rewards


def test_reward_lands_on_last_action_token_hand_example():
    # Row 0: EOS at j = 2 (mask 1 1 1 0 0), score 7 clipped to 5. Row 1: no EOS, score -2.
    ids = torch.tensor([[11, 12, 2, 2, 2], [11, 12, 13, 14, 15]])
    mask = core.action_mask_from_tokens(ids, eos_token_id=2)
    assert torch.equal(mask, torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1]]))
    logp = torch.tensor([[-1.0, -2.0, -0.5, 9.0, -9.0], [-1.0, -1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -1.0, -7.0, 3.0], [-1.0, -1.2, -0.8, -1.0, -2.0]])
    score = torch.tensor([7.0, -2.0])
    rewards, kl = compute_rewards(score, logp, ref, mask, kl_coef=0.1, clip_reward_value=5.0)
    expected_kl = torch.tensor([[0.5, 0.0, 0.5, 0.0, 0.0], [0.0, 0.2, -0.2, 0.0, 1.0]])
    expected_rewards = torch.tensor(
        [[-0.05, 0.0, -0.05 + 5.0, 0.0, 0.0], [0.0, -0.02, 0.02, 0.0, -0.1 - 2.0]]
    )
    assert torch.allclose(kl, expected_kl, atol=1e-6)
    assert torch.allclose(rewards, expected_rewards, atol=1e-6)
    assert torch.equal(rewards[0, 3:], torch.zeros(2))  # nothing after the EOS


def test_rewards_row_without_actions_and_no_clip():
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -1.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.full((3, 3), -1.0)
    mask = prefix_mask([0, 3, 1], 3)
    rewards, kl = compute_rewards(
        torch.tensor([3.0, 20.0, -1.0]), logp, ref, mask, clip_reward_value=None
    )
    assert torch.equal(rewards[0], torch.zeros(3)) and torch.equal(kl[0], torch.zeros(3))
    assert torch.allclose(rewards[1], torch.tensor([0.1, 0.0, 20.0 + 0.2]))
    assert torch.allclose(rewards[2], torch.tensor([-1.0, 0.0, 0.0]))
    # Zero generated positions at all must not crash.
    r, k = compute_rewards(torch.ones(2), torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0))
    assert r.shape == (2, 0) and k.shape == (2, 0)


def test_compute_rewards_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"score must be \(B,\)"):
        compute_rewards(torch.zeros(2, 1), z, z, z)
    with pytest.raises(ValueError, match="shapes must match"):
        compute_rewards(torch.zeros(2), z, torch.zeros(2, 4), z)
    with pytest.raises(ValueError, match="kl_coef"):
        compute_rewards(torch.zeros(2), z, z, z, kl_coef=-0.1)
    with pytest.raises(ValueError, match="clip_reward_value"):
        compute_rewards(torch.zeros(2), z, z, z, clip_reward_value=0.0)


# ----------------------------------------------------------------------------- GAE


def gae_reference(values, rewards, lengths, gamma, lam):
    """Plain double loop: A_t = sum_l (gamma lam)^l delta_{t+l} over the first `length` tokens."""
    batch, width = values.shape
    adv = [[0.0] * width for _ in range(batch)]
    ret = [[0.0] * width for _ in range(batch)]
    for b in range(batch):
        n = lengths[b]
        v = [float(values[b, t]) for t in range(n)] + [0.0]  # the value beyond the last action is 0
        deltas = [float(rewards[b, t]) + gamma * v[t + 1] - v[t] for t in range(n)]
        for t in range(n):
            adv[b][t] = sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, n))
            ret[b][t] = adv[b][t] + v[t]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_gae_matches_double_loop_reference(gamma, lam):
    gen = torch.Generator().manual_seed(5)
    lengths = [7, 0, 1, 4, 3, 7]
    mask = prefix_mask(lengths, 7)
    values = fill_masked(torch.randn(6, 7, generator=gen, dtype=torch.float64), mask, GARBAGE)
    rewards = fill_masked(torch.randn(6, 7, generator=gen, dtype=torch.float64), mask, -GARBAGE)
    adv, ret = core.gae(values, rewards, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = gae_reference(values, rewards, lengths, gamma, lam)
    assert torch.allclose(adv, ref_adv, atol=1e-10)
    assert torch.allclose(ret, ref_ret, atol=1e-10)


def test_gae_tiny_hand_cases():
    # gamma = lam = 1: returns are reward-to-go, advantages = returns - values.
    adv, ret = core.gae(
        torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3), 1.0, 1.0
    )
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0]]))
    assert torch.allclose(adv, torch.tensor([[0.0, -1.0, -2.0]]))
    # gamma 1, lam 0.5, two tokens: delta1 = 3 - 2 = 1, delta0 = 0 + 2 - 1 = 1, A0 = 1 + 0.5 * 1.
    adv, ret = core.gae(
        torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[0.0, 3.0, 9.0]]), prefix_mask([2], 3), 1.0, 0.5
    )
    assert torch.allclose(adv, torch.tensor([[1.5, 1.0, 0.0]]))
    assert torch.allclose(ret, torch.tensor([[2.5, 3.0, 0.0]]))


def test_gae_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="gamma"):
        core.gae(z, z, z, gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        core.gae(z, z, z, lam=-0.1)
    with pytest.raises(ValueError, match="shapes must match"):
        core.gae(z, torch.zeros(2, 2), z)


# ----------------------------------------------------------------------------- losses


def test_actor_loss_ratio_one():
    torch.manual_seed(6)
    mask = prefix_mask([3, 5, 1], 5)
    logp = fill_masked(-torch.rand(3, 5), mask, GARBAGE).requires_grad_()
    adv = fill_masked(torch.randn(3, 5), mask, GARBAGE)
    loss, stats = actor_loss(logp, logp.detach().clone(), adv, mask)
    assert loss.item() == pytest.approx(-core.masked_mean(adv, mask).item(), abs=1e-7)
    assert stats["clip_frac"].item() == 0.0
    assert stats["approx_kl"].item() == 0.0
    assert stats["ratio_mean"].item() == 1.0
    loss.backward()
    # d loss / d logp_t = -A_t / n_valid on valid tokens, 0 elsewhere.
    expected = torch.where(mask.bool(), -adv / mask.sum(), torch.zeros_like(adv))
    assert torch.allclose(logp.grad, expected, atol=1e-7)


def test_actor_loss_hand_example_where_clipping_binds():
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, GARBAGE]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.0]])
    logp = (old + ratios.log()).requires_grad_()
    loss, stats = actor_loss(logp, old, adv, mask, clip_eps=0.2)
    # Token 0: max(-1.5, -1.2) = -1.2 (clipped). Token 1: max(-0.5, -0.8) = -0.5.
    # Token 2: max(0.5, 0.8) = 0.8 (clipped).
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8) / 3, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(2 / 3)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 0.5) / 3, abs=1e-6)
    k3 = [(r - 1) - math.log(r) for r in (1.5, 0.5, 0.5)]
    assert stats["approx_kl"].item() == pytest.approx(sum(k3) / 3, abs=1e-6)
    loss.backward()
    # Clipped tokens get no gradient; token 1: d/dlogp (-A ratio)/3 = -0.5 / 3.
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5 / 3, 0.0, 0.0]]), atol=1e-6)


def test_critic_loss_hand_example():
    values = torch.tensor([[1.5, 1.5, GARBAGE]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, -GARBAGE]])
    returns = torch.tensor([[2.0, 1.0, GARBAGE]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = core.critic_loss(values, old, returns, mask, clip_value=0.2)
    # Token 0: unclipped (1.5 - 2)^2 = 0.25, clipped (1.2 - 2)^2 = 0.64 -> 0.5 * 0.64 = 0.32.
    # Token 1: unclipped (1.5 - 1)^2 = 0.25, clipped (1.2 - 1)^2 = 0.04 -> 0.5 * 0.25 = 0.125.
    assert loss.item() == pytest.approx((0.32 + 0.125) / 2, abs=1e-6)
    assert stats["value_clip_frac"].item() == pytest.approx(0.5)
    loss.backward()
    # Clipped token: no gradient. Unclipped: 0.5 * 2 * (1.5 - 1) / 2.
    assert torch.allclose(values.grad, torch.tensor([[0.0, 0.25, 0.0]]), atol=1e-6)
    unclipped, _ = core.critic_loss(values, old, returns, mask, clip_value=None)
    assert unclipped.item() == pytest.approx((0.125 + 0.125) / 2, abs=1e-6)


def test_explained_variance():
    mask = prefix_mask([3, 2], 4)
    returns = fill_masked(torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 5.0, 0.0, 0.0]]), mask, GARBAGE)
    assert core.explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    const = torch.full_like(returns, 3.0)
    assert core.explained_variance(const, returns, mask).item() == pytest.approx(0.0, abs=1e-6)
    values = returns + fill_masked(torch.tensor([[1.0, -1.0, 1.0, 0.0], [-1.0, 1.0, 0.0, 0.0]]), mask, 0.0)
    # Var(R) = 2 (biased, over 1..5); residuals +-1 with mean 0.2: Var = 1 - 0.04 = 0.96.
    assert core.explained_variance(values, returns, mask).item() == pytest.approx(1 - 0.96 / 2.0, abs=1e-6)
    assert math.isnan(core.explained_variance(values, torch.ones_like(values), mask).item())


# ----------------------------------------------------------------------------- garbage invariance


def _pipeline(logp_old, ref_logp, values_old, score, logp_new, values_new, mask):
    rewards, kl = compute_rewards(score, logp_old, ref_logp, mask, kl_coef=0.1, kl_kind="k3")
    adv, ret = core.gae(values_old, rewards, mask, gamma=1.0, lam=0.95)
    white = core.masked_whiten(adv, mask)
    pg, pg_stats = actor_loss(logp_new, logp_old, white, mask)
    vf, vf_stats = core.critic_loss(values_new, values_old, ret, mask)
    (pg + vf).backward()
    out = {"rewards": rewards, "kl": kl, "adv": adv, "ret": ret, "white": white, "pg": pg, "vf": vf}
    out.update(pg_stats)
    out.update(vf_stats)
    out["ev"] = core.explained_variance(values_old, ret, mask)
    out["grad_logp"] = logp_new.grad
    out["grad_values"] = values_new.grad
    return out


def test_pad_and_post_eos_positions_change_nothing():
    gen = torch.Generator().manual_seed(7)
    batch, width = 5, 8
    mask = prefix_mask([8, 3, 1, 0, 6], width)

    def rnd(scale=1.0):
        return torch.randn(batch, width, generator=gen) * scale

    logp_old, ref_logp = -rnd().abs(), -rnd().abs()
    values_old, score = rnd(), torch.randn(batch, generator=gen) * 4
    logp_new, values_new = logp_old + 0.3 * rnd(), values_old + 0.3 * rnd()

    def run(fill):
        def f(x, sign=1.0):
            return x.clone() if fill is None else fill_masked(x, mask, sign * fill)

        return _pipeline(
            f(logp_old),
            f(ref_logp, -1.0),
            f(values_old),
            score,
            f(logp_new, -1.0).requires_grad_(),
            f(values_new).requires_grad_(),
            mask,
        )

    clean = run(None)
    for fill in (GARBAGE, -GARBAGE, 123.0):
        dirty = run(fill)
        for key, value in clean.items():
            assert torch.isfinite(dirty[key]).all(), (fill, key)
            assert torch.equal(dirty[key], value), (fill, key)
    # Masked positions of every per-token output are 0.
    for key in ("rewards", "kl", "adv", "ret", "white", "grad_logp", "grad_values"):
        assert torch.equal(clean[key][~mask.bool()], torch.zeros(int((~mask.bool()).sum()))), key


def test_losses_with_no_valid_token_are_zero_and_finite():
    z = torch.zeros(2, 3, requires_grad=True)
    m = torch.zeros(2, 3)
    loss, stats = actor_loss(z, z.detach(), torch.ones(2, 3), m)
    vf, vstats = core.critic_loss(z, z.detach(), torch.ones(2, 3), m)
    assert loss.item() == 0.0 and vf.item() == 0.0
    assert all(torch.isfinite(v) for v in (*stats.values(), *vstats.values()))
    (loss + vf).backward()
    assert torch.equal(z.grad, torch.zeros(2, 3))


def test_loss_argument_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shapes must match"):
        actor_loss(z, z, torch.zeros(2, 4), z)
    with pytest.raises(ValueError, match="cliprange_low and cliprange_high must be > 0"):
        actor_loss(z, z, z, z, clip_eps=0.0)
    with pytest.raises(ValueError, match="shapes must match"):
        core.critic_loss(z, z, z, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="clip_value"):
        core.critic_loss(z, z, z, z, clip_value=-1.0)


# ----------------------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_hand_update_and_state_round_trip():
    ctl = core.AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)  # error clip(0.5) = 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    ctl.update(current_kl=5.4, n_steps=256)  # error -0.1
    assert ctl.value == pytest.approx(0.1 * 1.00512 * (1 - 0.1 * 256 / 10000))
    ctl.update(current_kl=0.0, n_steps=512)  # error clipped to -0.2
    expected = 0.1 * 1.00512 * 0.99744 * (1 - 0.2 * 512 / 10000)
    assert ctl.value == pytest.approx(expected)

    state = ctl.state_dict()
    resumed = core.AdaptiveKLController(init_kl_coef=0.5, target=6.0, horizon=10000)
    resumed.load_state_dict(state)
    assert resumed.value == ctl.value
    ctl.update(7.0, 64)
    resumed.update(7.0, 64)
    assert resumed.value == ctl.value
    with pytest.raises(ValueError, match="adaptive"):
        resumed.load_state_dict(core.FixedKLController(0.1).state_dict())
    with pytest.raises(ValueError, match="target"):
        core.AdaptiveKLController(0.1, target=0.0, horizon=100)


def test_fixed_kl_controller():
    ctl = core.FixedKLController(0.1)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.1
    other = core.FixedKLController(0.3)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.1
    with pytest.raises(ValueError):
        core.FixedKLController(-1.0)


def test_gae_skips_a_masked_hole_inside_the_answer():
    # A multi-turn episode: token 2 is an observation (masked) between two assistant turns. The
    # bootstrap of turn 1's last token goes to turn 2's first token, as if the hole were not there.
    # By hand (gamma 1, lam 0.5): A4 = 2 - 7 = -5; A3 = (1 + 7 - 5) + 0.5 A4 = 0.5;
    # A1 = (3 + 5 - 2) + 0.5 A3 = 6.25; A0 = (0 + 2 - 1) + 0.5 A1 = 4.125.
    values = torch.tensor([[1.0, 2.0, GARBAGE, 5.0, 7.0]])
    rewards = torch.tensor([[0.0, 3.0, GARBAGE, 1.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0]])
    adv, ret = core.gae(values, rewards, mask, gamma=1.0, lam=0.5)
    assert torch.equal(adv, torch.tensor([[4.125, 6.25, 0.0, 0.5, -5.0]]))
    assert torch.equal(ret, torch.tensor([[5.125, 8.25, 0.0, 5.5, 2.0]]))


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7)])
def test_gae_with_holes_equals_gae_of_the_compacted_episode(gamma, lam):
    # Invariance: removing the masked holes (observation tokens) changes no advantage or return.
    gen = torch.Generator().manual_seed(7)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0, 0], [0, 1, 1, 0, 1, 0, 0, 0, 0, 0]], dtype=torch.float64)
    values = fill_masked(torch.randn(2, 10, generator=gen, dtype=torch.float64), mask, GARBAGE)
    rewards = fill_masked(torch.randn(2, 10, generator=gen, dtype=torch.float64), mask, -GARBAGE)
    adv, ret = core.gae(values, rewards, mask, gamma=gamma, lam=lam)
    for b in range(2):
        keep = mask[b] > 0
        ref_adv, ref_ret = gae_reference(values[b][keep][None], rewards[b][keep][None], [int(keep.sum())],
                                         gamma, lam)
        assert torch.allclose(adv[b][keep], ref_adv[0], atol=1e-12)
        assert torch.allclose(ret[b][keep], ref_ret[0], atol=1e-12)
        assert torch.equal(adv[b][~keep], torch.zeros(int((~keep).sum()), dtype=torch.float64))


def test_logprobs_and_entropy_in_one_pass_equal_the_separate_functions():
    """The experience pass's fused helper: log-probs bit for bit, entropies to float32 rounding
    (and at least as close to a float64 reference), at a GPT-2-sized vocabulary."""
    torch.manual_seed(3)
    logits = torch.randn(2, 6, 50258) * 3
    labels = torch.randint(0, 50258, (2, 6))
    logp, entropy = logprobs_and_entropy(logits, labels)
    assert torch.equal(logp, logprobs_from_logits(logits, labels))
    ref = entropy_from_logits(logits.double()).float()
    plain = entropy_from_logits(logits)
    assert torch.allclose(entropy, plain, atol=2e-4)
    assert (entropy - ref).abs().max() <= (plain - ref).abs().max() + 1e-5
    flat_logp, flat_h = logprobs_and_entropy(torch.zeros(1, 2, 11), labels[:1, :2] % 11)
    assert torch.allclose(flat_h, torch.full((1, 2), math.log(11)))
    assert torch.allclose(flat_logp, torch.full((1, 2), -math.log(11)))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        logprobs_and_entropy(torch.zeros(1, 2, 4), torch.tensor([[0, 4]]))
