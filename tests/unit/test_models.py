"""Tokenizer set-up, LoRA selection, position ids and the SFT loss's padding invariance."""

import pytest
import torch

from chatrl.config import LoraConfig
from chatrl.models.causal_lm import (
    apply_lora,
    causal_lm_logits,
    load_causal_lm,
    load_tokenizer,
    optimizer_param_groups,
    position_ids_from_mask,
    vocab_size_for,
)
from chatrl.step1_sft.loss import IGNORE_INDEX, token_nll
from tests.conftest import STORIES, TOKENIZERS


@pytest.mark.parametrize("path,eos", [(TOKENIZERS / "gpt2", 50256), (TOKENIZERS / "qwen2", 151643), (STORIES, 2)])
def test_pad_token_is_added_and_distinct_from_eos(path, eos):
    tok = load_tokenizer(str(path))
    assert tok.eos_token_id == eos
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert tok.pad_token_id == len(tok) - 1  # the new token, appended
    assert vocab_size_for(tok) % 8 == 0 and vocab_size_for(tok) >= len(tok)


def test_stories260k_embeddings_grow_to_cover_pad():
    tok = load_tokenizer(str(STORIES))
    model = load_causal_lm(str(STORIES), tok)
    assert tok.pad_token_id == 512
    assert model.get_input_embeddings().weight.shape[0] == 520  # 513 rounded up to a multiple of 8
    assert model.config.pad_token_id == 512


def test_position_ids_follow_the_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 0]]


def test_lora_module_selection_and_param_groups(tiny_opt):
    tok = load_tokenizer(str(tiny_opt))
    model = apply_lora(load_causal_lm(str(tiny_opt), tok),
                       LoraConfig(lora_dim=4, lora_module_name="decoder.layers.", only_optimize_lora=True))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # 2 layers x (q, k, v, out, fc1, fc2) x (A, B)
    assert len(trainable) == 2 * 6 * 2
    groups = optimizer_param_groups(model, weight_decay=0.1, lora_learning_rate=3e-4)
    assert len(groups) == 1 and groups[0]["lr"] == 3e-4 and len(groups[0]["params"]) == 24
    with pytest.raises(ValueError, match="--lora_module_name"):
        apply_lora(load_causal_lm(str(tiny_opt), tok), LoraConfig(lora_dim=4, lora_module_name="no.such.module"))


def _pad(rows, pad_id, side):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, sl] = torch.tensor(r)
        mask[i, sl] = 1
    return ids, mask


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_sft_loss_of_padded_batch_equals_token_weighted_unpadded_loss(tiny_models, family, side):
    path = tiny_models[family]
    tok = load_tokenizer(str(path))
    model = load_causal_lm(str(path), tok).eval()
    torch.manual_seed(0)
    rows = [torch.randint(0, 50000, (n,)).tolist() for n in (5, 11, 8)]
    prompt_lens = [2, 6, 3]
    sums, counts = [], []
    for r, p in zip(rows, prompt_lens, strict=False):  # each sample alone, no padding
        ids = torch.tensor([r])
        labels = ids.clone()
        labels[:, :p] = IGNORE_INDEX
        s, n = token_nll(causal_lm_logits(model, ids, torch.ones_like(ids)), labels)
        sums.append(s.item())
        counts.append(n.item())
    ids, mask = _pad(rows, tok.pad_token_id, side)
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    for i, (r, p) in enumerate(zip(rows, prompt_lens, strict=False)):
        start = ids.shape[1] - len(r) if side == "left" else 0
        labels[i, start:start + p] = IGNORE_INDEX
    s, n = token_nll(causal_lm_logits(model, ids, mask), labels)
    assert n.item() == sum(counts) == (5 - 2) + (11 - 6) + (8 - 3)
    assert s.item() / n.item() == pytest.approx(sum(sums) / sum(counts), abs=1e-5)


def test_token_nll_hand_values():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 2.0  # predicts token at t=1
    labels = torch.tensor([[IGNORE_INDEX, 2, 1]])
    s, n = token_nll(logits, labels)
    import math
    expect = -(2.0 - math.log(math.exp(2.0) + 3)) + math.log(4.0)  # -log softmax at 2 and uniform at t=2
    assert n.item() == 2 and s.item() == pytest.approx(expect, rel=1e-6)
    with pytest.raises(ValueError):
        token_nll(logits, labels[:, :2])


@pytest.mark.parametrize("lora_dim", [0, 4])
def test_export_keeps_tied_embeddings_and_live_config(tmp_path, lora_dim):
    """A LoRA export of stories260K (tied) has one shared matrix, like the input."""
    import json

    from transformers import AutoModelForCausalLM

    from chatrl.config import LoraConfig
    from chatrl.distributed.weights import save_hf_model
    from chatrl.models.causal_lm import apply_lora, base_model, load_causal_lm

    tok = load_tokenizer(str(STORIES))
    model = load_causal_lm(str(STORIES), tok)
    n_input = sum(p.numel() for p in model.parameters())
    model = apply_lora(model, LoraConfig(lora_dim=lora_dim))
    save_hf_model(model, tok, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert saved.get_output_embeddings().weight is saved.get_input_embeddings().weight
    assert sum(p.numel() for p in saved.parameters()) == n_input
    assert base_model(model).config.tie_word_embeddings is True


def test_export_generation_config_stops_on_the_templates_end_of_turn(tmp_path):
    """The exported generation config lists <|im_end|> among its EOS ids."""
    from transformers import GenerationConfig

    from chatrl.distributed.weights import save_hf_model
    from chatrl.models.causal_lm import load_causal_lm
    from chatrl.models.tiny import TinySpec, make_tiny_model

    make_tiny_model("qwen2", tmp_path / "q", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    tok = load_tokenizer(str(tmp_path / "q"))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    model = load_causal_lm(str(tmp_path / "q"), tok)
    assert model.generation_config.eos_token_id == [im_end, tok.eos_token_id]
    save_hf_model(model, tok, tmp_path / "out")
    assert GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == [im_end, tok.eos_token_id]


def test_sampling_settings_temperature_0_is_greedy_and_bad_values_name_the_flag():
    """Temperature 0 means greedy decoding everywhere, bad values fail at start-up."""
    from chatrl.models.causal_lm import sampling_settings

    assert sampling_settings(0.0, 50, 0.9) == {"do_sample": False}
    assert sampling_settings(0.7, 0, 1.0, greedy=True) == {"do_sample": False}
    assert sampling_settings(0.7, 5, 0.9) == {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9}
    for kw, flag in [({"temperature": -0.5}, "--temperature"), ({"temperature": float("nan")}, "--temperature"),
                     ({"temperature": 1.0, "top_k": -1}, "--top_k"), ({"temperature": 1.0, "top_p": 0.0}, "--top_p")]:
        with pytest.raises(ValueError, match=flag):
            sampling_settings(**kw)


def test_decode_at_temperature_0_is_argmax():
    """The hybrid engine's decoder with the settings of --temperature 0: argmax, no NaN."""
    from chatrl.hybrid_engine.decode import GenerationSettings, pick_tokens, process_logits
    from chatrl.models.causal_lm import sampling_settings

    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    s = GenerationSettings(max_new_tokens=1, **{"temperature": 1.0, **sampling_settings(0.0)})
    assert pick_tokens(process_logits(logits, s, 0), s).tolist() == [1, 0]
@pytest.mark.parametrize("family", ["opt", "llama"])
def test_logits_to_keep_equals_the_last_positions_of_full_logits(tiny_models, family):
    """The LM head on the last N positions only (step 3's answer window) gives the full pass's values."""
    tok = load_tokenizer(str(tiny_models[family]))
    model = load_causal_lm(str(tiny_models[family]), tok).eval()
    torch.manual_seed(0)
    ids, mask = _pad([torch.randint(0, 50000, (n,)).tolist() for n in (9, 5)], tok.pad_token_id, "left")
    with torch.no_grad():
        full = causal_lm_logits(model, ids, mask)
        kept = causal_lm_logits(model, ids, mask, logits_to_keep=4)
    assert kept.shape == (2, 4, full.shape[-1])
    assert torch.allclose(kept, full[:, -4:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["opt", "llama"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_sft_nll_on_labelled_positions_equals_the_full_logits_path(tiny_models, family, side):
    """Step 1's LM head on the labelled positions only: the same NLL sum, token count and gradient as
    the head over every position, whatever the padding side (prompt tokens masked, as step 1 does)."""
    from chatrl.models.causal_lm import head_is_plain
    from chatrl.step1_sft.loss import sft_nll

    tok = load_tokenizer(str(tiny_models[family]))
    model = load_causal_lm(str(tiny_models[family]), tok).eval()
    assert head_is_plain(model)
    torch.manual_seed(0)
    ids, mask = _pad([torch.randint(0, 50000, (n,)).tolist() for n in (11, 6, 9)], tok.pad_token_id, side)
    labels = ids.masked_fill((mask == 0) | (mask.cumsum(-1) <= 3), IGNORE_INDEX)  # pads and 3-token prompts
    results = []
    for fn in (lambda: token_nll(causal_lm_logits(model, ids, mask), labels), lambda: sft_nll(model, ids, mask, labels)):
        model.zero_grad()
        s, n = fn()
        s.backward()
        results.append((s.detach(), int(n), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (s0, n0, g0), (s1, n1, g1) = results
    assert n0 == n1 == int((labels[:, 1:] != IGNORE_INDEX).sum()) > 0
    assert s1.item() == pytest.approx(s0.item(), rel=1e-6)
    assert len(g0) == len(g1) and all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(g0, g1, strict=True))


def test_a_soft_capped_head_falls_back_to_full_logits(tiny_models):
    """A config that scales or soft-caps the head's output takes the full-logits path: same values."""
    from chatrl.models.causal_lm import head_is_plain, labelled_token_logits

    tok = load_tokenizer(str(tiny_models["opt"]))
    model = load_causal_lm(str(tiny_models["opt"]), tok).eval()
    ids, mask = _pad([[5, 6, 7, 8], [9, 10]], tok.pad_token_id, "right")
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    with torch.no_grad():
        fast, t_fast = labelled_token_logits(model, ids, mask, labels)
        model.config.final_logit_softcapping = 30.0
        assert not head_is_plain(model)
        slow, t_slow = labelled_token_logits(model, ids, mask, labels)
    assert fast.shape == (4, model.config.vocab_size) and torch.equal(t_fast, t_slow) and t_fast.tolist() == [6, 7, 8, 10]
    assert torch.allclose(fast, slow, atol=1e-5, rtol=0)
