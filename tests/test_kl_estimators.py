"""Built-in KL estimators (Schulman, "Approximating KL divergence", 2020) and the estimator contract.

With x = logp - ref_logp at the sampled token: k1 = x, abs = |x|, k2 = x^2 / 2,
k3 = exp(-x) - 1 + x; ``full`` = sum_a p(a) (log p(a) - log q(a)) from both models' logits.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.interfaces import KLEstimator
from rlhf_lightning.registry import registry


def estimator(name: str) -> KLEstimator:
    return registry("kl_estimator").create(name)


# x = logp - ref_logp = (0.5, -1.0, 0.0, 2.0)
LOGP = torch.tensor([[-1.0, -2.0, -0.5, -0.25]], dtype=torch.float64)
REF_LOGP = torch.tensor([[-1.5, -1.0, -0.5, -2.25]], dtype=torch.float64)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("k1", [0.5, -1.0, 0.0, 2.0]),
        ("abs", [0.5, 1.0, 0.0, 2.0]),
        # x^2 / 2: 0.25/2, 1/2, 0, 4/2
        ("k2", [0.125, 0.5, 0.0, 2.0]),
        ("mse", [0.125, 0.5, 0.0, 2.0]),
        # exp(-x) - 1 + x: e^-0.5 - 0.5 = 0.1065307, e^1 - 2 = 0.7182818, 0, e^-2 + 1 = 1.1353353
        ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0, math.exp(-2.0) + 1.0]),
        ("low_var_kl", [0.10653065971263342, 0.7182818284590451, 0.0, 1.1353352832366128]),
    ],
)
def test_estimator_formula_on_hand_made_tensors(name, expected):
    out = estimator(name)(LOGP, REF_LOGP)
    torch.testing.assert_close(out, torch.tensor([expected], dtype=torch.float64))


def _full_kl_brute_force(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(logits.shape[:2], dtype=torch.float64)
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            p = torch.softmax(logits[b, t].double(), -1).tolist()
            q = torch.softmax(ref_logits[b, t].double(), -1).tolist()
            out[b, t] = sum(pa * (math.log(pa) - math.log(qa)) for pa, qa in zip(p, q, strict=True))
    return out


def test_full_against_brute_force_double_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 6, generator=g) * 2
    ref_logits = torch.randn(2, 3, 6, generator=g) * 2
    unused = torch.zeros(2, 3)
    out = estimator("full")(unused, unused, logits, ref_logits)
    assert out.shape == (2, 3)
    torch.testing.assert_close(out.double(), _full_kl_brute_force(logits, ref_logits), rtol=1e-5, atol=1e-6)


def test_full_hand_example():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 log 2 + 1/2 log(2/3) = 0.5 * log(4/3) = 0.1438410
    logits = torch.tensor([[[0.0, 0.0]]])
    ref_logits = torch.tensor([[[math.log(1.0), math.log(3.0)]]])
    out = estimator("full")(torch.zeros(1, 1), torch.zeros(1, 1), logits, ref_logits)
    assert out.item() == pytest.approx(0.5 * math.log(4.0 / 3.0), abs=1e-6)


def test_full_needs_logits_flag_and_clear_error_without_logits():
    full = estimator("full")
    assert full.needs_logits is True
    assert not any(estimator(n).needs_logits for n in ("k1", "abs", "k2", "k3"))
    with pytest.raises(ValueError, match="logits"):
        full(LOGP, REF_LOGP)
    with pytest.raises(ValueError, match="logits"):
        full(LOGP, REF_LOGP, logits=torch.zeros(1, 4, 3))


def test_k3_and_abs_and_k2_are_non_negative_on_random_inputs():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(64, 32, generator=g) * 3
    ref = torch.randn(64, 32, generator=g) * 3
    for name in ("k3", "abs", "k2"):
        assert (estimator(name)(logp, ref) >= 0).all(), name
    # k1 is not: this batch has negative entries (so the check above is meaningful for it)
    assert (estimator("k1")(logp, ref) < 0).any()


@pytest.fixture(scope="module")
def sampled_x():
    """x = log p(a) - log q(a) at 200k actions a ~ p over a 6-token vocabulary, and KL(p || q)."""
    g = torch.Generator().manual_seed(1234)
    p_logits = torch.randn(6, generator=g, dtype=torch.float64)
    q_logits = torch.randn(6, generator=g, dtype=torch.float64)
    logp, logq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    exact = float((logp.exp() * (logp - logq)).sum())
    actions = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=g)
    # exact KL is far from 0 and from E[k2], so the checks below can tell estimators apart
    assert exact > 0.2
    return logp[actions][None, :], logq[actions][None, :], exact


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_unbiased_estimators_mean_matches_exact_kl(sampled_x, name):
    logp, logq, exact = sampled_x
    samples = estimator(name)(logp, logq).flatten()
    stderr = samples.std().item() / math.sqrt(samples.numel())
    assert abs(samples.mean().item() - exact) < 4 * stderr


def test_k2_is_biased_so_the_unbiasedness_check_has_power(sampled_x):
    # E[x^2 / 2] != KL for these distributions: the same 4-sigma check rejects it.
    logp, logq, exact = sampled_x
    samples = estimator("k2")(logp, logq).flatten()
    stderr = samples.std().item() / math.sqrt(samples.numel())
    assert abs(samples.mean().item() - exact) > 4 * stderr


@pytest.mark.parametrize("alias, canonical", [("mse", "k2"), ("low_var_kl", "k3")])
def test_aliases_resolve_to_the_same_class(alias, canonical):
    reg = registry("kl_estimator")
    assert reg.get(alias) is reg.get(canonical)
    assert alias in reg.names() and canonical in reg.names()


# ---------------------------------------------------------------------------------------------
# Contract, over every registered estimator (third-party ones included)


def _inputs(needs_logits: bool, same: bool):
    g = torch.Generator().manual_seed(2)
    batch, length, vocab = 3, 5, 7
    logits = torch.randn(batch, length, vocab, generator=g)
    ref_logits = logits.clone() if same else torch.randn(batch, length, vocab, generator=g)
    tokens = torch.randint(0, vocab, (batch, length), generator=g)
    logp = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    ref_logp = ref_logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    return (logp, ref_logp, logits, ref_logits) if needs_logits else (logp, ref_logp, None, None)


@pytest.mark.parametrize("name", registry("kl_estimator").names())
def test_contract_shape_and_finite(name):
    est = estimator(name)
    assert isinstance(est, KLEstimator)
    logp, ref_logp, logits, ref_logits = _inputs(est.needs_logits, same=False)
    out = est(logp, ref_logp, logits, ref_logits)
    assert out.shape == (3, 5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", registry("kl_estimator").names())
def test_contract_zero_when_policy_equals_reference(name):
    est = estimator(name)
    logp, ref_logp, logits, ref_logits = _inputs(est.needs_logits, same=True)
    out = est(logp, ref_logp, logits, ref_logits)
    torch.testing.assert_close(out, torch.zeros(3, 5), rtol=0, atol=1e-6)
