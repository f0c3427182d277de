"""The math of PPO-RLHF as plain tensor functions: no Lightning, no model state.

Shapes: ``(batch, response_len)`` for everything per token unless stated. ``mask`` is 1 on
real response tokens (up to and including the first EOS) and 0 on padding after it.

``sum_fn`` (where accepted) all-reduces a tensor of sums across ranks, so that means and
variances are global under DDP; the default is the identity (single process).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

SumFn = Optional[Callable[[Tensor], Tensor]]


def _identity(t: Tensor) -> Tensor:
    return t


def masked_select(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask is 1, else 0 (a select, so inf/nan at masked positions cannot leak)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor, sum_fn: SumFn = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (global when ``sum_fn`` all-reduces)."""
    x = masked_select(x, mask)
    sums = (sum_fn or _identity)(torch.stack([x.sum(), mask.sum().to(x.dtype)]))
    return sums[0] / sums[1].clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, sum_fn: SumFn = None) -> Tensor:
    """Unbiased variance of ``x`` over the masked positions."""
    x = masked_select(x, mask)
    sums = (sum_fn or _identity)(torch.stack([x.sum(), (x * x).sum(), mask.sum().to(x.dtype)]))
    total, total_sq, n = sums
    mean = total / n.clamp(min=1)
    var = total_sq / n.clamp(min=1) - mean**2
    return var * n / (n - 1).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, sum_fn: SumFn = None) -> Tensor:
    """(x - mean) / std over the masked positions; masked-out positions are set to 0."""
    mean = masked_mean(x, mask, sum_fn)
    std = masked_var(x, mask, sum_fn).clamp(min=0).sqrt()
    whitened = (x - mean) / (std + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return masked_select(whitened, mask)


def logprobs_of(logits: Tensor, tokens: Tensor) -> Tensor:
    """log p(token) under ``logits``: (batch, len, vocab), (batch, len) -> (batch, len)."""
    logps = F.log_softmax(logits.float(), dim=-1)
    return logps.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_of(logits: Tensor) -> Tensor:
    """Entropy in nats of each position's distribution: (batch, len, vocab) -> (batch, len)."""
    logps = F.log_softmax(logits.float(), dim=-1)
    return -(logps.exp() * logps).sum(-1)


def response_mask(response: Tensor, eos_token_id: int) -> Tensor:
    """1 up to and including the first EOS of each response, 0 after it (all 1 if no EOS)."""
    is_eos = (response == eos_token_id).long()
    eos_before = is_eos.cumsum(-1) - is_eos  # number of EOS strictly before each position
    return (eos_before == 0).to(torch.float32)


def token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Per-token reward R_t = score * 1[t = last real token] - beta * kl_t (kl already masked)."""
    rewards = -beta * kl * mask
    last = mask.sum(-1).long().clamp(min=1) - 1
    return rewards.scatter_add(-1, last.unsqueeze(-1), scores.unsqueeze(-1).to(rewards.dtype))


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation; returns ``(advantages, returns)``, both masked.

    delta_t = r_t + gamma * V_{t+1} - V_t (V past the last real token is 0);
    A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V.
    """
    rewards, values = masked_select(rewards, mask), masked_select(values, mask)
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(rewards[:, 0])
    length = rewards.shape[1]
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
    return advantages, masked_select(advantages + values, mask)


class LossStats(NamedTuple):
    loss: Tensor
    clipfrac: Tensor
    approxkl: Tensor | None = None


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cliprange: float
) -> LossStats:
    """PPO clipped surrogate: mean over tokens of max(-A r, -A clip(r, 1-eps, 1+eps)), r = pi/pi_old."""
    # Mask before exp: an overflowing ratio at a padded position would turn the gradient into NaN.
    log_ratio = masked_select(logprobs - old_logprobs, mask)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    approxkl = 0.5 * masked_mean(log_ratio.detach() ** 2, mask)
    return LossStats(loss, clipfrac.detach(), approxkl)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float) -> LossStats:
    """Clipped value loss: 0.5 * mean over tokens of max((V - R)^2, (V_clipped - R)^2)."""
    values, old_values, returns = masked_select(values, mask), masked_select(old_values, mask), masked_select(returns, mask)
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_loss, clipped_loss), mask)
    clipfrac = masked_mean((clipped_loss > unclipped_loss).float(), mask)
    return LossStats(loss, clipfrac.detach())


def importance_weighted_kl(
    kl: Tensor, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, ratio_gradient: bool = True
) -> Tensor:
    """w_t * kl_t with the per-token importance ratio w_t = pi_theta(y_t) / pi_old(y_t), unclipped.

    The loss path samples y ~ pi_old; reweighting by w_t makes the expectation the current
    policy's at every PPO epoch: E_{pi_old}[w_t k_t] = E_{pi_theta}[k_t] (per position, the prefix
    held fixed). Which factors carry gradient (s_t = grad log pi_theta(y_t)):

    - ``ratio_gradient=True`` (the KL only in the loss): grad (w k) = w (k s + grad k), whose mean is
      grad E_{pi_theta}[k] = grad KL(pi_theta || pi_ref) at the position for every estimator whose
      VALUE is unbiased (k1, k3, full): the ratio's gradient is the score-function term k s that a
      loss on k alone misses (for k3 it turns (1 - pi_ref/pi) s into exactly x s, x = log pi - log pi_ref).
      Token-level form of Zhang (2025) / DeepSeek-V3.2's corrected k3 / TRL ``use_bias_correction_kl``.
    - ``ratio_gradient=False`` (``kl_penalty: both``): sg(w) grad k. The reward already carries
      k's score-function term through PPO's ratio w_t A_t; a second one here would count it twice.

    Unclipped: a clipped ratio has no gradient outside the band, which would drop the correction
    exactly where the policy moved most (PPO's clip already bounds how far an epoch moves it).
    Per-token, not cumulative: the sequence-level term (earlier tokens steering which later states
    are visited) is the reward path's job (GAE returns), as with PPO's own per-token ratio.
    Positions off ``mask`` are 0 (masked before exp, as in policy_loss).
    """
    ratio = masked_select(logprobs - old_logprobs, mask).exp()
    return (ratio if ratio_gradient else ratio.detach()) * masked_select(kl, mask)
