"""The reward-KL plane, exactly: the KL-regularised frontier, best-of-N and soft best-of-N as
distributions over enumerated responses, and the distance of a policy from the optimum estimated
from samples. Pure functions of log-probabilities and rewards; no model, no Lightning.

Layout as in :mod:`rlhf_lightning.exact.closed_form`: (prompts, responses) tensors, one row per prompt, each
row a distribution over that prompt's responses (every response of an enumerable task, or a pool
of n samples from pi_ref, each with probability 1 / n).

- **The frontier.** max E_pi r s.t. KL(pi || pi_ref) <= eps is attained by the tilted optimum
  pi_beta ∝ pi_ref exp(r / beta) for the beta whose KL is eps (the Lagrangian of the constraint;
  one beta for all prompts when the KL is averaged over them). :func:`frontier_reward` inverts
  KL(beta), monotone decreasing, by bisection: the frontier's reward at any KL, not an
  interpolation between grid points.
- **Best-of-N** draws N responses from pi_ref and keeps one of highest reward. With F(v) = P_ref(r <= v)
  and F(v-) = P_ref(r < v), the kept reward is v with probability F(v)^N - F(v-)^N, and given that,
  the response is pi_ref restricted to {r = v} (whatever the tie-break, as long as it looks only at
  rewards and positions), so

      P_BoN(y) = pi_ref(y) (F(r_y)^N - F(r_y-)^N) / P_ref(r = r_y).

  P_BoN / pi_ref depends on y only through r_y, so KL(BoN || pi_ref) is the KL between the two laws
  of the reward: ties lower it. Beirami et al. (2024, "Theoretical guarantees on the best-of-n
  alignment policy") show that the usual log N - (N - 1) / N (:func:`bon_kl_bound`) is the KL of a
  continuous reward law and an upper bound for every other.
- **Soft best-of-N** (Verdun et al. 2025, "Soft Best-of-n Sampling") draws N responses and keeps y_i
  with probability ∝ exp(r_i / lam). With w = exp(r / lam) and 1 / s = ∫_0^∞ exp(-t s) dt,

      P_soft(y) = N pi_ref(y) w_y ∫_0^∞ exp(-t w_y) M(t)^(N - 1) dt,    M(t) = E_ref exp(-t w),

  a one-dimensional integral (:func:`soft_bon_logprobs`, trapezoid rule in log t). N = 1 is pi_ref,
  lam -> 0 is best-of-N, N -> ∞ is pi_lam.
- **Distance to the optimum from samples.** KL(pi || pi_beta) = E_pi[log pi - log pi_ref - r / beta] + log Z
  with Z = E_ref exp(r / beta) = (J* - J(pi)) / beta. log Z from n reference samples, log mean w, is
  biased low (Jensen); the delta method gives its bias -(1/2) Var(w) / (n E[w]^2) and its standard
  error, both read from the effective sample size ESS = (sum w)^2 / sum w^2 of the weights
  (:func:`log_partition_estimate`). A heavy tail of w (a small beta) leaves the sample's ESS small
  and the bias unbounded: :class:`LogZEstimate` says when not to trust it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from rlhf_lightning.exact.closed_form import expected_reward, kl_divergence, optimal_logprobs


# ---------------------------------------------------------------------- best-of-N
def bon_kl_bound(n: int) -> float:
    """log N - (N - 1) / N: KL(BoN || pi_ref) for a continuous reward law, an upper bound otherwise."""
    return math.log(n) - (n - 1) / n


def _reward_cdf(logprobs: Tensor, rewards: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """F(r_y) = P(r <= r_y), F(r_y-) = P(r < r_y) and P(r = r_y) under each row's distribution: (prompts, responses) each.
    The level masses are summed per distinct reward, not taken as F - F(-), which would cancel near F = 1."""
    at_most, below, level = [], [], []
    for p, r in zip(logprobs.double().exp(), rewards.double(), strict=True):
        values, inverse = torch.unique(r, return_inverse=True)  # values ascending
        mass = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, p)
        cumulative = mass.cumsum(0).clamp(max=1.0)
        at_most.append(cumulative[inverse])
        below.append((cumulative - mass).clamp(min=0.0)[inverse])
        level.append(mass[inverse])
    return torch.stack(at_most), torch.stack(below), torch.stack(level)


def bon_logprobs(ref_logprobs: Tensor, rewards: Tensor, n: int) -> Tensor:
    """log P_BoN(y|x) of best-of-``n`` over pi_ref, ties exact (module docstring): (prompts, responses)."""
    if n < 1:
        raise ValueError(f"best-of-N needs N >= 1, got {n}")
    at_most, below, level = _reward_cdf(ref_logprobs, rewards)
    # log(F^N - G^N) = N log F + log(1 - (G / F)^N), stable when G is close to F
    log_kept = n * at_most.log() + torch.log(-torch.expm1(n * (below.log() - at_most.log())))
    return ref_logprobs.double() - level.log() + log_kept


def soft_bon_logprobs(ref_logprobs: Tensor, rewards: Tensor, n: int, lam: float, step: float = 0.05) -> Tensor:
    """log P_soft(y|x) of soft best-of-``n`` at temperature ``lam`` (module docstring): (prompts, responses).
    The integral runs over u = log t with nodes ``step`` apart, from where the integrand is ~exp(-25)
    to 50 / min w: the trapezoid rule on a smooth integrand that vanishes at both ends (tests/test_frontier.py
    checks that the rows sum to 1). Refused where a row's reward range exceeds 700 lam: its smallest
    weights would underflow float64 (where lam is far below every gap between rewards, soft best-of-N is
    best-of-N: :func:`bon_logprobs`)."""
    if n < 1 or not lam > 0:
        raise ValueError(f"soft best-of-N needs N >= 1 and lam > 0, got N={n}, lam={lam}")
    spread = float((rewards.max(-1).values - rewards.min(-1).values).max())
    if spread > 700 * lam:
        raise ValueError(f"soft best-of-N with lam={lam} on rewards {spread:.3g} apart: exp(-range / lam) underflows; lam >= range / 700")
    logp, r = ref_logprobs.double(), rewards.double()
    log_w = (r - r.max(-1, keepdim=True).values) / lam  # <= 0, max 0: t up to ~50 / min w covers every response
    rows = []
    for lp, lw in zip(logp, log_w, strict=True):
        lo, hi = -25.0, math.log(50.0) - float(lw.min())
        points = math.ceil((hi - lo) / step) + 1
        u = torch.linspace(lo, hi, points, dtype=torch.float64)  # t = exp(u)
        t = u.exp()
        log_m = torch.logsumexp(lp.unsqueeze(-1) - t * lw.exp().unsqueeze(-1), dim=0)  # log M(t): (points,)
        # integrand in u: w_y exp(-t w_y) M(t)^(N - 1) t, in logs: (responses, points)
        log_f = lw.unsqueeze(-1) - t * lw.exp().unsqueeze(-1) + (n - 1) * log_m + u
        log_integral = torch.logsumexp(log_f, dim=-1) + math.log((hi - lo) / (points - 1))  # trapezoid: the ends are ~0
        rows.append(math.log(n) + lp + log_integral)
    return torch.stack(rows)


# ---------------------------------------------------------------------- the frontier
@dataclass(frozen=True)
class PlanePoint:
    """Exact E_x E_pi r and E_x KL(pi || pi_ref) of one policy."""

    kl: float
    reward: float


def plane_point(logprobs: Tensor, ref_logprobs: Tensor, rewards: Tensor) -> PlanePoint:
    return PlanePoint(kl=kl_divergence(logprobs, ref_logprobs), reward=expected_reward(logprobs, rewards))


def tilted_point(ref_logprobs: Tensor, rewards: Tensor, beta: float) -> PlanePoint:
    """The frontier's point at ``beta``: pi_beta ∝ pi_ref exp(r / beta)."""
    return plane_point(optimal_logprobs(ref_logprobs, rewards, beta), ref_logprobs, rewards)


def frontier_reward(ref_logprobs: Tensor, rewards: Tensor, kl: float, tol: float = 1e-10) -> float:
    """The largest E_x E_pi r of any policy with E_x KL(pi || pi_ref) <= ``kl``: pi_beta's reward at the
    beta where its KL equals ``kl`` (:func:`reward_at_kl`). Beyond the reward maximiser's KL it is the maximum reward."""
    if kl <= 0:
        return expected_reward(ref_logprobs, rewards)
    return reward_at_kl(lambda beta: tilted_point(ref_logprobs, rewards, beta), kl, tol)


def reward_at_kl(point_at: Callable[[float], PlanePoint], kl: float, tol: float = 1e-10) -> float:
    """The reward of ``point_at(beta)``, the maximiser of E r - beta KL, at the beta whose KL is ``kl``: bisection on
    log beta over [1e-4, 1e4] (a Lagrangian's KL falls as beta grows), the greediest point's reward beyond its KL.
    Every policy with KL <= ``kl`` earns at most this (E r - beta KL is largest at the maximiser)."""
    lo, hi = math.log(1e-4), math.log(1e4)  # KL(lo) >= kl >= KL(hi) unless kl is outside the range
    greediest = point_at(math.exp(lo))
    if greediest.kl <= kl:
        return greediest.reward
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if point_at(math.exp(mid)).kl > kl else (lo, mid)
    return point_at(math.exp(hi)).reward


def frontier_gap(point: PlanePoint, ref_logprobs: Tensor, rewards: Tensor) -> float:
    """How far ``point`` lies below the frontier at its own KL, relative: (F(kl) - reward) / |F(kl)|."""
    best = frontier_reward(ref_logprobs, rewards, point.kl)
    return (best - point.reward) / abs(best)


# ---------------------------------------------------------------------- distance to the optimum from samples
@dataclass(frozen=True)
class LogZEstimate:
    """log Z = log E_ref exp(r / beta) per prompt from ``n`` reference samples each: (prompts,) tensors.

    ``plug_in`` = logsumexp(r / beta) - log n, whose delta-method bias is ``bias`` = -se^2 / 2 (low:
    Jensen); ``corrected`` = plug_in - bias; ``se`` = sqrt((n / ESS - 1) / n), the delta-method standard
    error, sqrt(Var(w) / n) / E[w] with the sample's moments; ``ess`` = (sum w)^2 / sum w^2. All of it
    rests on the sample's second moment of w: where the tail of w is heavy the sample has not seen
    it, ESS is small, and neither the value nor its interval is worth printing (:meth:`untrusted`)."""

    plug_in: Tensor
    corrected: Tensor
    bias: Tensor
    se: Tensor
    ess: Tensor
    n: int
    beta: float

    def untrusted(self, min_ess: float, reward_max: Optional[float] = None, max_tail: float = 0.1) -> Optional[str]:
        """Why the estimate cannot be trusted, or None: a prompt whose ESS is below ``min_ess``, or, given an
        upper bound ``reward_max`` of the reward, a prompt where what the sample cannot have seen could add
        more than ``max_tail`` nats to log Z: up to 3 / n of pi_ref's mass (the rule of three, ~95%) above
        the sample's largest reward, each worth at most exp(reward_max / beta). ESS alone misses that case:
        a sample that never drew the rare high reward has equal weights and a fine-looking ESS."""
        worst = int(self.ess.argmin())
        if float(self.ess[worst]) < min_ess:
            return (
                f"ESS of exp(r / beta) over {self.n} reference samples is {float(self.ess[worst]):.1f} < {min_ess:g} "
                f"(prompt {worst}): heavy tail, beta {self.beta:.3g} too small for this many samples"
            )
        if reward_max is not None:
            tail = float((torch.logaddexp(self.plug_in, torch.tensor(math.log(3 / self.n) + reward_max / self.beta)) - self.plug_in).max())
            if tail > max_tail:
                return (
                    f"the unseen tail could add up to {tail:.2f} nats to log Z (> max_tail {max_tail:g}): "
                    f"beta {self.beta:.3g} is too small for {self.n} reference samples with rewards up to {reward_max:g}"
                )
        return None


def log_partition_estimate(rewards: Tensor, beta: float) -> LogZEstimate:
    """:class:`LogZEstimate` from reference-sample rewards (prompts, n) at ``beta`` > 0."""
    if not beta > 0:
        raise ValueError(f"log Z needs beta > 0, got {beta}")
    s = rewards.double() / beta  # (prompts, n)
    n = s.shape[-1]
    plug_in = torch.logsumexp(s, -1) - math.log(n)
    ess = torch.exp(2 * torch.logsumexp(s, -1) - torch.logsumexp(2 * s, -1))
    var = (n / ess - 1).clamp(min=0) / n  # delta method: Var(log mean w) ~ Var(w) / (n E[w]^2)
    return LogZEstimate(plug_in=plug_in, corrected=plug_in + var / 2, bias=-var / 2, se=var.sqrt(), ess=ess, n=n, beta=beta)


@dataclass(frozen=True)
class OptimumDistance:
    """E_x KL(pi || pi_beta) estimated from samples, its standard error, and J* - J = beta * KL."""

    kl_to_optimum: float
    se: float
    gap: float  # J* - J(pi) = beta * kl_to_optimum
    log_z: float  # E_x log Z (bias-corrected)
    log_z_bias: float  # the plug-in's delta-method bias, already removed from kl_to_optimum
    reward: float  # E_pi r over the policy samples
    kl_to_ref: float  # E_pi[log pi - log pi_ref] (k1 of the whole response)
    reward_se: float
    kl_to_ref_se: float
    samples_se: float  # the policy samples' part of se; log Z's part is common to every measurement from one pool

    def fall_since(self, start: OptimumDistance) -> tuple[float, float]:
        """How far the distance fell since ``start`` (a measurement with the same log Z pool and beta) and its
        standard error: log Z cancels, so only the two sets of policy samples add variance."""
        return start.kl_to_optimum - self.kl_to_optimum, math.hypot(start.samples_se, self.samples_se)


def kl_to_optimum(
    log_ratio: Tensor, rewards: Tensor, log_z: Union[LogZEstimate, Tensor], beta: float, weights: Optional[Tensor] = None
) -> OptimumDistance:
    """KL(pi || pi_beta) = E_pi[log pi - log pi_ref - r / beta] + log Z, averaged over prompts, from
    policy samples ``log_ratio`` (log pi - log pi_ref of whole responses) and ``rewards``, both
    (prompts, m), and ``log_z`` of the same prompts: an estimate, or exact values (prompts,).

    ``weights`` (prompts, m), rows summing to 1, turn the sample means into weighted sums: with every
    response of an enumerable task weighted by pi(y) and the exact log Z, the result is the exact
    KL(pi || pi_beta). The standard error adds the two independent parts' variances (policy samples:
    sample variance / m per prompt, 0 with ``weights``; log Z: the delta method, 0 when exact)."""
    log_ratio, rewards = log_ratio.double(), rewards.double()
    prompts, m = log_ratio.shape
    if not isinstance(log_z, LogZEstimate):
        zero = torch.zeros(prompts, dtype=torch.float64)
        log_z = LogZEstimate(log_z.double(), log_z.double(), zero, zero, torch.full((prompts,), math.inf), m, beta)

    def mean_se(x: Tensor) -> tuple[float, float]:
        if weights is not None:
            return float((weights.double() * x).sum(-1).mean()), 0.0
        var = x.var(-1) / m if m > 1 else torch.zeros(prompts, dtype=torch.float64)
        return float(x.mean()), float(var.sum().sqrt() / prompts)

    term, term_se = mean_se(log_ratio - rewards / beta)
    log_z_mean, log_z_se = float(log_z.corrected.mean()), float(log_z.se.pow(2).sum().sqrt() / prompts)
    kl = term + log_z_mean
    reward, reward_se = mean_se(rewards)
    kl_ref, kl_ref_se = mean_se(log_ratio)
    return OptimumDistance(
        kl_to_optimum=kl,
        se=math.hypot(term_se, log_z_se),
        gap=beta * kl,
        log_z=log_z_mean,
        log_z_bias=float(log_z.bias.mean()),
        reward=reward,
        kl_to_ref=kl_ref,
        reward_se=reward_se,
        kl_to_ref_se=kl_ref_se,
        samples_se=term_se,
    )


# ---------------------------------------------------------------------- best-of-N from a reference pool
def bon_reward_from_pool(rewards: Tensor, n: int) -> Tensor:
    """Unbiased E[max of ``n`` draws from pi_ref] per prompt from a pool of M >= n reference rewards
    (prompts, M): the U-statistic sum_i r_(i) C(i - 1, n - 1) / C(M, n) over the sorted pool (every
    n-subset's maximum, averaged). (prompts,)"""
    m = rewards.shape[-1]
    if not 1 <= n <= m:
        raise ValueError(f"best-of-{n} from a pool of {m} samples needs 1 <= N <= M")
    ranks = torch.arange(1, m + 1, dtype=torch.float64)
    log_comb = torch.lgamma(ranks) - math.lgamma(n) - torch.lgamma((ranks - n + 1).clamp(min=1)) - math.log(math.comb(m, n))
    weights = torch.where(ranks >= n, log_comb.exp(), torch.zeros(m, dtype=torch.float64))  # C(i - 1, n - 1) / C(M, n)
    return (rewards.double().sort(-1).values * weights).sum(-1)


def bon_kl_from_pool(rewards: Tensor, n: int) -> Tensor:
    """KL(BoN || pi_ref) per prompt, plugged in: the exact best-of-``n`` KL of the pool's empirical reward
    law (each of the M samples 1 / M; ties as sampled). Below the bound by what the pool's ties say and by
    the discreteness of M atoms (a continuous law's log N - (N - 1) / N is approached as M grows). (prompts,)"""
    m = rewards.shape[-1]
    uniform = torch.full(rewards.shape, -math.log(m), dtype=torch.float64)
    bon = bon_logprobs(uniform, rewards, n)
    return (bon.exp() * (bon - uniform)).sum(-1)
