"""Two-turn episodes with a chance node: the KL-regularised optimum when an environment answers the policy.

An episode: a prompt x (uniform over X), the policy's first turn y1 ~ pi1(.|x), the environment's observation
o ~ P(o | x, y1) (a known table over O symbols), the policy's second turn y2 ~ pi2(.|x, y1, o), then the reward
r(x, y1, o, y2). The environment's tokens are state, not actions: the objective charges the KL of the policy's
tokens only,

    J(pi) = E_x E_{y1~pi1} [ -beta log pi1(y1|x)/pi_ref(y1|x)
                             + E_{o~P} E_{y2~pi2} [ r(x, y1, o, y2) - beta log pi2(y2|x, y1, o)/pi_ref(y2|x, y1, o) ] ],

and its maximiser is the soft-Bellman recursion (Ziebart 2010, "Modeling purposeful adaptive behavior with the
principle of maximum causal entropy", ch. 6; Levine 2018, "Reinforcement learning and control as probabilistic
inference", sec. 2.4: the "causal" optimum, not the posterior that also steers the dynamics):

    V2(x, y1, o) = beta log sum_y2 pi_ref(y2|x, y1, o) exp(r(x, y1, o, y2) / beta)      (a policy node)
    Vc(x, y1)    = sum_o P(o|x, y1) V2(x, y1, o)                                          (the chance node)
    V1(x)        = beta log sum_y1 pi_ref(y1|x) exp(Vc(x, y1) / beta)                      (a policy node)

    pi2*(y2|x, y1, o) ∝ pi_ref(y2|x, y1, o) exp(r / beta),   pi1*(y1|x) ∝ pi_ref(y1|x) exp(Vc(x, y1) / beta),
    J* = E_x V1(x),   J* - J(pi) = beta E_x [ KL(pi1 || pi1*) + E_{y1~pi1, o~P} KL(pi2 || pi2*) ].

As beta moves, pi*_beta traces the episode's reward-KL frontier (the Lagrangian of max E r s.t. KL <= eps, the KL
over the policy's tokens: :func:`episode_frontier_reward`).

Over a whole turn the value is the one the token-by-token recursion gives (it telescopes over the turn's tree:
:func:`token_level_optimum` builds it that way with :func:`~rlhf_lightning.exact.closed_form.backward_induction`).
With a deterministic environment (P one-hot) Vc = V2 and pi* is the tilt pi_ref exp(r / beta) over the policy's
tokens. With a stochastic one the episode tilt q(y1, o, y2|x) ∝ pi_ref(y1) P(o) pi_ref(y2) exp(r / beta)
(:func:`episode_tilt`) is the optimum of a policy that also chooses o: its value beta E_x log Z(x) >= J* (Jensen:
log E_P exp(V2 / beta) >= E_P V2 / beta, an optimism bias), and its first-turn marginal, evaluated under the real
environment, lands below J*. Its second-turn conditional is pi2* itself: once o is seen there is nothing to steer.

Tensors, float64, one row per prompt: ``ref1`` (X, N1) log pi_ref(y1|x), ``obs_probs`` (X, N1, O) P(o|x, y1),
``ref2`` (X, N1, O, N2) log pi_ref(y2|x, y1, o), ``rewards`` (X, N1, O, N2); N a turn's paths in the layout of
:mod:`~rlhf_lightning.exact.tabular` (-inf for a path that is no response). Pure functions: no model, no Lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from rlhf_lightning.exact.closed_form import backward_induction
from rlhf_lightning.exact.frontier import PlanePoint, reward_at_kl
from rlhf_lightning.exact.tabular import (
    conditional_tables,
    enumerate_responses,
    expected_log_ratio,
    log_normalise,
    prefix_index,
    response_lengths,
    valid_responses,
)


def _expect(logp: Tensor, values: Tensor) -> Tensor:
    """sum over the last dimension of p * values, 0 where p is 0 (whatever the value there)."""
    p = logp.exp()
    return torch.where(p > 0, p * values, torch.zeros((), dtype=p.dtype)).sum(-1)


def _log_obs(obs_probs: Tensor) -> Tensor:
    return obs_probs.double().log()


@dataclass
class SoftBellman:
    """The soft-Bellman optimum of an episode (:func:`soft_bellman`)."""

    second_values: Tensor  # V2(x, y1, o): (X, N1, O)
    chance_values: Tensor  # Vc(x, y1) = E_P V2: (X, N1)
    first_values: Tensor  # V1(x): (X,)
    pi1: Tensor  # log pi1*(y1|x): (X, N1)
    pi2: Tensor  # log pi2*(y2|x, y1, o): (X, N1, O, N2)
    optimum: float  # J* = E_x V1(x)


def soft_bellman(ref1: Tensor, obs_probs: Tensor, ref2: Tensor, rewards: Tensor, beta: float) -> SoftBellman:
    """The optimum of J over the policy's two turns, from the leaves back (the module's formulas):
    V2 = beta log sum_y2 pi_ref exp(r / beta), Vc = E_{o~P} V2, V1 = beta log sum_y1 pi_ref exp(Vc / beta)."""
    logits2 = ref2.double() + rewards.double() / beta
    second = beta * logits2.logsumexp(-1)
    chance = _expect(_log_obs(obs_probs), second)
    logits1 = ref1.double() + chance / beta
    first = beta * logits1.logsumexp(-1)
    return SoftBellman(second, chance, first, log_normalise(logits1), log_normalise(logits2), float(first.mean()))


def episode_objective(pi1: Tensor, pi2: Tensor, ref1: Tensor, obs_probs: Tensor, ref2: Tensor, rewards: Tensor, beta: float) -> Tensor:
    """J(pi) of the policy (log pi1 (X, N1), log pi2 (X, N1, O, N2)) under the real environment, the KL over the
    policy's tokens only (the module's first formula); a 0-dim float64 tensor, differentiable in pi1 and pi2."""
    second = _expect(pi2, rewards.double()) - beta * expected_log_ratio(pi2, ref2.double())  # (X, N1, O)
    chance = _expect(_log_obs(obs_probs), second)
    return (_expect(pi1, chance) - beta * expected_log_ratio(pi1, ref1.double())).mean()


def kl_to_optimum(pi1: Tensor, pi2: Tensor, optimum: SoftBellman, obs_probs: Tensor) -> Tensor:
    """E_x [ KL(pi1 || pi1*) + E_{y1~pi1, o~P} KL(pi2 || pi2*) ]: beta times it is J* - J(pi), for every pi."""
    second = expected_log_ratio(pi2, optimum.pi2)  # (X, N1, O)
    return (expected_log_ratio(pi1, optimum.pi1) + _expect(pi1, _expect(_log_obs(obs_probs), second))).mean()


def episode_point(pi1: Tensor, pi2: Tensor, ref1: Tensor, obs_probs: Tensor, ref2: Tensor, rewards: Tensor) -> PlanePoint:
    """The policy's place in the reward-KL plane of the episode: E r and the KL over its own tokens,
    E_x [ KL(pi1 || pi_ref1) + E_{y1~pi1, o~P} KL(pi2 || pi_ref2) ] (J = reward - beta KL at every beta)."""
    reward = float(episode_objective(pi1, pi2, ref1, obs_probs, ref2, rewards, 0.0))
    return PlanePoint(kl=reward - float(episode_objective(pi1, pi2, ref1, obs_probs, ref2, rewards, 1.0)), reward=reward)


def episode_frontier_reward(ref1: Tensor, obs_probs: Tensor, ref2: Tensor, rewards: Tensor, kl: float, tol: float = 1e-10) -> float:
    """The largest E r of any policy whose KL over its own tokens is at most ``kl`` under the real environment: the
    soft-Bellman optimum's at the beta where its KL is ``kl`` (:func:`~rlhf_lightning.exact.frontier.reward_at_kl`).
    The episode tilt's policy lies below it where P is stochastic (tests/test_exact_episodes.py)."""
    if kl <= 0:
        return episode_point(ref1, ref2, ref1, obs_probs, ref2, rewards).reward

    def point_at(beta: float) -> PlanePoint:
        optimum = soft_bellman(ref1, obs_probs, ref2, rewards, beta)
        return episode_point(optimum.pi1, optimum.pi2, ref1, obs_probs, ref2, rewards)

    return reward_at_kl(point_at, kl, tol)


@dataclass
class EpisodeTilt:
    """The tilt over whole episodes (:func:`episode_tilt`) and the policy read off it."""

    log_joint: Tensor  # log q(y1, o, y2|x): (X, N1, O, N2)
    value: float  # beta E_x log Z(x): its own objective, >= J*
    pi1: Tensor  # log q(y1|x): (X, N1)
    observations: Tensor  # log q(o|x, y1): the environment the tilt imagines steering, (X, N1, O)
    pi2: Tensor  # log q(y2|x, y1, o): (X, N1, O, N2), pi2* itself
    objective: float  # J(q's pi1, pi2) under the real environment, <= J*


def episode_tilt(
    ref1: Tensor, obs_model: Tensor, ref2: Tensor, rewards: Tensor, beta: float, obs_probs: Optional[Tensor] = None
) -> EpisodeTilt:
    """q(y1, o, y2|x) = pi_ref(y1|x) M(o|x, y1) pi_ref(y2|x, y1, o) exp(r / beta) / Z(x), M = ``obs_model`` (X, N1, O):
    the maximiser of E_q r - beta KL(q || pi_ref M pi_ref), the objective of a policy that also chooses o with
    reference M. Its value beta E_x log Z(x); its conditionals at the policy's nodes, q(y1|x) ∝ pi_ref(y1|x)
    sum_o M(o) exp(V2 / beta) and q(y2|x, y1, o) = pi2*; and ``objective``, their J under the real environment
    ``obs_probs`` (default: M, the episode tilt proper, M = P)."""
    log_joint = ref1.double()[..., None, None] + _log_obs(obs_model)[..., None] + ref2.double() + rewards.double() / beta
    log_z = log_joint.flatten(1).logsumexp(-1)  # (X,)
    log_joint = log_joint - log_z.view(-1, 1, 1, 1)
    first = log_joint.logsumexp((-2, -1))  # log q(x, y1) before normalising: the marginal itself (Z divided out)
    pi1 = log_normalise(first)
    observations = log_normalise(log_joint.logsumexp(-1))
    pi2 = log_normalise(log_joint)
    truth = obs_model if obs_probs is None else obs_probs
    objective = float(episode_objective(pi1, pi2, ref1, truth, ref2, rewards, beta))
    return EpisodeTilt(log_joint, float(beta * log_z.mean()), pi1, observations, pi2, objective)


def environment_tokens_counted(ref1: Tensor, obs_probs: Tensor, ref_obs: Tensor, ref2: Tensor, rewards: Tensor, beta: float) -> EpisodeTilt:
    """Where the KL in the reward (k1, a critic or any baseline exact under the sampled o) settles when the
    environment's token is charged as if it were the policy's (``policy_tokens_only: false``): the policy's own
    model of o, pi_theta(o|x, y1), is trained on o ~ P with the per-token reward -beta log pi_theta(o) / pi_ref(o)
    (``ref_obs``: log pi_ref(o|x, y1) of the reference model, (X, N1, O)). Its expected gradient on o's logits,
    P(o) (Q(o) - beta log pi_theta(o)/pi_ref(o) - V), is 0 where pi_theta(o) ∝ pi_ref(o) exp(V2(o) / beta), and then
    every o returns the same c(x, y1) = beta log sum_o pi_ref(o) exp(V2 / beta) to the first turn, whatever P:
    pi1 ∝ pi_ref(y1) exp(c / beta). That is :func:`episode_tilt` with M = pi_ref(o|x, y1), its ``objective`` J under the
    real P (the episode tilt itself where the reference's model of o is P). With the KL in the loss the o-logits'
    stationary point differs (it depends on the estimator): measured by the convergence cells, not given here."""
    return episode_tilt(ref1, ref_obs.double().exp(), ref2, rewards, beta, obs_probs)


@dataclass
class TokenOptimum:
    """pi* built token by token (:func:`token_level_optimum`)."""

    pi1: Tensor  # log pi1*(y1|x): (X, N1)
    pi2: Tensor  # log pi2*(y2|x, y1, o): (X, N1, O, N2)
    tables1: list[Tensor]  # log pi1*(a|x, y1_<t): L1 tables (X * S ** t, S), prompt-major (tabular.conditional_tables)
    tables2: list[Tensor]  # log pi2*(a|x, y1, o, y2_<t): L2 tables (X * N1 * O * S ** t, S), history-major


def token_level_optimum(ref1: Tensor, obs_probs: Tensor, ref2: Tensor, rewards: Tensor, beta: float, num_symbols: int) -> TokenOptimum:
    """pi* position by position, each turn by :func:`~rlhf_lightning.exact.closed_form.backward_induction`
    (soft) over its tree of ``num_symbols`` symbols: the second turn on its terminal reward, its value read back
    as V2 = E_pi2 [r - beta log pi2/pi_ref] (what the optimal continuation earns), the chance node's
    E_P V2 as the first turn's terminal reward. Another route to :func:`soft_bellman`'s pi* (equal to it: the
    token-level recursion telescopes over a turn), and the per-position conditionals the network's logits meet."""
    histories = (-1, rewards.shape[-1])  # every (x, y1, o) a row
    pi2 = backward_induction(ref2.reshape(histories), rewards.reshape(histories), beta, num_symbols).view(rewards.shape)
    second = _expect(pi2, rewards.double()) - beta * expected_log_ratio(pi2, ref2.double())
    chance = _expect(_log_obs(obs_probs), second)
    pi1 = backward_induction(ref1, chance, beta, num_symbols)
    return TokenOptimum(pi1, pi2, conditional_tables(pi1, num_symbols), conditional_tables(pi2.reshape(histories), num_symbols))


@dataclass(frozen=True)
class EpisodeTask:
    """An enumerable two-turn episode as tensors (the module's layout), and its trees: each turn at most
    ``length1`` / ``length2`` content tokens over ``num_tokens`` symbols, with EOS (the last of ``num_symbols``) or not."""

    ref1: Tensor
    obs_probs: Tensor
    ref_obs: Tensor  # log pi_ref(o|x, y1): the reference model's own guess at the environment (not P)
    ref2: Tensor
    rewards: Tensor
    num_tokens: int
    length1: int
    length2: int
    eos: bool

    @property
    def num_symbols(self) -> int:
        return self.num_tokens + self.eos

    @property
    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(ref1, obs_probs, ref2, rewards): the first arguments of :func:`soft_bellman` and :func:`episode_objective`."""
        return self.ref1, self.obs_probs, self.ref2, self.rewards


def random_turn_logprobs(histories: int, num_tokens: int, length: int, eos: bool, scale: float, generator: torch.Generator) -> Tensor:
    """log pi(y|h) of a random prefix-dependent policy (logits ``scale`` N(0, 1) at every history and prefix) for every
    path of the turn's tree, (histories, paths): the tokens up to and including EOS summed, -inf for a path that is
    no response (a token after EOS)."""
    symbols = num_tokens + eos
    paths = enumerate_responses(symbols, length)
    index = prefix_index(paths, symbols)  # (paths, length): row of y_<t in position t's table
    tables = [scale * torch.randn(histories, symbols**t, symbols, generator=generator, dtype=torch.float64) for t in range(length)]
    logits = torch.stack([tables[t][:, index[:, t]] for t in range(length)], dim=2)  # (histories, paths, length, symbols)
    per_token = logits.log_softmax(-1).gather(-1, paths.expand(histories, -1, -1).unsqueeze(-1)).squeeze(-1)
    if not eos:
        return per_token.sum(-1)
    mask = torch.arange(length) < response_lengths(paths, num_tokens).unsqueeze(-1)  # (paths, length)
    return (per_token * mask).sum(-1).masked_fill(~valid_responses(paths, num_tokens), -math.inf)


def random_episode_task(
    seed: int,
    num_prompts: int = 2,
    num_tokens: int = 2,
    length1: int = 2,
    length2: int = 2,
    num_observations: int = 3,
    eos: bool = False,
    reward_scale: float = 2.0,
    spread: float = 1.0,
    deterministic: bool = False,
    reference_scale: float = 0.5,
) -> EpisodeTask:
    """A seeded episode task: references random and prefix-dependent (logits ``reference_scale`` N(0, 1), the second
    turn's per history (x, y1, o)); P(o|x, y1) = softmax(``spread`` N(0, 1)) over the O observations (``spread`` 0:
    uniform, larger: more peaked), one-hot at its largest entry with ``deterministic``; the reference model's own
    pi_ref(o|x, y1), another such draw. The reward, times ``reward_scale``,

        r(x, y1, o, y2) = a(x, y1) + g(x, y1) b(x, y1, o) + 0.5 c(x, y1, o, y2) - (its mean under pi_ref P pi_ref),

    a, c ~ N(0, 1), b = n(x, o) - E_{P(.|x, y1)} n with n ~ N(0, 1) (every first turn's mean outcome is 0), and the
    stakes g(x, .) a shuffle of N1 points evenly spread over [0, 2]: each prompt has gambles (g near 2: the second turn's
    value swings with o) and safe turns (g near 0). The tilt prizes a gamble's good outcomes as if it chose them
    (by about g^2 Var_P(b) / (2 beta)), so its value and its first turn part from the soft-Bellman optimum by margins
    that grow with ``reward_scale`` / beta; the mean under the reference makes J(pi_ref) = 0."""
    generator = torch.Generator().manual_seed(seed)
    symbols = num_tokens + eos
    n1, n2, x, o = symbols**length1, symbols**length2, num_prompts, num_observations

    def normal(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    ref1 = random_turn_logprobs(x, num_tokens, length1, eos, reference_scale, generator)
    ref2 = random_turn_logprobs(x * n1 * o, num_tokens, length2, eos, reference_scale, generator).view(x, n1, o, n2)
    obs_logits = spread * normal(x, n1, o)
    obs_probs = obs_logits.softmax(-1)
    if deterministic:
        obs_probs = torch.nn.functional.one_hot(obs_logits.argmax(-1), o).double()
    ref_obs = normal(x, n1, o).log_softmax(-1)
    stake = torch.stack([2 * torch.linspace(0, 1, n1, dtype=torch.float64)[torch.randperm(n1, generator=generator)] for _ in range(x)])
    outcome = normal(x, 1, o)
    outcome = outcome - (obs_probs * outcome).sum(-1, keepdim=True)  # E_P b = 0 after every first turn
    mean = 0.5 * normal(x, n1) - 0.5 * stake  # a gamble costs a little on average
    rewards = (mean[..., None] + stake[..., None] * outcome)[..., None] + 0.5 * normal(x, n1, o, n2)
    off = ref1.isinf()[..., None, None] | ref2.isinf()
    rewards = (reward_scale * rewards).masked_fill(off, 0.0)
    reference = ref1.exp()[..., None, None] * obs_probs[..., None] * ref2.exp()
    rewards = (rewards - (reference * rewards).sum((1, 2, 3), keepdim=True)).masked_fill(off, 0.0)  # E_ref r = 0 per prompt
    return EpisodeTask(ref1, obs_probs, ref_obs, ref2, rewards, num_tokens, length1, length2, eos)
