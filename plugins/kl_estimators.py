"""Built-in KL estimators (Schulman, "Approximating KL divergence", 2020).

With x = log pi(y_t) - log pi_ref(y_t) at the sampled token y_t ~ pi, each returns a
per-token tensor (batch, response_len) whose expectation under pi relates to
KL(pi || pi_ref) at that position.

Straight-through estimators, for the KL-as-loss path (``kl_penalty: loss``), have the VALUE of
one estimator and the GRADIENT of another:

    st(a, b) = a.detach() + (b - b.detach())        value: a exactly (b - b is 0)    gradient: grad b

With s = grad log pi(y_t), the sampled-token estimators have, used as a loss on on-policy
samples, the expected gradients (pi_ref fixed, y_t held fixed):

    k1 = x                      grad = s                  E_pi[s]          = 0
    k2 = x^2 / 2                grad = x s                E_pi[x s]        = grad KL(pi || pi_ref)
    k3 = exp(-x) - 1 + x        grad = (1 - pi_ref/pi) s  E_pi[(1 - r) s]  = grad KL(pi_ref || pi)

(the last two: E_pi[x s] = sum_a grad pi(a) (log pi(a) - log pi_ref(a)) and sum_a grad pi(a) = 0;
E_pi[(1 - pi_ref/pi) s] = sum_a (grad pi(a) - pi_ref(a) grad log pi(a)) = -grad sum_a pi_ref log pi.)

So k3, the usual low-variance unbiased VALUE of the reverse KL (GRPO's ``low_var_kl``), has
the gradient of the FORWARD KL when differentiated as a loss: equal to the reverse-KL gradient
only to first order around pi = pi_ref, and biased further away (Tang & Munos, 2025, "On a few
pitfalls in KL divergence gradient estimation for RL"; verl's ``kl_loss_type: k3+``). k1 gives
no gradient at all in expectation. k2's value is biased, but its gradient x s is exactly the
score-function estimator of grad KL(pi || pi_ref). Hence:

    k3+  = st(k3, k2): reports k3's unbiased, non-negative value; trains with the reverse-KL gradient.
    k1+  = st(k1, k2): k1's unbiased (signed) value; the same gradient.

What "the gradient of KL" means here: at each sampled prefix s_t, grad KL(pi(.|s_t) || pi_ref(.|s_t))
with the prefix held fixed, the gradient of the ``full`` estimator used as the same loss. The
score-function term for how the prefix distribution itself moves is not in any loss-path
estimator; that part comes from k1 in the reward (``kl_penalty: reward`` or ``both``).
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from rlhf_lightning.interfaces import KLEstimator
from rlhf_lightning.registry import register, registry


@register("kl_estimator", "k1", description="x = log pi - log pi_ref: unbiased, high variance, can be negative")
class K1(KLEstimator):
    """k1 = x. Unbiased for KL(pi || pi_ref); single tokens can be negative."""

    unbiased_as_reward = True
    unbiased_value = True
    score_baseline = 1.0  # weighted in the loss: w k1 s, not w (k1 + 1) s (KLEstimator.score_baseline)

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, logits=None, ref_logits=None) -> Tensor:
        return logprobs - ref_logprobs


@register("kl_estimator", "abs", description="|x|: non-negative, biased upward")
class AbsKL(KLEstimator):
    """|x|. Non-negative; an upper bound in expectation on k1."""

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, logits=None, ref_logits=None) -> Tensor:
        return (logprobs - ref_logprobs).abs()


@register("kl_estimator", "k2", aliases=("mse",), description="x^2 / 2: non-negative, low variance, biased")
class K2(KLEstimator):
    """k2 = x^2 / 2. Non-negative, low variance; its gradient is that of the reverse-KL surrogate."""

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, logits=None, ref_logits=None) -> Tensor:
        return 0.5 * (logprobs - ref_logprobs) ** 2


@register("kl_estimator", "k3", aliases=("low_var_kl",), description="exp(-x) - 1 + x: unbiased, non-negative, low variance")
class K3(KLEstimator):
    """k3 = exp(-x) - 1 + x = (r - 1) - log r with r = pi_ref / pi. Unbiased and >= 0."""

    unbiased_value = True

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, logits=None, ref_logits=None) -> Tensor:
        x = logprobs - ref_logprobs
        return (-x).exp() - 1.0 + x


@register("kl_estimator", "full", description="exact KL over the whole vocabulary at each position, from both models' logits")
class FullKL(KLEstimator):
    """sum_a pi(a) (log pi(a) - log pi_ref(a)) at each position: exact, no sampling noise."""

    needs_logits = True
    unbiased_value = True  # exact: the KL itself

    def __call__(
        self, logprobs: Tensor, ref_logprobs: Tensor, logits: Optional[Tensor] = None, ref_logits: Optional[Tensor] = None
    ) -> Tensor:
        if logits is None or ref_logits is None:
            raise ValueError("the 'full' KL estimator needs the logits of both the policy and the reference")
        logp = F.log_softmax(logits.float(), dim=-1)
        ref_logp = F.log_softmax(ref_logits.float(), dim=-1)
        return (logp.exp() * (logp - ref_logp)).sum(-1)


def straight_through(value: Tensor, gradient: Tensor) -> Tensor:
    """``value`` in the forward pass, the gradient of ``gradient`` in the backward pass."""
    return value.detach() + (gradient - gradient.detach())


@register("kl_estimator", "straight_through", description="value of one registered estimator, gradient of another")
class StraightThroughKL(KLEstimator):
    """st(value, gradient): the per-token value of the registered estimator ``value`` with the
    gradient of the registered estimator ``gradient``; for any pair, e.g. ``value: full, gradient: k2``.
    Two pairs are registered presets:

    - ``k3+`` = st(k3, k2): value exp(-x) - 1 + x, gradient x grad log pi(y_t), whose on-policy
      mean is grad KL(pi || pi_ref) (plain k3's is grad KL(pi_ref || pi)).
    - ``k1+`` = st(k1, k2): value x, the same gradient; as a loss it trains like k3+ and logs the
      plain log-ratio.

    Args:
        value: name of the estimator whose per-token value is returned.
        gradient: name of the estimator whose gradient flows back to the log-probs (and logits).
    """

    def __init__(self, value: str = "k3", gradient: str = "k2") -> None:
        kl = registry("kl_estimator")
        self.value_estimator, self.gradient_estimator = kl.create(value), kl.create(gradient)
        self.needs_logits = self.value_estimator.needs_logits or self.gradient_estimator.needs_logits
        self.unbiased_value = self.value_estimator.unbiased_value

    def __call__(
        self, logprobs: Tensor, ref_logprobs: Tensor, logits: Optional[Tensor] = None, ref_logits: Optional[Tensor] = None
    ) -> Tensor:
        return straight_through(
            self.value_estimator(logprobs, ref_logprobs, logits, ref_logits),
            self.gradient_estimator(logprobs, ref_logprobs, logits, ref_logits),
        )


# The straight-through presets: (aliases, value estimator, description); the gradient is k2's in both.
STRAIGHT_THROUGH_PRESETS = {
    "k3+": (("k3+k2", "low_var_kl+"), "k3", "value of k3, gradient of k2 (straight-through): unbiased reverse-KL gradient as a loss"),
    "k1+": (("k1+k2",), "k1", "value of k1, gradient of k2 (straight-through): unbiased value and reverse-KL gradient"),
}
for _name, (_aliases, _value, _description) in STRAIGHT_THROUGH_PRESETS.items():
    registry("kl_estimator").register(_name, StraightThroughKL, _description, _aliases, init_args={"value": _value, "gradient": "k2"})
