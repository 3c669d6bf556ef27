"""Trainer.learn, the one step-3 learner: the gradient of one optimizer step is the same whether the
buffer is one micro-batch or four accumulated ones for each global aggregation mode (loss divided by
the step's global count, scaled by gas × world for DeepSpeed's division), PPO's default included, for
its actor and its critic; DeepSpeed-Chat's micro-batch mean (an option) is the mean of the
micro-batches' own means; a critic trains only when the algorithm has one."""

import math
from types import SimpleNamespace

import pytest
import torch

from chatrl.config import PPOConfig
from chatrl.models.reward_model import RewardModel
from chatrl.rl.stats import PooledStats
from chatrl.step3_ppo.engine import RLHFEngines
from chatrl.step3_ppo.trainer import Experience, OptimizerStep, Trainer, packed_answer_logp


class FakeEngine(torch.nn.Module):
    """What the trainer uses of a DeepSpeed engine: forward, backward (divides by gas), step."""

    def __init__(self, model, gas):
        super().__init__()
        self.model, self.gas = model, gas

    def forward(self, *args, **kw):
        return self.model(*args, **kw)

    def backward(self, loss):
        (loss / self.gas).backward()

    def step(self):
        pass

    def is_gradient_accumulation_boundary(self):
        return False


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float().eval()


def tiny_critic():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_labels=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return RewardModel(LlamaForSequenceClassification(cfg).float().eval())


def experience(with_values: bool = False) -> Experience:
    g = torch.Generator().manual_seed(1)
    P, A, B = 3, 5, 8
    seq = torch.randint(2, 32, (B, P + A), generator=g)
    lengths = torch.tensor([5, 1, 3, 0, 2, 5, 4, 1])
    action_mask = (torch.arange(A)[None] < lengths[:, None]).long()
    mask = torch.cat([torch.ones(B, P, dtype=torch.long), action_mask], dim=1)
    old = -torch.rand(B, A, generator=g) * 3
    adv = torch.randn(B, A, generator=g) * action_mask
    exp = Experience(seq, mask, P, action_mask, old, torch.zeros(B), ref_logp=old + 0.1, logp=old,
                     entropy=torch.zeros(B, A), kl=torch.zeros(B, A), advantages=adv)
    if with_values:
        exp.values, exp.returns = torch.randn(B, A, generator=g), torch.randn(B, A, generator=g)
    return exp


def trainer(settings: PPOConfig, actor, gas: int, critic=None) -> Trainer:
    tok = SimpleNamespace(eos_token_id=1, pad_token_id=0, chat_template=None)
    return Trainer(RLHFEngines(FakeEngine(actor, gas), FakeEngine(tiny_model(), 1), critic), None,
                   None, SimpleNamespace(value=0.1), settings, tok, step=OptimizerStep(gas, answer_len=5))


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_invariant_to_micro_batching(mode):
    out = []
    for mb, gas in ((8, 1), (2, 4)):
        model = tiny_model()
        settings = PPOConfig(per_device_training_batch_size=mb, rl_algorithm="grpo", num_samples_per_prompt=4,
                             loss_agg_mode=mode, kl_in="loss", init_kl_coef=0.1)
        stats = PooledStats()
        trainer(settings, model, gas).learn(experience(), stats)
        assert torch.isfinite(torch.tensor(stats.finish()["actor_loss"]))
        out.append(grads(model))
    assert out[0].abs().sum() > 0
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-6)


def test_ppo_default_is_invariant_to_micro_batching_for_actor_and_critic():
    """PPO's default aggregation is the optimizer step's token mean, for the policy loss and the value
    loss alike: one micro-batch of 8 or four accumulated micro-batches of 2 (rows of 0 to 5 tokens)
    give the same actor and critic gradients."""
    actors, critics = [], []
    for mb, gas in ((8, 1), (2, 4)):
        model, critic = tiny_model(), tiny_critic()
        settings = PPOConfig(per_device_training_batch_size=mb, separate_experience_pass=True)
        assert settings.loss_aggregation == "token-mean"
        trainer(settings, model, gas, FakeEngine(critic, gas)).learn(experience(with_values=True), PooledStats())
        actors.append(grads(model))
        critics.append(grads(critic))
    assert actors[0].abs().sum() > 0 and critics[0].abs().sum() > 0
    torch.testing.assert_close(actors[0], actors[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(critics[0], critics[1], rtol=0, atol=1e-6)


def test_ppo_micro_batch_mean_and_its_critic():
    """DeepSpeed-Chat's aggregation (``--loss_agg_mode micro-batch-token-mean``): four micro-batches of 2
    accumulated give the mean of the four micro-batches' own token means, which is not the
    one-micro-batch gradient (rows hold 1 to 5 tokens); the critic makes one step per micro-batch; a
    critic-free algorithm refuses one."""
    out, critics = [], []
    mode = "micro-batch-token-mean"
    for mb, gas in ((8, 1), (2, 4)):
        model, critic = tiny_model(), tiny_critic()
        settings = PPOConfig(per_device_training_batch_size=mb, separate_experience_pass=True, loss_agg_mode=mode)
        stats = PooledStats()
        trainer(settings, model, gas, FakeEngine(critic, gas)).learn(experience(with_values=True), stats)
        assert {"actor_loss", "critic_loss", "value_clip_frac", "clip_frac"} <= set(stats.finish())
        out.append(grads(model))
        critics.append(grads(critic))
    assert (out[0] - out[1]).abs().max() > 1e-4  # the split changes PPO's gradient: that is its aggregation
    # by hand: the accumulated gradient is the mean of the four micro-batches' gradients
    parts = []
    for i in range(4):
        model = tiny_model()
        exp = experience(with_values=True).rows(slice(2 * i, 2 * i + 2))
        settings = PPOConfig(per_device_training_batch_size=2, separate_experience_pass=True, loss_agg_mode=mode)
        trainer(settings, model, 1, FakeEngine(tiny_critic(), 1)).learn(exp, PooledStats())
        parts.append(grads(model))
    torch.testing.assert_close(out[1], sum(parts) / 4, rtol=0, atol=1e-6)
    assert critics[0].abs().sum() > 0
    with pytest.raises(ValueError, match="has no critic"):
        trainer(PPOConfig(rl_algorithm="grpo"), tiny_model(), 1, FakeEngine(tiny_critic(), 1))
    with pytest.raises(ValueError, match="needs critic"):
        trainer(PPOConfig(), tiny_model(), 1)


def test_temperature_is_in_the_sampled_and_the_trained_distribution():
    """At --temperature 0.5 the first token is drawn from softmax(logits / 0.5): the sampler reports the
    log-prob of that distribution, the trainer scores the same one (to float32 rounding), and the
    empirical frequency of the likeliest token matches it, not the untempered probability."""
    from chatrl.hybrid_engine import GenerationSettings
    from chatrl.hybrid_engine.decode import TPGroup, decode, gather_prompts
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # a peaked first-token distribution, far from its tempered one
    ids = torch.tensor([[5, 6, 7]]).repeat(4000, 1)
    mask = torch.ones_like(ids)
    settings = GenerationSettings(max_new_tokens=2, do_sample=True, temperature=0.5, pad_token_id=0)
    torch.manual_seed(0)
    with torch.no_grad():
        tokens, _, sampler_logp = decode(model, gather_prompts(ids, mask, TPGroup(), 0, 2), settings, TPGroup(),
                                         keep_logprobs=True)
    seq = torch.cat([ids, tokens], dim=1)
    tr = trainer(PPOConfig(rl_algorithm="grpo"), model, 1)
    tr.temperature = 0.5
    with torch.no_grad():
        trained = tr.padded_logp(model, seq[:8], torch.ones_like(seq[:8]), 3)
        first = torch.softmax(model(ids[:1]).logits[0, -1].float(), -1)
    torch.testing.assert_close(trained, sampler_logp[:8], rtol=0, atol=1e-5)
    top = int(first.argmax())
    p_untempered = float(first[top])
    p_tempered = float(torch.softmax(torch.log(first) / 0.5, -1)[top])
    freq = float((tokens[:, 0] == top).float().mean())
    sigma = (p_tempered * (1 - p_tempered) / len(ids)) ** 0.5
    assert abs(freq - p_tempered) < 4 * sigma, (freq, p_tempered, p_untempered)
    assert abs(freq - p_untempered) > 8 * sigma  # the untempered distribution is not what was sampled (0.37 vs 0.49)


def test_pooled_statistics_are_those_of_the_global_batch():
    """Rank 0 scoring 0 and rank 1 scoring 1: the score std over both is 0.5 (the mean of the per-rank
    stds is 0); a token mean weighs every token of every rank alike; the explained variance is the
    whole batch's; means, stds and the explained variance equal the one-process figures."""
    from chatrl.rl import core
    from tests.unit.test_critic_free import simulate_ranks

    torch.manual_seed(0)
    scores = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    entropy = torch.rand(6, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    values, returns = torch.randn(6, 4), torch.randn(6, 4)

    def fill(stats, rows):
        stats.add_mean("score_mean", scores[rows])
        stats.add_std("score_std", scores[rows])
        stats.add_mean("entropy", entropy[rows], mask[rows])
        stats.add_explained_variance("ev", values[rows], returns[rows], mask[rows])
        clipped = (entropy[rows] > 0.5).float()  # a micro-batch's token mean, weighed by its token count
        stats.add_weighted("clip_frac", core.masked_mean(clipped, mask[rows]).item(), float(mask[rows].sum()))

    def rank(r, reduce):
        stats = PooledStats()
        fill(stats, slice(3 * r, 3 * r + 3))
        return stats.finish(reduce)

    per_rank = simulate_ranks(rank, 2)
    whole = PooledStats()
    fill(whole, slice(0, 6))
    whole = whole.finish()
    assert per_rank[0] == per_rank[1]
    got = per_rank[0]
    assert got["score_std"] == pytest.approx(0.5) and got["score_mean"] == pytest.approx(0.5)
    assert got["entropy"] == pytest.approx(core.masked_mean(entropy, mask).item(), abs=1e-6)  # float32 there
    assert got["ev"] == pytest.approx(core.explained_variance(values, returns, mask).item(), abs=1e-6)
    for k in whole:
        assert got[k] == pytest.approx(whole[k], abs=1e-7), k
    # the mean of per-rank figures is what was logged before: it differs for every non-additive one
    ranks = [PooledStats(), PooledStats()]
    for r in (0, 1):
        fill(ranks[r], slice(3 * r, 3 * r + 3))
    alone = [s.finish() for s in ranks]
    assert (alone[0]["score_std"] + alone[1]["score_std"]) / 2 == 0.0
    assert abs((alone[0]["entropy"] + alone[1]["entropy"]) / 2 - got["entropy"]) > 1e-3
    constant = PooledStats()
    constant.add_explained_variance("ev", values, torch.full((6, 4), 3.217), mask)
    constant.add_std("std", torch.full((7,), 3.217, dtype=torch.float32))
    finished = constant.finish()
    assert math.isnan(finished["ev"])  # returns that do not vary: NaN, as core.explained_variance
    assert finished["std"] == 0.0  # a constant batch has no spread, whatever its float rounding


@pytest.mark.parametrize("top_k, top_p", [(0, 0.5), (5, 1.0)])
def test_top_p_and_top_k_are_in_the_sampled_and_the_trained_distribution(top_k, top_p):
    """With a top-p or top-k filter the sampler draws from the filtered distribution; the trainer's
    log-probs (old and new: one function) and the reference's are those of the same filtered
    distribution, so the sampler/trainer agreement holds on identical weights, the frequency of the
    likeliest first token matches its filtered probability, and with the actor as its own reference
    the KL is 0. Scoring the full softmax instead (chatrl before) put the sampler/trainer gap at 0.69
    nats at top-p 0.5 and 0.82 at top-k 5, and trained the likeliest first token, drawn 0.55 and 0.49
    of the time, at 0.28."""
    from chatrl.hybrid_engine import GenerationSettings
    from chatrl.hybrid_engine.decode import TPGroup, decode, gather_prompts
    from chatrl.logprobs import sampling_filter
    from chatrl.models.causal_lm import load_causal_lm, load_tokenizer
    from chatrl.rl import core
    from tests.conftest import STORIES

    tok = load_tokenizer(str(STORIES), padding_side="left")
    model = load_causal_lm(str(STORIES), tok, "fp32").eval()
    prompt = tok("She saw a")["input_ids"]  # a spread first token: 0.28 for the likeliest, 0.57 in the top 5
    n = 4000
    ids = torch.tensor([prompt]).repeat(n, 1)
    mask = torch.ones_like(ids)
    settings = GenerationSettings(max_new_tokens=3, do_sample=True, top_k=top_k, top_p=top_p,
                                  pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.no_grad():
        tokens, _, sampler_logp = decode(model, gather_prompts(ids, mask, TPGroup(), tok.pad_token_id, 3), settings,
                                         TPGroup(), keep_logprobs=True)
    seq = torch.cat([ids, tokens], dim=1)
    tr = trainer(PPOConfig(rl_algorithm="grpo"), model, 1)
    tr.top_k, tr.top_p = top_k, top_p
    rows = slice(0, 64)
    with torch.no_grad():
        trained, entropy = tr.padded_logp(model, seq[rows], torch.ones_like(seq[rows]), len(prompt), entropy=True)
        full = torch.softmax(model(ids[:1]).logits[0, -1].float(), -1)
    diff = (trained - sampler_logp[rows]).abs().max().item()
    assert diff < 1e-5, diff
    packed = packed_answer_logp(model, seq[rows], torch.ones_like(seq[rows]), len(prompt), tok.pad_token_id,
                                top_k=top_k, top_p=top_p)  # --packing scores the same distribution
    torch.testing.assert_close(packed, trained, rtol=0, atol=1e-5)
    # the actor as its own reference: the same filter on the same logits, KL exactly 0
    action = torch.ones_like(trained)
    assert core.masked_kl(trained, tr.padded_logp(model, seq[rows], torch.ones_like(seq[rows]), len(prompt)),
                          action, "k1").abs().max().item() == 0.0
    top = int(full.argmax())
    kept = torch.isfinite(sampling_filter(full.log()[None], top_k, top_p)[0])
    p_filtered = float(full[top] / full[kept].sum())
    first = tokens[:, 0]
    assert bool(kept[first].all())  # nothing outside the filter was drawn
    freq = float((first == top).float().mean())
    sigma = (p_filtered * (1 - p_filtered) / n) ** 0.5
    assert abs(freq - p_filtered) < 4 * sigma, (freq, p_filtered, float(full[top]))
    assert abs(freq - float(full[top])) > 8 * sigma  # the full softmax is not what was sampled
    hit = seq[rows, len(prompt)] == top
    assert hit.any()
    assert math.isclose(math.exp(float(trained[hit, 0][0])), p_filtered, rel_tol=1e-4)
    # the entropy is that of the filtered distribution
    q = full[kept] / full[kept].sum()
    assert math.isclose(float(entropy[0, 0]), float(-(q * q.log()).sum()), rel_tol=1e-4)
