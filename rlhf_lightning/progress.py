"""The command's progress bar: Lightning's Rich bar as a PPO run wants it (:class:`IterationProgressBar`)."""

from __future__ import annotations

import math
import threading
from datetime import timedelta
from typing import Optional

from lightning.pytorch.callbacks import RichProgressBar
from rich.progress import ProgressColumn
from rich.text import Text


class IterationProgressBar(RichProgressBar):
    """Lightning's Rich progress bar as a PPO run wants it: iterations done of the epoch's, the time so
    far and left and the rate from the mean iteration since the epoch began (Lightning's, from the last
    30 s, shows none while iterations take longer), ``s/it`` below one iteration a second, and the
    module's ``reward``, ``kl`` and ``beta`` without Lightning's ``v_num``. Redrawn every second, so the
    clock moves while an iteration runs (Lightning's redraws only when a batch ends)."""

    def __init__(self) -> None:
        super().__init__()
        self._ticking: Optional[threading.Event] = None

    def configure_columns(self, trainer) -> list:
        from lightning.pytorch.callbacks.progress.rich_progress import CustomTimeColumn, ProcessingSpeedColumn

        columns = super().configure_columns(trainer)
        return [
            _TimeColumn(self.theme.time)
            if isinstance(c, CustomTimeColumn)
            else _RateColumn(self.theme.processing_speed)
            if isinstance(c, ProcessingSpeedColumn)
            else c
            for c in columns
        ]

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.progress is not None and self.train_progress_bar_id is not None:  # the pace carries over, not the clock
            self.progress.update(self.train_progress_bar_id, ended_at=0.0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._note_pace(self.train_progress_bar_id)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx: int = 0) -> None:
        super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        self._note_pace(self.val_progress_bar_id)

    def _note_pace(self, task_id) -> None:
        """Record on the task, as a batch ends, the mean seconds per batch so far and when it ended."""
        if self.progress is None or task_id is None:
            return
        task = self.progress.tasks[task_id]
        if task.completed and task.elapsed:
            self.progress.update(task_id, per_iteration=task.elapsed / task.completed, ended_at=task.elapsed)

    def _init_progress(self, trainer) -> None:
        super()._init_progress(trainer)
        if self.progress is not None and self._ticking is None:
            self._ticking = threading.Event()
            threading.Thread(target=self._tick, args=(self._ticking,), daemon=True, name="progress-bar-clock").start()

    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            progress = self.progress
            if progress is not None and not self._progress_stopped:
                progress.soft_refresh()  # Lightning's refresh thread redraws at its next turn

    def teardown(self, trainer, pl_module, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        if self._ticking is not None:
            self._ticking.set()
            self._ticking = None


class _TimeColumn(ProgressColumn):
    """``elapsed • left``: the batches to go at the mean pace so far (``per_iteration``), counting down from
    the last batch's end (``ended_at``) to no less than the batches after the running one."""

    max_refresh = 0.5

    def __init__(self, style) -> None:
        super().__init__()
        self.style = style

    def render(self, task) -> Text:
        elapsed = (task.finished_time if task.finished else task.elapsed) or 0.0
        each, to_go = task.fields.get("per_iteration"), (task.total or math.inf) - task.completed
        left = "-:--:--"
        if each is not None and math.isfinite(to_go):
            since = max(0.0, elapsed - task.fields.get("ended_at", elapsed))
            left = str(timedelta(seconds=round(max(each * (to_go - 1), each * to_go - since, 0.0))))
        return Text(f"{timedelta(seconds=int(elapsed))} • {left}", style=self.style)


class _RateColumn(ProgressColumn):
    """The mean pace so far: iterations per second, or seconds per iteration when slower than one a second."""

    def __init__(self, style) -> None:
        super().__init__()
        self.style = style

    def render(self, task) -> Text:
        each = task.fields.get("per_iteration")
        rate = "-- it/s" if each is None else f"{each:.1f}s/it" if each > 1 else f"{1 / each:.2f}it/s"
        return Text(rate, style=self.style)
