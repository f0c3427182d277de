"""Callbacks that ship with rlhf-lightning."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Optional

import torch
from lightning import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from rlhf_lightning.fsdp2 import full_state_dict, is_sharded


class ExportPolicy(Callback):
    """At the end of fit, write the trained policy with ``save_pretrained`` (LoRA merged into the
    weights) plus its tokenizer, so ``transformers.AutoModelForCausalLM.from_pretrained`` loads it.

    Args:
        dirpath: output folder; default ``<log dir>/policy``.
    """

    def __init__(self, dirpath: Optional[str] = None) -> None:
        self.dirpath = dirpath

    def on_fit_end(self, trainer, pl_module) -> None:
        target = Path(self.dirpath or Path(trainer.log_dir or trainer.default_root_dir) / "policy")
        if export_policy(pl_module, target) is not None:
            print(f"exported the trained policy to {target}")


def export_policy(module, target: Path) -> Optional[Path]:
    """Save ``module.policy`` (merging a LoRA adapter into a copy) and its tokenizer to ``target``
    from global rank 0; returns None on the other ranks. Call it on every rank: a sharded (FSDP2)
    policy is first gathered into full weights on CPU, which are loaded into an unsharded copy
    built from the config."""
    policy = module.policy
    if is_sharded(policy):
        state = full_state_dict(policy)  # a collective: every rank takes part
        if module.global_rank != 0:
            return None
        with torch.random.fork_rng():  # building draws random initial weights that are then replaced
            policy = module._load_policy()
            if module.hparams.lora_rank:
                policy = module._add_lora(policy)
        policy.load_state_dict(state)
    elif module.global_rank != 0:
        return None
    elif hasattr(policy, "merge_and_unload"):
        policy = copy.deepcopy(policy)
    if hasattr(policy, "merge_and_unload"):
        policy = policy.merge_and_unload()
    policy.save_pretrained(target)
    module.tokenizer.save_pretrained(target)
    return target


class IterationCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that saves every ``every_n_iterations`` PPO iterations (plus ``last.ckpt``).

    Lightning's ``every_n_train_steps`` counts optimizer steps, of which one PPO iteration takes
    ``ppo_epochs * num_minibatches`` per optimizer; this counts iterations (training batches).
    Writes are atomic (Lightning saves through a temporary file that is renamed into place), so
    a kill during a save leaves the previous checkpoint loadable.
    """

    def __init__(self, every_n_iterations: int = 10, save_last: bool = True, save_top_k: int = 1, **kwargs) -> None:
        if every_n_iterations < 1:
            raise ValueError(f"every_n_iterations must be >= 1, got {every_n_iterations!r}")
        super().__init__(save_last=save_last, save_top_k=save_top_k, every_n_train_steps=0, **kwargs)
        self.every_n_iterations = every_n_iterations

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.iteration % self.every_n_iterations or self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)


class IterationTimer(Callback):
    """Logs ``timing/iteration_s``: wall-clock seconds of each PPO iteration (training batch),
    from the end of the previous one (the first: from its own start), so everything a user waits
    for between two iterations counts, logging and callbacks included. The module's ``timing/*``
    phases add up to a little less. ``tools/compare_trl.py`` reads it."""

    def __init__(self) -> None:
        self._since: Optional[float] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._since is None:
            self._since = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        for logger in trainer.loggers:
            logger.log_metrics({"timing/iteration_s": now - self._since}, step=pl_module.iteration)
        self._since = now
