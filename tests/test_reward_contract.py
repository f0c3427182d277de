"""The reward-backend contract, for every registered backend (built-in or installed): one finite
float32 score per response, the same scores for the same texts, shaping (missing-EOS penalty,
normalisation, clipping) applied on top by the base class, and a state that survives a checkpoint.

Backends that need a resource get a small local one (a function, a tiny classifier checkpoint, a
scoring server on 127.0.0.1); every other backend must build with its defaults."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.registry import registry

from helpers import Server, length_scores

PROMPTS = ["Write a happy line.", "Describe rain.", "Say hi.", "Count to three."]
RESPONSES = ["What a wonderful, sunny day!", "Grey and cold, it falls all night.", "hi", ""]
# A verifiable reward computes each prompt's answer from it, so it is asked questions.
QUESTIONS = ["What is 2 + 3?", "What is 7 * 6?", "What is 10 - 4?", "What is 1 + 1?"]
NAMES = [entry.name for entry in registry("reward_model").entries()]


def prompts_for(backend) -> list[str]:
    return QUESTIONS if registry("reward_model").get("exact_answer") is type(backend) else PROMPTS


@pytest.fixture
def backend(request, tiny_classifier, monkeypatch):
    """The registered backend ``request.param``, with the small resource it needs, set up on CPU."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    servers = []
    name = request.param
    cls = registry("reward_model").get(name)
    if name == "callable":
        rm = cls(function="rlhf_lightning_plugins.rewards.toy:char_count", kwargs={"chars": "aeiou"})
    elif name == "embedding_similarity":
        rm = cls(target="a happy, sunny day")
    elif name == "hf_classifier":
        rm = cls(path=str(tiny_classifier[0]))
    elif name == "ensemble":
        rm = cls(paths=[str(tiny_classifier[0])] * 2, combine="mean_minus_std", standardize=False)
    elif name == "remote":
        servers.append(Server(length_scores))
        rm = cls(url=servers[0].url)
    else:
        rm = cls()
    rm.setup(torch.device("cpu"))
    yield rm
    for server in servers:
        server.close()


@pytest.mark.parametrize("backend", NAMES, indirect=True)
def test_one_finite_float_score_per_response_and_the_same_for_the_same_texts(backend):
    prompts = prompts_for(backend)
    scores = backend.checked_scores(prompts, RESPONSES)
    assert scores.dtype == torch.float32 and scores.shape == (len(RESPONSES),) and torch.isfinite(scores).all()
    torch.testing.assert_close(backend.checked_scores(prompts, RESPONSES), scores)
    # Scored one at a time, each response gets the score it gets in the batch.
    one_by_one = torch.cat([backend.checked_scores([p], [r]) for p, r in zip(prompts, RESPONSES, strict=True)])
    torch.testing.assert_close(one_by_one, scores, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", NAMES, indirect=True)
def test_shaping_is_applied_on_top_of_the_raw_scores(backend):
    backend.shaping.missing_eos_penalty, backend.shaping.clip = 0.5, 0.75
    ended = torch.tensor([True, False, True, False])
    raw, shaped = backend(prompts_for(backend), RESPONSES, ended)
    expected = (raw - 0.5 * (~ended).float()).clamp(-0.75, 0.75)
    torch.testing.assert_close(shaped, expected)


@pytest.mark.parametrize("backend", NAMES, indirect=True)
def test_state_survives_a_checkpoint(backend):
    backend.shaping.normalize = True
    backend(prompts_for(backend), RESPONSES, torch.ones(len(RESPONSES), dtype=torch.bool))
    state = backend.state_dict()
    fresh = type(backend).__new__(type(backend))
    fresh.__dict__.update(backend.__dict__)
    fresh.shaping = type(backend.shaping)()  # no statistics seen
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state and fresh.shaping.stats.count == len(RESPONSES)
