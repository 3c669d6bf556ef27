"""chatrl.generation: a model outside DeepSpeed generates through step 3's decoder (the hybrid engine's
KV-cache loop) with chatrl's stop ids, token for token what HF generate gives greedily; answers are cut
after their first stop id."""

import torch

from chatrl.generation import answer_tokens, generate_answers, inference_engine, left_pad
from chatrl.models.causal_lm import load_causal_lm, load_tokenizer, stop_token_ids
from tests.conftest import STORIES


def test_plain_model_uses_step3s_decoder_and_matches_hf_generate():
    tok = load_tokenizer(str(STORIES), padding_side="left")
    model = load_causal_lm(str(STORIES), tok).eval()
    engine = inference_engine(model)
    assert engine.enabled and engine._direct  # the KV-cache decoder on the module itself, no copy
    prompts = [tok("Once upon a time")["input_ids"], tok("The dog")["input_ids"], tok("Hi")["input_ids"]]
    ours = generate_answers(engine, prompts, tok, 24, None)
    ids, mask = left_pad(prompts, tok.pad_token_id)
    with torch.no_grad():
        hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                            eos_token_id=stop_token_ids(tok, model), pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    assert ours.shape == (3, 24)
    assert torch.equal(ours[:, :hf.shape[1]], hf) and bool((ours[:, hf.shape[1]:] == tok.pad_token_id).all())


def test_answers_are_cut_after_their_first_stop_id():
    got = answer_tokens(torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 9, 2, 0]]), [2])
    assert got == [([5, 2], True), ([5, 6, 7, 8], False), ([2], True)]


def test_greedy_tokens_and_logprobs_equal_hf_generate_and_no_deprecation_warning_fires():
    """The decode loop hands the model its KV cache by the keyword the installed transformers reads
    (``cache``; ``past_key_values`` is deprecated, removed in 5.40, and fired a FutureWarning from
    ``LlamaModel.forward`` at every decoding step before): greedy tokens equal HF generate's, the
    sampler's log-probs equal those of HF's scores to float32 rounding, in fp32 and bf16, and no
    FutureWarning or DeprecationWarning is raised."""
    import warnings

    from chatrl.hybrid_engine import GenerationSettings
    from chatrl.hybrid_engine.decode import TPGroup, cache_keyword, decode, gather_prompts
    from chatrl.logprobs import logprobs_from_logits

    tok = load_tokenizer(str(STORIES), padding_side="left")
    prompts = [tok(p)["input_ids"] for p in ["Once upon a time", "The dog", "Hi", "She saw a"]]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    for dtype, atol in (("fp32", 1e-5), ("bf16", 1e-2)):  # measured: 3.8e-6 and 0
        model = load_causal_lm(str(STORIES), tok, dtype).eval()
        assert cache_keyword(model.model) == "cache"
        settings = GenerationSettings(max_new_tokens=16, pad_token_id=tok.pad_token_id)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tokens, _, logp = decode(model, gather_prompts(ids, mask, TPGroup(), tok.pad_token_id, 16), settings,
                                     TPGroup(), keep_logprobs=True)
        noisy = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
        assert not noisy, noisy
        with torch.no_grad():
            hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                                eos_token_id=[], pad_token_id=tok.pad_token_id, output_scores=True,
                                return_dict_in_generate=True)
        new = hf.sequences[:, ids.shape[1]:]
        assert torch.equal(tokens, new), dtype
        want = logprobs_from_logits(torch.stack([x.float() for x in hf.scores], dim=1), new)
        torch.testing.assert_close(logp, want, rtol=0, atol=atol)


def test_a_model_that_takes_past_key_values_gets_its_cache_by_that_name():
    class Old(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=None, **kwargs):
            return input_ids

    from chatrl.hybrid_engine.decode import cache_keyword

    assert cache_keyword(Old()) == "past_key_values"


def _stories_bf16_batch():
    from chatrl.hybrid_engine.decode import TPGroup, gather_prompts

    tok = load_tokenizer(str(STORIES), padding_side="left")
    prompts = [tok(p)["input_ids"] for p in ["Once upon a time", "The dog", "Hi", "She saw a"]]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    model = load_causal_lm(str(STORIES), tok, "bf16").eval()
    return tok, model, gather_prompts(ids, mask, TPGroup(), tok.pad_token_id, 12)


def _decode_all(model, batch, tok):
    """Greedy and sampled decodes of ``batch``: tokens, raw logits and sampler log-probs of each."""
    from chatrl.hybrid_engine import GenerationSettings
    from chatrl.hybrid_engine.decode import TPGroup, decode

    outs = []
    for sample in (False, True):
        s = GenerationSettings(max_new_tokens=12, do_sample=sample, temperature=0.9, pad_token_id=tok.pad_token_id)
        g = torch.Generator().manual_seed(3) if sample else None
        with torch.inference_mode():
            outs.append(decode(model, batch, s, TPGroup(), generator=g, keep_logits=True, keep_logprobs=True))
    return outs


def test_a_model_attending_in_fp32_caches_fp32_keys_and_decodes_the_same_bits(monkeypatch):
    """bf16 weights on CPU attend on float32 copies (FP32_SDPA): the decode loop's KV cache holds the keys
    and values in float32 (converted once, exactly) instead of converting the whole cache in every layer
    at every step; tokens, logits and log-probs equal those of a bf16 cache bit for bit."""
    import chatrl.hybrid_engine.decode as decode_module
    from chatrl.models.precision import FP32_SDPA

    tok, model, batch = _stories_bf16_batch()
    assert model.config._attn_implementation == FP32_SDPA
    cache = decode_module.make_cache(model.config, 20)
    with torch.inference_mode():
        model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=True, cache=cache)
    assert cache.layers[0].keys.dtype == torch.float32 and cache.layers[-1].values.dtype == torch.float32
    fp32_cache = _decode_all(model, batch, tok)
    plain = decode_module.make_cache

    def bf16_cache(config, capacity):
        c = plain(config, capacity)
        for layer in c.layers:
            layer.store_dtype = None
        return c

    monkeypatch.setattr(decode_module, "make_cache", bf16_cache)
    bf16 = _decode_all(model, batch, tok)
    for got, want in zip(fp32_cache, bf16, strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_prepacked_bf16_linears_give_f_linear_bits_and_are_restored_after_the_block():
    """Inside PrepackedLinears a bf16 nn.Linear computes through oneDNN with its weight reordered once: the
    same bits as F.linear for the rows it was packed for and for any other row count; LoRA-like
    subclasses and fp32 layers are left alone; on exit every module is its plain self again."""
    import pytest

    from chatrl.hybrid_engine.decode import PrepackedLinears, can_prepack

    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    if not can_prepack(lin.weight):
        pytest.skip("torch here has no oneDNN bf16 linear ops")

    class Sub(torch.nn.Linear):
        pass

    sub, fp32 = Sub(96, 8).to(torch.bfloat16), torch.nn.Linear(96, 8)
    model = torch.nn.ModuleDict({"lin": lin, "sub": sub, "fp32": fp32})
    x8, x3 = torch.randn(8, 1, 96).to(torch.bfloat16), torch.randn(3, 96).to(torch.bfloat16)
    want8, want3 = torch.nn.functional.linear(x8, lin.weight, lin.bias), torch.nn.functional.linear(x3, lin.weight, lin.bias)
    with torch.inference_mode(), PrepackedLinears(model, 8) as packs:
        assert packs.modules == [lin]
        assert "forward" in lin.__dict__ and "forward" not in sub.__dict__
        assert torch.equal(lin(x8), want8) and torch.equal(lin(x3), want3)
    assert not any("forward" in m.__dict__ for m in (lin, sub, fp32))


def test_decoding_with_prepacked_weights_gives_the_same_tokens_logits_and_logprobs(monkeypatch):
    """The decode loop with bf16 weights reordered for oneDNN (the default on CPU) and with plain F.linear
    (prepacking switched off): greedy and sampled tokens, raw logits and log-probs equal bit for bit."""
    import chatrl.hybrid_engine.decode as decode_module

    tok, model, batch = _stories_bf16_batch()
    packed = _decode_all(model, batch, tok)
    assert decode_module._PACKED_EQUAL and all(decode_module._PACKED_EQUAL.values()), decode_module._PACKED_EQUAL
    monkeypatch.setattr(decode_module, "can_prepack", lambda weight: False)
    plain = _decode_all(model, batch, tok)
    for got, want in zip(packed, plain, strict=True):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
