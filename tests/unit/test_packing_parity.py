"""Packed rows give the padded path's numbers, for every step and every model family chatrl packs
(OPT with its block-diagonal mask, Llama and Qwen2 with restarting position ids), in fp32:

* step 1: the SFT loss (sum, count, each example's NLL) and its gradient;
* step 2: the reward model's values at every position and end scores, and the pairwise loss's gradient;
* DPO: each answer's summed log-prob and token count, and the DPO loss's gradient;
* step 3: the actor's and the reference's per-token log-probs and entropy, the critic's values and
  the gradients of one learning step (actor and critic);

and step 3's micro-batches cut by token budget give the gradient of the padded micro-batches for
every global loss aggregation, PPO's default (``token-mean``) included."""

from types import SimpleNamespace

import pytest
import torch

from chatrl.config import OptimConfig, PackingConfig, PPOConfig, SamplingConfig
from chatrl.data.collate import PackedPairCollator, PackedSFTCollator, PairCollator, SFTCollator
from chatrl.errors import UsageError
from chatrl.hybrid_engine import Sampler
from chatrl.logprobs import IGNORE_INDEX
from chatrl.models.causal_lm import check_packing, load_causal_lm, load_tokenizer
from chatrl.models.reward_model import RewardModel, load_reward_model, pairwise_loss
from chatrl.rl.stats import PooledStats
from chatrl.sizes import loss_aggregation
from chatrl.step1_sft.loss import sft_nll
from chatrl.step2_dpo.batch import DPOCollator, PackedDPOCollator, batch_answer_logps, split_pairs
from chatrl.step2_dpo.loss import DPOConfig, preference_loss
from chatrl.step3_ppo.engine import RLHFEngines
from chatrl.step3_ppo.trainer import Experience, OptimizerStep, Trainer

FAMILIES = ("opt", "llama", "qwen2")
TOL = 1e-5


@pytest.fixture(scope="module")
def family_models(tiny_models, tiny_qwen2):
    return {**tiny_models, "qwen2": tiny_qwen2}


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def close(a, b, tol=TOL, msg=None):
    torch.testing.assert_close(a, b, rtol=0, atol=tol, msg=msg)


def examples(n_lengths, prompt_lens, seed=0, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, vocab, (n,), generator=g), "prompt_len": p}
            for n, p in zip(n_lengths, prompt_lens, strict=True)]


def pairs(seed=0, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, c, r in ((4, 3, 6), (2, 7, 1), (5, 2, 2)):
        prompt = torch.randint(3, vocab, (p,), generator=g)
        out.append({"chosen_input_ids": torch.cat([prompt, torch.randint(3, vocab, (c,), generator=g)]),
                    "rejected_input_ids": torch.cat([prompt, torch.randint(3, vocab, (r,), generator=g)]),
                    "prompt_len": p, "index": len(out)})
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mask_prompt, turns", [(True, False), (False, False), (True, True)])
def test_step1_sft_loss_packed_equals_padded(family_models, family, mask_prompt, turns):
    """``turns``: two rows are conversations whose every assistant turn is trained (``trained_spans``
    with an untrained observation between the turns)."""
    tok = load_tokenizer(str(family_models[family]))
    model = load_causal_lm(str(family_models[family]), tok).eval()
    batch = examples([9, 4, 12, 6, 2], [3, 1, 5, 6, 1])
    if turns:
        batch[0]["trained_spans"], batch[2]["trained_spans"] = [3, 5, 7, 9], [5, 7, 9, 12]
    out = []
    for collate in (SFTCollator(tok.pad_token_id, mask_prompt), PackedSFTCollator(tok.pad_token_id, mask_prompt, 14)):
        b = collate(batch)
        model.zero_grad()
        nll, n = sft_nll(model, b["input_ids"], b["attention_mask"], b["labels"], packed=b.get("packed"))
        nll.backward()
        out.append((nll.detach(), int(n), grads(model), b))
    (s0, n0, g0, padded), (s1, n1, g1, packed) = out
    assert packed["input_ids"].shape[0] < 5 and packed["packed"].tokens < padded["input_ids"].numel()
    assert n0 == n1 == int((padded["labels"][:, 1:] != IGNORE_INDEX).sum()) > 0
    if turns:  # the observation tokens between two trained turns carry no label in either layout
        assert (padded["labels"][0, 5:7] == IGNORE_INDEX).all() and (padded["labels"][2, 7:9] == IGNORE_INDEX).all()
        assert n0 == 4 + 3 + 5 + 0 + 1  # the trained tokens of the five rows
    close(s1, s0, 1e-4)  # a sum of ~30 token losses of ~7 nats
    close(g1, g0)
    # each example's NLL: the padded row's against the packed sequence's tokens
    with torch.no_grad():
        p = packed["packed"]
        lp_pad = torch.log_softmax(model(input_ids=padded["input_ids"],
                                         attention_mask=padded["attention_mask"]).logits.float(), -1)
        from chatrl.models.causal_lm import causal_lm_logits

        lp_packed = p.unpack(torch.log_softmax(causal_lm_logits(model, p.input_ids, None, packed=p).float(), -1))
        labels_packed = p.unpack(packed["labels"])
    for i, ex in enumerate(batch):
        n = len(ex["input_ids"])
        want_labels = padded["labels"][i, 1:n]
        keep = want_labels != IGNORE_INDEX
        assert torch.equal(labels_packed[i, 1:n][keep], want_labels[keep])
        want = -lp_pad[i, :n - 1][keep].gather(-1, want_labels[keep, None]).sum()
        got = -lp_packed[i, :n - 1][keep].gather(-1, want_labels[keep, None]).sum()
        close(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_step2_reward_scores_packed_equal_padded(family_models, family):
    tok = load_tokenizer(str(family_models[family]))
    torch.manual_seed(0)
    rm = load_reward_model(str(family_models[family]), tok, require_head=False).eval()
    batch = pairs()
    out = []
    for collate in (PairCollator(tok.pad_token_id), PackedPairCollator(tok.pad_token_id)):
        b = collate(batch)
        rm.zero_grad()
        values, scores = rm(b["input_ids"], b["attention_mask"], packed=b.get("packed"))
        pairwise_loss(*split_pairs(scores)).backward()
        out.append((values.detach(), scores.detach(), grads(rm), b))
    (v0, s0, g0, padded), (v1, s1, g1, packed) = out
    close(s1, s0)
    p = packed["packed"]
    unpacked = p.unpack(v1)
    for i, n in enumerate(p.length.tolist()):
        close(unpacked[i, :n], v0[i, :n])
    assert float(v1[p.seq_ids < 0].abs().sum()) == 0.0
    close(g1, g0)


@pytest.mark.parametrize("family", FAMILIES)
def test_dpo_answer_logps_packed_equal_padded(family_models, family):
    tok = load_tokenizer(str(family_models[family]))
    model = load_causal_lm(str(family_models[family]), tok).eval()
    reference = load_causal_lm(str(family_models[family]), tok).eval()
    batch = pairs(seed=1)
    settings = DPOConfig(beta=0.1, rpo_alpha=0.5)
    out = []
    for collate in (DPOCollator(tok.pad_token_id), PackedDPOCollator(tok.pad_token_id)):
        b = collate(batch)
        with torch.no_grad():
            ref, _ = batch_answer_logps(reference, b, "cpu")
        model.zero_grad()
        logps, n = batch_answer_logps(model, b, "cpu")
        losses, _, _ = preference_loss(settings, *split_pairs(logps), *split_pairs(ref), *split_pairs(n))
        losses.mean().backward()
        out.append((logps.detach(), n, losses.detach(), grads(model)))
    (l0, n0, loss0, g0), (l1, n1, loss1, g1) = out
    assert n0.tolist() == n1.tolist() == [3, 7, 2, 6, 1, 2]
    close(l1, l0)
    close(loss1, loss0)
    close(g1, g0)


# ------------------------------------------------------------------------------------------ step 3
class FakeEngine(torch.nn.Module):
    """What the trainer uses of a DeepSpeed engine: forward, backward (divides by the configured
    accumulation steps), step, and the accumulation boundary it is told."""

    def __init__(self, model, gas):
        super().__init__()
        self.module, self.gas, self.boundaries = model, gas, []

    def forward(self, *args, **kw):
        return self.module(*args, **kw)

    def backward(self, loss):
        (loss / self.gas).backward()

    def step(self):
        pass

    def set_gradient_accumulation_boundary(self, is_boundary):
        self.boundaries.append(is_boundary)

    def is_gradient_accumulation_boundary(self):
        return False


def rollouts(pad_token_id: int, vocab: int = 1000) -> Experience:
    """8 rollouts in the experience layout: prompts of 2 to 5 real tokens left-padded to 5, answers of
    0 to 6 tokens right-padded to 6 (one empty answer)."""
    g = torch.Generator().manual_seed(3)
    P, A = 5, 6
    prompt_lens = torch.tensor([5, 2, 3, 4, 5, 2, 3, 4])
    answer_lens = torch.tensor([6, 1, 3, 0, 2, 6, 4, 5])
    prompt_mask = (torch.arange(P)[None] >= P - prompt_lens[:, None]).long()
    action_mask = (torch.arange(A)[None] < answer_lens[:, None]).long()
    mask = torch.cat([prompt_mask, action_mask], 1)
    seq = torch.randint(3, vocab, (8, P + A), generator=g).masked_fill(mask == 0, pad_token_id)
    old = -torch.rand(8, A, generator=g) * 3 * action_mask
    return Experience(seq, mask, P, action_mask, old, torch.randn(8, generator=g), ref_logp=old + 0.1, logp=old,
                      entropy=torch.zeros(8, A), kl=torch.zeros(8, A),
                      advantages=torch.randn(8, A, generator=g) * action_mask,
                      values=torch.randn(8, A, generator=g), returns=torch.randn(8, A, generator=g))


def make_trainer(settings, actor, reference, critic, tok, gas, packing=None, temperature=1.0):
    return Trainer(RLHFEngines(FakeEngine(actor, gas), reference, critic and FakeEngine(critic, gas)), None,
                   Sampler(None, SamplingConfig(temperature=temperature)), SimpleNamespace(value=0.1), settings, tok,
                   step=OptimizerStep(gas, answer_len=6), packing=packing)


@pytest.mark.parametrize("family", FAMILIES)
def test_step3_forwards_and_one_learning_step_packed_equal_padded(family_models, family):
    path = str(family_models[family])
    tok = load_tokenizer(path)
    exp = rollouts(tok.pad_token_id)
    mask = exp.action_mask.bool()
    out = []
    for packing in (PackingConfig(), PackingConfig(packing=True)):
        actor, reference = load_causal_lm(path, tok).eval(), load_causal_lm(path, tok).eval()
        torch.manual_seed(0)
        critic = load_reward_model(path, tok, require_head=False).eval()
        settings = PPOConfig(per_device_training_batch_size=4, separate_experience_pass=True)
        tr = make_trainer(settings, actor, reference, critic, tok, 2, packing, temperature=0.7)
        with torch.no_grad():
            logp, entropy = tr.policy_logp(actor, exp, entropy=True)
            ref = tr.policy_logp(reference, exp)
            values = tr.critic_values(exp)
        tr.learn(exp.rows(slice(0, 8)), PooledStats())
        out.append((logp, entropy, ref, values, grads(actor), grads(critic)))
    for name, a, b in zip(("logp", "entropy", "ref_logp", "values"), out[0][:4], out[1][:4], strict=True):
        close(b[mask], a[mask], msg=name)
        assert float(b[~mask].abs().sum()) == 0.0, name  # nothing beyond an answer
    close(out[1][4], out[0][4])
    close(out[1][5], out[0][5])


def test_packed_logprobs_promote_bf16_logits_before_the_temperature(monkeypatch):
    """The packed path scores bf16 logits as the padded path and the sampler do: float32 first, then
    divided by the temperature (dividing in bf16 rounds once more, by up to 2^-9 relative, and fails)."""
    from chatrl.step3_ppo import trainer as trainer_module

    exp, vocab = rollouts(pad_token_id=0), 1000
    g = torch.Generator().manual_seed(5)
    seen = {}

    def fake_logits(model, rows, cols, input_ids, attention_mask, packed):
        seen["logits"] = (torch.randn(len(rows), vocab, generator=g) * 4).to(torch.bfloat16)
        return seen["logits"]

    monkeypatch.setattr(trainer_module, "token_logits_at", fake_logits)
    logp = trainer_module.packed_answer_logp(None, exp.sequences, exp.attention_mask, exp.prompt_len, 0, 0.7)
    targets = exp.sequences[:, exp.prompt_len:][exp.action_mask.bool()]  # answer tokens in row order
    z = seen["logits"].float() / 0.7
    expected = z.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(z, -1)
    assert torch.equal(logp[exp.action_mask.bool()], expected)
    assert float(logp[~exp.action_mask.bool()].abs().sum()) == 0.0
    in_bf16 = (seen["logits"] / 0.7).float()
    assert not torch.equal(in_bf16.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(in_bf16, -1), expected)


def tiny_llama_pair(path, tok):
    torch.manual_seed(0)
    return load_causal_lm(path, tok).eval(), load_causal_lm(path, tok).eval()


@pytest.mark.parametrize("algorithm, mode", [("grpo", "token-mean"), ("rloo", "seq-mean-token-mean"),
                                             ("reinforce_pp", "seq-mean-token-sum-norm"), ("ppo", None)])
@pytest.mark.parametrize("packed", [False, True])
def test_step3_token_budget_micro_batches_give_the_padded_gradient(tiny_llama, algorithm, mode, packed):
    """Two optimizer steps of 4 rollouts (micro-batches of 2, accumulation 2) against the same steps cut
    by a 12-token budget (1 or 2 rollouts per micro-batch, packed or padded): the same actor and critic
    gradients; DeepSpeed is told which micro-batch ends each step. PPO's unset aggregation is its
    default, the step's token mean (nothing to adapt)."""
    from chatrl.step3_ppo.settings import Step3Settings

    path = str(tiny_llama)
    tok = load_tokenizer(path)
    exp = rollouts(tok.pad_token_id)
    with torch.no_grad():  # old log-probs of the actor itself (ratio 1), a reference near it
        actor, _ = tiny_llama_pair(path, tok)
        exp.logp = make_trainer(PPOConfig(rl_algorithm="grpo"), actor, actor, None, tok, 1).policy_logp(actor, exp)
        exp.ref_logp = exp.logp + 0.05 * torch.randn(exp.logp.shape, generator=torch.Generator().manual_seed(5))
    out = []
    for budget in (0, 12):
        s = Step3Settings(ppo=PPOConfig(per_device_training_batch_size=2, separate_experience_pass=True,
                                        rl_algorithm=algorithm, num_samples_per_prompt=4 if algorithm != "ppo" else 1,
                                        loss_agg_mode=mode, kl_in="loss", init_kl_coef=0.1),
                          packing=PackingConfig(packing=packed and budget > 0, max_tokens_per_micro_batch=budget))
        assert loss_aggregation(s.ppo, OptimConfig(), s.packing, ptx=False) == (mode or "token-mean", None)
        actor, reference = tiny_llama_pair(path, tok)
        critic = None
        if algorithm == "ppo":
            torch.manual_seed(0)
            critic = load_reward_model(path, tok, require_head=False).eval()
        tr = make_trainer(s.ppo, actor, reference, critic, tok, 2, s.packing)
        stats = PooledStats()
        tr.learn(exp.rows(slice(0, 8)), stats)
        out.append((grads(actor), grads(critic) if critic is not None else None, tr.actor.boundaries,
                    stats.finish()))
    (g0, c0, b0, s0), (g1, c1, b1, s1) = out
    assert b0 == [] and b1.count(True) == 2 and len(b1) > 4  # more micro-batches than 4, two steps
    assert g0.abs().sum() > 0
    close(g1, g0)
    if c0 is not None:
        close(c1, c0)
        assert s1["critic_loss"] == pytest.approx(s0["critic_loss"], abs=1e-6)
    assert s1["actor_loss"] == pytest.approx(s0["actor_loss"], abs=1e-6)


def test_token_budget_refuses_what_it_cannot_keep_invariant():
    from chatrl.rl import algorithms
    from tests.unit.test_plans import plan_from_flags as plan_ppo

    assert loss_aggregation(PPOConfig(), OptimConfig(), PackingConfig(), ptx=False) == ("token-mean", None)
    common = dict(n_generation_batches=4, n_prompts=16, world_size=1, per_device_generation_batch_size=4,
                  per_device_training_batch_size=2, generation_batches=1, ppo_epochs=1, gradient_accumulation_steps=1,
                  num_train_epochs=1, max_steps=0, num_warmup_steps=0, algorithm=algorithms.get("grpo"),
                  num_samples_per_prompt=4)
    with pytest.raises(ValueError, match="PTX"):
        plan_ppo(**common, ptx=True, loss_agg_mode="token-mean", max_tokens_per_micro_batch=64)
    with pytest.raises(ValueError, match="global --loss_agg_mode"):
        plan_ppo(**common, ptx=False, loss_agg_mode="micro-batch-token-mean", max_tokens_per_micro_batch=64)
    assert plan_ppo(**common, ptx=False, loss_agg_mode="token-mean", max_tokens_per_micro_batch=64).total_buffers == 4
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be >= 0"):
        PackingConfig(max_tokens_per_micro_batch=-1)


def test_packing_refuses_an_untested_family_by_name(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_embd=16, n_layer=1, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UsageError, match=rf"{tmp_path} is 'gpt2'.*drop --packing"):
        check_packing(PackingConfig(packing=True), str(tmp_path))
    check_packing(PackingConfig(packing=False), str(tmp_path))  # nothing to check without --packing
    model = SimpleNamespace(config=SimpleNamespace(model_type="gpt2", _attn_implementation="sdpa", name_or_path="x"))
    from chatrl.models.causal_lm import packed_inputs
    from chatrl.packing import pack

    with pytest.raises(UsageError, match="'gpt2'"):
        packed_inputs(model, pack([[1, 2]], 0))


def test_reward_model_class_is_packed_by_its_backbone_family(tiny_opt):
    """The reward model (a sequence-classification wrapper) reads its backbone's family: OPT gets the
    block-diagonal mask."""
    from chatrl.models.causal_lm import packed_inputs
    from chatrl.packing import pack

    tok = load_tokenizer(str(tiny_opt))
    rm = load_reward_model(str(tiny_opt), tok, require_head=False)
    assert isinstance(rm, RewardModel)
    inputs = packed_inputs(rm, pack([[5, 6], [7]], tok.pad_token_id))
    assert inputs["attention_mask"].shape == (2, 1, 2, 2)  # rows as wide as the longest sequence


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_reward_scores_packed_equal_padded_with_the_fp32_attention(family_models, family):
    """In bf16 on CPU the reward model attends in float32 (chatrl.models.precision.FP32_SDPA), which takes
    OPT's block-diagonal mask and Llama's and Qwen2's restarting positions: packed end scores equal the
    padded ones to bf16 rounding (a tolerance of 2⁻⁶ of the largest score; on this CPU they come out equal)."""
    from chatrl.models.precision import FP32_SDPA

    tok = load_tokenizer(str(family_models[family]))
    torch.manual_seed(0)
    rm = load_reward_model(str(family_models[family]), tok, dtype="bf16", require_head=False).eval()
    assert rm.hf.config._attn_implementation == FP32_SDPA
    batch = pairs()
    with torch.no_grad():
        b = PairCollator(tok.pad_token_id)(batch)
        padded = rm(b["input_ids"], b["attention_mask"]).end_scores
        b = PackedPairCollator(tok.pad_token_id)(batch)
        packed = rm(b["input_ids"], b["attention_mask"], packed=b.get("packed")).end_scores
    scale = padded.abs().max()
    close(packed, padded, tol=float(scale) * 2 ** -6)
