"""Truncated-support (top-k) KL estimators against the exact full-vocabulary KL, on an enumerable task.

A contextual bandit: P prompts, one token from a vocabulary of V, the student's logits a free table (P, V) (the
tabular policy of :mod:`rlhf_lightning.exact.tabular` with responses of one token, where the per-state KL is the
whole response's), the teacher's logits fixed. With one token per response a per-position divergence in the
loss is the whole objective, so every number below is exact: no sampling, no network.

Each estimator is measured against the exact objective of its direction (``Truncation.of``: the teacher's top k
estimates the forward KL, the student's the reverse KL; sampled-token and ``full`` estimators the reverse):

    reverse  J(pi) = E_pi r - beta KL(pi || pi_ref),   pi* ∝ pi_ref exp(r / beta)
    forward  J(pi) = E_pi r - beta KL(pi_ref || pi),   pi* = pi_ref beta / (lambda - r)   (exact.divergence_optimal_logprobs)

:func:`measure` gives, at the starting policy, the value's bias and the cosine of the estimator's gradient with the
exact KL's, then trains the table with Adam on the estimator's exact expected loss, -E_pi r + beta E[k], and
reports where it lands (``tools/studies/topk_report.py``, docs/divergences.md, "Truncated support: top-k").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_lightning import recipes
from rlhf_lightning.exact.f_divergence import divergence_optimal_logprobs
from rlhf_lightning.exact.tabular import cosine, expected_log_ratio
from rlhf_lightning.interfaces import KLEstimator
from rlhf_lightning.registry import registry


@dataclass(frozen=True)
class BanditTask:
    """P prompts over V tokens: the student's starting logits, the teacher's logits and the rewards, all (P, V)."""

    student: Tensor
    teacher: Tensor
    rewards: Tensor
    beta: float = 1.0


def bandit_task(vocab: int, prompts: int = 8, seed: int = 0, reward: bool = False, teacher_scale: float = 2.0) -> BanditTask:
    """Student logits N(0, 1), teacher logits ``teacher_scale`` N(0, 1) (a peaked teacher, so a top k misses some mass),
    rewards N(0, 1) (``reward``) or 0 (pure distillation)."""
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(prompts, vocab, generator=generator, dtype=torch.float64)
    teacher = teacher_scale * torch.randn(prompts, vocab, generator=generator, dtype=torch.float64)
    rewards = torch.randn(prompts, vocab, generator=generator, dtype=torch.float64)
    return BanditTask(student, teacher, rewards if reward else torch.zeros_like(rewards))


def estimate(estimator: KLEstimator, logits: Tensor, ref_logits: Tensor, sampled: bool) -> Tensor:
    """E_{a ~ pi}[k] per prompt (P,), differentiable in ``logits`` as the estimator is in the loss: a full-distribution
    estimator's value itself; a sampled-token one's sum_a sg(pi(a)) k(a), whose gradient is E_pi[grad k] (on-policy,
    ``tabular.expected_gradient``); ``sampled``: ``estimator.reads_sampled_token()``, asked once by the caller."""
    logp, logq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    if not sampled:
        return estimator(logp[:, :1], logq[:, :1], logits.unsqueeze(1), ref_logits.unsqueeze(1)).squeeze(1)
    vocab = logits.shape[-1]
    per_token = estimator(logp, logq, logits.unsqueeze(1).expand(-1, vocab, -1), ref_logits.unsqueeze(1).expand(-1, vocab, -1))
    return (logp.detach().exp() * per_token).sum(-1)


def exact_kl(logits: Tensor, ref_logits: Tensor, towards: str) -> Tensor:
    """KL(pi || pi_ref) (``reverse``) or KL(pi_ref || pi) (``forward``) per prompt, differentiable."""
    logp, logq = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    return expected_log_ratio(logp, logq) if towards == "reverse" else expected_log_ratio(logq, logp)


def optimum(task: BanditTask, towards: str) -> Tensor:
    """log pi* of the exact objective of direction ``towards`` (P, V)."""
    logq = task.teacher.log_softmax(-1)
    divergence = registry("divergence").create("reverse_kl" if towards == "reverse" else "forward_kl")
    return divergence_optimal_logprobs(logq, task.rewards, task.beta, divergence)


def objective(logits: Tensor, task: BanditTask, towards: str) -> float:
    """J = E_x [E_pi r - beta KL] with the exact KL of direction ``towards``."""
    reward = (logits.log_softmax(-1).exp() * task.rewards).sum(-1)
    return float((reward - task.beta * exact_kl(logits, task.teacher, towards)).mean())


def entropy(logits: Tensor) -> float:
    logp = logits.log_softmax(-1)
    return float(-(logp.exp() * logp).sum(-1).mean())


@dataclass
class Row:
    """One estimator on one task: at the start (bias, cosine, whether its gradient is identically 0) and where
    training lands (the gap J* - J of the exact objective, both KLs to the teacher, the entropy's drift, how often
    the clamp was active: the share of (step, prompt) with the unclamped sum below 0)."""

    name: str
    k: int
    direction: str
    bias: float
    cosine: float
    zero_gradient: bool
    gap: float
    reverse_kl: float
    forward_kl: float
    reverse_kl_start: float
    entropy_drift: float
    clamp_active: float


def measure(name: str, task: BanditTask, k: int = 0, steps: int = 200, lr: float = 0.2) -> Row:
    """The row of the registered estimator ``name`` (with ``k`` where it takes one) on ``task``."""
    estimator = registry("kl_estimator").create(name, **({"k": k} if k else {}))
    towards, sampled = recipes.direction_of(estimator), estimator.reads_sampled_token()
    unclamped = None
    if estimator.truncation is not None and estimator.truncation.clamp:
        unclamped = registry("kl_estimator").create("topk", **{**vars(estimator.truncation), "clamp": False})
    logits = task.student.clone().requires_grad_()
    value, exact = estimate(estimator, logits, task.teacher, sampled), exact_kl(logits, task.teacher, towards)
    (grad,), (exact_grad,) = torch.autograd.grad(value.sum(), logits), torch.autograd.grad(exact.sum(), logits)
    start_kl, start_entropy = float(exact_kl(task.student, task.teacher, "reverse").mean()), entropy(task.student)
    optimiser = torch.optim.Adam([logits], lr=lr)
    clamped = 0
    for _ in range(steps):
        reward = (logits.log_softmax(-1).exp() * task.rewards).sum(-1)
        loss = (task.beta * estimate(estimator, logits, task.teacher, sampled) - reward).sum()
        if unclamped is not None:
            clamped += int((estimate(unclamped, logits.detach(), task.teacher, False) < 0).sum())
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    final = logits.detach()
    j_star = objective(optimum(task, towards), task, towards)
    return Row(
        name=name,
        k=k,
        direction=towards,
        bias=float((value - exact).mean().detach()),
        cosine=cosine(grad.flatten(), exact_grad.flatten()),
        zero_gradient=bool((grad == 0).all()),
        gap=j_star - objective(final, task, towards),
        reverse_kl=float(exact_kl(final, task.teacher, "reverse").mean()),
        forward_kl=float(exact_kl(final, task.teacher, "forward").mean()),
        reverse_kl_start=start_kl,
        entropy_drift=entropy(final) - start_entropy,
        clamp_active=clamped / max(steps * task.student.shape[0], 1),
    )
