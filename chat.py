#!/usr/bin/env python
"""Chat with a trained actor: ``python chat.py --path <actor folder>``.

Multi-turn: the whole conversation is formatted with the same function step 1 trained on
(:func:`chatrl.data.format_prompt`), so the model sees the prompt layout it learned. Answers
stream as they are generated. When the conversation would no longer fit the model's context
window (minus the answer budget), the oldest turns are dropped first. Type ``clear`` to start a
new conversation and ``quit`` (or Ctrl-D) to leave. Input may be piped: one user turn per line.

``python chat.py --web --path <actor> [--compare <other actor>]`` serves the same chat as a web page
on http://127.0.0.1:7860 (:mod:`chatrl.tools.web_chat`), side by side with a second model if given.

``python chat.py --path <actor> --env calculator`` chats with an environment's tools, as step 3's
``--env`` trains with them (``docs/multi_turn.md``): each answer goes to the environment, and while
it answers with an observation (shown as ``[tool] …``) the model answers again, up to
``--max_turns`` answers per user turn. The conversation's ids are then kept as sampled and
appended to, never re-tokenized (:class:`chatrl.conversation.ToolSession`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from chatrl import config
from chatrl.cli import normalize_argv
from chatrl.config import REQUIRED, setting
from chatrl.conversation import HUMAN_MARKER, ToolSession, prompt_ids_within
from chatrl.data.formatting import uses_chat_template
from chatrl.distributed.dist import place_threads_for_load
from chatrl.envs import load_environment
from chatrl.errors import UsageError
from chatrl.models import model_zoo
from chatrl.models.causal_lm import (
    check_context_window,
    context_window,
    load_chat_lm,
    load_tokenizer,
    sampling_settings,
    stop_token_ids,
)
from chatrl.models.precision import resolve_dtype
from chatrl.tools.web_chat import serve


@dataclass
class ChatConfig:
    """Chat."""

    path: str = setting(REQUIRED, "an HF model folder (e.g. a step-1 or step-3 actor) or hub name", type=str)
    max_new_tokens: int = setting(128, "answer budget per turn", unit="tokens")
    greedy: bool = setting(False, "greedy decoding instead of sampling")
    repetition_penalty: float = setting(1.0, "HF generate's repetition penalty (1: off)")
    seed: int | None = setting(None, "seed the sampler for reproducible answers", type=int)
    device: str | None = setting(None, "cpu, cuda, cuda:1, ... (default: cuda if available)", type=str)


@dataclass
class WebChatConfig:
    """The web chat (``--web``, :mod:`chatrl.tools.web_chat`)."""

    web: bool = setting(False, "serve a chat page instead of the terminal loop")
    host: str = setting("127.0.0.1", "address the web chat binds (0.0.0.0 exposes it to the network)")
    port: int = setting(7860, "web chat port")
    compare: str | None = setting(None, "a second model folder answering the same messages side by side "
                                        "(e.g. step 1's actor)", type=str)
    system_prompt: str = setting("", "initial system prompt of the web chat")


def build_parser() -> argparse.ArgumentParser:
    p = config.new_parser(__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config.add_block(p, ChatConfig)
    config.add_block(p, config.SamplingConfig, defaults={"temperature": 0.7, "top_p": 0.9})
    config.add_block(p, config.ModelConfig, only=("trust_remote_code", "dtype"), defaults={"dtype": "auto"})
    config.add_block(p, config.EnvConfig, only=("env", "env_args", "max_turns"), title="tools of an environment")
    config.add_block(p, WebChatConfig, title='web chat (pip install -e ".[web]")')
    return p


def answer_streamer(tokenizer):
    """transformers' ``TextStreamer`` (prompt skipped, special tokens dropped) that drops the
    answer's leading whitespace, so that it reads ``Assistant: Hello`` whatever the tokenizer
    makes of the first token (``Assistant:He`` with stories260K, ``Assistant:  He`` with a leading-space token)."""
    from transformers import TextStreamer

    class AnswerStreamer(TextStreamer):
        started = False

        def on_finalized_text(self, text: str, stream_end: bool = False):
            if not self.started:
                text = text.lstrip()
                self.started = bool(text)
            super().on_finalized_text(text, stream_end=stream_end)

    return AnswerStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def human_turns(interactive: bool, clear: Callable[[], None]) -> Iterator[str]:
    """The lines a person types at the terminal chat, blank ones skipped: ``quit``, Ctrl-D or Ctrl-C at the
    prompt end them (no traceback), ``clear`` calls ``clear()`` and says so. Piped input (not a terminal)
    is echoed after a ``Human:`` label, so a transcript reads as a conversation."""
    while True:
        try:
            text = input("\nHuman: " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if not interactive:
            print(f"\nHuman: {text}")
        if text.strip() == "quit":
            return
        if text.strip() == "clear":
            clear()
            print("(conversation cleared)")
            continue
        if text.strip():
            yield text


def check_model_folder(parser, flag: str, path: str | None) -> None:
    """Refuse, in one line, a model path that names a local folder that does not exist (it starts
    with ``/``, ``.`` or ``~``, its first part is a folder here: ``output/step3_rlhf/actr``, or it has
    more parts than a hub name's ``namespace/name``: ``output/step3_rlhf/actor`` before any run);
    hub names (``facebook/opt-1.3b``) are left to the loader."""
    if not path or Path(path).expanduser().is_dir():
        return
    if path.startswith(("/", ".", "~")) or Path(path.split("/", 1)[0]).expanduser().is_dir() \
            or path.strip("/").count("/") >= 2:
        parser.error(f"{flag} {path}: no such folder (a trained model's folder, e.g. output/step3_rlhf/actor)")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(normalize_argv(sys.argv[1:] if argv is None else argv))
    for flag in ("path", "compare"):
        check_model_folder(build_parser(), f"--{flag}", getattr(args, flag, None))
        if getattr(args, flag, None) and not Path(getattr(args, flag)).is_dir():
            try:  # a packaged model's name (smollm2-135m-instruct), a short name or a .gguf file
                setattr(args, flag, model_zoo.resolve(getattr(args, flag)))
            except UsageError as err:
                build_parser().error(f"--{flag}: {err}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.web:
        if args.env:
            build_parser().error("--env works in the terminal chat, not with --web")
        return serve(args)
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


    try:
        sampling = sampling_settings(args.temperature, args.top_k, args.top_p, greedy=args.greedy)
        check_context_window(args.path, {"--max_new_tokens + 1 prompt token": args.max_new_tokens + 1},
                             args.trust_remote_code)
    except ValueError as e:
        build_parser().error(str(e))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(place_threads_for_load("chatrl chat"), flush=True)
    tokenizer = load_tokenizer(args.path, padding_side="left", trust_remote_code=args.trust_remote_code)
    dtype, why = resolve_dtype(args.dtype, torch.device(device).type)
    model = load_chat_lm(args.path, dtype, device, args.trust_remote_code, tokenizer)
    window = context_window(model.config) or tokenizer.model_max_length
    budget = max(1, window - args.max_new_tokens)  # >= 1 checked above when the config names its window
    if args.seed is not None:
        torch.manual_seed(args.seed)
    stop = None if uses_chat_template(tokenizer) else [HUMAN_MARKER]
    interactive = sys.stdin.isatty()
    if args.env:
        try:
            session = ToolSession(tokenizer, load_environment(args.env, args.env_args), args.max_turns or 4,
                                  stop_token_ids(tokenizer, model))
        except ValueError as e:
            build_parser().error(str(e))
        return tool_chat(session, model, tokenizer, args, sampling, budget, interactive)
    history: list[dict] = []
    print(f"chatrl chat: {args.path} (context {window} tokens, {dtype}{f' ({why})' if why else ''}). "
          "Type 'clear' to reset, 'quit' to leave.", flush=True)
    for text in human_turns(interactive, history.clear):
        history.append({"role": "user", "content": text})
        ids, kept = prompt_ids_within(tokenizer, history, budget)
        history[:] = kept  # the oldest turns dropped to fit the context window
        input_ids = torch.tensor([ids], device=device)
        print("Assistant: ", end="", flush=True)
        streamer = answer_streamer(tokenizer)
        try:
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=args.max_new_tokens,
                    **sampling, repetition_penalty=args.repetition_penalty, eos_token_id=stop_token_ids(tokenizer, model),
                    pad_token_id=tokenizer.pad_token_id, stop_strings=stop, tokenizer=tokenizer, streamer=streamer)
        except KeyboardInterrupt:  # Ctrl-C during an answer: drop it, keep the conversation
            print("\n(answer stopped)")
            history.pop()
            continue
        answer = tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
        answer = answer.split(HUMAN_MARKER)[0].strip() if stop else answer.strip()
        history.append({"role": "assistant", "content": answer})


def tool_chat(session: ToolSession, model, tokenizer, args, sampling: dict, budget: int, interactive: bool) -> None:
    """The terminal loop of a chat with an environment's tools (module docstring)."""
    import torch

    print(f"chatrl chat with --env {args.env}: observations are shown as [role] text. Type 'clear' to reset, "
          "'quit' to leave.", flush=True)
    for text in human_turns(interactive, session.clear):
        ids = session.user(text)
        while True:
            if len(ids) > budget:
                print("\n(the conversation no longer fits the context window; type 'clear')")
                break
            input_ids = torch.tensor([ids], device=model.device)
            print("Assistant: ", end="", flush=True)
            try:
                with torch.no_grad():
                    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                         max_new_tokens=args.max_new_tokens, **sampling,
                                         repetition_penalty=args.repetition_penalty,
                                         eos_token_id=sorted(session.stops, key=lambda i: i != session.eot),
                                         pad_token_id=tokenizer.pad_token_id, streamer=answer_streamer(tokenizer))
            except KeyboardInterrupt:  # Ctrl-C during an answer: its ids are half there, start over
                print("\n(answer stopped; conversation cleared)")
                session.clear()
                break
            observation = session.answer(out[0, input_ids.shape[1]:].tolist())
            if observation is None:
                break
            for m in observation:
                print(f"[{m['role']}] {m['content']}", flush=True)
            ids = list(session.ids.ids)


if __name__ == "__main__":
    main()
