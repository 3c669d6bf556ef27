"""Step 3's multi-turn episodes: up to ``--max_turns`` assistant turns per episode, generated one
turn at a time by the hybrid engine, with the environment's observations appended between turns
(``docs/multi_turn.md``).

Token-in/token-out: an episode's ids are only ever appended to. The prompt is the ids of the
environment's opening turns (:func:`chatrl.data.turns.encode_conversation`); an assistant turn is
the ids the model sampled, through its first stop token, with the sampler's log-probs; an
observation is :func:`chatrl.data.turns.observation_ids` of the environment's new turns. The
assistant text given to the environment is decoded from the sampled ids and never tokenized
again. The trained mask is 1 on sampled ids only.

An episode ends when the environment says ``done`` (or returns no observation), when a turn does
not end with the end-of-turn token (``--max_answer_seq_len`` reached, or another stop token such as
ChatML's ``<|endoftext|>``: the model ended the conversation, and an observation after it would
break the layout), after ``--max_turns`` turns, or when the next observation and one more token
would exceed ``--max_total_tokens`` (the episode's prompt, turns and observations).

Generation is collective on some layouts (tensor-parallel groups, ZeRO-3 without the hybrid
engine), so every rank generates while any rank has an unfinished episode (a rank with none feeds
one finished episode again and drops the result), and an environment failure on one rank is an
:class:`~chatrl.envs.base.EnvError` on every rank: one all-reduce of two flags per turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from chatrl.data.examples import left_cut
from chatrl.data.turns import ConversationIds, encode_conversation, observation_ids
from chatrl.envs.base import EnvError, EnvFactory, check_messages_out, check_step
from chatrl.sizes import EpisodePlan

AllReduce = Callable[[torch.Tensor], torch.Tensor]
Generate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Episode:
    """One episode's state: its environment, turns, ids (with the trained mask), sampler log-probs
    (one per id, 0 off sampled ids) and the reward of each step."""

    env: object
    messages: list[dict]
    ids: ConversationIds
    prompt_len: int
    logp: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    infos: list[dict] = field(default_factory=list)
    done: bool = False
    ended: bool = True  # the last turn ended with a stop token
    error: str | None = None


@dataclass
class EpisodeBatch:
    """A rank's episodes as tensors. ``B`` episodes, prompt width ``P``, answer-region width ``A``
    (turns and observations after the prompt).

    Attributes:
        sequences: ``(B, P + A)`` ids, prompts left-padded, regions right-padded with the pad id.
        attention_mask: ``(B, P + A)``, 1 on every real id (observations included).
        action_mask: ``(B, A)``, 1 on sampled ids only (the trained mask).
        sampler_logp: ``(B, A)`` the sampler's log-prob of each sampled id, 0 elsewhere.
        turn_rewards: ``(B, A)`` each step's reward but the last at its turn's last id, 0 elsewhere.
        final_rewards: ``(B,)`` the last step's reward. turns: ``(B,)`` assistant turns.
        ended: ``(B,)`` bool: the last turn ended with a stop token.
        prompt_len: ``P``. prompts: ``B`` opening-turn lists. answers: ``B`` last assistant texts.
        messages: ``B`` full conversations (for logs and the report).
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    sampler_logp: torch.Tensor
    turn_rewards: torch.Tensor
    final_rewards: torch.Tensor
    turns: torch.Tensor
    ended: torch.Tensor
    prompt_len: int
    prompts: list[list[dict]]
    answers: list[str]
    messages: list[list[dict]]


def episode_seed(step: int, rank: int, index: int) -> int:
    """The ``seed`` of an episode's row: a function of the training step, the rank and the row."""
    return (step * 1_000_003 + rank * 10_007 + index) % (2 ** 31)


def _start(make_env: EnvFactory, row: dict, tokenizer, max_prompt_len: int, where: str) -> Episode:
    env = make_env()
    opening = check_messages_out(env.reset(row), f"{where}: reset", observation=False)
    ids = encode_conversation(tokenizer, opening, generation_prompt=True).ids
    cut = left_cut(ids, max_prompt_len, tokenizer.bos_token_id) or ids[-max_prompt_len:]
    conv = ConversationIds()
    conv.append(cut, trained=False)
    return Episode(env, opening, conv, len(cut), logp=[0.0] * len(cut))


def _left_padded(rows: Sequence[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def _take_turn(e: Episode, tokens: list[int], logps: list[float], stops: set[int], eot: int, max_total_tokens: int,
               last_turn: bool, tokenizer, where: str) -> None:
    """Append one sampled turn to ``e``, ask the environment, and append its observation (or end ``e``)."""
    cut = next((i + 1 for i, t in enumerate(tokens) if t in stops), None)
    ended = cut is not None
    goes_on = ended and tokens[cut - 1] == eot
    tokens, logps = tokens[:cut], logps[:cut]
    room = max_total_tokens - len(e.ids.ids)
    if len(tokens) > room:
        tokens, logps, ended, goes_on = tokens[:room], logps[:room], False, False
    e.ids.append(tokens, trained=True)
    e.logp += logps
    e.ended = ended
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    e.messages.append({"role": "assistant", "content": text})
    new, reward, done, info = check_step(e.env.step([dict(m) for m in e.messages], text), f"{where}: step")
    e.rewards.append(reward)
    e.infos.append(info)
    if done or new is None or not goes_on or last_turn:
        e.done = True
        return
    obs = observation_ids(tokenizer, e.messages, new)
    if len(e.ids.ids) + len(obs) + 1 > max_total_tokens:
        e.done = True  # no room for one more sampled token after the observation
        e.infos[-1] = {**info, "truncated": "max_total_tokens"}
        return
    e.messages += new
    e.ids.append(obs, trained=False)
    e.logp += [0.0] * len(obs)


def _agree(flags: list[float], all_reduce_sum: AllReduce | None, device) -> list[float]:
    t = torch.tensor(flags, dtype=torch.float32, device=device)
    return (all_reduce_sum(t) if all_reduce_sum is not None else t).tolist()


@dataclass(frozen=True)
class Episodes:
    """Step 3's multi-turn episodes (``--env``): the environment's factory, one instance per episode
    (:func:`chatrl.envs.load_environment`), and the episodes' sizes (:func:`chatrl.sizes.plan_episodes`)."""

    make_env: EnvFactory
    plan: EpisodePlan


def run_episodes(generate: Generate, tokenizer, episodes: Episodes, rows: Sequence[dict], *,
                 stop_ids: Sequence[int], device, all_reduce_sum: AllReduce | None = None, rank: int = 0,
                 step: int = 0) -> EpisodeBatch:
    """Play one episode per row (module docstring). A collective: every rank calls it.

    Args:
        generate: ``generate(ids (b, W), mask (b, W)) -> (sequences (b, W + T), sampler_logp (b, T))``,
            one assistant turn of at most ``T`` tokens (the hybrid engine's, inside its inference layout).
        episodes: the environment and the sizes: ``max_turns`` assistant turns per episode (>= 1), the
            opening turns' ids cut from the left to ``max_prompt_len``, ``max_total_tokens`` the bound
            on an episode's ids.
        rows: ``{"messages", "metadata", "seed"}`` per episode (:mod:`chatrl.envs.base`).
        stop_ids: ids that end a turn (:func:`chatrl.models.causal_lm.stop_token_ids`), the end-of-turn token
            first: only a turn that ends with it is followed by an observation.
        all_reduce_sum: sums a tensor over ranks (``None``: one rank). rank, step: for messages.

    Raises:
        EnvError: an environment raised or returned something wrong, on this or another rank
            (on every rank; the failing one chains its error).
    """
    make_env, plan = episodes.make_env, episodes.plan
    max_turns, max_prompt_len, max_total_tokens = plan.max_turns, plan.max_prompt_len, plan.max_total_tokens
    where = f"--env {getattr(make_env, 'spec', 'environment')} (rank {rank}, step {step})"
    stops, eot, pad = set(int(i) for i in stop_ids), int(stop_ids[0]), tokenizer.pad_token_id
    played: list[Episode] = []
    error: BaseException | None = None
    try:
        played = [_start(make_env, row, tokenizer, max_prompt_len, where) for row in rows]
    except Exception as exc:  # noqa: BLE001 - every failure must reach the collective below
        error = exc
    turn = 0
    while True:  # every rank takes the same number of passes: the active count is global
        active = [e for e in played if not e.done] if error is None else []
        n_active, failed = _agree([float(len(active)), float(error is not None)], all_reduce_sum, device)
        if failed:
            if error is not None:
                raise EnvError(f"{where}: {type(error).__name__}: {error}") from error
            raise EnvError(f"{where}: the environment failed on another rank; see its error")
        if n_active == 0:
            break
        feed = active or played[:1]
        ids, mask = _left_padded([e.ids.ids for e in feed], pad, device)
        seq, logp = generate(ids, mask)
        new, logp = seq[:, ids.shape[1]:].tolist(), logp.float().tolist()
        try:
            for e, tokens, lp in zip(active, new, logp, strict=False):
                _take_turn(e, tokens, lp[:len(tokens)], stops, eot, max_total_tokens, turn == max_turns - 1,
                           tokenizer, where)
        except Exception as exc:  # noqa: BLE001 - as above
            error = exc
        turn += 1
    return _to_batch(played, pad, device)


def _to_batch(episodes: list[Episode], pad: int, device) -> EpisodeBatch:
    P = max(e.prompt_len for e in episodes)
    A = max(len(e.ids.ids) - e.prompt_len for e in episodes)
    B = len(episodes)
    seq = torch.full((B, P + A), pad, dtype=torch.long)
    att = torch.zeros((B, P + A), dtype=torch.long)
    act, logp, turn_r = torch.zeros(B, A), torch.zeros(B, A), torch.zeros(B, A)
    for b, e in enumerate(episodes):
        ids, n, p = e.ids.ids, len(e.ids.ids), e.prompt_len
        seq[b, P - p:P - p + n] = torch.tensor(ids, dtype=torch.long)
        att[b, P - p:P - p + n] = 1
        act[b, :n - p] = torch.tensor(e.ids.trained[p:], dtype=torch.float32)
        logp[b, :n - p] = torch.tensor(e.logp[p:], dtype=torch.float32)
        for (_, end), r in zip(e.ids.turns[:-1], e.rewards[:-1], strict=False):
            turn_r[b, end - 1 - p] = r
    return EpisodeBatch(
        seq.to(device), att.to(device), act.to(device), logp.to(device), turn_r.to(device),
        torch.tensor([e.rewards[-1] if e.rewards else 0.0 for e in episodes], device=device),
        torch.tensor([len(e.ids.turns) for e in episodes], device=device),
        torch.tensor([e.ended for e in episodes], device=device), P,
        [[m for m in e.messages[:_opening(e)]] for e in episodes],
        [next((m["content"] for m in reversed(e.messages) if m["role"] == "assistant"), "") for e in episodes],
        [list(e.messages) for e in episodes])


def _opening(e: Episode) -> int:
    return next((i for i, m in enumerate(e.messages) if m["role"] == "assistant"), len(e.messages))
