"""Verifiable rewards: a response is scored against a known answer, so the reward is exact (a gold
that needs no judge) and costs nothing on a CPU."""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from rlhf_lightning.interfaces import ConfigError, RewardModel, require, require_number
from rlhf_lightning.registry import register

# "a OP b" in a question; x and × read as multiplication, the minus sign and the en dash as minus.
QUESTION = re.compile(r"(-?\d+)\s*([-+*x×–−])\s*(-?\d+)")
OPERATIONS = {
    "+": operator.add,
    "-": operator.sub,
    "–": operator.sub,
    "−": operator.sub,
    "*": operator.mul,
    "x": operator.mul,
    "×": operator.mul,
}
# A number as written in an answer: "1,234", "-7", "42.0"; a minus sign only where it cannot be an
# operator or a dash after a word ("5-3" holds 5 and 3).
NUMBER = re.compile(r"(?:(?<![\w-])-)?\d+(?:,\d{3})*(?:\.\d+)?")
# Where an answer is stated explicitly, it wins over the other numbers of the response.
STATED = re.compile(r"\\boxed\{\s*([^}]*)\}|answer\s*(?:is|:|=)\s*([-\d,.]+)", re.IGNORECASE)


def question_answer(prompt: str) -> int:
    """The integer answer of the first ``a OP b`` in ``prompt`` (OP one of + - * x ×); a ConfigError
    naming the prompt when it holds none."""
    match = QUESTION.search(prompt)
    requirement = "an arithmetic question 'a + b', 'a - b' or 'a * b'"
    require(match is not None, "each prompt scored by reward_model exact_answer", requirement, prompt)
    a, op, b = match.groups()
    return OPERATIONS[op](int(a), int(b))


def _integer(text: str) -> Optional[int]:
    """``text`` as an integer ("1,234" -> 1234, "42.0" -> 42); None for a fraction or no number."""
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


def parse_answer(response: str) -> Optional[int]:
    """The integer a response answers: the last explicitly stated one (``\\boxed{N}``, "answer is N",
    "answer: N"), else the last number in the response (a short model writes "17 + 25 = 42" or
    "42." or "The sum is 42"); None when there is none or it is not a whole number. Numbers in words
    ("forty-two") are not read."""
    stated = [m.group(1) or m.group(2) for m in STATED.finditer(response)]
    candidates = [n for s in stated for n in NUMBER.findall(s)] or NUMBER.findall(response)
    return _integer(candidates[-1]) if candidates else None


@register(
    "reward_model",
    "exact_answer",
    description="1 if the response's final integer equals the answer of the prompt's arithmetic question, else 0",
)
class ExactAnswerReward(RewardModel):
    """A verifiable reward for arithmetic questions: ``score = 1[parse(y) = a(x)]``, so the mean
    reward is the accuracy (the outcome reward of RLVR: Lambert et al. 2024, Tulu 3; DeepSeek-AI
    2025, DeepSeek-R1), with ``wrong_score`` for a wrong or missing answer.

    The answer a(x) is computed from the prompt itself (the first "a + b", "a - b" or "a * b" in
    it; see :func:`question_answer`) rather than looked up in a prompt-to-answer table: any prompt
    file works as it is (``data.train_path`` and ``data.val_path`` carry the questions, nothing else
    must be kept in step with them), and a prompt whose answer cannot be known is an error, not a
    silent zero. The response's answer is parsed by :func:`parse_answer`.

    Args:
        wrong_score: score of a wrong or unparseable answer (0; negative to punish a wrong answer
            more than the KL costs).
    """

    def __init__(self, wrong_score: float = 0.0, **options: Any) -> None:
        super().__init__(**options)
        require_number("reward_model.wrong_score", wrong_score, below=1)
        self.wrong_score = float(wrong_score)

    def check_prompts(self, prompts: Sequence[str], field: str, role: str) -> None:
        """Every prompt must hold an arithmetic question (its answer is computed from it)."""
        missing = [i for i, prompt in enumerate(prompts) if QUESTION.search(prompt) is None]
        if missing:
            first = prompts[missing[0]]
            raise ConfigError(
                f"{field}: prompt {missing[0]} ({first[:40]!r}{'...' if len(first) > 40 else ''}) holds no arithmetic question "
                f"'a + b', 'a - b' or 'a * b', which {role} exact_answer computes its answer from ({len(missing)} such prompts)"
            )

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor:
        correct = [parse_answer(response) == question_answer(prompt) for prompt, response in zip(prompts, responses, strict=True)]
        return torch.tensor([1.0 if ok else self.wrong_score for ok in correct])
