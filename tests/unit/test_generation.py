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
