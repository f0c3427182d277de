"""Learned reward models: a frozen local Hugging Face sequence classifier, and a conservative ensemble of them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from rlhf_lightning import prefix
from rlhf_lightning.interfaces import RewardModel, require, require_number
from rlhf_lightning.registry import register
from rlhf_lightning_plugins.rewards.encoder import EncoderReward

CHECKPOINT = "a Hugging Face sequence-classification checkpoint: config, weights, tokenizer"


@register("reward_model", "hf_classifier", description="a local AutoModelForSequenceClassification checkpoint")
class HFClassifierReward(EncoderReward):
    """Score = one logit of a frozen local sequence classifier on prompt + response.

    Args:
        path: folder of a Hugging Face sequence-classification checkpoint (model and tokenizer).
        label_index: which output logit is the reward (0 for a single-output reward model).
        include_prompt: score ``prompt + separator + response`` rather than the response alone.
        chat_template: score the conversation of the prompt (user turn) and the response (assistant turn)
            in the reward model tokenizer's chat template instead (what a reward model trained on chats reads,
            and what TRL's trainers score: tools/benchmarks/compare_trl.py).
        batch_size: texts per forward pass; max_length: truncation length in reward-model tokens.
        shared_prompts: texts of the same prompt (``num_generations`` > 1), or all texts where every prompt
            is distinct, run the tokens they start with once (``prefix.classify_shared_prefixes``: the whole
            texts' scores to fp32 rounding). Only a causal model scores a prefix the same whatever follows
            it; ``setup`` checks that on two texts: None (default) shares where it holds and scores whole texts elsewhere, True refuses a model
            where it does not, False scores whole texts.
    """

    def __init__(
        self,
        path: Optional[str] = None,
        label_index: int = 0,
        include_prompt: bool = True,
        separator: str = "\n",
        chat_template: bool = False,
        batch_size: int = 32,
        max_length: int = 512,
        trust_remote_code: bool = False,
        shared_prompts: Optional[bool] = None,
        **options: Any,
    ) -> None:
        super().__init__(batch_size, max_length, **options)
        require_number("reward_model.label_index", label_index, integer=True, at_least=0)
        # Optional in the signature only so that a missing path is this message, not the parser's union error.
        require(isinstance(path, (str, Path)) and bool(str(path)), "reward_model.path", f"a local folder ({CHECKPOINT})", path)
        self.path, self.label_index, self.include_prompt, self.separator = path, label_index, include_prompt, separator
        turns = "(the conversation is the prompt's user turn and the response's assistant turn)"
        require(include_prompt or not chat_template, "reward_model.include_prompt", f"true with reward_model.chat_template {turns}", False)
        require(
            separator == "\n" or not chat_template, "reward_model.separator", f"left out with reward_model.chat_template {turns}", separator
        )
        self.chat_template, self.add_special_tokens = chat_template, not chat_template
        self.trust_remote_code, self.shared_prompts = trust_remote_code, shared_prompts
        self.shares = False  # whether score() shares prefixes: decided in setup

    def load_tokenizer(self) -> None:
        """The reward model's tokenizer (once), with a pad token, truncating from the left: a text longer
        than ``max_length`` keeps its end, the response, which is what the classifier pools (cut from the
        right, every response of a long prompt would fall outside what it reads: one score for all)."""
        from transformers import AutoTokenizer

        if self.tokenizer is None:
            require(Path(self.path).is_dir(), f"{self.role}.init_args.path", f"an existing folder ({CHECKPOINT})", str(self.path))
            self.tokenizer = AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
            if self.tokenizer.pad_token is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            self.tokenizer.truncation_side = "left"

    def check_prompts(self, prompts: Sequence[str], field: str, role: str) -> None:
        """Warn at start-up of prompts that alone fill ``max_length`` as the model reads them (their
        conversation or ``prompt + separator``): it will read their responses but not their starts."""
        super().check_prompts(prompts, field, role)
        require(Path(self.path).is_dir(), f"{role}.init_args.path", f"an existing folder ({CHECKPOINT})", str(self.path))
        if not self.include_prompt:
            return
        try:
            self.load_tokenizer()
        except OSError:  # a folder without a tokenizer: setup's load names what it lacks
            return
        distinct = list(dict.fromkeys(prompts))
        self.warn_if_truncated(self.texts(distinct, [""] * len(distinct)), f"prompts of {field}", " with an empty response")

    def setup(self, device: torch.device) -> None:
        from transformers import AutoModelForSequenceClassification

        if self.model is None:
            self.load_tokenizer()
            self.model = AutoModelForSequenceClassification.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
            self.model.requires_grad_(False).eval()
            no_template = f"false: the tokenizer in {self.path} has no chat template"
            require(self.tokenizer.chat_template or not self.chat_template, "reward_model.chat_template", no_template, True)
            labels = self.model.config.num_labels
            requirement = f"in [0, {labels}): {self.path} has {labels} labels"
            require(0 <= self.label_index < labels, "reward_model.label_index", requirement, self.label_index)
        self.device = device
        self.model.to(device)
        if self.shared_prompts is not False:
            self.shares = self._scores_prefixes_alike()
            require(self.shares or self.shared_prompts is None, "reward_model.shared_prompts", f"false: {self.path} is not causal", True)

    @torch.inference_mode()
    def _scores_prefixes_alike(self) -> bool:
        """Whether two texts that share a prefix score the same through ``classify_shared_prefixes`` as whole
        (a causal model; a bidirectional encoder's prefix sees what follows it, or takes no KV cache)."""
        texts = ["The reward model reads this, then alpha", "The reward model reads this, then beta!"]
        rows = self.tokenizer(texts)["input_ids"]
        try:
            shared = prefix.classify_shared_prefixes(self.model, rows, [0, 0], self.tokenizer.pad_token_id)
        except (TypeError, ValueError, AttributeError, RuntimeError):  # no KV cache in this architecture's forward
            return False
        whole = torch.cat([self.model(**enc).logits for enc in self.batches(texts, warn=False)])
        return shared is not None and torch.allclose(shared, whole, rtol=1e-4, atol=1e-4)

    def texts(self, prompts: Sequence[str], responses: Sequence[str]) -> list[str]:
        """What the model reads of each response: see ``include_prompt``, ``separator`` and ``chat_template``."""
        if self.chat_template:
            turns = [[{"role": "user", "content": p}, {"role": "assistant", "content": r}] for p, r in zip(prompts, responses, strict=True)]
            return [self.tokenizer.apply_chat_template(conversation, tokenize=False) for conversation in turns]
        return [p + self.separator + r if self.include_prompt else r for p, r in zip(prompts, responses, strict=True)]

    @torch.inference_mode()
    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor:
        if self.model is None:
            self.setup(self.device)
        texts = self.texts(prompts, responses)
        if not (self.shares and self.include_prompt):
            return torch.cat([self.model(**enc).logits[:, self.label_index].float().cpu() for enc in self.batches(texts)])
        # The rows of a prompt share its tokens; where no prompt repeats, all rows share what every text
        # starts with, if anything (a chat template's system prompt).
        groups = list(prompts) if len(set(prompts)) < len(prompts) else [""] * len(prompts)
        scores = []
        for start in range(0, len(texts), self.batch_size):
            chunk = slice(start, start + self.batch_size)
            rows = self.encode(texts[chunk])["input_ids"]
            logits = prefix.classify_shared_prefixes(self.model, rows, groups[chunk], self.tokenizer.pad_token_id)
            if logits is None:  # a row ends in pad tokens only: whole texts
                logits = next(self.model(**enc).logits for enc in self.batches(texts[chunk]))
            scores.append(logits[:, self.label_index].float().cpu())
        return torch.cat(scores)


# How K member scores r_1..r_K of one response become its reward (Coste et al. 2023, section 3).
ENSEMBLE_COMBINATIONS = ("mean", "min", "mean_minus_std")
REWARD_STATS_FILE = "reward_stats.json"  # written beside each model by tools/train_reward_model.py


@register("reward_model", "ensemble", description="K reward-model checkpoints combined by mean, min or mean - lambda std")
class EnsembleReward(RewardModel):
    """A conservative ensemble of K Bradley-Terry reward models (Coste et al. 2023, "Reward Model
    Ensembles Help Mitigate Overoptimization"), each a frozen :class:`HFClassifierReward`:

        mean:            R = mean_k r_k                      (mean optimisation)
        min:             R = min_k r_k                       (worst-case optimisation, WCO)
        mean_minus_std:  R = mean_k r_k - lambda * std_k r_k (uncertainty-weighted, UWO)

    with std the population standard deviation over the K members. Coste et al.'s UWO subtracts
    lambda times the variance; the std keeps the penalty in reward units, so lambda reads as "how
    many member disagreements". A Bradley-Terry reward is only defined up to a shift (and, across
    seeds, its scale differs), so with ``standardize`` each member is first mapped to
    ``(r_k - mu_k) / sigma_k``, with mu_k, sigma_k its scores' mean and std on the reference
    policy's answers it was trained on (``reward_stats.json`` beside the model, written by
    ``tools/train_reward_model.py``): otherwise ``min`` would follow whichever member happens to
    sit lowest and ``std`` would measure offsets, not disagreement.

    Each member is loaded once in :meth:`setup` and scores the whole batch in its own batched pass.

    Args:
        paths: the K >= 2 model folders (``python -m tools.train_reward_model --ensemble K`` prints them).
        combine: ``mean``, ``min`` or ``mean_minus_std``.
        std_coef: lambda of ``mean_minus_std`` (ignored otherwise).
        standardize: standardise members by their ``reward_stats.json`` first.
        include_prompt, separator, chat_template, batch_size, max_length: as in :class:`HFClassifierReward`, for every member.
    """

    def __init__(
        self,
        paths: Optional[Sequence[str]] = None,
        combine: Literal["mean", "min", "mean_minus_std"] = "mean",
        std_coef: float = 1.0,
        standardize: bool = True,
        include_prompt: bool = True,
        separator: str = "\n",
        chat_template: bool = False,
        batch_size: int = 32,
        max_length: int = 512,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        # Optional in the signature only so that missing paths are this message, not the parser's union error.
        enough = isinstance(paths, Sequence) and not isinstance(paths, str) and len(paths) >= 2
        require(enough, "reward_model.paths", "a list of at least 2 model folders", paths)
        require(combine in ENSEMBLE_COMBINATIONS, "reward_model.combine", f"one of {', '.join(ENSEMBLE_COMBINATIONS)}", combine)
        require_number("reward_model.std_coef", std_coef, at_least=0)
        self.paths, self.combine, self.std_coef, self.standardize = list(paths), combine, float(std_coef), standardize
        self.members = [
            HFClassifierReward(
                path,
                include_prompt=include_prompt,
                separator=separator,
                chat_template=chat_template,
                batch_size=batch_size,
                max_length=max_length,
            )
            for path in self.paths
        ]
        self.member_mean = torch.zeros(len(self.paths))  # (K,) mu_k
        self.member_std = torch.ones(len(self.paths))  # (K,) sigma_k
        if standardize:
            stats = [json.loads(self._stats_file(path).read_text()) for path in self.paths]
            self.member_mean = torch.tensor([s["mean"] for s in stats])
            self.member_std = torch.tensor([s["std"] for s in stats])

    @staticmethod
    def _stats_file(path: str) -> Path:
        stats = Path(path) / REWARD_STATS_FILE
        require(stats.is_file(), "reward_model.paths", f"model folders with a {REWARD_STATS_FILE} (or standardize: false)", path)
        return stats

    def check_prompts(self, prompts: Sequence[str], field: str, role: str) -> None:
        for path in self.paths:
            require(Path(path).is_dir(), f"{role}.init_args.paths", f"existing folders (each {CHECKPOINT})", str(path))
        for member in self.members:
            member.check_prompts(prompts, field, role)

    def setup(self, device: torch.device) -> None:
        for member in self.members:
            member.setup(device)

    def member_scores(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor:
        """Standardised member scores, shape (K, batch)."""
        raw = torch.stack([member.score(prompts, responses) for member in self.members])  # (K, batch)
        return (raw - self.member_mean[:, None]) / self.member_std[:, None]

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor:
        scores = self.member_scores(prompts, responses)  # (K, batch)
        if self.combine == "min":
            return scores.min(0).values
        if self.combine == "mean_minus_std":
            return scores.mean(0) - self.std_coef * scores.std(0, unbiased=False)
        return scores.mean(0)
