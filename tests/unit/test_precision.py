"""Precision: --dtype auto, the float32 islands fed bf16 inputs, the float32 heads, the float32 EMA, and
the importance weights of the sampler/trainer correction (hand-derived values).

An island's contract: bf16 inputs are promoted before any arithmetic, so its output is float32 (or
wider) and EQUAL to the float32 computation on the same values (a bf16 number is exactly a float32
number); a computation that stayed in bf16 would differ by bf16 rounding (2^-9 relative) and fail.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from chatrl.config import ModelConfig, PPOConfig
from chatrl.errors import UsageError
from chatrl.logprobs import entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from chatrl.models import precision
from chatrl.rl import core
from chatrl.rl.advantages import AdvantageInputs, global_masked_whiten
from chatrl.rl.algorithms import ALGORITHMS
from chatrl.rl.loss import logp_diff, policy_loss, rollout_is_weights, truncated_is_weights

BF16 = torch.bfloat16


def bf16(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])


def same(out_bf16_in, out_fp32_in):
    """Float32 or wider, and equal to the float32 computation (to its own rounding, summation order aside)."""
    for a, b in zip(out_bf16_in if isinstance(out_bf16_in, tuple) else (out_bf16_in,),
                    out_fp32_in if isinstance(out_fp32_in, tuple) else (out_fp32_in,), strict=True):
        if a is None:
            continue
        assert a.dtype in (torch.float32, torch.float64), a.dtype
        torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- --dtype auto
def test_auto_resolves_to_bf16_only_where_the_device_runs_it_natively(monkeypatch):
    precision.native_bf16.cache_clear()
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True, "amx_bf16": False})
    assert precision.resolve_dtype("auto", "cpu") == ("bf16", "--dtype auto: CPU with AVX512-BF16")
    precision.native_bf16.cache_clear()
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": False, "amx_bf16": True})
    assert precision.resolve_dtype("auto", "cpu")[0] == "bf16"
    precision.native_bf16.cache_clear()
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": False, "avx512_f": True})
    assert precision.resolve_dtype("auto", "cpu") == ("fp32", "--dtype auto: this CPU has no native bf16")
    precision.native_bf16.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)  # a V100
    assert precision.resolve_dtype("auto", "cuda")[0] == "fp32"
    precision.native_bf16.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert precision.resolve_dtype("auto", "cuda") == ("bf16", "--dtype auto: CUDA device with bf16")
    precision.native_bf16.cache_clear()
    for explicit in ("fp32", "bf16", "fp16"):
        assert precision.resolve_dtype(explicit) == (explicit, "")
    with pytest.raises(ValueError, match="--dtype must be one of"):
        precision.resolve_dtype("float8")


def test_model_block_resolves_auto_where_settings_are_read(monkeypatch):
    precision.native_bf16.cache_clear()
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True})
    try:
        m = ModelConfig(model_name_or_path="x", dtype="auto")
        assert m.dtype == "bf16" and m.dtype_note == "bf16 (--dtype auto: CPU with AVX512-BF16)"
        assert ModelConfig(model_name_or_path="x", dtype="bf16").dtype_note == "bf16"
    finally:
        precision.native_bf16.cache_clear()


# -------------------------------------------------------------------------------------- float32 heads
def test_compute_in_fp32_gives_float32_outputs_and_bf16_gradients():
    lin = torch.nn.Linear(8, 5, bias=True).to(BF16)
    x = bf16(3, 8)
    expected = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    precision.compute_in_fp32(lin)
    out = lin(x)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert not torch.equal(out, lin.weight.new_tensor(0) + F.linear(x, lin.weight, lin.bias).float())  # bf16 rounds
    out.sum().backward()
    assert lin.weight.grad.dtype == BF16 and lin.weight.grad.abs().sum() > 0
    twin = copy.deepcopy(lin)  # the EMA's and DPO's copies carry it
    assert precision.computes_in_fp32(twin) and twin.forward.__self__ is twin
    assert torch.equal(twin(x), expected)
    with pytest.raises(TypeError, match="nn.Linear"):
        precision.compute_in_fp32(torch.nn.Embedding(4, 4))


def test_reward_model_scores_and_values_are_float32_in_bf16(tiny_opt):
    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model

    tok = load_tokenizer(str(tiny_opt))
    rm = load_reward_model(str(tiny_opt), tok, dtype="bf16", require_head=False).eval()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, tok.pad_token_id]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    with torch.no_grad():
        out = rm(ids, mask)
        hidden = rm.hf.model(input_ids=ids, attention_mask=mask).last_hidden_state
    head = rm.hf.score.weight
    assert head.dtype == BF16 and out.values.dtype == torch.float32 and out.end_scores.dtype == torch.float32
    expected = (hidden.float() @ head.float().t()).squeeze(-1)
    torch.testing.assert_close(out.end_scores, torch.stack([expected[0, 3], expected[1, 2]]), rtol=0, atol=1e-6)


def test_fp32_lm_head_gives_float32_logits_in_training_and_decoding(tiny_opt):
    from chatrl.hybrid_engine.decode import head_weight, project_head
    from chatrl.models.causal_lm import causal_lm_logits, load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(tiny_opt))
    plain = load_causal_lm(str(tiny_opt), tok, "bf16").eval()
    lm = load_causal_lm(str(tiny_opt), tok, "bf16", fp32_lm_head=True).eval()
    assert precision.computes_in_fp32(lm.lm_head) and not precision.computes_in_fp32(plain.lm_head)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        hidden = lm.model.decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = causal_lm_logits(lm, ids, mask)
        bf16_logits = causal_lm_logits(plain, ids, mask)
    w = lm.lm_head.weight
    expected = hidden.float() @ w.float().t()
    assert logits.dtype == torch.float32 and bf16_logits.dtype == BF16
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert (bf16_logits.float() - expected).abs().max() > 1e-3  # what the bf16 head's rounding costs
    # decoding multiplies by the same float32 matrix (cast once per call), the bf16 head by its own
    last = hidden[:, -1]
    assert head_weight(lm.lm_head).dtype == torch.float32 and head_weight(plain.lm_head) is plain.lm_head.weight
    torch.testing.assert_close(project_head(lm.lm_head, last, head_weight(lm.lm_head)), logits[:, -1], rtol=0,
                               atol=1e-5)
    assert project_head(plain.lm_head, last).dtype == BF16


# --------------------------------------------------------------------------------- the float32 islands
def test_token_maths_promotes_bf16_logits():
    logits, labels = bf16(2, 5, 11, scale=4.0), torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    same(logprobs_from_logits(logits, labels), logprobs_from_logits(logits.float(), labels))
    same(entropy_from_logits(logits), entropy_from_logits(logits.float()))
    same(logprobs_and_entropy(logits, labels), logprobs_and_entropy(logits.float(), labels))
    same(core.ptx_loss(logits, labels), core.ptx_loss(logits.float(), labels))


def test_kl_rewards_gae_whitening_and_value_loss_promote_bf16():
    logp, ref = bf16(3, 5, scale=0.5, seed=1) - 2, bf16(3, 5, scale=0.5, seed=2) - 2
    for kind in ("k1", "k3", "abs", "mse"):
        same(core.kl_penalty(logp, ref, kind), core.kl_penalty(logp.float(), ref.float(), kind))
        same(core.masked_kl(logp, ref, MASK, kind), core.masked_kl(logp.float(), ref.float(), MASK, kind))
    kl, score = bf16(3, 5, scale=0.1, seed=3), bf16(3, seed=4)
    same(core.compute_rewards(score, kl, MASK), core.compute_rewards(score.float(), kl.float(), MASK))
    values, rewards = bf16(3, 5, seed=5), bf16(3, 5, seed=6)
    same(core.gae(values, rewards, MASK), core.gae(values.float(), rewards.float(), MASK))
    same(core.masked_whiten(values, MASK), core.masked_whiten(values.float(), MASK))
    same(global_masked_whiten(values, MASK), global_masked_whiten(values.float(), MASK))
    old, ret = bf16(3, 5, seed=7), bf16(3, 5, seed=8)
    same(core.critic_loss(values, old, ret, MASK)[0], core.critic_loss(values.float(), old.float(), ret.float(), MASK)[0])
    same(core.explained_variance(values, ret, MASK), core.explained_variance(values.float(), ret.float(), MASK))


def test_policy_loss_and_agreement_promote_bf16():
    logp, old, adv = bf16(3, 5, scale=0.3, seed=1) - 1, bf16(3, 5, scale=0.3, seed=2) - 1, bf16(3, 5, seed=3)
    loss, stats = policy_loss(logp, old, adv, MASK, 9.0, is_weights=bf16(3, 5, seed=4).abs(), ref_logp=old,
                              kl_loss_coef=0.1)
    loss32, stats32 = policy_loss(logp.float(), old.float(), adv.float(), MASK, 9.0,
                                  is_weights=bf16(3, 5, seed=4).abs().float(), ref_logp=old.float(), kl_loss_coef=0.1)
    same(loss, loss32)
    for k in stats:
        same(stats[k], stats32[k])
    same(rollout_is_weights(logp, old, MASK, level="sequence", mode="mask", cap=3.0)[0],
         rollout_is_weights(logp.float(), old.float(), MASK, level="sequence", mode="mask", cap=3.0)[0])
    same(logp_diff(logp, old, MASK)["rollout/logp_diff_mean"], logp_diff(logp.float(), old.float(), MASK)["rollout/logp_diff_mean"])


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_advantage_estimator_promotes_bf16_scores_kl_and_values(name):
    algo = ALGORITHMS[name]
    n = 3 if algo.min_samples_per_prompt > 1 else 1
    scores, kl = bf16(3, seed=1), bf16(3, 5, scale=0.05, seed=2)
    values = bf16(3, 5, seed=3) if algo.needs_critic else None
    settings = PPOConfig(rl_algorithm=name, num_samples_per_prompt=n)

    def run(cast):
        return algo.estimate(AdvantageInputs(cast(scores), MASK, cast(kl), 0.1,
                                             None if values is None else cast(values), n), settings)

    a, b = run(lambda t: t), run(lambda t: t.float())
    same(a.advantages, b.advantages)
    for x, y in ((a.returns, b.returns), (a.rewards, b.rewards)):
        if x is not None:
            same(x, y)


def test_sft_dpo_and_reward_losses_promote_bf16():
    from chatrl.models.reward_model import pairwise_loss
    from chatrl.step1_sft.loss import token_nll
    from chatrl.step2_dpo.loss import DPOConfig, answer_logps, preference_loss

    logits = bf16(2, 6, 13, scale=3.0)
    ids = torch.randint(0, 13, (2, 6), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :2] = -100
    same(token_nll(logits, labels)[0], token_nll(logits.float(), labels)[0])
    answer = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0]])
    same(answer_logps(logits, ids, answer)[0], answer_logps(logits.float(), ids, answer)[0])
    pc, pr, rc, rr = (bf16(4, seed=s) - 20 for s in range(4))
    losses, cr, rj = preference_loss(DPOConfig(), pc, pr, rc, rr)
    same((losses, cr, rj), preference_loss(DPOConfig(), pc.float(), pr.float(), rc.float(), rr.float()))
    same(pairwise_loss(pc, pr), pairwise_loss(pc.float(), pr.float()))


# ------------------------------------------------------------------------------------------ the EMA
def test_ema_in_float32_follows_a_bf16_actor_that_a_bf16_ema_cannot():
    """beta 0.992 and an actor 1/64 above the EMA's 1.0: the float32 EMA moves by 0.008/64 = 1.25e-4 per
    update (exactly, to float32 rounding); a bf16 EMA does not move at all (half its 2^-8 rounding step
    at 1.0 is 2e-3), which is why step 3 holds the EMA in float32."""
    from chatrl.step3_ppo.trainer import update_ema

    actor = torch.nn.Linear(1, 4, bias=False).to(BF16)
    with torch.no_grad():
        actor.weight.fill_(1.0 + 1 / 64)
    ema32 = torch.nn.Linear(1, 4, bias=False)
    ema16 = torch.nn.Linear(1, 4, bias=False).to(BF16)
    with torch.no_grad():
        ema32.weight.fill_(1.0)
        ema16.weight.fill_(1.0)
    for _ in range(10):
        update_ema(ema32, actor, 0.992)
        update_ema(ema16, actor, 0.992)
    assert torch.equal(ema16.weight, torch.ones_like(ema16.weight))
    expected = 1 + (1 / 64) * (1 - 0.992 ** 10)
    torch.testing.assert_close(ema32.weight, torch.full_like(ema32.weight, expected), rtol=0, atol=1e-6)


# ------------------------------------------------------------------------ sampler/trainer importance weights
def test_token_level_weights_by_hand():
    old = torch.tensor([[math.log(3.0), math.log(0.5), 0.0, 7.0]])
    sampler = torch.zeros(1, 4)
    mask = torch.tensor([[1, 1, 1, 0]])  # ratios 3, 0.5, 1 (and a masked 1096)
    w, out = rollout_is_weights(old, sampler, mask, level="token", mode="truncate", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.0, 0.0]]))
    assert out.tolist() == [[True, False, False, False]]
    assert torch.equal(w, truncated_is_weights(old, sampler, mask, 2.0))
    w, out = rollout_is_weights(old, sampler, mask, level="token", mode="mask", cap=2.0)  # band [0.5, 2]
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.0, 0.0]]))
    assert out.tolist() == [[True, False, False, False]]
    w, out = rollout_is_weights(old, sampler, mask, level="token", mode="mask", cap=4.0, cap_low=0.6)
    torch.testing.assert_close(w, torch.tensor([[3.0, 0.0, 1.0, 0.0]]))
    assert out.tolist() == [[False, True, False, False]]


def test_sequence_and_geometric_weights_by_hand():
    """Row 0: token ratios 2, 2, 2 (answer ratio 8, geometric mean 2); row 1: ratios 0.5, 1 (answer 0.5,
    geometric mean 1/sqrt 2); row 2: no action token."""
    ln2 = math.log(2.0)
    old = torch.tensor([[ln2, ln2, ln2], [-ln2, 0.0, 50.0], [9.0, 9.0, 9.0]])
    sampler = torch.zeros(3, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    w, out = rollout_is_weights(old, sampler, mask, level="sequence", mode="truncate", cap=5.0)
    torch.testing.assert_close(w, torch.tensor([[5.0, 5.0, 5.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]))
    assert out.tolist() == [[True] * 3, [False] * 3, [False] * 3]
    w, _ = rollout_is_weights(old, sampler, mask, level="sequence", mode="mask", cap=5.0, cap_low=0.4)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]))
    w, out = rollout_is_weights(old, sampler, mask, level="geometric", mode="mask", cap=1.5)  # band [2/3, 1.5]
    g = 2 ** -0.5
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 0.0], [g, g, 0.0], [0.0, 0.0, 0.0]]))
    assert out.tolist() == [[True] * 3, [False] * 3, [False] * 3]
    # a 4000-token answer whose ratio is e^400 neither overflows nor leaves NaN
    w, _ = rollout_is_weights(torch.full((1, 4000), 0.1), torch.zeros(1, 4000), torch.ones(1, 4000),
                              level="sequence", mode="truncate", cap=3.0)
    assert torch.equal(w, torch.full((1, 4000), 3.0))
    for bad, flag in (({"cap": 0.5}, "--rollout_is_cap "), ({"cap": 2.0, "cap_low": 1.5}, "--rollout_is_cap_low"),
                      ({"level": "word"}, "--rollout_is_level"), ({"mode": "clip"}, "--rollout_is_mode")):
        with pytest.raises(UsageError, match=flag):
            rollout_is_weights(old, sampler, mask, **{"cap": 2.0, **bad})


def test_masked_answer_leaves_the_loss_and_only_it():
    """mask mode at the sequence level: the dropped answer's tokens add nothing to the loss or its
    gradient; the kept answer's contribution is its ratio times its unweighted one."""
    ln2 = math.log(2.0)
    old = torch.tensor([[ln2, ln2], [0.1, -0.1]])
    sampler = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    w, _ = rollout_is_weights(old, sampler, mask, level="sequence", mode="mask", cap=2.0)  # row 0: ratio 4
    assert w[0].tolist() == [0.0, 0.0] and torch.allclose(w[1], torch.ones(2))
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    loss, _ = policy_loss(logp, old, adv, mask, 4.0, is_weights=w)
    loss.backward()
    assert torch.equal(logp.grad[0], torch.zeros(2))
    torch.testing.assert_close(logp.grad[1], -adv[1] / 4.0)


# ------------------------------------------------------------------------------ attention on CPU
def test_low_precision_models_attend_in_float32_on_cpu_only():
    assert precision.attention_implementation("bf16", "cpu") == precision.FP32_SDPA
    assert precision.attention_implementation("fp16", "cpu") == precision.FP32_SDPA
    assert precision.attention_implementation("fp32", "cpu") is None
    assert precision.attention_implementation("bf16", "cuda") is None
    assert precision.attention_kwargs("fp32", "cpu") == {}
    with pytest.raises(ValueError, match="dtype must be fp32, bf16 or fp16, got 'auto'"):
        precision.attention_implementation("auto", "cpu")


@pytest.mark.parametrize("masked", [False, True])
def test_fp32_attention_island_is_float32_rounded_once(masked):
    """Against float64 attention over the same bf16 queries, keys and values (causal, and a left-padded
    boolean mask as transformers' SDPA masks give it): the island's output is within one bf16 rounding
    of the truth, torch's bf16 SDPA is further off on average; the island's gradients reach q, k, v in bf16."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    precision.register_fp32_sdpa()
    module = torch.nn.Module()
    module.is_causal = True
    b, h, n, d = 2, 4, 64, 16
    q, k, v = (bf16(b, h, n, d, seed=s).requires_grad_() for s in (1, 2, 3))
    mask = None
    if masked:  # row 1 left-padded by 10 positions
        keep = torch.ones(b, n, dtype=torch.bool)
        keep[1, :10] = False
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
        mask = mask | torch.eye(n, dtype=torch.bool)  # every query sees something (the pads see themselves)
    out, _ = precision._sdpa_in_fp32(module, q, k, v, mask)
    assert out.dtype == BF16 and out.shape == (b, n, h, d)
    truth, _ = sdpa_attention_forward(module, q.double(), k.double(), v.double(), mask)
    native, _ = sdpa_attention_forward(module, q, k, v, mask)
    err = (out.double() - truth).abs()
    assert err.max() <= truth.abs().max() * 2 ** -8, err.max()
    native_err = (native.double() - truth).abs().mean()
    assert native_err > 1.2 * err.mean(), (native_err, err.mean())
    out.double().mul(truth.detach()).sum().backward()
    assert all(t.grad.dtype == BF16 and t.grad.abs().sum() > 0 for t in (q, k, v))


@pytest.mark.parametrize("family", ["opt", "llama", "qwen2"])
def test_bf16_models_load_with_the_fp32_attention_on_cpu(family, tiny_models, tiny_qwen2):
    """A bf16 causal LM and reward model load with the island, an fp32 one with transformers' own; the
    island sees the padding: a left-padded row's logits equal the row alone to bf16 rounding, and
    ignoring the mask moves them far more."""
    from chatrl.models.causal_lm import load_causal_lm, load_tokenizer
    from chatrl.models.reward_model import load_reward_model

    path = str({**tiny_models, "qwen2": tiny_qwen2}[family])
    tok = load_tokenizer(path)
    lm = load_causal_lm(path, tok, "bf16").eval()
    assert lm.config._attn_implementation == precision.FP32_SDPA
    assert load_reward_model(path, tok, dtype="bf16", require_head=False).hf.config._attn_implementation == \
        precision.FP32_SDPA
    assert load_causal_lm(path, tok, "fp32").config._attn_implementation != precision.FP32_SDPA
    g = torch.Generator().manual_seed(0)
    row = torch.randint(3, 1000, (1, 12), generator=g)
    ids = torch.cat([torch.full((1, 6), tok.pad_token_id), row], 1)
    mask = torch.cat([torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], 1)
    with torch.no_grad():
        alone = lm(input_ids=row, attention_mask=torch.ones_like(row)).logits[0].float()
        padded = lm(input_ids=ids, attention_mask=mask).logits[0, 6:].float()
        unmasked = lm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, 6:].float()
    scale = alone.abs().max()
    assert (padded - alone).abs().max() <= scale * 2 ** -6
    assert (unmasked - alone).abs().max() > 4 * (padded - alone).abs().max()
