"""Built-in reference updates: a frozen reference (the default), a periodic sync or reset, an EMA.

With a fixed beta and the policy converged to the optimum of each reference before it moves, the
reference after k syncs or resets is pi_k ∝ pi_0 exp(k r / beta), and an EMA reference after n
updates of weight alpha is, to first order in the parameters, pi_0 exp(n alpha r / beta)
(rlhf_lightning/exact/closed_form.py: ``iterated_optimal_logprobs``, ``ema_reference_logprobs``).
"""

from __future__ import annotations

from rlhf_lightning.interfaces import ReferenceUpdate, require_number
from rlhf_lightning.registry import register


@register("reference_update", "none", description="the reference stays the starting policy (the default)")
class NoUpdate(ReferenceUpdate):
    """The classic frozen reference: KL(pi || pi_0) throughout."""

    moves = False

    def weight(self, iteration: int) -> float:
        return 0.0


@register("reference_update", "sync", description="the reference becomes the policy every N iterations (TR-DPO hard update)")
class Sync(ReferenceUpdate):
    """ref <- policy after every ``every_n_iterations``-th iteration (Gorbatovski et al. 2024,
    "Learn Your Reference Model for Real Good Alignment", TR-DPO's hard update)."""

    def weight(self, iteration: int) -> float:
        return 1.0 if iteration % self.every_n_iterations == 0 else 0.0


@register("reference_update", "reset", description="sync plus a fresh optimizer state every N iterations (ProRL)")
class Reset(Sync):
    """ref <- policy and the policy's optimizer state cleared, after every ``every_n_iterations``-th
    iteration (Liu et al. 2025, "ProRL: Prolonged Reinforcement Learning", reference resets)."""

    reset_optimizer = True


@register("reference_update", "ema", description="ref <- (1 - alpha) ref + alpha policy every N iterations (TR-DPO soft update)")
class EMA(ReferenceUpdate):
    """Polyak averaging of the reference toward the policy, ref <- (1 - alpha) ref + alpha policy,
    after every ``every_n_iterations``-th iteration (TR-DPO's soft update). Its only fixed points are
    policies on the reward's maximisers: a fixed point needs ref = pi = ref exp(r / beta) / Z."""

    def __init__(self, alpha: float = 0.1, every_n_iterations: int = 1) -> None:
        super().__init__(every_n_iterations)
        require_number("reference_update.alpha", alpha, above=0, at_most=1)
        self.alpha = float(alpha)

    def weight(self, iteration: int) -> float:
        return self.alpha if iteration % self.every_n_iterations == 0 else 0.0
