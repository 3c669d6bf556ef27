"""Step 3's trainer, one for every algorithm: rollouts, an experience buffer, learning from it.

The algorithm (:class:`chatrl.rl.algorithms.Algorithm`, ``--rl_algorithm``) chooses the advantage
estimator, whether a critic exists, its group size and default loss aggregation; everything else is
the same for all. Per experience buffer (:func:`chatrl.step3_ppo.main.train` reads top to bottom):

1. **rollouts** (:meth:`Trainer.rollout`, once per generation batch): each prompt repeated ``N``
   times (``--num_samples_per_prompt``; the group is contiguous and stays on one rank), answers
   generated in the hybrid engine's inference layout with the sampler's log-prob of every sampled
   token, the action mask (through the first stop token, detail 3 of ``docs/ppo.md``), the reward
   of every source (:class:`chatrl.rewards.WeightedReward`: reward model, functions, servers; a
   failure on any rank an error on every rank) minus ``--penalty_no_eos``. With an environment
   (``--env``, :meth:`Trainer.rollout_episodes`) each rollout is a multi-turn episode
   (:mod:`chatrl.envs.rollout`): the answer region holds every assistant turn and the
   observations between them, the action mask is 1 on the sampled tokens only, and the
   environment's reward is one of the sources (``docs/multi_turn.md``);
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

With ``--packing`` the experience and training forwards (actor, reference, critic, reward model) run
on packed rows of each micro-batch's real tokens (:func:`chatrl.packing.pack_rollouts`), read back
into the buffer's ``(B, A)`` layout: the same numbers without the padding. With
``--max_tokens_per_micro_batch`` each optimizer step's rollouts are cut into micro-batches of at most
that many tokens (as many on every rank), whose number DeepSpeed is told through its accumulation
boundary; the loss aggregation is then a global one (``docs/packing.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from chatrl.config import PackingConfig, PPOConfig
from chatrl.distributed.dist import RankGroup
from chatrl.distributed.resilience import nonfinite_scores
from chatrl.envs.rollout import Episodes, episode_seed, run_episodes
from chatrl.evidence.weight_version import WeightVersionCheck
from chatrl.hybrid_engine import Sampler
from chatrl.logprobs import token_logprobs
from chatrl.models.causal_lm import causal_lm_logits, stop_token_ids, token_logits_at
from chatrl.packing import micro_batch_groups, pack_rollouts
from chatrl.rewards import RewardBatch, WeightedReward, reward_batch_from_tokens, score_on_all_ranks
from chatrl.rewards.base import decode_exactly
from chatrl.rl import core
from chatrl.rl.advantages import AdvantageInputs, repeat_prompts
from chatrl.rl.loss import (
    PolicyLossSettings,
    logp_diff,
    loss_scale,
    policy_loss,
    rollout_is_weights,
    step_normalizers,
)
from chatrl.rl.stats import PooledStats
from chatrl.step3_ppo.engine import RLHFEngines


@dataclass(frozen=True)
class OptimizerStep:
    """How the trainer's micro-batches make one optimizer step: ``gradient_accumulation_steps``
    micro-batches per rank (the actor's DeepSpeed engine's), the policy loss aggregated by
    ``loss_agg_mode`` (the planned one, :attr:`chatrl.sizes.PPOPlan.loss_agg_mode`; None: the PPO
    block's :attr:`~chatrl.config.PPOConfig.loss_aggregation`) and ``answer_len`` tokens, the
    per-answer constant of ``seq-mean-token-sum-norm`` (``--max_answer_seq_len``, or the episodes'
    widest answer region)."""

    gradient_accumulation_steps: int = 1
    loss_agg_mode: str | None = None
    answer_len: int = 1


@dataclass
class Experience:
    """One rank's rollouts and what is computed from them. ``B`` rollouts, prompt width ``P``, answer width ``A``.

    Filled by :meth:`Trainer.rollout`: ``sequences``/``attention_mask`` ``(B, P + A)`` (prompts
    left-padded, answers masked after their first stop token), ``prompt_len`` ``P``,
    ``action_mask`` ``(B, A)``, ``sampler_logp`` ``(B, A)`` (the generator's log-prob of each
    sampled token), ``scores`` ``(B,)`` (the weighted reward, penalty included),
    ``reward_parts`` (``{"reward/<source>": (B,)}`` unweighted), ``metadata`` (``B`` dicts), and the
    stamp of the weights that generated each rollout (:mod:`chatrl.evidence.weight_version`):
    ``weight_version`` ``(B,)`` int64 and ``weight_checksum`` ``(B,)`` float64 (``None`` without a
    stamp source). For multi-turn episodes (``--env``) the answer region ``A`` holds every assistant
    turn and the observations between them: ``attention_mask`` is 1 on both, ``action_mask`` on the
    sampled tokens only (every per-token quantity below is masked with it), ``turn_rewards``
    ``(B, A)`` the environment's rewards of the turns before the last at their last tokens (part of
    ``scores``), ``turns`` ``(B,)`` the assistant turns, ``transcripts`` the ``B`` conversations.

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
    turn_rewards: torch.Tensor | None = None
    turns: torch.Tensor | None = None
    transcripts: list[list[dict]] = field(default_factory=list)
    weight_version: torch.Tensor | None = None
    weight_checksum: torch.Tensor | None = None
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

    def to(self, device) -> Experience:
        """A copy with every tensor on ``device`` (``"cpu"``: to pickle or save it)."""
        def moved(v):
            if isinstance(v, torch.Tensor):
                return v.to(device)
            return {k: t.to(device) for k, t in v.items()} if isinstance(v, dict) else v

        return Experience(**{f.name: moved(getattr(self, f.name)) for f in fields(self)})

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
    widths ``A`` (right-padded); every per-token ``(B, A)`` tensor is right-padded with 0 (the action
    mask too, so padding is never an action), per-rollout ``(B,)`` ones are concatenated. A single
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

    def joined(name: str):
        parts = [getattr(r, name) for r in rollouts]
        if parts[0] is None:
            return None
        if isinstance(parts[0], list):  # per rollout (transcripts)
            return [x for part in parts for x in part]
        if parts[0].dim() == 2:  # per token (B, A_r)
            return torch.cat([torch.nn.functional.pad(t, (0, a - t.shape[1])) for t in parts])
        return torch.cat(parts)

    skip = {"sequences", "attention_mask", "prompt_len", "reward_parts", "metadata"}
    per_row = {f.name: joined(f.name) for f in fields(Experience) if f.name not in skip}
    return Experience(torch.cat(seqs), torch.cat(masks), p,
                      reward_parts={k: torch.cat([r.reward_parts[k] for r in rollouts]) for k in rollouts[0].reward_parts},
                      metadata=[m for r in rollouts for m in r.metadata], **per_row)


def answer_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits ``(B, A, V)`` whose column ``j`` predicts answer token ``j`` (``A = T - prompt_len``).

    Only the ``A + 1`` last positions go through the LM head (the prompt's logits are never read).
    """
    return causal_lm_logits(model, sequences, attention_mask, logits_to_keep=sequences.shape[1] - prompt_len + 1)[:, :-1]


def answer_values(critic, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                  pad_token_id: int | None = None) -> torch.Tensor:
    """Critic values ``(B, A)``: column ``j`` is V(prompt, answer tokens < j). With ``pad_token_id``
    the rollouts run packed (:func:`chatrl.packing.pack_rollouts`; the same values, 0 beyond each answer)."""
    if pad_token_id is None:
        return critic(sequences, attention_mask).values[:, prompt_len - 1:-1].float()
    packed, slots = pack_rollouts(sequences, attention_mask, prompt_len, pad_token_id)
    values = critic(packed.input_ids, None, packed=packed).values
    return slots.scatter(values[slots.rows, slots.cols].float(), len(sequences), sequences.shape[1] - prompt_len)


def packed_answer_logp(model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                       pad_token_id: int, temperature: float = 1.0, entropy: bool = False, top_k: int = 0,
                       top_p: float = 1.0):
    """Log-probs ``(B, A)`` of the answer tokens (and their entropy ``(B, A)`` with ``entropy``) under
    ``model`` at ``temperature`` (and the sampler's ``top_k`` / ``top_p`` filters), computed on packed rows (:func:`chatrl.packing.pack_rollouts`) with
    the LM head on the answer positions only: the padded path's numbers on each answer token, 0
    beyond each answer (:func:`chatrl.logprobs.token_logprobs`, float32 before the temperature)."""
    packed, slots = pack_rollouts(sequences, attention_mask, prompt_len, pad_token_id)
    logits = token_logits_at(model, slots.rows, slots.cols, packed.input_ids, None, packed)
    width = sequences.shape[1] - prompt_len
    targets = sequences[:, prompt_len:][slots.seq, slots.offset]
    out = token_logprobs(logits.unsqueeze(0), targets.unsqueeze(0), temperature, entropy, top_k, top_p)
    return (tuple(slots.scatter(x[0], len(sequences), width) for x in out) if entropy
            else slots.scatter(out[0], len(sequences), width))


class Trainer:
    """Makes experience and trains the actor (and the critic, when the algorithm has one) on it.

    Args:
        models: the engines (:class:`chatrl.step3_ppo.engine.RLHFEngines`): ``actor`` (with optimizer),
            ``reference`` (frozen, engine or module, the actor's tokenizer; ``None`` when the KL
            coefficient is 0, :func:`chatrl.step3_ppo.engine.needs_reference`: the experience's
            ``ref_logp`` and ``kl`` are then ``None`` and no ``kl`` statistic is logged), ``critic``
            (``critic(ids, mask)`` returns ``(values (B, T), end_scores (B,))``; ``None`` when the
            algorithm has no critic) and ``ema``, an optional EMA copy of the actor, averaged after every
            actor optimizer step (ZeRO-3 partitions are averaged in place, no gather). Its ``reward``
            engine is not used.
        reward: ``reward(RewardBatch) -> (scores (B,), {"reward/<name>": (B,)})``
            (:class:`chatrl.rewards.WeightedReward`).
        sampler: the rollouts' :class:`chatrl.hybrid_engine.Sampler` (``None``: the trainer only
            learns). Its ``sampling`` (``--temperature``, ``--top_k``, ``--top_p``) is scored: the
            actor's and the reference's log-probs, the ratio, the KL and the entropy are those of the
            distribution the tokens were sampled from, ``softmax(logits / T)`` (as TRL, veRL and
            OpenRLHF compute them), greedy decoding at ``T = 1``; with a top-k / top-p filter, those of
            the filtered distribution, each model filtering its own logits, the sampled token always
            counted (:func:`chatrl.logprobs.token_logprobs`; ``docs/critic_free.md``, "Temperature,
            top-k and top-p"). Its ``weights`` give the stamps: every rollout carries
            ``sampler_stamp()``, and :meth:`make_experience` checks them against ``training_stamp()``
            (:class:`chatrl.evidence.weight_version.WeightVersionCheck`, ``weight_check``); ``None``: no check.
        kl_controller: its ``value`` is the KL coefficient (``--kl_in`` reward or loss).
        settings: step 3's :class:`chatrl.config.PPOConfig` (the algorithm, its sizes and
            coefficients).
        tokenizer: the actor's (stop ids, pad id; answers are decoded for text rewards).
        step: the optimizer step's accumulation, planned loss aggregation and answer budget
            (:class:`OptimizerStep`).
        ranks: this rank and the collectives over the ranks (:class:`chatrl.distributed.dist.RankGroup`; reward
            failures name the rank); ``None``: one rank.
        packing: ``--packing`` (packed forwards) and ``--max_tokens_per_micro_batch`` (micro-batches
            by token budget; needs a global loss aggregation and no PTX loss, :func:`chatrl.sizes.plan_ppo`).
        episodes: the environment and sizes of multi-turn episodes (``--env``,
            :class:`chatrl.envs.rollout.Episodes`), or ``None``: one answer per prompt.

    Attributes:
        trace: set it to a dict before :meth:`learn` and learn fills it: ``ratio`` and ``clip``
            ``(epochs, R, A)`` per token (:func:`chatrl.rl.loss.policy_loss`'s ``token_stats``),
            ``actor_grad_norm`` and ``critic_grad_norm`` (one per optimizer step, DeepSpeed's
            ``get_global_grad_norm``); the rollout records and the loss-scale probe read it.

    Raises:
        ValueError: a critic given to an algorithm without one, or none to one that needs it.
    """

    def __init__(self, models: RLHFEngines, reward: WeightedReward, sampler: Sampler | None, kl_controller,
                 settings: PPOConfig, tokenizer, *, step: OptimizerStep = OptimizerStep(),
                 ranks: RankGroup | None = None, packing: PackingConfig | None = None,
                 episodes: Episodes | None = None):
        self.algorithm = settings.algorithm
        actor, reference, critic, ema = models.actor, models.reference, models.critic, models.ema
        if (critic is not None) != self.algorithm.needs_critic:
            raise ValueError(f"--rl_algorithm {self.algorithm.name} {'needs' if self.algorithm.needs_critic else 'has no'}"
                             " critic")
        self.actor, self.reference, self.critic, self.ema = actor, reference, critic, ema
        sampler = sampler or Sampler(None)
        self.reward, self.generate, self.kl_ctl, self.s, self.tokenizer = reward, sampler, kl_controller, settings, tokenizer
        self.mb, self.n = settings.per_device_training_batch_size, settings.samples_per_prompt
        self.mode = step.loss_agg_mode or settings.loss_aggregation
        # the critic's value loss: DeepSpeed-Chat's per-micro-batch mean beside its policy loss, else the step's token mean
        self.critic_mode = "micro-batch-token-mean" if self.mode == "micro-batch-token-mean" else "token-mean"
        self.loss = PolicyLossSettings(self.mode, *settings.clip_bounds, settings.kl_loss_estimator)
        self.stops, self.pad = stop_token_ids(tokenizer), tokenizer.pad_token_id
        ranks = ranks or RankGroup()
        self.gas, self.world, self.answer_len = step.gradient_accumulation_steps, ranks.world_size, step.answer_len
        self.all_reduce_sum, self.all_reduce_max, self.rank = ranks.all_reduce_sum, ranks.all_reduce_max, ranks.rank
        self.temperature, self.top_k, self.top_p = sampler.sampling.scored  # greedy: T = 1, no filter
        packing = packing or PackingConfig()
        self.packed, self.max_tokens = packing.packing, packing.max_tokens_per_micro_batch
        self.episodes = episodes
        self.weights, self.weight_check = sampler.weights, WeightVersionCheck()
        self.trace: dict | None = None
        self._step = 0
        for m in (actor, critic, reference, ema):
            if m is not None:
                m.eval()  # detail 1: dropout off in every RL forward pass

    def score_through(self, hook: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Pass every rollout's scores through ``hook`` from now on (``--debug_nonfinite_steps``, a
        testing hook: :meth:`chatrl.run.Run.nonfinite`, NaN at the listed steps;
        :func:`chatrl.distributed.resilience.nonfinite_scores`)."""
        self.reward = nonfinite_scores(self.reward, hook)

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
                step: int, messages: list | None = None) -> Experience:
        """``N`` answers to each left-padded prompt ``(B, P)``, their sampler log-probs and rewards
        (all ranks call it: generation and the reward failure check are collective). With an
        environment, ``N`` episodes of each prompt row's ``messages`` (:meth:`rollout_episodes`).

        Raises:
            chatrl.rewards.RewardError: a reward source failed on some rank (on every rank).
            chatrl.envs.EnvError: the environment failed on some rank (on every rank).
        """
        if self.episodes is not None:
            return self.rollout_episodes(messages, metadata, step, prompt_ids.device)
        ids, mask = repeat_prompts(prompt_ids, prompt_mask, self.n)
        meta = [dict(m) for m in (metadata or [{}] * len(prompt_ids)) for _ in range(self.n)]
        seq, sampler_logp = self.generate(ids, mask)
        self._step = step
        P = ids.shape[1]
        seq, full_mask, action_mask = self.mask_answers(ids, mask, seq)
        sampler_logp = core.where_valid(sampler_logp[:, :action_mask.shape[1]].float().to(seq.device), action_mask > 0)
        batch = reward_batch_from_tokens(self.tokenizer, seq, full_mask, action_mask, P, meta, step)
        scores, parts = self._score(batch, step, seq.device)
        if self.s.penalty_no_eos:
            has_eos = core.has_stop_token(seq[:, P:], action_mask, self.stops)
            scores = scores - self.s.penalty_no_eos * (~has_eos).float()
        return Experience(seq, full_mask, P, action_mask, sampler_logp, scores, parts, meta,
                          **self._stamps(len(seq), seq.device))

    def _stamps(self, n: int, device) -> dict:
        """The stamp of the weights that generated the last rollouts, per rollout: ``weight_version``
        ``(n,)`` int64 and ``weight_checksum`` ``(n,)`` float64; ``{}`` without a stamp source."""
        stamp = self.weights.sampler_stamp() if self.weights is not None else None
        if stamp is None:
            return {}
        return {"weight_version": torch.full((n,), stamp.version, dtype=torch.long, device=device),
                "weight_checksum": torch.full((n,), stamp.checksum, dtype=torch.float64, device=device)}

    def _score(self, batch: RewardBatch, step: int, device) -> tuple[torch.Tensor, dict]:
        """The weighted reward of ``batch`` on every rank (a failure anywhere raises everywhere)."""
        got: dict = {}

        def score() -> torch.Tensor:
            got["total"], got["parts"] = self.reward(batch)
            return got["total"]

        scores = score_on_all_ranks(score, rank=self.rank, world_size=self.world, all_reduce_sum=self.all_reduce_sum,
                                    step=step, device=device).to(device).float()
        return scores, {k: v.detach().float().to(device) for k, v in got["parts"].items()}

    @torch.no_grad()
    def rollout_episodes(self, messages: list | None, metadata: list[dict] | None, step: int, device) -> Experience:
        """``N`` multi-turn episodes of each prompt row (``docs/multi_turn.md``): generated turn by
        turn inside one inference session of the hybrid engine (:func:`chatrl.envs.rollout.run_episodes`),
        token-in/token-out, then scored: the environment's summed rewards and every other source
        (the reward model and ``formatted_texts`` read the whole episode, functions the last
        assistant turn), minus
        ``--penalty_no_eos`` when the last turn did not end. A collective: every rank calls it.

        Raises:
            ValueError: prompt rows without their messages.
            chatrl.envs.EnvError, chatrl.rewards.RewardError: as :meth:`rollout`.
        """
        if messages is None:
            raise ValueError("episodes need each prompt row's messages (PromptCollator(with_metadata=True))")
        meta = [dict(m) for m in (metadata or [{}] * len(messages))]
        rows = [{"messages": [dict(m) for m in msgs], "metadata": dict(md), "seed": episode_seed(step, self.rank, i)}
                for i, (msgs, md) in enumerate(zip(messages, meta, strict=True)) for _ in range(self.n)]
        session = self.generate.session
        with session() if session is not None else contextlib.nullcontext():
            ep = run_episodes(self.generate, self.tokenizer, self.episodes, rows, stop_ids=self.stops, device=device,
                              all_reduce_sum=self.all_reduce_sum, rank=self.rank, step=step)
        self._step = step
        rmeta = [r["metadata"] for r in rows]
        P = ep.prompt_len
        prompts = [self.tokenizer.decode(ep.sequences[i, :P][ep.attention_mask[i, :P] > 0], skip_special_tokens=True)
                   for i in range(len(rows))]
        env_total = ep.final_rewards + ep.turn_rewards.sum(dim=1)
        token_ids = [ep.sequences[i][ep.attention_mask[i] > 0].tolist() for i in range(len(rows))]
        batch = RewardBatch(prompts, ep.answers, rmeta, step, ep.sequences, ep.attention_mask, P,
                            [decode_exactly(self.tokenizer, ids) for ids in token_ids], token_ids,
                            episode_rewards=env_total.tolist())
        scores, parts = self._score(batch, step, device)
        if self.s.penalty_no_eos:
            scores = scores - self.s.penalty_no_eos * (~ep.ended).float()
        return Experience(ep.sequences, ep.attention_mask, P, ep.action_mask, ep.sampler_logp, scores, parts, rmeta,
                          turn_rewards=ep.turn_rewards, turns=ep.turns, transcripts=ep.messages,
                          **self._stamps(len(rows), device))

    def padded_logp(self, model, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
                    entropy: bool = False):
        """The log-probs ``(B, A)`` of the answer tokens of padded ``sequences`` ``(B, prompt_len + A)``
        under the actor or the reference at the sampling temperature and with its top-k / top-p filters
        (and their entropy ``(B, A)`` with ``entropy``): the distribution the answers were sampled from. The answer logits go through
        :func:`chatrl.logprobs.token_logprobs`, which promotes bf16 logits to float32 before dividing, as
        the sampler does (at ``T = 1`` nothing is divided). The answer ids are the model's own samples,
        so they are not range-checked here (no host sync)."""
        logits = answer_logits(model, sequences, attention_mask, prompt_len)
        return token_logprobs(logits, sequences[:, prompt_len:], self.temperature, entropy, self.top_k, self.top_p)

    def policy_logp(self, model, exp: Experience, entropy: bool = False):
        """The log-probs ``(B, A)`` of ``exp``'s answer tokens under the actor or the reference at the
        sampling temperature and filters (and their entropy with ``entropy``), padded (:meth:`padded_logp`) or
        packed (``--packing``, :func:`packed_answer_logp`)."""
        if self.packed:
            return packed_answer_logp(model, exp.sequences, exp.attention_mask, exp.prompt_len, self.pad,
                                      self.temperature, entropy, self.top_k, self.top_p)
        return self.padded_logp(model, exp.sequences, exp.attention_mask, exp.prompt_len, entropy)

    def critic_values(self, exp: Experience) -> torch.Tensor:
        """The critic's values ``(B, A)`` of ``exp``, padded or packed (``--packing``)."""
        return answer_values(self.critic, exp.sequences, exp.attention_mask, exp.prompt_len,
                             self.pad if self.packed else None)

    def micro_batches(self, exp: Experience) -> list[tuple[slice, int, bool]]:
        """One pass over the buffer as micro-batches ``(rows, normaliser index, ends an optimizer step)``.

        Without a token budget: ``--per_device_training_batch_size`` rollouts each, micro-batch ``j``
        reading normaliser ``j`` (:func:`chatrl.rl.loss.step_normalizers`), and DeepSpeed counting
        the accumulation itself (``None``). With ``--max_tokens_per_micro_batch``: each optimizer
        step's rollouts (``--gradient_accumulation_steps`` × the batch size) cut by token budget, as
        many micro-batches on every rank (a collective), each reading its step's normaliser.
        """
        if not self.max_tokens:
            return [(slice(i, i + self.mb), j, None) for j, i in enumerate(range(0, len(exp), self.mb))]
        widths = (exp.attention_mask > 0).sum(-1).tolist() if self.packed else [exp.sequences.shape[1]] * len(exp)
        out, per_step = [], self.mb * self.gas
        for k, start in enumerate(range(0, len(exp), per_step)):
            units = [(w,) for w in widths[start:start + per_step]]
            groups = micro_batch_groups(units, self.mb, self.max_tokens, self.packed, self.all_reduce_max)
            out += [(slice(start + g[0], start + g[-1] + 1), k * self.gas, i == len(groups) - 1)
                    for i, g in enumerate(groups)]
        return out

    # ---------------------------------------------------------------------------------- experience
    def first_pass_is_experience(self, rollouts: int) -> bool:
        """Whether the actor's and critic's experience passes are left to the first training pass: the
        buffer (``rollouts`` per rank, the same on every rank) is one training micro-batch, so the
        first step's forwards see exactly the experience pass's weights and inputs (detail 1),
        unless ``--separate_experience_pass`` asks for the plain path (or micro-batches are cut by
        token budget)."""
        return rollouts <= self.mb and not self.s.separate_experience_pass and not self.max_tokens

    @torch.no_grad()
    def make_experience(self, rollouts: list[Experience], stats: PooledStats) -> tuple[Experience, dict]:
        """One experience buffer from the generation batches' rollouts (module docstring, step 2).

        Returns the buffer and its agreement figures (already global; empty when the first training
        pass makes the experience: :meth:`learn` returns them then); adds its pooled statistics to
        ``stats``. A collective: every rank calls it.
        """
        exp = concat_rollouts(rollouts, self.pad)
        if self.weights is not None and exp.weight_version is not None:  # before anything learns from them
            self.weight_check.check(exp.weight_version, exp.weight_checksum, self.weights.training_stamp(), self._step,
                                    self.all_reduce_sum, self.all_reduce_max)
        deferred = self.first_pass_is_experience(len(exp))
        parts: dict[str, list] = {k: [] for k in ("logp", "entropy", "values", "ref_logp")}
        for rows, _, _ in self.micro_batches(exp):
            part = exp.rows(rows)
            if not deferred:
                logp, entropy = self.policy_logp(self.actor, part, entropy=True)
                parts["logp"].append(logp)
                parts["entropy"].append(entropy)
                if self.critic is not None:
                    parts["values"].append(self.critic_values(part))
            if self.reference is not None:
                parts["ref_logp"].append(self.policy_logp(self.reference, part))
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
        kl_coef = self.kl_ctl.value if s.kl_in == "reward" else 0.0
        if exp.ref_logp is not None:
            exp.kl = core.masked_kl(exp.logp, exp.ref_logp, exp.action_mask, s.kl_estimator)
            kl = exp.kl
        else:  # no reference (a KL coefficient of 0): the penalty is 0 whatever the KL
            if kl_coef:
                raise ValueError(f"a KL coefficient of {kl_coef} needs the reference model's log-probs")
            kl = torch.zeros_like(exp.logp, dtype=torch.float32)
        out = self.algorithm.estimate(AdvantageInputs(exp.scores, exp.action_mask, kl, kl_coef, exp.values,
                                                      self.n, self.all_reduce_sum, exp.turn_rewards), s)
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

        Adds to ``stats``: the losses (``actor_loss`` and ``critic_loss`` are the mean loss of an
        optimizer step, all ranks' micro-batches, :func:`chatrl.rl.loss.loss_scale`; ``ptx_loss``: the
        mean over micro-steps) and the token statistics of the policy and value losses (clip fractions,
        approximate KL, ratio, ...) pooled over every token of every micro-batch and rank. Returns the
        agreement figures when the first training pass made the experience, else ``{}``.
        """
        norms = step_normalizers(exp.action_mask, self.mb, self.gas, self.mode, constant=float(self.answer_len),
                                 all_reduce_sum=self.all_reduce_sum)
        scale = loss_scale(self.mode, self.gas, self.world)
        critic_norms, critic_scale = None, 1.0
        if self.critic is not None:  # the value loss: a token mean of the optimizer step (or of the micro-batch)
            critic_mode = self.critic_mode
            critic_norms = (norms if critic_mode == self.mode else
                            step_normalizers(exp.action_mask, self.mb, self.gas, critic_mode,
                                             all_reduce_sum=self.all_reduce_sum))
            critic_scale = loss_scale(critic_mode, self.gas, self.world)
        ptx_iter = iter(ptx_batches) if ptx_batches is not None else None
        losses: dict[str, float] = {}
        agreement: dict = {}
        n = 0
        if self.trace is not None:
            self.trace.update(ratio=[], clip=[], actor_grad_norm=[], critic_grad_norm=[])
        for epoch in range(self.s.ppo_epochs):
            if self.trace is not None:
                self.trace["ratio"].append(torch.ones(exp.action_mask.shape, dtype=torch.float32))
                self.trace["clip"].append(torch.zeros(exp.action_mask.shape, dtype=torch.int8))
            for rows, j, ends_step in self.micro_batches(exp):
                logp = values = None
                if exp.logp is None:  # the experience's actor (and critic) passes are this first step's forwards
                    logp, values, agreement = self.first_pass(exp, stats)
                    part = exp
                else:
                    part = exp.rows(rows)
                if ends_step is not None:  # micro-batches by token budget: their number varies per step
                    for engine in (self.actor, self.critic):
                        if engine is not None:
                            engine.set_gradient_accumulation_boundary(ends_step)
                tokens = float(core.valid_mask(part.action_mask).sum())
                per_token: dict | None = {} if self.trace is not None else None
                step_stats = self.train_actor(part, norms[j], scale, logp, per_token)
                if per_token:
                    a = per_token["ratio"].shape[1]
                    self.trace["ratio"][epoch][rows, :a] = per_token["ratio"].float().cpu()
                    self.trace["clip"][epoch][rows, :a] = per_token["clip"].cpu()
                if self.critic is not None:
                    step_stats.update(self.train_critic(part, values, critic_norms[j], critic_scale))
                if ptx_iter is not None:
                    step_stats.update(self.train_ptx(next(ptx_iter)))
                for k, v in step_stats.items():
                    if k in ("actor_loss", "critic_loss", "ptx_loss"):
                        losses[k] = losses.get(k, 0.0) + float(v)
                    else:  # a mean over the micro-batch's action tokens
                        stats.add_weighted(k, float(v), tokens)
                # micro-steps of the configured size: a step cut by token budget counts as the accumulation steps
                n += 1 if ends_step is None else (self.gas if ends_step else 0)
        factor = {"actor_loss": scale, "critic_loss": critic_scale}
        for k, total in losses.items():  # one figure per rank, averaged over ranks (equal micro-steps)
            stats.add_weighted(k, total * factor.get(k, 1.0) / max(n, 1), 1.0)
        return agreement

    # --------------------------------------------------------------- the loss-scale probe's reference
    # ------------------------------------------------------------------ what the certificate asks
    def trace_learning(self, on: bool) -> None:
        """Whether the next :meth:`learn` fills a per-token trace (:meth:`learning_trace`)."""
        self.trace = {} if on else None

    def learning_trace(self) -> dict | None:
        """The trace of the last :meth:`learn` asked for with :meth:`trace_learning` (``ratio``, ``clip``,
        ``actor_grad_norm``, ``critic_grad_norm``), or None."""
        return self.trace

    def first_optimizer_step_rows(self, exp: Experience) -> Experience:
        """This rank's rows of ``exp`` that the first actor optimizer step trained on, on the CPU
        (micro-batch size × accumulation rows; the loss-scale probe's batch)."""
        return exp.rows(slice(0, self.gas * self.mb)).to("cpu")

    def loss_aggregation(self, model: str) -> str:
        """The loss aggregation of ``model`` ("actor": ``--loss_agg_mode``; "critic": its value loss's)."""
        return self.mode if model == "actor" else self.critic_mode

    def weight_versions(self) -> WeightVersionCheck:
        """The weight-version check of every buffer so far (the certificate's property 2)."""
        return self.weight_check

    def one_batch_actor_loss(self, model, parts: list[Experience]) -> torch.Tensor:
        """The policy loss of a global batch as ONE micro-batch on one rank, by its definition
        (:class:`chatrl.evidence.certificate.LossScaleProbe`): ``parts`` (every rank's rows of the first actor
        optimizer step, with their experience) joined, ``model``'s log-probs at the sampling
        temperature, the clipped loss over all their action tokens with the aggregation's own count
        (no accumulation, no rank, no DeepSpeed factor)."""
        exp = concat_rollouts(list(parts), self.pad)
        logp = self.padded_logp(model, exp.sequences, exp.attention_mask, exp.prompt_len)
        norm = step_normalizers(exp.action_mask, len(exp), 1, self.mode, constant=float(self.answer_len))[0]
        in_loss = self.s.kl_in == "loss"
        loss, _ = policy_loss(logp, exp.logp, exp.advantages, exp.action_mask, norm, self.loss,
                              is_weights=exp.is_weights, ref_logp=exp.ref_logp if in_loss else None,
                              kl_loss_coef=self.kl_ctl.value if in_loss else 0.0)
        return loss

    def one_batch_critic_loss(self, model, parts: list[Experience]) -> torch.Tensor:
        """The value loss of a global batch as ONE micro-batch on one rank: the token mean over all
        action tokens of ``parts`` joined (see :meth:`one_batch_actor_loss`)."""
        exp = concat_rollouts(list(parts), self.pad)
        values = answer_values(model, exp.sequences, exp.attention_mask, exp.prompt_len)
        return core.critic_loss(values, exp.values, exp.returns, exp.action_mask, self.s.cliprange_value)[0]

    def first_pass(self, exp: Experience, stats: PooledStats) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """The first training forwards on a one-micro-batch buffer whose experience passes were deferred.

        The actor's (and critic's) training forwards give the old log-probs, entropy and values
        (detached: the same numbers the experience passes would give, so the ratio is exactly 1);
        :meth:`finish_experience` then fills the rest of ``exp``. Returns the forwards' ``logp``
        and ``values`` (with their graphs, for the first losses; both alive until the actor's
        backward) and the experience statistics.
        """
        logp, entropy = self.policy_logp(self.actor, exp, entropy=True)
        values = self.critic_values(exp) if self.critic is not None else None
        exp.logp, exp.entropy = logp.detach(), entropy.detach()
        exp.values = values.detach() if values is not None else None
        del entropy
        return logp, values, self.finish_experience(exp, stats)

    def train_actor(self, exp: Experience, normalizer: torch.Tensor, scale: float,
                    logp: torch.Tensor | None = None, token_stats: dict | None = None) -> dict:
        """One micro-step of the actor on ``exp`` (one micro-batch): the clipped policy loss
        (:func:`chatrl.rl.loss.policy_loss`, with the KL loss term under ``--kl_in loss``) divided by
        ``normalizer``, times ``scale`` for DeepSpeed. ``logp`` ``(B, A)``: the actor's log-probs
        from a forward already run on it (:meth:`first_pass`), else computed here. ``token_stats``:
        filled with the per-token ratio and clip flags when given."""
        if logp is None:
            logp = self.policy_logp(self.actor, exp)
        in_loss = self.s.kl_in == "loss"
        loss, stats = policy_loss(logp, exp.logp, exp.advantages, exp.action_mask, normalizer, self.loss,
                                  is_weights=exp.is_weights, ref_logp=exp.ref_logp if in_loss else None,
                                  kl_loss_coef=self.kl_ctl.value if in_loss else 0.0, token_stats=token_stats)
        self.actor.backward(loss * scale)
        self._step_engine(self.actor, "actor_grad_norm")
        self._after_actor_step()
        return {"actor_loss": loss.detach(), **stats}

    def _step_engine(self, engine, trace_key: str) -> None:
        """``engine.step()``; at an optimizer step with :attr:`trace` set, its gradient norm goes there."""
        boundary = self.trace is not None and engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            norm = engine.get_global_grad_norm()
            self.trace[trace_key].append(float(norm) if norm is not None else float("nan"))

    def train_critic(self, exp: Experience, values: torch.Tensor | None = None,
                     normalizer: torch.Tensor | None = None, scale: float = 1.0) -> dict:
        """One clipped value-loss micro-step of the critic on ``exp`` (one micro-batch): its share of the
        optimizer step's token mean (``normalizer``, the step's action-token count; ``None``: the
        micro-batch's own mean), times ``scale`` for DeepSpeed (:func:`chatrl.rl.loss.loss_scale`).
        ``values`` ``(B, A)`` as ``logp`` in :meth:`train_actor`."""
        if values is None:
            values = self.critic_values(exp)
        loss, stats = core.critic_loss(values, exp.values, exp.returns, exp.action_mask, self.s.cliprange_value,
                                       normalizer=normalizer)
        self.critic.backward(loss * scale)
        self._step_engine(self.critic, "critic_grad_norm")
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
    ``reward/mean``; ``kl`` only where there is a reference. Multi-turn episodes: ``answer_len`` counts sampled tokens, ``eos_rate`` is the
    share whose last turn ended, and ``episode/turns`` and ``episode/observation_len`` (tokens the
    environment appended) are added."""
    m = exp.action_mask
    answer = exp.sequences[:, exp.prompt_len:]
    stats.add_mean("reward/score_mean", exp.scores)
    stats.add_std("reward/score_std", exp.scores)
    for k, v in exp.reward_parts.items():
        stats.add_mean(k, v)
    if exp.kl is not None:  # None without a reference (a KL coefficient of 0)
        stats.add_mean("kl", (exp.kl * m).sum(dim=1))
    stats.add_mean("entropy", exp.entropy, m)
    stats.add_mean("answer_len", m.sum(dim=1).float())
    if exp.turns is None:
        stats.add_mean("eos_rate", core.has_stop_token(answer, m, stop_ids).float())
    else:
        stats.add_mean("eos_rate", last_token_stops(answer, m, stop_ids).float())
        stats.add_mean("episode/turns", exp.turns.float())
        stats.add_mean("episode/observation_len", (exp.attention_mask[:, exp.prompt_len:].float() - m.float()).sum(1))
    stats.add_weighted("kl_coef", float(kl_coef), 1.0)
    if exp.rewards is not None:
        stats.add_mean("reward/mean", (exp.rewards * m).sum(dim=1))
    if exp.values is not None:
        stats.add_explained_variance("explained_variance", exp.values, exp.returns, m)


def last_token_stops(answer: torch.Tensor, action_mask: torch.Tensor, stop_ids: list[int]) -> torch.Tensor:
    """``(B,)`` bool: the last action token of each row (``answer``, ``action_mask`` ``(B, A)``) is a
    stop token: an episode's last turn ended."""
    positions = torch.arange(answer.shape[1], device=answer.device)
    last = torch.where(action_mask > 0, positions, -1).amax(dim=1)
    tok = answer.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)
    return (last >= 0) & torch.isin(tok, torch.as_tensor(stop_ids, device=answer.device))
