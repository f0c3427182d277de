"""KLToOptimum: how far a real run's policy is from the KL-regularised optimum of its own reward.

For a beta, the optimum of J(pi) = E r - beta KL(pi || pi_ref) is pi_beta ∝ pi_ref exp(r / beta), and

    KL(pi || pi_beta) = E_pi[log pi - log pi_ref - r / beta] + log Z,    Z = E_ref exp(r / beta),
    J* - J(pi) = beta * KL(pi || pi_beta).

The callback samples ``reference_samples`` responses per meter prompt from the starting policy
(the reference) before the first update and keeps their training scores; then, and every ``every``
iterations, it samples ``policy_samples`` responses per prompt from the policy and estimates both
terms (:func:`rlhf_lightning.exact.frontier.kl_to_optimum`, log Z with its delta-method bias removed and
its standard error). The reference pool is kept, so log Z follows the beta of a moving controller.
Where the estimate cannot be trusted it logs why instead of a number (a warning, and a TensorBoard
text ``kl_to_optimum``): the effective sample size of exp(r / beta) below ``min_ess`` (a heavy
tail: beta too small for the pool), or, given ``reward_max``, the worst case of what the pool has
not seen (mass up to 3 / n above its largest reward, each worth at most exp(reward_max / beta))
adding more than ``max_tail`` nats to log Z.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from rlhf_lightning.checks import require, require_number
from rlhf_lightning.exact.frontier import OptimumDistance, kl_to_optimum, log_partition_estimate


class KLToOptimum(Callback):
    """Logs ``objective/kl_to_optimum`` (E_x KL(pi || pi_beta), nats per response) with its standard error
    ``objective/kl_to_optimum_se``, the implied ``objective/optimum_gap`` = J* - J(pi) = beta * KL, and
    ``objective/log_z_ess`` (the smallest effective sample size over the prompts) every ``every``
    iterations and before the first update (logged at step 0: KL(pi_ref || pi_beta) = log Z - E_ref r / beta,
    where a run that approaches the optimum starts falling from; module docstring), and how far it fell since
    then, ``objective/kl_to_optimum_fall`` with its standard error ``objective/kl_to_optimum_fall_se`` (at the
    start's beta: both measurements read the same log Z, whose error cancels in the difference).

    Args:
        every: iterations between measurements.
        beta: the optimum's beta; null: the beta controller's at each measurement.
        num_prompts: meter prompts, the first distinct ones of the first training batch (or ``prompts``).
        reference_samples: responses per prompt from the reference, sampled once (the log Z pool).
        policy_samples: responses per prompt from the policy at each measurement.
        min_ess: smallest trusted effective sample size of exp(r / beta) per prompt.
        reward_max: an upper bound of the training score, if known (VADER: 1); enables the tail check.
        max_tail: the largest worst-case unseen-tail share of log Z (nats) that still prints a number.
        prompts: explicit meter prompts.
    """

    def __init__(
        self,
        every: int = 10,
        beta: Optional[float] = None,
        num_prompts: int = 4,
        reference_samples: int = 64,
        policy_samples: int = 16,
        min_ess: float = 8.0,
        reward_max: Optional[float] = None,
        max_tail: float = 0.1,
        prompts: Optional[list[str]] = None,
    ) -> None:
        for name, value in (("every", every), ("num_prompts", num_prompts), ("reference_samples", reference_samples)):
            require(isinstance(value, int) and value >= 1, f"KLToOptimum.{name}", "an integer >= 1", value)
        require(isinstance(policy_samples, int) and policy_samples >= 2, "KLToOptimum.policy_samples", "an integer >= 2", policy_samples)
        require_number("KLToOptimum.beta", beta, above=0, optional=True)
        require_number("KLToOptimum.min_ess", min_ess, at_least=1)
        require_number("KLToOptimum.reward_max", reward_max, optional=True)
        require_number("KLToOptimum.max_tail", max_tail, above=0)
        self.every, self.beta, self.num_prompts = every, beta, num_prompts
        self.reference_samples, self.policy_samples = reference_samples, policy_samples
        self.min_ess, self.reward_max, self.max_tail = min_ess, reward_max, max_tail
        self.prompts = list(prompts) if prompts else None
        self.reference_scores: Optional[torch.Tensor] = None  # (prompts, reference_samples): the log Z pool
        self.rows: list[dict[str, Any]] = []  # every measurement: iteration, beta, reward and KL, the distance or why not
        self._no_pool = False

    def state_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "reference_scores": self.reference_scores}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts, self.reference_scores = state["prompts"], state["reference_scores"]

    def setup(self, trainer, pl_module, stage: str) -> None:
        controller = pl_module.beta_controller
        require(
            self.beta is not None or not controller.keyed_by_prompt,
            "KLToOptimum.beta",
            "a number with a per-prompt beta controller (the meter measures against one beta's optimum)",
            self.beta,
        )
        divergence = getattr(pl_module, "divergence", None)
        require(
            divergence is None or divergence.per_token,
            "model.divergence",
            "reverse_kl with the KLToOptimum callback (it measures the distance to pi_beta ∝ pi_ref exp(r / beta), the KL's optimum)",
            type(divergence).__name__,
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._no_pool or (pl_module.iteration != 0 and self.reference_scores is not None):
            return
        # The policy is the reference only at the start, and only when the reference is the starting policy.
        if pl_module.iteration != 0 or pl_module.networks.initial_is_apart:
            self._no_pool = True
            self._refuse(
                trainer,
                pl_module,
                "no reference pool: the run did not start at iteration 0 with this callback, or the reference moves or is another "
                "model (model.reference)",
            )
            return
        if self.reference_scores is None:  # else a pool loaded with load_state_dict: another run's from the same reference
            self.prompts = self.prompts or list(dict.fromkeys(batch))[: self.num_prompts]
            self.reference_scores, _ = self._sample(pl_module, self.reference_samples)
        self._measure(trainer, pl_module)  # the starting point, KL(pi_ref || pi_beta): where a falling meter falls from

    @torch.no_grad()
    def _sample(self, pl_module, per_prompt: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training scores and log pi - log pi_ref of whole responses, (prompts, per_prompt) each, from the
        policy: one rollout per prompt, so the sampler's logits (rows x new tokens x vocabulary) are held for
        one prompt's responses at a time. Each rollout draws from the iteration's sampling seed, so prompts share
        random numbers: each prompt's samples stay independent draws, and its estimate unbiased."""
        scores, log_ratios = [], []
        for prompt in self.prompts:
            rollout = pl_module.rollout([prompt] * per_prompt)
            raw = pl_module.reward_model.checked_scores(rollout.prompts, rollout.response_texts)
            scores.append(pl_module.reward_model.shape_scores(raw, rollout.ended_with_eos, update_stats=False).double())
            log_ratios.append(((rollout.old_logprobs - rollout.ref_logprobs) * rollout.response_mask).sum(-1).double().cpu())
        return torch.stack(scores), torch.stack(log_ratios)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        iteration = pl_module.iteration
        if self.reference_scores is not None and (iteration % self.every == 0 or trainer.should_stop):
            self._measure(trainer, pl_module)

    def _measure(self, trainer, pl_module) -> None:
        iteration = pl_module.iteration
        beta = self.beta if self.beta is not None else pl_module.beta_controller.beta
        scores, log_ratio = self._sample(pl_module, self.policy_samples)
        row: dict[str, Any] = {"iteration": iteration, "beta": beta}
        row["sampled"] = kl_to_optimum(log_ratio, scores, torch.zeros(len(self.prompts)), 1.0)  # its reward and KL to the reference
        reason = self._untrusted(pl_module, beta)
        self.rows.append(row)
        if reason is not None:
            row["reason"] = reason
            self._refuse(trainer, pl_module, reason)
            return
        log_z = log_partition_estimate(self.reference_scores, beta)
        row["distance"], row["ess"] = kl_to_optimum(log_ratio, scores, log_z, beta), float(log_z.ess.min())
        metrics = {
            "objective/kl_to_optimum": row["distance"].kl_to_optimum,
            "objective/kl_to_optimum_se": row["distance"].se,
            "objective/optimum_gap": row["distance"].gap,
            "objective/log_z_ess": row["ess"],
        }
        start = self.rows[0]
        if "distance" in start and start["beta"] == beta:  # the same pool and beta: log Z cancels in the fall
            row["fall"] = row["distance"].fall_since(start["distance"])
            metrics["objective/kl_to_optimum_fall"], metrics["objective/kl_to_optimum_fall_se"] = row["fall"]
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=max(pl_module.step, 0))

    def _untrusted(self, pl_module, beta: float) -> Optional[str]:
        if not beta > 0:
            return f"beta is {beta}: no KL-regularised optimum to measure against"
        if pl_module.reward_model.shaping.normalize:
            return "reward_model.normalize moves the training score: the optimum moves with it"
        return log_partition_estimate(self.reference_scores, beta).untrusted(self.min_ess, self.reward_max, self.max_tail)

    def _refuse(self, trainer, pl_module, reason: str) -> None:
        rank_zero_warn(f"KLToOptimum at iteration {pl_module.iteration}: not measured: {reason}")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and trainer.global_rank == 0:
                logger.experiment.add_text("kl_to_optimum", reason, global_step=max(pl_module.step, 0))

    @property
    def last(self) -> Optional[OptimumDistance]:
        """The latest trusted measurement."""
        return next((row["distance"] for row in reversed(self.rows) if "distance" in row), None)
