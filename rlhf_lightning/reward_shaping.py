"""What the loop does with a reward backend's scores: checks what the backend returned, then
shapes it into the scores the policy is trained on (missing-EOS penalty, running normalisation,
clipping, in that order), with the running mean and std the normalisation keeps."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from rlhf_lightning.checks import ConfigError, require_number

# Beyond this a score is no reward's scale but a broken backend's: float32 (7 digits) loses the
# KL penalty beside it, and from about 1e18 the squares in the advantages' whitening and the value
# loss overflow, so the PPO loss turns non-finite and its fault would name the loss, not the backend.
MAX_ABS_SCORE = 1e15


def check_scores(raw: Any, backend: str, n_responses: int) -> Tensor:
    """A backend's scores as float32 (n_responses,) on CPU. Anything but a tensor, an array or a
    list of numbers, or a wrong shape, is a ``ConfigError`` naming the backend (the backend is
    broken: the run stops); a non-finite score, or one beyond +-``MAX_ABS_SCORE``, is a
    ``FloatingPointError`` naming the backend's argument, its class and the scores (a fault: the
    module skips the iteration). ``backend``: the class, with its role when not the trained reward
    (``ExactAnswerReward (model.gold_reward_model)``)."""
    if not isinstance(raw, (Tensor, np.ndarray, list, tuple)):
        raise ConfigError(
            f"reward model {backend} returned a {type(raw).__name__}; expected a tensor, an array or a list of "
            f"numbers, one per response ({n_responses})"
        )
    try:
        scores = torch.as_tensor(raw.detach().cpu() if isinstance(raw, Tensor) else raw, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ConfigError(f"reward model {backend} returned scores that are not numbers ({err}): {str(raw)[:200]}") from None
    if scores.shape != (n_responses,):
        raise ConfigError(
            f"reward model {backend} returned scores of shape {tuple(scores.shape)}; "
            f"expected one score per response, shape ({n_responses},)"
        )
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        raise FloatingPointError(f"reward model {backend} returned non-finite scores for responses {bad}: {scores[bad].tolist()}")
    huge = (scores.abs() > MAX_ABS_SCORE).nonzero().flatten().tolist()
    if huge:
        name, _, role = backend.partition(" (")
        raise FloatingPointError(
            f"{role.rstrip(')') or 'model.reward_model'} {name} returned scores beyond +-{MAX_ABS_SCORE:g} for responses "
            f"{huge[:8]}{' ...' if len(huge) > 8 else ''}: [{', '.join(f'{v:.4g}' for v in scores[huge[:8]].tolist())}] (the PPO loss would overflow float32 or lose "
            "the KL penalty beside them); scale the backend's scores down"
        )
    return scores


class ScoreShaping:
    """Raw scores -> training scores: ``score - missing_eos_penalty`` for a response that never
    emitted EOS, then (``normalize``) ``(score - mean) / std`` over every score seen so far, then
    clipping to ``[-clip, clip]``.

    Args:
        normalize: whiten scores with a running mean/std over every score seen so far.
        clip: clip the (normalised) scores to ``[-clip, clip]``.
        missing_eos_penalty: subtracted from the score of a response that never emitted EOS.
    """

    def __init__(self, normalize: bool = False, clip: Optional[float] = None, missing_eos_penalty: Optional[float] = None) -> None:
        require_number("reward_model.clip", clip, above=0, optional=True)
        require_number("reward_model.missing_eos_penalty", missing_eos_penalty, optional=True)
        self.normalize, self.clip, self.missing_eos_penalty = normalize, clip, missing_eos_penalty
        self.stats = RunningMeanStd()

    def __call__(self, raw: Tensor, ended_with_eos: Tensor, sum_fn=None, update_stats: bool = True) -> Tensor:
        """Global statistics when ``sum_fn`` all-reduces; frozen with ``update_stats=False``, as in evaluation."""
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
