"""rlhf-lightning: PPO-RLHF with a KL penalty as a clean, hackable PyTorch Lightning program.

The names below load on first use (PEP 562), so ``import rlhf_lightning.cli`` does not load torch:
``rlhf-lightning --help`` answers at once and the command imports torch after its first line."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'rlhf_lightning' has no attribute {name!r}")
    home = "rlhf_lightning.registry" if name[0].islower() else "rlhf_lightning.interfaces"
    return getattr(importlib.import_module(home), name)
