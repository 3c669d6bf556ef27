"""Loading actors, tokenizers and LoRA adapters.

Everything here is a thin layer over ``transformers`` and ``peft``: the model families, generation
and tokenization are theirs. What chatrl adds is the tokenizer set-up that keeps RLHF correct
(a pad token distinct from EOS; ``docs/tokenization.md``) and DeepSpeed-Chat's LoRA flag semantics.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from chatrl.config import LoraConfig, PackingConfig
from chatrl.errors import UsageError
from chatrl.logprobs import IGNORE_INDEX
from chatrl.models.precision import attention_kwargs, compute_in_fp32
from chatrl.packing import BLOCK_MASK, PackedRows, attention_style, block_diagonal_mask

log = logging.getLogger(__name__)

PAD_TOKEN = "<pad>"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """Map a ``--dtype`` value (``fp32``, ``bf16``, ``fp16``) to a torch dtype. Raises ValueError."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def vocab_size_for(tokenizer, multiple: int = 8) -> int:
    """Embedding rows needed for ``tokenizer``: ``len(tokenizer)`` rounded up to ``multiple``."""
    n = len(tokenizer)
    return (n + multiple - 1) // multiple * multiple


def prepare_tokenizer(tokenizer, padding_side: str = "right"):
    """Give ``tokenizer`` a pad token distinct from EOS, in place, and return it.

    A tokenizer without a pad token, or whose pad equals its EOS (GPT-2, Llama, Qwen2 ship so),
    gets ``<pad>`` added as a special token. Masks in chatrl always come from ``attention_mask``;
    a distinct pad id is a second line of defence for code outside chatrl (collators, HF
    generation) that compares ids with ``pad_token_id``.

    Raises:
        ValueError: the tokenizer has no EOS token (answers could not be terminated).
    """
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token; chatrl needs one to end answers")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    tokenizer.padding_side = padding_side
    return tokenizer


def _load_error(path: str, what: str, err: Exception) -> OSError:
    """An error naming ``path`` for a failed ``from_pretrained`` (for a missing local folder,
    transformers only complains about hub repo ids): FileNotFoundError when nothing exists at
    ``path``, else OSError."""
    detail = f"{type(err).__name__}: {str(err).strip()}"
    if not os.path.exists(path):
        return FileNotFoundError(f"{what} path not found: {path} is not a local folder, and loading it as a hub "
                                 f"name failed ({detail})")
    return OSError(f"cannot load a {what} from {path} ({detail})")


class MissingTokenizerError(UsageError, FileNotFoundError):
    """A local model folder without the files a tokenizer is loaded from."""


#: The files a tokenizer is built from, by kind (one of these must be in a model folder).
TOKENIZER_FILES = {"tokenizer.json": "tokenizer.json (fast tokenizer)",
                   "tokenizer.model": "tokenizer.model (SentencePiece)", "spiece.model": "spiece.model (SentencePiece)",
                   "vocab.json": "vocab.json with merges.txt (BPE)", "vocab.txt": "vocab.txt (WordPiece)",
                   "tiktoken.model": "tiktoken.model"}


def check_tokenizer_files(path: str) -> None:
    """Refuse a local folder that holds no tokenizer files, naming what is missing and what is there
    (transformers' own message, "You need to have sentencepiece or tiktoken installed …", blames the
    environment). Hub names and folders with a tokenizer pass.

    Raises:
        MissingTokenizerError: naming the folder, the files looked for and the files found.
    """
    folder = Path(path)
    if not folder.is_dir():
        return
    names = {p.name for p in folder.iterdir()}
    if any(n.endswith(".tiktoken") for n in names) or any(
            n in names and (n != "vocab.json" or "merges.txt" in names) for n in TOKENIZER_FILES):
        return
    partial = " (vocab.json is there, merges.txt is not)" if "vocab.json" in names else ""
    found = ", ".join(sorted(names)) or "nothing"
    raise MissingTokenizerError(
        f"{path} holds no tokenizer files: none of {', '.join(TOKENIZER_FILES.values())}{partial}; it holds "
        f"{found}. Copy the tokenizer files of the model it was made from into it (with tokenizer_config.json and "
        "special_tokens_map.json when there are any), or give that model's folder")


def load_tokenizer(path: str, padding_side: str = "right", trust_remote_code: bool = False):
    """Load a tokenizer from a hub name or local folder and :func:`prepare_tokenizer` it.

    Raises:
        FileNotFoundError: ``path`` does not exist locally and is not loadable from the hub (names it).
        MissingTokenizerError: ``path`` is a folder without tokenizer files (names the files).
        OSError: ``path`` holds tokenizer files that do not load (names it).
    """
    from transformers import AutoTokenizer

    check_tokenizer_files(path)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _load_error(path, "model/tokenizer", err) from err
    setattr(tok, DECLARED_EOS_ATTR, declared_eos_ids(path, trust_remote_code))
    return prepare_tokenizer(tok, padding_side)


#: Attribute of a tokenizer loaded by :func:`load_tokenizer` holding the stop ids its model folder declares.
DECLARED_EOS_ATTR = "declared_eos_token_ids"


def _ids(value) -> list[int]:
    """An ``eos_token_id`` value (None, an int or a list of ints) as a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def declared_eos_ids(path: str, trust_remote_code: bool = False) -> list[int]:
    """The ids a model folder (or hub name) declares as ending generation: its generation config's
    ``eos_token_id`` (an id or a list; stories260K declares ``[2, 1]``: it ends a story with BOS),
    then its config's. Empty when neither can be read (a tokenizer-only folder)."""
    from transformers import AutoConfig, GenerationConfig

    ids: list[int] = []
    for load in (lambda: GenerationConfig.from_pretrained(path),
                 lambda: AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)):
        try:
            cfg = load()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        ids += _ids(getattr(cfg, "eos_token_id", None))
    return list(dict.fromkeys(ids))


def fit_embeddings(model, tokenizer) -> None:
    """Resize ``model``'s embeddings to cover ``tokenizer`` (multiple of 8) and record its special ids.

    Only grows the matrix: a model whose vocabulary already covers the tokenizer keeps its size
    (OPT's checkpoints carry spare rows). ``config.pad_token_id`` is set to the tokenizer's pad id,
    and the generation config's EOS ids to :func:`stop_token_ids` of the tokenizer and the model:
    the end-of-turn token, the tokenizer's EOS and every id the model already declares (so plain
    ``generate`` on the model, and on its export, stops where chatrl's generation stops).
    """
    need = len(tokenizer)
    have = model.get_input_embeddings().weight.shape[0]
    if have < need:
        model.resize_token_embeddings(vocab_size_for(tokenizer), pad_to_multiple_of=8)
    model.config.pad_token_id = tokenizer.pad_token_id
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        stops = stop_token_ids(tokenizer, model)
        gen.pad_token_id = tokenizer.pad_token_id
        gen.eos_token_id = stops[0] if len(stops) == 1 else stops


def load_chat_lm(path: str, dtype: str, device, trust_remote_code: bool = False, tokenizer=None):
    """A saved causal LM for generation, as the chats load it: weights in ``dtype``, the attention the
    trainer used on ``device``'s type (:func:`chatrl.models.precision.attention_kwargs`: fp32 on CPU for bf16),
    moved to ``device``, in eval mode.

    Args:
        path: HF folder or hub name. dtype: ``fp32`` | ``bf16`` | ``fp16`` (resolved, not ``auto``).
        device: a torch device or its name (``"cpu"``, ``"cuda:0"``). trust_remote_code: passed to transformers.
        tokenizer: the :func:`load_tokenizer` tokenizer it will be fed by: the embeddings are fitted to it
            (:func:`fit_embeddings`), so the pad token it adds to a model whose pad is its EOS (SmolLM2,
            Qwen2, Llama: the id one past the vocabulary) embeds in a padded batch instead of indexing
            out of range.

    Raises:
        OSError: ``path`` holds no loadable model (from transformers).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, trust_remote_code=trust_remote_code, dtype=torch_dtype(dtype),
        **attention_kwargs(dtype, torch.device(device).type))
    if tokenizer is not None:
        fit_embeddings(model, tokenizer)
    return model.to(device).eval()


def load_causal_lm(
    path: str,
    tokenizer,
    dtype: str = "fp32",
    dropout: float | None = None,
    trust_remote_code: bool = False,
    fp32_lm_head: bool = False,
):
    """Load an HF causal LM (hub name or folder) ready for chatrl.

    Args:
        path: hub name (``facebook/opt-1.3b``) or local folder.
        tokenizer: a tokenizer passed through :func:`prepare_tokenizer`; embeddings are fitted to it.
        dtype: ``fp32`` | ``bf16`` | ``fp16``: the dtype the weights are loaded in.
        dropout: if given, overrides every ``*dropout`` field of the config (``0.0`` turns it off).
        trust_remote_code: passed to transformers; off unless the user asks.
        fp32_lm_head: compute the LM head in float32 whatever ``dtype`` (``--fp32_lm_head``,
            :func:`chatrl.models.precision.compute_in_fp32`): the logits are then float32.

    Raises:
        FileNotFoundError: ``path`` is neither a local folder nor reachable on the hub (names it).
        OSError: ``path`` exists but holds no model config (names it).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _load_error(path, "model", err) from err
    if dropout is not None:
        for key in ("dropout", "attention_dropout", "activation_dropout", "hidden_dropout", "resid_pdrop",
                    "embd_pdrop", "attn_pdrop"):
            if hasattr(config, key):
                setattr(config, key, dropout)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code,
        **attention_kwargs(dtype))
    fit_embeddings(model, tokenizer)
    if fp32_lm_head:
        head = model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear):
            raise UsageError(f"--fp32_lm_head: {type(model).__name__} has no linear output embedding")
        compute_in_fp32(head)
    return model


def lora_target_modules(model, module_name: str) -> list[str]:
    """Qualified names of the ``nn.Linear`` modules whose name contains ``module_name``.

    Raises:
        ValueError: nothing matches (the flag names a module the model does not have).
    """
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and module_name in n]
    names = [n for n in names if not n.endswith("lm_head") and not n.endswith("score")]
    if not names:
        raise ValueError(f"--lora_module_name {module_name!r} matches no nn.Linear in {type(model).__name__}")
    return names


def lora_enabled(lora: LoraConfig) -> bool:
    """Whether ``lora`` (a per-model :class:`chatrl.config.LoraConfig`) turns LoRA on (rank > 0)."""
    return lora.lora_dim > 0


def lora_config(model, lora: LoraConfig):
    """The ``peft.LoraConfig`` for ``lora`` on ``model``: rank ``--lora_dim``, scale 1 (alpha = rank,
    as DeepSpeed-Chat's default), no LoRA dropout, every ``nn.Linear`` whose name contains
    ``--lora_module_name``."""
    import peft

    return peft.LoraConfig(r=lora.lora_dim, lora_alpha=lora.lora_dim, lora_dropout=0.0,
                           target_modules=lora_target_modules(model, lora.lora_module_name), bias="none")


def apply_lora(model, lora: LoraConfig):
    """Wrap ``model`` with peft LoRA adapters, returning the peft model (or ``model`` if LoRA is off).

    With ``only_optimize_lora`` only the adapters train (peft's default); otherwise the base
    weights stay trainable too, as DeepSpeed-Chat does.

    Raises:
        ValueError: ``--lora_module_name`` matches no linear layer (:func:`lora_target_modules`).
    """
    if not lora_enabled(lora):
        return model
    from peft import get_peft_model

    peft_model = get_peft_model(model, lora_config(model, lora))
    if not lora.only_optimize_lora:
        for name, p in peft_model.named_parameters():
            if "lora_" not in name:
                p.requires_grad_(True)
    return peft_model


def base_model(model):
    """The HF model under a peft wrapper (or ``model`` itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def enable_gradient_checkpointing(model) -> None:
    """Turn on activation checkpointing; with LoRA-only training, make inputs require grad so that
    checkpointed blocks still produce gradients for the adapters."""
    hf = base_model(model)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.config.use_cache = False
    if hasattr(hf, "enable_input_require_grads"):
        hf.enable_input_require_grads()


def optimizer_param_groups(model, weight_decay: float, lora_learning_rate: float | None = None) -> list[dict]:
    """Split trainable parameters into decay / no-decay groups, plus a LoRA group with its own rate.

    Biases and norm weights get no weight decay (Loshchilov & Hutter, 2019, section 2 convention).
    Empty groups are dropped (DeepSpeed rejects them).
    """
    decay, no_decay, lora = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if "lora_" in name:
            lora.append(p)
        elif p.ndim < 2 or "norm" in name.lower() or name.endswith(".bias"):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if lora:
        group = {"params": lora, "weight_decay": 0.0}
        if lora_learning_rate is not None:
            group["lr"] = lora_learning_rate
        groups.append(group)
    return [g for g in groups if g["params"]]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that follow the mask: ``(B, T)`` long, 0 at each row's first real token.

    Left-padded rows then see the same positions as unpadded ones; pads get 0 (their outputs are
    never read). Needed because Llama-family models count positions from the left edge.
    """
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).clamp(min=0) * mask


def accepts_logits_to_keep(model) -> bool:
    """Whether ``model``'s forward (under a DeepSpeed engine or peft wrapper) takes HF's ``logits_to_keep``."""
    import inspect

    hf = base_model(getattr(model, "module", model))
    return "logits_to_keep" in inspect.signature(type(hf).forward).parameters


def packed_inputs(model, packed: PackedRows) -> dict:
    """Forward arguments of packed rows (:mod:`chatrl.packing`) for ``model``: the rows' ids, position
    ids that restart at each sequence, and the attention mask of the model's family: ``None`` where
    attention reads packed rows from the position ids (Llama, Qwen2), the 4-D block-diagonal mask
    (:func:`chatrl.packing.block_diagonal_mask`, in the model's dtype) for OPT.

    Raises:
        UsageError: a family or attention implementation packing does not support
            (:func:`chatrl.packing.attention_style`).
    """
    hf = base_model(getattr(model, "module", model))
    cfg = hf.config
    style = attention_style(getattr(cfg, "model_type", None), getattr(cfg, "_attn_implementation", None),
                            getattr(cfg, "name_or_path", None) or type(hf).__name__)
    mask = None
    if style == BLOCK_MASK:
        mask = block_diagonal_mask(packed.seq_ids, next(hf.parameters()).dtype)
    return {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "attention_mask": mask}


def forward_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   packed: PackedRows | None = None) -> dict:
    """``model``'s forward arguments for a padded batch (position ids from the mask, any padding side)
    or, with ``packed``, for its rows (:func:`packed_inputs`; ``input_ids`` must be its rows then)."""
    if packed is not None:
        if input_ids is not packed.input_ids and not torch.equal(input_ids, packed.input_ids):
            raise ValueError("forward_inputs: input_ids are not the packed rows' ids")
        return packed_inputs(model, packed)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask)}


def causal_lm_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     logits_to_keep: int = 0, packed: PackedRows | None = None) -> torch.Tensor:
    """Logits ``(B, T, V)`` of ``model`` with position ids from the mask (padding-side invariant).

    ``logits_to_keep > 0`` returns only the last ``logits_to_keep`` positions, ``(B, logits_to_keep, V)``:
    the LM head (for a small model with a large vocabulary the largest matmul of the forward and
    backward passes) then runs on those rows only. Models whose forward lacks HF's
    ``logits_to_keep`` compute all positions and are sliced (the same values).

    With ``packed`` (:class:`chatrl.packing.PackedRows`; ``input_ids`` its rows ``(R, W)``,
    ``attention_mask`` ignored) the logits are those of the rows, ``(R, W, V)``: each sequence's
    equal its own padded logits.
    """
    kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep and accepts_logits_to_keep(model) else {}
    out = model(**forward_inputs(model, input_ids, attention_mask, packed), use_cache=False, **kwargs)
    return out.logits[:, -logits_to_keep:] if logits_to_keep else out.logits


# config attributes of models whose forward changes the LM head's output (Gemma's soft-capping,
# Cohere's and Granite's logit scales): their logits are not ``lm_head(last hidden state)``
_HEAD_OUTPUT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def head_is_plain(model) -> bool:
    """Whether ``model``'s logits are exactly its output embedding applied to the last hidden state
    (true for OPT, GPT-2, Llama, Mistral, Qwen2; false when the config declares a soft-cap or scale)."""
    hf = base_model(getattr(model, "module", model))
    cfg = getattr(hf, "config", None)
    return (callable(getattr(hf, "get_output_embeddings", None)) and hf.get_output_embeddings() is not None
            and not any(getattr(cfg, k, None) not in (None, 0, 1, 1.0) for k in _HEAD_OUTPUT_TRANSFORMS))


def token_logits_at(model, rows: torch.Tensor, cols: torch.Tensor, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None, packed: PackedRows | None = None) -> torch.Tensor:
    """The logits of the positions ``(rows[i], cols[i])`` only, ``(M, V)`` in the model's dtype.

    The body runs once through ``model``'s own forward (so DeepSpeed's hooks and peft's adapters
    apply as usual) with HF's ``logits_to_keep=1`` and ``output_hidden_states``, and the LM head
    runs on the ``M`` selected hidden states: for a small model with a large vocabulary the head is
    the largest matmul of the forward and backward passes. The head input is the last hidden state,
    which equals what the model's own head reads for the families of :func:`head_is_plain` (tested
    for OPT, Llama and Qwen2). Models that fail that check, or lack ``logits_to_keep``, compute full
    logits and are indexed (the same values).

    Args:
        model: an HF causal LM, possibly under a DeepSpeed engine or peft wrapper.
        rows, cols: ``(M,)`` long positions in ``input_ids``.
        input_ids, attention_mask, packed: as :func:`causal_lm_logits`.
    """
    inputs = forward_inputs(model, input_ids, attention_mask, packed)
    if not (head_is_plain(model) and accepts_logits_to_keep(model)):
        return model(**inputs, use_cache=False).logits[rows, cols]
    out = model(**inputs, use_cache=False, logits_to_keep=1, output_hidden_states=True)
    head = base_model(getattr(model, "module", model)).get_output_embeddings()
    return head(out.hidden_states[-1][rows, cols])


def labelled_token_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                          labels: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                          packed: PackedRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the positions whose next token carries a label, and those labels, flattened.

    The LM head runs on those ``N`` rows only (:func:`token_logits_at`): with the prompt masked most
    positions carry no loss (step 1 on helpful-base: about a quarter of them do; 4-5x faster
    forward, loss and backward at a 50k vocabulary).

    Args:
        model: an HF causal LM, possibly under a DeepSpeed engine or peft wrapper.
        input_ids, attention_mask: ``(B, T)``; position ids follow the mask (any padding side).
        labels: ``(B, T)`` aligned with the inputs (not shifted); ``ignore_index`` marks no loss.
        packed: packed rows (:class:`chatrl.packing.PackedRows`): ``input_ids`` and ``labels`` are
            ``(R, W)`` rows, ``attention_mask`` is ignored; the first token of each sequence is
            never a target (nothing of its own sequence predicts it).

    Returns:
        ``(logits, targets)``: ``(N, V)`` in the model's dtype and ``(N,)`` long, where ``N`` counts
        the labelled tokens of ``labels[:, 1:]``, in row-major order; ``logits[i]`` is the prediction
        from the position before ``targets[i]``.

    Raises:
        ValueError: ``labels`` and ``input_ids`` differ in shape.
    """
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ")
    if packed is not None:
        labels = labels.index_put((packed.row, packed.start), labels.new_tensor(ignore_index))
    targets = labels[:, 1:]
    rows, cols = (targets != ignore_index).nonzero(as_tuple=True)
    return token_logits_at(model, rows, cols, input_ids, attention_mask, packed), targets[rows, cols]


def special_token_texts(tokenizer) -> list[str]:
    """The text of every special token of ``tokenizer`` (BOS, EOS, pad, a chat template's markers…)."""
    texts = set(tokenizer.all_special_tokens)
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            texts.add(str(tok.content))
    return sorted(t for t in texts if t)


_EOT_PROBE = "\x00chatrl-end-of-turn-probe\x00"


def end_of_turn_token_id(tokenizer) -> int:
    """The token that ends an assistant turn: the chat template's, else the tokenizer's EOS.

    With a chat template, the first special token the template writes after an assistant message
    (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``</s>`` for Llama 2); the EOS when the
    template writes none.

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no EOS token")
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.eos_token_id
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": _EOT_PROBE}], tokenize=False)
    after = text.split(_EOT_PROBE, 1)[1] if _EOT_PROBE in text else ""
    special = set(tokenizer.all_special_ids) | {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                                                 if getattr(t, "special", False)}
    for i in tokenizer(after, add_special_tokens=False)["input_ids"]:
        if i in special and i != tokenizer.pad_token_id:
            return int(i)
    return tokenizer.eos_token_id


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Ids that end a generated answer, in this order: the end-of-turn token
    (:func:`end_of_turn_token_id`), the tokenizer's EOS, then every id the model declares: the ids
    its folder's generation config and config name as ``eos_token_id`` (recorded by
    :func:`load_tokenizer`) and, with ``model``, those of its loaded ``generation_config`` and
    ``config``. The pad id is never one of them.

    Generation (step 3, the hybrid engine, chat, the web chat), step 3's action mask, the
    ``--penalty_no_eos`` penalty, every "ended its turn" metric (step 3's ``eos_rate``, the EOS
    checks of steps 1 and DPO) and the generation config of every export use this one set
    (docs/tokenization.md, rule 3).
    """
    ids = [end_of_turn_token_id(tokenizer), tokenizer.eos_token_id, *getattr(tokenizer, DECLARED_EOS_ATTR, [])]
    if model is not None:
        hf = base_model(getattr(model, "module", model))
        for cfg in (getattr(hf, "generation_config", None), getattr(hf, "config", None)):
            ids += _ids(getattr(cfg, "eos_token_id", None)) if cfg is not None else []
    return [i for i in dict.fromkeys(ids) if i is not None and i != tokenizer.pad_token_id]


def sampling_settings(temperature: float, top_k: int = 0, top_p: float = 1.0, greedy: bool = False) -> dict:
    """``generate`` keyword arguments for the sampling flags: ``{"do_sample": False}`` for greedy
    decoding (``greedy`` or ``--temperature 0``), else ``do_sample`` with the three settings.

    Temperature 0 is the limit of sampling at falling temperature: the most likely token, i.e.
    greedy decoding (HF ``generate`` refuses it and dividing the logits by 0 gives NaN).

    Raises:
        ValueError: naming ``--temperature`` (negative or not finite), ``--top_k`` (negative) or
            ``--top_p`` (outside ``(0, 1]``), so that a step refuses at start-up.
    """
    import math

    if not math.isfinite(temperature) or temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0: greedy decoding), got {temperature}")
    if top_k < 0:
        raise UsageError(f"--top_k must be >= 0 (0: no top-k filter), got {top_k}")
    if not 0 < top_p <= 1:
        raise UsageError(f"--top_p must be in (0, 1] (1: no nucleus filter), got {top_p}")
    if greedy or temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p)}


_WINDOW_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


def context_window(config) -> int | None:
    """Tokens a model can attend over: its config's ``max_position_embeddings`` (or GPT-2's
    ``n_positions`` …); None when the config names no limit."""
    for key in _WINDOW_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context_window(path, budgets: dict[str, int], trust_remote_code: bool = False) -> int | None:
    """Refuse sequence budgets beyond the model's context window, before anything is loaded.

    Args:
        path: the model folder or hub name (only its config is read), or a list of them (``None``
            entries and repeats are skipped; the smallest window is returned).
        budgets: flag text → tokens, e.g. ``{"--max_seq_len": 512}`` or
            ``{"--max_prompt_seq_len + --max_answer_seq_len": 256 + 256}``.

    Returns the window (None when the config names none; nothing is checked then).

    Raises:
        ValueError: naming the flag, its value, the model and its limit (positions past the window
            would otherwise fail late as ``IndexError: index out of range in self``).
        FileNotFoundError / OSError: as :func:`load_causal_lm` for a path without a config.
    """
    from transformers import AutoConfig

    if not isinstance(path, str):
        windows = [check_context_window(p, budgets, trust_remote_code) for p in dict.fromkeys(path) if p is not None]
        return min((w for w in windows if w is not None), default=None)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _load_error(path, "model", err) from err
    window = context_window(config)
    if window is None:
        return None
    for flag, tokens in budgets.items():
        if tokens > window:
            raise UsageError(f"{flag} {tokens} exceeds the context window of {path} ({window} positions, "
                             f"its config's max_position_embeddings); lower {flag.split(' + ')[0]}")
    return window


def check_packing(packing: PackingConfig, path, trust_remote_code: bool = False) -> None:
    """Refuse ``--packing`` for a model family it does not support, before anything is loaded.

    Args:
        packing: the program's :class:`chatrl.config.PackingConfig` (nothing is checked without ``--packing``).
        path: the model folder or hub name (only its config is read), or a list of them (``None``
            entries and repeats are skipped).

    Raises:
        UsageError: naming the model and its family (:func:`chatrl.packing.attention_style`).
        FileNotFoundError / OSError: as :func:`load_causal_lm` for a path without a config.
    """
    from transformers import AutoConfig

    if not packing.packing:
        return
    for p in [path] if isinstance(path, str) else [p for p in dict.fromkeys(path) if p is not None]:
        try:
            config = AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            raise _load_error(p, "model", err) from err
        attention_style(getattr(config, "model_type", None), what=p)
