"""Helpers for tests: tiny randomly initialised modules and short CPU fits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from lightning import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback

from rlhf_lightning.data import PromptDataModule
from rlhf_lightning.module import PPORLHF
from rlhf_lightning_plugins.rewards.function import CallableReward

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def cli(cwd: Path, *args: str, timeout: float = 600, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """``rlhf-lightning <args>`` as a user runs it, in ``cwd``, with the tests folder importable
    (for test reward functions and callbacks named in the arguments), ``env`` added to the environment."""
    Path(cwd).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-m", "rlhf_lightning.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)  # fmt: skip


def char_reward(chars: str = "e") -> CallableReward:
    return CallableReward(function="rlhf_lightning_plugins.rewards.toy:char_count", kwargs={"chars": chars})


def make_module(**overrides) -> PPORLHF:
    """A configured PPORLHF on the tiny model with the char-count reward. Seeded first: the module
    draws its sampling seed from torch's at construction, which would otherwise be whatever the
    previous test left."""
    kwargs = dict(policy="tiny", reward_model=char_reward(), max_new_tokens=12, ppo_epochs=2, lr=3e-3, critic_lr=3e-3)
    kwargs.update(overrides)
    seed_everything(0, verbose=False)
    module = PPORLHF(**kwargs)
    module.configure_model()
    return module


class MetricsHistory(Callback):
    """Records the logged metrics after every training batch, and what ``training_step`` returned."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.outputs: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        self.outputs.append(outputs)

    def series(self, key: str) -> list[float]:
        return [row[key] for row in self.rows]


def fit(
    module: PPORLHF, tmp_path, iterations: int, batch_size: int = 8, seed: int = 0, callbacks=(), datamodule=None,
    ckpt_path=None, **trainer_kwargs,
):  # fmt: skip
    """Run ``iterations`` PPO iterations on CPU; return (trainer, metrics history)."""
    seed_everything(seed, verbose=False)
    history = MetricsHistory()
    kwargs = dict(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=iterations, limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[history, *callbacks], default_root_dir=str(tmp_path), num_sanity_val_steps=0,
    )  # fmt: skip
    kwargs.update(trainer_kwargs)
    trainer = Trainer(**kwargs)
    trainer.fit(module, datamodule=datamodule or PromptDataModule(batch_size=batch_size), ckpt_path=ckpt_path)
    return trainer, history
