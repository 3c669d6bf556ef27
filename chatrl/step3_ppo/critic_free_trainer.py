"""Critic-free RL (GRPO, RLOO, REINFORCE++) in step 3: rollouts in groups, rewards from any
source, group or batch baselines instead of a critic, a loss normalised by global counts.

The maths lives in :mod:`chatrl.step3_ppo.critic_free` (``docs/critic_free.md``); this module is
the trainer that :func:`chatrl.step3_ppo.main.train` drives when ``--rl_algorithm`` is not
``ppo``. Per experience buffer:

1. **rollouts**: each prompt of each generation batch repeated ``N`` times
   (``--num_samples_per_prompt``, the group is contiguous and stays on one rank); the hybrid
   engine returns the sampler's log-prob of every sampled token (raw fp32 logits);
2. **reward**: the weighted sources (:func:`chatrl.rewards.build_reward`) on the decoded prompts,
   answers and row metadata, a failure on any rank an error on every rank;
3. **buffer**: the generation batches padded to one width and concatenated (prompts left, answers
   right; with ``--generation_batches 1`` nothing is padded), then the actor's and the
   reference's log-probs on the training micro-batches, and ``rollout/logp_diff_*`` (the sampler's
   log-probs against the training forward's);
4. **advantages** on the whole buffer (:func:`critic_free.critic_free_advantages`);
5. **learning**: ``ppo_epochs`` passes of micro-batches; each micro-batch's loss is divided by
   its optimizer step's global count (:func:`critic_free.step_normalizers`) and scaled by
   ``gas × world`` before DeepSpeed's ``backward`` (which divides by both), so the gradient is
   the same however the step is split into micro-batches and ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from chatrl.config import PPOConfig
from chatrl.models import stop_token_ids
from chatrl.step3_ppo import core, critic_free
from chatrl.step3_ppo.trainer import Experience, PPOTrainer, answer_logits


@dataclass
class CriticFreeExperience(Experience):
    """An :class:`Experience` (``values``/``returns`` are zeros: there is no critic) plus the
    sampler's log-probs ``(B, A)`` and the reward of each source ``{"reward/<name>": (B,)}``."""

    sampler_logp: torch.Tensor
    is_weights: torch.Tensor | None = None

    def rows(self, idx: slice) -> CriticFreeExperience:
        """The rollouts ``idx`` (a slice of the batch dimension)."""
        return CriticFreeExperience(**{f.name: (v[idx] if isinstance(v, torch.Tensor) else v)
                                       for f in fields(self) for v in (getattr(self, f.name),)})


def _pad_cat(rollouts: list[dict], pad_id: int) -> dict:
    """Concatenate rollouts of different prompt widths ``P`` (left-padded) and answer widths ``A``
    (right-padded) into one batch; per-token ``(B, A)`` tensors are right-padded with 0."""
    if len(rollouts) == 1:
        return rollouts[0]
    p = max(r["prompt_len"] for r in rollouts)
    a = max(r["action_mask"].shape[1] for r in rollouts)
    out: dict = {"prompt_len": p, "metadata": [m for r in rollouts for m in r["metadata"]], "parts": {}}
    seqs, masks, amasks, slps = [], [], [], []
    for r in rollouts:
        rp, ra = r["prompt_len"], r["action_mask"].shape[1]
        s, m = r["sequences"], r["attention_mask"]
        seqs.append(torch.cat([s.new_full((len(s), p - rp), pad_id), s[:, :rp], s[:, rp:],
                               s.new_full((len(s), a - ra), pad_id)], dim=1))
        masks.append(torch.cat([m.new_zeros(len(m), p - rp), m, m.new_zeros(len(m), a - ra)], dim=1))
        amasks.append(torch.nn.functional.pad(r["action_mask"], (0, a - ra)))
        slps.append(torch.nn.functional.pad(r["sampler_logp"], (0, a - ra)))
    out.update(sequences=torch.cat(seqs), attention_mask=torch.cat(masks), action_mask=torch.cat(amasks),
               sampler_logp=torch.cat(slps), scores=torch.cat([r["scores"] for r in rollouts]))
    for k in rollouts[0]["parts"]:
        out["parts"][k] = torch.cat([r["parts"][k] for r in rollouts])
    return out


class CriticFreeTrainer(PPOTrainer):
    """Makes experience with the actor and the reference only and trains the actor with a critic-free
    policy gradient. No critic, no value loss; a ``PPOTrainer`` otherwise (EMA, the ``on_actor_step`` hook).

    Args:
        actor, reference: DeepSpeed engines.
        reward: ``reward(RewardBatch) -> (scores (B,), {"reward/<name>": (B,)})``, e.g.
            :class:`chatrl.rewards.WeightedReward`.
        generate: ``generate(ids (B, P), mask) -> (sequences (B, P + A), sampler_logp (B, A))``.
        kl_controller: its ``value`` is the KL coefficient (``--kl_in`` reward or loss).
        settings: the PPO block (``rl_algorithm``, ``num_samples_per_prompt``, ``loss_agg_mode``, ...).
        tokenizer: the actor's (answers are decoded for the reward).
        gradient_accumulation_steps, world_size: of the actor's DeepSpeed engine.
        answer_len: ``--max_answer_seq_len``, the constant of ``seq-mean-token-sum-norm``.
        all_reduce_sum, all_reduce_max: collectives over the ranks (``None``: one rank).
        rank: this rank (reward failures name it).
    """

    def __init__(self, actor, reference, reward: Callable, generate, kl_controller, settings: PPOConfig, tokenizer,
                 gradient_accumulation_steps: int, world_size: int, answer_len: int, *,
                 all_reduce_sum=None, all_reduce_max=None, rank: int = 0, ema=None,
                 on_actor_step: Callable[[], None] | None = None):
        super().__init__(actor, None, reference, None, generate, kl_controller, settings, stop_token_ids(tokenizer),
                         tokenizer.pad_token_id, ema=ema, on_actor_step=on_actor_step)
        self.reward, self.tokenizer = reward, tokenizer
        self.gas, self.world, self.answer_len = gradient_accumulation_steps, world_size, answer_len
        self.all_reduce_sum, self.all_reduce_max, self.rank = all_reduce_sum, all_reduce_max, rank
        self.n = settings.num_samples_per_prompt
        self.clip_low = settings.cliprange if settings.cliprange_low is None else settings.cliprange_low
        self.clip_high = self.clip_low if settings.cliprange_high is None else settings.cliprange_high

    @torch.no_grad()
    def rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, metadata: list[dict] | None,
                step: int) -> dict:
        """Generate ``N`` answers to each left-padded prompt ``(B, P)`` and score them (all ranks)."""
        from chatrl.rewards import reward_batch_from_tokens, score_on_all_ranks

        ids, mask = critic_free.repeat_prompts(prompt_ids, prompt_mask, self.n)
        meta = [dict(m) for m in (metadata or [{}] * len(prompt_ids)) for _ in range(self.n)]
        seq, sampler_logp = self.generate(ids, mask)
        P = ids.shape[1]
        seq, full_mask, action_mask = self.mask_answers(ids, mask, seq)
        answer = seq[:, P:]
        sampler_logp = (sampler_logp[:, :answer.shape[1]].float() * action_mask).to(seq.device)
        batch = reward_batch_from_tokens(self.tokenizer, seq, full_mask, action_mask, P, meta, step)
        got: dict = {}

        def score() -> torch.Tensor:
            got["total"], got["parts"] = self.reward(batch)
            return got["total"]

        scores = score_on_all_ranks(score, rank=self.rank, world_size=self.world, all_reduce_sum=self.all_reduce_sum,
                                    step=step, device=seq.device).to(seq.device).float()
        if self.s.penalty_no_eos:
            has_eos = core.has_stop_token(answer, action_mask, self.eos)
            scores = scores - self.s.penalty_no_eos * (~has_eos).float()
        return {"sequences": seq, "attention_mask": full_mask, "prompt_len": P, "action_mask": action_mask,
                "sampler_logp": sampler_logp, "scores": scores, "metadata": meta,
                "parts": {k: v.detach().float().to(seq.device) for k, v in got["parts"].items()}}

    @torch.no_grad()
    def make_buffer(self, rollouts: list[dict]) -> tuple[CriticFreeExperience, dict]:
        """One experience buffer from the generation batches' rollouts: the actor's and reference's
        log-probs on the training micro-batches, ``rollout/logp_diff_*``, the advantages. Returns the
        experience and its statistics (reward parts, agreement, advantage)."""
        b = _pad_cat(rollouts, self.pad)
        seq, mask, P, action_mask = b["sequences"], b["attention_mask"], b["prompt_len"], b["action_mask"]
        parts = {k: [] for k in ("logp", "ref_logp", "entropy")}
        for i in range(0, seq.shape[0], self.mb):
            s, m = seq[i:i + self.mb], mask[i:i + self.mb]
            logits = answer_logits(self.actor, s, m, P)
            parts["logp"].append(core.logprobs_from_logits(logits, s[:, P:]))
            parts["entropy"].append(core.entropy_from_logits(logits))
            del logits
            parts["ref_logp"].append(core.logprobs_from_logits(answer_logits(self.reference, s, m, P), s[:, P:]))
        out = {k: torch.cat(v) for k, v in parts.items()}
        logp, ref_logp = out["logp"], out["ref_logp"]
        kl = (logp - ref_logp) * action_mask  # k1 per token, as PPO reports it
        s = self.s
        adv = critic_free.critic_free_advantages(
            s.rl_algorithm, b["scores"], action_mask, self.n, kl=kl if s.kl_in == "reward" else None,
            kl_coef=self.kl_ctl.value, scale_by_std=not s.grpo_no_std_scaling, all_reduce_sum=self.all_reduce_sum)
        is_w = (critic_free.truncated_is_weights(logp, b["sampler_logp"], action_mask, s.rollout_is_cap)
                if s.rollout_is_cap > 0 else None)
        zeros = torch.zeros_like(logp)
        exp = CriticFreeExperience(seq, mask, P, action_mask, logp, ref_logp, zeros, kl, zeros, adv, zeros,
                                   out["entropy"], b["scores"], b["sampler_logp"], is_w)
        stats = {k: v.mean() for k, v in b["parts"].items()}
        stats.update(critic_free.logp_diff(b["sampler_logp"], logp, action_mask, self.all_reduce_sum,
                                           self.all_reduce_max))
        stats["advantage_abs_mean"] = core.masked_mean(adv.abs(), action_mask)
        return exp, stats

    def learn(self, exp: CriticFreeExperience, ptx_batches=None) -> dict:
        """``ppo_epochs`` passes of micro-batches over the buffer, each loss divided by its optimizer
        step's global count and scaled for DeepSpeed (module docstring). Returns mean statistics;
        ``actor_loss`` is the loss of an optimizer step (all ranks' micro-batches summed)."""
        s = self.s
        norms = critic_free.step_normalizers(exp.action_mask, self.mb, self.gas, s.loss_agg_mode,
                                             constant=float(self.answer_len), all_reduce_sum=self.all_reduce_sum)
        scale = critic_free.deepspeed_loss_scale(self.gas, self.world)
        sums: dict[str, float] = {}
        n = 0
        loss_sum = 0.0
        for _ in range(s.ppo_epochs):
            for j, i in enumerate(range(0, exp.sequences.shape[0], self.mb)):
                part = exp.rows(slice(i, i + self.mb))
                logits = answer_logits(self.actor, part.sequences, part.attention_mask, part.prompt_len)
                logp = core.logprobs_from_logits(logits, part.sequences[:, part.prompt_len:])
                del logits
                in_loss = s.kl_in == "loss"
                loss, stats = critic_free.policy_loss(
                    logp, part.logp, part.advantages, part.action_mask, norms[j], loss_agg_mode=s.loss_agg_mode,
                    cliprange_low=self.clip_low, cliprange_high=self.clip_high, is_weights=part.is_weights,
                    ref_logp=part.ref_logp if in_loss else None, kl_loss_coef=self.kl_ctl.value if in_loss else 0.0)
                self.actor.backward(loss * scale)
                self.actor.step()
                self._after_actor_step()
                loss_sum += float(loss.detach())
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                n += 1
        result = {k: v / max(n, 1) for k, v in sums.items()}
        steps = max(n // self.gas, 1)
        result["actor_loss"] = loss_sum * self.world / steps  # mean over ranks (reduce_stats) = global step loss
        return result

    def make_experience(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, metadata=None,
                        step: int = 0) -> tuple[CriticFreeExperience, dict]:
        """One generation batch as a whole buffer (rollout + :meth:`make_buffer`); returns the
        experience and its timings and statistics."""
        t0 = time.time()
        roll = self.rollout(prompt_ids, prompt_mask, metadata, step)
        t1 = time.time()
        exp, stats = self.make_buffer([roll])
        return exp, {**stats, "time/generate": t1 - t0, "time/experience": time.time() - t1}
