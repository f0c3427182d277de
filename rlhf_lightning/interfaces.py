"""The plugin contracts: one abstract base class per plugin kind.

These are plain ABCs (not ``typing.Protocol``) so that jsonargparse can resolve
``class_path: K3`` among their imported subclasses. Implementations live in
``plugins/`` (importable as ``rlhf_lightning_plugins``) or in third-party packages.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Literal, Optional, Sequence

import torch
from torch import Tensor

from rlhf_lightning.registry import register_kind

KLUnit = Literal["sequence_sum", "token_mean"]


def finite_number(value: Any) -> bool:
    """An int or float that is neither inf nor nan (what a numeric setting must be)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


class ConfigError(ValueError):
    """A setting, a file it names, or a plugin's output that cannot work; its message names the
    field. The command prints it and exits with status 2, without a traceback."""


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """A file that a setting names does not exist."""


def require(condition: bool, field: str, requirement: str, value: Any) -> None:
    """Unless ``condition``: ``ConfigError("<field> must be <requirement>, got <value>")``, the one
    shape of every configuration error (``field`` as the user writes it: ``model.lr``,
    ``beta_controller.target``, ``KLGuard.max_kl``)."""
    if not condition:
        raise ConfigError(f"{field} must be {requirement}, got {value!r}")


def require_number(
    field: str,
    value: Any,
    *,
    above: Optional[float] = None,
    at_least: Optional[float] = None,
    below: Optional[float] = None,
    at_most: Optional[float] = None,
    integer: bool = False,
    optional: bool = False,
) -> None:
    """The one check of a numeric setting: an int or float (an int with ``integer``; never a bool),
    finite (YAML's ``.inf`` and ``.nan`` parse as floats), within the bounds given, or None with
    ``optional``. Else ``ConfigError("<field> must be a finite number > 0, got inf")``, the
    requirement spelt from the bounds (``an integer >= 1``, ``a finite number in (0, 1]``)."""
    if optional and value is None:
        return
    low = (f"> {above}", f"({above}") if above is not None else (f">= {at_least}", f"[{at_least}") if at_least is not None else None
    high = (f"< {below}", f"{below})") if below is not None else (f"<= {at_most}", f"{at_most}]") if at_most is not None else None
    bounds = f" in {low[1]}, {high[1]}" if low and high else f" {(low or high)[0]}" if low or high else ""
    requirement = ("an integer" if integer else "a finite number") + bounds + (", or null" if optional else "")
    number = isinstance(value, int) if integer else finite_number(value)
    require(
        number and not isinstance(value, bool)
        and (above is None or value > above) and (at_least is None or value >= at_least)
        and (below is None or value < below) and (at_most is None or value <= at_most),
        field, requirement, value,
    )  # fmt: skip


class KLEstimator(ABC):
    """Per-token estimate of KL(pi || pi_ref) at the sampled tokens of a response.

    With x = logp_policy - logp_ref of each sampled token, an estimator returns a tensor
    of shape (batch, response_len); the caller masks out prompt and padding positions.
    Estimators that need whole distributions set ``needs_logits = True`` and then also
    receive the (temperature-scaled) logits of both models, shape (batch, response_len, vocab).
    """

    needs_logits: bool = False
    # True when, as a per-token reward, its policy gradient (score function times return) is the
    # gradient of the KL: only the log-ratio k1 has this property.
    unbiased_as_reward: bool = False

    @abstractmethod
    def __call__(
        self,
        logprobs: Tensor,
        ref_logprobs: Tensor,
        logits: Optional[Tensor] = None,
        ref_logits: Optional[Tensor] = None,
    ) -> Tensor: ...


class BetaController(ABC):
    """Holds the KL coefficient beta and updates it from the observed KL after every iteration.

    ``unit`` declares which KL the controller sees and its target is expressed in:
    ``sequence_sum`` (batch mean of each response's summed per-token KL, as in
    lm-human-preferences and TRL) or ``token_mean`` (mean over all response tokens, as in
    verl and OpenRLHF). The observed value is always the global mean across ranks.
    """

    def __init__(self, init_beta: float = 0.1, unit: KLUnit = "sequence_sum") -> None:
        require_number("beta_controller.init_beta", init_beta, at_least=0)
        require(unit in ("sequence_sum", "token_mean"), "beta_controller.unit", "'sequence_sum' or 'token_mean'", unit)
        self.beta = float(init_beta)
        self.unit = unit

    @abstractmethod
    def update(self, observed_kl: float, n_samples: int) -> float:
        """Update from this iteration's observed KL over ``n_samples`` responses; return the new beta."""

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta = float(state["beta"])


class AdvantageEstimator(ABC):
    """Turns one rollout's per-token rewards into advantages (and, with a critic, value targets).

    The rollout holds ``group_size`` responses per prompt in consecutive rows (``model.num_generations``),
    and ``rewards`` is R_t = r_RM * 1[t = T] - beta * kl_t (the KL term only when the penalty is in
    the reward), shape (batch, response_len), zero off ``mask``. Class attributes declare what the
    estimator needs, so the module can check a config at start-up:

    - ``needs_critic``: it reads ``values`` (V(s_t) of the rollout) and returns value targets; a
      critic-free estimator is called with ``values=None`` and returns ``(advantages, None)``.
    - ``min_group_size``: the smallest ``num_generations`` it is defined for (2 for group baselines).
    - ``whiten``: whether the module whitens its advantages over the global batch by default
      (``model.whiten_advantages: null``); estimators that normalise themselves say False.
    - ``loss_aggregation``: the registered loss aggregation the estimator is defined with, if any
      (Dr. GRPO's ``constant``), used when ``model.loss_aggregation`` is null.
    """

    needs_critic: bool = False
    min_group_size: int = 1
    whiten: bool = False
    loss_aggregation: Optional[str] = None

    @abstractmethod
    def __call__(
        self, rewards: Tensor, mask: Tensor, values: Optional[Tensor], group_size: int, sum_fn=None
    ) -> tuple[Tensor, Optional[Tensor]]:
        """``(advantages, returns)``, each (batch, response_len) and zero off ``mask``; ``returns``
        (the critic's targets) is None for a critic-free estimator. ``sum_fn`` all-reduces sums
        across ranks, for estimators that normalise over the global batch."""


class PolicyLoss(ABC):
    """The per-token policy-gradient loss of one micro-batch, before aggregation over tokens.

    Receives log pi_theta of the sampled tokens (with gradient), log pi_old (the sampler's), the
    advantages and the response mask, each (batch, response_len), and returns ``(loss, clipped)``:
    the loss of every token and a 0/1 tensor marking tokens where a clip or truncation was active
    (logged as ``policy/clipfrac``), both zero off the mask. The module sums the loss with the
    weights of the ``LossAggregation``. ``loss_aggregation`` optionally names the aggregation the
    loss is defined with (GSPO's sequence mean), used when ``model.loss_aggregation`` is null.
    """

    loss_aggregation: Optional[str] = None

    @abstractmethod
    def __call__(self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]: ...


class LossAggregation(ABC):
    """How per-token losses become one number: weights w (batch, response_len), zero off the mask,
    such that the loss of the whole minibatch (all micro-batches, all ranks) is sum w * loss_t.

    ``sum_fn`` all-reduces sums across ranks (the weights' denominators are global), and
    ``max_new_tokens`` is the configured response length (for constant normalisers)."""

    @abstractmethod
    def weights(self, mask: Tensor, max_new_tokens: int, sum_fn=None) -> Tensor: ...


class ReferenceUpdate(ABC):
    """When, and how far, the KL's reference moves toward the policy.

    After PPO iteration ``i`` (1-based) the module sets ``ref <- (1 - alpha) ref + alpha policy``
    in the reference's own parameters (the frozen copy under full fine-tuning; a second, frozen
    LoRA adapter under LoRA), with ``alpha = weight(i)``; 0 leaves the reference where it is.
    alpha = 1 makes the reference the current policy, so the next rollout's KL is exactly 0.
    Class attributes declare what the module must build:

    - ``moves``: False only for the frozen reference (no second adapter or initial copy is built,
      and ``objective/kl_to_initial`` is ``objective/kl``).
    - ``reset_optimizer``: also clear the optimizer state (Adam moments) of the policy's
      parameters at each update (ProRL's reference reset, Liu et al. 2025).
    """

    moves: bool = True
    reset_optimizer: bool = False

    def __init__(self, every_n_iterations: int = 1) -> None:
        require_number("reference_update.every_n_iterations", every_n_iterations, integer=True, at_least=1)
        self.every_n_iterations = every_n_iterations

    @abstractmethod
    def weight(self, iteration: int) -> float:
        """alpha in [0, 1] of the update after PPO iteration ``iteration`` (1-based); 0: no update."""


class RewardModel(ABC):
    """Scores responses: one float per (prompt, response) pair, from their decoded text.

    Subclasses implement :meth:`score`. Calling the backend validates the scores (shape,
    finiteness), applies the optional missing-EOS penalty, running mean/std normalisation
    and clipping, in that order, and returns the scores the policy is trained on.

    Args:
        normalize: whiten scores with a running mean/std over every score seen so far.
        clip: clip the (normalised) scores to ``[-clip, clip]``.
        missing_eos_penalty: subtracted from the score of a response that never emitted EOS.
    """

    def __init__(
        self,
        normalize: bool = False,
        clip: Optional[float] = None,
        missing_eos_penalty: Optional[float] = None,
    ) -> None:
        require_number("reward_model.clip", clip, above=0, optional=True)
        require_number("reward_model.missing_eos_penalty", missing_eos_penalty, optional=True)
        self.normalize = normalize
        self.clip = clip
        self.missing_eos_penalty = missing_eos_penalty
        self.stats = RunningMeanStd()

    @abstractmethod
    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor | Sequence[float]:
        """Raw scores, one per response."""

    def setup(self, device: torch.device) -> None:
        """Called once before use with the device the policy runs on (load or move models here)."""

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        ended_with_eos: Tensor,
        sum_fn=None,
        update_stats: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """Return ``(raw_scores, train_scores)``: :meth:`checked_scores` then :meth:`shape_scores`."""
        raw = self.checked_scores(prompts, responses)
        return raw, self.shape_scores(raw, ended_with_eos, sum_fn, update_stats)

    def checked_scores(self, prompts: Sequence[str], responses: Sequence[str]) -> Tensor:
        """Raw scores as float32 (batch,) on CPU; ValueError for a wrong shape, FloatingPointError
        for non-finite scores, each naming the backend."""
        raw = self.score(prompts, responses)
        raw = torch.as_tensor(raw.detach().cpu() if isinstance(raw, Tensor) else raw, dtype=torch.float32)
        name = type(self).__name__
        if raw.shape != (len(responses),):
            raise ValueError(
                f"reward model {name} returned scores of shape {tuple(raw.shape)}; "
                f"expected one score per response, shape ({len(responses)},)"
            )
        bad = (~torch.isfinite(raw)).nonzero().flatten().tolist()
        if bad:
            raise FloatingPointError(f"reward model {name} returned non-finite scores for responses {bad}: {raw[bad].tolist()}")
        return raw

    def shape_scores(self, raw: Tensor, ended_with_eos: Tensor, sum_fn=None, update_stats: bool = True) -> Tensor:
        """Missing-EOS penalty, running normalisation (global when ``sum_fn`` all-reduces; frozen
        statistics with ``update_stats=False``, as in evaluation), then clipping."""
        scores = raw.clone()
        if self.missing_eos_penalty is not None:
            scores = scores - self.missing_eos_penalty * (~ended_with_eos.cpu()).float()
        if self.normalize:
            if update_stats:
                self.stats.update(scores, sum_fn)
            scores = (scores - self.stats.mean) / (self.stats.std + 1e-8)
        if self.clip is not None:
            scores = scores.clamp(-self.clip, self.clip)
        return scores

    def state_dict(self) -> dict[str, Any]:
        return {"stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats.load_state_dict(state["stats"])


class RunningMeanStd:
    """Running mean and (population) standard deviation of every value seen, merged batch by
    batch with Chan et al.'s parallel update; std is 1 until two values have been seen."""

    def __init__(self) -> None:
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count >= 2 else 1.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, x: Tensor, sum_fn=None) -> None:
        # Global batch moments from three all-reduced sums, so every rank holds the same stats.
        x = x.double().flatten()
        sums = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(), (x * x).sum()])
        if sum_fn is not None:
            sums = sum_fn(sums)
        n, s, ss = (float(v) for v in sums)
        if n == 0:
            return
        batch_mean = s / n
        batch_m2 = max(ss - n * batch_mean**2, 0.0)
        total = self.count + n
        delta = batch_mean - self.mean
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.count = total

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]


register_kind("kl_estimator", KLEstimator)
register_kind("beta_controller", BetaController)
register_kind("reward_model", RewardModel)
register_kind("advantage_estimator", AdvantageEstimator)
register_kind("policy_loss", PolicyLoss)
register_kind("loss_aggregation", LossAggregation)
register_kind("reference_update", ReferenceUpdate)
