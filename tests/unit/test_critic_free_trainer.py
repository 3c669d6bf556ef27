"""Trainer.learn, the one step-3 learner: the gradient of one optimizer step is the same whether the
buffer is one micro-batch or four accumulated ones for each global aggregation mode (loss divided by
the step's global count, scaled by gas × world for DeepSpeed's division); PPO's micro-batch mean is
the mean of the micro-batches' own means; a critic trains only when the algorithm has one."""

from types import SimpleNamespace

import pytest
import torch

from chatrl.config import PPOConfig
from chatrl.reward_model import RewardModel
from chatrl.step3_ppo.trainer import Experience, Trainer


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
    return Trainer(FakeEngine(actor, gas), FakeEngine(tiny_model(), 1), critic, None,
                   None, SimpleNamespace(value=0.1), settings, tok, gradient_accumulation_steps=gas, world_size=1,
                   answer_len=5)


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_invariant_to_micro_batching(mode):
    out = []
    for mb, gas in ((8, 1), (2, 4)):
        model = tiny_model()
        settings = PPOConfig(per_device_training_batch_size=mb, rl_algorithm="grpo", num_samples_per_prompt=4,
                             loss_agg_mode=mode, kl_in="loss", init_kl_coef=0.1)
        stats = trainer(settings, model, gas).learn(experience())
        assert torch.isfinite(torch.tensor(stats["actor_loss"]))
        out.append(grads(model))
    assert out[0].abs().sum() > 0
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-6)


def test_ppo_micro_batch_mean_and_its_critic():
    """PPO (DeepSpeed-Chat's aggregation): four micro-batches of 2 accumulated give the mean of the
    four micro-batches' own token means, which is not the one-micro-batch gradient (rows hold
    1 to 5 tokens); the critic makes one step per micro-batch; a critic-free algorithm refuses one."""
    out, critics = [], []
    for mb, gas in ((8, 1), (2, 4)):
        model, critic = tiny_model(), tiny_critic()
        settings = PPOConfig(per_device_training_batch_size=mb, separate_experience_pass=True)
        stats = trainer(settings, model, gas, FakeEngine(critic, gas)).learn(experience(with_values=True))
        assert {"actor_loss", "critic_loss", "value_clip_frac", "clip_frac"} <= set(stats)
        out.append(grads(model))
        critics.append(grads(critic))
    assert (out[0] - out[1]).abs().max() > 1e-4  # the split changes PPO's gradient: that is its aggregation
    # by hand: the accumulated gradient is the mean of the four micro-batches' gradients
    parts = []
    for i in range(4):
        model = tiny_model()
        exp = experience(with_values=True).rows(slice(2 * i, 2 * i + 2))
        settings = PPOConfig(per_device_training_batch_size=2, separate_experience_pass=True)
        trainer(settings, model, 1, FakeEngine(tiny_critic(), 1)).learn(exp)
        parts.append(grads(model))
    torch.testing.assert_close(out[1], sum(parts) / 4, rtol=0, atol=1e-6)
    assert critics[0].abs().sum() > 0
    with pytest.raises(ValueError, match="has no critic"):
        trainer(PPOConfig(rl_algorithm="grpo"), tiny_model(), 1, FakeEngine(tiny_critic(), 1))
    with pytest.raises(ValueError, match="needs critic"):
        trainer(PPOConfig(), tiny_model(), 1)
