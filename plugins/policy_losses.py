"""Built-in policy losses (the per-token surrogate) and loss aggregations (how tokens are averaged).

The policy losses differ in how they limit an update that moves pi away from the sampler pi_old:
PPO's symmetric ratio clip, DAPO's wider upper clip, dual clip's cap on negative advantages,
GSPO's clip of one length-normalised ratio per sequence, and CISPO's truncated, stop-gradient
importance weight. The aggregations differ in how a response's length weighs its tokens.
"""

from __future__ import annotations

from typing import Optional

from rlhf_lightning import ppo_math as pm
from rlhf_lightning.interfaces import LossAggregation, PolicyLoss, require_number
from rlhf_lightning.registry import register


def _require_clip(name: str, value: float, lower: bool = True) -> None:
    """A clip range eps > 0; one that sets the lower clip 1 - eps must also be < 1 (at 1 or more
    the ratio's lower bound is 0 or negative: no lower clip at all)."""
    require_number(f"policy_loss.{name}", value, above=0, **({"below": 1} if lower else {}))


@register("policy_loss", "ppo_clip", description="PPO's clipped surrogate, clip(r, 1 - eps, 1 + eps) (the default)")
class PPOClip(PolicyLoss):
    """loss_t = max(-A r, -A clip(r, 1 - cliprange, 1 + cliprange)), r = pi / pi_old (Schulman et al. 2017)."""

    def __init__(self, cliprange: float = 0.2) -> None:
        _require_clip("cliprange", cliprange)
        self.cliprange = cliprange

    def __call__(self, logprobs, old_logprobs, advantages, mask):
        return pm.clipped_surrogate(logprobs, old_logprobs, advantages, mask, self.cliprange, self.cliprange)


@register("policy_loss", "clip_higher", description="DAPO's decoupled clip: clip(r, 1 - eps_low, 1 + eps_high)")
class ClipHigher(PolicyLoss):
    """DAPO (Yu et al. 2025): a wider upper clip lets unlikely tokens with A > 0 grow, against
    entropy collapse: loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))."""

    def __init__(self, clip_low: float = 0.2, clip_high: float = 0.28) -> None:
        _require_clip("clip_low", clip_low)
        _require_clip("clip_high", clip_high, lower=False)
        self.clip_low, self.clip_high = clip_low, clip_high

    def __call__(self, logprobs, old_logprobs, advantages, mask):
        return pm.clipped_surrogate(logprobs, old_logprobs, advantages, mask, self.clip_low, self.clip_high)


@register("policy_loss", "dual_clip", description="PPO clip plus a cap of -A * c on tokens with A < 0 (dual clip)")
class DualClip(PolicyLoss):
    """Dual-clip PPO (Ye et al. 2020): PPO's clip, and for A < 0 the loss is also capped at
    -A * clip_ratio_c, so a huge ratio on a bad token cannot dominate the update."""

    def __init__(self, cliprange: float = 0.2, clip_ratio_c: float = 3.0) -> None:
        _require_clip("cliprange", cliprange)
        require_number("policy_loss.clip_ratio_c", clip_ratio_c, above=1)
        self.cliprange, self.clip_ratio_c = cliprange, clip_ratio_c

    def __call__(self, logprobs, old_logprobs, advantages, mask):
        return pm.clipped_surrogate(logprobs, old_logprobs, advantages, mask, self.cliprange, self.cliprange, self.clip_ratio_c)


@register("policy_loss", "gspo", description="GSPO: one length-normalised ratio per sequence, clipped")
class GSPO(ClipHigher):
    """GSPO (Zheng et al. 2025): the clip acts on s_i = exp(mean_t log(pi / pi_old)), one ratio per
    response, with GSPO's small clip range; defined with the sequence-mean aggregation."""

    loss_aggregation = "seq_mean_token_mean"

    def __init__(self, clip_low: float = 3e-4, clip_high: float = 4e-4) -> None:
        super().__init__(clip_low, clip_high)

    def __call__(self, logprobs, old_logprobs, advantages, mask):
        return pm.sequence_ratio_surrogate(logprobs, old_logprobs, advantages, mask, self.clip_low, self.clip_high)


@register("policy_loss", "cispo", description="CISPO: REINFORCE with a truncated, stop-gradient importance weight")
class CISPO(PolicyLoss):
    """CISPO (MiniMax-M1, 2025): loss_t = -sg(min(r, 1 + clip_high)) * A * log pi: every token keeps
    its gradient (no clipped-out tokens), only the weight is bounded."""

    def __init__(self, clip_high: float = 0.28) -> None:
        _require_clip("clip_high", clip_high, lower=False)
        self.clip_high = clip_high

    def __call__(self, logprobs, old_logprobs, advantages, mask):
        return pm.truncated_is_policy_gradient(logprobs, old_logprobs, advantages, mask, self.clip_high)


class _ModeAggregation(LossAggregation):
    """An aggregation that is one mode of ``ppo_math.aggregation_weights``."""

    mode: str

    def weights(self, mask, max_new_tokens, sum_fn=None):
        return pm.aggregation_weights(mask, self.mode, sum_fn)


@register("loss_aggregation", "token_mean", description="mean over every token of the batch (the default)")
class TokenMean(_ModeAggregation):
    """sum_{i,t} loss_{i,t} / sum_i |y_i|: long responses weigh more, per token alike."""

    mode = "token_mean"


@register("loss_aggregation", "seq_mean_token_mean", description="mean over responses of each response's token mean")
class SeqMeanTokenMean(_ModeAggregation):
    """1/N sum_i 1/|y_i| sum_t loss_{i,t} (GRPO's original): every response weighs alike, so a
    token of a short response weighs more than one of a long response."""

    mode = "seq_mean_token_mean"


@register("loss_aggregation", "seq_mean_token_sum", description="mean over responses of each response's token sum")
class SeqMeanTokenSum(_ModeAggregation):
    """1/N sum_i sum_t loss_{i,t}: the sequence-level objective's own scale (its gradient is the
    REINFORCE gradient of the whole response); grows with length."""

    mode = "seq_mean_token_sum"


@register("loss_aggregation", "constant", description="token sum over responses x a constant length (Dr. GRPO)")
class ConstantNormaliser(LossAggregation):
    """1/(N * C) sum_{i,t} loss_{i,t} with a constant C (default ``model.sampling.max_new_tokens``): Dr. GRPO's
    normaliser (Liu et al. 2025), the token sum's direction at a fixed scale."""

    def __init__(self, normaliser: Optional[float] = None) -> None:
        require_number("loss_aggregation.normaliser", normaliser, above=0, optional=True)  # null: model.sampling.max_new_tokens
        self.normaliser = normaliser

    def weights(self, mask, max_new_tokens, sum_fn=None):
        return pm.aggregation_weights(mask, "constant", sum_fn, self.normaliser or max_new_tokens)
