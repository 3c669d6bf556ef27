"""Built-in rule rewards for verifiable tasks: an exact-match maths answer and a format check.

Both follow the reward-function signature of :mod:`chatrl.rewards.function`:
``fn(prompts: list[str], answers: list[str], metadata: list[dict]) -> list[float]``.

The number grammar of :func:`exact_match` (``docs/rewards.md`` lists it with a table of cases):

* the value read from a text is, in order of precedence, the content of the last ``\\boxed{…}``
  (which must be one number), the first number after the last "answer is" / "answer:" /
  "####", else the last number of the text;
* a number is an optional sign (``-``, ``+``, ``−``; a ``-`` right after a number, letter or
  closing bracket is a subtraction, not a sign), digits with optional thousands commas
  (``1,234``), optional decimals (``0.75``, ``.5``), an optional exponent (``1e-05``,
  ``2.5 × 10^3``, ``2.5 \\times 10^{3}``), a fraction (``3/4``, ``\\frac{3}{4}``, ``\\dfrac34``) or a
  mixed number (``1 1/2``); a trailing ``%`` is ignored;
* a number that is part of an expression is no value: a term of a sum, difference, product or
  quotient (``3 + 4``; ``3 + 4 = 7`` reads 7), glued to a letter before it (``x2``), a base or
  exponent of ``^`` (``2^10``), a subscript, followed by ``!``, ``π``/``\\pi`` or inside a root,
  a date-like chain ``3/4/2020``, and a ``\\frac`` whose parts are not numbers; an answer whose
  value would be such a number has none (score 0): expressions are not evaluated;
* values compare exactly, as fractions (``0.75`` equals ``3/4``, ``7.0`` equals ``7``).
"""

from __future__ import annotations

import re
from fractions import Fraction

#: Default of :func:`regex_format`: the answer ends with a number.
DEFAULT_FORMAT_REGEX = r"[-+]?\d+(?:\.\d+)?\s*$"

#: An unsigned decimal number: digits with optional thousands commas, decimals, exponent.
UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
_SIGNED = re.compile(rf"\s*(?P<sign>[-+\u2212])?\s*(?P<num>{UNSIGNED})\s*")
_FRAC = r"\\[dt]?frac\s*(?:\{(?P<fn>[^{}]*)\}|(?P<fn1>\d))\s*(?:\{(?P<fd>[^{}]*)\}|(?P<fd1>\d))"
_ATOM = re.compile(
    rf"(?P<frac>{_FRAC})"
    rf"|(?P<chain>{UNSIGNED}(?:\s*/\s*{UNSIGNED}){{2,}})"
    rf"|(?P<whole>\d+)[ \t]+(?P<mn>\d+)\s*/\s*(?P<md>\d+)(?![\d.,/])"
    rf"|(?P<n>{UNSIGNED})(?:\s*/\s*(?P<d>{UNSIGNED}))?")
# "2.5 × 10^3", "2.5 \times 10^{-3}", "2.5*10^3" → "2.5e3"
_SCIENTIFIC = re.compile(rf"(?P<m>{UNSIGNED})\s*(?:\\times|\\cdot|×|·|\*|x)\s*10\s*\^\s*\{{?\s*(?P<e>[-+\u2212]?\d+)\s*\}}?")
_ANSWER_IS = re.compile(r"answer\s*(?:is|was|:|=)|####", re.IGNORECASE)
_GLUED_BEFORE = re.compile(r"(?:[^\W\d_]|[._\\^]|(?:\\sqrt\s*(?:\[[^\]]*\])?|[\^_])\s*\{?\s*)$")
_GLUED_AFTER = re.compile(r"\s*(?:\^|!|π|√|\\pi\b|\\sqrt)")
_THIN_SPACES = re.compile(r"\\[!,;:]|\$|\\%|%|\\left|\\right")
_BOXED_WORDS = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{[^{}]*\}")


#: Numbers whose decimal exponent is larger than this in magnitude, or that have more digits than
#: MAX_DIGITS, are not read as values: ``1e999999`` would take minutes as an exact fraction, 5,000
#: digits pass Python's integer conversion limit, and no answer is such a number.
MAX_EXPONENT = 400
MAX_DIGITS = 1000
_EXPONENT = re.compile(r"[eE]([-+]?\d+)$")


def _exact(num: str) -> Fraction | None:
    """``num`` (an ``UNSIGNED`` match) as an exact fraction, thousands commas dropped; None when its
    exponent passes :data:`MAX_EXPONENT` or its digits :data:`MAX_DIGITS`."""
    e = _EXPONENT.search(num)
    if (e and abs(int(e.group(1))) > MAX_EXPONENT) or len(num) > MAX_DIGITS + 40:
        return None
    return Fraction(num.replace(",", ""))


def _fraction(text: str | None) -> Fraction | None:
    if text is None:
        return None
    m = _SIGNED.fullmatch(_clean(text))
    if not m:
        return None
    value = _exact(m["num"])
    if value is None:
        return None
    return -value if m["sign"] in ("-", "\u2212") else value


def _quotient(n: Fraction | None, d: Fraction | None) -> Fraction | None:
    return n / d if n is not None and d is not None and d != 0 else None


def _atom_value(m: re.Match) -> Fraction | None:
    """The value of one ``_ATOM`` match without its sign, or None for an expression."""
    if m["frac"]:
        return _quotient(_fraction(m["fn"] if m["fn"] is not None else m["fn1"]),
                         _fraction(m["fd"] if m["fd"] is not None else m["fd1"]))
    if m["chain"]:
        return None
    if m["whole"]:
        mn, md = int(m["mn"]), int(m["md"])
        return Fraction(int(m["whole"])) + Fraction(mn, md) if 0 < mn < md else None
    n = _exact(m["n"])
    return _quotient(n, _exact(m["d"])) if m["d"] else n


def _clean(text: str) -> str:
    """Scientific notation as ``e`` exponents, LaTeX thin spaces, ``$`` and ``%`` out, ``{,}`` as a comma."""
    text = _SCIENTIFIC.sub(lambda m: f"{m['m']}e{m['e'].replace(chr(0x2212), '-')}", str(text))
    return _THIN_SPACES.sub("", text.replace("{,}", ",")).replace("\\ ", " ")


_OPERATORS = "+-\u2212*×/÷·"


def _sign(text: str, start: int) -> int:
    """How the number at ``text[start]`` is preceded: -1 after a unary minus, 0 after a binary
    operator (the number is a term of an expression), else 1. A '-' or '+' after a digit, a closing
    bracket or a one-letter variable (``x - 5``) is binary; after a word (``is -5``) or at the
    start it is a sign."""
    i = start - 1
    while i >= 0 and text[i].isspace():
        i -= 1
    if i < 0 or text[i] not in _OPERATORS:
        return 1
    if text[i] not in "-+\u2212":
        return 0
    j = i - 1
    while j >= 0 and text[j].isspace():
        j -= 1
    if j >= 0 and (text[j].isdigit() or text[j] in ")]}" or
                   (text[j].isalpha() and (j == 0 or not text[j - 1].isalpha()))):
        return 0
    if j >= 0 and text[j] in _OPERATORS:  # 2 * -3: a signed term
        return 0
    return -1 if text[i] in "-\u2212" else 1


_OPERATOR_AFTER = re.compile(r"\s*[-+\u2212*×/÷·]\s*[\w(\\.]")


def numbers_in(text: str) -> list[Fraction | None]:
    """Every number of ``text`` (cleaned by :func:`_clean`) in order, as an exact fraction; None for
    one that is part of an expression (module docstring): glued to a letter, a power, a root or a
    factorial, or a term of a sum, difference, product or quotient (``3 + 4`` holds no value;
    ``3 + 4 = 7`` holds 7)."""
    out = []
    for m in _ATOM.finditer(text):
        sign = _sign(text, m.start())
        glued = (_GLUED_BEFORE.search(text, max(0, m.start() - 24), m.start()) or _GLUED_AFTER.match(text, m.end())
                 or _OPERATOR_AFTER.match(text, m.end()) or sign == 0)
        value = None if glued else _atom_value(m)
        out.append(None if value is None else sign * value)
    return out


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` (braces balanced), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1:i]
    return None


def final_value(text) -> Fraction | None:
    """The answer value of ``text`` as an exact fraction, or None: the ``\\boxed{}`` content (one
    number), else the first number after the last "answer is" / "####", else the last number.

    ``"so 3 + 4 = 7."`` -> 7; ``"the answer is 3/4, not 1/4"`` -> 3/4; ``"1e-05"`` -> 1/100000;
    ``"\\boxed{\\frac{3}{4}}"`` -> 3/4; ``"\\boxed{x+1}"`` -> None; ``"2^10"`` -> None.
    """
    text = str(text)
    boxed = _boxed(text)
    if boxed is not None:
        inner = _clean(_BOXED_WORDS.sub("", boxed)).rsplit("=", 1)[-1].strip().rstrip(".").strip()
        found = list(_ATOM.finditer(inner))
        if len(found) != 1 or inner[:found[0].start()].strip() not in ("", "-", "+", "\u2212") \
                or inner[found[0].end():].strip():
            return None
        return numbers_in(inner)[0]
    cue = next(reversed(list(_ANSWER_IS.finditer(text))), None)
    if cue is not None:
        return next((v for v in numbers_in(_clean(text[cue.end():])) if v is not None), None)
    found = numbers_in(_clean(text))
    return found[-1] if found else None


def extract_final_number(text: str) -> Fraction | None:
    """The answer value of ``text`` (:func:`final_value`); kept under its former name."""
    return final_value(text)


def reference_value(reference) -> Fraction | None:
    """A row's reference as an exact fraction: a number (``1e-05`` is 1/100000, not -5) or a text
    read by :func:`final_value`; None for a boolean or a text without a value."""
    if isinstance(reference, bool):
        return None
    if isinstance(reference, int):
        return Fraction(reference)
    if isinstance(reference, float):
        return Fraction(repr(reference)) if reference == reference and abs(reference) != float("inf") else None
    return final_value(reference)


def exact_match(prompts: list[str], answers: list[str], metadata: list[dict]) -> list[float]:
    """1.0 where the answer's value equals the reference's value exactly, else 0.0.

    The reference is ``metadata[i]["reference"]`` (a string such as ``"42"``, ``"3/4"``,
    ``"x = 42"`` or ``"\\boxed{0.75}"``, or a number). Both are read by :func:`final_value`
    (grammar in the module docstring and docs/rewards.md) and compared as fractions (``"0.75"``
    matches ``"3/4"``); an answer without a value (none, or an expression) scores 0.

    Raises:
        ValueError: a row without a reference, or whose reference holds no number (names the row).

    Source: the rule-based accuracy reward of DeepSeek-R1 (DeepSeek-AI 2025, section 2.2.2) and
    the final-answer match of GSM8K (Cobbe et al. 2021).
    """
    out = []
    for i, (answer, meta) in enumerate(zip(answers, metadata, strict=True)):
        if meta.get("reference") is None:
            raise ValueError(f"exact_match: row {i} has no 'reference' in its metadata: its prompt rows need a "
                             "\"reference\" (the expected answer; scripts/make_arith_task.py writes them, docs/rewards.md)")
        ref = reference_value(meta["reference"])
        if ref is None:
            raise ValueError(f"exact_match: row {i}'s reference {meta['reference']!r} holds no number")
        got = final_value(answer)
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
