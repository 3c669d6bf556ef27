"""PPO for RLHF: making experience and learning from it, for an actor, a critic, a frozen reference
and a frozen reward (any ``score_fn``).

Every tensor convention follows :mod:`chatrl.step3_ppo.core` (per-token tensors cover the answer
part only, ``(B, A)``, aligned with the generated token they score). The numbered details of
``docs/ppo.md`` are implemented here:

1. every forward pass runs with dropout off (``eval()``), training passes included, so the first
   PPO epoch has ratio exactly 1 and KL(actor‖reference) exactly 0 when they are equal; the
   experience pass runs on the same micro-batches as the training pass so even floating-point
   summation order agrees. When a rollout batch is one training micro-batch, the actor's and
   critic's experience passes are not run at all: the first training pass's own forwards give
   the old log-probs and values (the weights have not moved since the rollout), and the rewards
   and advantages are computed between that forward and the loss (:meth:`PPOTrainer.train_first_pass`);
3. the action mask covers the generated tokens up to and including the first EOS; tokens after it
   are overwritten with pad and masked everywhere;
8. every rank makes the same number of optimizer steps whatever its answers: the experience
   count per rank is fixed, answers of any length (empty, no EOS) are kept, and an answer without
   EOS can be penalised (``penalty_no_eos``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from chatrl.config import PPOConfig
from chatrl.step3_ppo import core

ScoreFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``score_fn(sequences (B, T), attention_mask (B, T), prompt_len) -> scores (B,)``."""


@dataclass
class Experience:
    """One rank's rollouts. ``B`` rollouts, prompt width ``P``, answer width ``A``.

    ``sequences``/``attention_mask``: ``(B, P + A)``, prompts left-padded, answers masked after
    their first EOS. Per-token fields are ``(B, A)``: ``action_mask``, ``logp`` (actor),
    ``ref_logp``, ``values`` (critic, V(state before token j)), ``kl`` (per-token KL estimate),
    ``rewards``, ``advantages``, ``returns``, ``entropy`` (actor, nats). ``scores`` ``(B,)``: the
    reward function's scores before clipping (penalty included). ``logp``, ``values``, ``entropy``,
    ``kl``, ``rewards``, ``advantages`` and ``returns`` are ``None`` until the first training pass
    fills them when that pass is also the experience's (:meth:`PPOTrainer.train_first_pass`).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    action_mask: torch.Tensor
    logp: torch.Tensor | None
    ref_logp: torch.Tensor
    values: torch.Tensor | None
    kl: torch.Tensor | None
    rewards: torch.Tensor | None
    advantages: torch.Tensor | None
    returns: torch.Tensor | None
    entropy: torch.Tensor | None
    scores: torch.Tensor

    def rows(self, idx: slice) -> Experience:
        """The rollouts ``idx`` (a slice of the batch dimension) as a new Experience."""
        return Experience(**{f.name: (v[idx] if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
                             for f in fields(self)})


def answer_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits ``(B, A, V)`` whose column ``j`` predicts answer token ``j`` (``A = T - prompt_len``).

    Only the ``A + 1`` last positions go through the LM head (the prompt's logits are never read).
    """
    from chatrl.models import causal_lm_logits

    return causal_lm_logits(model, sequences, attention_mask, logits_to_keep=sequences.shape[1] - prompt_len + 1)[:, :-1]


def answer_values(critic, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Critic values ``(B, A)``: column ``j`` is V(prompt, answer tokens < j)."""
    return critic(sequences, attention_mask).values[:, prompt_len - 1:-1].float()


class PPOTrainer:
    """Makes experience with the four models and trains the actor and critic on it.

    Args:
        actor, critic: DeepSpeed engines with optimizers (``critic(ids, mask)`` returns
            ``(values (B, T), end_scores (B,))``).
        reference: a frozen causal LM (engine or module) with the actor's tokenizer.
        score_fn: the reward, see :data:`ScoreFn` (a reward model's end score, or a rule).
        generate: ``generate(input_ids, attention_mask) -> sequences (B, P + A)`` (the hybrid engine).
        kl_controller: :class:`core.FixedKLController` or :class:`core.AdaptiveKLController`.
        settings: the PPO block of the configuration (``config.from_args(PPOConfig, args)``).
        eos_token_id: the id, or ids, that end an answer (:func:`chatrl.models.stop_token_ids`: the
            chat template's end-of-turn token and the EOS). pad_token_id: the actor tokenizer's pad.
        ema: optional EMA copy of the actor, updated after every actor step (ZeRO-3 partitions are
            averaged in place, no gather).
        on_actor_step: called after every actor optimizer step (the hybrid engine marks its
            inference copy stale there).
    """

    def __init__(self, actor, critic, reference, score_fn: ScoreFn, generate, kl_controller, settings: PPOConfig,
                 eos_token_id: int | list[int], pad_token_id: int, ema=None, on_actor_step: Callable[[], None] | None = None):
        self.actor, self.critic, self.reference = actor, critic, reference
        self.score_fn, self.generate = score_fn, generate
        self.kl_ctl, self.s = kl_controller, settings
        self.mb = settings.per_device_training_batch_size
        self.eos, self.pad = eos_token_id, pad_token_id
        self.ema, self.on_actor_step = ema, on_actor_step
        for m in (actor, critic, reference, ema):
            if m is not None:
                m.eval()  # detail 1: dropout off in every RL forward pass

    def mask_answers(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seq: torch.Tensor):
        """Detail 3: the action mask ``(B, A)`` of generated ``seq`` ``(B, P + A)`` covers the answer up
        to and including its first stop token; later tokens become pad. Returns ``(seq, mask, action_mask)``
        with ``mask`` ``(B, P + A)`` the prompt's mask followed by the action mask."""
        answer = seq[:, prompt_ids.shape[1]:]
        action_mask = core.action_mask_from_tokens(answer, self.eos).to(prompt_mask.dtype)
        answer = answer.masked_fill(action_mask == 0, self.pad)
        return (torch.cat([prompt_ids, answer], dim=1), torch.cat([prompt_mask, action_mask], dim=1), action_mask)

    @torch.no_grad()
    def make_experience(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[Experience, dict]:
        """Generate answers to left-padded prompts ``(B, P)`` and score them. Returns the experience and timings."""
        t0 = time.time()
        seq = self.generate(prompt_ids, prompt_mask)
        t_gen = time.time() - t0
        P = prompt_ids.shape[1]
        seq, mask, action_mask = self.mask_answers(prompt_ids, prompt_mask, seq)
        deferred = self.first_pass_is_experience(seq.shape[0])

        parts = {k: [] for k in ("logp", "ref_logp", "values", "entropy")}
        for i in range(0, seq.shape[0], self.mb):
            s, m = seq[i:i + self.mb], mask[i:i + self.mb]
            if not deferred:
                logp, entropy = core.logprobs_and_entropy(answer_logits(self.actor, s, m, P), s[:, P:])
                parts["logp"].append(logp)
                parts["entropy"].append(entropy)
                parts["values"].append(answer_values(self.critic, s, m, P))
            parts["ref_logp"].append(core.logprobs_from_logits(answer_logits(self.reference, s, m, P), s[:, P:]))
        out = {k: torch.cat(v) if v else None for k, v in parts.items()}
        scores = self.score(seq, mask, P)
        rewards = kl = advantages = returns = None
        if not deferred:
            rewards, kl, advantages, returns = self.estimate_advantages(scores, out["logp"], out["ref_logp"],
                                                                        out["values"], action_mask)
        exp = Experience(seq, mask, P, action_mask, out["logp"], out["ref_logp"], out["values"], kl, rewards,
                         advantages, returns, out["entropy"], scores)
        return exp, {"time/generate": t_gen, "time/experience": time.time() - t0 - t_gen}

    def first_pass_is_experience(self, rollouts: int) -> bool:
        """Whether the actor's and critic's experience passes are left to the first training pass: the
        rollout batch (``rollouts`` per rank, the same on every rank) is one training micro-batch, so
        the first PPO step's forwards see exactly the experience pass's weights and inputs (detail 1),
        unless ``--separate_experience_pass`` asks for the plain path."""
        return rollouts <= self.mb and not self.s.separate_experience_pass

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """The reward of each rollout ``(B,)``: ``score_fn`` minus ``penalty_no_eos`` for answers without EOS."""
        scores = self.score_fn(sequences, attention_mask, prompt_len).float()
        if self.s.penalty_no_eos:
            has_eos = core.has_stop_token(sequences[:, prompt_len:], attention_mask[:, prompt_len:], self.eos)
            scores = scores - self.s.penalty_no_eos * (~has_eos).float()
        return scores

    def estimate_advantages(self, scores, logp, ref_logp, values, action_mask):
        """PPO's advantages: per-token KL-shaped rewards (score at the last action token), then GAE
        on the critic's values (optionally whitened). All ``(B, A)`` but ``scores`` ``(B,)``.

        Returns ``(rewards, kl, advantages, returns)``. A critic-free algorithm replaces this method.
        """
        rewards, kl = core.compute_rewards(scores, logp, ref_logp, action_mask, self.kl_ctl.value,
                                           self.s.clip_reward_value, self.s.kl_estimator)
        advantages, returns = core.gae(values, rewards, action_mask, self.s.gamma, self.s.lam)
        if self.s.whiten_advantages:
            advantages = core.masked_whiten(advantages, action_mask)
        return rewards, kl, advantages, returns

    def train_first_pass(self, exp: Experience) -> dict:
        """The first PPO step on a one-micro-batch ``exp`` whose actor and critic passes were deferred.

        The actor's and critic's training forwards give the old log-probs, entropy and values (detached:
        the same numbers the experience passes would give, so the ratio is exactly 1); the KL-shaped
        rewards, GAE and returns are then computed and filled into ``exp`` before the two losses, as
        :meth:`make_experience` does otherwise. Saves one actor and one critic forward per rollout
        batch; both graphs are alive until the actor's backward (peak memory: two activations sets).
        """
        answer = exp.sequences[:, exp.prompt_len:]
        logp, entropy = core.logprobs_and_entropy(
            answer_logits(self.actor, exp.sequences, exp.attention_mask, exp.prompt_len), answer)
        values = answer_values(self.critic, exp.sequences, exp.attention_mask, exp.prompt_len)
        exp.logp, exp.entropy, exp.values = logp.detach(), entropy.detach(), values.detach()
        del entropy
        with torch.no_grad():
            exp.rewards, exp.kl, exp.advantages, exp.returns = self.estimate_advantages(
                exp.scores, exp.logp, exp.ref_logp, exp.values, exp.action_mask)
        return {**self.train_actor(exp, logp), **self.train_critic(exp, values)}

    def train_actor(self, exp: Experience, logp: torch.Tensor | None = None) -> dict:
        """One PPO-clip step of the actor on ``exp`` (one micro-batch); ``logp`` ``(B, A)``: the actor's
        log-probs from a forward already run on it (:meth:`train_first_pass`), else computed here."""
        if logp is None:
            logits = answer_logits(self.actor, exp.sequences, exp.attention_mask, exp.prompt_len)
            logp = core.logprobs_from_logits(logits, exp.sequences[:, exp.prompt_len:])
        loss, stats = core.actor_loss(logp, exp.logp, exp.advantages, exp.action_mask, self.s.cliprange)
        self.actor.backward(loss)
        self.actor.step()
        self._after_actor_step()
        return {"actor_loss": loss.detach(), **stats}

    def train_critic(self, exp: Experience, values: torch.Tensor | None = None) -> dict:
        """One clipped value-loss step of the critic on ``exp`` (one micro-batch); ``values`` ``(B, A)``
        as ``logp`` in :meth:`train_actor`."""
        if values is None:
            values = answer_values(self.critic, exp.sequences, exp.attention_mask, exp.prompt_len)
        loss, stats = core.critic_loss(values, exp.values, exp.returns, exp.action_mask, self.s.cliprange_value)
        self.critic.backward(loss)
        self.critic.step()
        return {"critic_loss": loss.detach(), **stats}

    def train_ptx(self, batch: dict) -> dict:
        """One step of the actor on unsupervised text, loss scaled by ``unsup_coef`` (Ouyang et al., 2022, eq. 2)."""
        from chatrl.models import causal_lm_logits

        logits = causal_lm_logits(self.actor, batch["input_ids"], batch["attention_mask"])
        loss = core.ptx_loss(logits, batch["labels"])
        self.actor.backward(self.s.unsup_coef * loss)
        self.actor.step()
        self._after_actor_step()
        return {"ptx_loss": loss.detach()}

    def _after_actor_step(self) -> None:
        if self.ema is not None and self.actor.is_gradient_accumulation_boundary():
            update_ema(self.ema, self.actor.module, self.s.ema_beta)
        if self.on_actor_step is not None:
            self.on_actor_step()

    def learn(self, exp: Experience, ptx_batches=None) -> dict:
        """``ppo_epochs`` passes of micro-batches over ``exp``; returns the mean of every statistic."""
        sums: dict[str, float] = {}
        n = 0
        ptx_iter = iter(ptx_batches) if ptx_batches is not None else None
        for _ in range(self.s.ppo_epochs):
            for i in range(0, exp.sequences.shape[0], self.mb):
                if exp.logp is None:  # the experience's actor and critic passes are this first step's forwards
                    stats = self.train_first_pass(exp)
                else:
                    part = exp.rows(slice(i, i + self.mb))
                    stats = {**self.train_actor(part), **self.train_critic(part)}
                if ptx_iter is not None:
                    stats.update(self.train_ptx(next(ptx_iter)))
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                n += 1
        return {k: v / max(n, 1) for k, v in sums.items()}


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, beta: float) -> None:
    """``ema ← beta·ema + (1 − beta)·model`` over parameters, in place.

    Under ZeRO-3 both modules are partitioned alike (same shapes, same world), so the local
    partitions (``ds_tensor``) are averaged directly without a gather.
    """
    for p_ema, p in zip(ema.parameters(), model.parameters(), strict=True):
        src, dst = (p.ds_tensor, p_ema.ds_tensor) if hasattr(p, "ds_tensor") else (p.data, p_ema.data)
        dst.mul_(beta).add_(src.to(dst.dtype), alpha=1.0 - beta)


def summarize(exp: Experience, kl_coef: float, eos_token_id: int | list[int]) -> dict:
    """Rollout statistics of one rank (means over rollouts or over action tokens), see ``docs/ppo.md``."""
    m = exp.action_mask
    answer = exp.sequences[:, exp.prompt_len:]
    return {
        "reward/score_mean": exp.scores.mean(),
        "reward/score_std": exp.scores.std(unbiased=False),
        "reward/mean": (exp.rewards * m).sum(dim=1).mean(),
        "kl": (exp.kl * m).sum(dim=1).mean(),
        "entropy": core.masked_mean(exp.entropy, m),
        "explained_variance": core.explained_variance(exp.values, exp.returns, m),
        "answer_len": m.sum(dim=1).float().mean(),
        "eos_rate": core.has_stop_token(answer, m, eos_token_id).float().mean(),
        "kl_coef": torch.tensor(float(kl_coef)),
    }
