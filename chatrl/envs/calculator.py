"""The calculator tool: the model writes ``<calc>EXPRESSION</calc>``, the environment answers with
the value in a tool turn, and a turn without a call is the final answer, rewarded 1 when its last
number equals the row's ``reference`` (``docs/multi_turn.md``, "Built-in environments").

A call is untrusted text. It is evaluated by a small parser of its own (never ``eval``): ASCII
decimal numbers, ``+ - * /``, unary signs and parentheses, exact rational arithmetic
(:class:`fractions.Fraction`), with limits on the expression's length, the digits of a number, the
nesting depth and the size of every intermediate result. Whatever the text, the tool answers
``"error: …"`` instead of raising, and every call is bounded in time (the fuzz test in
``tests/unit/test_envs.py`` feeds it thousands of random and hostile strings).
"""

from __future__ import annotations

from fractions import Fraction

from chatrl.rewards.builtin import extract_final_number

CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"

#: Limits on a call (each one gives an ``error:`` answer, never an exception).
MAX_EXPRESSION_CHARS = 200
MAX_NUMBER_DIGITS = 30
MAX_DEPTH = 32
MAX_RESULT_BITS = 256  # numerator and denominator of every intermediate value
DECIMALS = 10  # a non-terminating quotient is rounded to this many decimals

INSTRUCTIONS = ("You can use a calculator: write <calc>EXPRESSION</calc> (numbers, + - * / and parentheses) "
                "and nothing else in your turn, and its result comes back. Then give the answer.")


class CalcError(ValueError):
    """An expression the calculator refuses (its message is the tool's answer after ``error:``)."""


def _tokens(text: str) -> list[str]:
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\n":
            i += 1
        elif c in "+-*/()":
            out.append(c)
            i += 1
        elif "0" <= c <= "9" or c == ".":
            j = i
            while j < n and ("0" <= text[j] <= "9" or text[j] == "."):
                j += 1
            num = text[i:j]
            if num.count(".") > 1 or num == ".":
                raise CalcError(f"bad number {num[:20]!r}")
            if len(num.replace(".", "")) > MAX_NUMBER_DIGITS:
                raise CalcError(f"a number has more than {MAX_NUMBER_DIGITS} digits")
            out.append(num)
            i = j
        else:
            raise CalcError(f"unexpected character {c!r}")
    return out


class _Parser:
    """Recursive descent over ``expr := term (('+'|'-') term)*``, ``term := factor (('*'|'/') factor)*``,
    ``factor := ('+'|'-') factor | NUMBER | '(' expr ')'``, with a depth limit."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.at = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise CalcError("the expression ends too early")
        self.at += 1
        return tok

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term(depth)
            value = _checked(value + rhs if op == "+" else value - rhs)
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.factor(depth)
            if op == "/" and rhs == 0:
                raise CalcError("division by zero")
            value = _checked(value * rhs if op == "*" else value / rhs)
        return value

    def factor(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise CalcError(f"nested deeper than {MAX_DEPTH}")
        tok = self.take()
        if tok in ("+", "-"):
            value = self.factor(depth + 1)
            return -value if tok == "-" else value
        if tok == "(":
            value = self.expr(depth + 1)
            if self.peek() != ")":
                raise CalcError("a '(' is not closed")
            self.take()
            return value
        if tok in ("*", "/", ")"):
            raise CalcError(f"unexpected {tok!r}")
        return Fraction(tok)


def _checked(x: Fraction) -> Fraction:
    if x.numerator.bit_length() > MAX_RESULT_BITS or x.denominator.bit_length() > MAX_RESULT_BITS:
        raise CalcError("the result is too large")
    return x


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic ``expression`` (module docstring).

    Raises:
        CalcError: anything but a well-formed expression within the limits (too long, a character
            other than digits, ``.``, ``+ - * / ( )`` and spaces, a number of more than
            :data:`MAX_NUMBER_DIGITS` digits, nesting deeper than :data:`MAX_DEPTH`, an
            intermediate value beyond :data:`MAX_RESULT_BITS` bits, division by zero).
    """
    if not isinstance(expression, str):
        raise CalcError("not text")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    tokens = _tokens(expression)
    if not tokens:
        raise CalcError("empty expression")
    parser = _Parser(tokens)
    value = parser.expr(0)
    if parser.peek() is not None:
        raise CalcError(f"unexpected {parser.peek()!r}")
    return value


def format_number(x: Fraction) -> str:
    """``x`` as the tool writes it: an integer as digits, other values with up to
    :data:`DECIMALS` decimals (trailing zeros dropped): ``408``, ``-2.5``, ``0.3333333333``."""
    if x.denominator == 1:
        return str(x.numerator)
    scaled = round(abs(x) * 10 ** DECIMALS)
    whole, frac = divmod(scaled, 10 ** DECIMALS)
    digits = str(frac).rjust(DECIMALS, "0").rstrip("0")
    return ("-" if x < 0 else "") + str(whole) + ("." + digits if digits else "")


def find_call(text: str) -> str | None:
    """The expression of the first ``<calc>…</calc>`` in ``text`` (``""``-free), or None when the
    text holds no ``<calc>``. An unclosed tag calls the rest of the text."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return None
    start += len(CALL_OPEN)
    end = text.find(CALL_CLOSE, start)
    return text[start:] if end < 0 else text[start:end]


def call(expression: str) -> str:
    """The tool's answer to one call: the value, or ``"error: …"``; never raises."""
    try:
        return format_number(evaluate(expression))
    except CalcError as exc:
        return f"error: {exc}"
    except (ArithmeticError, ValueError, RecursionError) as exc:  # a limit the checks above missed
        return f"error: {type(exc).__name__}"


class CalculatorEnv:
    """The calculator environment (module docstring): one instance per episode.

    Args:
        max_calls: tool calls allowed per episode; a call beyond them ends the episode with reward 0.
        system_prompt: start the episode with :data:`INSTRUCTIONS` as a system turn.
        correct_reward, wrong_reward: the final answer's reward (its last number equals the
            ``reference`` of the row's metadata, :func:`chatrl.rewards.builtin.extract_final_number`).

    ``reset`` raises ValueError for a row without a ``reference`` holding a number, unless the row
    is a chat's (``metadata["chat"]``: the tool answers, no answer is rewarded).
    """

    def __init__(self, max_calls: int = 4, system_prompt: bool = False, correct_reward: float = 1.0,
                 wrong_reward: float = 0.0):
        self.max_calls, self.system_prompt = int(max_calls), bool(system_prompt)
        self.correct_reward, self.wrong_reward = float(correct_reward), float(wrong_reward)
        self.reference = None
        self.calls = 0

    def reset(self, row: dict) -> list[dict]:
        """The row's prompt turns (after the instructions, with ``system_prompt``)."""
        meta = row.get("metadata") or {}
        ref = meta.get("reference")
        self.reference = extract_final_number(str(ref)) if ref is not None else None
        if self.reference is None and not meta.get("chat"):
            raise ValueError(f"calculator: the row has no reference number in its metadata ({row.get('metadata')!r})")
        self.calls = 0
        messages = [dict(m) for m in row["messages"]]
        return ([{"role": "system", "content": INSTRUCTIONS}] if self.system_prompt else []) + messages

    def step(self, messages: list[dict], assistant_text: str):
        """A call gets its value as a tool turn (reward 0); a turn without a call is the final answer."""
        expression = find_call(assistant_text)
        if expression is None:
            got = extract_final_number(assistant_text)
            right = got is not None and got == self.reference
            return None, self.correct_reward if right else self.wrong_reward, True, {"answer": got is not None,
                                                                                   "correct": right}
        self.calls += 1
        if self.calls > self.max_calls:
            return None, self.wrong_reward, True, {"reason": f"more than {self.max_calls} tool calls"}
        result = call(expression)
        return [{"role": "tool", "content": result}], 0.0, False, {"call": expression[:80], "result": result}
