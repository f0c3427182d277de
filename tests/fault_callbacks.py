"""Callbacks that simulate faults in subprocess runs (imported by class_path from the tests)."""

import itertools
import os
import signal
from typing import Optional

from lightning.pytorch.callbacks import Callback


class RecordBeta(Callback):
    """Append ``rank iteration beta`` lines to a file after every iteration (every rank)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_rank} {pl_module.iteration} {pl_module.beta_controller.beta!r}\n")


class RecordPromptBetas(Callback):
    """Append ``[rank, iteration, {prompt id: beta}]`` JSON lines (every rank): a per-prompt controller's table
    when training starts (after a resume: as loaded) and after every iteration."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        self._write(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._write(trainer, pl_module)

    def _write(self, trainer, pl_module) -> None:
        import json

        with open(self.path, "a") as f:
            f.write(json.dumps([trainer.global_rank, pl_module.iteration, pl_module.beta_controller.betas]) + "\n")


class RecordMetrics(Callback):
    """Append one JSON line per iteration on every rank: ``[rank, iteration, {metric: value}]``,
    every scalar the module logged (what each rank holds after the strategy's reduce)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import json

        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps([trainer.global_rank, pl_module.iteration, metrics]) + "\n")


class RecordGroups(Callback):
    """Append ``rank iteration rows groups`` after every iteration: this rank's rollout size and how
    many runs of identical consecutive prompts it holds (one per prompt when groups stay together)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        prompts = outputs["rollout"].prompts
        runs = 1 + sum(a != b for a, b in itertools.pairwise(prompts))
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_rank} {pl_module.iteration} {len(prompts)} {runs}\n")


class RecordReference(Callback):
    """Append ``rank iteration sha1`` after every iteration: a hash of the reference's parameters'
    bytes (bit-identical on every rank, or the hashes differ)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import hashlib

        reference, _ = pl_module.networks.reference_parameters()
        digest = hashlib.sha1(b"".join(p.detach().cpu().numpy().tobytes() for p in reference)).hexdigest()
        with open(self.path, "a") as f:
            f.write(f"{trainer.global_rank} {pl_module.iteration} {digest}\n")


class RecordPrompts(Callback):
    """Append one JSON line per iteration: ``[iteration, prompts of this batch]``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import json

        with open(self.path, "a") as f:
            f.write(json.dumps([pl_module.iteration + 1, list(batch)]) + "\n")


class SignalMidIteration(Callback):
    """Send ``signal`` (a name: SIGTERM, SIGINT, SIGKILL) to this process once, at the first
    optimizer step of the ``iteration``-th PPO iteration (counted from 1), in the middle of its
    update, as a scheduler, Ctrl+C or a kill would."""

    def __init__(self, iteration: int, signal: str = "SIGTERM") -> None:
        self.iteration, self.signal, self.sent = iteration, signal, False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if pl_module.iteration == self.iteration - 1 and not self.sent:  # pl_module.iteration: iterations done
            self.sent = True
            os.kill(os.getpid(), getattr(signal, self.signal))


class KillMidIteration(SignalMidIteration):
    """SIGKILL in the middle of the update after ``iteration`` completed iterations (the
    ``iteration + 1``-th): after its rollout and scoring, at its first optimizer step; only on
    global rank ``rank`` when given (the other ranks are left to notice)."""

    def __init__(self, iteration: int, rank: Optional[int] = None) -> None:
        super().__init__(iteration + 1, "SIGKILL")
        self.rank = rank

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.rank is None or trainer.global_rank == self.rank:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)


class RecordRollouts(Callback):
    """Append ``{"rank", "iteration", "prompts", "responses", "synced_step"}`` JSON lines after every
    iteration (every rank): the rollout's prompts and response texts, and the step a rollout engine's
    own weights are from (None for an engine without a copy)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import json

        rollout = outputs["rollout"]
        line = {
            "rank": trainer.global_rank,
            "iteration": pl_module.iteration,
            "prompts": list(rollout.prompts),
            "responses": list(rollout.response_texts),
            "synced_step": getattr(pl_module.rollout_engine, "synced_step", None),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


class SaveAtIteration(Callback):
    """``trainer.save_checkpoint(path)`` after iteration ``iteration`` (every rank: a collective under FSDP2)."""

    def __init__(self, path: str, iteration: int) -> None:
        self.path, self.iteration = path, iteration

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.iteration == self.iteration:
            trainer.save_checkpoint(self.path)


class RecordDeviceMemory(Callback):
    """Append the GPU memory in use (GiB: total - free, ``torch.cuda.mem_get_info``, which counts
    vLLM's allocations too) before every optimizer step: in the update, while a sleeping engine
    has given its memory back."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        import torch

        free, total = torch.cuda.mem_get_info()
        with open(self.path, "a") as f:
            f.write(f"{(total - free) / 2**30:.4f}\n")
