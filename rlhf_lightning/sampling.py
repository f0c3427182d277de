"""The distribution a rollout is sampled from, and how far the sampler's log-probs are from the trainer's.

The declared distribution (docs/rollout-engines.md): at response position t, with the policy's logits
l_t and ``model.sampling.temperature`` tau,

    pi(a | s_t) = softmax(l_t / tau)(a) 1[a in K_t] / sum_{b in K_t} softmax(l_t / tau)(b),

where K_t, the kept set, is what the sampler kept at t: EOS removed before ``min_new_tokens``, then
the ``top_k`` largest tempered logits, then of those the smallest set of most likely tokens whose
probability reaches ``top_p`` (transformers' TopK and TopP warpers and vLLM's sampler apply this
rule, in this order). K_t is computed once, from pi_old at sampling time, and replayed: the policy
pi_theta during the PPO epochs and the reference are restricted to the same K_t and renormalised
there. The PPO ratio, every KL estimate, the KL the controller sees and the entropy are of these
distributions; with top_k 0, top_p 1 and min_new_tokens 0, K_t is the whole vocabulary.

Pure functions on tensors; the sampler calls them in ``Sampler.trajectory``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_lightning import ppo_math as pm
from rlhf_lightning import trust_regions

OUTSIDE_LOGIT = -1e4  # a token outside the kept set: probability exactly 0 (exp underflows), finite log-ratios and entropies


def kept_tokens(logits: Tensor, top_k: int = 0, top_p: float = 1.0, banned: Optional[Tensor] = None) -> Optional[Tensor]:
    """The kept set K_t of each position, a bool mask like ``logits`` (..., vocab): the ``banned``
    tokens (a bool mask broadcastable to it) removed, then the ``top_k`` largest logits (0: all;
    ties at the k-th value kept), then, sorted ascending, every token whose cumulative probability
    exceeds 1 - top_p (the most likely token always stays). None when nothing is removed."""
    if not top_k and top_p >= 1.0 and banned is None:
        return None
    logits = logits.float()
    kept = torch.ones_like(logits, dtype=torch.bool) if banned is None else ~banned.expand_as(logits)
    if top_k and top_k < logits.shape[-1]:
        kth = logits.masked_fill(~kept, -torch.inf).topk(top_k, dim=-1).values[..., -1:]
        kept = kept & (logits >= kth)
    if top_p < 1.0:
        ascending, order = logits.masked_fill(~kept, -torch.inf).sort(dim=-1)
        removed = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        removed[..., -1] = False
        kept = kept & ~removed.scatter(-1, order, removed)
    return kept


def restrict(logits: Tensor, kept: Optional[Tensor]) -> Tensor:
    """``logits`` with every token outside the kept set at OUTSIDE_LOGIT: their softmax is the
    distribution renormalised on the kept set."""
    return logits if kept is None else logits.masked_fill(~kept, OUTSIDE_LOGIT)


def explored(logits: Tensor, epsilon: float) -> Tensor:
    """Log-probs of the exploring mixture mu = (1 - epsilon) softmax(``logits``) + epsilon U, U uniform over the
    tokens softmax(``logits``) gives probability > 0 (the kept set, less what the model itself rules out), so mu
    keeps pi's support and pi / mu <= 1 / (1 - epsilon); OUTSIDE_LOGIT off that support. ``logits`` itself at 0."""
    if not epsilon:
        return logits
    probs = torch.softmax(logits.float(), -1)
    support = probs > 0
    mixed = (1 - epsilon) * probs + epsilon * support / support.sum(-1, keepdim=True)
    return torch.where(support, mixed.log(), OUTSIDE_LOGIT)


def draw(logits: Tensor, block: int = 512, generator: Optional[torch.Generator] = None) -> Tensor:
    """One index per row of ``logits`` (rows, vocab) drawn from softmax(logits) by inverse transform: u ~
    U[0, 1) from ``generator`` (default: torch's), then the first index whose cumulative probability exceeds u. In two
    levels, to stay exact to float64 at the cost of one float32 pass: the sums of ``block`` probabilities
    (float64 cumulative sum over the blocks) pick the block, a float64 cumulative sum inside it the index; a
    token of probability 0 is never drawn. One uniform per row instead of ``torch.multinomial``'s one
    exponential per row and token (32 rows over SmolLM2's 49152 tokens: 1.5M variates a decode step)."""
    probs = torch.softmax(logits.float(), -1)
    rows, vocab = probs.shape
    blocks = F.pad(probs, (0, (-vocab) % block)).view(rows, -1, block)
    block_cdf = blocks.sum(-1, dtype=torch.float64).cumsum(-1)
    u = torch.rand(rows, 1, dtype=torch.float64, device=probs.device, generator=generator) * block_cdf[:, -1:]
    chosen = torch.searchsorted(block_cdf, u, right=True).clamp(max=block_cdf.shape[1] - 1)  # its mass > 0
    before = torch.where(chosen > 0, block_cdf.gather(1, (chosen - 1).clamp(min=0)), torch.zeros_like(u))
    within = blocks[torch.arange(rows, device=probs.device), chosen[:, 0]].double().cumsum(-1)
    # below the block's own total (its sums can round apart from block_cdf's), so the index has mass
    rest = torch.minimum(u - before, torch.nextafter(within[:, -1:], torch.zeros_like(u)))
    return (chosen * block + torch.searchsorted(within, rest, right=True))[:, 0]


def min_new_tokens_ban(shape: tuple[int, ...], eos_token_id: int, min_new_tokens: int, device=None) -> Optional[Tensor]:
    """(1, response_len, vocab) True at EOS on the first ``min_new_tokens`` positions (what the
    sampler suppresses); None when ``min_new_tokens`` is 0."""
    if not min_new_tokens:
        return None
    banned = torch.zeros(1, *shape[-2:], dtype=torch.bool, device=device)
    banned[0, :min_new_tokens, eos_token_id] = True
    return banned


def correction_weights(
    trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, mode: str, cap: trust_regions.Setting, share: Optional[Tensor] = None
) -> Optional[Tensor]:
    """Importance weights from the sampler to the trainer's pi_old, (batch, response_len), zero off
    ``mask``, without gradient. Per token (``tis``, ``mis``) w_t = pi_old(y_t | s_t) / pi_sampler(y_t | s_t);
    per response (``seq_tis``, ``seq_mis``) every token of a response gets w = prod_t w_t, the ratio of
    the whole response's probabilities (unbiased for returns that depend on the tokens after t, which a
    per-token weight leaves drawn from the sampler). ``*tis``: min(w, cap) (truncated importance
    sampling, Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training"); ``*mis``: w inside [1 / cap, cap], 0 outside (masked importance sampling: a token or
    response whose probabilities disagree that much is dropped); ``none``: None. A trust region of :mod:`trust_regions`
    (``icepop``, ``ipo``, ``m2po``): w_t inside the region, 0 outside, ``cap`` its setting (``share`` (batch, 1): each
    row's weight in m2po's batch mean)."""
    if mode == "none":
        return None
    log_w = pm.masked_select(trainer_logprobs.double() - sampler_logprobs.double(), mask)
    if mode in trust_regions.TRUST_REGIONS:
        keep = trust_regions.keep_mask(mode, log_w, sampler_logprobs, mask, cap, share)
        return pm.masked_select(torch.where(keep, log_w.exp(), torch.zeros_like(log_w)), mask).float()
    if mode.startswith("seq_"):
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    w = log_w.exp()
    w = w.clamp(max=cap) if mode.endswith("tis") else torch.where((w <= cap) & (w >= 1 / cap), w, torch.zeros_like(w))
    return pm.masked_select(w, mask).float()


def mismatch_metrics(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor, sum_fn=None) -> dict[str, float]:
    """How the sampler's log-probs of the sampled tokens differ from the trainer's, over every
    response token of every rank: max and mean of |log pi_trainer - log pi_sampler| and the mean
    and max of the ratio pi_sampler / pi_trainer. ``sum_fn(t, op)`` reduces across ranks."""
    reduce = sum_fn or (lambda t, op="sum": t)
    diff = (trainer_logprobs.double() - sampler_logprobs.double()) * mask
    ratio = pm.masked_select(diff.neg().exp(), mask)
    sums = reduce(torch.stack([diff.abs().sum(), ratio.sum(), mask.sum().double()]))
    maxima = reduce(torch.stack([diff.abs().max(), ratio.max()]), op="max")
    return {
        "rollout/logprob_diff_max": float(maxima[0]),
        "rollout/logprob_diff_mean": float(sums[0] / sums[2]),
        "rollout/sampler_trainer_ratio_mean": float(sums[1] / sums[2]),
        "rollout/sampler_trainer_ratio_max": float(maxima[1]),
    }


def off_policy_weight_metrics(
    trainer_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    mode: str,
    cap: trust_regions.Setting,
    share: Optional[Tensor] = None,
    sum_fn=None,
) -> dict[str, float]:
    """How much the weights of :func:`correction_weights` from the sampler mu (stale weights) to the trainer's
    pi_prox throw away, over every response token of every rank (``sum_fn(t)`` sums across ranks):

    - ``off_policy/clipped_fraction``: the share of tokens whose weight the truncation changed (``*tis``: w > cap;
      ``*mis``: w outside [1 / cap, cap], dropped; a sequence mode clips every token of its response);
    - ``off_policy/ess``: the effective sample size of the weights applied, as a share of the samples,
      (sum_i w_i)^2 / (n sum_i w_i^2) in (0, 1] (Kish): 1 when every weight is equal, 1 / n when one sample carries
      them all. The samples are the tokens (``tis``, ``mis``) or the responses (``seq_*``); with ``none`` (nothing
      weighed) it is the ESS the exact correction's weights pi_prox(y) / mu(y) would have: how far the batch is from
      on-policy;
    - ``off_policy/weight_mass``: the mean weight applied per response token (a response's weight on each of its
      tokens in a sequence mode): 1 in expectation for the exact weights; near 0 the loss is near 0 (``weight_guard``);
    - ``off_policy/cap_removed``: the share of the exact weights' mass (pi_prox / mu on every response token) that the
      truncation or the mask took away, 1 - applied / exact: 0 for the exact weights; near 1 the loss keeps almost
      nothing of what the exact correction would weigh (a long response's sequence weight past its cap);
    - ``off_policy/trust_masked_fraction``, with a trust region (``icepop``, ``ipo``, ``m2po``): the share of tokens
      outside it (their weight 0; the same as ``clipped_fraction`` there).

    ``share`` (batch, 1) weighs each row (the exact lab's mu(y|x) per enumerated response; None: each row once)."""
    reduce = sum_fn or (lambda t: t)
    mask = mask.double()
    share = torch.ones_like(mask[:, :1]) if share is None else share.double().reshape(-1, 1)
    log_w = pm.masked_select(trainer_logprobs.double() - sampler_logprobs.double(), mask)
    per_sequence = mode == "none" or mode.startswith("seq_")
    if per_sequence:
        log_w = log_w.sum(-1, keepdim=True)
    raw = log_w.exp()
    trust = mode in trust_regions.TRUST_REGIONS
    if trust:
        clipped = ~trust_regions.keep_mask(mode, log_w, sampler_logprobs, mask, cap, share) & mask.bool()
        applied = torch.where(clipped, torch.zeros_like(raw), raw)
    elif mode.endswith("tis"):
        clipped, applied = raw > cap, raw.clamp(max=cap)
    elif mode.endswith("mis"):
        clipped = (raw > cap) | (raw < 1 / cap)
        applied = torch.where(clipped, torch.zeros_like(raw), raw)
    else:
        clipped, applied = torch.zeros_like(raw, dtype=torch.bool), raw
    units = share * (mask.amax(-1, keepdim=True) if per_sequence else mask)  # each sample's weight in the sums
    tokens = share * mask
    clipped_tokens, token_mass = (tokens * clipped.expand_as(tokens)).sum(), (tokens * applied.expand_as(tokens)).sum()
    exact_mass = (tokens * raw.expand_as(tokens)).sum()
    sums = [(units * applied).sum(), (units * applied**2).sum(), units.sum(), clipped_tokens, tokens.sum(), token_mass, exact_mass]
    total, squares, n, clipped_total, token_total, mass, exact_total = reduce(torch.stack(sums))
    out = {
        "off_policy/clipped_fraction": float(clipped_total / token_total.clamp(min=1e-300)),
        "off_policy/ess": float(total**2 / (n * squares).clamp(min=1e-300)),
        "off_policy/weight_mass": float(mass / token_total.clamp(min=1e-300)),
        "off_policy/cap_removed": float(1 - mass / exact_total) if exact_total > 0 else 0.0,
    }
    if trust:
        out["off_policy/trust_masked_fraction"] = out["off_policy/clipped_fraction"]
    return out
