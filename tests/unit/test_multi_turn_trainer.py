"""The one step-3 Trainer on multi-turn episodes (--env): observation tokens sit in the answer region
with action mask 0, and every per-token quantity (KL, advantages, the policy loss, the entropy
statistic, the sampler/trainer log-prob gap) is masked out there; PPO's GAE crosses them; the
environment's per-turn rewards reach PPO at their turns and the critic-free algorithms through the
episode's score; single answers are unchanged (no environment, no turn tensors)."""

from __future__ import annotations

import pytest
import torch

from chatrl.config import PPOConfig, RewardConfig
from chatrl.data.formatting import encode_example
from chatrl.envs import load_environment
from chatrl.envs.rollout import Episodes
from chatrl.hybrid_engine import Sampler
from chatrl.models.causal_lm import load_tokenizer, stop_token_ids
from chatrl.rewards import build_reward
from chatrl.rl import core
from chatrl.rl.advantages import AdvantageInputs, grpo_outcome_advantages, outcome_per_token, ppo_advantages
from chatrl.rl.stats import PooledStats
from chatrl.sizes import plan_episodes
from chatrl.step3_ppo.engine import RLHFEngines
from chatrl.step3_ppo.trainer import Trainer, concat_rollouts, summarize
from tests.conftest import TOKENIZERS
from tests.unit.test_envs import ScriptedSampler
from tests.unit.test_step3_trainer import FakeEngine


def tiny_lm(vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def setup():
    tok = load_tokenizer(str(TOKENIZERS / "qwen2"), padding_side="left")
    q = {"role": "user", "content": "What is 12*34?"}
    first = encode_example(tok, [q], "<calc>12*34</calc>")[1]
    second = encode_example(tok, [q, {"role": "assistant", "content": "<calc>12*34</calc>"},
                                  {"role": "tool", "content": "408"}], "408")[1]
    return tok, q, first, second


def make_trainer(tok, sampler, algorithm: str, critic=None, n: int = 2):
    settings = PPOConfig(rl_algorithm=algorithm, num_samples_per_prompt=n, per_device_training_batch_size=4,
                         separate_experience_pass=True, init_kl_coef=0.05)
    reward = build_reward(RewardConfig(reward_fn=["exact_match"]), episodes=True)
    vocab = len(tok)
    return Trainer(RLHFEngines(FakeEngine(tiny_lm(vocab, 0), 1), FakeEngine(tiny_lm(vocab, 1), 1), critic), reward,
                   Sampler(sampler), core.FixedKLController(0.05), settings, tok,
                   episodes=Episodes(load_environment("calculator"), plan_episodes(64, 16, 3, None)))


def test_observation_tokens_are_masked_everywhere(setup):
    tok, q, first, second = setup
    sampler = ScriptedSampler([first, second], tok.pad_token_id, 16)
    tr = make_trainer(tok, sampler, "grpo")
    exp = tr.rollout(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), [{"reference": "408"}, {"reference": "1"}],
                     step=1, messages=[[q], [q]])
    assert exp.turns.tolist() == [2, 2, 2, 2] and exp.transcripts[0][2] == {"role": "tool", "content": "408"}
    region = exp.attention_mask[:, exp.prompt_len:]
    obs = (region > 0) & (exp.action_mask == 0)
    n_obs = int(obs[0].sum())
    assert n_obs > 0 and int(exp.action_mask[0].sum()) == len(first) + len(second)
    # the environment's reward and exact_match: both right for row 0's reference 408, wrong for 1
    assert exp.reward_parts["reward/env"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert exp.scores.tolist() == [2.0, 2.0, 0.0, 0.0]
    stats = PooledStats()
    exp, agreement = tr.make_experience([exp], stats)
    assert exp.kl[obs].abs().sum() == 0 and exp.advantages[obs].abs().sum() == 0
    assert exp.kl[exp.action_mask > 0].abs().sum() > 0  # different actor and reference: a real KL
    # GRPO: the episode's group advantage on every sampled token of both turns, plus the KL penalty
    # still to come over sampled tokens only (the observations' log-probs never enter it)
    outcome = grpo_outcome_advantages(exp.scores, 2)
    expected = outcome_per_token(outcome, AdvantageInputs(exp.scores, exp.action_mask, exp.kl, 0.05))
    torch.testing.assert_close(exp.advantages, expected)
    garbage = exp.kl.clone()
    garbage[obs] = 1e6  # what an unmasked observation token would add to every earlier token
    assert not torch.allclose(outcome_per_token(outcome, AdvantageInputs(exp.scores, (region > 0).float(), garbage,
                                                                         0.05)), expected)
    # the sampler/trainer gap is over sampled tokens only: a sampler reporting the actor's own
    # log-probs there (and 0 on observations, as the episode loop does) has no gap
    exp.sampler_logp = core.where_valid(exp.logp, exp.action_mask > 0)
    gap = tr.finish_experience(exp, PooledStats())
    assert max(abs(v) for k, v in gap.items() if k.startswith("rollout/logp_diff")) < 1e-6
    tr.learn(exp, stats)
    summarize(exp, 0.05, tr.stops, stats)
    got = stats.finish()
    assert got["episode/turns"] == 2.0 and got["episode/observation_len"] == float(n_obs)
    assert got["answer_len"] == float(len(first) + len(second)) and got["eos_rate"] == 1.0
    assert got["entropy"] == pytest.approx(core.masked_mean(exp.entropy, exp.action_mask).item(), abs=1e-6)


def test_ppo_places_turn_rewards_and_gae_crosses_observations():
    # one episode, region: turn 1 (2 tokens), observation (2 tokens), turn 2 (2 tokens)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]])
    turn = torch.tensor([[0.0, 0.3, 0.0, 0.0, 0.0, 0.0]])  # the environment rewarded turn 1 with 0.3
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.4, 0.5]])
    kl = torch.zeros(1, 6)
    settings = PPOConfig(gamma=1.0, lam=1.0, clip_reward_value=5.0)
    out = ppo_advantages(AdvantageInputs(torch.tensor([1.3]), mask, kl, 0.0, values, 1, None, turn), settings)
    # rewards: 0.3 at turn 1's last token, the rest of the score (1.0) at the last action token
    assert out.rewards.tolist() == [[0.0, pytest.approx(0.3), 0.0, 0.0, 0.0, pytest.approx(1.0)]]
    # gamma = lam = 1: the return of every sampled token is the reward still to come; observations 0
    assert out.returns[0].tolist() == pytest.approx([1.3, 1.3, 0.0, 0.0, 1.0, 1.0])
    assert out.advantages[0].tolist() == pytest.approx([1.2, 1.1, 0.0, 0.0, 0.6, 0.5])


def test_single_answers_keep_no_turn_tensors(setup):
    tok, q, first, _ = setup
    settings = PPOConfig(rl_algorithm="grpo", num_samples_per_prompt=2, per_device_training_batch_size=4)
    sampler = ScriptedSampler([first], tok.pad_token_id, 16)
    tr = Trainer(RLHFEngines(FakeEngine(tiny_lm(len(tok), 0), 1), FakeEngine(tiny_lm(len(tok), 1), 1)),
                 build_reward(RewardConfig(reward_fn=["exact_match"])), Sampler(sampler), core.FixedKLController(0.05),
                 settings, tok)
    ids = torch.tensor([tok("hi")["input_ids"]])
    exp = tr.rollout(ids, torch.ones_like(ids), [{"reference": "1"}], step=1)
    assert exp.turn_rewards is None and exp.turns is None and exp.transcripts == []
    assert concat_rollouts([exp, exp], tok.pad_token_id).turns is None
    assert stop_token_ids(tok)[0] in exp.sequences[0].tolist()
