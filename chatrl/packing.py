"""Padding-free batches: sequences laid end to end in rows, and every per-sequence quantity read back.

A padded batch computes ``B × T_max`` positions for ``sum(T_i)`` real tokens; on chat data a third of
them are padding (``docs/packing.md``). A *packed* batch lays the sequences end to end in a few rows
(:func:`pack`), each sequence with position ids that restart at 0, so that a causal LM sees each
sequence exactly as it would alone, provided attention does not cross from one sequence into the next:

* **position-id families** (Llama, Qwen2: :data:`POSITION_ID_FAMILIES`): transformers builds the
  block-diagonal causal mask itself from position ids that restart at 0 when no 2-D attention mask
  and no cache are passed (``masking_utils.find_packed_sequence_indices``); on GPUs
  flash-attention's variable-length path serves such rows without any mask;
* **block-mask families** (OPT: :data:`BLOCK_MASK_FAMILIES`): OPT's mask builder ignores position
  ids, so the rows get an explicit 4-D additive block-diagonal causal mask
  (:func:`block_diagonal_mask`) beside their per-sequence positions (with SDPA or eager attention).

Other families are refused by name (:func:`attention_style`): their parity with the padded path is
not tested.

Reading back: :class:`PackedRows` records each sequence's row, start and length; :meth:`PackedRows.slots`
gives the row and column of any window of each sequence (its answer tokens, its last token), so
that per-sequence quantities (an SFT loss over answer tokens, a reward model's end score, DPO's
per-answer log-probs, PPO's per-token log-probs and values) come out per sequence, in the order
the sequences were given, equal to the padded path's (``tests/unit/test_packing.py``).

Micro-batches by token budget (:func:`token_budget_groups`, :func:`split_to_count`): the examples of
one optimizer step are cut into consecutive groups of at most ``budget`` tokens instead of a fixed
count; every rank makes the same number of micro-batches (ZeRO-3 gathers parameters in every forward).

Pure tensor functions and index arithmetic: no model, no distributed calls (a cross-rank maximum is
passed in as a callable).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch

from chatrl.errors import UsageError
from chatrl.models.precision import FP32_SDPA

#: HF ``model_type`` s whose attention reads packed rows from restarting position ids (tested for parity).
POSITION_ID_FAMILIES = ("llama", "qwen2")
#: HF ``model_type`` s that need an explicit block-diagonal mask (tested for parity).
BLOCK_MASK_FAMILIES = ("opt",)
#: Attention implementations that take an explicit 4-D additive mask.
BLOCK_MASK_ATTENTION = ("sdpa", "eager", FP32_SDPA)

POSITION_IDS, BLOCK_MASK = "position_ids", "block_mask"


def attention_style(model_type: str | None, attn_implementation: str | None = None, what: str = "the model") -> str:
    """How packed rows are kept apart in attention for a model family: :data:`POSITION_IDS` or :data:`BLOCK_MASK`.

    Args:
        model_type: the HF config's ``model_type`` (``"llama"``, ``"opt"``, ...).
        attn_implementation: the config's ``_attn_implementation`` once the model is built (``None``:
            not known yet, not checked).
        what: how to name the model in an error (its path).

    Raises:
        UsageError: the family's parity with padded batches is not tested (naming it and the
            families that are), or OPT with an attention implementation that takes no 4-D mask.
    """
    if model_type in POSITION_ID_FAMILIES:
        return POSITION_IDS
    if model_type in BLOCK_MASK_FAMILIES:
        if attn_implementation is not None and attn_implementation not in BLOCK_MASK_ATTENTION:
            raise UsageError(f"--packing: {what} ({model_type}) needs an explicit block-diagonal mask, which the "
                             f"{attn_implementation!r} attention does not take; load it with attention "
                             f"{' or '.join(BLOCK_MASK_ATTENTION)}, or drop --packing")
        return BLOCK_MASK
    families = ", ".join(BLOCK_MASK_FAMILIES + POSITION_ID_FAMILIES)
    raise UsageError(f"--packing supports the model families {families} (tested to give the padded path's "
                     f"numbers); {what} is {model_type!r}: drop --packing for it")


@dataclass(frozen=True)
class Slots:
    """Positions in packed rows, one per (sequence, offset) pair, flattened to ``M`` entries.

    ``rows``, ``cols``: where each entry sits in the ``(R, W)`` rows; ``seq``: which sequence it
    belongs to (``0 .. N-1``, the order given to :func:`pack`); ``offset``: its index within the
    window asked for (``0 .. width_i - 1``). All ``(M,)`` long, sequence-major.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    seq: torch.Tensor
    offset: torch.Tensor

    def scatter(self, values: torch.Tensor, n_seqs: int, width: int) -> torch.Tensor:
        """``values (M, ...)`` placed at ``[seq, offset]`` of a zero ``(n_seqs, width, ...)`` tensor
        (differentiable; positions outside every window stay 0)."""
        out = values.new_zeros((n_seqs, width, *values.shape[1:]))
        return out.index_put((self.seq, self.offset), values)


@dataclass(frozen=True)
class PackedRows:
    """``N`` sequences laid end to end in ``R`` rows of width ``W`` (:func:`pack`).

    Attributes:
        input_ids: ``(R, W)`` long; the slots after a row's last sequence hold the pad id.
        position_ids: ``(R, W)`` long, ``0 .. length - 1`` along each sequence; 0 on the trailing pads.
        seq_ids: ``(R, W)`` long, the sequence at each slot (``0 .. N-1``), ``-1`` on the trailing pads.
        row, start, length: ``(N,)`` long: sequence ``i`` is ``input_ids[row[i], start[i] : start[i] + length[i]]``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    row: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor

    @property
    def n_seqs(self) -> int:
        """``N``, the number of sequences."""
        return int(self.length.shape[0])

    @property
    def tokens(self) -> int:
        """Positions the rows compute, ``R × W`` (real tokens plus the rows' trailing pads)."""
        return int(self.input_ids.numel())

    def to(self, device) -> PackedRows:
        """The same rows on ``device``."""
        return PackedRows(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def slots(self, offset: torch.Tensor | int, width: torch.Tensor | int) -> Slots:
        """The window ``[offset_i, offset_i + width_i)`` of every sequence ``i``, as :class:`Slots`.

        Args:
            offset, width: ``(N,)`` long or ints (the same for every sequence); ``width_i`` may be 0.

        Raises:
            ValueError: a window reaches outside its sequence.
        """
        n = self.n_seqs
        offset = torch.as_tensor(offset, dtype=torch.long, device=self.start.device).expand(n)
        width = torch.as_tensor(width, dtype=torch.long, device=self.start.device).expand(n)
        if n and (bool((offset < 0).any()) or bool((width < 0).any()) or bool((offset + width > self.length).any())):
            raise ValueError("PackedRows.slots: a window reaches outside its sequence")
        seq = torch.repeat_interleave(torch.arange(n, device=width.device), width)
        first = torch.cumsum(width, 0) - width
        pos = torch.arange(seq.numel(), device=width.device) - first[seq]
        return Slots(self.row[seq], self.start[seq] + offset[seq] + pos, seq, pos)

    def last_slots(self) -> Slots:
        """The last token of every sequence (where a reward model reads its end score)."""
        return self.slots(self.length - 1, 1)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``values (R, W, ...)`` at every slot → ``(N, max length, ...)``, each sequence left-aligned
        (as right padding would place it), zero beyond its length."""
        slots = self.slots(0, self.length)
        return slots.scatter(values[slots.rows, slots.cols], self.n_seqs, int(self.length.max()) if self.n_seqs else 0)


def pack(seqs: Sequence, pad_token_id: int, row_tokens: int = 0) -> PackedRows:
    """Lay ``seqs`` end to end in rows of at most ``max(row_tokens, longest sequence)`` tokens.

    Rows are filled first-fit in order of decreasing length (the longest sequences first; ties in
    the given order), so a row never holds more than its width, the attention cost of a row (whose
    mask is dense on a CPU) never exceeds that of one padded row of the longest sequence, and the
    trailing pads are few. The rows are as wide as the fullest one.

    Args:
        seqs: ``N >= 1`` 1-D sequences of token ids (tensors or lists), each at least one token long.
        pad_token_id: the id placed after each row's last sequence (never attended to by a real token).
        row_tokens: the row width to fill up to (0: the longest sequence's length).

    Returns:
        :class:`PackedRows` on the device of the first sequence; ``row``, ``start``, ``length`` are in
        the order of ``seqs``.

    Raises:
        ValueError: no sequences, an empty sequence, or a ``pad_token_id`` of None.
    """
    if pad_token_id is None:
        raise ValueError("pack: pad_token_id is None (prepare the tokenizer with chatrl.models.causal_lm.prepare_tokenizer)")
    ids = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in seqs]
    if not ids:
        raise ValueError("pack: no sequences to pack")
    lengths = [int(t.numel()) for t in ids]
    if min(lengths) < 1:
        raise ValueError("pack: every sequence needs at least one token")
    capacity = max(row_tokens, max(lengths))
    fill: list[int] = []
    place = [(0, 0)] * len(ids)
    for i in sorted(range(len(ids)), key=lambda k: -lengths[k]):
        r = next((r for r, used in enumerate(fill) if used + lengths[i] <= capacity), len(fill))
        if r == len(fill):
            fill.append(0)
        place[i] = (r, fill[r])
        fill[r] += lengths[i]
    width, device = max(fill), ids[0].device
    input_ids = torch.full((len(fill), width), pad_token_id, dtype=torch.long, device=device)
    position_ids = torch.zeros((len(fill), width), dtype=torch.long, device=device)
    seq_ids = torch.full((len(fill), width), -1, dtype=torch.long, device=device)
    for i, (t, (r, s)) in enumerate(zip(ids, place, strict=True)):
        input_ids[r, s:s + lengths[i]] = t
        position_ids[r, s:s + lengths[i]] = torch.arange(lengths[i], device=device)
        seq_ids[r, s:s + lengths[i]] = i
    row, start = (torch.tensor(v, dtype=torch.long, device=device) for v in zip(*place, strict=True))
    return PackedRows(input_ids, position_ids, seq_ids, row, start, torch.tensor(lengths, dtype=torch.long,
                                                                                  device=device))


def block_diagonal_mask(seq_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The additive 4-D attention mask of packed rows: each token sees the earlier tokens of its own sequence.

    ``mask[r, 0, q, k] = 0`` where ``seq_ids[r, k] == seq_ids[r, q] >= 0`` and ``k <= q``, and
    ``finfo(dtype).min`` elsewhere; a trailing pad (``seq_ids == -1``) sees only itself, so that
    no softmax row is empty. transformers passes a 4-D mask to SDPA and eager attention as it is.

    Args:
        seq_ids: ``(R, W)`` long (:attr:`PackedRows.seq_ids`).
        dtype: the model's compute dtype.

    Returns:
        ``(R, 1, W, W)`` of ``dtype``.
    """
    q, k = seq_ids.unsqueeze(-1), seq_ids.unsqueeze(-2)
    width = seq_ids.shape[-1]
    causal = torch.ones(width, width, dtype=torch.bool, device=seq_ids.device).tril()
    allowed = ((q == k) & (q >= 0) & causal) | torch.eye(width, dtype=torch.bool, device=seq_ids.device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=seq_ids.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def token_cost(lengths: Sequence[int], packed: bool) -> int:
    """Positions a micro-batch of sequences of ``lengths`` computes: their sum when packed, the
    count times the longest when padded."""
    return sum(lengths) if packed else len(lengths) * max(lengths, default=0)


def token_budget_groups(units: Sequence[Sequence[int]], budget: int, packed: bool) -> list[list[int]]:
    """Cut an optimizer step's examples into consecutive micro-batches of at most ``budget`` tokens.

    Greedy in the given order: a micro-batch takes the next example while its :func:`token_cost`
    stays within ``budget``; an example whose own cost exceeds the budget forms a micro-batch alone.

    Args:
        units: per example, the lengths of the sequences it contributes (one for an SFT example or
            a rollout; two for a preference pair, whose sides stay in one micro-batch).
        budget: tokens per micro-batch, > 0.
        packed: count packed tokens (sums) or padded ones (count × longest).

    Returns:
        Lists of example indices, in order, covering every example once.

    Raises:
        ValueError: ``budget <= 0``.
    """
    if budget <= 0:
        raise ValueError(f"token_budget_groups: budget must be > 0, got {budget}")
    groups: list[list[int]] = []
    lengths: list[int] = []
    for i, unit in enumerate(units):
        if groups and token_cost(lengths + list(unit), packed) <= budget:
            groups[-1].append(i)
            lengths += list(unit)
        else:
            groups.append([i])
            lengths = list(unit)
    return groups


def split_to_count(groups: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest groups in halves (first half first) until there are ``count`` of them.

    Every rank must run the same number of micro-batches (each forward of a ZeRO-3 model gathers
    parameters from every rank): a rank whose examples fit in fewer micro-batches than another's
    splits its own further. Order is kept.

    Raises:
        ValueError: ``count`` is below ``len(groups)`` or above the number of examples.
    """
    n = sum(len(g) for g in groups)
    if count < len(groups) or count > n:
        raise ValueError(f"split_to_count: cannot make {count} micro-batches of {len(groups)} groups, {n} examples")
    groups = [list(g) for g in groups]
    while len(groups) < count:
        j = max(range(len(groups)), key=lambda k: len(groups[k]))
        g = groups[j]
        groups[j:j + 1] = [g[:(len(g) + 1) // 2], g[(len(g) + 1) // 2:]]
    return groups


def micro_batch_groups(units: Sequence[Sequence[int]], per_micro_batch: int, max_tokens: int, packed: bool,
                       all_reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[list[int]]:
    """The micro-batches of one optimizer step's examples, as lists of example indices.

    ``max_tokens == 0``: consecutive groups of ``per_micro_batch`` examples (the last may be
    shorter), no collective. ``max_tokens > 0``: :func:`token_budget_groups`, then as many on every
    rank as on the rank that needs most (:func:`split_to_count`; ``all_reduce_max`` takes the
    maximum over ranks, ``None`` for one rank: every rank must call it then).
    """
    if not max_tokens:
        return [list(range(i, min(i + per_micro_batch, len(units)))) for i in range(0, len(units), per_micro_batch)]
    groups = token_budget_groups(units, max_tokens, packed)
    if all_reduce_max is not None:
        groups = split_to_count(groups, int(all_reduce_max(torch.tensor(float(len(groups))))))
    return groups


def pack_rollouts(sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, pad_token_id: int,
                  row_tokens: int = 0) -> tuple[PackedRows, Slots]:
    """Step-3 rollouts as packed rows of their real tokens, and the slots whose outputs belong to the answer.

    A rollout in the experience layout is a left-padded prompt of width ``P`` followed by its answer,
    right-padded to width ``A`` (its mask there is the action mask: the answer up to and including
    its first stop token). Packed, rollout ``b`` is its ``p_b`` real prompt tokens then its ``a_b``
    answer tokens; slot ``(b, j)`` of the returned :class:`Slots` is the position just before answer
    token ``j``, whose logits predict that token and whose value is V(state before token ``j``):
    the packed counterpart of column ``P - 1 + j`` of the padded rows.

    Args:
        sequences, attention_mask: ``(B, P + A)`` (:class:`chatrl.step3_ppo.trainer.Experience`).
        prompt_len: ``P``. pad_token_id, row_tokens: as :func:`pack`.

    Returns:
        ``(packed, slots)``: ``B`` sequences; ``slots`` of ``sum(a_b)`` entries, ``slots.offset`` the
        answer column ``j``.

    Raises:
        ValueError: a rollout without a prompt token, or whose answer mask is not a prefix.
    """
    mask = attention_mask > 0
    prompt, answer = mask[:, :prompt_len].sum(-1), mask[:, prompt_len:].sum(-1)
    if bool((prompt < 1).any()):
        raise ValueError("pack_rollouts: a rollout has no prompt token")
    if mask.shape[1] > prompt_len and bool((mask[:, prompt_len:].long().cumsum(-1).gather(-1, (answer - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
             != answer).any()):
        raise ValueError("pack_rollouts: an answer's mask is not a prefix of its answer columns")
    packed = pack([s[m] for s, m in zip(sequences, mask, strict=True)], pad_token_id, row_tokens)
    return packed, packed.slots(prompt - 1, answer)
