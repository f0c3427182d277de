"""The math of PPO-RLHF as plain tensor functions: no Lightning, no model state.

Shapes: ``(batch, response_len)`` for everything per token unless stated. ``mask`` is 1 on
real response tokens (up to and including the first EOS) and 0 on padding after it.

``sum_fn`` (where accepted) all-reduces a tensor of sums across ranks, so that means and
variances are global under DDP; the default is the identity (single process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Optional

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


def whitening_divisor(x: Tensor, mask: Tensor, sum_fn: SumFn = None) -> Tensor:
    """std + 1e-8 of ``x`` over the masked positions: what :func:`masked_whiten` divides by."""
    return masked_var(x, mask, sum_fn).clamp(min=0).sqrt() + 1e-8


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, sum_fn: SumFn = None) -> Tensor:
    """(x - mean) / std over the masked positions; masked-out positions are set to 0."""
    mean = masked_mean(x, mask, sum_fn)
    whitened = (x - mean) / whitening_divisor(x, mask, sum_fn)
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


def token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, beta: float | Tensor) -> Tensor:
    """Per-token reward R_t = score * 1[t = last real token] - beta * kl_t (kl already masked); ``beta`` one
    number or one per row, (batch, 1)."""
    rewards = -beta * kl * mask
    return rewards.scatter_add(-1, last_position(mask).unsqueeze(-1), scores.unsqueeze(-1).to(rewards.dtype))


def last_position(mask: Tensor) -> Tensor:
    """Each row's last position where ``mask`` is 1 (batch,), long; 0 for a row without one. The last token of
    the response, or of an episode's last policy turn (an environment's tokens in between are 0 in the mask)."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask.bool(), positions, -1).amax(-1).clamp(min=0)


def packed(mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(order, packed_mask)``: the positions of each row with its masked-in ones first, in order (a stable sort),
    and the mask gathered by them (a prefix of ones). ``x.gather(-1, order)`` packs a per-token tensor so that a
    loop over t runs over the policy's tokens alone; ``out.scatter(-1, order, y)`` puts the result back."""
    order = torch.sort((mask <= 0).to(torch.int8), dim=-1, stable=True).indices
    return order, mask.gather(-1, order)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation; returns ``(advantages, returns)``, both masked.

    delta_t = r_t + gamma * V_{t+1} - V_t (V past the last real token is 0);
    A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V. t runs over the tokens in ``mask``: in an episode,
    the policy's tokens, t + 1 the policy's next one, so that an environment's turn between two of them is part
    of the transition (discounted once, like any other state change; docs/environments.md).
    """
    order, mask = packed(mask)
    rewards, values = masked_select(rewards.gather(-1, order), mask), masked_select(values.gather(-1, order), mask)
    advantages = torch.zeros_like(rewards)
    last_gae = torch.zeros_like(rewards[:, 0])
    length = rewards.shape[1]
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(last_gae)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        advantages[:, t] = last_gae
    unpack = torch.zeros_like(advantages)
    return unpack.scatter(-1, order, advantages), unpack.scatter(-1, order, masked_select(advantages + values, mask))


def reward_to_go(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) R_s over the real tokens: GAE with V = 0 and lambda = 1."""
    return gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[0]


def group_advantages(returns: Tensor, group_size: int, baseline: str = "mean", scale: bool = False, eps: float = 1e-6) -> Tensor:
    """Advantages of sequence returns (batch,) against their group's baseline; groups are
    ``group_size`` consecutive rows (the responses to one prompt).

    ``mean``: A_i = R_i - mean_g R (GRPO, Dr. GRPO); ``leave_one_out``: A_i = R_i - mean_{j != i} R_j
    = n / (n - 1) * (R_i - mean_g R) (RLOO); ``scale``: divided by (std_g R + eps), the unbiased
    standard deviation of the group (GRPO). Returns are shifted by their group's first value
    before anything is summed, so a group whose returns are all equal gets advantages of exactly 0.
    """
    grouped = returns.view(-1, group_size)
    shifted = grouped - grouped[:, :1]
    advantages = shifted - shifted.mean(-1, keepdim=True)
    if baseline == "leave_one_out":
        advantages = advantages * group_size / (group_size - 1)
    elif baseline != "mean":
        raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
    if scale:
        advantages = advantages / (shifted.std(-1, keepdim=True) + eps)
    return advantages.flatten()


class LossStats(NamedTuple):
    loss: Tensor
    clipfrac: Tensor
    approxkl: Tensor | None = None


class TokenLoss(NamedTuple):
    """A loss per token (batch, len) and where a clip was active (0/1), both zero off the mask."""

    loss: Tensor
    clipped: Tensor


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: Optional[float] = None,
) -> TokenLoss:
    """PPO's clipped surrogate per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)),
    r = pi / pi_old (Schulman et al. 2017; clip_high > clip_low is DAPO's clip-higher). With
    ``clip_ratio_c`` (dual clip, Ye et al. 2020) tokens with A < 0 are also capped at -A * c."""
    # Mask before exp: an overflowing ratio at a padded position would turn the gradient into NaN.
    ratio = masked_select(logprobs - old_logprobs, mask).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if clip_ratio_c is not None:
        capped = torch.where(advantages < 0, torch.minimum(loss, -advantages * clip_ratio_c), loss)
        was_clipped = was_clipped | (capped < loss)
        loss = capped
    return TokenLoss(masked_select(loss, mask), masked_select(was_clipped.to(loss.dtype), mask).detach())


def sequence_ratio_surrogate(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float
) -> TokenLoss:
    """GSPO (Zheng et al. 2025), token form: the sequence's length-normalised ratio
    s_i = exp(mean_t (log pi - log pi_old)) clipped to [1 - clip_low, 1 + clip_high], carried by
    every token as s_{i,t} = sg(s_i) * pi_t / sg(pi_t) (value s_i, gradient s_i grad log pi_t):
    loss_t = max(-A s_{i,t}, -A clip(s_{i,t})). With a sequence-mean aggregation its gradient is GSPO's."""
    log_ratio = masked_select(logprobs - old_logprobs, mask)
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    token_log_ratio = seq_log_ratio.detach() + logprobs - logprobs.detach()
    return clipped_surrogate(token_log_ratio, torch.zeros_like(logprobs), advantages, mask, clip_low, clip_high)


def truncated_is_policy_gradient(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_high: float) -> TokenLoss:
    """CISPO (MiniMax-M1, 2025): REINFORCE on log pi with the importance weight r = pi / pi_old
    truncated at 1 + clip_high and stopped from the gradient, so no token's gradient is dropped:
    loss_t = -sg(min(r, 1 + clip_high)) * A * log pi."""
    ratio = masked_select(logprobs - old_logprobs, mask).exp().detach()
    weight = ratio.clamp(max=1.0 + clip_high)
    loss = -weight * advantages * logprobs
    return TokenLoss(masked_select(loss, mask), masked_select((ratio > 1.0 + clip_high).to(loss.dtype), mask))


def aggregation_weights(mask: Tensor, mode: str, sum_fn: SumFn = None, normaliser: Optional[float] = None) -> Tensor:
    """Weights w (batch, len), zero off the mask, such that sum w * loss_t aggregates per-token
    losses over the whole (global, with ``sum_fn``) batch:

    - ``token_mean``: 1 / (tokens in the batch): every token counts alike;
    - ``seq_mean_token_mean``: 1 / (|y_i| * responses): the mean over responses of each one's token mean;
    - ``seq_mean_token_sum``: 1 / responses: the mean over responses of each one's token sum;
    - ``constant``: 1 / (responses * normaliser): token sums over a fixed length (Dr. GRPO).
    """
    lengths = mask.sum(-1, keepdim=True)
    tokens, responses = (sum_fn or _identity)(torch.stack([mask.sum(), (lengths > 0).sum().to(mask.dtype)]))
    if mode == "token_mean":
        weights = mask / tokens.clamp(min=1)
    elif mode == "seq_mean_token_mean":
        weights = mask / (lengths.clamp(min=1) * responses.clamp(min=1))
    elif mode == "seq_mean_token_sum":
        weights = mask / responses.clamp(min=1)
    elif mode == "constant":
        weights = mask / (responses.clamp(min=1) * normaliser)
    else:
        raise ValueError(f"aggregation mode must be token_mean, seq_mean_token_mean, seq_mean_token_sum or constant, got {mode!r}")
    return weights


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, cliprange: float) -> LossStats:
    """PPO clipped surrogate: mean over tokens of max(-A r, -A clip(r, 1-eps, 1+eps)), r = pi/pi_old."""
    loss, clipped = clipped_surrogate(logprobs, old_logprobs, advantages, mask, cliprange, cliprange)
    return LossStats(masked_mean(loss, mask), masked_mean(clipped, mask), approx_kl(logprobs, old_logprobs, mask))


def approx_kl(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """0.5 * mean over tokens of (log pi - log pi_old)^2: how far the update moved the policy."""
    return 0.5 * masked_mean(masked_select(logprobs - old_logprobs, mask).detach() ** 2, mask)


def value_loss_terms(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float) -> TokenLoss:
    """Clipped value loss per token: 0.5 * max((V - R)^2, (V_clipped - R)^2)."""
    values, old_values, returns = masked_select(values, mask), masked_select(old_values, mask), masked_select(returns, mask)
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    return TokenLoss(masked_select(loss, mask), masked_select((clipped_loss > unclipped_loss).to(loss.dtype), mask).detach())


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float) -> LossStats:
    """Clipped value loss: 0.5 * mean over tokens of max((V - R)^2, (V_clipped - R)^2)."""
    loss, clipped = value_loss_terms(values, old_values, returns, mask, cliprange_value)
    return LossStats(masked_mean(loss, mask), masked_mean(clipped, mask))


def importance_weighted_kl(
    kl: Tensor, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, ratio_gradient: bool = True, score_baseline: float = 0.0
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
    Per token only: this is grad KL(pi_theta(.|s_t) || pi_ref(.|s_t)) at each visited state, not the
    gradient of the whole response's KL, which also charges y_t for the KL of the states it leads to.
    That sequence term is :func:`kl_to_go_loss` (the loss path) or the returns (the reward path).
    With the ratio's gradient, ``score_baseline`` b (``KLEstimator.score_baseline``) takes b * grad w
    off the gradient and nothing off the value: grad w = w s has mean 0 under pi_old, so the mean is
    unchanged and, for k1 with b = 1, w (k1 + 1) s becomes w k1 s (k3's gradient, without its noise).
    Positions off ``mask`` are 0 (masked before exp, as in policy_loss).
    """
    ratio = masked_select(logprobs - old_logprobs, mask).exp()
    if not ratio_gradient:
        return ratio.detach() * masked_select(kl, mask)
    return ratio * masked_select(kl, mask) - score_baseline * (ratio - ratio.detach())


def kl_to_go_loss(
    logprobs: Tensor, old_logprobs: Tensor, kl: Tensor, mask: Tensor, future_weights: str = "cumulative", groups: Optional[Tensor] = None
) -> Tensor:
    """The sequence term of a KL in the loss, per token (batch, len): value 0, gradient

        grad_t = rho_t * G_t * s_t,   G_t = sum_{t' > t} W_{t,t'} k_t'   (G detached),

    with s_t = grad log pi_theta(y_t | s_t), rho_t = pi_theta(y_t | s_t) / pi_old(y_t | s_t) (carrying
    gradient), k = ``kl`` per-token values whose mean at each state is its KL (only their values are used;
    PPORLHF passes the log-ratio's, log pi - log pi_ref, for every estimator that reads the sampled token:
    k3's exp(-x) - 1 + x is heavy-tailed where pi << pi_ref and made this term's variance much larger
    at pi* on the random tasks, docs/kl-estimators.md; full's exact values otherwise) and
    W_{t,t'} = prod_{t < tau <= t'} rho_tau (``cumulative``) or rho_t' (``token``), both detached;
    ``none``: G = 0, only the baseline below (``kl_loss_scope: per_token`` adds no term: there the baseline
    raised k3's per-token gradient variance and left the cells further from their fixed point).
    Computed as (rho_t - sg(rho_t)) * sg(G_t), DiCE's "magic box": adding it changes no logged value.

    Why. With y ~ pi_theta and an estimator whose VALUE is unbiased at every state, E[k_t | s_t] =
    KL_t(s_t) := KL(pi_theta(.|s_t) || pi_ref(.|s_t)) (k1, k3, full; the values of k1+, k3+), the chain
    rule of KL makes the response's KL KL(pi_theta(.|x) || pi_ref(.|x)) = E[sum_t k_t], and its gradient
    (pathwise plus score function; E[s_t k_t'] = 0 for t' < t since E[s_t | s_t] = 0) is

        grad KL_seq = E[ sum_t grad k_t + s_t k_t + s_t sum_{t' > t} k_t' ].

    The per-token loss w_t k_t with its ratio carrying gradient (:func:`importance_weighted_kl`) gives
    the first two terms. The third, the sequence term, is the KL still to be paid after y_t, which
    depends on y_t whenever the later conditionals' distance to pi_ref depends on the prefix (almost
    always): a per-token loss alone has the fixed point of ``exact.closed_form.backward_induction(soft=False)``,
    not pi*. Which factors carry gradient:

    - rho_t: it is the score function of the token y_t at s_t (grad rho_t = rho_t s_t; s_t at epoch 1);
    - G_t: not. Each grad k_t' is counted once, by the per-token term at t'; each later token's own
      score terms by its own rho_t'. A G_t with gradient would count them again for every t < t'.

    Several PPO epochs: the tokens come from pi_old. Given s_t, E_old[rho_t s_t W_{t,t'} k_t' | s_t] with
    the cumulative W equals E_theta[s_t k_t' | s_t] (each ratio turns one token's pi_old into
    pi_theta), so the term is the exact sequence term at every visited state. The visited states
    themselves come from pi_old, the approximation PPO makes for its policy loss and the per-token KL
    loss alike (the prefix ratio prod_{tau < t} rho_tau is dropped): the total expected gradient is
    sum_s d_old(s) grad_{theta at s} of pi_theta's whole KL from s on, which at epoch 1 (d_old =
    d_theta) is grad KL_seq exactly. ``token`` weights evaluate the future on pi_old's states instead
    (right at epoch 1, off by O(how far the epochs moved pi) after), with a variance that does not grow
    with the response: the cumulative product over a long response can (weights near exp(+-sqrt(T) *
    |log rho|)).

    Scaling. The sum with the per-token term, beta * (w_t k_t + this), aggregated with weights that are
    the same for every token of every response (``token_mean``, ``seq_mean_token_sum``, ``constant``),
    has expected gradient c * beta * grad KL_seq, c the weight: aggregate it with the policy loss's
    weights, so that beta keeps its ratio to the reward. Not for estimators whose value is biased
    (k2: E[k2] != KL, so E[s_t sum k2] is the score term of another quantity), and not next to a KL in the
    reward (``both``): PPO's ratio times returns that contain the KL already carries this term.
    Baseline (``groups``, (batch,) ids: rows answering the same prompt). With it the gradient is
    rho_t * (G_t - b_t) * s_t, b_t the mean of k_t + G_t over the OTHER rows of the group at position t
    (:func:`leave_one_out_mean`): a baseline for the whole score coefficient of the KL at t, the same-token
    k_t that the ratio of :func:`importance_weighted_kl` carries included. The other rows are sampled
    independently of row i's tokens, so E_old[grad rho_t * b_t | s_t] = b_t grad E_old[rho_t | s_t] = 0:
    the expected gradient is unchanged, at every epoch. Without it the KL still to pay is a score-function
    coefficient with mean far from 0 (its size on the random tasks: docs/kl-estimators.md), and the loss
    path is noisier than the reward path, whose returns the critic or the group centres, so sampled runs
    end further from J*. At t = 0 the group shares the state; later the mean is over the
    group's other prefixes, still valid, less tight.
    Positions off ``mask`` contribute 0 (masked before exp; the KL there must be 0 or masked too).
    """
    ratio = masked_select(logprobs - old_logprobs, mask).exp()  # (batch, len)
    kl, weight = masked_select(kl, mask).detach(), ratio.detach()
    if future_weights == "token":
        weighted = weight * kl
        to_go = weighted.flip(-1).cumsum(-1).flip(-1) - weighted  # sum over t' > t
    elif future_weights == "cumulative":
        to_go = torch.zeros_like(kl)
        for t in reversed(range(kl.shape[-1] - 1)):  # G_t = rho_{t+1} (k_{t+1} + G_{t+1}), G past the end 0
            to_go[:, t] = weight[:, t + 1] * (kl[:, t + 1] + to_go[:, t + 1])
    elif future_weights == "none":
        to_go = torch.zeros_like(kl)
    else:
        raise ValueError(f"future_weights must be 'cumulative', 'token' or 'none', got {future_weights!r}")
    if groups is not None:
        to_go = to_go - leave_one_out_mean(kl + to_go, mask, groups)
    return masked_select((ratio - weight) * to_go, mask)


def leave_one_out_mean(x: Tensor, mask: Tensor, groups: Tensor) -> Tensor:
    """Per position, the mean of ``x`` (batch, len) over the other rows with the same id in ``groups``
    (batch,) that are on ``mask`` there; 0 where there is none and off the mask."""
    members = F.one_hot(groups).to(x.dtype)  # (batch, groups)
    x, mask = masked_select(x, mask), mask.to(x.dtype)
    sums, counts = members @ (members.T @ x), members @ (members.T @ mask)  # the row's group's, per position
    others = counts - mask
    return masked_select(torch.where(others > 0, (sums - x) / others.clamp(min=1), torch.zeros((), dtype=x.dtype, device=x.device)), mask)


def group_ids(prompts: Sequence[str], rows: Tensor) -> Tensor:
    """An id per row of ``rows`` (indices into ``prompts``), equal for rows with the same prompt: (len(rows),)."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(prompts[i], len(ids)) for i in rows.tolist()], device=rows.device)
