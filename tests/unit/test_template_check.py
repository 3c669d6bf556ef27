"""The chat-template checker (chatrl.data.template_check, python -m chatrl.tools.check_template) on every
tokenizer under ../shared and on the Jinja fixtures of tests/data/templates (Llama-3, Llama-2 and
Phi-3 styles, ChatML with {% generation %} marks, and deliberately broken templates, each of which
must be caught by the right check with the right message). Run with -s to see the findings tables."""

import json
from pathlib import Path

import pytest

from chatrl.data.template_check import CHECKS, FAIL, NA, PASS, check_tokenizer, format_table
from chatrl.models.causal_lm import load_tokenizer
from chatrl.tools import check_template
from tests.conftest import SHARED

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "templates"
FIXTURES = json.loads((TEMPLATES / "fixtures.json").read_text())
CONVERSATIONS = ("single_turn", "multi_turn_system", "tool_calls", "control_text", "think")


def fixture_tokenizer(name: str):
    """The fixture's base tokenizer from ../shared, its markers added as special tokens, its template set."""
    spec = FIXTURES[name]
    tok = load_tokenizer(str(SHARED / spec["tokenizer"]))
    if spec["special_tokens"]:
        tok.add_special_tokens({"additional_special_tokens": spec["special_tokens"]})
    if spec.get("bos_token"):
        tok.bos_token = spec["bos_token"]
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def table(findings) -> dict[str, str]:
    """conversation -> one letter per check (p pass, F fail, - n/a), in CHECKS order."""
    letter = {PASS: "p", FAIL: "F", NA: "-"}
    out: dict[str, str] = {}
    for f in findings:
        out[f.conversation] = out.get(f.conversation, "") + letter[f.status]
    return out


ALL_PASS_NO_MASK = "pppp-p"  # every check passes; no {% generation %} mask to compare


@pytest.mark.parametrize("path", ["tokenizers/gpt2", "tokenizers/qwen2", "models/stories260K"])
def test_every_shared_tokenizer_passes(path):
    findings = check_tokenizer(load_tokenizer(str(SHARED / path)))
    print("\n" + format_table(findings, path))
    assert [f.check for f in findings[:len(CHECKS)]] == list(CHECKS)
    assert table(findings) == {c: ALL_PASS_NO_MASK for c in CONVERSATIONS}


# What each fixture gives, per conversation (checks in CHECKS order: renders, prefix, end_of_turn,
# loss_mask, template_mask, token_in_token_out).
EXPECTED = {
    "llama3": {c: ALL_PASS_NO_MASK for c in CONVERSATIONS},
    # Llama 2 refuses a tool turn (roles must alternate): that conversation is n/a, loudly, not wrong
    "llama2": {**{c: ALL_PASS_NO_MASK for c in CONVERSATIONS}, "tool_calls": "------"},
    # Phi-3 writes nothing for a tool turn: the model would never see the tool's output
    "phi3": {**{c: ALL_PASS_NO_MASK for c in CONVERSATIONS}, "tool_calls": "Fppp-p"},
    "chatml_generation": {**{c: "pppppp" for c in CONVERSATIONS}, "control_text": ALL_PASS_NO_MASK},
    "broken_no_end_of_turn": {c: "ppFp-F" for c in CONVERSATIONS},
    "broken_generation_prompt": {c: "pFpp-p" for c in CONVERSATIONS},
    "broken_last_turn_only": {"single_turn": "pFpp-F", "multi_turn_system": "pFFFFF", "tool_calls": "pFFFFF",
                              "control_text": "pFpp-F", "think": "pFFFFF"},
    "broken_drops_think": {**{c: ALL_PASS_NO_MASK for c in CONVERSATIONS}, "think": "pFpp-p"},
    "broken_generation_mask": {**{c: "ppppFp" for c in CONVERSATIONS}, "control_text": ALL_PASS_NO_MASK},
}

# The message each broken fixture must give (check, conversation, text in the detail).
CAUGHT = {
    "phi3": ("renders", "tool_calls", "turn 2 (tool) is dropped"),
    "broken_no_end_of_turn": ("end_of_turn", "single_turn", "the template writes no special token after assistant "
                                                            "turn 0"),
    "broken_generation_prompt": ("prefix", "single_turn", "assistant turn 0 does not extend its generation prompt"),
    "broken_last_turn_only": ("prefix", "multi_turn_system", "re-renders earlier turns"),
    "broken_drops_think": ("prefix", "think", "the prompt of assistant turn 1 does not extend turn 0"),
    "broken_generation_mask": ("template_mask", "single_turn", "the template's mask alone covers position 9"),
}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_fixture_templates(name):
    findings = check_tokenizer(fixture_tokenizer(name))
    print("\n" + format_table(findings, name))
    assert table(findings) == EXPECTED[name]
    if name in CAUGHT:
        check, conv, text = CAUGHT[name]
        detail = next(f.detail for f in findings if f.check == check and f.conversation == conv)
        assert text in detail, detail


def test_broken_generation_mask_names_the_header_tokens():
    findings = check_tokenizer(fixture_tokenizer("broken_generation_mask"), {"one": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]})
    detail = next(f.detail for f in findings if f.check == "template_mask")
    assert ">>151644:'<|im_start|>'" in detail  # the assistant header the template's mask trains


def test_cli_exit_codes_and_conversation_files(tmp_path, capsys):
    qwen = str(SHARED / "tokenizers" / "qwen2")
    assert check_template.main([qwen]) == 0
    assert "every check passed" in capsys.readouterr().out
    assert check_template.main([qwen, "--chat_template", str(TEMPLATES / "broken_no_end_of_turn.jinja")]) == 1
    assert "FAIL" in capsys.readouterr().out
    convs = tmp_path / "c.jsonl"
    convs.write_text(json.dumps({"name": "mine", "messages": [{"role": "user", "content": "a"},
                                                              {"role": "assistant", "content": "b"}]}) + "\n")
    assert check_template.main([qwen, "--conversations", str(convs)]) == 0
    assert "| mine |" in capsys.readouterr().out
    convs.write_text(json.dumps([{"role": "user", "content": "a"}]) + "\n")
    assert check_template.main([qwen, "--conversations", str(convs)]) == 2
    assert "conversation 0 has no assistant turn" in capsys.readouterr().err


def test_startup_check_stops_with_the_table_or_logs_the_skip(caplog, tmp_path):
    import logging

    from chatrl.data.template_check import check_startup, startup_conversations
    from chatrl.errors import UsageError

    rows = tmp_path / "sft.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                                             {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao."}]})
                    + "\n" + json.dumps({"prompt": "Name a colour.", "chosen": "Blue."}) + "\n")
    convs = startup_conversations([str(rows)])
    assert list(convs) == ["row 0"] and len(convs["row 0"]) == 4  # a conversation sample whole
    log = logging.getLogger("test")
    broken = fixture_tokenizer("broken_drops_think")
    convs["think"] = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "<think>x</think> A."},
                      {"role": "user", "content": "!"}, {"role": "assistant", "content": "B."}]
    with pytest.raises(UsageError, match="would mis-train these conversations") as err:
        check_startup(broken, convs, "step 1", skip=False, log=log)
    assert "| think | pass | FAIL |" in str(err.value) and "--skip_template_check" in str(err.value)
    with caplog.at_level(logging.INFO, logger="test"):
        check_startup(broken, convs, "step 1", skip=True, log=log)
        check_startup(load_tokenizer(str(SHARED / "tokenizers" / "qwen2")), convs, "step 3", skip=False, log=log)
    assert "the chat-template check is skipped (--skip_template_check)" in caplog.text
    assert "step 3: chat-template check passed on 2 conversations" in caplog.text
