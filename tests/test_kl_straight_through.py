"""Straight-through KL estimators (plugins/kl_estimators.py) and tools/studies/kl_estimator_report.py.

k3+ = k3.detach() + (k2 - k2.detach()): the value of k3 = exp(-x) - 1 + x, the gradient of
k2 = x^2 / 2, with x = log p(y) - log q(y). On a categorical p = softmax(theta) with samples y ~ p,
grad_theta log p(y) = e_y - p, and the expected gradients used as a loss are (derived in the plugin):

    k2, k3+, k1+:  E[x (e_y - p)]           = p * (d - KL)     = grad_theta KL(p || q),  d = log p - log q
    k3:            E[(1 - q/p)(y) (e_y - p)] = p - q            = grad_theta KL(q || p)   (the forward KL)
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.interfaces import KLEstimator
from rlhf_lightning.registry import registry
from rlhf_lightning_plugins.kl_estimators import StraightThroughKL, straight_through
from tools.studies import kl_estimator_report


def estimator(name: str) -> KLEstimator:
    return registry("kl_estimator").create(name)


# x = logp - ref_logp = (0.5, -1.0, 0.0, 2.0)
LOGP = torch.tensor([[-1.0, -2.0, -0.5, -0.25]], dtype=torch.float64)
REF_LOGP = torch.tensor([[-1.5, -1.0, -0.5, -2.25]], dtype=torch.float64)


def test_k3_plus_and_k1_plus_are_presets_of_straight_through():
    reg = registry("kl_estimator")
    for name, value in (("k3+", "K3"), ("k3+k2", "K3"), ("low_var_kl+", "K3"), ("k1+", "K1"), ("k1+k2", "K1")):
        estimator = reg.create(name)
        assert type(estimator) is StraightThroughKL
        assert (type(estimator.value_estimator).__name__, type(estimator.gradient_estimator).__name__) == (value, "K2")
    assert not reg.create("k3+").needs_logits and not reg.create("k3+").unbiased_as_reward
    assert StraightThroughKL("full", "k2").needs_logits  # either side needing logits is enough


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name, value_name, gradient_name", [("k3+", "k3", "k2"), ("k1+", "k1", "k2")])
def test_value_of_one_estimator_gradient_of_the_other_exactly(name, value_name, gradient_name, dtype):
    g = torch.Generator().manual_seed(0)
    ref_logp = (torch.randn(4, 7, generator=g, dtype=torch.float64) * 2).to(dtype)
    logp = (torch.randn(4, 7, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    out = estimator(name)(logp, ref_logp)
    # value: a + (b - b) with b - b == 0 exactly, so bit for bit the value estimator
    assert torch.equal(out.detach(), estimator(value_name)(logp, ref_logp).detach())
    (grad,) = torch.autograd.grad(out.sum(), logp)
    logp_copy = logp.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(estimator(gradient_name)(logp_copy, ref_logp).sum(), logp_copy)
    assert torch.equal(grad, expected)
    # and by hand: d(x^2 / 2)/d logp = x
    assert torch.equal(grad, (logp - ref_logp).detach())


def test_hand_values():
    # k3 at x = (0.5, -1, 0, 2): e^-0.5 - 0.5, e - 2, 0, e^-2 + 1; gradient x = (0.5, -1, 0, 2)
    logp = LOGP.clone().requires_grad_()
    out = estimator("k3+")(logp, REF_LOGP)
    expected = [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0, math.exp(-2.0) + 1.0]
    torch.testing.assert_close(out.detach(), torch.tensor([expected], dtype=torch.float64), rtol=0, atol=1e-15)
    out.sum().backward()
    assert logp.grad.tolist() == [[0.5, -1.0, 0.0, 2.0]]


def test_straight_through_function_and_gradient_into_logits():
    a = torch.tensor([3.0], requires_grad=True)
    b = torch.tensor([2.0], requires_grad=True)
    out = straight_through(a * 10, b**2)
    out.backward()
    assert out.item() == 30.0  # the value of a * 10
    assert a.grad is None and b.grad.item() == 4.0  # the gradient of b^2 only
    # value of k3, gradient of full: the gradient reaches the logits
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ref_logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(2))
    tokens = torch.zeros(2, 3, dtype=torch.long)
    logp = logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    ref_logp = ref_logits.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    st = StraightThroughKL("k3", "full")
    out = st(logp, ref_logp, logits, ref_logits)
    assert torch.equal(out.detach(), estimator("k3")(logp, ref_logp).detach())
    (grad,) = torch.autograd.grad(out.sum(), logits)
    (expected,) = torch.autograd.grad(estimator("full")(logp, ref_logp, logits, ref_logits).sum(), logits)
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)


# ---------------------------------------------------------------------- the categorical toy
N_SAMPLES = 200_000


@pytest.fixture(scope="module")
def categorical():
    """theta (6 logits of p), log q, N samples y ~ p, and the exact gradients of both KLs."""
    g = torch.Generator().manual_seed(1234)
    theta = torch.randn(6, generator=g, dtype=torch.float64) * 1.5
    logq = (torch.randn(6, generator=g, dtype=torch.float64) * 1.5).log_softmax(-1)
    logp = theta.log_softmax(-1)
    p, q = logp.exp(), logq.exp()
    kl = float((p * (logp - logq)).sum())
    reverse_grad = p * (logp - logq - kl)  # grad_theta KL(p || q), closed form
    forward_grad = p - q  # grad_theta KL(q || p)
    # closed forms against autograd on the definitions
    t = theta.clone().requires_grad_()
    lp = t.log_softmax(-1)
    torch.testing.assert_close(torch.autograd.grad((lp.exp() * (lp - logq)).sum(), t)[0], reverse_grad)
    t = theta.clone().requires_grad_()
    torch.testing.assert_close(torch.autograd.grad((q * (logq - t.log_softmax(-1))).sum(), t)[0], forward_grad)
    samples = torch.multinomial(p, N_SAMPLES, replacement=True, generator=g)
    # far apart: a test that tells the two gradients apart has power
    assert kl > 0.5 and (reverse_grad - forward_grad).abs().max() > 0.1
    return theta, logq, samples, reverse_grad, forward_grad


def per_sample_gradients(name: str, theta, logq, samples) -> torch.Tensor:
    """grad_theta est(log p(y_i) - log q(y_i)) for every sample, (N, 6), by autograd: each row
    has its own copy of theta, so the gradient of the summed loss is the per-sample gradients."""
    thetas = theta.expand(len(samples), -1).clone().requires_grad_()
    logp = thetas.log_softmax(-1).gather(-1, samples[:, None])  # (N, 1)
    loss = estimator(name)(logp, logq[samples][:, None]).sum()
    return torch.autograd.grad(loss, thetas)[0]


def z_scores(grads: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(mean - target) / standard error, per component."""
    se = grads.std(0) / math.sqrt(len(grads))
    return (grads.mean(0) - target) / se


@pytest.mark.parametrize("name", ["k3+", "k1+", "k2"])
def test_mean_gradient_approaches_the_exact_reverse_kl_gradient(categorical, name):
    theta, logq, samples, reverse_grad, _ = categorical
    grads = per_sample_gradients(name, theta, logq, samples)
    assert z_scores(grads, reverse_grad).abs().max() < 4.5  # 6 components, 4.5 sigma each


def test_k3_gradient_is_biased_towards_the_forward_kl_gradient(categorical):
    theta, logq, samples, reverse_grad, forward_grad = categorical
    grads = per_sample_gradients("k3", theta, logq, samples)
    z = z_scores(grads, reverse_grad)
    # The bias, in standard errors and in size: far outside the noise, of the order of the gradient itself.
    assert z.abs().max() > 20
    bias = grads.mean(0) - reverse_grad
    assert float(bias.norm()) > 0.3 * float(reverse_grad.norm())
    # What it estimates instead, unbiasedly: grad KL(q || p) = p - q.
    assert z_scores(grads, forward_grad).abs().max() < 4.5
    # k3+ on the same samples has the same value and no such bias.
    st = per_sample_gradients("k3+", theta, logq, samples)
    assert float((st.mean(0) - reverse_grad).norm()) < 0.1 * float(bias.norm())


def test_k1_gradient_is_zero_in_expectation(categorical):
    theta, logq, samples, _, _ = categorical
    grads = per_sample_gradients("k1", theta, logq, samples)
    assert z_scores(grads, torch.zeros(6, dtype=torch.float64)).abs().max() < 4.5


# ---------------------------------------------------------------------- the report tool
def test_kl_estimator_report_fast(tmp_path):
    out = tmp_path / "report.md"
    rows = {r.name: r for r in kl_estimator_report.main(["--fast", "--out", str(out)])}

    names = [e.name for e in registry("kl_estimator").entries()]
    assert set(names) <= set(rows)
    report = out.read_text()
    for name in names:
        assert f"| {name} " in report
    for r in rows.values():
        values = [r.bias, r.bias_se, r.std, r.error_std, r.negative, r.ns_per_token, r.grad_cos, r.grad_rel_err]
        assert all(math.isfinite(v) for v in values), r
    png = tmp_path / "kl_estimates.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    full, k1, k2, k3, k3p = (rows[n] for n in ("full", "k1", "k2", "k3", "k3+"))
    assert abs(full.bias) < 1e-9 and full.error_std < 1e-9  # the reference itself
    assert full.grad_cos == pytest.approx(1.0) and full.grad_rel_err < 1e-9
    assert abs(k1.bias) < 3 * k1.bias_se and abs(k1.bias) < 0.25 * k1.std  # unbiased, noisy
    assert 0.2 < k1.negative < 0.8 and k3.negative == 0.0 and k2.negative == 0.0
    assert rows["abs"].bias > 5 * rows["abs"].bias_se  # |x| >= x: biased upward
    # k3+ reports k3's values and trains with k2's gradient
    assert (k3p.bias, k3p.std) == (k3.bias, k3.std)
    assert k3p.grad_cos == pytest.approx(k2.grad_cos, abs=1e-6)
    # with the token summed out: k2 / k3+ are the exact gradient, k3 is off, k1 has none
    assert k3p.expected_grad_rel_err < 1e-3 and k2.expected_grad_rel_err < 1e-3
    assert k3.expected_grad_rel_err > 10 * k3p.expected_grad_rel_err
    assert k1.expected_grad_rel_err == pytest.approx(1.0, abs=1e-3) and k1.expected_grad_norm < 1e-3
    # off-policy (the policy moved 4 PPO epochs from the sampler): importance weighting gives the
    # value-unbiased estimators the exact gradient of KL(pi_theta || pi_ref); unweighted k1 is far off
    for name in ("k1", "k3", "full"):
        assert rows[name].off_policy_cos_importance > 0.99, rows[name]
    assert k1.off_policy_cos < 0.5 and k3.off_policy_cos < k3.off_policy_cos_importance
    assert k3p.off_policy_cos_importance < rows["k3"].off_policy_cos_importance  # the score term twice
