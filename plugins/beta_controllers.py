"""Built-in beta controllers: how the KL coefficient moves with the observed KL."""

from __future__ import annotations

from rlhf_lightning.interfaces import BetaController, KLUnit, require_number
from rlhf_lightning.registry import register


@register("beta_controller", "fixed", description="beta never changes")
class FixedBeta(BetaController):
    """A constant KL coefficient."""

    def update(self, observed_kl: float, n_samples: int) -> float:
        return self.beta


@register("beta_controller", "adaptive", description="Ziegler et al. (2019) proportional controller toward a KL target")
class AdaptiveBeta(BetaController):
    """Proportional control of beta (Ziegler et al., 2019, "Fine-Tuning LMs from Human Preferences").

    error = clip(KL / target - 1, -0.2, 0.2);  beta <- beta * (1 + error * n_samples / horizon).
    """

    def __init__(self, init_beta: float = 0.1, target: float = 6.0, horizon: float = 10000, unit: KLUnit = "sequence_sum") -> None:
        super().__init__(init_beta, unit)
        require_number("beta_controller.target", target, above=0)
        require_number("beta_controller.horizon", horizon, above=0)
        self.target = target
        self.horizon = horizon

    def update(self, observed_kl: float, n_samples: int) -> float:
        error = min(max(observed_kl / self.target - 1.0, -0.2), 0.2)
        self.beta *= 1.0 + error * n_samples / self.horizon
        return self.beta


@register("beta_controller", "band", description="x1.5 above 1.5*target, /1.5 below 0.5*target, clamped")
class BandBeta(BetaController):
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
        super().__init__(init_beta, unit)
        require_number("beta_controller.target", target, above=0)
        require_number("beta_controller.factor", factor, above=1)
        require_number("beta_controller.beta_min", beta_min, at_least=0)
        require_number("beta_controller.beta_max", beta_max, at_least=beta_min)
        require_number("beta_controller.init_beta", init_beta, at_least=beta_min, at_most=beta_max)
        self.target, self.factor, self.beta_min, self.beta_max = target, factor, beta_min, beta_max

    def update(self, observed_kl: float, n_samples: int) -> float:
        if observed_kl > 1.5 * self.target:
            self.beta *= self.factor
        elif observed_kl < 0.5 * self.target:
            self.beta /= self.factor
        self.beta = min(max(self.beta, self.beta_min), self.beta_max)
        return self.beta
