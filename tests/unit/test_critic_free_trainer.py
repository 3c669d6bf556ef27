"""CriticFreeTrainer.learn: the gradient of one optimizer step is the same whether the buffer is
one micro-batch or four accumulated ones (loss divided by the step's global count, scaled by
gas × world for DeepSpeed's division), for each aggregation mode."""

from types import SimpleNamespace

import pytest
import torch

from chatrl.config import PPOConfig
from chatrl.step3_ppo.critic_free_trainer import CriticFreeExperience, CriticFreeTrainer


class FakeEngine(torch.nn.Module):
    """What the trainer uses of a DeepSpeed engine: forward, backward (divides by gas), step."""

    def __init__(self, model, gas):
        super().__init__()
        self.model, self.gas = model, gas

    def forward(self, **kw):
        return self.model(**kw)

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


def experience():
    g = torch.Generator().manual_seed(1)
    P, A, B = 3, 5, 8
    seq = torch.randint(2, 32, (B, P + A), generator=g)
    lengths = torch.tensor([5, 1, 3, 0, 2, 5, 4, 1])
    action_mask = (torch.arange(A)[None] < lengths[:, None]).long()
    mask = torch.cat([torch.ones(B, P, dtype=torch.long), action_mask], dim=1)
    old = -torch.rand(B, A, generator=g) * 3
    adv = torch.randn(B, A, generator=g) * action_mask
    z = torch.zeros(B, A)
    return CriticFreeExperience(seq, mask, P, action_mask, old, old + 0.1, z, z, z, adv, z, z, torch.zeros(B), old)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_invariant_to_micro_batching(mode):
    grads = []
    for mb, gas in ((8, 1), (2, 4)):
        model = tiny_model()
        settings = PPOConfig(per_device_training_batch_size=mb, rl_algorithm="grpo", num_samples_per_prompt=4,
                             loss_agg_mode=mode, kl_in="loss", init_kl_coef=0.1)
        tok = SimpleNamespace(eos_token_id=1, pad_token_id=0)
        kl = SimpleNamespace(value=0.1)
        trainer = CriticFreeTrainer(FakeEngine(model, gas), FakeEngine(tiny_model(), 1), None, None, kl, settings,
                                    tok, gas, 1, answer_len=5)
        stats = trainer.learn(experience())
        assert torch.isfinite(torch.tensor(stats["actor_loss"]))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6)
