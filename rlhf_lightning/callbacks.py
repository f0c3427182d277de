"""Callbacks that ship with rlhf-lightning."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

from lightning import Callback


class ExportPolicy(Callback):
    """At the end of fit, write the trained policy with ``save_pretrained`` (LoRA merged into the
    weights) plus its tokenizer, so ``transformers.AutoModelForCausalLM.from_pretrained`` loads it.

    Args:
        dirpath: output folder; default ``<log dir>/policy``.
    """

    def __init__(self, dirpath: Optional[str] = None) -> None:
        self.dirpath = dirpath

    def on_fit_end(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0:
            return
        target = Path(self.dirpath or Path(trainer.log_dir or trainer.default_root_dir) / "policy")
        export_policy(pl_module, target)
        print(f"exported the trained policy to {target}")


def export_policy(module, target: Path) -> Path:
    """Save ``module.policy`` (merging a LoRA adapter into a copy) and its tokenizer to ``target``."""
    policy = module.policy
    if hasattr(policy, "merge_and_unload"):
        policy = copy.deepcopy(policy).merge_and_unload()
    policy.save_pretrained(target)
    module.tokenizer.save_pretrained(target)
    return target
