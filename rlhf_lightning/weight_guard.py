"""A run never trains on zero weights silently.

A correction's weights multiply every term of the loss (``PPOUpdate.loss``). Where they are (almost) all zero, the
loss is (almost) zero and the update does nothing, with no error: the sequence weight of a long response whose
sampler drifted (a product of many ratios below 1), a masked correction (``mis``, a trust region) that drops every
token (TRL's asynchronous GRPO review, trl PR #7120: "loss 0 and no error" on 300-token responses). Before each
update, :class:`WeightGuard` reads the batch's mean weight per token over every rank and, below
``model.off_policy.min_weight_mass``, warns once naming the settings that produced the weights, or stops the run
(``model.off_policy.stop_on_zero_weights``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from rlhf_lightning.checks import ConfigError


class ZeroWeightsError(ConfigError):
    """The batch's correction weights fell below ``model.off_policy.min_weight_mass`` with ``stop_on_zero_weights``."""


def weight_mass(is_weights: Tensor, mask: Tensor, reduce: Optional[Callable[[Tensor], Tensor]] = None) -> float:
    """The mean weight per response token over every rank (``reduce`` sums across ranks): sum w_t / sum mask."""
    sums = torch.stack([(is_weights.double() * mask).sum(), mask.double().sum()])
    total, tokens = (reduce or (lambda t: t))(sums).tolist()
    return total / max(tokens, 1.0)


class WeightGuard:
    """Checks a batch's correction weights (``Trajectory.is_weights``) against ``floor`` (0: no check). ``settings``
    names what produced them (for the message); ``stop``: raise :class:`ZeroWeightsError` instead of warning (once)."""

    def __init__(self, floor: float, settings: str, stop: bool = False) -> None:
        self.floor, self.settings, self.stop = floor, settings, stop
        self.warned = False

    @classmethod
    def of(cls, off_policy, sampling) -> WeightGuard:
        """The guard of a run's settings (``OffPolicyArgs``, ``SamplingArgs``): its message names the correction in force."""
        mode, setting = off_policy.weights(sampling)
        if off_policy.max_staleness:
            knob = "trust_band" if off_policy.correction in ("icepop", "ipo", "m2po") else "correction_cap"
            settings = (
                f"model.off_policy.correction {off_policy.correction} with model.off_policy.{knob} {setting} "
                f"at model.off_policy.max_staleness {off_policy.max_staleness}"
            )
        else:
            settings = f"model.sampling.rollout_correction {mode} with model.sampling.rollout_correction_cap {setting}"
        return cls(off_policy.min_weight_mass, settings, off_policy.stop_on_zero_weights)

    def check(self, is_weights: Optional[Tensor], mask: Tensor, reduce=None, iteration: Optional[int] = None) -> Optional[float]:
        """The batch's weight mass (None without weights or a floor); below the floor, a warning the first time, or the
        error where the run stops. Every rank reduces the same sums, so every rank decides alike."""
        if is_weights is None or not self.floor:
            return None
        mass = weight_mass(is_weights, mask, reduce)
        if mass >= self.floor or (self.warned and not self.stop):
            return mass
        where = "" if iteration is None else f" at iteration {iteration}"
        message = (
            f"the correction's weights average {mass:.3g} per token{where}, below model.off_policy.min_weight_mass {self.floor:g}: "
            f"the loss is (almost) zero and the update does nothing ({self.settings}; off_policy/weight_mass, off_policy/ess). "
            "The sampler is far from the trainer: lower model.off_policy.max_staleness, raise the cap or widen the trust "
            "region, or use model.off_policy.correction: token on long responses"
        )
        if self.stop:
            raise ZeroWeightsError(message + " (model.off_policy.stop_on_zero_weights true).")
        warnings.warn(message + "; warned once (model.off_policy.stop_on_zero_weights: true stops the run).", UserWarning, stacklevel=2)
        self.warned = True
        return mass
