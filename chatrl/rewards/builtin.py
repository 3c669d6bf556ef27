"""Built-in rule rewards for verifiable tasks: an exact-match maths answer and a format check.

Both follow the reward-function signature of :mod:`chatrl.rewards.function`:
``fn(prompts: list[str], answers: list[str], metadata: list[dict]) -> list[float]``.
"""

from __future__ import annotations

import re
from fractions import Fraction

#: A number: optional sign, digits with optional thousands commas, optional decimals.
NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")

#: Default of :func:`regex_format`: the answer ends with a number.
DEFAULT_FORMAT_REGEX = r"[-+]?\d+(?:\.\d+)?\s*$"


def extract_final_number(text: str) -> Fraction | None:
    """The last number in ``text`` as an exact fraction, or ``None`` if there is none.

    ``"so 3 + 4 = 7."`` -> 7; ``"1,234.5"`` -> 2469/2; ``"-12"`` -> -12.
    """
    found = NUMBER.findall(str(text))
    return Fraction(found[-1].replace(",", "")) if found else None


def exact_match(prompts: list[str], answers: list[str], metadata: list[dict]) -> list[float]:
    """1.0 where the answer's final number equals the reference's final number, else 0.0.

    The reference is ``metadata[i]["reference"]`` (a string such as ``"42"`` or ``"x = 42"``, or a
    number). Numbers compare exactly (``"7.0"`` matches ``7``). An answer without a number scores 0.

    Raises:
        ValueError: a row without a reference, or whose reference holds no number (names the row).

    Source: the rule-based accuracy reward of DeepSeek-R1 (DeepSeek-AI 2025, section 2.2.2) and
    the final-answer match of GSM8K (Cobbe et al. 2021).
    """
    out = []
    for i, (answer, meta) in enumerate(zip(answers, metadata, strict=True)):
        if meta.get("reference") is None:
            raise ValueError(f"exact_match: row {i} has no 'reference' in its metadata")
        ref = extract_final_number(meta["reference"])
        if ref is None:
            raise ValueError(f"exact_match: row {i}'s reference {meta['reference']!r} holds no number")
        got = extract_final_number(answer)
        out.append(1.0 if got is not None and got == ref else 0.0)
    return out


def regex_format(prompts: list[str], answers: list[str], metadata: list[dict]) -> list[float]:
    """1.0 where the answer matches the row's format regular expression, else 0.0.

    The pattern is ``metadata[i]["format_regex"]`` when present, else :data:`DEFAULT_FORMAT_REGEX`;
    it is applied with :func:`re.search` (anchor it with ``^``/``$`` to match the whole answer).

    Raises:
        ValueError: a pattern that does not compile (names the row).

    Source: the format reward of DeepSeek-R1 (DeepSeek-AI 2025, section 2.2.2).
    """
    out = []
    for i, (answer, meta) in enumerate(zip(answers, metadata, strict=True)):
        pattern = meta.get("format_regex", DEFAULT_FORMAT_REGEX)
        try:
            ok = re.search(pattern, answer) is not None
        except (re.error, TypeError) as exc:
            raise ValueError(f"regex_format: row {i}'s format_regex {pattern!r} is invalid: {exc}") from None
        out.append(1.0 if ok else 0.0)
    return out

