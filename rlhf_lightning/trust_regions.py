"""Sampler-side trust regions: which of the sampler's tokens a correction keeps, as the anchors ship them.

Each is a correction mode (``model.off_policy.correction``, the mode of ``sampling.correction_weights``): a weight
w_t = keep_t * r_t on each sampled token, r_t = pi_prox(y_t | s_t) / mu(y_t | s_t) the ratio of the trainer's
log-prob (the proximal policy, the current weights) to the sampler's (mu: stale weights, or another engine's
numerics), keep_t in {0, 1} the trust region's mask. The objective each optimises, in expectation over mu's
responses, is the per-token importance-weighted one with the masked tokens' terms removed:

    E_mu[ sum_t keep_t r_t l_t ],   l_t the module's per-token loss (policy loss, KL term),

which is the ``token`` correction where keep_t = 1 (approximate: mu's states and continuations stay), and drops the
gradient of every token outside the region. Where mu = pi_prox (on-policy, or where a stale run stops moving) every
r_t = 1, nothing is masked and the weight is 1: the fixed point is pi* for a stale sampler (class ``approximate``,
``recipes.off_policy_recipe``); a sampler that stays off (its own numerics) keeps masking the same tokens and the run
lands off pi* (measured in docs/async.md, "Sampler-side trust regions").

- ``icepop`` (IcePop, Ling team's Ring-1T, 2025): keep_t = 1[low <= r_t <= high], band (low, high) = (0.5, 5);
- ``ipo`` (prime-rl's default loss): keep_t = 1[|pi_prox(y_t) - mu(y_t)| <= delta] in probability, delta = 0.3;
- ``m2po`` (M2PO, Zheng et al. 2025, "Prosperity before collapse"): the tokens of largest (log r_t)^2 masked, the
  fewest that bring the kept tokens' mean (log r)^2, the second moment M2, to at most tau = 0.04 (over the rank's
  batch, each token weighed by ``share`` where given).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

Setting = Union[float, tuple[float, float]]

# name -> (default setting, what the setting is): ``model.off_policy.trust_band`` null takes the default
TRUST_REGIONS: dict[str, tuple[Setting, str]] = {
    "icepop": ((0.5, 5.0), "the ratio band [low, high]"),
    "ipo": (0.3, "delta, the largest |pi_prox - mu| in probability"),
    "m2po": (0.04, "tau, the largest second moment mean (log r)^2 of the kept tokens"),
}


def setting_of(name: str, band: Optional[Setting]) -> Setting:
    """The trust region's setting: ``band`` where given (a pair for ``icepop``, a number for the others), else its default."""
    if band is None:
        return TRUST_REGIONS[name][0]
    if name == "icepop":
        low, high = band
        return float(low), float(high)
    return float(band[0] if isinstance(band, (tuple, list)) else band)


def check_setting(name: str, band: Optional[Setting]) -> Optional[str]:
    """Why ``band`` is not a valid setting of trust region ``name`` (None: valid)."""
    if band is None:
        return None
    try:
        value = setting_of(name, band)
    except (TypeError, ValueError):
        return f"{TRUST_REGIONS[name][1]} of {name}: " + ("a pair of numbers" if name == "icepop" else "one number")
    if name == "icepop":
        return None if 0 <= value[0] < 1 < value[1] else "icepop's band [low, high] with 0 <= low < 1 < high"
    return None if value > 0 else f"{TRUST_REGIONS[name][1]} of {name}: a number > 0"


def keep_mask(
    name: str, log_ratio: Tensor, sampler_logprobs: Tensor, mask: Tensor, setting: Setting, share: Optional[Tensor] = None
) -> Tensor:
    """keep_t of trust region ``name`` (bool, like ``log_ratio``; False off ``mask``), from the per-token log-ratio
    log pi_prox - log mu (batch, response_len) and mu's log-probs of the sampled tokens; ``share`` (batch, 1) weighs each
    row in m2po's batch mean (the exact lab's mu(y|x); None: each row once)."""
    on = mask.bool()
    if name == "icepop":
        low, high = setting
        ratio = log_ratio.exp()
        return on & (ratio >= low) & (ratio <= high)
    if name == "ipo":
        sampler_probs = sampler_logprobs.double().exp()
        return on & ((sampler_probs * log_ratio.exp() - sampler_probs).abs() <= setting)
    if name == "m2po":
        return on & ~m2po_masked(log_ratio, on, setting, share)
    raise KeyError(f"trust region {name!r}: one of {', '.join(TRUST_REGIONS)}")


def m2po_masked(log_ratio: Tensor, on: Tensor, tau: float, share: Optional[Tensor] = None) -> Tensor:
    """M2PO's mask: sort the tokens by M2_t = (log r_t)^2, largest first, and mask the fewest of them such that the
    rest's (``share``-weighted) mean M2 is <= ``tau``; True where masked."""
    m2 = (log_ratio.double() ** 2).masked_fill(~on, 0.0).flatten()
    weight = (on.double() * (1.0 if share is None else share.double().reshape(-1, 1))).flatten()
    order = m2.argsort(descending=True)
    # after masking the first j of the order: the rest's mean M2 = (total - head_j) / (count - count_j)
    m2_head = torch.cat([m2.new_zeros(1), (m2 * weight)[order].cumsum(0)])
    count_head = torch.cat([m2.new_zeros(1), weight[order].cumsum(0)])
    rest_mean = (m2_head[-1] - m2_head) / (count_head[-1] - count_head).clamp(min=1e-300)
    fits = (rest_mean <= tau) | (count_head[-1] - count_head <= 0)
    masked_count = int(fits.nonzero()[0, 0])  # the first j that fits (j = all tokens always does)
    masked = torch.zeros_like(m2, dtype=torch.bool)
    masked[order[:masked_count]] = True
    return masked.view_as(log_ratio)
