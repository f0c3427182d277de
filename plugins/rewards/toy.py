"""Toy reward functions for the ``callable`` backend: cheap, exact, and learnable by a tiny model."""

from __future__ import annotations

from collections.abc import Sequence


def char_count(prompts: Sequence[str], responses: Sequence[str], chars: str = "e", scale: float = 1.0) -> list[float]:
    """scale * number of characters of each response that are in ``chars``."""
    return [scale * sum(ch in chars for ch in response) for response in responses]


def exclamation_count(prompts: Sequence[str], responses: Sequence[str], cap: int = 10) -> list[float]:
    """A deliberately flawed proxy: counts exclamation marks, up to ``cap`` (the seeds' reward hack)."""
    return [float(min(response.count("!"), cap)) for response in responses]


def constant(prompts: Sequence[str], responses: Sequence[str], value: float = 1.0) -> list[float]:
    """The same score for every response, whatever its length or content (tools/studies/length_bias.py)."""
    return [value] * len(responses)
