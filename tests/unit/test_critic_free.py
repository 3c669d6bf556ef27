"""Unit tests of the advantage estimators and the policy loss (chatrl.rl): hand-derived values on a group
of 4 answers, no dead option, and gradient invariance under micro-batching, accumulation and ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from chatrl.logprobs import logprobs_from_logits
from chatrl.rl import advantages as adv_mod
from chatrl.rl import core
from chatrl.rl import loss as loss_mod
from chatrl.rl.algorithms import ALGORITHMS, get
from chatrl.rl.loss import GLOBAL_LOSS_AGG_MODES, PolicyLossSettings


def critic_free_advantages(algorithm, scores, mask, n, *, kl=None, kl_coef=0.0, scale_by_std=True,
                           all_reduce_sum=None):
    """An algorithm's advantages through its registered estimator (the step-3 loop's path)."""
    settings = type("Settings", (), {"grpo_no_std_scaling": not scale_by_std})()
    inputs = adv_mod.AdvantageInputs(scores, mask, kl if kl is not None else torch.zeros_like(mask),
                                      kl_coef if kl is not None else 0.0, None, n, all_reduce_sum)
    return ALGORITHMS[algorithm].estimate(inputs, settings).advantages

GARBAGE = 1e6
S2 = math.sqrt(2.0)


def prefix_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).float()


# One group of 4 answers: rewards 3, 0, 1, 0 (mean 1, deviations 2, -1, 0, -1, unbiased std sqrt(2)),
# answer lengths 2, 3, 1, 2 in a width of 3.
SCORES = torch.tensor([3.0, 0.0, 1.0, 0.0])
LENGTHS = [2, 3, 1, 2]
MASK = prefix_mask(LENGTHS, 3)


# ----------------------------------------------------------------------------- layout


def test_repeat_prompts_keeps_groups_contiguous():
    ids, mask = adv_mod.repeat_prompts(torch.tensor([[0, 5], [6, 7]]), torch.tensor([[0, 1], [1, 1]]), 3)
    assert ids[:, 1].tolist() == [5, 5, 5, 7, 7, 7]
    assert mask[:, 0].tolist() == [0, 0, 0, 1, 1, 1]


# ----------------------------------------------------------------------------- advantages


def test_grpo_dr_grpo_rloo_outcome_hand_values():
    grpo = adv_mod.grpo_outcome_advantages(SCORES, 4)
    assert torch.allclose(grpo, torch.tensor([2 / S2, -1 / S2, 0.0, -1 / S2]), atol=1e-5)
    dr = adv_mod.grpo_outcome_advantages(SCORES, 4, scale_by_std=False)
    assert torch.allclose(dr, torch.tensor([2.0, -1.0, 0.0, -1.0]))
    # Leave one out: 3 - (0 + 1 + 0) / 3 = 8/3; 0 - 4/3; 1 - 1; 0 - 4/3.
    assert torch.allclose(adv_mod.rloo_outcome_advantages(SCORES, 4), torch.tensor([8 / 3, -4 / 3, 0.0, -4 / 3]))
    # Two groups are independent; an all-equal group gets 0 (not NaN).
    two = adv_mod.grpo_outcome_advantages(torch.tensor([3.0, 0, 1, 0, 5, 5, 5, 5]), 4)
    assert torch.allclose(two[:4], grpo) and torch.equal(two[4:], torch.zeros(4))
    with pytest.raises(ValueError, match="groups of num_samples_per_prompt=3"):
        adv_mod.grpo_outcome_advantages(SCORES, 3)
    with pytest.raises(ValueError, match=">= 2"):
        adv_mod.rloo_outcome_advantages(SCORES, 1)


def test_critic_free_advantages_per_token_hand_values():
    garbage = torch.full((4, 3), GARBAGE)
    adv = critic_free_advantages("grpo", SCORES, MASK, 4)
    expected = torch.tensor([[2 / S2, 2 / S2, 0], [-1 / S2] * 3, [0.0, 0, 0], [-1 / S2, -1 / S2, 0]])
    assert torch.allclose(adv, expected, atol=1e-5)
    # KL in the reward (k1, beta 0.5): row 0 has KL 0.1, 0.2 -> reward-to-go -0.5 * (0.3, 0.2).
    kl = torch.where(MASK.bool(), torch.tensor([[0.1, 0.2, 0.0]] * 4), garbage)
    with_kl = critic_free_advantages("grpo", SCORES, MASK, 4, kl=kl, kl_coef=0.5)
    assert torch.allclose(with_kl[0, :2], torch.tensor([2 / S2 - 0.15, 2 / S2 - 0.1]), atol=1e-5)
    assert with_kl[0, 2] == 0 and with_kl[2, 0] == pytest.approx(-0.05)
    # REINFORCE++: token values 3,3 | 0,0,0 | 1 | 0,0 whitened over the 8 tokens (unbiased variance).
    rpp = critic_free_advantages("reinforce_pp", SCORES, MASK, 4)
    std = math.sqrt((2 * 2.125**2 + 5 * 0.875**2 + 0.125**2) / 7)
    assert rpp[0, 0].item() == pytest.approx(2.125 / std, abs=1e-5)
    assert rpp[1, 2].item() == pytest.approx(-0.875 / std, abs=1e-5)
    assert rpp[2, 0].item() == pytest.approx(0.125 / std, abs=1e-5)
    assert rpp[2, 1] == 0
    # On one rank, the global whitening is core.masked_whiten.
    x = torch.randn(4, 3)
    assert torch.allclose(adv_mod.global_masked_whiten(x, MASK), core.masked_whiten(x, MASK), atol=1e-6)
    with pytest.raises(ValueError, match="PPO's advantages need the critic's values"):
        critic_free_advantages("ppo", SCORES, MASK, 4)
    with pytest.raises(Exception, match="--rl_algorithm 'sppo': choose one of ppo, grpo, rloo, reinforce_pp"):
        get("sppo")


def test_global_whiten_over_simulated_ranks_equals_whole_batch():
    torch.manual_seed(0)
    x, mask = torch.randn(8, 5), prefix_mask([5, 1, 3, 4, 2, 5, 1, 2], 5)
    whole = core.masked_whiten(x, mask)
    parts = [(x[:4], mask[:4]), (x[4:], mask[4:])]
    outs = simulate_ranks(lambda r, red: adv_mod.global_masked_whiten(*parts[r], red), 2)
    assert torch.allclose(torch.cat(outs), whole, atol=1e-6)


def simulate_ranks(fn, world: int):
    """Run ``fn(rank, all_reduce_sum)`` for every rank in-process, one thread per rank; the
    ``all_reduce_sum`` they get sums a tensor over the ranks like ``torch.distributed.all_reduce``."""
    import threading

    slots: list = [None] * world
    barrier = threading.Barrier(world, timeout=60)
    results: list = [None] * world
    errors: list = []

    def all_reduce_sum(rank):
        def reduce(t):
            slots[rank] = t.clone()
            barrier.wait()
            total = sum(slots)
            barrier.wait()
            return total
        return reduce

    def run(rank):
        try:
            results[rank] = fn(rank, all_reduce_sum(rank))
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# Values whose float mean is not exact in a plain reduction (3.217 in float32 gave +0.477 per answer
# in a group of 8 beside a group with spread; up to 183 for 30 answers of 1000.1).
CONSTANTS = [3.217, 0.1, 0.3, 1 / 3, 0.7, 7.7, -2.45, 123.456, 1000.1, 1e-7, 6.02e23, 0.0, -1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_groups_get_exactly_zero_advantage_for_any_size_and_value(dtype):
    for n in range(2, 65):
        spread = torch.arange(n, dtype=dtype)  # the neighbouring group, with spread
        for v in CONSTANTS:
            scores = torch.cat([torch.full((n,), v, dtype=dtype), spread])
            for out in (adv_mod.grpo_outcome_advantages(scores, n),
                        adv_mod.grpo_outcome_advantages(scores, n, scale_by_std=False),
                        adv_mod.rloo_outcome_advantages(scores, n)):
                assert torch.equal(out[:n], torch.zeros(n, dtype=out.dtype)), (n, v, out[:n])
                assert out[n:].abs().max() >= 0.5  # the group with spread keeps its advantages
    # through the registered estimators, per token, with the 3.217 float32 case of the report
    scores = torch.cat([torch.full((8,), 3.217), torch.arange(8.0)])
    mask = prefix_mask([3] * 16, 4)
    for algorithm in ("grpo", "rloo"):
        for std in (True, False):
            a = critic_free_advantages(algorithm, scores, mask, 8, scale_by_std=std)
            assert torch.equal(a[:8], torch.zeros(8, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_batches_whiten_to_exactly_zero(dtype):
    """PPO's --whiten_advantages (core.masked_whiten) and REINFORCE++'s global whitening, on one rank
    and over two simulated ranks, give exactly 0 for a constant input of any size and value."""
    for rows in range(1, 9):
        for width in (1, 3, 7):
            lengths = [1 + (i * 5) % width for i in range(rows)]
            mask = prefix_mask(lengths, width)
            for v in CONSTANTS:
                x = torch.where(mask.bool(), torch.full((rows, width), v, dtype=dtype),
                                torch.full((rows, width), GARBAGE, dtype=dtype))
                assert torch.equal(core.masked_whiten(x, mask), torch.zeros_like(x)), (rows, width, v)
                assert torch.equal(adv_mod.global_masked_whiten(x, mask), torch.zeros_like(x))
                assert core.masked_var(x, mask) == 0
                outs = simulate_ranks(lambda r, red, x=x, mask=mask: adv_mod.global_masked_whiten(x, mask, red), 2)
                assert all(torch.equal(o, torch.zeros_like(x)) for o in outs), (rows, width, v)
    # REINFORCE++ through its estimator: every answer scored 3.217, no KL term
    mask = prefix_mask([2, 3, 1, 4], 4)
    a = critic_free_advantages("reinforce_pp", torch.full((4,), 3.217), mask, 1)
    assert torch.equal(a, torch.zeros(4, 4))


# ----------------------------------------------------------------------------- loss, hand values


def loss_batch():
    """logp / old_logp giving ratios row0 (1.5, 1), row1 (0.5, 1, 1.1), row2 (any), row3 (1, 1)."""
    old = torch.full((4, 3), -1.0)
    log_ratio = torch.tensor([[math.log(1.5), 0.0, GARBAGE], [math.log(0.5), 0.0, math.log(1.1)],
                              [0.3, GARBAGE, GARBAGE], [0.0, 0.0, GARBAGE]])
    logp = torch.where(MASK.bool(), old + log_ratio, torch.full((4, 3), GARBAGE)).requires_grad_()
    adv = torch.where(MASK.bool(), critic_free_advantages("grpo", SCORES, MASK, 4), torch.full((4, 3), GARBAGE))
    return logp, old, adv


def test_policy_loss_hand_values_for_each_aggregation():
    logp, old, adv = loss_batch()
    # Per-token losses (A = 2/sqrt2 row 0, -1/sqrt2 rows 1 and 3, 0 row 2), eps 0.2:
    # row 0: ratio 1.5 clipped to 1.2 -> -1.2*sqrt2, ratio 1 -> -sqrt2;
    # row 1: ratio 0.5 clipped to 0.8 -> 0.8/sqrt2, then 1/sqrt2, 1.1/sqrt2; row 3: 1/sqrt2 twice.
    token_sum = -2.2 * S2 + 4.9 / S2
    seq_means = [-1.1 * S2, 2.9 / (3 * S2), 0.0, 1 / S2]
    cases = {"token-mean": (token_sum / 8, 8), "seq-mean-token-mean": (sum(seq_means) / 4, 4),
             "seq-mean-token-sum-norm": (token_sum / 12, 12)}
    for mode, (expected, norm) in cases.items():
        assert loss_mod.step_normalizers(MASK, 4, 1, mode, constant=3)[0].item() == norm
        loss, stats = loss_mod.policy_loss(logp, old, adv, MASK, norm, PolicyLossSettings(mode))
        assert loss.item() == pytest.approx(expected, abs=1e-6), mode
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 8)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 8)
    # Asymmetric clip (DAPO): eps_high 0.28 lets row 0 token 0 reach 1.28; eps_low 0.3 clips at 0.7.
    loss, _ = loss_mod.policy_loss(logp, old, adv, MASK, 8, PolicyLossSettings(cliprange_low=0.3, cliprange_high=0.28))
    assert loss.item() == pytest.approx((token_sum - 0.08 * S2 - 0.1 / S2) / 8, abs=1e-6)
    # Gradient w.r.t. logp (token-mean): -A * ratio / 8 where unclipped, 0 where clipped.
    loss, _ = loss_mod.policy_loss(logp, old, adv, MASK, 8)
    (grad,) = torch.autograd.grad(loss, logp)
    expected_grad = torch.tensor([[0.0, -S2 / 8, 0], [0.0, 1 / S2 / 8, 1.1 / S2 / 8], [0, 0, 0],
                                  [1 / S2 / 8, 1 / S2 / 8, 0]])
    assert torch.allclose(grad, expected_grad, atol=1e-6)


def test_kl_loss_is_weights_and_errors():
    logp, old, adv = loss_batch()
    base, _ = loss_mod.policy_loss(logp, old, adv, MASK, 8)
    # k3 with log r = ref - logp = -0.5 on every token: (e^-0.5 - 1) + 0.5 per token.
    ref = torch.where(MASK.bool(), logp.detach() - 0.5, torch.full((4, 3), GARBAGE))
    k3 = math.exp(-0.5) - 1 + 0.5
    loss, stats = loss_mod.policy_loss(logp, old, adv, MASK, 8, ref_logp=ref, kl_loss_coef=0.1)
    assert loss.item() == pytest.approx(base.item() + 0.1 * k3, abs=1e-6)
    assert stats["kl_loss"].item() == pytest.approx(k3, abs=1e-6)
    # Truncated IS weights: exp(old - sampler) capped at 2; rows 1 and 3 get weight 1.5, the rest 1.
    sampler = old.clone()
    sampler[1] -= math.log(1.5)
    sampler[3] -= math.log(1.5)
    sampler[0, 0] -= 5.0  # weight e^5, capped at 2; row 0 token 0 has zero gradient (clipped) but loss counts
    w = loss_mod.truncated_is_weights(old, sampler, MASK, cap=2.0)
    assert w[0, 0].item() == 2.0 and w[1, 1].item() == pytest.approx(1.5) and w[2, 1].item() == 0
    loss, stats = loss_mod.policy_loss(logp, old, adv, MASK, 8, is_weights=w)
    expected = (-1.2 * S2 * 2 - S2 + 1.5 * 2.9 / S2 + 1.5 * 2 / S2) / 8
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="must be >= 1"):
        loss_mod.truncated_is_weights(old, sampler, MASK, cap=0.5)
    with pytest.raises(ValueError, match="needs ref_logp"):
        loss_mod.policy_loss(logp, old, adv, MASK, 8, kl_loss_coef=0.1)
    with pytest.raises(ValueError, match="needs a constant"):
        loss_mod.step_normalizers(MASK, 4, 1, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        loss_mod.policy_loss(logp, old, adv, MASK, 8, PolicyLossSettings("sum"))


def kl_loss_gradient_error(kind: str | None, samples: int = 400_000) -> tuple[float, float]:
    """The mean gradient of the policy loss's KL term (coefficient 1, advantages 0) over ``samples``
    on-policy one-token answers of a 6-way categorical policy, against the exact gradients of
    KL(pi || pi_ref) and of KL(pi_ref || pi): the two relative errors."""
    g = torch.Generator().manual_seed(0)
    theta = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.2, 0.0], dtype=torch.float64, requires_grad=True)
    log_ref = torch.log_softmax(torch.tensor([-0.3, 0.9, 0.4, -0.8, 0.1, 0.6], dtype=torch.float64), -1)
    log_pi = torch.log_softmax(theta, -1)
    tokens = torch.multinomial(log_pi.detach().exp(), samples, replacement=True, generator=g)
    logp = log_pi[tokens].unsqueeze(1)
    settings = PolicyLossSettings() if kind is None else PolicyLossSettings(kl_loss_kind=kind)
    loss, _ = loss_mod.policy_loss(logp, logp.detach(), torch.zeros_like(logp), torch.ones(samples, 1),
                                   float(samples), settings, ref_logp=log_ref[tokens].unsqueeze(1), kl_loss_coef=1.0)
    (grad,) = torch.autograd.grad(loss, theta, retain_graph=True)
    forward = (log_pi.exp() * (log_pi - log_ref)).sum()  # KL(pi || pi_ref), exact
    reverse = (log_ref.exp() * (log_ref - log_pi)).sum()  # KL(pi_ref || pi), exact
    errors = []
    for kl in (forward, reverse):
        (exact,) = torch.autograd.grad(kl, theta, retain_graph=True)
        errors.append(((grad - exact).norm() / exact.norm()).item())
    return errors[0], errors[1]


def test_kl_loss_term_pulls_by_the_gradient_of_kl_policy_to_reference():
    # On samples from pi, k2's gradient d * grad(log pi) averages to grad KL(pi || pi_ref); k3's as written,
    # (1 - pi_ref / pi) * grad(log pi), to grad KL(pi_ref || pi). The default (k3's value, k2's gradient)
    # must pull by the first. Before the estimator was selectable the term was k3 as written: 0.185 away
    # from grad KL(pi || pi_ref) on this harness, 0.002 from the reverse KL's.
    default_forward, _ = kl_loss_gradient_error(None)
    assert default_forward < 0.02
    k2_forward, _ = kl_loss_gradient_error("k2")
    assert k2_forward < 0.02
    k3_forward, k3_reverse = kl_loss_gradient_error("k3")
    assert k3_forward > 0.15 and k3_reverse < 0.02


def test_kl_loss_term_values_and_gradients_by_hand():
    # d = logp - ref = 0.5 on every token: k2 = d^2 / 2 = 0.125, gradient d = 0.5; k3 = e^-0.5 - 1 + 0.5,
    # gradient 1 - e^-0.5; k3+ has k3's value and k2's gradient. All are 0 with gradient 0 at d = 0.
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    ref = logp.detach() - 0.5
    k3 = math.exp(-0.5) - 0.5
    cases = {"k2": (0.125, 0.5), "k3": (k3, 1 - math.exp(-0.5)), "k3+": (k3, 0.5)}
    for kind, (value, grad) in cases.items():
        term = loss_mod.kl_loss_term(logp, ref, kind)
        (g,) = torch.autograd.grad(term.sum(), logp)
        assert torch.allclose(term, torch.full((2, 3), value)), kind
        assert torch.allclose(g, torch.full((2, 3), grad)), kind
        term = loss_mod.kl_loss_term(logp, logp.detach(), kind)
        (g,) = torch.autograd.grad(term.sum(), logp)
        assert term.abs().max().item() == 0 and g.abs().max().item() == 0, kind
    with pytest.raises(ValueError, match="unknown kind 'k1'"):
        loss_mod.kl_loss_term(logp, ref, "k1")


def test_logp_diff_on_masked_tokens_only():
    sampler = torch.tensor([[-1.0, -2.0, GARBAGE], [-1.0, -1.0, -1.0]])
    train = torch.tensor([[-1.0, -2.5, 0.0], [-1.25, -1.0, -1.0]])
    out = loss_mod.logp_diff(sampler, train, prefix_mask([2, 3], 3))
    assert out["rollout/logp_diff_max"].item() == 0.5
    assert out["rollout/logp_diff_mean"].item() == pytest.approx(0.75 / 5)


# ----------------------------------------------------------------------------- no dead option


def test_every_option_changes_the_loss_or_gradient():
    torch.manual_seed(3)
    B, A = 8, 5
    mask = prefix_mask([5, 1, 3, 4, 2, 5, 1, 2], A)
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 0.0, 1.0, 3.0])
    old = -torch.rand(B, A) * 2
    logp = (old + torch.randn(B, A) * 0.4).requires_grad_()
    ref = old + torch.randn(B, A) * 0.3
    sampler = old + torch.randn(B, A) * 0.5
    kl = core.kl_penalty(old, ref, "k1")

    def run(algorithm="grpo", scale_by_std=True, kl_in_reward=False, mode="token-mean", low=0.2, high=None,
            cap=None, kl_loss_coef=0.0, kl_loss_kind="k3+", constant=5.0):
        adv = critic_free_advantages(algorithm, scores, mask, 4, kl=kl if kl_in_reward else None, kl_coef=0.3,
                                        scale_by_std=scale_by_std)
        norm = loss_mod.step_normalizers(mask, B, 1, mode, constant=constant)[0]
        w = None if cap is None else loss_mod.truncated_is_weights(old, sampler, mask, cap)
        loss, _ = loss_mod.policy_loss(logp, old, adv, mask, norm, PolicyLossSettings(mode, low, high, kl_loss_kind),
                                       is_weights=w, ref_logp=ref, kl_loss_coef=kl_loss_coef)
        (g,) = torch.autograd.grad(loss, logp)
        return loss.detach(), g

    base = run()
    variants = {"rloo": run(algorithm="rloo"), "reinforce_pp": run(algorithm="reinforce_pp"),
                "dr_grpo": run(scale_by_std=False), "kl_in_reward": run(kl_in_reward=True),
                "seq-mean-token-mean": run(mode="seq-mean-token-mean"),
                "seq-mean-token-sum-norm": run(mode="seq-mean-token-sum-norm"),
                "cliprange_low": run(low=0.05), "cliprange_high": run(high=0.6), "rollout_is_cap": run(cap=1.5),
                "kl_loss": run(kl_loss_coef=0.2)}
    variants["constant"] = run(mode="seq-mean-token-sum-norm", constant=9.0)
    variants["kl_loss_k2"] = run(kl_loss_coef=0.2, kl_loss_kind="k2")
    variants["kl_loss_k3"] = run(kl_loss_coef=0.2, kl_loss_kind="k3")
    against = {"constant": "seq-mean-token-sum-norm", "kl_loss_k2": "kl_loss", "kl_loss_k3": "kl_loss"}
    for name, (loss, grad) in variants.items():
        ref_loss, ref_grad = variants[against[name]] if name in against else base
        changed = abs(loss - ref_loss).item() > 1e-6 or (grad - ref_grad).abs().max().item() > 1e-6
        assert changed, f"option {name} changes nothing"


# ----------------------------------------------------------------------------- gradient invariance


def toy_setup(seed: int = 0):
    """8 answers of a toy policy whose parameters W (V, V) are shared by all rows."""
    g = torch.Generator().manual_seed(seed)
    V, A = 7, 5
    W0 = torch.randn(V, V, generator=g)
    tokens = torch.randint(0, V, (8, A + 1), generator=g)
    mask = prefix_mask([5, 1, 3, 4, 2, 5, 1, 2], A)
    with torch.no_grad():
        old = toy_logp(W0, tokens)
        ref = old + 0.3 * torch.randn(8, A, generator=g)
    W = (W0 + 0.3 * torch.randn(V, V, generator=g)).requires_grad_()  # ratios away from 1: clipping happens
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 0.0, 1.0, 3.0])
    return W, tokens, mask, old, ref, scores


@dataclass(frozen=True)
class ToyBatch:
    """The toy policy's parameters ``W`` and its 8 answers: ``tokens`` ``(8, A + 1)``, ``mask``, the
    old and reference log-probs and the advantages ``(8, A)``."""

    W: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    adv: torch.Tensor


def toy_logp(W: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logprobs_from_logits(W[tokens[:, :-1]], tokens[:, 1:])


def step_grad(b: ToyBatch, rows, micro_batch, gas, mode, all_reduce_sum=None, naive=False) -> torch.Tensor:
    """Summed gradient of one rank's rows trained as micro-batches with a global normaliser."""
    W, tokens, mask, old, ref, adv = b.W, b.tokens, b.mask, b.old, b.ref, b.adv
    m = mask[rows]
    norms = loss_mod.step_normalizers(m, micro_batch, gas, mode, constant=5.0, all_reduce_sum=all_reduce_sum)
    grad = torch.zeros_like(W)
    for i, norm in enumerate(norms):
        sl = slice(rows.start + i * micro_batch, rows.start + (i + 1) * micro_batch)
        if naive:  # the usual bug: each micro-batch normalised by its own count
            norm = loss_mod.step_normalizers(mask[sl], micro_batch, 1, mode, constant=5.0)[0]
        loss, _ = loss_mod.policy_loss(toy_logp(W, tokens[sl]), old[sl], adv[sl], mask[sl], norm,
                                       PolicyLossSettings(mode, 0.2, 0.28), ref_logp=ref[sl], kl_loss_coef=0.1)
        grad += torch.autograd.grad(loss, W)[0]
    return grad


@pytest.mark.parametrize("mode", GLOBAL_LOSS_AGG_MODES)
def test_same_gradient_for_one_micro_batch_accumulation_and_two_ranks(mode):
    W, tokens, mask, old, ref, scores = toy_setup()
    # Advantages on each rank's whole buffer: a group of 4 is one rank's rows, so they agree.
    adv = critic_free_advantages("grpo", scores, mask, 4)
    batch = ToyBatch(W, tokens, mask, old, ref, adv)
    one = step_grad(batch, slice(0, 8), 8, 1, mode)
    accumulated = step_grad(batch, slice(0, 8), 2, 4, mode)
    ranks = simulate_ranks(lambda r, red: step_grad(batch, slice(4 * r, 4 * r + 4), 2, 2, mode, red), 2)
    assert one.abs().max() > 1e-3
    assert torch.allclose(accumulated, one, atol=1e-6, rtol=0)
    assert torch.allclose(ranks[0] + ranks[1], one, atol=1e-6, rtol=0)
    # The test can fail: normalising each micro-batch by its own count changes the gradient.
    naive = step_grad(batch, slice(0, 8), 2, 4, mode, naive=True)
    assert (naive - one).abs().max() > 1e-3


def test_loss_scale_undoes_accumulation_and_rank_average_for_global_modes_only():
    assert loss_mod.loss_scale("token-mean", 4, 2) == 8.0
    assert loss_mod.loss_scale("micro-batch-token-mean", 4, 2) == 1.0
