"""Built-in KL estimators (Schulman, "Approximating KL divergence", 2020).

With x = log pi(y_t) - log pi_ref(y_t) at the sampled token y_t ~ pi, each returns a
per-token tensor (batch, response_len) whose expectation under pi relates to
KL(pi || pi_ref) at that position.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from rlhf_lightning.interfaces import KLEstimator
from rlhf_lightning.registry import register


@register("kl_estimator", "k1", description="x = log pi - log pi_ref: unbiased, high variance, can be negative")
class K1(KLEstimator):
    """k1 = x. Unbiased for KL(pi || pi_ref); single tokens can be negative."""

    unbiased_as_reward = True

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

    def __call__(self, logprobs: Tensor, ref_logprobs: Tensor, logits=None, ref_logits=None) -> Tensor:
        x = logprobs - ref_logprobs
        return (-x).exp() - 1.0 + x


@register("kl_estimator", "full", description="exact KL over the whole vocabulary at each position, from both models' logits")
class FullKL(KLEstimator):
    """sum_a pi(a) (log pi(a) - log pi_ref(a)) at each position: exact, no sampling noise."""

    needs_logits = True

    def __call__(
        self, logprobs: Tensor, ref_logprobs: Tensor, logits: Optional[Tensor] = None, ref_logits: Optional[Tensor] = None
    ) -> Tensor:
        if logits is None or ref_logits is None:
            raise ValueError("the 'full' KL estimator needs the logits of both the policy and the reference")
        logp = F.log_softmax(logits.float(), dim=-1)
        ref_logp = F.log_softmax(ref_logits.float(), dim=-1)
        return (logp.exp() * (logp - ref_logp)).sum(-1)
