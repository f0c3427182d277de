"""The KL-regularised optimum in closed form, on tasks small enough to enumerate every response.

The KL-regularised objective

    J(pi) = E_x [ E_{y~pi(.|x)} r(x, y)  -  beta * KL(pi(.|x) || pi_ref(.|x)) ]

has the closed-form maximiser pi*(y|x) = pi_ref(y|x) exp(r(x, y) / beta) / Z(x) with
Z(x) = sum_y pi_ref(y|x) exp(r(x, y) / beta), and J* = J(pi*) = beta * E_x log Z(x)
(e.g. Rafailov et al. 2023, "Direct Preference Optimization", eq. 4). For any pi,
J(pi) = J* - beta * KL(pi || pi*), so the objective gap measures the distance to the optimum
in the KL that matters.

A reference that moves (PPORLHF's ``reference_update``): if the policy converges to the optimum
of its reference before every sync or reset, the reference after k of them is the iterated optimum

    pi_k(y|x) ∝ pi_0(y|x) exp(k r(x, y) / beta),

the optimum of the original objective at beta / k (:func:`iterated_optimal_logprobs`): resets anneal
beta. An EMA reference ref <- (1 - alpha) ref + alpha pi moves its log-probabilities by the
geometric mixture (exact when they are linear in the averaged parameters, first order otherwise),
log ref' = (1 - alpha) log ref + alpha log pi - log norm; with the policy at ref's optimum that is
ref' ∝ ref exp(alpha r / beta), so n updates give pi_{n alpha} (:func:`ema_reference_logprobs`). Its
only fixed points (ref = pi*(ref)) are distributions on argmax_y r(x, y): no KL-regularised
interior optimum survives a reference that keeps following the policy.

Per-prompt betas (a per-prompt controller's, one beta_x per prompt): J(pi) = E_x [ E r - beta_x KL_x ] is
maximised prompt by prompt, pi*(.|x) ∝ pi_ref(.|x) exp(r / beta_x), J* = E_x beta_x log Z_x(beta_x) and
J* - J(pi) = E_x beta_x KL(pi(.|x) || pi*(.|x)). Where beta_x makes KL(pi*(.|x) || pi_ref(.|x)) equal the
prompt's budget (:func:`prompt_betas`), pi* maximises E r subject to every prompt's KL <= its budget: the
betas are the Lagrange multipliers of those constraints. The functions below that take ``beta`` take
either one number or a tensor (num_prompts,) of them.

Functions on log-probabilities take tensors of shape (num_prompts, num_responses), one row per
prompt, each row a distribution over all responses in the order of :func:`enumerate_responses`.
Pure functions of tensors: no model, no Lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from rlhf_lightning.exact.f_divergence import divergence_objective, divergence_optimal_logprobs
from rlhf_lightning.exact.tabular import expected_log_ratio, log_normalise, reward_to_go, sum_after
from rlhf_lightning.interfaces import Divergence

Beta = Union[float, Tensor]  # one beta, or one per prompt: (prompts,)


def _column(beta: Beta) -> Tensor:
    """``beta`` as a float64 column: (1, 1) for one number, (prompts, 1) for one per prompt."""
    return torch.as_tensor(beta, dtype=torch.float64).reshape(-1, 1)


def log_partition(ref_logprobs: Tensor, rewards: Tensor, beta: Beta) -> Tensor:
    """log Z(x) = log sum_y pi_ref(y|x) exp(r(x, y) / beta_x): (prompts, responses) -> (prompts,)."""
    return torch.logsumexp(ref_logprobs.double() + rewards.double() / _column(beta), dim=-1)


def optimal_logprobs(ref_logprobs: Tensor, rewards: Tensor, beta: Beta) -> Tensor:
    """log pi*(y|x) = log pi_ref(y|x) + r(x, y) / beta_x - log Z(x)."""
    return ref_logprobs.double() + rewards.double() / _column(beta) - log_partition(ref_logprobs, rewards, beta).unsqueeze(-1)


def iterated_optimal_logprobs(initial_logprobs: Tensor, rewards: Tensor, beta: float, k: float) -> Tensor:
    """log pi_k = log pi_0 + k r / beta - log Z_k: the optimum after k converged reference resets
    (k may be fractional: an EMA reference), i.e. the optimum at beta / k."""
    return optimal_logprobs(initial_logprobs, rewards, beta / k)


def ema_reference_logprobs(ref_logprobs: Tensor, rewards: Tensor, beta: float, alpha: float) -> Tensor:
    """One EMA update of a reference whose policy sits at its optimum, as a normalised geometric
    mixture: log ref' = (1 - alpha) log ref + alpha log pi*(ref) - log norm."""
    mixed = (1 - alpha) * ref_logprobs.double() + alpha * optimal_logprobs(ref_logprobs, rewards, beta)
    return mixed - torch.logsumexp(mixed, dim=-1, keepdim=True)


def optimal_objective(ref_logprobs: Tensor, rewards: Tensor, beta: Beta) -> float:
    """J* = E_x beta_x log Z(x)."""
    return float((_column(beta).squeeze(-1) * log_partition(ref_logprobs, rewards, beta)).mean())


def kl_divergence(logp: Tensor, logq: Tensor) -> float:
    """E_x KL(p(.|x) || q(.|x)) = E_x sum_y p (log p - log q), with 0 log 0 = 0."""
    return float(expected_log_ratio(logp.double(), logq.double()).mean())


def expected_reward(logprobs: Tensor, rewards: Tensor) -> float:
    """E_x E_{y~pi} r(x, y)."""
    return float((logprobs.double().exp() * rewards.double()).sum(-1).mean())


def objective(logprobs: Tensor, ref_logprobs: Tensor, rewards: Tensor, beta: Beta) -> float:
    """J(pi) = E_x [ E_{y~pi} r(x, y) - beta_x * KL(pi(.|x) || pi_ref(.|x)) ]."""
    if isinstance(beta, Tensor):
        kl = expected_log_ratio(logprobs.double(), ref_logprobs.double())  # (prompts,)
        return expected_reward(logprobs, rewards) - float((beta.double() * kl).mean())
    return expected_reward(logprobs, rewards) - beta * kl_divergence(logprobs, ref_logprobs)


def backward_induction(ref_logprobs: Tensor, rewards: Tensor, beta: float, num_tokens: int, soft: bool = True) -> Tensor:
    """The policy built token by token from the last position back, pi(a | s) ∝ pi_ref(a | s) exp(Q(s, a) / beta),
    as log pi(y|x) over whole responses (same layout as ``ref_logprobs``; responses in the order of
    :func:`enumerate_responses` over ``num_tokens`` content tokens; the reward is terminal).

    ``soft=True``: Q(s, a) = V(s + a) with V(s) = beta log sum_a pi_ref(a|s) exp(Q(s, a) / beta), the
    soft value that charges the KL of every later token: this is pi* itself (equal to
    :func:`optimal_logprobs`). ``soft=False``: V(s) = E_{a~pi}[Q(s, a)], the expected reward to go
    with no KL of later tokens: the fixed point of a per-token KL loss, grad E[r] - beta E_s grad
    KL(pi(.|s) || pi_ref(.|s)) = 0 at every visited s, which never charges a token for the KL of the
    states it leads to (Tang & Munos, 2025, "On a few pitfalls in KL divergence gradient estimation
    for RL", sec. 4).

    The two differ whenever the KL still to be paid after a token depends on the tokens already chosen:
    soft Q(s, a) = E[r | s, a] - beta * (the KL the optimal continuation of s + a pays), and the
    per-token fixed point drops the second part. That is so for almost every reward that depends on
    token order (pairs, transitions, positions), even under a reference that ignores the prefix, a
    uniform one included (the :meth:`ExactTask.random` tasks); it vanishes when the
    continuation's optimal KL is the same after every token, as on a one-token bandit or with a terminal
    reward that counts tokens under a prefix-independent reference.
    """
    prompts, responses = ref_logprobs.shape
    length = round(math.log(responses, num_tokens))
    shape = (prompts, *[num_tokens] * length)
    ref, value = ref_logprobs.double().view(shape), rewards.double().view(shape)
    logprobs = torch.zeros(shape, dtype=torch.float64)
    for t in reversed(range(length)):  # value: (prompts, K ** (t + 1)) over prefixes of t + 1 tokens
        logits = log_normalise(sum_after(ref, t + 1, log=True)) + value / beta
        policy = log_normalise(logits)  # log pi(a | prefix of t tokens); -inf where no response goes
        value = beta * logits.logsumexp(-1) if soft else torch.where(policy > -math.inf, policy.exp() * value, 0.0).sum(-1)
        logprobs = logprobs + policy.view(*policy.shape, *[1] * (length - t - 1))
    return logprobs.view(prompts, responses)


def weighted_fixed_point(
    ref_logprobs: Tensor,
    rewards: Tensor,
    beta: float,
    num_tokens: int,
    weights: Tensor,
    lengths: Tensor,
    scope: str = "sequence",
    rounds: int = 500,
    tolerance: float = 1e-12,
) -> Tensor:
    """Where PPO with the KL in the loss settles when each response's loss is weighted by ``weights`` w(y)
    (paths,): ``seq_mean_token_mean`` weighs response i by 1 / |y_i| (``lengths``, tokens up to and including
    EOS), while ``token_mean``, ``seq_mean_token_sum`` and ``constant`` weigh every response alike (w constant:
    this is then pi* for ``scope='sequence'`` and :func:`backward_induction` (``soft=False``) for ``per_token``).
    Log pi(y|x) in the layout of ``ref_logprobs`` (the tree over ``num_tokens`` symbols, EOS the last).

    The baselines are the critic-free estimators' with a mean baseline (rloo, dr_grpo, reinforce_pp; not grpo,
    whose per-prompt std divides the reward and not the KL): the reward's b_r(x) = E_pi[r | x] and, for the sequence scope, the KL's group baseline of
    ``ppo_math.kl_to_go_loss``, b_t(x) = E_pi[L_{>=t} | x, |y| > t] with L_{>=t} = sum_{t' >= t} l_t' and
    l_t = log pi(y_t | s_t) / pi_ref(y_t | s_t). The expected gradient of the loss on the logit of a at state s
    (t tokens in) is P(s) pi(a|s) (h(s, a) - sum_b pi(b|s) h(s, b)) with

        h(s, a) = E_pi[ w(y) (r(y) - b_r - beta (L_{>=t}(y) - b_t)) | s, a ]          (per_token: beta l_t only),

    so at an interior stationary point h(s, .) is one constant c(s) over the actions. With l_t(a|s) inside
    L_{>=t}, m = E[w | s, a] and n = E[w (r - beta L_{>t}) | s, a] over pi's own continuation,

        l(a|s) = (n - (b_r - beta b_t) m - c(s)) / (beta m),     pi(a|s) = pi_ref(a|s) exp(l(a|s)),

    c(s) the root of sum_a pi(a|s) = 1 (Newton: the log-sum is convex and decreasing in c). Solved from the
    last position back, as :func:`backward_induction`, inside a fixed point on the baselines (which depend
    on pi): ``rounds`` at most, until no log-probability moves by more than ``tolerance``. A constant w makes
    the baselines drop out (they multiply m, the same for every action) and gives pi* or the per-token
    fixed point in one round; 1 / |y| makes them matter: a short response's tokens weigh more, and so does
    the baseline's pull on them (Dr. GRPO's length bias, with the KL in the loss)."""
    if scope not in ("sequence", "per_token"):
        raise ValueError(f"scope must be 'sequence' or 'per_token', got {scope!r}")
    prompts, paths = ref_logprobs.shape
    length = round(math.log(paths, num_tokens))
    shape = (prompts, *[num_tokens] * length)
    ref, reward = ref_logprobs.double().view(shape), rewards.double().view(shape)
    weight = weights.double().expand(prompts, paths).reshape(shape)
    on_mask = [(lengths > t).double().expand(prompts, paths).reshape(shape) for t in range(length)]
    logprobs, ratios = ref, [torch.zeros(shape, dtype=torch.float64)] * length  # pi = pi_ref to start
    for _ in range(rounds):
        probs = logprobs.exp()
        b_r = sum_after(probs * reward, 0).view(prompts, *[1] * length)
        later_all = torch.stack(ratios).flip(0).cumsum(0).flip(0)  # L_{>=t}, t = 0 .. L-1
        b_t = [sum_after(probs * on_mask[t] * later_all[t], 0) / sum_after(probs * on_mask[t], 0).clamp(min=1e-300) for t in range(length)]
        continuation, later, new_ratios = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64), []
        for t in reversed(range(length)):
            cond_ref = log_normalise(sum_after(ref, t + 1, log=True))
            reach = continuation.exp()  # pi(rest | s, a): sums to 1 under each reachable (s, a)
            target = reward - beta * later if scope == "sequence" else reward
            m = sum_after(reach * weight, t + 1)
            n = sum_after(reach * weight * target, t + 1)
            baseline = b_r.view(prompts, *[1] * (t + 1)) - (beta * b_t[t].view(prompts, *[1] * (t + 1)) if scope == "sequence" else 0)
            allowed = cond_ref > -math.inf
            scale = beta * m.clamp(min=1e-300)
            free = torch.where(allowed, cond_ref + (n - baseline * m) / scale, -math.inf)
            c = torch.zeros((*free.shape[:-1], 1), dtype=torch.float64)
            for _ in range(100):  # Newton on g(c) = logsumexp_a(free_a - c / scale_a) = 0
                logits = free - c / scale
                g = logits.logsumexp(-1, keepdim=True)
                slope = torch.where(allowed, (logits - g).exp() / scale, 0.0).sum(-1, keepdim=True)
                c = torch.where(g > -math.inf, c + g / slope.clamp(min=1e-300), c)
            policy = log_normalise(free - c / scale)  # normalised already at the root; this removes the last rounding
            ratio = torch.where(allowed, policy - cond_ref, 0.0)
            expand = (*ratio.shape, *[1] * (length - t - 1))
            continuation = continuation + policy.view(expand)
            later = later + ratio.view(expand)
            new_ratios.insert(0, ratio.view(expand).expand(shape))
        moved = torch.where(continuation > -math.inf, (continuation - logprobs).abs(), 0.0).max()
        logprobs, ratios = continuation, new_ratios
        if moved < tolerance:
            break
    return logprobs.reshape(prompts, paths)


def per_token_residuals(
    logprobs: Tensor, ref_logprobs: Tensor, rewards: Tensor, beta: float, num_tokens: int
) -> list[tuple[Tensor, Tensor]]:
    """How far a policy is from the per-token fixed point, state by state: for each position t, over the prefixes s
    of t tokens, the residual KL(pi(. | s) || pi_ref(. | s) exp(Q(s, .) / beta) / Z(s)), with Q(s, a) = E_pi[r | s, a]
    the reward to go under pi's own continuation (no KL of later tokens), beside the prefix's probability P_pi(s);
    each (prompts, K ** t). Every residual is 0 exactly at :func:`backward_induction` (``soft=False``), the only
    policy that meets the per-token condition at every state; pi* misses it where the KL still to be paid after a
    token depends on that token."""
    prompts, responses = logprobs.shape
    length = round(math.log(responses, num_tokens))
    shape = (prompts, *[num_tokens] * length)
    joint, ref, reward = logprobs.double().view(shape), ref_logprobs.double().view(shape), rewards.double().view(shape)
    probs, out = joint.exp(), []
    for t in range(length):
        log_sa, ref_sa = sum_after(joint, t + 1, log=True), sum_after(ref, t + 1, log=True)  # log P(s, a)
        q = reward_to_go(probs, reward, t + 1)
        policy = log_normalise(log_sa)
        target = log_normalise(log_normalise(ref_sa) + q / beta)
        residual = expected_log_ratio(policy, target)
        out.append((residual.reshape(prompts, -1), log_sa.logsumexp(-1).exp().reshape(prompts, -1)))
    return out


def controller_beta(ref_logprobs: Tensor, rewards: Tensor, target: float, unit: str, lengths: Tensor) -> float:
    """The beta at which an adaptive controller holding the KL at ``target`` in its ``unit`` rests when the
    policy sits at pi*_beta: ``sequence_sum`` E_x KL(pi*_beta || pi_ref) = target; ``token_mean`` (the
    module's ``objective/kl_per_token``, total KL over total tokens) E_x KL / E_x E |y| = target, ``lengths``
    (paths,) in tokens with EOS. Both land on a tilted optimum, at different betas: the unit decides which
    (bisection on log beta; the KL of pi*_beta falls as beta grows)."""
    if unit not in ("sequence_sum", "token_mean"):
        raise ValueError(f"unit must be 'sequence_sum' or 'token_mean', got {unit!r}")

    def kl_in_unit(beta: float) -> float:
        opt = optimal_logprobs(ref_logprobs, rewards, beta)
        kl = kl_divergence(opt, ref_logprobs)
        return kl if unit == "sequence_sum" else kl / float((opt.exp() * lengths.double()).sum(-1).mean())

    low, high = math.log(1e-4), math.log(1e4)
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if kl_in_unit(math.exp(middle)) > target else (low, middle)
    return math.exp((low + high) / 2)


def prompt_kls(logprobs: Tensor, ref_logprobs: Tensor, unit: str, lengths: Tensor) -> Tensor:
    """Each prompt's KL(pi(.|x) || pi_ref(.|x)) in a controller's ``unit``: nats per response (``sequence_sum``) or per
    token (``token_mean``: KL_x / E_pi[|y| | x], ``lengths`` (paths,) in tokens with EOS); (prompts,) float64."""
    if unit not in ("sequence_sum", "token_mean"):
        raise ValueError(f"unit must be 'sequence_sum' or 'token_mean', got {unit!r}")
    kl = expected_log_ratio(logprobs.double(), ref_logprobs.double())
    return kl if unit == "sequence_sum" else kl / (logprobs.double().exp() * lengths.double()).sum(-1)


def prompt_betas(ref_logprobs: Tensor, rewards: Tensor, budgets: Tensor, unit: str, lengths: Tensor) -> Tensor:
    """Where a per-prompt controller rests (``per_prompt``): for each prompt x the beta_x at which its own tilted
    optimum pi*_{beta_x}(.|x) spends exactly its budget, in ``unit`` (:func:`controller_beta` on that prompt's
    row alone); (prompts,) float64. A budget above what any beta reaches (the KL of the reward maximiser) ends
    at the bisection's floor, 1e-4."""
    rows = range(ref_logprobs.shape[0])
    return torch.tensor(
        [controller_beta(ref_logprobs[i : i + 1], rewards[i : i + 1], float(budgets[i]), unit, lengths) for i in rows], dtype=torch.float64
    )


def length_report(logprobs: Tensor, lengths: Tensor, ended_with_eos: Tensor) -> dict[str, float]:
    """E_x E_pi |y| (tokens, EOS included) and E_x P_pi(cut without EOS) of ``logprobs`` over paths whose
    ``lengths`` and ``ended_with_eos`` are given (paths,)."""
    probs = logprobs.double().exp()
    return {
        "mean_length": float((probs * lengths.double()).sum(-1).mean()),
        "truncated": float((probs * (~ended_with_eos).double()).sum(-1).mean()),
    }


def distance_scale(beta: float, j_star: float, rewards: Tensor) -> float:
    """What turns a KL(pi || target) into the gap's unit, beta / |J*| (J* - J(pi) = beta KL(pi || pi*)); 1 (nats)
    with a reward of 0 everywhere, where J* = 0 (:func:`optimum_report`)."""
    return beta / abs(j_star) if rewards.any() else 1.0


@dataclass
class OptimumReport:
    """Exact distances of a policy from the KL-regularised optimum."""

    objective: float  # J(pi)
    optimum: float  # J*
    gap: float  # (J* - J(pi)) / |J*|; NaN with a reward of 0 everywhere (J* = 0: distillation, where kl_to_optimum is the distance)
    kl_to_optimum: float  # E_x KL(pi || pi*)
    kl_to_ref: float  # E_x KL(pi || pi_ref)
    optimum_kl_to_ref: float  # E_x KL(pi* || pi_ref): where an exact learner's KL should land
    reward: float  # E_x E_pi r
    fixed_point_distance: float = math.nan  # beta E_x KL(pi || per-token fixed point) / |J*| (given num_tokens)


def optimum_logprobs(ref_logprobs: Tensor, rewards: Tensor, beta: Beta, divergence: Optional[Divergence] = None) -> Tensor:
    """log pi* of the objective: the KL's tilted distribution (``beta`` one number or one per prompt), or with a
    sequence-level ``divergence`` its J_f's (:func:`~rlhf_lightning.exact.f_divergence.divergence_optimal_logprobs`)."""
    if divergence is None or divergence.per_token:
        return optimal_logprobs(ref_logprobs, rewards, beta)
    return divergence_optimal_logprobs(ref_logprobs, rewards, beta, divergence)


def optimum_report(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    rewards: Tensor,
    beta: Beta,
    num_tokens: Optional[int] = None,
    divergence: Optional[Divergence] = None,
) -> OptimumReport:
    """Every exact quantity of ``logprobs`` against the optimum defined by ``ref_logprobs``, ``rewards``, ``beta``
    (one number, or one per prompt: then without ``num_tokens``).

    With a sequence-level ``divergence`` (not the reverse KL; one beta) the objective, the optimum and the gap are
    J_f's (:mod:`~rlhf_lightning.exact.f_divergence`), ``kl_to_optimum`` KL(pi || pi*_f) (infinite where pi*_f drops
    a response pi keeps), the KLs to the reference still KL(. || pi_ref), and no per-token fixed point (NaN).

    The gap is a distance: J* - J(pi) = E_x beta_x KL(pi || pi*) for every pi, so gap = E_x beta_x KL(pi || pi*) / |J*|. With
    ``num_tokens`` (responses in the order of :func:`enumerate_responses`) ``fixed_point_distance`` is the same
    distance from the per-token fixed point (:func:`backward_induction`, ``soft=False``), in the same unit: where a
    per-token cell should be 0. Its gap is no such distance: J is not stationary at the fixed point, so the gap of a
    policy near it moves at first order: a run close to the fixed point can lie much further from its gap.

    With a reward of 0 everywhere (on-policy distillation toward a teacher reference) pi* = pi_ref, J* = 0 and
    J(pi) = -beta KL(pi || pi_ref): nothing to normalise by, so the gap is NaN and the distance is
    ``kl_to_optimum`` = ``kl_to_ref`` = KL(pi || pi_ref), in nats; so is ``fixed_point_distance`` (:func:`distance_scale`),
    the per-token fixed point being pi_ref too."""
    if divergence is not None and not divergence.per_token:
        opt = divergence_optimal_logprobs(ref_logprobs, rewards, beta, divergence)
        j = divergence_objective(logprobs, ref_logprobs, rewards, beta, divergence)
        j_star = divergence_objective(opt, ref_logprobs, rewards, beta, divergence)
        return OptimumReport(
            objective=j,
            optimum=j_star,
            gap=(j_star - j) / abs(j_star) if rewards.any() else math.nan,  # reward 0: pi*_f = pi_ref, J*_f = 0
            kl_to_optimum=kl_divergence(logprobs, opt),
            kl_to_ref=kl_divergence(logprobs, ref_logprobs),
            optimum_kl_to_ref=kl_divergence(opt, ref_logprobs),
            reward=expected_reward(logprobs, rewards),
        )
    opt = optimal_logprobs(ref_logprobs, rewards, beta)
    j, j_star = objective(logprobs, ref_logprobs, rewards, beta), optimal_objective(ref_logprobs, rewards, beta)
    distance = math.nan
    if num_tokens is not None:
        if isinstance(beta, Tensor):
            raise ValueError("optimum_report: the per-token fixed point is computed for one beta, not one per prompt (num_tokens=None)")
        fixed_point = backward_induction(ref_logprobs, rewards, beta, num_tokens, soft=False)
        distance = distance_scale(beta, j_star, rewards) * kl_divergence(logprobs, fixed_point)
    return OptimumReport(
        objective=j,
        optimum=j_star,
        gap=(j_star - j) / abs(j_star) if rewards.any() else math.nan,
        kl_to_optimum=kl_divergence(logprobs, opt),
        kl_to_ref=kl_divergence(logprobs, ref_logprobs),
        optimum_kl_to_ref=kl_divergence(opt, ref_logprobs),
        reward=expected_reward(logprobs, rewards),
        fixed_point_distance=distance,
    )
