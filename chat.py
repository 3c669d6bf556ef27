#!/usr/bin/env python
"""Chat with a trained actor: ``python chat.py --path <actor folder>``.

Multi-turn: the whole conversation is formatted with the same function step 1 trained on
(:func:`chatrl.data.format_prompt`), so the model sees the prompt layout it learned. Answers
stream as they are generated. When the conversation would no longer fit the model's context
window (minus the answer budget), the oldest turns are dropped first. Type ``clear`` to start a
new conversation and ``quit`` (or Ctrl-D) to leave. Input may be piped: one user turn per line.

``python chat.py --web --path <actor> [--compare <other actor>]`` serves the same chat as a web page
on http://127.0.0.1:7860 (:mod:`chatrl.web_chat`), side by side with a second model if given.
"""

from __future__ import annotations

import argparse
import os
import sys

from chatrl.cli import normalize_argv
from chatrl.conversation import HUMAN_MARKER, prompt_ids_within


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", required=True, help="an HF model folder (e.g. a step-1 or step-3 actor) or hub name")
    p.add_argument("--max_new_tokens", type=int, default=128, help="answer budget per turn (tokens)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top_p", type=float, default=0.9)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--repetition_penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="seed the sampler for reproducible answers")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, … (default: cuda if available)")
    p.add_argument("--trust_remote_code", action="store_true")
    g = p.add_argument_group("web chat (pip install -e \".[web]\")")
    g.add_argument("--web", action="store_true", help="serve a chat page instead of the terminal loop")
    g.add_argument("--host", default="127.0.0.1", help="address the web chat binds (0.0.0.0 exposes it to the network)")
    g.add_argument("--port", type=int, default=7860, help="web chat port")
    g.add_argument("--compare", default=None,
                   help="a second model folder answering the same messages side by side (e.g. step 1's actor)")
    g.add_argument("--system_prompt", default="", help="initial system prompt of the web chat")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(normalize_argv(sys.argv[1:] if argv is None else argv))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.web:
        from chatrl.web_chat import serve

        return serve(args)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, TextStreamer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    from chatrl.data.formatting import uses_chat_template
    from chatrl.models import load_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(args.path, padding_side="left", trust_remote_code=args.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(args.path, trust_remote_code=args.trust_remote_code).to(device).eval()
    window = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
    budget = max(8, window - args.max_new_tokens)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    stop = None if uses_chat_template(tokenizer) else [HUMAN_MARKER]
    interactive = sys.stdin.isatty()
    history: list[dict] = []
    print(f"chatrl chat: {args.path} (context {window} tokens). Type 'clear' to reset, 'quit' to leave.", flush=True)
    while True:
        try:
            text = input("\nHuman: " if interactive else "")
        except EOFError:
            break
        if not interactive:
            print(f"\nHuman: {text}")
        if text.strip() == "quit":
            break
        if text.strip() == "clear":
            history = []
            print("(conversation cleared)")
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        ids, history = prompt_ids_within(tokenizer, history, budget)
        input_ids = torch.tensor([ids], device=device)
        print("Assistant:", end="", flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=args.max_new_tokens,
                do_sample=not args.greedy, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                repetition_penalty=args.repetition_penalty, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, stop_strings=stop, tokenizer=tokenizer, streamer=streamer)
        answer = tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
        answer = answer.split(HUMAN_MARKER)[0].strip() if stop else answer.strip()
        history.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    main()
