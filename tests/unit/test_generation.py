"""chatrl.generation: a model outside DeepSpeed generates through step 3's decoder (the hybrid engine's
KV-cache loop) with chatrl's stop ids, token for token what HF generate gives greedily; answers are cut
after their first stop id."""

import torch

from chatrl.generation import answer_tokens, generate_answers, inference_engine, left_pad
from chatrl.models import load_causal_lm, load_tokenizer, stop_token_ids
from tests.conftest import STORIES


def test_plain_model_uses_step3s_decoder_and_matches_hf_generate():
    tok = load_tokenizer(str(STORIES), padding_side="left")
    model = load_causal_lm(str(STORIES), tok).eval()
    engine = inference_engine(model)
    assert engine.enabled and engine._direct  # the KV-cache decoder on the module itself, no copy
    prompts = [tok("Once upon a time")["input_ids"], tok("The dog")["input_ids"], tok("Hi")["input_ids"]]
    ours = generate_answers(engine, prompts, tok, 24, {"do_sample": False})
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
