"""The shared part of the rewards that run a frozen local Hugging Face model over the texts."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rlhf_lightning.interfaces import RewardModel, require_number


class EncoderReward(RewardModel):
    """Base of the rewards that run a frozen local model (``model``, ``tokenizer``, loaded by the
    subclass's ``setup``) over the texts, ``batch_size`` texts per forward pass, each truncated
    to ``max_length`` tokens."""

    def __init__(self, batch_size: int, max_length: int, **options: Any) -> None:
        super().__init__(**options)
        require_number("reward_model.batch_size", batch_size, integer=True, at_least=1)
        require_number("reward_model.max_length", max_length, integer=True, at_least=1)
        self.batch_size, self.max_length = batch_size, max_length
        self.add_special_tokens = True  # False for texts a chat template rendered: they carry their own
        self.model = None
        self.tokenizer = None
        self.device = torch.device("cpu")

    def encode(self, texts: Sequence[str], **kwargs: Any) -> Any:
        """The texts tokenised, each truncated to ``max_length`` tokens, with the tokenizer's special tokens
        unless the texts carry their own (``add_special_tokens``)."""
        return self.tokenizer(
            list(texts), truncation=True, max_length=self.max_length, add_special_tokens=self.add_special_tokens, **kwargs
        )

    def batches(self, texts: Sequence[str]) -> Iterator[Any]:
        """The texts, ``batch_size`` at a time, tokenised (padded, truncated) onto ``self.device``."""
        for start in range(0, len(texts), self.batch_size):
            yield self.encode(texts[start : start + self.batch_size], return_tensors="pt", padding=True).to(self.device)
