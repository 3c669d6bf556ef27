"""The inference copy of the actor: a plain HF model, LoRA merged, optionally tensor-parallel.

:class:`InferenceCopy` holds a second instance of the actor's HF class whose weights are filled
from the training module:

* the skeleton is built on the ``meta`` device, sharded with ``parallelize_module`` while still
  empty (no full-size tensor is ever allocated for it), then materialised with ``to_empty``;
* :meth:`InferenceCopy.refresh` walks the training module in groups of decoder layers, gathers
  each group's ZeRO-3 partitions (a collective over all ranks), adds the LoRA delta
  ``scaling · B @ A`` to every adapted weight, and copies each rank's slice into its shard;
* buffers (rotary ``inv_freq`` and the like) are copied as they are; they are never partitioned.

The copy never registers with DeepSpeed, so its forward passes run no ZeRO hooks and no
collectives besides the tensor-parallel all-reduces.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time

import torch

from chatrl.distributed.weights import gathered
from chatrl.hybrid_engine.tp_plan import (
    SUPPORTED_FAMILIES,
    decoder_layers,
    family_of,
    shard_head_counts,
    tp_plan,
)
from chatrl.models.causal_lm import base_model
from chatrl.models.precision import compute_in_fp32, computes_in_fp32

log = logging.getLogger(__name__)


def _source_tensor(src_module: torch.nn.Module, leaf: str) -> torch.Tensor:
    """The inference value of parameter ``leaf`` of ``src_module``: base weight plus LoRA delta.

    ``src_module`` is the training module at the same path as the inference module; for a peft
    LoRA layer the weight lives in ``base_layer`` and the active, unmerged adapters add
    ``get_delta_weight``. Must be called while the module's parameters are gathered.
    """
    base = getattr(src_module, "base_layer", None)
    if base is None:
        return getattr(src_module, leaf).detach()
    value = getattr(base, leaf).detach()
    if leaf != "weight" or getattr(src_module, "merged", False) or getattr(src_module, "disable_adapters", False):
        return value
    adapters = [a for a in src_module.active_adapters if a in getattr(src_module, "lora_A", {})]
    if not adapters:
        return value
    value = value.clone()
    for adapter in adapters:
        value += src_module.get_delta_weight(adapter).to(value.dtype)
    return value


class _RowParallelReduce:
    """Forward hook of a row-parallel linear: sum the partial outputs over the group, then add the bias.

    The bias is held here instead of in the module, so that it is added once, after the sum.
    """

    def __init__(self, bias: torch.Tensor | None, group):
        self.bias = bias
        self.group = group

    def __call__(self, module, inputs, output):
        torch.distributed.all_reduce(output, group=self.group)
        if self.bias is not None:
            output += self.bias
        return output


def localize(model: torch.nn.Module, group) -> dict[str, tuple]:
    """Turn a ``parallelize_module``-sharded model into plain local shards plus explicit all-reduces.

    DTensor dispatch costs about a millisecond per sharded linear on a CPU, more than the
    arithmetic of one decoding step of a small model, so decoding runs on the local shards:
    column-parallel linears need no communication (their input is replicated, their output is
    this rank's heads / FFN slice); row-parallel ones get a :class:`_RowParallelReduce` hook.
    The placements are returned (``{parameter name: placements}``) to slice full weights later.

    Call it on a materialised model (after ``to_empty``); it removes the DTensor input/output
    hooks that ``parallelize_module`` installed.
    """
    from torch.distributed.tensor import DTensor, Shard

    placements: dict[str, tuple] = {}
    for mod_name, module in model.named_modules():
        params = {k: p for k, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
        if not params:
            continue
        module._forward_pre_hooks.clear()
        module._forward_hooks.clear()
        for leaf, p in params.items():
            placements[f"{mod_name}.{leaf}" if mod_name else leaf] = tuple(p.placements)
            module._parameters[leaf] = torch.nn.Parameter(p.to_local(), requires_grad=False)
        weight_place = placements.get(f"{mod_name}.weight" if mod_name else "weight")
        if weight_place is not None and weight_place[0] == Shard(1):  # row-parallel: input dim split
            bias = module._parameters.pop("bias", None)
            module.register_parameter("bias", None)
            if bias is not None:
                hook_bias = torch.nn.Parameter(bias.detach(), requires_grad=False)
                module.tp_bias = hook_bias
            module.register_forward_hook(_RowParallelReduce(getattr(module, "tp_bias", None), group))
    return placements


def release_host_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``; else no-op)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class InferenceCopy:
    """A tensor-parallel, LoRA-merged HF copy of a training module.

    Args:
        train_module: the actor's HF causal LM as DeepSpeed holds it (maybe a peft ``PeftModel``,
            maybe ZeRO-3 partitioned).
        device: where the copy lives (the training device).
        tp_mesh: a 1-D ``DeviceMesh`` over this rank's tensor-parallel group, or ``None`` for TP 1.
        group_size: decoder layers gathered per ZeRO-3 all-gather (``--tp_gather_partition_size``).

    Raises:
        ValueError: the model's family is not supported, or the TP size does not divide its heads.
    """

    def __init__(self, train_module: torch.nn.Module, device: torch.device, tp_mesh=None, group_size: int = 8):

        self.source = base_model(train_module)
        if family_of(self.source) is None:
            raise ValueError(f"hybrid engine does not serve model_type {self.source.config.model_type!r}")
        if group_size < 1:
            raise ValueError(f"--tp_gather_partition_size must be >= 1, got {group_size}")
        self.device = device
        self.tp_mesh = tp_mesh
        self.tp_size = tp_mesh.size() if tp_mesh is not None else 1
        self.group_size = group_size
        self.model = self._build_skeleton()

    def _build_skeleton(self) -> torch.nn.Module:
        src = self.source
        dtype = next(src.parameters()).dtype
        with torch.device("meta"):
            model = type(src)._from_config(src.config, dtype=dtype)
        model.eval().requires_grad_(False)
        self.placements: dict[str, tuple] = {}
        if self.tp_size > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            plan = tp_plan(model, self.tp_size)
            parallelize_module(model, self.tp_mesh, plan, src_data_rank=None)
            shard_head_counts(model, self.tp_size)
            model.to_empty(device=self.device)
            self.placements = localize(model, self.tp_mesh.get_group())
        else:
            model.to_empty(device=self.device)
        if computes_in_fp32(src.get_output_embeddings()):  # --fp32_lm_head: decoding's head in float32 too
            compute_in_fp32(model.get_output_embeddings())
        return model

    def _groups(self) -> list[list[str]]:
        """Module-name prefixes per gather group: everything outside the layers, then layer groups."""
        layers_path = SUPPORTED_FAMILIES[family_of(self.source)]
        n = len(decoder_layers(self.source))
        layer_names = [f"{layers_path}.{i}" for i in range(n)]
        groups = [layer_names[i:i + self.group_size] for i in range(0, n, self.group_size)]
        return [[""]] + groups

    def refresh(self) -> tuple[float, float]:
        """Copy the current training weights (LoRA merged) into the shards.

        Every rank of the job must call it together (ZeRO-3 gathers are collectives).

        Returns:
            ``(gather_s, shard_s)``: seconds spent in ZeRO-3 all-gathers and in merging / slicing /
            copying into the inference copy.
        """
        gather_s = shard_s = 0.0
        layers_path = SUPPORTED_FAMILIES[family_of(self.source)]
        for prefixes in self._groups():
            names = self._param_names(prefixes, layers_path)
            src_params = self._source_params(names)
            t0 = time.perf_counter()
            with gathered(src_params):
                t1 = time.perf_counter()
                with torch.no_grad():
                    for name, target in names:
                        self._fill(name, target)
                t2 = time.perf_counter()
            gather_s += (t1 - t0) + (time.perf_counter() - t2)
            shard_s += t2 - t1
        with torch.no_grad():
            for name, buf in self.model.named_buffers():
                buf.copy_(self.source.get_buffer(name))
        return gather_s, shard_s

    def _param_names(self, prefixes: list[str], layers_path: str) -> list[tuple[str, torch.Tensor]]:
        """``(name, inference tensor)`` of the parameters in a gather group (tied ones listed once per name)."""
        out = []
        for name, p in self.model.named_parameters(remove_duplicate=False):
            in_layers = name.startswith(layers_path + ".")
            if prefixes == [""]:
                if not in_layers:
                    out.append((name, p))
            elif any(name.startswith(pre + ".") for pre in prefixes):
                out.append((name, p))
        return out

    def _source_params(self, names: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Every training parameter (base and LoRA) feeding the inference parameters ``names``."""
        params, seen = [], set()
        for name, _ in names:
            mod_name = name.rsplit(".", 1)[0]
            for p in self.source.get_submodule(mod_name).parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def _fill(self, name: str, target: torch.Tensor) -> None:
        mod_name, leaf = name.rsplit(".", 1)
        leaf = "bias" if leaf == "tp_bias" else leaf  # a row-parallel bias, moved into its reduce hook
        full = _source_tensor(self.source.get_submodule(mod_name), leaf).to(self.device)
        placement = self.placements.get(f"{mod_name}.{leaf}")
        if placement is not None:
            from torch.distributed.tensor import distribute_tensor

            full = distribute_tensor(full, self.tp_mesh, placement, src_data_rank=None).to_local()
        if full.shape != target.shape:
            raise RuntimeError(f"{name}: training slice {tuple(full.shape)} != inference {tuple(target.shape)}")
        target.copy_(full)

    def release(self) -> None:
        """Drop the inference weights and return the freed memory to the OS."""
        self.model = None
        release_host_memory()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
