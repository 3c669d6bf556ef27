"""The reference model of DPO: where ``log π_ref`` of a batch comes from.

One object answers :meth:`ReferenceLogps.logps` for a :class:`~chatrl.step2_dpo.batch.DPOCollator`
batch, whichever of the set-ups :func:`build_reference` chose:

* ``copy``: a frozen copy of the starting model (a deep copy of the policy as loaded, so that rows
  added for a ``<pad>`` token are the same in both, whatever their initialisation), wrapped
  by DeepSpeed without an optimizer (ZeRO-3 partitions it across ranks when the policy runs
  ZeRO-3, ``--offload_reference_model`` keeps its partitions in CPU memory); always in eval mode,
  ``requires_grad`` off.
* ``adapters_disabled``: with LoRA and ``--only_optimize_lora`` the base weights never change, so
  the reference is the policy itself inside peft's ``disable_adapter()`` context: no second copy.
  (Without ``--only_optimize_lora`` the base weights train too, DeepSpeed-Chat's semantics, and a
  frozen copy is needed.)
* ``precomputed``: ``--precompute_ref_log_probs`` runs the reference once over the training and
  eval pairs before training, keeps the ``(N, 2)`` table of log-probs (a few bytes per pair) and
  frees the reference.
* ``none``: reference-free losses (SimPO).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from chatrl.config import LoraConfig, ZeroConfig
from chatrl.distributed.dist import all_reduce_sum, eval_batches, frozen_engine
from chatrl.models.causal_lm import lora_enabled
from chatrl.sizes import BatchSizes
from chatrl.step2_dpo.batch import batch_answer_logps, split_pairs
from chatrl.step2_dpo.loss import DPOConfig

log = logging.getLogger(__name__)


@torch.no_grad()
def batch_logps(model, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logps (2B,), n_tokens (2B,))`` of a DPO batch's answers under ``model``, padded or packed
    (:func:`chatrl.step2_dpo.batch.batch_answer_logps`), without gradients."""
    return batch_answer_logps(model, batch, device)


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module):
    """``module`` in eval mode (no dropout) for the block, then back to its previous mode."""
    was = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was)


class ReferenceLogps:
    """Reference log-probs of DPO batches. ``kind`` is ``copy``, ``adapters_disabled``,
    ``precomputed`` or ``none``; ``engine`` is the frozen copy's DeepSpeed engine (``copy`` only)."""

    def __init__(self, kind: str, device, engine=None, policy=None):
        self.kind, self.device, self.engine, self.policy = kind, device, engine, policy
        self.tables: dict[str, torch.Tensor] = {}

    def logps(self, batch: dict, split: str = "train") -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(chosen (B,), rejected (B,))`` reference log-probs (float32, on ``device``), or None
        for ``none``. ``split`` names the precomputed table (``train`` / ``eval``)."""
        if self.kind == "none":
            return None
        if self.kind == "precomputed":
            table = self.tables[split][batch["index"]]
            return table[:, 0].to(self.device), table[:, 1].to(self.device)
        if self.kind == "copy":
            logps, _ = batch_logps(self.engine, batch, self.device)
        else:  # the policy with its LoRA adapters switched off, without dropout
            with eval_mode(self.policy.module), self.policy.module.disable_adapter():
                logps, _ = batch_logps(self.policy, batch, self.device)
        return split_pairs(logps)

    def precompute(self, split: str, dataset, collate, batch_size: int, rank: int, world: int) -> None:
        """Fill the ``split`` table ``(len(dataset), 2)`` (chosen, rejected) from this reference.

        Each rank scores its shard (every rank the same number of batches, as ZeRO-3 needs), and
        the shards are summed over ranks. Every rank must call it.
        """
        table = torch.zeros(len(dataset), 2, dtype=torch.float64)
        for batch, real in eval_batches(dataset, collate, batch_size, rank, world):
            chosen, rejected = self.logps(batch)
            idx = batch["index"][real]
            table[idx, 0] = chosen.double().cpu()[real]
            table[idx, 1] = rejected.double().cpu()[real]
        self.tables[split] = all_reduce_sum(table).float()

    def release(self) -> None:
        """Switch to the precomputed tables and drop the reference model (frees the copy's memory)."""
        self.kind, self.engine = "precomputed", None


def reference_kind(settings: DPOConfig, lora: LoraConfig) -> str:
    """``none`` (reference-free loss), ``adapters_disabled`` (LoRA with ``--only_optimize_lora``) or
    ``copy``; decide it before LoRA wraps the policy (a copy is taken of the bare model)."""
    if settings.reference_free:
        return "none"
    if lora_enabled(lora) and lora.only_optimize_lora:
        return "adapters_disabled"
    if lora_enabled(lora):
        log.info("LoRA without --only_optimize_lora trains the base weights too: the reference is a frozen copy")
    return "copy"


def build_reference(kind: str, zero: ZeroConfig, dtype: str, initial_model, policy_engine, batch: BatchSizes,
                    info) -> ReferenceLogps:
    """The reference of ``kind`` (:func:`reference_kind`; see the module docstring).

    Args:
        zero: the program's ZeRO block (the policy's stage, ``--offload_reference_model``,
            ``--partition_frozen_models``). dtype: ``--dtype``.
        initial_model: for ``copy``, a deep copy of the policy taken right after loading (before
            LoRA and DeepSpeed); it becomes the frozen reference. Ignored otherwise.
        policy_engine: the policy's DeepSpeed engine (its module is peft-wrapped with LoRA).
        batch: :class:`~chatrl.sizes.BatchSizes` (the inference engine's config needs them).
    """
    if kind != "copy":
        return ReferenceLogps(kind, info.device, policy=policy_engine if kind == "adapters_disabled" else None)
    model = initial_model
    model.requires_grad_(False)
    model.eval()
    engine = frozen_engine(model, zero.zero_stage, batch, dtype, zero.partition_frozen_models,
                           zero.offload_reference_model)
    engine.eval()
    return ReferenceLogps("copy", info.device, engine=engine)
