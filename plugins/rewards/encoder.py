"""The shared part of the rewards that run a frozen local Hugging Face model over the texts."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rlhf_lightning.interfaces import RewardModel, require_number


class EncoderReward(RewardModel):
    """Base of the rewards that run a frozen local model (``model``, ``tokenizer``, loaded by the
    subclass's ``setup``) over the texts, ``batch_size`` texts per forward pass, each truncated
    to ``max_length`` tokens at the tokenizer's ``truncation_side``; the first batch with a longer
    text is warned about, naming ``max_length`` under the module argument the backend serves
    (``model.reward_model``, told by ``check_prompts``)."""

    role = "model.reward_model"

    def __init__(self, batch_size: int, max_length: int, **options: Any) -> None:
        super().__init__(**options)
        require_number("reward_model.batch_size", batch_size, integer=True, at_least=1)
        require_number("reward_model.max_length", max_length, integer=True, at_least=1)
        self.batch_size, self.max_length = batch_size, max_length
        self.add_special_tokens = True  # False for texts a chat template rendered: they carry their own
        self.model = None
        self.tokenizer = None
        self.device = torch.device("cpu")
        self.warned_truncation = False

    def check_prompts(self, prompts: Sequence[str], field: str, role: str) -> None:
        self.role = role

    def encode(self, texts: Sequence[str], warn: bool = True, **kwargs: Any) -> Any:
        """The texts tokenised, each truncated to ``max_length`` tokens, with the tokenizer's special tokens
        unless the texts carry their own (``add_special_tokens``); ``warn`` of a truncated text (not for probes)."""
        if warn and not self.warned_truncation:
            self.warn_if_truncated(texts)
        return self.tokenizer(
            list(texts), truncation=True, max_length=self.max_length, add_special_tokens=self.add_special_tokens, **kwargs
        )

    def warn_if_truncated(self, texts: Sequence[str], what: str = "texts", after: str = "") -> bool:
        """Warn (once) when some of ``texts`` are longer than ``max_length`` tokens: the model reads only
        one end of them. Returns whether it warned."""
        lengths = [len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=self.add_special_tokens)["input_ids"]]
        longer = [n for n in lengths if n > self.max_length]
        if not longer:
            return False
        from lightning.pytorch.utilities import rank_zero_warn  # here, so `rlhf-lightning plugins` does not load Lightning

        self.warned_truncation = True
        end = "last" if self.tokenizer.truncation_side == "left" else "first"
        rank_zero_warn(
            f"{self.role}.init_args.max_length {self.max_length}: {len(longer)} of {len(texts)} {what} are longer (the longest "
            f"{max(longer)} tokens){after}; {type(self).__name__} reads only their {end} {self.max_length} tokens. Raise "
            f"{self.role}.init_args.max_length (within the model's context) or shorten the prompts"
        )
        return True

    def batches(self, texts: Sequence[str], warn: bool = True) -> Iterator[Any]:
        """The texts, ``batch_size`` at a time, tokenised (padded, truncated) onto ``self.device``."""
        for start in range(0, len(texts), self.batch_size):
            yield self.encode(texts[start : start + self.batch_size], warn, return_tensors="pt", padding=True).to(self.device)
