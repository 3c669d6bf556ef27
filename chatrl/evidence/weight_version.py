"""Which weights made a rollout: the actor's version and a cheap checksum of its effective weights.

Step 3 samples with one copy of the actor (the hybrid engine's inference copy, or the training
module itself) and trains another. A sync that silently fails leaves the sampler on old weights:
nothing crashes, the reward stays flat. So every rollout carries a :class:`WeightStamp` of the
weights that generated it, read from the generating model, and the trainer compares it with the
stamp of the weights it trains (:class:`WeightVersionCheck`) before learning from the rollouts.

A stamp is ``(version, checksum, bound)``:

* ``version``: the actor's optimizer-step count (``engine.global_steps``) when the weights were
  taken;
* ``checksum``: ``sum_k c_k w_k`` in float64 over a fixed sample of ``K`` elements ``w_k`` of the
  actor's *effective* weights (a LoRA layer's ``W + scaling · B @ A``), with fixed coefficients
  ``c_k`` in ``[0.5, 1.5]``; the sample (:class:`WeightFingerprint`) is drawn once, from the
  decoder's linear layers (their LoRA layers when the actor has adapters: the weights that move);
* ``bound``: how far two reads of the same weights may differ: 0 for a plain copy (every element
  is copied bit for bit), the rounding of the LoRA merge otherwise
  (``sum_k c_k (r + 4) eps (|W| + scaling sum_r |B A|)``).

Reading costs ``K`` element reads and, when the weights are partitioned (ZeRO-3) or
tensor-parallel, one all-reduce of ``K`` (or fewer) numbers; nothing is gathered.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chatrl.distributed.dist import get_rank
from chatrl.models.causal_lm import base_model

#: Linear layers sampled, and elements per layer.
SAMPLE_LAYERS = 16
ELEMENTS_PER_LAYER = 4


class WeightVersionError(RuntimeError):
    """Rollouts made by other weights than the ones the trainer holds (a stale sampler)."""


@dataclass(frozen=True)
class WeightStamp:
    """The weights a rollout was generated with, or the trainer holds (module docstring).

    Attributes:
        version: actor optimizer steps taken when the weights were read.
        checksum: float64 checksum of the sampled effective weights.
        bound: largest difference two reads of the same weights may show (LoRA merge rounding).
    """

    version: int
    checksum: float
    bound: float = 0.0

    @property
    def digest(self) -> str:
        """A short hex form of the checksum (12 characters), for messages and records."""
        return hashlib.sha1(repr(float(self.checksum)).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class _Element:
    module: str  # the Linear layer's name in the HF model (the inference copy's name too)
    row: int
    col: int
    coef: float


def _is_lora_linear(module) -> bool:
    base = getattr(module, "base_layer", None)
    return isinstance(base, torch.nn.Linear) and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))


def _linear_layers(hf: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of the effective linear layers of an HF model (LoRA layers as one), in name order;
    the LM head and embeddings are left out (tied, vocabulary-sharded, rarely trained with LoRA)."""
    out = []
    for name, mod in hf.named_modules():
        if ".base_layer" in name or "lora_" in name or name.endswith("lm_head"):
            continue  # a LoRA layer's inner linears are read through the layer
        if _is_lora_linear(mod):
            use_dora = getattr(mod, "use_dora", {})
            if not any(use_dora.get(a, False) for a in getattr(mod, "active_adapters", [])):
                out.append((name, mod))
        elif isinstance(mod, torch.nn.Linear):
            out.append((name, mod))
    return out


class WeightFingerprint:
    """A fixed sample of a model's effective weights and two ways of reading it (module docstring).

    Args:
        train_module: the actor as DeepSpeed trains it (maybe peft-wrapped, maybe ZeRO-3
            partitioned); the sample is drawn from its linear layers, once.
        seed: of the sample's positions and coefficients.

    The sample is a list of ``(layer name, row, column, coefficient)``; a layer name is the same in
    the training module (under peft's wrapper) and in a plain HF copy of it.
    """

    def __init__(self, train_module: torch.nn.Module, seed: int = 0):
        self.hf = base_model(train_module)
        layers = _linear_layers(self.hf)
        lora = [(n, m) for n, m in layers if _is_lora_linear(m)]
        pool = lora or layers
        g = torch.Generator().manual_seed(seed)
        picks = ([pool[round(i * (len(pool) - 1) / max(SAMPLE_LAYERS - 1, 1))] for i in range(SAMPLE_LAYERS)]
                 if len(pool) > SAMPLE_LAYERS else pool)
        elements = []
        for name, mod in dict(picks).items():
            weight = mod.base_layer.weight if _is_lora_linear(mod) else mod.weight
            rows, cols = _shape(weight)
            for _ in range(ELEMENTS_PER_LAYER):
                r = int(torch.randint(rows, (1,), generator=g))
                c = int(torch.randint(cols, (1,), generator=g))
                elements.append(_Element(name, r, c, 0.5 + float(torch.rand(1, generator=g))))
        self.elements = elements

    def __len__(self) -> int:
        return len(self.elements)

    # ------------------------------------------------------------------ training layout
    def training(self, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[float, float]:
        """``(checksum, bound)`` of the training module's effective weights now.

        ZeRO-3 partitions are read where they live (each rank its own part; ``all_reduce_sum`` adds
        them up: a collective, every rank calls it; ``None`` with one rank or whole weights). A
        LoRA layer's element is ``W[r, c] + scaling · sum_i B[r, i] A[i, c]`` over its active,
        unmerged adapters (``fan_in_fan_out`` layers transpose the delta), as peft merges it.
        """
        reads: list[tuple[torch.Tensor, int]] = []  # (parameter, flat index)
        plan = []
        for e in self.elements:
            mod = self.hf.get_submodule(e.module)
            if not _is_lora_linear(mod):
                plan.append((e, len(reads), []))
                reads.append((mod.weight, e.row * _shape(mod.weight)[1] + e.col))
                continue
            base = mod.base_layer.weight
            plan_e = (e, len(reads), [])
            reads.append((base, e.row * _shape(base)[1] + e.col))
            if not (getattr(mod, "merged", False) or getattr(mod, "disable_adapters", False)):
                fan_in_fan_out = getattr(mod, "fan_in_fan_out", False)
                out_i, in_j = (e.col, e.row) if fan_in_fan_out else (e.row, e.col)
                for adapter in mod.active_adapters:
                    if adapter not in mod.lora_A:
                        continue
                    a, b = mod.lora_A[adapter].weight, mod.lora_B[adapter].weight  # (r, in), (out, r)
                    rank = _shape(a)[0]
                    a_idx, b_idx = len(reads), len(reads) + rank
                    reads += [(a, k * _shape(a)[1] + in_j) for k in range(rank)]
                    reads += [(b, out_i * rank + k) for k in range(rank)]
                    plan_e[2].append((a_idx, b_idx, rank, float(mod.scaling[adapter])))
            plan.append(plan_e)
        values, partitioned = _read_elements(reads)
        if partitioned and all_reduce_sum is not None:
            values = all_reduce_sum(values)
        checksum = bound = 0.0
        dtype = reads[0][0].dtype if reads else torch.float32
        eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
        for e, i, adapters in plan:
            w = float(values[i])
            total, size = w, abs(w)
            for a_idx, b_idx, rank, scaling in adapters:
                prods = values[a_idx:a_idx + rank] * values[b_idx:b_idx + rank]
                total += scaling * float(prods.sum())
                size += abs(scaling) * float(prods.abs().sum())
                bound += e.coef * (rank + 4) * eps * size
            checksum += e.coef * total
        return checksum, bound

    # ------------------------------------------------------------------ a plain (or TP) copy
    def of_copy(self, model: torch.nn.Module, placements: dict | None = None, tp_rank: int = 0, tp_size: int = 1,
                all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
        """The checksum of a plain HF model of the actor's class (the hybrid engine's inference copy,
        LoRA merged), maybe tensor-parallel: ``placements`` maps ``"layer.weight"`` to its DTensor
        placements (``Shard(0)``: rows split, ``Shard(1)``: columns split, in ``tp_size`` chunks of
        ``ceil(n / tp_size)``); each TP rank reads the elements it holds and ``all_reduce_sum``
        (over the TP group: a collective of the group) adds them up.
        """
        values = torch.zeros(len(self.elements), dtype=torch.float64)
        for k, e in enumerate(self.elements):
            w = model.get_submodule(e.module).weight
            r, c = e.row, e.col
            placement = (placements or {}).get(f"{e.module}.weight")
            dim = _shard_dim(placement) if tp_size > 1 else None
            if dim is None:
                if tp_rank == 0 or tp_size == 1:
                    values[k] = float(w[r, c])
                continue
            full = (r, c)[dim]
            chunk = int(w.shape[dim])  # the engine's plans split evenly (heads and FFN widths divide by TP)
            if full // chunk == tp_rank:
                local = (full - tp_rank * chunk, c) if dim == 0 else (r, full - tp_rank * chunk)
                values[k] = float(w[local])
        if tp_size > 1 and all_reduce_sum is not None:
            values = all_reduce_sum(values)
        return float(sum(e.coef * float(v) for e, v in zip(self.elements, values, strict=True)))


def _shard_dim(placement) -> int | None:
    if not placement:
        return None
    dim = getattr(placement[0], "dim", None)
    return int(dim) if dim is not None else None


def _read_elements(reads: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, bool]:
    """The flat elements ``reads`` as float64; ZeRO-3 parameters from this rank's partition (0 where
    another rank holds the element). Returns ``(values, any_partitioned)``; with partitioned
    parameters, whole ones are read on rank 0 only, so that a sum over ranks counts them once."""
    partitioned = any(hasattr(p, "ds_tensor") for p, _ in reads)
    rank = get_rank() if partitioned else 0
    device = next((p.ds_tensor.device if hasattr(p, "ds_tensor") else p.device for p, _ in reads), torch.device("cpu"))
    values = torch.zeros(len(reads), dtype=torch.float64, device=device)
    with torch.no_grad():
        for k, (p, idx) in enumerate(reads):
            if hasattr(p, "ds_tensor"):
                part = p.ds_tensor
                size = part.ds_numel if hasattr(part, "ds_numel") else part.numel()
                lo = rank * size
                if lo <= idx < lo + size:
                    values[k] = part.view(-1)[idx - lo].double()
            elif rank == 0:
                values[k] = p.detach().reshape(-1)[idx].double()
    return values, partitioned


class WeightVersionCheck:
    """The trainer's side: every rollout's stamp against the stamp of the weights it trains.

    :meth:`check` raises :class:`WeightVersionError` (on every rank) at the first buffer with a
    rollout whose version differs from the trainer's, or whose checksum is further from the
    trainer's than both stamps' bounds allow. ``rollouts``, ``max_gap``, ``versions`` and
    ``failure`` summarise the run for the certificate.
    """

    def __init__(self):
        self.rollouts = 0
        self.max_gap = 0.0
        self.max_bound = 0.0
        self.versions: list[int] = []
        self.failure: str | None = None

    def state_dict(self) -> dict:
        """What a checkpoint keeps (JSON): the rollouts checked, the largest gap and bound, the versions."""
        return {"rollouts": self.rollouts, "max_gap": self.max_gap, "max_bound": self.max_bound,
                "versions": self.versions}

    def load_state_dict(self, saved: dict) -> None:
        """Continue from :meth:`state_dict` (a resumed run)."""
        self.rollouts, self.max_gap = int(saved.get("rollouts", 0)), float(saved.get("max_gap", 0.0))
        self.max_bound, self.versions = float(saved.get("max_bound", 0.0)), list(saved.get("versions", []))

    def check(self, versions: torch.Tensor, checksums: torch.Tensor, expected: WeightStamp, step: int,
              all_reduce_sum: Callable | None = None, all_reduce_max: Callable | None = None,
              bound: float = 0.0) -> None:
        """Compare the stamps of one buffer's rollouts with ``expected`` (the trainer's weights).

        Args:
            versions: ``(B,)`` each rollout's weight version. checksums: ``(B,)`` float64.
            expected: the trainer's stamp. step: the training step (for the message).
            all_reduce_sum, all_reduce_max: cross-rank reductions (collectives; ``None``: one rank).
            bound: the sampler's stamp bound (the larger of it and ``expected.bound`` is allowed).

        Raises:
            WeightVersionError: naming the property, the versions, the checksums and the gap.
        """
        with torch.no_grad():
            gap = (checksums.double().cpu() - expected.checksum).abs()
            stale = (versions.cpu() != expected.version)
            allowed = max(bound, expected.bound)
            bad = stale | (gap > allowed)
            counts = torch.tensor([float(bad.sum()), float(len(versions))], dtype=torch.float64)
            worst = torch.tensor([float(gap.max()) if len(gap) else 0.0, allowed], dtype=torch.float64)
            first = int(bad.nonzero()[0, 0]) if bad.any() else -1
            if all_reduce_sum is not None:
                counts = all_reduce_sum(counts)
                worst = all_reduce_max(worst)
        n_bad, n = int(counts[0]), int(counts[1])
        self.rollouts += n
        self.max_gap = max(self.max_gap, float(worst[0]))
        self.max_bound = max(self.max_bound, float(worst[1]))
        if expected.version not in self.versions:
            self.versions.append(expected.version)
        if n_bad:
            if first >= 0:
                seen = WeightStamp(int(versions[first]), float(checksums[first]))
                which = (f"rollout {first} of rank {get_rank()} was generated by weights of version {seen.version} "
                         f"(checksum {seen.checksum:.12g}, {seen.digest})")
            else:
                which = "rollouts of another rank were generated by other weights"
            self.failure = (f"certificate: weight version failed at step {step}: {n_bad} of {n} rollouts were not "
                            f"generated by the weights the trainer holds; {which}, the trainer holds version "
                            f"{expected.version} (checksum {expected.checksum:.12g}, {expected.digest}); largest "
                            f"checksum gap {float(worst[0]):.3g} > bound {float(worst[1]):.3g}. The sampler's weights "
                            "are stale: the inference copy was not refreshed after an optimizer step")
            raise WeightVersionError(self.failure)
