"""The hybrid engine: switch the actor between its training layout and a fast inference layout.

See ``docs/hybrid_engine.md`` for the design and measured figures. In short, around generation:
gather the ZeRO-3 partitions a group of layers at a time, merge LoRA, shard over the
tensor-parallel group (``torch.distributed.tensor.parallel``), decode with a preallocated KV cache
(:mod:`chatrl.hybrid_engine.decode`), and on exit free the copy if asked to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from chatrl.config import HybridEngineConfig, SamplingConfig
from chatrl.distributed.dist import all_reduce_sum, cpu_threads_per_rank, local_world_size
from chatrl.evidence.weight_version import WeightFingerprint, WeightStamp
from chatrl.hybrid_engine.decode import GenerationSettings, TPGroup, decode, gather_prompts
from chatrl.hybrid_engine.inference_copy import InferenceCopy, release_host_memory
from chatrl.hybrid_engine.tp_plan import check_tp_size, family_of
from chatrl.logprobs import logprobs_from_logits
from chatrl.models.causal_lm import base_model, sampling_settings, stop_token_ids

log = logging.getLogger(__name__)


@dataclass
class Sampler:
    """What step 3's trainer samples rollouts with (:meth:`HybridEngine.sampler`).

    ``generate(ids (B, P), mask (B, P)) -> (sequences (B, P + A), sampler_logp (B, A))``;
    ``sampling``: the distribution it draws from (``--temperature``, ``--top_k``, ``--top_p``), which
    the trainer's log-probs score (:attr:`chatrl.config.SamplingConfig.scored`); ``session``: a
    context manager factory inside which several calls share one inference layout (a multi-turn
    rollout), or None; ``weights``: the source of weight stamps (``sampler_stamp()``, the weights of
    the last generation, and ``training_stamp()``, the actor's now), or None: no stamps.
    """

    generate: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    session: Callable[[], contextlib.AbstractContextManager] | None = None
    weights: object | None = None

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.generate(ids, mask)


class HybridEngineFallbackWarning(UserWarning):
    """The actor's model family is not served by the hybrid engine; plain generation is used."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _has_lora(module: torch.nn.Module) -> bool:
    return hasattr(module, "peft_config") or any("lora_" in n for n, _ in module.named_parameters())


@contextlib.contextmanager
def native_linear():
    """Run with torch's own ``F.linear`` while inside the block.

    Partitioning a model for ZeRO-3 replaces ``torch.nn.functional.linear`` process-wide with
    DeepSpeed's memory-saving autograd function ("persists unless manually reset"); the inference
    copy is not partitioned, needs no autograd, and that function fails under ``inference_mode``.
    """
    import torch.nn.functional as F

    try:
        from deepspeed.runtime.zero.partition_parameters import (
            InsertPostInitMethodToModuleSubClasses as Patcher,
        )
    except ImportError:  # DeepSpeed absent: nothing was patched
        yield
        return
    original = getattr(Patcher, "linear_bk", None)
    if original is None or F.linear is original:
        yield
        return
    patched, F.linear = F.linear, original
    try:
        yield
    finally:
        F.linear = patched


def _eos_list(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


class HybridEngine:
    """Generation for a DeepSpeed-wrapped actor, in a layout built for decoding.

    Args:
        actor_engine: a ``deepspeed.DeepSpeedEngine`` whose ``.module`` is an HF causal LM, possibly
            a peft ``PeftModel`` with LoRA adapters, under ZeRO stage 0–3.
        settings: the hybrid engine's block (:class:`chatrl.config.HybridEngineConfig`):
            ``enable_hybrid_engine``: off, :meth:`generate` is HF ``generate`` on the training module
            (``synced_gpus`` under ZeRO-3 so that ranks finishing early keep serving gathers);
            ``inference_tp_size``: ranks per tensor-parallel group, which must divide the world size,
            the attention (and KV) head counts and the FFN width; ``tp_gather_partition_size``: decoder
            layers per ZeRO-3 all-gather; ``release_inference_cache``: free the inference copy on
            :meth:`exit_inference` (otherwise it is kept and refreshed in place);
            ``debug_stale_weights`` (testing): once built, the inference copy is never refreshed,
            although its version follows the actor's optimizer steps, as a sync that silently fails
            would leave it; step 3's weight-version check must stop the run.
        num_threads: intra-op CPU threads per rank while generating; default: this process's CPUs
            divided by the ranks on the node. Ignored on CUDA.
        pin_threads: pin each rank to its own CPUs while generating (CPU only; default on when the
            node has a CPU per thread of every rank).

    Every :meth:`generate` stamps the weights it generated with (:meth:`sampler_stamp`: their
    version and checksum, read from the model that decoded, :mod:`chatrl.evidence.weight_version`);
    :meth:`training_stamp` reads the same of the training weights.

    Attributes:
        timings: seconds of the last ``gather`` (ZeRO-3 all-gathers), ``shard`` (building the copy,
            merging LoRA, slicing and copying shards), ``generate`` (prompt exchange and decoding) and
            ``release`` (freeing the copy).

    Raises:
        ValueError: ``inference_tp_size`` < 1, not dividing the world size, or not dividing the
            model's heads / FFN width.

    Every rank must call :meth:`enter_inference` and :meth:`generate` together (the weight gather is
    a collective over all ranks; decoding is collective within each tensor-parallel group).
    """

    def __init__(self, actor_engine, settings: HybridEngineConfig, *, num_threads: int | None = None,
                 pin_threads: bool | None = None):

        self.engine = actor_engine
        self.module = actor_engine.module
        self.hf = base_model(self.module)
        self.zero_stage = int(actor_engine.zero_optimization_stage())
        self.rank, self.world_size = _world()
        self.settings = settings
        self.tp_size = settings.inference_tp_size
        if self.tp_size < 1 or self.world_size % self.tp_size:
            raise ValueError(f"--inference_tp_size {self.tp_size} must be >= 1 and divide the world size "
                             f"{self.world_size}")
        self.device = next(self.module.parameters()).device
        self.family = family_of(self.hf)
        self.enabled = settings.enable_hybrid_engine and self.family is not None
        if settings.enable_hybrid_engine and self.family is None:
            warnings.warn(f"hybrid engine does not serve model_type {self.hf.config.model_type!r} "
                          f"(served: opt, llama, qwen2, mistral); generating with plain HF generate on the "
                          f"training layout instead", HybridEngineFallbackWarning, stacklevel=2)
        self.timings: dict[str, float] = {"gather": 0.0, "shard": 0.0, "generate": 0.0, "release": 0.0}
        self._direct = self.enabled and self.zero_stage < 3 and self.tp_size == 1 and not _has_lora(self.module)
        self._copy: InferenceCopy | None = None
        self._in_inference = False
        self._weights_step: int | None = None
        self._was_training = False
        self._tp_mesh = None
        self._group = TPGroup()
        if self.enabled and self.tp_size > 1:
            check_tp_size(self.hf, self.tp_size)
            self._tp_mesh, self._group = self._make_tp_group()
        self._threads, self._cpus = self._thread_plan(num_threads, pin_threads)
        self.fingerprint = WeightFingerprint(self.module)
        self._stamp: WeightStamp | int | None = None  # an int: the version of training weights not read yet

    # ------------------------------------------------------------------ layout
    def _make_tp_group(self):
        from torch.distributed.device_mesh import init_device_mesh

        device_type = self.device.type
        mesh = init_device_mesh(device_type, (self.world_size // self.tp_size, self.tp_size),
                                mesh_dim_names=("dp", "tp"))["tp"]
        return mesh, TPGroup(mesh.get_group())

    def _thread_plan(self, num_threads, pin_threads) -> tuple[int, list[int] | None]:
        if self.device.type != "cpu":
            return 0, None
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        local_world = local_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        threads = num_threads or cpu_threads_per_rank()
        if pin_threads is None:
            pin_threads = threads * local_world <= len(cpus)
        mine = cpus[local_rank * threads:(local_rank + 1) * threads] if pin_threads else None
        return threads, (mine or None)

    @contextlib.contextmanager
    def _placement(self):
        """Threads (and CPU pinning) for this rank while generating; restored afterwards."""
        if not self._threads:
            yield
            return
        prev_threads = torch.get_num_threads()
        prev_cpus = os.sched_getaffinity(0) if self._cpus else None
        torch.set_num_threads(self._threads)
        if self._cpus:
            os.sched_setaffinity(0, self._cpus)
        try:
            yield
        finally:
            torch.set_num_threads(prev_threads)
            if prev_cpus:
                os.sched_setaffinity(0, prev_cpus)

    def _is_stale(self) -> bool:
        if self._direct:
            return False
        # One signal: the actor engine's optimizer-step count (a skipped step changes no weight).
        return self._copy is None or self._weights_step != self.engine.global_steps

    @contextlib.contextmanager
    def inference(self):
        """``with hybrid.inference(): hybrid.generate(...)``: the inference layout inside the block,
        the training layout after it (with ``release_inference_cache`` the copy is freed on exit,
        ``timings["release"]``). Collective over all ranks under ZeRO-3."""
        self.enter_inference()
        try:
            yield self
        finally:
            self.exit_inference()

    @property
    def threads_per_rank(self) -> int:
        """Intra-op CPU threads this rank uses while generating (0: left as they are, e.g. on CUDA)."""
        return self._threads

    @property
    def in_inference(self) -> bool:
        """Whether the inference layout is entered."""
        return self._in_inference

    def enter_inference(self) -> None:
        """Switch to the inference layout: build or refresh the inference copy if needed.

        A no-op when already entered with fresh weights. Collective over all ranks under ZeRO-3.
        """
        if not self.enabled:
            self._in_inference = True
            return
        if self._direct:
            if not self._in_inference:
                self._was_training = self.module.training
                self.module.eval()
            self.timings.update(gather=0.0, shard=0.0)
            self._in_inference = True
            return
        if not self._is_stale() or (self.settings.debug_stale_weights and self._copy is not None):
            self.timings.update(gather=0.0, shard=0.0)
            self._weights_step = self.engine.global_steps  # (the testing switch: a version that lies)
            self._in_inference = True
            return
        shard_s = 0.0
        if self._copy is None:
            t0 = time.perf_counter()
            self._copy = InferenceCopy(self.module, self.device, self._tp_mesh,
                                       self.settings.tp_gather_partition_size)
            shard_s += time.perf_counter() - t0
        gather_s, fill_s = self._copy.refresh()
        self.timings.update(gather=gather_s, shard=shard_s + fill_s)
        self._weights_step = self.engine.global_steps
        self._in_inference = True

    def exit_inference(self) -> None:
        """Return to the training layout; with ``release_inference_cache`` free the inference copy."""
        t0 = time.perf_counter()
        if self._direct and self._in_inference and self._was_training:
            self.module.train()
        if self.settings.release_inference_cache and self._copy is not None:
            self._copy.release()
            self._copy = None
        elif self.settings.release_inference_cache:
            release_host_memory()
        self._in_inference = False
        self.timings["release"] = time.perf_counter() - t0

    # -------------------------------------------------------------- generation
    def _settings(self, max_new_tokens, sampling: SamplingConfig | None, eos_token_id, pad_token_id,
                  min_new_tokens) -> GenerationSettings:
        gen_cfg = getattr(self.hf, "generation_config", None)
        if eos_token_id is None:
            eos_token_id = getattr(gen_cfg, "eos_token_id", None)
            if eos_token_id is None:
                eos_token_id = self.hf.config.eos_token_id
        eos = _eos_list(eos_token_id)
        if pad_token_id is None:
            pad_token_id = getattr(gen_cfg, "pad_token_id", None)
            if pad_token_id is None:
                pad_token_id = self.hf.config.pad_token_id
            if pad_token_id is None:
                pad_token_id = eos[0] if eos else 0
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        drawn = {"temperature": 1.0, "top_k": 0, "top_p": 1.0,  # greedy: the warpers are not applied
                 **(sampling_settings(sampling.temperature, sampling.top_k or 0, sampling.top_p)
                    if sampling is not None else {"do_sample": False})}
        return GenerationSettings(
            max_new_tokens=int(max_new_tokens), eos_token_ids=eos, pad_token_id=int(pad_token_id),
            min_new_tokens=int(min_new_tokens or 0), **drawn)

    def generate(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 sampling: SamplingConfig | None = None, eos_token_id=None, pad_token_id=None, min_new_tokens: int = 0,
                 generator: torch.Generator | None = None, output_logits: bool = False,
                 output_logprobs: bool = False):
        """Generate continuations of left-padded prompts.

        Args:
            input_ids: ``(B, P)`` token ids, left-padded. attention_mask: ``(B, P)``, 1 on real tokens.
            max_new_tokens: tokens to generate (equal on every rank of a tensor-parallel group).
            sampling: ``--temperature``, ``--top_k``, ``--top_p`` (:class:`chatrl.config.SamplingConfig`,
                as HF ``generate``'s; ``top_k=0``/``top_p=1`` disable the filters, ``temperature=0`` is
                greedy decoding: :func:`chatrl.models.causal_lm.sampling_settings`); ``None``: greedy decoding.
            min_new_tokens: as in HF ``generate``.
            eos_token_id: an id or a list of ids ending an answer; ``None`` takes the model's.
            pad_token_id: filler after EOS; ``None`` takes the model's.
            generator: RNG for sampling on the engine path (the global RNG when ``None``).
            output_logits: also return the raw logits of every decoding step.
            output_logprobs: also return the sampler's log-prob of each sampled token under the
                distribution it was drawn from (the fp32 scores after temperature, top-k and top-p),
                ``(B, max_new_tokens)``, 0 after generation stopped (step 3's ``rollout/logp_diff``); computed by the training
                forward's formula (:func:`chatrl.logprobs.logprobs_from_logits`), so that
                the gap measures the forward passes only, not two ways of normalising.

        Returns:
            ``(B, P + max_new_tokens)`` token ids: the prompts, then the new tokens, right-padded with
            ``pad_token_id`` after EOS or after generation stopped. With ``output_logits``, a pair
            ``(sequences, logits)`` with ``logits`` ``(B, steps, vocab)`` fp32. With
            ``output_logprobs`` (and not ``output_logits``), ``(sequences, logprobs)``.

        Raises:
            ValueError: bad ``max_new_tokens``, sampling settings or shapes.
        """
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} must both be (B, P)")
        s = self._settings(max_new_tokens, sampling, eos_token_id, pad_token_id, min_new_tokens)
        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        if not self.enabled:
            self._stamp = int(self.engine.global_steps)  # the training weights: read when asked
            with self._placement():
                out = self._plain_generate(input_ids, attention_mask, s, output_logits, output_logprobs)
            if not output_logprobs:
                return out
            sequences, logits = out  # with output_logprobs: the processed scores
            steps = logits.shape[1]
            new = sequences[:, input_ids.shape[1]:input_ids.shape[1] + steps]
            logprobs = torch.zeros(new.shape[0], s.max_new_tokens, dtype=torch.float32, device=new.device)
            logprobs[:, :steps] = logprobs_from_logits(logits, new)
            return sequences, logprobs
        if not self._in_inference or self._is_stale():
            self.enter_inference()
        model = self.hf if self._direct else self._copy.model
        t0 = time.perf_counter()
        with self._placement(), native_linear(), torch.inference_mode():
            batch = gather_prompts(input_ids, attention_mask, self._group, s.pad_token_id, s.max_new_tokens)
            tokens, logits, *logprobs = decode(model, batch, s, self._group, generator=generator,
                                               keep_logits=output_logits, keep_logprobs=output_logprobs)
        sequences = torch.cat([input_ids, tokens], dim=1)
        self.timings["generate"] = time.perf_counter() - t0
        # the training weights (direct path) are read when asked; the copy now (it may be freed on exit)
        self._stamp = int(self.engine.global_steps) if self._direct else self._copy_stamp()
        if output_logprobs:
            return sequences, logprobs[0]
        return (sequences, logits) if output_logits else sequences

    def sampler(self, max_new_tokens: int, sampling: SamplingConfig, tokenizer) -> Sampler:
        """Step 3's rollout sampler on this engine: :meth:`generate` with ``max_new_tokens``
        (``--max_answer_seq_len``), ``sampling`` and the tokenizer's stop ids
        (:func:`chatrl.models.causal_lm.stop_token_ids`) and pad id bound, returning ``(sequences, sampler
        log-probs of the sampled tokens)``, run inside :meth:`inference` so that training always runs
        in the training layout (and ``release_inference_cache`` frees the copy after every rollout).
        A multi-turn rollout generates every turn inside one :attr:`Sampler.session` (one switch of
        layout per rollout, not one per turn). The engine is the sampler's stamp source."""
        stops, pad = stop_token_ids(tokenizer), tokenizer.pad_token_id

        def turn(ids, mask):
            return self.generate(ids, mask, max_new_tokens=max_new_tokens, sampling=sampling, eos_token_id=stops,
                                 pad_token_id=pad, output_logprobs=True)

        def generate(ids, mask):
            if self.in_inference:  # inside a session (a multi-turn rollout)
                return turn(ids, mask)
            with self.inference():
                return turn(ids, mask)

        return Sampler(generate, sampling, session=self.inference, weights=self)

    # ------------------------------------------------------------------ weight stamps
    def training_stamp(self) -> WeightStamp:
        """The version (optimizer steps) and checksum of the actor's training weights now (a collective
        under ZeRO-3: every rank calls it)."""
        checksum, bound = self.fingerprint.training(all_reduce_sum if self.world_size > 1 else None)
        return WeightStamp(int(self.engine.global_steps), checksum, bound)

    def _copy_stamp(self) -> WeightStamp:
        group = self._group

        def tp_sum(t: torch.Tensor) -> torch.Tensor:
            out = t.to(self.device)
            dist.all_reduce(out, group=group.group)
            return out.cpu()

        checksum = self.fingerprint.of_copy(self._copy.model, self._copy.placements, group.index, group.size,
                                            tp_sum if group.size > 1 else None)
        return WeightStamp(int(self._weights_step), checksum)

    def sampler_stamp(self) -> WeightStamp:
        """The stamp of the weights the last :meth:`generate` decoded with, read from the model that
        decoded: the inference copy (read when it generated), or the training module on the plain and
        direct paths (its version taken when it generated, its checksum read now: a collective under
        ZeRO-3, so every rank calls it, before the actor's next optimizer step).

        Raises:
            RuntimeError: nothing was generated yet.
        """
        if self._stamp is None:
            raise RuntimeError("sampler_stamp: nothing was generated yet")
        if isinstance(self._stamp, int):
            now = self.training_stamp()
            return WeightStamp(self._stamp, now.checksum, now.bound)
        return self._stamp

    def _plain_generate(self, input_ids, attention_mask, s: GenerationSettings, output_logits: bool,
                        output_scores: bool = False):
        """HF ``generate`` on the training module (ZeRO-3: synced decoding so no rank hangs); with
        ``output_logits`` also the raw logits of every step, with ``output_scores`` the processed scores
        (after temperature, top-k, top-p: the distribution each token was drawn from)."""
        t0 = time.perf_counter()
        was_training = self.module.training
        self.module.eval()
        kwargs = dict(max_new_tokens=s.max_new_tokens, min_new_tokens=s.min_new_tokens, do_sample=s.do_sample,
                      eos_token_id=list(s.eos_token_ids) or None, pad_token_id=s.pad_token_id,
                      synced_gpus=self.zero_stage == 3 and self.world_size > 1)
        if s.do_sample:
            kwargs.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        if output_logits or output_scores:
            kwargs.update(output_logits=output_logits, output_scores=output_scores, return_dict_in_generate=True)
        try:
            with torch.no_grad():
                out = self.module.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        finally:
            self.module.train(was_training)
        sequences = out.sequences if output_logits or output_scores else out
        total = input_ids.shape[1] + s.max_new_tokens
        if sequences.shape[1] < total:
            fill = sequences.new_full((sequences.shape[0], total - sequences.shape[1]), s.pad_token_id)
            sequences = torch.cat([sequences, fill], dim=1)
        self.timings.update(gather=0.0, shard=0.0, release=0.0, generate=time.perf_counter() - t0)
        if output_scores:
            return sequences, torch.stack([x.float() for x in out.scores], dim=1)
        if output_logits:
            return sequences, torch.stack([x.float() for x in out.logits], dim=1)
        return sequences
