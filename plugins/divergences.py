"""Built-in divergences: the f-divergences D_f(pi || pi_ref) = E_{pi_ref}[f(u)], u = pi(y|x) / pi_ref(y|x)
(``interfaces.Divergence``; docs/divergences.md). Each is f, f' and log (f')^{-1} as functions of
log u, the response's summed per-token log-ratio:

    name        f(u)                                        f'(u)                 (f')^{-1}(v)                  u of pi*
    reverse_kl  u log u                                     log u + 1             exp(v - 1)                    > 0, tilted
    forward_kl  -log u                                      -1 / u                -1 / v      (v < 0)           > 0
    js          u log u - (u + 1) log((u + 1) / 2)          log(2u / (u + 1))     e^v / (2 - e^v) (v < log 2)   > 0
      mixture b 2(1-b) u log u - 2 m log m, m = b + (1-b) u  2(1-b) log(u / m)      b w / (1 - (1-b) w), w = e^(v / (2(1-b)))
    chi2        (u - 1)^2                                   2 (u - 1)             1 + v / 2, clipped at 0        >= 0
    alpha       (u^(1-a) - (1-a) u - a) / (a (a - 1))       (1 - u^(-a)) / a      (1 - a v)^(-1/a)              >= 0 (a < 0)

The alpha family (f-DPO's parametrisation, Wang et al. 2023) tends to the reverse KL as alpha -> 0 and to the
forward KL (plus u - 1, which E_{pi_ref} sends to 0) as alpha -> 1; alpha = -1 is chi2 / 2; alpha = 0.5 is
2 x the squared Hellinger distance sum_y (sqrt pi - sqrt pi_ref)^2. ``js`` is 2 x the Jensen-Shannon
divergence, KL(pi || m) + KL(pi_ref || m) with m = (pi + pi_ref) / 2; ``js`` with ``mixture: b`` is 2 x the
generalised one of distillation trainers, 2 [b KL(pi_ref || M) + (1 - b) KL(pi || M)], M = b pi_ref + (1 - b) pi
(TRL's GKD ``beta`` = b, the teacher's weight in M: b -> 0 is the forward KL's direction, b -> 1 the reverse's).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_lightning.checks import require, require_number
from rlhf_lightning.interfaces import Divergence
from rlhf_lightning.registry import register


def _u_log_u(log_u: Tensor) -> Tensor:
    """u log u from log u, 0 at u = 0 (log u = -inf)."""
    return torch.where(log_u > -math.inf, log_u.exp() * log_u, torch.zeros_like(log_u))


@register("divergence", "reverse_kl", aliases=("kl",), description="KL(pi || pi_ref): the per-token KL penalty (the default)")
class ReverseKL(Divergence):
    """KL(pi || pi_ref), f(u) = u log u. f'(u) = log u + 1 is the sum of the per-token log-ratios plus a
    constant, so its penalty is the KL estimator's, per token (``model.kl_estimator``, ``model.kl.placement``):
    today's loop unchanged. pi* ∝ pi_ref exp(r / beta)."""

    per_token = True

    def f(self, log_u: Tensor) -> Tensor:
        return _u_log_u(log_u)

    def f_prime(self, log_u: Tensor) -> Tensor:
        return log_u + 1.0

    def log_f_prime_inverse(self, v: Tensor) -> Tensor:
        return v - 1.0

    def value(self, log_u: Tensor) -> Tensor:
        return log_u  # f(u) / u = log u exactly: the k1 sum


@register("divergence", "forward_kl", description="KL(pi_ref || pi), f(u) = -log u: mass-covering, penalty beta / u")
class ForwardKL(Divergence):
    """KL(pi_ref || pi), f(u) = -log u. The penalty -beta f'(u) = beta / u pays a response the policy gives
    less than the reference does; pi*(y) = pi_ref(y) beta / (lambda - r(y)), lambda > max_y r."""

    def f(self, log_u: Tensor) -> Tensor:
        return -log_u

    def f_prime(self, log_u: Tensor) -> Tensor:
        return -torch.exp(-log_u)

    def log_f_prime_inverse(self, v: Tensor) -> Tensor:
        return torch.where(v < 0, -torch.log(-v.clamp(max=0)), torch.full_like(v, math.inf))


@register(
    "divergence",
    "js",
    aliases=("jensen_shannon",),
    description="2 x the generalised Jensen-Shannon divergence, mixture = the reference's weight in M (TRL's GKD beta); 1/2 by default",
)
class JensenShannon(Divergence):
    """Twice the generalised Jensen-Shannon divergence of distillation trainers (GKD, Agarwal et al. 2024, eq. 1;
    TRL's ``generalized_jsd_loss`` with ``beta = mixture``), with P = pi_ref (the teacher) and Q = pi (the student):

        D = 2 [ b KL(pi_ref || M) + (1 - b) KL(pi || M) ],   M = b pi_ref + (1 - b) pi,   b = ``mixture``.

    b is the reference's weight in the mixture. As b -> 0, D ~ 2 b KL(pi_ref || pi), the forward KL's direction
    (mass-covering); as b -> 1, D ~ 2 (1 - b) KL(pi || pi_ref), the reverse KL's (mode-seeking); the limits
    themselves vanish, so the endpoints are ``forward_kl`` and ``reverse_kl`` (which TRL also special-cases at
    beta = 0 and 1). b = 1/2 is 2 x the Jensen-Shannon divergence, symmetric in pi and pi_ref. With u = pi / pi_ref:

        f(u)  = 2 [(1 - b) u log u - (b + (1 - b) u) log(b + (1 - b) u)]
        f'(u) = 2 (1 - b) log(u / (b + (1 - b) u))   < -2 (1 - b) log(1 - b)  (= log 2 at b = 1/2)

    so a response's penalty is bounded below, and pi*(y) = pi_ref(y) b w / (1 - (1 - b) w), w = exp(v / (2 (1 - b))),
    v = (r(y) - lambda) / beta (e^v / (2 - e^v) at b = 1/2).

    Args:
        mixture: b, strictly between 0 and 1 (0 is ``forward_kl``, 1 ``reverse_kl``).
    """

    omit_default_arguments = True  # "js" names the symmetric one; "js:0.1" another mixture (exact.f_divergence.divergence_label)

    def __init__(self, mixture: float = 0.5) -> None:
        require_number("divergence.mixture", mixture)
        require(0 < mixture < 1, "divergence.mixture", "a number in (0, 1) (at 0 use forward_kl, at 1 reverse_kl)", mixture)
        self.mixture = float(mixture)
        b = self.mixture
        self._log_b, self._log_1mb = math.log(b), math.log1p(-b)

    def _log_m(self, log_u: Tensor) -> Tensor:
        """log (b + (1 - b) u): the mixture's probability over pi_ref's."""
        return torch.logaddexp(torch.full_like(log_u, self._log_b), self._log_1mb + log_u)

    def f(self, log_u: Tensor) -> Tensor:
        b = self.mixture
        return 2.0 * ((1.0 - b) * _u_log_u(log_u) - self._log_m(log_u).exp() * self._log_m(log_u))

    def f_prime(self, log_u: Tensor) -> Tensor:
        # log u - log(b + (1 - b) u) = -log(1 - b) - softplus(log(b / (1 - b)) - log u), finite for large log u
        return 2.0 * (1.0 - self.mixture) * (-self._log_1mb - F.softplus(self._log_b - self._log_1mb - log_u))

    def log_f_prime_inverse(self, v: Tensor) -> Tensor:
        t = self._log_1mb + v / (2.0 * (1.0 - self.mixture))  # log((1 - b) w) < 0 inside f's range
        inside = t < 0
        log_w = t - self._log_1mb
        return torch.where(inside, self._log_b + log_w - torch.log(-torch.expm1(torch.where(inside, t, -1.0))), math.inf)


@register("divergence", "chi2", aliases=("chi_squared",), description="Pearson chi-squared, f(u) = (u - 1)^2: pi* may drop responses")
class ChiSquared(Divergence):
    """Pearson chi^2(pi || pi_ref), f(u) = (u - 1)^2 (Huang et al. 2024, "Correcting the mythos of
    KL-regularization"). f'(u) = 2 (u - 1) is linear in u: pi*(y) = pi_ref(y) max(0, 1 + (r(y) - lambda) /
    (2 beta)), a response whose reward is low enough gets probability 0."""

    def f(self, log_u: Tensor) -> Tensor:
        return (log_u.exp() - 1.0) ** 2

    def f_prime(self, log_u: Tensor) -> Tensor:
        return 2.0 * (log_u.exp() - 1.0)

    def log_f_prime_inverse(self, v: Tensor) -> Tensor:
        u = 1.0 + v / 2.0
        return torch.where(u > 0, torch.log(u.clamp(min=0)), -math.inf)


# |alpha| past this: u^(-alpha) overflows float64 (e^709) for a response a few nats from the reference (7 at alpha 100), and
# the penalty is inf on one side of u = 1 and vanishes (1 / alpha) on the other. Below ALPHA_MIN (float64's smallest
# normal number), alpha is subnormal. Between them the penalty is computed to float64's precision (expm1).
ALPHA_MAX, ALPHA_MIN = 100.0, 2.2250738585072014e-308


@register("divergence", "alpha", description="alpha-divergence, f(u) = (u^(1-alpha) - (1-alpha) u - alpha) / (alpha (alpha - 1))")
class AlphaDivergence(Divergence):
    """The alpha-divergence (f-DPO's parametrisation), f(u) = (u^(1 - alpha) - (1 - alpha) u - alpha) /
    (alpha (alpha - 1)), f'(u) = (1 - u^(-alpha)) / alpha, (f')^{-1}(v) = (1 - alpha v)^(-1 / alpha): the reverse
    KL as alpha -> 0, the forward KL as alpha -> 1, chi2 / 2 at alpha = -1. For alpha < 0 pi* may drop
    responses (u clipped at 0 where 1 - alpha v <= 0); for alpha > 0 it keeps every one.

    Args:
        alpha: a number in [-100, 100] but 0 and 1 (use ``reverse_kl`` and ``forward_kl``), not subnormal.
    """

    def __init__(self, alpha: float = 0.5) -> None:
        require_number("divergence.alpha", alpha, at_least=-ALPHA_MAX, at_most=ALPHA_MAX)
        require(alpha not in (0, 1), "divergence.alpha", "a number other than 0 and 1 (for those: reverse_kl, forward_kl)", alpha)
        require(
            abs(alpha) >= ALPHA_MIN,
            "divergence.alpha",
            f"at least {ALPHA_MIN:g} in size, float64's smallest normal number (a subnormal alpha keeps a few bits: its penalty is no longer the formula's)",
            alpha,
        )
        self.alpha = float(alpha)

    # Written with expm1 (u^(-a) - 1 = expm1(-a log u)): at an alpha near 0 the differences of terms near 1 would cancel
    # to 0 in float64 (alpha 1e-300: a penalty of exactly 0, the regulariser gone) where these tend to the reverse KL's.
    def f(self, log_u: Tensor) -> Tensor:
        a = self.alpha
        return (log_u.exp() * torch.expm1(-a * log_u) / a + torch.expm1(log_u)) / (a - 1.0)

    def f_prime(self, log_u: Tensor) -> Tensor:
        return -torch.expm1(-self.alpha * log_u) / self.alpha

    def log_f_prime_inverse(self, v: Tensor) -> Tensor:
        a = self.alpha
        base = 1.0 - a * v
        outside = math.inf if a > 0 else -math.inf  # a > 0: v at or past sup f' = 1 / a; a < 0: below f'(0) = 1 / a
        return torch.where(base > 0, -torch.log1p((-a * v).clamp(min=-1.0 + 1e-300)) / a, outside)
