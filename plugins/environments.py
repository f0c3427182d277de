"""Built-in environments (``model.environment``): a calculator tool for the arithmetic prompts and a
number-guessing game with feedback. Each is a small class; the episode loop is rlhf_lightning/episodes.py."""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from collections.abc import Sequence
from typing import Any, Optional

from rlhf_lightning.interfaces import Environment, Step, require, require_number
from rlhf_lightning.registry import register

# A call of the calculator: <calc>EXPRESSION</calc>; an opening tag left unclosed (a turn cut at
# max_new_tokens) is a call too, answered with an error (its expression may be cut).
CALL = re.compile(r"<calc>(.*?)(</calc>|$)", re.DOTALL)
BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# What a model writes for the same operators: the multiplication and division signs, the caret.
ALIASES = str.maketrans({"×": "*", "÷": "/", "−": "-", "^": "**"})


class ToolError(ValueError):
    """An expression the calculator refuses: its message is the tool's answer."""


def evaluate(expression: str, max_digits: int = 30, max_length: int = 100) -> int | float:
    """The value of an arithmetic ``expression``: numbers, ``+ - * / // % **``, unary minus and parentheses
    (``×``, ``÷`` and ``^`` read as ``*``, ``/`` and ``**``), walked on its syntax tree; nothing else is run
    (no names, calls or attributes). Every operand and result must stay below 10^max_digits in magnitude, a
    power is refused before it is computed when its result would not, and the text is at most ``max_length``
    characters (which also bounds its nesting). Anything else raises :class:`ToolError`, never another
    exception, so a hostile expression costs microseconds."""
    text = expression.strip().translate(ALIASES)
    if not text:
        raise ToolError("empty expression")
    if len(text) > max_length:
        raise ToolError(f"expression longer than {max_length} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ToolError("not an arithmetic expression") from None
    limit = 10**max_digits

    def checked(value: Any) -> int | float:
        if isinstance(value, complex):  # (-8) ** 0.5
            raise ToolError("not a real number")
        if not math.isfinite(value) or abs(value) >= limit:
            raise ToolError("result out of range")
        return value

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return checked(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(left) > 1 and right > 0 and right * math.log10(abs(left)) >= max_digits:
                raise ToolError("result out of range")
            try:
                return checked(BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("result out of range") from None
        raise ToolError("only numbers, + - * / // % ** and parentheses")

    return walk(tree.body)


def show(value: int | float) -> str:
    """A result as the tool writes it: an integer as one (a float with an integer value too, ``7.0`` -> ``7``),
    else 12 significant digits."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


@register(
    "environment",
    "calculator",
    description="a tool: <calc>EXPRESSION</calc> in a turn is answered with its value; a turn without a call is the final answer",
)
class Calculator(Environment):
    """A calculator the policy calls by writing ``<calc>17 + 25</calc>`` in its turn (numbers, ``+ - * / // %
    **`` and parentheses; :func:`evaluate`). Each call of the turn is answered, one line each, in the ``tool``
    role: its value (``42``), or ``error: <why>`` for an expression it refuses (division by zero, a result of
    more than ``max_digits`` digits, anything that is not arithmetic, a ``<calc>`` left open). A turn without a call is the final answer
    and ends the episode (``done``). ``info``: ``tool_call`` (the turn called), ``tool_ok`` (every call of it
    was answered with a value).

    The calculator pays nothing (``reward`` None): the run's reward backend scores the episode, whose text
    ends with the final turn, so ``exact_answer``'s last number is the policy's answer. A final turn with no
    number in it is scored by the tool's last result instead: the answer must be written, not only computed.

    Args:
        max_digits: the largest magnitude of an operand or result, 10^max_digits (exclusive).
        max_length: the longest expression in characters.
        **limits: the limits every environment takes (:class:`~rlhf_lightning.interfaces.Environment`).
    """

    role = "tool"

    def __init__(self, max_digits: int = 30, max_length: int = 100, **limits: Any) -> None:
        super().__init__(**limits)
        require_number("environment.max_digits", max_digits, integer=True, at_least=1, at_most=300)
        require_number("environment.max_length", max_length, integer=True, at_least=1, at_most=10_000)
        self.max_digits, self.max_length = max_digits, max_length

    def reset(self, prompt: str, seed: int) -> dict[str, int]:
        return {"calls": 0}

    def step(self, state: dict[str, int], turn_text: str, turn_ids: Sequence[int]) -> Step:
        calls = CALL.findall(turn_text)
        if not calls:
            return Step(done=True, info={"tool_call": False, "tool_ok": False})
        lines, ok = [], True
        for expression, closed in calls:
            try:
                if not closed:
                    raise ToolError("<calc> not closed by </calc>")
                lines.append(show(evaluate(expression, self.max_digits, self.max_length)))
            except ToolError as err:
                lines.append(f"error: {err}")
                ok = False
        state["calls"] += len(calls)
        return Step(observation="\n".join(lines), info={"tool_call": True, "tool_ok": ok})


# The range of a game as the prompt states it: "between 1 and 8".
RANGE = re.compile(r"between\s+(-?\d+)\s+and\s+(-?\d+)", re.IGNORECASE)
INTEGER = re.compile(r"-?\d+")


@register(
    "environment",
    "guess_number",
    description="a game: guess a secret number in max_turns guesses, told 'higher' or 'lower'; reward 1 on a right guess",
)
class GuessNumber(Environment):
    """Guess the number: the environment draws a secret integer in the range the prompt states ("between 1 and
    8"; else ``low``..``high``) from the episode's seed, the policy guesses (the first integer of its turn), and
    the environment answers ``higher``, ``lower`` or, for a turn with no number, asks for one, in the ``user``
    role. A right guess earns ``reward`` 1 (``Step.reward`` of that turn) and ends the episode; ``max_turns``
    wrong guesses end it with 0. Over 1..8 with 3 guesses, bisection wins on 7 of the 8 secrets (1 + 2 + 4
    numbers are reachable in three guesses): a mean reward of 7/8, against 3/8 for three distinct blind guesses.

    Args:
        low, high: the range where the prompt states none.
        **limits: the limits every environment takes (``max_turns``: the guesses).
    """

    role = "user"

    def __init__(self, low: int = 1, high: int = 8, **limits: Any) -> None:
        super().__init__(**limits)
        require_number("environment.low", low, integer=True)
        require_number("environment.high", high, integer=True)
        require(high > low, "environment.high", f"an integer > environment.low ({low})", high)
        self.low, self.high = low, high

    def bounds(self, prompt: str) -> tuple[int, int]:
        found = RANGE.search(prompt)
        low, high = (int(found.group(1)), int(found.group(2))) if found else (self.low, self.high)
        return min(low, high), max(low, high)

    def reset(self, prompt: str, seed: int) -> dict[str, Any]:
        low, high = self.bounds(prompt)
        return {"low": low, "high": high, "secret": random.Random(seed).randint(low, high), "guesses": 0}

    def step(self, state: dict[str, Any], turn_text: str, turn_ids: Sequence[int]) -> Step:
        state["guesses"] += 1
        found = INTEGER.search(turn_text)
        guess: Optional[int] = int(found.group()) if found else None
        out_of_guesses = state["guesses"] >= self.max_turns
        if guess == state["secret"]:
            return Step(reward=1.0, done=True, info={"guess": guess})
        if guess is None:
            observation = f"Reply with one number between {state['low']} and {state['high']}."
        else:
            observation = f"{'Higher' if state['secret'] > guess else 'Lower'} than {guess}."
        return Step(observation=observation, reward=0.0, done=out_of_guesses, info={"guess": guess})
