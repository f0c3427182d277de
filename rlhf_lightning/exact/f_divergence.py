"""The f-divergence-regularised optimum in closed form, on tasks small enough to enumerate every response.

For a divergence D_f(pi || pi_ref) = E_{y~pi_ref} f(u(y)), u = pi / pi_ref (``interfaces.Divergence``), the objective

    J_f(pi) = E_x [ E_{y~pi(.|x)} r(x, y)  -  beta * D_f(pi(.|x) || pi_ref(.|x)) ]

is concave in pi, and its maximiser satisfies, per prompt, r(y) - beta f'(u(y)) = lambda(x) wherever u(y) > 0
(and r(y) - beta f'(0+) <= lambda where u(y) = 0: the KKT conditions of the simplex), so

    pi*(y|x) = pi_ref(y|x) (f')^{-1}((r(x, y) - lambda(x)) / beta),   u clipped at 0 where (f')^{-1} leaves [0, inf),

with lambda(x) the root of sum_y pi*(y|x) = 1 (f-DPO, Wang et al. 2023, "Beyond reverse KL"; f-DPG, Go et al.
2023). The sum falls as lambda grows, and since some u must be >= 1 and some <= 1 the root lies in
[min_y r - beta f'(1), max_y r - beta f'(1)]: bisection there, per prompt, to float64's resolution. For the
reverse KL (f'(u) = log u + 1) this is pi* ∝ pi_ref exp(r / beta) (:func:`~rlhf_lightning.exact.closed_form.optimal_logprobs`).

Functions on log-probabilities take tensors of shape (num_prompts, num_responses), one row per prompt, -inf where
the reference gives a path probability 0 (a path that is no response: it is left out of every sum).
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor

from rlhf_lightning.checks import require
from rlhf_lightning.interfaces import Divergence
from rlhf_lightning.registry import registry

BISECTION_STEPS = 200  # halvings of the bracket: float64 runs out of digits long before


def _log_mass(ref: Tensor, rewards: Tensor, valid: Tensor, lam: Tensor, beta: float, divergence: Divergence) -> tuple[Tensor, Tensor]:
    """log u(y) and log sum_y pi_ref(y) u(y) at the multipliers ``lam`` (prompts, 1)."""
    log_u = torch.where(valid, divergence.log_f_prime_inverse((rewards - lam) / beta), -math.inf)
    return log_u, torch.logsumexp(ref + log_u, dim=-1, keepdim=True)


def divergence_optimal_logprobs(ref_logprobs: Tensor, rewards: Tensor, beta: float, divergence: Divergence) -> Tensor:
    """log pi*(y|x) of J_f: pi_ref (f')^{-1}((r - lambda) / beta) with lambda(x) by bisection, then normalised
    (which removes the bisection's last rounding; for the reverse KL it makes the result pi* ∝ pi_ref exp(r / beta)
    whatever lambda); -inf where pi* drops a response (u = 0) or the reference has no path."""
    ref, rewards = ref_logprobs.double(), rewards.double()
    valid = ref > -math.inf
    at_one = float(divergence.f_prime(torch.zeros((), dtype=torch.float64)))  # f'(1)
    low = torch.where(valid, rewards, math.inf).amin(-1, keepdim=True) - beta * at_one
    high = torch.where(valid, rewards, -math.inf).amax(-1, keepdim=True) - beta * at_one
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        too_much = _log_mass(ref, rewards, valid, middle, beta, divergence)[1] > 0  # the mass falls as lambda grows
        low, high = torch.where(too_much, middle, low), torch.where(too_much, high, middle)
    log_u, log_mass = _log_mass(ref, rewards, valid, (low + high) / 2, beta, divergence)
    return ref + log_u - log_mass


def divergence_value(logprobs: Tensor, ref_logprobs: Tensor, divergence: Divergence) -> Tensor:
    """D_f(pi(.|x) || pi_ref(.|x)) = sum_y pi_ref(y|x) f(pi(y|x) / pi_ref(y|x)) per prompt: (prompts,), float64; f's
    limit at u = 0 where pi drops a response (chi2: f(0) = 1)."""
    ref, logp = ref_logprobs.double(), logprobs.double()
    valid = ref > -math.inf
    log_u = torch.where(valid, logp - torch.where(valid, ref, 0.0), -math.inf)
    return torch.where(valid, ref.exp() * divergence.f(log_u), 0.0).sum(-1)


def divergence_objective(logprobs: Tensor, ref_logprobs: Tensor, rewards: Tensor, beta: float, divergence: Divergence) -> float:
    """J_f(pi) = E_x [ E_{y~pi} r(x, y) - beta * D_f(pi(.|x) || pi_ref(.|x)) ]."""
    reward = (logprobs.double().exp() * rewards.double()).sum(-1)
    return float((reward - beta * divergence_value(logprobs, ref_logprobs, divergence)).mean())


def divergence_optimal_objective(ref_logprobs: Tensor, rewards: Tensor, beta: float, divergence: Divergence) -> float:
    """J*_f = J_f(pi*)."""
    optimum = divergence_optimal_logprobs(ref_logprobs, rewards, beta, divergence)
    return divergence_objective(optimum, ref_logprobs, rewards, beta, divergence)


def divergence_named(spec: str) -> Divergence:
    """A registered divergence from ``NAME`` (``chi2``) or ``NAME:VALUE`` for one with a single numeric argument
    (``alpha:0.5``): how the lab's tools name one on their command line."""
    name, _, value = spec.partition(":")
    if not value:
        return registry("divergence").create(name)
    arguments = [p for p in inspect.signature(registry("divergence").get(name).__init__).parameters if p != "self"]
    require(len(arguments) == 1, f"divergence {name!r}", "NAME alone (it takes no single numeric argument)", spec)
    try:
        number = float(value)
    except ValueError:
        number = value
    return registry("divergence").create(name, **{arguments[0]: number})


def divergence_label(divergence: Divergence) -> str:
    """``chi2``, ``alpha:0.5``, ``js:0.1``: the name :func:`divergence_named` reads back (``js`` at its default mixture 1/2)."""
    entry = next(e for e in registry("divergence").entries() if e.cls is type(divergence) and not e.init_args)
    values = divergence.init_args
    if getattr(divergence, "omit_default_arguments", False):  # js: "js" is the symmetric one, "js:0.1" another mixture
        defaults = inspect.signature(type(divergence).__init__).parameters
        values = {k: v for k, v in values.items() if v != defaults[k].default}
    return ":".join([entry.name, *(f"{v:g}" for v in values.values())])
