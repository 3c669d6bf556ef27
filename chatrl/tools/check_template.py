"""``python -m chatrl.tools.check_template MODEL_OR_TOKENIZER [--conversations FILE]``: the chat-template
checker (:mod:`chatrl.data.template_check`, ``docs/multi_turn.md``).

Renders multi-turn conversations (system and tool turns where the template supports them) through
chatrl's formatting and prints the findings table: prefix preservation, the trained end-of-turn
token, what is in the loss, the template's own ``{% generation %}`` mask, and token-in/token-out.
Exits 0 when every check passes (or is n/a), 1 when one fails, 2 on bad input.

``--conversations FILE``: a ``.json`` list or a ``.jsonl`` file of conversations, each a list of
``{"role", "content"}`` messages or ``{"name": ..., "messages": [...]}``; by default a built-in set
(single turn, system and multi-turn, two tool calls, control-token text, ``<think>`` blocks).
``--chat_template FILE`` tries a Jinja template with the tokenizer (its markers must be tokens of
the tokenizer to be special).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from chatrl import config
from chatrl.cli import normalize_argv
from chatrl.config import REQUIRED, setting
from chatrl.data.formatting import check_messages
from chatrl.data.template_check import check_tokenizer, failures, format_table
from chatrl.errors import UsageError
from chatrl.models.causal_lm import load_tokenizer


@dataclass
class CheckTemplateConfig:
    """The chat-template checker."""

    model_name_or_path: str = setting(REQUIRED, "a model or tokenizer folder (or hub name) whose tokenizer to check",
                                      type=str)
    conversations: str | None = setting(None, "a .json list or .jsonl file of conversations (lists of "
                                              "{role, content} messages); unset: the built-in set", type=str)
    chat_template: str | None = setting(None, "a Jinja chat template file to use instead of the tokenizer's", type=str)


def build_parser() -> argparse.ArgumentParser:
    """The checker's flags (the model is positional)."""
    p = config.new_parser(__doc__.split("\n\n")[0], prog="python -m chatrl.tools.check_template")
    p.add_argument("model_name_or_path", help=CheckTemplateConfig.__dataclass_fields__["model_name_or_path"]
                   .metadata["help"])
    config.add_block(p, CheckTemplateConfig, exclude=("model_name_or_path",))
    config.add_block(p, config.ModelConfig, only=("trust_remote_code",))
    return p


def read_conversations(path: str) -> dict[str, list[dict]]:
    """``{name: messages}`` from a ``.json`` list or ``.jsonl`` file (module docstring).

    Raises:
        UsageError: an unreadable file, or a conversation that is not a list of messages (names the
            file and the conversation).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        rows = json.loads(text) if p.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
    except (OSError, ValueError) as exc:
        raise UsageError(f"--conversations {path}: cannot read it: {exc}") from None
    if not isinstance(rows, list) or not rows:
        raise UsageError(f"--conversations {path}: expected a non-empty list of conversations")
    out: dict[str, list[dict]] = {}
    for i, row in enumerate(rows):
        name, msgs = (row.get("name", f"conversation {i}"), row.get("messages")) if isinstance(row, dict) else \
            (f"conversation {i}", row)
        try:
            check_messages(msgs, prompt=False)
        except (ValueError, TypeError, AttributeError) as exc:
            raise UsageError(f"--conversations {path}: conversation {i}: {exc}") from None
        if not any(m["role"] == "assistant" for m in msgs):
            raise UsageError(f"--conversations {path}: conversation {i} has no assistant turn to check")
        out[str(name)] = msgs
    return out


def main(argv: list[str] | None = None) -> int:
    """Print the findings table; return the exit code (0 pass, 1 a check failed)."""
    args = build_parser().parse_args(normalize_argv(sys.argv[1:] if argv is None else argv))
    try:
        conversations = read_conversations(args.conversations) if args.conversations else None
        tokenizer = load_tokenizer(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
        if args.chat_template:
            tokenizer.chat_template = Path(args.chat_template).read_text(encoding="utf-8")
    except (UsageError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    findings = check_tokenizer(tokenizer, conversations)
    layout = "chat template" if getattr(tokenizer, "chat_template", None) else "Human/Assistant convention"
    print(format_table(findings, f"{args.model_name_or_path} ({layout})"))
    bad = failures(findings)
    print(f"\n{len(bad)} failed check(s)" if bad else "\nevery check passed (or is n/a)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
