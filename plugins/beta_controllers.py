"""Built-in beta controllers: how the KL coefficient beta moves with the observed KL.

``fixed`` keeps it; ``anneal`` moves it on a schedule from one value to another; ``adaptive``
(Ziegler et al., 2019) and ``band`` scale it toward a KL target; from control theory, ``pid`` steers
log(beta) with a PID controller and ``dual`` treats beta as the Lagrange multiplier of the hard
constraint KL <= target. ``per_prompt`` keeps one beta per prompt, each moved by ``adaptive``'s rule
from that prompt's own KL toward its own budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor

from rlhf_lightning.checks import FLOAT32_RANGE
from rlhf_lightning.interfaces import BetaController, KLUnit, PerPromptBetaController, require, require_number
from rlhf_lightning.registry import register

# KL / target is floored here before the log: the k1 estimator's KL can be 0 or negative,
# and it is exactly 0 on the first iteration, when the policy still equals the reference.
KL_RATIO_FLOOR = 1e-6


class TargetBeta(BetaController):
    """Base of the controllers that steer the observed KL toward ``target`` (a KL in ``unit``)."""

    def __init__(self, init_beta: float, target: float, unit: KLUnit) -> None:
        super().__init__(init_beta, unit)
        require_number("beta_controller.target", target, at_least=FLOAT32_RANGE[0], at_most=FLOAT32_RANGE[1])  # a KL the float32 KL meets
        self.target = float(target)


class ClampedTargetBeta(TargetBeta):
    """A :class:`TargetBeta` that keeps beta in [beta_min, beta_max] (:meth:`clamp`), init_beta included."""

    # pid steps log(beta), which must exist: its beta_min must be > 0, the others' >= 0.
    beta_min_positive: bool = False

    def __init__(self, init_beta: float, target: float, beta_min: float, beta_max: float, unit: KLUnit) -> None:
        super().__init__(init_beta, target, unit)
        require_number("beta_controller.beta_min", beta_min, **({"above": 0} if self.beta_min_positive else {"at_least": 0}))
        require_number("beta_controller.beta_max", beta_max, at_least=beta_min)
        require_number("beta_controller.init_beta", init_beta, at_least=beta_min, at_most=beta_max)
        self.beta_min, self.beta_max = float(beta_min), float(beta_max)

    def clamp(self, beta: float) -> float:
        return min(max(beta, self.beta_min), self.beta_max)


@register("beta_controller", "fixed", description="beta never changes")
class FixedBeta(BetaController):
    """A constant KL coefficient."""

    def update(self, observed_kl: float, n_samples: int) -> float:
        return self.beta


@register("beta_controller", "anneal", description="a schedule: beta moves geometrically from init_beta to final_beta, then stays")
class AnnealedBeta(BetaController):
    """A schedule, blind to the KL: after the i-th update beta = init_beta * (final_beta / init_beta) **
    min(i / iterations, 1), so it reaches ``final_beta`` after ``iterations`` iterations and stays there.

    What it is for: a run whose optimum at ``final_beta`` puts its mass on responses the reference
    almost never samples can stall short of it (a mode the sampler stopped visiting: docs/results.md,
    "The reward-KL frontier", random:3 at beta 0.5). Starting at a larger beta keeps the policy near the
    optimum of that beta, which still samples them, and lowering beta moves that optimum continuously
    toward the one wanted. The objective of the run's end is that of ``final_beta``."""

    def __init__(self, init_beta: float = 1.0, final_beta: float = 0.1, iterations: int = 100, unit: KLUnit = "sequence_sum") -> None:
        super().__init__(init_beta, unit)
        require_number("beta_controller.init_beta", init_beta, above=0)  # the geometric path needs both ends > 0
        require_number("beta_controller.final_beta", final_beta, above=0)
        require_number("beta_controller.iterations", iterations, integer=True, at_least=1)
        self.init_beta, self.final_beta, self.iterations = float(init_beta), float(final_beta), int(iterations)
        self.updates = 0

    def update(self, observed_kl: float, n_samples: int) -> float:
        self.updates += 1
        self.beta = self.init_beta * (self.final_beta / self.init_beta) ** min(self.updates / self.iterations, 1.0)
        return self.beta

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.updates = int(state["updates"])


@register("beta_controller", "adaptive", description="Ziegler et al. (2019) proportional controller toward a KL target")
class AdaptiveBeta(TargetBeta):
    """Proportional control of beta (Ziegler et al., 2019, "Fine-Tuning LMs from Human Preferences").

    error = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + error * n_samples / horizon)
    (:func:`proportional_factor`).
    """

    def __init__(self, init_beta: float = 0.1, target: float = 6.0, horizon: float = 10000, unit: KLUnit = "sequence_sum") -> None:
        super().__init__(init_beta, target, unit)
        require_number("beta_controller.init_beta", init_beta, above=0)  # beta * (1 + ...) never leaves 0
        require_number("beta_controller.horizon", horizon, above=0)
        self.horizon = horizon

    def update(self, observed_kl: float, n_samples: int) -> float:
        self.beta *= float(proportional_factor(observed_kl, self.target, n_samples, self.horizon))
        return self.beta

    def check_batch(self, responses: int, per_prompt: int, field: str) -> None:
        """A step of 1 - 0.2 n / horizon must stay > 0: ``horizon`` above 0.2 x the responses one update counts (a
        per-prompt controller's: each prompt's ``per_prompt``), else beta falls to 0 or below at the first low KL."""
        n = per_prompt if self.keyed_by_prompt else responses
        of = "of one prompt that an update of its beta counts" if self.keyed_by_prompt else "that one update counts"
        require(
            self.horizon > 0.2 * n,
            f"{field}.init_args.horizon",
            f"> {0.2 * n:g}, 0.2 x the {n} responses {of} (a step beta x (1 - 0.2 x {n} / horizon) leaves beta at or below 0)",
            self.horizon,
        )


def proportional_factor(
    observed_kl: Union[float, Tensor], target: Union[float, Tensor], n_samples: Union[int, Tensor], horizon: float
) -> Tensor:
    """Ziegler et al.'s multiplicative step, 1 + clip(KL / target - 1, -0.2, 0.2) * n_samples / horizon, in
    float64: of one KL (``adaptive``) or of one per prompt (``per_prompt``), elementwise."""
    error = torch.as_tensor(observed_kl / target - 1.0, dtype=torch.float64).clamp(-0.2, 0.2)
    return 1.0 + error * n_samples / horizon


@register(
    "beta_controller", "per_prompt", description="one beta per prompt, each moved by adaptive's rule from its own KL toward its budget"
)
class PromptBudgetBeta(PerPromptBetaController, AdaptiveBeta):
    """Per-prompt KL budgets: prompt x's own beta_x, after every iteration in which x was sampled,

        beta_x <- beta_x * (1 + clip(KL_x / budget_x - 1, -0.2, 0.2) * n_x / horizon),

    KL_x the mean KL (in ``unit``) of x's n_x responses of the iteration over all ranks, budget_x the prompt
    file's ``budget_column`` value or ``target``; a prompt not sampled keeps its beta. With ``decay_after`` T,
    the k-th update of a prompt past its T-th takes a step T / k as long (n_x T / k in place of n_x): the
    1/k steps of stochastic approximation (Robbins & Monro, 1951), under which beta_x converges to where
    E[KL_x] meets the budget instead of wandering about it with the sampling noise (a constant step leaves
    beta_x a noise of its own, about 1 / sqrt(horizon), and since a prompt's KL is convex in its beta,
    that noise also biases beta_x upward). This is ``adaptive``'s
    rule (Ziegler et al., 2019) per prompt, chosen over the dual update beta_x += lr (KL_x - budget_x) because
    it is scale-free: the error is relative and the step multiplicative, so one ``horizon`` serves budgets of
    0.1 and of 10 nats, and beta_x stays > 0 without a clamp. Both are integral control of the budget (beta_x
    accumulates the errors), so at rest KL_x = budget_x: with the policy at its optimum, pi*(.|x) ∝ pi_ref
    exp(r / beta_x), beta_x is where the tilted optimum's KL meets the budget (``exact.closed_form.prompt_betas``), and the
    policy is the maximiser of E r subject to KL_x <= budget_x for every prompt (the betas are its Lagrange
    multipliers). ``horizon`` counts one prompt's responses (default 100: 16 responses a prompt move its beta
    by at most 3.2% an iteration). ``beta``, the beta of a prompt with no entry yet, follows ``adaptive``'s
    rule toward ``target`` on the mean KL of the iteration's responses, stepping by the mean responses per prompt
    (:class:`~rlhf_lightning.interfaces.PerPromptBetaController`), before the prompts move.
    ``beta_min`` / ``beta_max`` clamp every beta (each prompt's and ``beta``) after each update: anti-windup.
    beta_x is the controller's integrator, and where the policy cannot follow a lower beta (pi* moves onto
    responses the sampler does not meet) the rule keeps lowering it while the KL stays below budget; the
    clamp stops that integration at a bound the user trusts (null: no bound, the rule's own beta > 0). An
    ``init_beta`` above where the betas rest keeps the early policy near the reference and lets each beta come
    down at the capped step with the policy following (an anneal): ``optimum_check --kl-budgets`` starts at 4 for
    that (random:3 wound up from 1 on two sampling seeds of three; docs/plugins.md, "Per-prompt KL budgets").
    The state is every prompt's beta, by prompt id."""

    def __init__(
        self,
        init_beta: float = 0.1,
        target: float = 6.0,
        horizon: float = 100,
        budget_column: Optional[str] = None,
        decay_after: Optional[int] = None,
        beta_min: Optional[float] = None,
        beta_max: Optional[float] = None,
        unit: KLUnit = "sequence_sum",
    ) -> None:
        super().__init__(init_beta, target, horizon, unit)
        require_number("beta_controller.decay_after", decay_after, integer=True, at_least=1, optional=True)
        require_number("beta_controller.beta_min", beta_min, above=0, at_most=init_beta, optional=True)
        require_number("beta_controller.beta_max", beta_max, at_least=max(init_beta, beta_min or 0.0), optional=True)
        self.decay_after, self.beta_min, self.beta_max = decay_after, beta_min, beta_max
        require(
            budget_column is None or (isinstance(budget_column, str) and bool(budget_column.strip())),
            "beta_controller.budget_column",
            "the name of a column of data.train_path holding each prompt's KL budget, or null (target for every prompt)",
            budget_column,
        )
        self.budget_column = budget_column
        self.betas: dict[str, float] = {}  # prompt id -> beta
        self.updates: dict[str, int] = {}  # prompt id -> the updates of its beta so far
        self.budgets: dict[str, float] = {}  # prompt id -> budget; absent: target

    def set_budgets(self, budgets: Optional[dict[str, float]]) -> None:
        self.budgets = dict(budgets or {})

    def budgets_of(self, prompt_ids: Sequence[str]) -> Tensor:
        return torch.tensor([self.budgets.get(i, self.target) for i in prompt_ids], dtype=torch.float64)

    def betas_of(self, prompt_ids: Sequence[str]) -> Tensor:
        return torch.tensor([self.betas.get(i, self.beta) for i in prompt_ids], dtype=torch.float64)

    def update_prompts(self, prompt_ids: Sequence[str], observed_kls: Tensor, n_samples: Tensor) -> None:
        # beta first (adaptive's rule on the responses' mean KL, stepping by the prompts' mean count of responses,
        # the unit of ``horizon``), so that a prompt met for the first time starts from it
        steps, kls = n_samples.double(), observed_kls.double()
        self.beta = self.clamp(
            self.beta * float(proportional_factor(float((kls * steps).sum() / steps.sum()), self.target, float(steps.mean()), self.horizon))
        )
        self.updates.update({i: self.updates.get(i, 0) + 1 for i in prompt_ids})
        if self.decay_after is not None:  # the k-th update past the T-th: T / k of the step
            steps = steps * (self.decay_after / torch.tensor([self.updates[i] for i in prompt_ids], dtype=torch.float64)).clamp(max=1.0)
        factor = proportional_factor(kls, self.budgets_of(prompt_ids), steps, self.horizon)
        betas = (self.betas_of(prompt_ids) * factor).tolist()
        self.betas.update(zip(prompt_ids, map(self.clamp, betas), strict=True))

    def update(self, observed_kl: float, n_samples: int) -> float:
        """Nothing: ``beta`` moves in :meth:`update_prompts`, whose step counts responses per prompt (``horizon``'s
        unit; the batch's count here would step it by as many times more, and below 0 for a small horizon)."""
        return self.beta

    def clamp(self, beta: float) -> float:
        """beta within [beta_min, beta_max], each bound only where set."""
        return min(max(beta, self.beta_min or 0.0), math.inf if self.beta_max is None else self.beta_max)

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "betas": dict(self.betas), "updates": dict(self.updates)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.betas = {str(prompt_id): float(beta) for prompt_id, beta in state["betas"].items()}
        self.updates = {str(prompt_id): int(count) for prompt_id, count in state["updates"].items()}


@register("beta_controller", "band", description="x1.5 above 1.5*target, /1.5 below 0.5*target, clamped")
class BandBeta(ClampedTargetBeta):
    """Multiplicative band controller: beta * factor when KL > 1.5 * target,
    beta / factor when KL < 0.5 * target, else unchanged; clamped to [beta_min, beta_max]."""

    def __init__(
        self,
        init_beta: float = 0.1,
        target: float = 6.0,
        factor: float = 1.5,
        beta_min: float = 1e-4,
        beta_max: float = 10.0,
        unit: KLUnit = "sequence_sum",
    ) -> None:
        super().__init__(init_beta, target, beta_min, beta_max, unit)
        require_number("beta_controller.init_beta", init_beta, above=0)  # beta * factor never leaves 0
        require_number("beta_controller.factor", factor, above=1)
        self.factor = factor

    def update(self, observed_kl: float, n_samples: int) -> float:
        if observed_kl > 1.5 * self.target:
            self.beta *= self.factor
        elif observed_kl < 0.5 * self.target:
            self.beta /= self.factor
        self.beta = self.clamp(self.beta)
        return self.beta


@register("beta_controller", "pid", description="PID controller on log(beta) toward a KL target, with anti-windup")
class PIDBeta(ClampedTargetBeta):
    """Discrete PID control of log(beta) toward a KL target, in incremental (velocity) form.

    With the error in log space, clipped to [-error_clip, error_clip],

        e_t = clip(log(max(KL_t / target, 1e-6)), -error_clip, error_clip)
        I_t = clip(I_{t-1} + e_t, -integral_limit, integral_limit)      (anti-windup)
        log beta <- clip(log beta + kp * e_t + ki * I_t + kd * (e_t - e_{t-1}), log beta_min, log beta_max)

    and e_{t-1} = e_t on the first update (no derivative kick). The log error is symmetric
    (KL at twice and at half the target give +-log 2) and, for a KL that scales like a power of
    1/beta, linear in log beta; the clip keeps the first iterations, where KL is 0 by
    construction, from driving beta to beta_min at once. Because the step is added to log beta,
    ``kp`` alone is a multiplicative controller like Ziegler et al.'s ``adaptive``
    (log beta += kp * e_t); ``ki`` adds the accumulated error, which removes the lag behind a
    KL that keeps drifting upward as the policy learns; ``kd`` reacts at once to a change of the
    error and damps the oscillation. Summed up, log beta = const + kd * e_t + kp * sum e +
    ki * sum sum e (ignoring the clamps): a standard discrete PID
    (Astrom & Murray, "Feedback Systems", chapter "PID Control") one order up, so that the plain
    gain ``kp`` reproduces the KL controller of the RLHF literature (Ziegler et al., 2019,
    "Fine-Tuning Language Models from Human Preferences", whose KL-penalised PPO Stiennon et al.,
    2020, "Learning to summarize from human feedback", build on). The integral and the previous
    error are state: ``state_dict`` carries them, so a resumed run continues identically.
    """

    beta_min_positive = True

    def __init__(
        self,
        init_beta: float = 0.1,
        target: float = 6.0,
        kp: float = 0.1,
        ki: float = 0.005,
        kd: float = 0.2,
        integral_limit: float = 2.0,
        error_clip: float = 1.0,
        beta_min: float = 1e-4,
        beta_max: float = 10.0,
        unit: KLUnit = "sequence_sum",
    ) -> None:
        super().__init__(init_beta, target, beta_min, beta_max, unit)
        for name, gain in (("kp", kp), ("ki", ki), ("kd", kd)):
            require_number(f"beta_controller.{name}", gain, at_least=0)
        require_number("beta_controller.integral_limit", integral_limit, at_least=0)
        require_number("beta_controller.error_clip", error_clip, above=0)
        self.kp, self.ki, self.kd = float(kp), float(ki), float(kd)
        self.integral_limit, self.error_clip = float(integral_limit), float(error_clip)
        self.integral = 0.0
        self.prev_error: Optional[float] = None

    def error(self, observed_kl: float) -> float:
        """e_t = clip(log(KL_t / target), -error_clip, error_clip), KL / target floored at 1e-6."""
        e = math.log(max(observed_kl / self.target, KL_RATIO_FLOOR))
        return min(max(e, -self.error_clip), self.error_clip)

    def update(self, observed_kl: float, n_samples: int) -> float:
        e = self.error(observed_kl)
        self.integral = min(max(self.integral + e, -self.integral_limit), self.integral_limit)
        derivative = e - (e if self.prev_error is None else self.prev_error)
        self.prev_error = e
        log_beta = math.log(self.beta) + self.kp * e + self.ki * self.integral + self.kd * derivative
        self.beta = self.clamp(math.exp(log_beta))
        return self.beta

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "integral": self.integral, "prev_error": self.prev_error}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.integral = float(state["integral"])
        self.prev_error = None if state["prev_error"] is None else float(state["prev_error"])


@register("beta_controller", "dual", description="beta as a Lagrange multiplier for KL <= target (projected dual ascent)")
class DualBeta(TargetBeta):
    """beta as the Lagrange multiplier of the hard constraint KL <= target.

    The Lagrangian relaxation  max_pi min_{beta >= 0}  E[r] - beta * (KL - target)  is solved by
    alternating a policy step with projected gradient ascent on beta, the constraint violation
    being the gradient:

        beta <- min(max(0, beta + lr * (KL_t - target)), beta_max)

    (``beta_max`` optional). beta grows while the constraint is violated and shrinks toward 0,
    where the penalty switches off, while it holds with slack. As Stooke et al. (2020) show,
    this is pure integral control of the constraint: it overshoots and oscillates when lr is
    large relative to how fast KL responds. ``lr`` is in beta per unit of KL, so it depends on
    ``unit``. References: Tessler et al. (2019), "Reward Constrained Policy Optimization";
    Stooke et al. (2020), "Responsive Safety in Reinforcement Learning by PID Lagrangian Methods".
    """

    def __init__(
        self,
        init_beta: float = 0.1,
        target: float = 6.0,
        lr: float = 0.01,
        beta_max: Optional[float] = None,
        unit: KLUnit = "sequence_sum",
    ) -> None:
        super().__init__(init_beta, target, unit)
        require_number("beta_controller.lr", lr, above=0)
        require_number("beta_controller.beta_max", beta_max, at_least=init_beta, optional=True)
        self.lr = float(lr)
        self.beta_max = None if beta_max is None else float(beta_max)

    def update(self, observed_kl: float, n_samples: int) -> float:
        beta = max(0.0, self.beta + self.lr * (observed_kl - self.target))
        self.beta = beta if self.beta_max is None else min(beta, self.beta_max)
        return self.beta
