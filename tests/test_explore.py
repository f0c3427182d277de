"""Exploration (``model.sampling.explore``): each token drawn from mu = (1 - epsilon) pi + epsilon U, U uniform on
pi's support, log pi_old kept the policy's and each token weighed by pi_old / mu; epsilon falls to 0 over
``model.sampling.explore_iterations`` (docs/divergences.md, "Exploring an optimum in the reference's tail")."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning import ppo_math as pm
from rlhf_lightning import sampling
from rlhf_lightning.args import SamplingArgs
from rlhf_lightning.exact.tasks import ExactPPORLHF, task_named
from rlhf_lightning.interfaces import ConfigError, RolloutEngine
from rlhf_lightning_plugins.rollout_engines import DeclaredDraw

from helpers import make_module


def test_explored_is_the_mixture_with_the_uniform_on_the_support_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0), sampling.OUTSIDE_LOGIT, 0.0]])  # pi = 1/5, 3/5, 0, 1/5
    mixed = sampling.explored(logits, 0.25).exp()
    by_hand = torch.tensor([[0.75 / 5 + 0.25 / 3, 0.75 * 3 / 5 + 0.25 / 3, 0.0, 0.75 / 5 + 0.25 / 3]])
    assert torch.allclose(mixed, by_hand, atol=1e-7) and mixed.sum().item() == pytest.approx(1.0, abs=1e-6)
    assert sampling.explored(logits, 0.0) is logits


def test_the_exploration_schedule_by_hand():
    settings = SamplingArgs(explore=0.4, explore_iterations=4)
    assert [settings.exploration(i) for i in range(6)] == pytest.approx([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
    assert SamplingArgs().exploration(0) == 0.0


def test_declared_draw_explores_inside_the_kept_set():
    """DeclaredDraw with epsilon 0.5 and top-k 5 on 8000 copies of one row: the frequencies are the mixture of
    softmax(scores) on the top 5 with the uniform on those 5 (within 4 standard errors), nothing outside them."""
    scores = torch.randn(1, 50, generator=torch.Generator().manual_seed(2)).expand(8000, -1).clone()
    draw = DeclaredDraw(temperature=1.0, top_k=5, top_p=1.0, eos_token_id=3, min_new_tokens=0, prompt_len=4, explore=0.5)
    out = draw(torch.zeros(8000, 4, dtype=torch.long), scores.clone()).argmax(-1)
    top5 = scores[0].topk(5).indices
    pi = torch.zeros(50, dtype=torch.float64)
    pi[top5] = torch.softmax(scores[0, top5].double(), -1)
    mu = 0.5 * pi + 0.5 * (pi > 0) / 5
    freq = torch.bincount(out, minlength=50).double() / 8000
    assert ((freq - mu).abs() <= 4 * (mu * (1 - mu) / 8000).sqrt() + 1e-12).all()
    assert (freq[pi == 0] == 0).all() and (mu - pi).abs().max() > 0.05  # the test tells mu from pi


def _exploring_task_module(**settings) -> ExactPPORLHF:
    module = ExactPPORLHF(task_named("random-eos:1"), **settings)
    module.configure_model()
    return module


def test_an_exploring_rollout_draws_mu_and_weighs_each_token_by_pi_over_mu():
    """On random-eos:1 (responses ending at EOS) at epsilon 0.4: the 6000 sampled responses' frequencies are mu(y|x),
    enumerated as the product of the mixture's token probabilities (within 4 standard errors, and away from pi's);
    trainer_logprobs (log pi_old, the PPO ratio's anchor) are the policy's, sampler_logprobs mu's, and every token's
    weight is pi / mu <= 1 / (1 - epsilon)."""
    module = _exploring_task_module(explore=0.4, explore_iterations=10)
    module.train()
    rollout = module.rollout(list(module.task.prompts) * 3000)
    input_ids, attention_mask, mask = module._all_responses()
    length = module.task.response_length
    with torch.no_grad():
        logits = module.networks.response_logits(module.policy, input_ids, attention_mask, length).float()
    token_mu = pm.logprobs_of(sampling.explored(logits, 0.4), input_ids[:, -length:]).double()
    mu = (token_mu * mask).sum(-1).view(len(module.task.prompts), -1).masked_fill(~module.task.valid, -math.inf).exp()
    pi = module.exact_logprobs().exp()
    assert torch.allclose(mu.sum(-1), torch.ones(2, dtype=torch.float64), atol=1e-5)
    counts = torch.zeros_like(mu)
    index = {text: j for j, text in enumerate(module.task.responses)}
    for prompt, text in zip(rollout.prompts, rollout.response_texts, strict=True):
        counts[module.task.prompts.index(prompt), index[text]] += 1
    n = counts.sum(-1, keepdim=True)
    se = (mu * (1 - mu) / n).sqrt()
    assert ((counts / n - mu).abs() <= 4 * se + 1e-9).all()
    assert ((counts / n - pi).abs() > 4 * se + 1e-9).any()  # mu's frequencies, not pi's
    m = rollout.response_mask.bool()
    with torch.no_grad():
        again = module.networks.response_logits(module.policy, rollout.input_ids, rollout.attention_mask, rollout.responses.shape[1])
    pi_tokens = pm.logprobs_of(again.float(), rollout.responses)[m]
    mu_tokens = pm.logprobs_of(sampling.explored(again.float(), 0.4), rollout.responses)[m]
    assert torch.allclose(rollout.trainer_logprobs[m], pi_tokens, atol=1e-5)
    assert torch.allclose(rollout.old_logprobs[m], pi_tokens, atol=1e-5)
    assert torch.allclose(rollout.sampler_logprobs[m], mu_tokens, atol=1e-5)
    weights = rollout.is_weights[m].double()
    assert torch.allclose(weights, (pi_tokens - mu_tokens).double().exp(), rtol=1e-4)
    assert weights.max() <= 1 / 0.6 + 1e-6 and weights.min() < 0.5  # rare tokens, met more often than pi meets them


def test_past_its_iterations_exploration_samples_pi_itself():
    """At an iteration past explore_iterations (epsilon 0) a rollout is the non-exploring module's, bit for bit:
    the same responses, log-probs and no weights."""
    plain, exploring = _exploring_task_module(), _exploring_task_module(explore=0.3, explore_iterations=2)
    for module in (plain, exploring):
        module.train()
        module.iteration = 2
    prompts = list(plain.task.prompts) * 50
    a, b = plain.rollout(prompts), exploring.rollout(prompts)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    assert a.is_weights is None and b.is_weights is None
    exploring.iteration = 1
    c = exploring.rollout(prompts)
    assert not torch.equal(c.sampler_logprobs, c.trainer_logprobs) and c.is_weights is not None


class OwnDraws(RolloutEngine):
    """An engine that samples its own way (a third party's, or vllm's): it does not draw the exploring mixture."""

    def sample(self, module, enc, seed):
        raise AssertionError("refused before it samples")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"explore": 1.0, "explore_iterations": 5}, r"model.sampling.explore must be a finite number in \[0, 1\)"),
        ({"explore": 0.2}, r"model.sampling.explore_iterations must be an integer >= 1"),
        (
            {"explore": 0.2, "explore_iterations": 5, "do_sample": False},
            r"model.sampling.explore must be 0 with model.sampling.do_sample false",
        ),
        (
            {"explore": 0.2, "explore_iterations": 5, "rollout_engine": OwnDraws()},
            r"model.rollout_engine must be an engine that draws from the exploring mixture .*got 'OwnDraws'",
        ),
        (
            {"explore": 0.2, "explore_iterations": 5, "max_staleness": 1, "old_logprobs": "forward"},
            r"model.off_policy.max_staleness must be 0 with model.sampling.explore 0.2",
        ),
        (
            {"explore": 0.2, "explore_iterations": 5, "rollout_correction": "tis", "old_logprobs": "forward"},
            r"model.sampling.rollout_correction must be 'none' with model.sampling.explore 0.2",
        ),
    ],
)
def test_bad_exploration_settings_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_module(**overrides)
