"""Straight-through KL estimators for the KL-as-loss path (``kl_penalty: loss``).

A straight-through estimator has the VALUE of one estimator and the GRADIENT of another:

    st(a, b) = a.detach() + (b - b.detach())        value: a exactly (b - b is 0)    gradient: grad b

With x = log pi(y_t) - log pi_ref(y_t) at the sampled token y_t ~ pi and s = grad log pi(y_t),
the sampled-token estimators of Schulman ("Approximating KL divergence", 2020) have, used as a
loss on on-policy samples, the expected gradients (pi_ref fixed, y_t held fixed):

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

from torch import Tensor

from rlhf_lightning.interfaces import KLEstimator
from rlhf_lightning.registry import register, registry


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

    def __call__(
        self, logprobs: Tensor, ref_logprobs: Tensor, logits: Optional[Tensor] = None, ref_logits: Optional[Tensor] = None
    ) -> Tensor:
        return straight_through(
            self.value_estimator(logprobs, ref_logprobs, logits, ref_logits),
            self.gradient_estimator(logprobs, ref_logprobs, logits, ref_logits),
        )


registry("kl_estimator").register(
    "k3+", StraightThroughKL, aliases=("k3+k2", "low_var_kl+"), init_args={"value": "k3", "gradient": "k2"},
    description="value of k3, gradient of k2 (straight-through): unbiased reverse-KL gradient as a loss",
)  # fmt: skip
registry("kl_estimator").register(
    "k1+", StraightThroughKL, aliases=("k1+k2",), init_args={"value": "k1", "gradient": "k2"},
    description="value of k1, gradient of k2 (straight-through): unbiased value and reverse-KL gradient",
)  # fmt: skip
