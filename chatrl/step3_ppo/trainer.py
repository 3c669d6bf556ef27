"""Step 3's trainer, one for every algorithm: rollouts, an experience buffer, learning from it.

The algorithm (:class:`chatrl.rl.algorithms.Algorithm`, ``--rl_algorithm``) chooses the advantage
estimator, whether a critic exists, its group size and default loss aggregation; everything else is
the same for all. Per experience buffer (:func:`chatrl.step3_ppo.main.train` reads top to bottom):

1. **rollouts** (:meth:`Trainer.rollout`, once per generation batch): each prompt repeated ``N``
   times (``--num_samples_per_prompt``; the group is contiguous and stays on one rank), answers
   generated in the hybrid engine's inference layout with the sampler's log-prob of every sampled
   token, the action mask (through the first stop token, detail 3 of ``docs/ppo.md``), the reward
   of every source (:class:`chatrl.rewards.WeightedReward`: reward model, functions, servers; a
   failure on any rank an error on every rank) minus ``--penalty_no_eos``;
2. **experience** (:meth:`Trainer.make_experience`): the generation batches padded to one width
   and concatenated, then the actor's log-probs and entropy, the critic's values (when there is
   one) and the reference's log-probs on the training micro-batches; then
   :meth:`Trainer.finish_experience`: the per-token KL, the algorithm's advantages (and returns)
   on the rank's whole buffer, importance weights (``--rollout_is_cap``, per token or per answer) and the
   sampler/trainer agreement ``rollout/logp_diff_*``. When the buffer is one training
   micro-batch, the first training step's forwards are the experience's (the same numbers, two
   forwards fewer; ``--separate_experience_pass`` turns it off);
3. **learning** (:meth:`Trainer.learn`): ``--ppo_epochs`` passes of micro-batches; each makes one
   actor micro-step (:func:`chatrl.rl.loss.policy_loss`, its share of the optimizer step's loss,
   :func:`chatrl.rl.loss.step_normalizers`), one critic micro-step when there is a critic
   (:func:`chatrl.rl.core.critic_loss`) and one PTX micro-step of the actor with
   ``--unsupervised_dataset_name``; the EMA follows every actor optimizer step.

Every model runs in eval mode (dropout off, detail 1), so at the first PPO epoch the ratio is exactly
1 and the KL to an identical reference exactly 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from chatrl.config import PPOConfig
from chatrl.logprobs import float_dtype, logprobs_and_entropy, logprobs_from_logits
from chatrl.models import causal_lm_logits, stop_token_ids
from chatrl.rewards import WeightedReward, reward_batch_from_tokens, score_on_all_ranks
from chatrl.rl import core
from chatrl.rl.advantages import AdvantageInputs, repeat_prompts
from chatrl.rl.loss import logp_diff, loss_scale, policy_loss, rollout_is_weights, step_normalizers
from chatrl.rl.stats import PooledStats

AllReduce = Callable[[torch.Tensor], torch.Tensor]
Generate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``generate(ids (B, P), mask (B, P)) -> (sequences (B, P + A), sampler_logp (B, A))`` (the hybrid engine)."""


@dataclass
class Experience:
    """One rank's rollouts and what is computed from them. ``B`` rollouts, prompt width ``P``, answer width ``A``.

    Filled by :meth:`Trainer.rollout`: ``sequences``/``attention_mask`` ``(B, P + A)`` (prompts
    left-padded, answers masked after their first stop token), ``prompt_len`` ``P``,
    ``action_mask`` ``(B, A)``, ``sampler_logp`` ``(B, A)`` (the generator's log-prob of each
    sampled token), ``scores`` ``(B,)`` (the weighted reward, penalty included),
    ``reward_parts`` (``{"reward/<source>": (B,)}`` unweighted) and ``metadata`` (``B`` dicts).

    Filled by the experience pass, all ``(B, A)``: ``ref_logp``, ``logp`` (actor), ``entropy`` (nats),
    ``values`` (critic, V(state before token j); ``None`` without a critic); and by
    :meth:`Trainer.finish_experience`: ``kl`` (per-token estimate), ``advantages``, ``returns``
    (critic targets; ``None`` without a critic), ``rewards`` (per-token rewards, when the
    algorithm builds them), ``is_weights`` (``None`` unless ``--rollout_is_cap``; ``--rollout_is_level``,
    ``--rollout_is_mode``).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_len: int
    action_mask: torch.Tensor
    sampler_logp: torch.Tensor
    scores: torch.Tensor
    reward_parts: dict[str, torch.Tensor] = field(default_factory=dict)
    metadata: list[dict] = field(default_factory=list)
    ref_logp: torch.Tensor | None = None
    logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def rows(self, idx: slice) -> Experience:
        """The rollouts ``idx`` (a slice of the batch dimension) as a new Experience (tensors are views)."""
        def part(v):
            if isinstance(v, torch.Tensor):
                return v[idx]
            if isinstance(v, dict):
                return {k: t[idx] for k, t in v.items()}
            return v[idx] if isinstance(v, list) else v

        return Experience(**{f.name: part(getattr(self, f.name)) for f in fields(self)})


def concat_rollouts(rollouts: list[Experience], pad_token_id: int) -> Experience:
    """One buffer from rollouts of different prompt widths ``P`` (left-padded to the widest) and answer
    widths ``A`` (right-padded); per-token ``(B, A)`` tensors are right-padded with 0. A single
    rollout is returned as it is."""
    if len(rollouts) == 1:
        return rollouts[0]
    p = max(r.prompt_len for r in rollouts)
    a = max(r.action_mask.shape[1] for r in rollouts)
    seqs, masks = [], []
    for r in rollouts:
        rp, ra = r.prompt_len, r.action_mask.shape[1]
        s, m = r.sequences, r.attention_mask
        seqs.append(torch.cat([s.new_full((len(s), p - rp), pad_token_id), s, s.new_full((len(s), a - ra), pad_token_id)],
                              dim=1))
        masks.append(torch.cat([m.new_zeros(len(m), p - rp), m, m.new_zeros(len(m), a - ra)], dim=1))

    def right(name: str) -> torch.Tensor:
        return torch.cat([torch.nn.functional.pad(getattr(r, name), (0, a - getattr(r, name).shape[1]))
                          for r in rollouts])

    return Experience(torch.cat(seqs), torch.cat(masks), p, right("action_mask"), right("sampler_logp"),
                      torch.cat([r.scores for r in rollouts]),
                      {k: torch.cat([r.reward_parts[k] for r in rollouts]) for k in rollouts[0].reward_parts},
                      [m for r in rollouts for m in r.metadata])


def answer_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits ``(B, A, V)`` whose column ``j`` predicts answer token ``j`` (``A = T - prompt_len``).

    Only the ``A + 1`` last positions go through the LM head (the prompt's logits are never read).
    """
    return causal_lm_logits(model, sequences, attention_mask, logits_to_keep=sequences.shape[1] - prompt_len + 1)[:, :-1]


def answer_values(critic, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Critic values ``(B, A)``: column ``j`` is V(prompt, answer tokens < j)."""
    return critic(sequences, attention_mask).values[:, prompt_len - 1:-1].float()


class Trainer:
    """Makes experience and trains the actor (and the critic, when the algorithm has one) on it.

    Args:
        actor: the actor's DeepSpeed engine (with optimizer).
        reference: the frozen reference (engine or module) with the actor's tokenizer.
        critic: the critic's engine (``critic(ids, mask)`` returns ``(values (B, T), end_scores
            (B,))``), or ``None`` when the algorithm has no critic.
        reward: ``reward(RewardBatch) -> (scores (B,), {"reward/<name>": (B,)})``
            (:class:`chatrl.rewards.WeightedReward`).
        generate: see :data:`Generate`.
        kl_controller: its ``value`` is the KL coefficient (``--kl_in`` reward or loss).
        settings: step 3's :class:`chatrl.config.PPOConfig` (the algorithm, its sizes and
            coefficients).
        tokenizer: the actor's (stop ids, pad id; answers are decoded for text rewards).
        gradient_accumulation_steps, world_size: of the actor's DeepSpeed engine.
        answer_len: ``--max_answer_seq_len``, the constant of ``seq-mean-token-sum-norm``.
        all_reduce_sum, all_reduce_max: collectives over the ranks (``None``: one rank).
        rank: this rank (reward failures name it).
        temperature: ``--temperature`` of the sampler (0: greedy). The actor's and the reference's
            log-probs, the ratio, the KL and the entropy are those of the distribution the tokens
            were sampled from, ``softmax(logits / T)`` (as TRL, veRL and OpenRLHF compute them);
            greedy decoding is scored at ``T = 1``. Top-k and top-p truncate what the sampler draws
            from but not what is trained (``docs/critic_free.md``, "Temperature").
        ema: optional EMA copy of the actor, averaged after every actor optimizer step (ZeRO-3
            partitions are averaged in place, no gather).

    Raises:
        ValueError: a critic given to an algorithm without one, or none to one that needs it.
    """

    def __init__(self, actor, reference, critic, reward: WeightedReward, generate: Generate, kl_controller,
                 settings: PPOConfig, tokenizer, *, gradient_accumulation_steps: int = 1, world_size: int = 1,
                 answer_len: int = 1, all_reduce_sum: AllReduce | None = None, all_reduce_max: AllReduce | None = None,
                 rank: int = 0, ema=None, temperature: float = 1.0):
        self.algorithm = settings.algorithm
        if (critic is not None) != self.algorithm.needs_critic:
            raise ValueError(f"--rl_algorithm {self.algorithm.name} {'needs' if self.algorithm.needs_critic else 'has no'}"
                             " critic")
        self.actor, self.reference, self.critic, self.ema = actor, reference, critic, ema
        self.reward, self.generate, self.kl_ctl, self.s, self.tokenizer = reward, generate, kl_controller, settings, tokenizer
        self.mb, self.n = settings.per_device_training_batch_size, settings.samples_per_prompt
        self.mode = settings.loss_aggregation
        self.clip_low, self.clip_high = settings.clip_bounds
        self.stops, self.pad = stop_token_ids(tokenizer), tokenizer.pad_token_id
        self.gas, self.world, self.answer_len = gradient_accumulation_steps, world_size, answer_len
        self.all_reduce_sum, self.all_reduce_max, self.rank = all_reduce_sum, all_reduce_max, rank
        self.temperature = temperature if temperature > 0 else 1.0
        for m in (actor, critic, reference, ema):
            if m is not None:
                m.eval()  # detail 1: dropout off in every RL forward pass

    # ------------------------------------------------------------------------------------ rollouts
    def mask_answers(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seq: torch.Tensor):
        """Detail 3: the action mask ``(B, A)`` of generated ``seq`` ``(B, P + A)`` covers the answer up
        to and including its first stop token; later tokens become pad. Returns ``(seq, mask, action_mask)``
        with ``mask`` ``(B, P + A)`` the prompt's mask followed by the action mask."""
        answer = seq[:, prompt_ids.shape[1]:]
        action_mask = core.action_mask_from_tokens(answer, self.stops).to(prompt_mask.dtype)
        answer = answer.masked_fill(action_mask == 0, self.pad)
        return (torch.cat([prompt_ids, answer], dim=1), torch.cat([prompt_mask, action_mask], dim=1), action_mask)

    @torch.no_grad()
    def rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, metadata: list[dict] | None,
                step: int) -> Experience:
        """``N`` answers to each left-padded prompt ``(B, P)``, their sampler log-probs and rewards
        (all ranks call it: generation and the reward failure check are collective).

        Raises:
            chatrl.rewards.RewardError: a reward source failed on some rank (on every rank).
        """
        ids, mask = repeat_prompts(prompt_ids, prompt_mask, self.n)
        meta = [dict(m) for m in (metadata or [{}] * len(prompt_ids)) for _ in range(self.n)]
        seq, sampler_logp = self.generate(ids, mask)
        P = ids.shape[1]
        seq, full_mask, action_mask = self.mask_answers(ids, mask, seq)
        sampler_logp = core.where_valid(sampler_logp[:, :action_mask.shape[1]].float().to(seq.device), action_mask > 0)
        batch = reward_batch_from_tokens(self.tokenizer, seq, full_mask, action_mask, P, meta, step)
        got: dict = {}

        def score() -> torch.Tensor:
            got["total"], got["parts"] = self.reward(batch)
            return got["total"]

        scores = score_on_all_ranks(score, rank=self.rank, world_size=self.world, all_reduce_sum=self.all_reduce_sum,
                                    step=step, device=seq.device).to(seq.device).float()
        if self.s.penalty_no_eos:
            has_eos = core.has_stop_token(seq[:, P:], action_mask, self.stops)
            scores = scores - self.s.penalty_no_eos * (~has_eos).float()
        return Experience(seq, full_mask, P, action_mask, sampler_logp, scores,
                          {k: v.detach().float().to(seq.device) for k, v in got["parts"].items()}, meta)

    def policy_logits(self, model, sequences: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_len: int) -> torch.Tensor:
        """The answer logits ``(B, A, V)`` of the actor or the reference, divided by the sampling
        temperature: the distribution the answers were sampled from (the sampler divides float32
        logits, so bf16 logits are promoted before the division; at ``T = 1`` they stay as they are)."""
        logits = answer_logits(model, sequences, attention_mask, prompt_len)
        return logits.to(float_dtype(logits)) / self.temperature if self.temperature != 1.0 else logits

    # ---------------------------------------------------------------------------------- experience
    def first_pass_is_experience(self, rollouts: int) -> bool:
        """Whether the actor's and critic's experience passes are left to the first training pass: the
        buffer (``rollouts`` per rank, the same on every rank) is one training micro-batch, so the
        first step's forwards see exactly the experience pass's weights and inputs (detail 1),
        unless ``--separate_experience_pass`` asks for the plain path."""
        return rollouts <= self.mb and not self.s.separate_experience_pass

    @torch.no_grad()
    def make_experience(self, rollouts: list[Experience], stats: PooledStats) -> tuple[Experience, dict]:
        """One experience buffer from the generation batches' rollouts (module docstring, step 2).

        Returns the buffer and its agreement figures (already global; empty when the first training
        pass makes the experience: :meth:`learn` returns them then); adds its pooled statistics to
        ``stats``. A collective: every rank calls it.
        """
        exp = concat_rollouts(rollouts, self.pad)
        deferred = self.first_pass_is_experience(len(exp))
        parts: dict[str, list] = {k: [] for k in ("logp", "entropy", "values", "ref_logp")}
        P = exp.prompt_len
        for i in range(0, len(exp), self.mb):
            s, m = exp.sequences[i:i + self.mb], exp.attention_mask[i:i + self.mb]
            if not deferred:
                logp, entropy = logprobs_and_entropy(self.policy_logits(self.actor, s, m, P), s[:, P:])
                parts["logp"].append(logp)
                parts["entropy"].append(entropy)
                if self.critic is not None:
                    parts["values"].append(answer_values(self.critic, s, m, P))
            parts["ref_logp"].append(logprobs_from_logits(self.policy_logits(self.reference, s, m, P), s[:, P:]))
        exp.ref_logp, exp.logp, exp.entropy, exp.values = (torch.cat(parts[k]) if parts[k] else None
                                                           for k in ("ref_logp", "logp", "entropy", "values"))
        return exp, ({} if deferred else self.finish_experience(exp, stats))

    @torch.no_grad()
    def finish_experience(self, exp: Experience, stats: PooledStats) -> dict:
        """From the experience's log-probs (and values): the per-token KL (``--kl_estimator``), the
        algorithm's advantages on the rank's whole buffer, the importance weights and the agreement
        statistics; fills ``exp``, adds ``advantage_abs_mean`` to ``stats`` and returns
        ``rollout/logp_diff_*`` (global). A collective (REINFORCE++'s whitening, the agreement
        figures): every rank calls it."""
        s = self.s
        exp.kl = core.masked_kl(exp.logp, exp.ref_logp, exp.action_mask, s.kl_estimator)
        kl_coef = self.kl_ctl.value if s.kl_in == "reward" else 0.0
        out = self.algorithm.estimate(AdvantageInputs(exp.scores, exp.action_mask, exp.kl, kl_coef, exp.values,
                                                      self.n, self.all_reduce_sum), s)
        exp.advantages, exp.returns, exp.rewards = out.advantages, out.returns, out.rewards
        if s.rollout_is_cap > 0:
            exp.is_weights, outside = rollout_is_weights(exp.logp, exp.sampler_logp, exp.action_mask,
                                                         level=s.rollout_is_level, mode=s.rollout_is_mode,
                                                         cap=s.rollout_is_cap, cap_low=s.rollout_is_cap_low)
            stats.add_mean("rollout/is_outside_frac", outside.float(), exp.action_mask)
        stats.add_mean("advantage_abs_mean", exp.advantages.abs(), exp.action_mask)
        return logp_diff(exp.sampler_logp, exp.logp, exp.action_mask, self.all_reduce_sum, self.all_reduce_max)

    # ------------------------------------------------------------------------------------ learning
    def learn(self, exp: Experience, stats: PooledStats, ptx_batches=None) -> dict:
        """``--ppo_epochs`` passes of micro-batches over the buffer (module docstring, step 3).

        Adds to ``stats``: the losses (``actor_loss`` is the mean loss of an optimizer step, all ranks'
        micro-batches, :func:`chatrl.rl.loss.loss_scale`; ``critic_loss``, ``ptx_loss``: the mean over
        micro-steps) and the token statistics of the policy and value losses (clip fractions,
        approximate KL, ratio, ...) pooled over every token of every micro-batch and rank. Returns the
        agreement figures when the first training pass made the experience, else ``{}``.
        """
        norms = step_normalizers(exp.action_mask, self.mb, self.gas, self.mode, constant=float(self.answer_len),
                                 all_reduce_sum=self.all_reduce_sum)
        scale = loss_scale(self.mode, self.gas, self.world)
        ptx_iter = iter(ptx_batches) if ptx_batches is not None else None
        losses: dict[str, float] = {}
        agreement: dict = {}
        n = 0
        for _ in range(self.s.ppo_epochs):
            for j, i in enumerate(range(0, len(exp), self.mb)):
                logp = values = None
                if exp.logp is None:  # the experience's actor (and critic) passes are this first step's forwards
                    logp, values, agreement = self.first_pass(exp, stats)
                    part = exp
                else:
                    part = exp.rows(slice(i, i + self.mb))
                tokens = float(core.valid_mask(part.action_mask).sum())
                step_stats = self.train_actor(part, norms[j], scale, logp)
                if self.critic is not None:
                    step_stats.update(self.train_critic(part, values))
                if ptx_iter is not None:
                    step_stats.update(self.train_ptx(next(ptx_iter)))
                for k, v in step_stats.items():
                    if k in ("actor_loss", "critic_loss", "ptx_loss"):
                        losses[k] = losses.get(k, 0.0) + float(v)
                    else:  # a mean over the micro-batch's action tokens
                        stats.add_weighted(k, float(v), tokens)
                n += 1
        for k, total in losses.items():  # one figure per rank, averaged over ranks (equal micro-steps)
            stats.add_weighted(k, total * (scale if k == "actor_loss" else 1.0) / max(n, 1), 1.0)
        return agreement

    def first_pass(self, exp: Experience, stats: PooledStats) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """The first training forwards on a one-micro-batch buffer whose experience passes were deferred.

        The actor's (and critic's) training forwards give the old log-probs, entropy and values
        (detached: the same numbers the experience passes would give, so the ratio is exactly 1);
        :meth:`finish_experience` then fills the rest of ``exp``. Returns the forwards' ``logp``
        and ``values`` (with their graphs, for the first losses; both alive until the actor's
        backward) and the experience statistics.
        """
        answer = exp.sequences[:, exp.prompt_len:]
        logp, entropy = logprobs_and_entropy(
            self.policy_logits(self.actor, exp.sequences, exp.attention_mask, exp.prompt_len), answer)
        values = (answer_values(self.critic, exp.sequences, exp.attention_mask, exp.prompt_len)
                  if self.critic is not None else None)
        exp.logp, exp.entropy = logp.detach(), entropy.detach()
        exp.values = values.detach() if values is not None else None
        del entropy
        return logp, values, self.finish_experience(exp, stats)

    def train_actor(self, exp: Experience, normalizer: torch.Tensor, scale: float,
                    logp: torch.Tensor | None = None) -> dict:
        """One micro-step of the actor on ``exp`` (one micro-batch): the clipped policy loss
        (:func:`chatrl.rl.loss.policy_loss`, with the KL loss term under ``--kl_in loss``) divided by
        ``normalizer``, times ``scale`` for DeepSpeed. ``logp`` ``(B, A)``: the actor's log-probs
        from a forward already run on it (:meth:`first_pass`), else computed here."""
        if logp is None:
            logits = self.policy_logits(self.actor, exp.sequences, exp.attention_mask, exp.prompt_len)
            logp = logprobs_from_logits(logits, exp.sequences[:, exp.prompt_len:])
            del logits
        in_loss = self.s.kl_in == "loss"
        loss, stats = policy_loss(logp, exp.logp, exp.advantages, exp.action_mask, normalizer,
                                  loss_agg_mode=self.mode, cliprange_low=self.clip_low, cliprange_high=self.clip_high,
                                  is_weights=exp.is_weights, ref_logp=exp.ref_logp if in_loss else None,
                                  kl_loss_coef=self.kl_ctl.value if in_loss else 0.0)
        self.actor.backward(loss * scale)
        self.actor.step()
        self._after_actor_step()
        return {"actor_loss": loss.detach(), **stats}

    def train_critic(self, exp: Experience, values: torch.Tensor | None = None) -> dict:
        """One clipped value-loss micro-step of the critic on ``exp`` (one micro-batch); ``values``
        ``(B, A)`` as ``logp`` in :meth:`train_actor`."""
        if values is None:
            values = answer_values(self.critic, exp.sequences, exp.attention_mask, exp.prompt_len)
        loss, stats = core.critic_loss(values, exp.values, exp.returns, exp.action_mask, self.s.cliprange_value)
        self.critic.backward(loss)
        self.critic.step()
        return {"critic_loss": loss.detach(), **stats}

    def train_ptx(self, batch: dict) -> dict:
        """One micro-step of the actor on unsupervised text: next-token NLL over the labelled tokens,
        scaled by ``--unsup_coef`` (Ouyang et al., 2022, eq. 2)."""
        logits = causal_lm_logits(self.actor, batch["input_ids"], batch["attention_mask"])
        loss = core.ptx_loss(logits[:, :-1], batch["labels"][:, 1:])
        self.actor.backward(self.s.unsup_coef * loss)
        self.actor.step()
        self._after_actor_step()
        return {"ptx_loss": loss.detach()}

    def _after_actor_step(self) -> None:
        if self.ema is not None and self.actor.is_gradient_accumulation_boundary():
            update_ema(self.ema, self.actor.module, self.s.ema_beta)


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, beta: float) -> None:
    """``ema ← beta·ema + (1 − beta)·model`` over parameters, in place.

    Under ZeRO-3 both modules are partitioned alike (same shapes, same world), so the local
    partitions (``ds_tensor``) are averaged directly without a gather.
    """
    for p_ema, p in zip(ema.parameters(), model.parameters(), strict=True):
        src, dst = (p.ds_tensor, p_ema.ds_tensor) if hasattr(p, "ds_tensor") else (p.data, p_ema.data)
        dst.mul_(beta).add_(src.to(dst.dtype), alpha=1.0 - beta)


def summarize(exp: Experience, kl_coef: float, stop_ids: list[int], stats: PooledStats) -> None:
    """Add the rollout statistics of this rank's buffer to ``stats`` (``docs/ppo.md``), each pooled
    over the global batch: means over rollouts (scores and their parts, the per-answer KL, answer
    length, the share of answers that end their turn), the scores' standard deviation, the entropy
    over action tokens, and with a critic ``explained_variance``, with per-token rewards
    ``reward/mean``."""
    m = exp.action_mask
    answer = exp.sequences[:, exp.prompt_len:]
    stats.add_mean("reward/score_mean", exp.scores)
    stats.add_std("reward/score_std", exp.scores)
    for k, v in exp.reward_parts.items():
        stats.add_mean(k, v)
    stats.add_mean("kl", (exp.kl * m).sum(dim=1))
    stats.add_mean("entropy", exp.entropy, m)
    stats.add_mean("answer_len", m.sum(dim=1).float())
    stats.add_mean("eos_rate", core.has_stop_token(answer, m, stop_ids).float())
    stats.add_weighted("kl_coef", float(kl_coef), 1.0)
    if exp.rewards is not None:
        stats.add_mean("reward/mean", (exp.rewards * m).sum(dim=1))
    if exp.values is not None:
        stats.add_explained_variance("explained_variance", exp.values, exp.returns, m)
