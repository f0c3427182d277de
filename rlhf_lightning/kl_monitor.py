"""KL monitoring callbacks: guard the run against KL drift and jumps, and show where the KL sits.

The KL to the reference is the one number that says how far the policy has moved from the
model we trust. Watching it over time tracks behavioural drift; a sudden jump is the signature
of an anomalous optimisation step (a reward-hacking exploit found, a bad batch, a loss blow-up);
a hard budget enforces an update constraint the way a trust region would, after the fact.

- :class:`KLGuard` watches ``objective/kl`` and ``objective/kl_max`` after every iteration,
  warns on spikes over a running level, and enforces a KL budget by warning, stopping the run,
  or rolling back to the last good state.
- :class:`TokenKLView` draws a few responses with every token shaded by its KL contribution,
  and a histogram of the per-token KL, to TensorBoard.

Both run on every rank and read only global (all-rank) metrics, so every rank takes the same
decision; only rank 0 writes to TensorBoard.
"""

from __future__ import annotations

import copy
import statistics
import warnings
from collections import deque
from typing import Any, Literal, Optional

import numpy as np
import torch
from lightning import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from rlhf_lightning.interfaces import require

WATCHED = ("objective/kl", "objective/kl_max")


def _tensorboards(trainer) -> list[TensorBoardLogger]:
    return [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]


class RunningLevel:
    """The typical recent value of a metric: an exponential moving average
    ``level <- decay * level + (1 - decay) * x`` started at the first value, or the median of
    the last ``window`` values (robust to the spikes it is compared with)."""

    def __init__(self, kind: Literal["ema", "median"], decay: float, window: int) -> None:
        self.kind, self.decay = kind, decay
        self.n = 0  # values seen
        self.ema = 0.0
        self.recent: deque[float] = deque(maxlen=window)

    @property
    def value(self) -> float:
        return self.ema if self.kind == "ema" else statistics.median(self.recent)

    def update(self, x: float) -> None:
        self.ema = x if self.n == 0 else self.decay * self.ema + (1 - self.decay) * x
        self.recent.append(x)
        self.n += 1

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "ema": self.ema, "recent": list(self.recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n, self.ema = state["n"], state["ema"]
        self.recent = deque(state["recent"], maxlen=self.recent.maxlen)


class KLGuard(Callback):
    """Watches the KL to the reference after every PPO iteration; warns on spikes and enforces a budget.

    After each training batch it reads ``objective/kl`` (mean over responses of the summed
    per-token KL) and ``objective/kl_max`` (the largest response's) from the iteration's ``outputs``.

    * **Spike**: a watched value ``x > spike_factor * max(level, min_level)``, where ``level`` is
      the metric's running level over the previous iterations (see :class:`RunningLevel`), checked
      once ``warmup`` values are in it. ``min_level`` keeps the first iterations, where the KL
      grows from exactly 0, from counting as spikes. Spikes only warn.
    * **Violation**: ``objective/kl > max_kl`` or ``objective/kl_max > max_kl_max``. Then
      ``action`` is ``warn``; ``stop`` (``trainer.should_stop``: the run ends after this
      iteration, with the cause in the warning); or ``rollback``: weights, optimizer states and
      the beta controller go back to the last good snapshot and training continues with the
      next batch. More than ``max_consecutive_rollbacks`` rollbacks without a good iteration
      between them stop the run: the restored policy keeps breaking the budget.

    Rollback keeps in-memory snapshots (CPU copies) rather than loading the last checkpoint
    file: it needs no checkpoint callback, the snapshot is never older than ``snapshot_every``
    good iterations, and a checkpoint written after a violating iteration can never be the
    target. A snapshot is taken at the start of training (the starting or resumed state) and
    after every ``snapshot_every``-th iteration that had neither a spike nor a violation.
    It holds the module's trainable tensors (frozen ones, the reference and a LoRA base,
    cannot change and are not copied), every optimizer's state, and ``beta_controller.state_dict()``.
    Not rolled back: the iteration counter (so the next rollout draws fresh samples and
    checkpoints keep counting), the data order, and the reward backend's running statistics.
    Costs, with rollback only: one CPU copy of the trainable weights and optimizer state.

    Events count as metrics ``system/kl_guard/spikes``, ``system/kl_guard/violations`` and
    ``system/kl_guard/rollbacks`` (cumulative, logged every iteration), are warned with
    ``rank_zero_warn`` and, with a TensorBoardLogger, written as text under ``kl_guard``. Values of a rolled-back iteration do
    not enter the running levels. Counters and levels are saved with checkpoints; snapshots are not.

    Args:
        max_kl: budget on ``objective/kl`` (nats per response); None for none.
        max_kl_max: budget on ``objective/kl_max``; None for none.
        action: what a violation does: ``warn``, ``stop`` or ``rollback``.
        spike_factor: a spike is a value above this many times the running level (> 1); None disables.
        level: running level kind: ``ema`` or ``median``.
        ema_decay: EMA decay in [0, 1).
        window: values in the median.
        warmup: values in the running level before spikes are checked.
        min_level: floor of the running level in spike checks, in the metrics' unit (>= 0).
        snapshot_every: good iterations between rollback snapshots.
        max_consecutive_rollbacks: rollbacks in a row before the run stops instead.
    """

    def __init__(
        self,
        max_kl: Optional[float] = None,
        max_kl_max: Optional[float] = None,
        action: Literal["warn", "stop", "rollback"] = "warn",
        spike_factor: Optional[float] = 3.0,
        level: Literal["ema", "median"] = "ema",
        ema_decay: float = 0.9,
        window: int = 10,
        warmup: int = 3,
        min_level: float = 1.0,
        snapshot_every: int = 1,
        max_consecutive_rollbacks: int = 3,
    ) -> None:
        args = dict(locals())  # the settings by name, for the messages

        def check(ok: bool, field: str, requirement: str) -> None:
            require(ok, f"KLGuard.{field}", requirement, args[field])

        check(max_kl is None or max_kl > 0, "max_kl", "> 0 or None")
        check(max_kl_max is None or max_kl_max > 0, "max_kl_max", "> 0 or None")
        check(action in ("warn", "stop", "rollback"), "action", "one of warn, stop, rollback")
        has_budget = max_kl is not None or max_kl_max is not None
        check(action == "warn" or has_budget, "action", "'warn' when neither max_kl nor max_kl_max is set")
        check(spike_factor is None or spike_factor > 1, "spike_factor", "> 1 or None")
        check(level in ("ema", "median"), "level", "'ema' or 'median'")
        check(0 <= ema_decay < 1, "ema_decay", "in [0, 1)")
        check(min_level >= 0, "min_level", ">= 0")
        for field in ("window", "warmup", "snapshot_every", "max_consecutive_rollbacks"):
            check(isinstance(args[field], int) and args[field] >= 1, field, "an integer >= 1")
        self.budgets = {"objective/kl": max_kl, "objective/kl_max": max_kl_max}
        self.action = action
        self.spike_factor, self.warmup, self.min_level = spike_factor, warmup, min_level
        self.snapshot_every, self.max_consecutive_rollbacks = snapshot_every, max_consecutive_rollbacks
        self.levels = {name: RunningLevel(level, ema_decay, window) for name in WATCHED}
        self.counts = {"spikes": 0, "violations": 0, "rollbacks": 0}
        self.consecutive_rollbacks = 0
        self.good_iterations = 0
        self.snapshot: Optional[dict[str, Any]] = None
        self.stop_reason: Optional[str] = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(budgets=self.budgets, action=self.action, spike_factor=self.spike_factor)

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module) -> None:
        if self.action == "rollback":
            self.snapshot = self.take_snapshot(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.snapshot = None  # a full copy of the trainable state; free it

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = outputs.get("metrics") or {}  # empty when the module skipped the iteration for a fault
        values = {name: float(metrics[name]) for name in WATCHED if name in metrics}
        if not values:
            return
        iteration = pl_module.step  # the iteration's TensorBoard step, as its scalars
        spikes = self.spikes(values)
        if spikes:
            self.counts["spikes"] += 1
            self._report(trainer, iteration, f"KL spike at iteration {iteration}: " + "; ".join(spikes))
        violations = [
            f"{name} = {values[name]:.4g} > {'max_kl' if name == 'objective/kl' else 'max_kl_max'} = {limit:g}"
            for name, limit in self.budgets.items()
            if limit is not None and values.get(name, -np.inf) > limit
        ]
        rolled_back = False
        if violations:
            self.counts["violations"] += 1
            rolled_back = self._enforce(trainer, pl_module, iteration, "; ".join(violations))
        else:
            self.consecutive_rollbacks = 0
        if not rolled_back:
            for name, value in values.items():
                self.levels[name].update(value)
        if not spikes and not violations:
            self.good_iterations += 1
            if self.action == "rollback" and self.good_iterations % self.snapshot_every == 0:
                self.snapshot = self.take_snapshot(trainer, pl_module)
        pl_module.log_dict({f"system/kl_guard/{k}": float(v) for k, v in self.counts.items()}, on_step=True, on_epoch=False)

    # ------------------------------------------------------------------ decisions
    def spikes(self, values: dict[str, float]) -> list[str]:
        """Descriptions of the watched values that spike over their running level."""
        if self.spike_factor is None:
            return []
        out = []
        for name, value in values.items():
            level = self.levels[name]
            if level.n >= self.warmup:
                threshold = self.spike_factor * max(level.value, self.min_level)
                if value > threshold:
                    floor = f" (floored at min_level {self.min_level:g})" if level.value < self.min_level else ""
                    out.append(f"{name} = {value:.4g} > {self.spike_factor:g} x running level {level.value:.4g}{floor}")
        return out

    def _enforce(self, trainer, pl_module, iteration: int, cause: str) -> bool:
        """Apply ``action`` to a budget violation; True if the state was rolled back."""
        message = f"KL budget exceeded at iteration {iteration}: {cause}"
        if self.action == "warn":
            self._report(trainer, iteration, message)
            return False
        if self.action == "rollback" and self.consecutive_rollbacks < self.max_consecutive_rollbacks:
            self.restore_snapshot(trainer, pl_module, self.snapshot)
            self.counts["rollbacks"] += 1
            self.consecutive_rollbacks += 1
            self._report(trainer, iteration, f"{message}; rolled back to the state after iteration {self.snapshot['iteration']}")
            return True
        if self.action == "rollback":
            message += f"; {self.consecutive_rollbacks} rollbacks in a row did not help (max_consecutive_rollbacks)"
        self.stop_reason = f"{message}; stopping the run"
        trainer.should_stop = True
        self._report(trainer, iteration, self.stop_reason)
        return False

    def _report(self, trainer, iteration: int, message: str) -> None:
        rank_zero_warn(f"KLGuard: {message}")
        if trainer.is_global_zero:
            for logger in _tensorboards(trainer):
                logger.experiment.add_text("kl_guard", message, global_step=iteration)

    # ------------------------------------------------------------------ snapshots
    @staticmethod
    def take_snapshot(trainer, pl_module) -> dict[str, Any]:
        """CPU copies of what a rollback restores: trainable module tensors, optimizer and beta state."""
        cpu_copy = lambda obj: apply_to_collection(obj, Tensor, lambda t: t.detach().to("cpu", copy=True))
        # Frozen parameters cannot change, and tied weights share storage: copy each storage once.
        seen = {p.data_ptr() for p in pl_module.parameters() if not p.requires_grad}
        weights = {}
        for name, tensor in pl_module.state_dict().items():
            if tensor.numel() and tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            weights[name] = tensor.detach().to("cpu", copy=True)
        controller = getattr(pl_module, "beta_controller", None)
        return {
            "iteration": pl_module.step,
            "state_dict": weights,
            "optimizers": [cpu_copy(opt.state_dict()) for opt in trainer.optimizers],
            "beta_controller": copy.deepcopy(controller.state_dict()) if controller is not None else None,
        }

    @staticmethod
    def restore_snapshot(trainer, pl_module, snapshot: dict[str, Any]) -> None:
        """Copy a snapshot back in place (parameters keep their identity, so optimizers stay valid)."""
        result = pl_module.load_state_dict(snapshot["state_dict"], strict=False)
        assert not result.unexpected_keys, result.unexpected_keys
        for opt, state in zip(trainer.optimizers, snapshot["optimizers"], strict=True):
            opt.load_state_dict(state)  # moves the state to each parameter's device
        if snapshot["beta_controller"] is not None:
            pl_module.beta_controller.load_state_dict(copy.deepcopy(snapshot["beta_controller"]))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "levels": {name: level.state_dict() for name, level in self.levels.items()},
            "consecutive_rollbacks": self.consecutive_rollbacks,
            "good_iterations": self.good_iterations,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counts = dict(state_dict["counts"])
        for name, level_state in state_dict["levels"].items():
            self.levels[name].load_state_dict(level_state)
        self.consecutive_rollbacks = state_dict["consecutive_rollbacks"]
        self.good_iterations = state_dict["good_iterations"]


class TokenKLView(Callback):
    """Every ``every_n_iterations`` PPO iterations, writes to TensorBoard:

    * ``{tag}/responses`` (Images): ``num_samples`` responses of the batch, each token a box
      shaded by its KL estimate kl_t (blue below 0, white at 0, red above; the same scale for
      all tokens drawn), decoded one token at a time with the module's tokenizer; a header
      per response gives its summed KL and the start of its prompt. ``order: max_kl`` draws the
      responses with the largest summed KL (the outliers ``objective/kl_max`` reports),
      ``first`` the first ones of the batch.
    * ``{tag}/per_token`` (Histograms): kl_t of every response token of the batch (rank 0's share).

    Reads the rollout and its per-token KL (batch, response_len) from the iteration's ``outputs``
    (what ``training_step`` returns); an iteration skipped for a fault draws nothing. Iterations 1,
    1 + n, 1 + 2n, ... are drawn, like the module's sample table.

    Args:
        every_n_iterations: drawing period in PPO iterations.
        num_samples: responses per image.
        max_tokens: tokens drawn per response (the rest is cut, and the header says so).
        order: which responses: ``max_kl`` or ``first``.
        line_chars: characters per line of the image.
        tag: TensorBoard tag prefix.
    """

    def __init__(
        self,
        every_n_iterations: int = 10,
        num_samples: int = 4,
        max_tokens: int = 96,
        order: Literal["max_kl", "first"] = "max_kl",
        line_chars: int = 100,
        tag: str = "kl_tokens",
    ) -> None:
        counts = dict(every_n_iterations=every_n_iterations, num_samples=num_samples, max_tokens=max_tokens, line_chars=line_chars)
        for field, value in counts.items():
            require(isinstance(value, int) and value >= 1, f"TokenKLView.{field}", "an integer >= 1", value)
        require(order in ("max_kl", "first"), "TokenKLView.order", "'max_kl' or 'first'", order)
        self.every_n_iterations, self.num_samples, self.max_tokens = every_n_iterations, num_samples, max_tokens
        self.order, self.line_chars, self.tag = order, line_chars, tag

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit" and not _tensorboards(trainer):
            rank_zero_warn("TokenKLView writes to TensorBoard, but the trainer has no TensorBoardLogger; it draws nothing")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.step % self.every_n_iterations or not trainer.is_global_zero:
            return
        loggers = _tensorboards(trainer)
        if not loggers or outputs.get("skipped", True):
            return
        rollout, kl = outputs["rollout"], outputs["kl"]
        kl, mask = kl.detach().float().cpu(), rollout.response_mask.bool().cpu()
        image = self.draw(pl_module.tokenizer, rollout, kl, mask)
        values = kl[mask]
        values = values[torch.isfinite(values)]
        for logger in loggers:
            logger.experiment.add_image(f"{self.tag}/responses", image, global_step=pl_module.step, dataformats="HWC")
            if values.numel():
                logger.experiment.add_histogram(f"{self.tag}/per_token", values, global_step=pl_module.step)

    def draw(self, tokenizer, rollout, kl: Tensor, mask: Tensor) -> np.ndarray:
        """The image (height, width, 3) uint8 of the chosen responses."""
        seq_kl = (kl * mask).sum(-1)
        rows = seq_kl.argsort(descending=True) if self.order == "max_kl" else torch.arange(len(seq_kl))
        samples = []
        for i in rows[: self.num_samples].tolist():
            ids = rollout.responses[i].cpu()[mask[i]]
            texts = tokenizer.batch_decode(ids[: self.max_tokens].view(-1, 1))
            cut = f", first {self.max_tokens} of {len(ids)} tokens" if len(ids) > self.max_tokens else f", {len(ids)} tokens"
            header = f"#{i}  KL {seq_kl[i]:.3g} nats{cut}  |  prompt: {rollout.prompts[i][:80]!r}"
            samples.append((header, texts, kl[i][mask[i]][: self.max_tokens].tolist()))
        return token_kl_image(samples, self.line_chars)


def token_kl_image(samples: list[tuple[str, list[str], list[float]]], line_chars: int = 100, fontsize: float = 9.0) -> np.ndarray:
    """Render ``(header, token_texts, token_kls)`` samples as token boxes shaded by KL; (H, W, 3) uint8.

    Monospace text on a character grid: a token of n characters is a box n cells wide, wrapped
    at ``line_chars`` cells. The colour scale is symmetric around 0 (k1 per-token estimates can
    be negative) and shared by every token drawn. Uses the Agg canvas directly, never pyplot.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    # Lay out first: (column, line) of every header and token box.
    items, line = [], 0  # (kind, column, line, text, kl)
    for header, texts, kls in samples:
        items.append(("header", 0, line, header[:line_chars], 0.0))
        line, column = line + 1, 0
        for text, value in zip(texts, kls, strict=True):
            text = (text.replace("\n", "\\n").replace("\t", "\\t") or "''")[:line_chars]
            if column + len(text) > line_chars:
                line, column = line + 1, 0
            items.append(("token", column, line, text, value))
            column += len(text)
        line += 2
    n_lines = max(line - 1, 1)

    all_kl = [abs(v) for kind, *_, v in items if kind == "token" and np.isfinite(v)]
    scale = max(all_kl, default=0.0) or 1.0
    cmap, norm = colormaps["RdBu_r"], Normalize(-scale, scale)
    cell_w, cell_h = 0.62 * fontsize / 72, 1.7 * fontsize / 72  # inches per character cell and line
    bar_h, margin = 0.75, 0.15  # colour bar with its ticks and label below the text
    width, height = line_chars * cell_w + 2 * margin, n_lines * cell_h + bar_h + 2 * margin
    fig = Figure(figsize=(width, height), dpi=150)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_axes((margin / width, (bar_h + margin) / height, line_chars * cell_w / width, n_lines * cell_h / height))
    ax.set_xlim(0, line_chars)
    ax.set_ylim(n_lines, 0)
    ax.axis("off")
    text_style = dict(va="center", ha="left", fontsize=fontsize, family="monospace", parse_math=False)
    for kind, column, row, text, value in items:
        if kind == "header":
            ax.text(0, row + 0.5, text, color="0.3", **text_style)
            continue
        color = cmap(norm(value)) if np.isfinite(value) else (0.6, 0.6, 0.6, 1.0)
        ax.add_patch(Rectangle((column, row + 0.08), len(text), 0.84, facecolor=color, edgecolor="0.85", linewidth=0.4))
        dark = np.isfinite(value) and abs(norm(value) - 0.5) > 0.35
        ax.text(column, row + 0.5, text, color="white" if dark else "black", **text_style)
    cax = fig.add_axes((0.25, (margin + 0.4) / height, 0.5, 0.12 / height))
    fig.colorbar(ScalarMappable(norm, cmap), cax=cax, orientation="horizontal", label="per-token KL estimate (nats)")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing")  # tokens outside the font's range
        canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
