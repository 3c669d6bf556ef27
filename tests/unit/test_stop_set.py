"""One stop set everywhere (docs/tokenization.md, rule 3): the chat template's end of turn, the
tokenizer's EOS and every id the model declares, never the pad. Generation (step 3's rollouts through
the hybrid engine, the EOS checks, chat), the action mask, ``--penalty_no_eos``, ``eos_rate`` and
the exports all use it.

stories260K declares ``eos_token_id: [2, 1]`` (it ends a story with BOS): its greedy story from
"Once upon a time" ends after 342 tokens; with the declared BOS lost it ran to a 400-token limit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from chatrl.models.causal_lm import load_causal_lm, load_tokenizer, stop_token_ids
from tests.conftest import STORIES, TOKENIZERS

STORY_TOKENS = 342  # greedy new tokens of stories260K after "Once upon a time", its BOS stop included
TAIL = 12  # the prompts below hold the story but its last TAIL tokens (a short generation ends it)
BUDGET = 48  # answer budget of those generations: without the declared BOS they run to it


@pytest.fixture(scope="module")
def stories():
    """stories260K as chatrl loads it, and a prompt: "Once upon a time" and its greedy story, all but
    the story's last TAIL tokens (the last one the BOS that ends it)."""
    tok = load_tokenizer(str(STORIES), padding_side="left")
    model = load_causal_lm(str(STORIES), tok).eval()
    ids = tok("Once upon a time", return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=400, do_sample=False,
                         pad_token_id=tok.pad_token_id)  # the generation config chatrl gave the model
    assert out.shape[1] - ids.shape[1] == STORY_TOKENS and out[0, -1].item() == 1  # before: 400, no stop
    return tok, model, out[:, :-TAIL]


def test_stop_set_is_the_union_of_turn_end_eos_and_declared_ids_never_the_pad(stories, tmp_path):
    tok, model, _ = stories
    assert stop_token_ids(tok) == [2, 1] and tok.pad_token_id == 512
    assert model.generation_config.eos_token_id == [2, 1]  # kept when chatrl loads the model
    qwen = load_tokenizer(str(TOKENIZERS / "qwen2"))
    im_end = qwen.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(qwen) == [im_end, qwen.eos_token_id]
    # a model that declares its pad id (and another id) as EOS: the pad is never a stop id
    from chatrl.models.tiny import TinySpec, make_tiny_model

    m, t = make_tiny_model("llama", tmp_path / "m", TinySpec(hidden=16, layers=1, heads=2, ffn=32))
    m.generation_config.eos_token_id = [t.eos_token_id, t.pad_token_id, 7]
    m.generation_config.save_pretrained(tmp_path / "m")
    declared = load_tokenizer(str(tmp_path / "m"))
    assert stop_token_ids(declared) == [declared.eos_token_id, 7]
    assert stop_token_ids(load_tokenizer(str(TOKENIZERS / "gpt2")), m) == [t.eos_token_id, 7]


def test_exports_keep_the_declared_stop_ids_and_plain_generate_stops_there(stories, tmp_path):
    from transformers import AutoModelForCausalLM, GenerationConfig

    from chatrl.distributed.weights import save_hf_model

    tok, model, ids = stories
    save_hf_model(model, tok, tmp_path / "export")
    assert GenerationConfig.from_pretrained(tmp_path / "export").eos_token_id == [2, 1]
    assert stop_token_ids(load_tokenizer(str(tmp_path / "export"))) == [2, 1]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    out = exported.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=BUDGET, do_sample=False,
                            pad_token_id=tok.pad_token_id)  # the export's own generation config
    assert out.shape[1] - ids.shape[1] == TAIL and out[0, -1].item() == 1


def eos_rate_of(exp, stops) -> float:
    """Step 3's logged ``eos_rate`` of one buffer (one rank), as the loop computes it."""
    from chatrl.rl.stats import PooledStats
    from chatrl.step3_ppo.trainer import summarize

    stats = PooledStats()
    summarize(exp, 0.0, stops, stats)
    return stats.finish()["eos_rate"]


class ActorEngine(torch.nn.Module):
    """The parts of a ZeRO-0 DeepSpeed engine that the hybrid engine and the trainer use."""

    def __init__(self, model):
        super().__init__()
        self.module = model
        self.global_steps = 0  # the weight version the hybrid engine stamps rollouts with

    def forward(self, *args, **kw):
        return self.module(*args, **kw)

    def zero_optimization_stage(self):
        return 0


def step3_settings(*flags):
    from chatrl import config
    from chatrl.step3_ppo.main import build_parser
    from chatrl.step3_ppo.settings import Step3Settings

    argv = ["--actor_model_name_or_path", str(STORIES), "--data_path", "x.jsonl", "--output_dir", "/tmp/x",
            "--max_answer_seq_len", str(BUDGET), "--temperature", "0", *flags]
    return config.read(Step3Settings, build_parser().parse_args(argv))


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain_generate", "hybrid_engine"])
def test_step3_rollout_mask_penalty_and_eos_rate_use_the_declared_stop(stories, hybrid):
    from chatrl.hybrid_engine import HybridEngine
    from chatrl.rewards import FunctionReward, WeightedReward
    from chatrl.step3_ppo.engine import RLHFEngines
    from chatrl.step3_ppo.trainer import Trainer

    tok, model, ids = stories
    s = step3_settings("--rl_algorithm", "grpo", "--num_samples_per_prompt", "2", "--penalty_no_eos", "1.0",
                       *(["--enable_hybrid_engine"] if hybrid else []))
    actor = ActorEngine(model)
    sampler = HybridEngine(actor, s.hybrid).sampler(s.rollout.max_answer_seq_len, s.sampling, tok)
    reward = WeightedReward([(1.0, FunctionReward(lambda p, a, m: [0.5] * len(a), name="half"))])
    trainer = Trainer(RLHFEngines(actor, actor), reward, sampler, SimpleNamespace(value=0.0), s.ppo, tok)
    assert trainer.stops == [2, 1]
    exp = trainer.rollout(ids, torch.ones_like(ids), None, step=1)
    assert exp.action_mask.sum(1).tolist() == [TAIL] * 2  # through the BOS that ends the story (before: 48)
    answer = exp.sequences[:, exp.prompt_len:]
    assert answer[0, TAIL - 1].item() == 1 and (answer[:, TAIL:] == tok.pad_token_id).all()
    assert exp.scores.tolist() == [0.5, 0.5]  # no --penalty_no_eos: the answers ended
    exp.kl, exp.entropy = torch.zeros_like(exp.sampler_logp), torch.zeros_like(exp.sampler_logp)
    assert eos_rate_of(exp, trainer.stops) == 1.0


def test_eos_checks_and_web_chat_use_the_declared_stop(stories):
    from chatrl.distributed.dist import DistInfo
    from chatrl.generation import eos_rate
    from chatrl.tools.web_chat import ChatModel

    tok, model, ids = stories
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    prompt = ids[0].tolist()
    assert eos_rate(model, [prompt], tok, TAIL, 0, info) == 1.0  # before: 0.0 (the BOS did not count)
    assert eos_rate(model, [prompt], tok, TAIL - 1, 0, info) == 0.0
    assert ChatModel(str(STORIES), "cpu").stop_ids == [2, 1]


def test_one_definition_of_an_ended_answer_with_chatml():
    """Qwen2's ChatML: EOS is <|endoftext|>, a turn ends with <|im_end|>. Generation, the action mask,
    --penalty_no_eos and eos_rate all count <|im_end|> (the critic-free loop once logged eos_rate 0.000
    for answers that all ended their turn, against the tokenizer's EOS alone)."""
    from chatrl.hybrid_engine import HybridEngine
    from chatrl.rewards import FunctionReward, WeightedReward
    from chatrl.step3_ppo.engine import RLHFEngines
    from chatrl.step3_ppo.trainer import Trainer

    tok = load_tokenizer(str(TOKENIZERS / "qwen2"), padding_side="left")
    im_end, eot, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id, tok.pad_token_id
    answers = [[40, 41, im_end, 42, 43], [44, eot, 45, 46, 47], [48, 49, 50, 51, 52], [im_end, 0, 0, 0, 0]]
    prompt = torch.tensor([[tok.convert_tokens_to_ids("<|im_start|>"), 872, 198]] * 4)
    captured = {}

    class Hybrid:  # what HybridEngine.sampler asks of the hybrid engine
        in_inference = False

        def inference(self):
            import contextlib
            return contextlib.nullcontext()

        def sampler_stamp(self):  # no weight stamps
            return None

        def generate(self, ids, mask, **kw):
            captured.update(kw)
            return torch.cat([ids, torch.tensor(answers)], 1), torch.zeros(4, 5)

    s = step3_settings("--rl_algorithm", "rloo", "--num_samples_per_prompt", "1", "--penalty_no_eos", "2.0")
    sampler = HybridEngine.sampler(Hybrid(), s.rollout.max_answer_seq_len, s.sampling, tok)
    reward = WeightedReward([(1.0, FunctionReward(lambda p, a, m: [1.0] * len(a), name="one"))])
    trainer = Trainer(RLHFEngines(None, None), reward, sampler, SimpleNamespace(value=0.0), s.ppo, tok)
    exp = trainer.rollout(prompt, torch.ones_like(prompt), None, step=1)
    assert captured["eos_token_id"] == trainer.stops == stop_token_ids(tok) == [im_end, eot]
    assert exp.action_mask.sum(1).tolist() == [3, 2, 5, 1]
    assert (exp.sequences[0, 3 + 3:] == pad).all()
    assert exp.scores.tolist() == [1.0, 1.0, -1.0, 1.0]  # the penalty only where no stop token came
    exp.kl, exp.entropy = torch.zeros(4, 5), torch.zeros(4, 5)
    assert eos_rate_of(exp, trainer.stops) == 0.75
