"""Run a step program's real training loop in this process for a step or two, and capture what it
trained: the first optimizer step's full gradient of every trained engine, the logged metrics, and
the weights at the end. The workers of ``tests/stages/test_certificate.py`` run many configurations
this way inside one launch (every rank of the launch runs the same list).

The step programs run as they are (their ``run`` / ``build`` + ``train``); what is captured is read
from the DeepSpeed engines they build (``chatrl.distributed.dist.trained_engine`` is wrapped while a run lasts):
``deepspeed.utils.safe_get_full_grad`` at the first gradient-accumulation boundary, before the
optimizer step (every ZeRO stage; a collective under ZeRO 2 and 3, called on every rank alike).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
from pathlib import Path

import torch

from chatrl.distributed import dist
from tests.conftest import DATA, STORIES

HH = str(DATA / "hh-rlhf" / "helpful-base")
PROMPTS = str(DATA / "prompts")
ALPACA = str(DATA / "alpaca-instructions")
PROGRAMS = ("sft", "reward", "dpo", "ppo", "grpo")
STEP3 = ("ppo", "grpo")


def letter_reward(prompts: list[str], answers: list[str], metadata: list[dict]) -> list[float]:
    """A smooth rule reward (``--reward_fn tests/stages/loop_runs.py:letter_reward``): the share of the
    answer's characters that are the letter ``e``, plus a tenth of its length in words."""
    return [a.count("e") / max(len(a), 1) + 0.1 * len(a.split()) for a in answers]


def data_argv(program: str, work: Path, rows: int = 64) -> list[str]:
    """The data flags of a tiny run of ``program`` (hh-rlhf rows; prompts of phase 3 from the pairs)."""
    split = {"sft": "10,0,0", "reward": "0,10,0", "dpo": "0,10,0", "ppo": "0,0,10", "grpo": "0,0,10"}[program]
    return ["--data_path", f"{HH}[0:{rows}]", "--data_split", split, "--data_output_path", str(work / "cache")]


def base_argv(program: str, work: Path, out: Path, *, micro: int = 2, gas: int = 1, zero: int = 0, steps: int = 2,
              model: str | Path = STORIES, rows: int = 64, extra: list[str] | None = None) -> list[str]:
    """A tiny run of ``program``: ``steps`` optimizer steps (step 3: experience buffers) of ``micro``
    samples per rank (step 3: prompts per generation batch and rollouts per micro-batch) × ``gas``,
    ZeRO ``zero``, no evaluation, no final save (``--stop_after_steps``), fp32, dropout off."""
    common = ["--output_dir", str(out), "--overwrite_output_dir", "--disable_progress_bar",
              "--stop_after_steps", str(steps), "--max_steps", str(steps + 1),
              "--gradient_accumulation_steps", str(gas), "--disable_loss_scale_probe", "--seed", "7"]
    if program in STEP3:
        n = 2 if program == "grpo" else 1
        return ["--actor_model_name_or_path", str(model), *data_argv(program, work, rows), *common,
                "--rl_algorithm", program, "--reward_fn", "tests/stages/loop_runs.py:letter_reward",
                "--num_samples_per_prompt", str(n), "--per_device_generation_batch_size", str(micro * gas // n),
                "--per_device_training_batch_size", str(micro), "--max_prompt_seq_len", "24",
                "--max_answer_seq_len", "6", "--actor_zero_stage", str(zero), "--critic_zero_stage", str(zero),
                "--actor_learning_rate", "1e-3", "--critic_learning_rate", "1e-3", "--num_warmup_steps", "0",
                *(extra or [])]
    return ["--model_name_or_path", str(model), *data_argv(program, work, rows), *common,
            "--per_device_train_batch_size", str(micro), "--max_seq_len", "64", "--zero_stage", str(zero),
            "--eval_fraction", "0", "--learning_rate", "1e-3", "--dropout", "0", *(extra or [])]


class Capture:
    """While active, every engine ``chatrl.distributed.dist.trained_engine`` builds is kept (``engines``, in
    build order) and its first optimizer step's full gradients recorded (``grads[i]``: name → CPU
    float tensor)."""

    def __init__(self):
        self.engines: list = []
        self.grads: dict[int, dict[str, torch.Tensor]] = {}

    @contextlib.contextmanager
    def active(self):
        original = dist.trained_engine

        def wrapped(*args, **kwargs):
            engine = original(*args, **kwargs)
            self._watch(engine, len(self.engines))
            self.engines.append(engine)
            return engine

        dist.trained_engine = wrapped
        try:
            yield self
        finally:
            dist.trained_engine = original

    def _watch(self, engine, i: int) -> None:
        from deepspeed.utils import safe_get_full_grad

        step = engine.step

        def step_and_capture(*args, **kwargs):
            if i not in self.grads and engine.is_gradient_accumulation_boundary():
                grads = {}
                for name, p in engine.module.named_parameters():
                    if p.requires_grad:
                        g = safe_get_full_grad(p)  # a collective under ZeRO 2 and 3: every rank, same order
                        if g is not None:
                            grads[name] = (g.to_dense() if g.is_sparse else g).detach().float().cpu().clone()
                self.grads[i] = grads
            return step(*args, **kwargs)

        engine.step = step_and_capture

    def weights(self) -> dict[int, dict[str, torch.Tensor]]:
        """The trained engines' current full weights (gathered under ZeRO-3; every rank calls it)."""
        from chatrl.distributed.weights import full_state_dict

        out = {}
        for i, e in enumerate(self.engines):
            state = full_state_dict(e.module)
            if not state:  # ranks other than 0 get {} from full_state_dict
                state = {}
            out[i] = {k: v.float() for k, v in state.items()}
        return out


def answer_sampler(vocab: int, eos: int, pad: int, answer_len: int, seed: int = 0):
    """A sampler that depends on nothing but each prompt: answers drawn from a generator seeded by the
    prompt's tokens and its repeat within the batch (a group's answers differ), with a stop token at
    a random place or none. ``generate(ids (B, P), mask (B, P)) -> (sequences, sampler log-probs = 0)``:
    the same rollouts whatever the split of the batch over micro-batches and ranks."""

    def generate(ids: torch.Tensor, mask: torch.Tensor):
        rows, seen = [], {}
        for b in range(ids.shape[0]):
            key = tuple(ids[b][mask[b] > 0].tolist())
            k = seen[key] = seen.get(key, -1) + 1
            digest = hashlib.sha256(repr((seed, key, k)).encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
            toks = torch.randint(3, vocab, (answer_len,), generator=g)
            stop = int(torch.randint(1, answer_len + 2, (1,), generator=g))  # answer_len + 1: no stop token
            if stop <= answer_len:
                toks[stop - 1] = eos
                toks[stop:] = pad
            rows.append(toks)
        answers = torch.stack(rows).to(ids.device)
        return torch.cat([ids, answers], dim=1), torch.zeros(answers.shape, dtype=torch.float32)

    return generate


def run(program: str, argv: list[str], *, fixed_sampler: bool = False, weights: bool = False,
        score_fn=None) -> dict:
    """Run ``program`` with ``argv`` in this process (every rank); returns ``{"grads", "rows",
    "weights"}`` (weights only when asked: a gather). ``fixed_sampler``: step 3's answers come from
    :func:`answer_sampler` instead of the model (the rollouts then do not depend on the layout)."""
    from chatrl import cli
    from chatrl.tracking import METRICS_FILE, read_metrics

    cap = Capture()
    out = Path(argv[argv.index("--output_dir") + 1])
    with cap.active():
        if program in STEP3:
            from chatrl.step3_ppo.main import build, build_parser, train

            r = build(cli.parse(build_parser(), argv), score_fn=score_fn)
            if fixed_sampler:
                tok = r.tokenizer
                r.trainer.generate = answer_sampler(len(tok), tok.eos_token_id, tok.pad_token_id,
                                                    r.settings.rollout.max_answer_seq_len)
                r.trainer.weights = None  # not the hybrid engine's answers: no weight stamps
            train(r)
            del r
        else:
            module = {"sft": "chatrl.step1_sft.main", "reward": "chatrl.step2_reward.main",
                      "dpo": "chatrl.step2_dpo.main"}[program]
            import importlib

            result = importlib.import_module(module).run(argv)
            del result
        got = {"grads": cap.grads, "weights": cap.weights() if weights else None}
    dist.barrier()
    rows = read_metrics(out / METRICS_FILE) if dist.is_main() and (out / METRICS_FILE).exists() else []
    got["rows"] = [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/", "elapsed", "samples_per_s",
                                                                    "train/samples_per_s", "train/pairs_per_s"))}
                   for r in rows]
    cap.engines.clear()
    gc.collect()
    return got


def max_rel_diff(a: dict, b: dict) -> float:
    """The largest ``|a - b| / (|b| + 1e-12)`` over matching tensors of two ``{name: tensor}`` maps
    (inf when the names differ)."""
    if set(a) != set(b):
        return float("inf")
    worst = 0.0
    for k in a:
        d = (a[k] - b[k]).abs().max().item()
        worst = max(worst, d / (b[k].abs().max().item() + 1e-12))
    return worst


def rank_env() -> dict:
    """What the workers print about themselves."""
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "pid": os.getpid()}
