"""rlhf-lightning: PPO-RLHF with a KL penalty as a clean, hackable PyTorch Lightning program."""

from rlhf_lightning.interfaces import (
    AdvantageEstimator,
    BetaController,
    Divergence,
    KLEstimator,
    LossAggregation,
    PolicyLoss,
    ReferenceUpdate,
    RewardModel,
    RolloutEngine,
)
from rlhf_lightning.registry import load_plugins, register, register_kind

__all__ = [
    "AdvantageEstimator",
    "BetaController",
    "Divergence",
    "KLEstimator",
    "LossAggregation",
    "PolicyLoss",
    "ReferenceUpdate",
    "RewardModel",
    "RolloutEngine",
    "load_plugins",
    "register",
    "register_kind",
]
__version__ = "0.3.0"
