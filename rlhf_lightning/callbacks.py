"""Callbacks that ship with rlhf-lightning."""

from __future__ import annotations

import contextlib
import copy
import glob
import math
import os
import signal
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from fsspec.utils import get_protocol
from lightning import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from rlhf_lightning.fsdp2 import full_state_dict, is_sharded
from rlhf_lightning.interfaces import ConfigError, ConfigFileNotFoundError, require, require_number


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
    """Saves ``last.ckpt`` every ``every_n_iterations`` PPO iterations, and when the run is stopped
    by SIGTERM or Ctrl+C; otherwise a plain ModelCheckpoint (its end-of-epoch checkpoints, its
    folder, ``--ckpt_path last``), through Lightning's public API only (``trainer.save_checkpoint``).

    Lightning's ``every_n_train_steps`` counts optimizer steps, of which one PPO iteration takes
    ``ppo_epochs * num_minibatches`` per optimizer (and fewer when a step is skipped for a fault);
    this counts iterations (training batches). SIGTERM (what schedulers send before killing a job)
    and a first Ctrl+C let the current iteration finish, save ``last.ckpt`` and exit with status
    128 + the signal number (143, 130), so ``--ckpt_path last`` resumes exactly where the run
    stopped; a second Ctrl+C stops at once.
    """

    def __init__(self, every_n_iterations: int = 10, save_last: bool = True, save_top_k: int = 1, **kwargs) -> None:
        require_number("IterationCheckpoint.every_n_iterations", every_n_iterations, integer=True, at_least=1)
        super().__init__(save_last=save_last, save_top_k=save_top_k, every_n_train_steps=0, **kwargs)
        self.every_n_iterations = every_n_iterations
        self._stop_signal: Optional[int] = None
        self._previous_sigint: Any = None
        self._saved_at: Optional[int] = None  # the iteration last.ckpt was last written after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not pl_module.iteration % self.every_n_iterations and not trainer.fast_dev_run:
            self._save_last(trainer, pl_module)

    def _last_path(self) -> Path:
        return Path(self.dirpath) / (self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)  # dirpath: resolved by ModelCheckpoint.setup

    def _save_last(self, trainer, pl_module) -> Path:
        path = self._last_path()
        trainer.save_checkpoint(path)  # every rank takes part (sharded checkpoints); rank 0 writes a single file
        self._saved_at = pl_module.iteration
        return path

    def on_train_start(self, trainer, pl_module) -> None:
        # A first Ctrl+C takes SIGTERM's path (Lightning's own handling: the loop stops after the
        # current batch, its metrics logged, and raises SIGTERMException) instead of raising mid-update.
        self._stop_signal = None
        with contextlib.suppress(ValueError):  # not the main thread: leave SIGINT alone
            self._previous_sigint = signal.signal(signal.SIGINT, lambda signum, frame: self._on_sigint())

    def _on_sigint(self) -> None:
        if self._stop_signal == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl+C: stop now, without a checkpoint
        self._stop_signal = signal.SIGINT
        rank_zero_info("Ctrl+C: finishing this iteration, then saving last.ckpt (Ctrl+C again to stop at once)")
        os.kill(os.getpid(), signal.SIGTERM)

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_sigint()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_sigint()
        if not isinstance(exception, SIGTERMException):
            return
        signum, self._stop_signal = self._stop_signal or signal.SIGTERM, None
        path = self._save_last(trainer, pl_module) if self._saved_at != pl_module.iteration else self._last_path()
        rank_zero_info(f"stopped by {signal.Signals(signum).name} after iteration {pl_module.iteration}; saved {path}; "
                       "resume with --ckpt_path last")  # fmt: skip
        exception.code = 128 + signum  # the shell's convention for a process ended by a signal

    def _restore_sigint(self) -> None:
        if self._previous_sigint is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoint files that are never half written, and damaged ones named when read.

    Save: ``torch.save`` into a temporary file beside the target (same folder, so same file
    system), flushed and fsync'ed, then renamed onto the target name (``os.replace``, atomic)
    and the folder fsync'ed. A failure at any point, a full disk or a kill, leaves the previous
    checkpoint and no partial file. (Lightning's own write goes through a temporary file in the
    system's temp folder, which a move across file systems copies onto the target name, unsynced.)

    Load: a checkpoint is a zip archive with a CRC-32 per record, checked before ``torch.load``
    (which does not check them): a truncated, corrupt or missing file is a ConfigError naming it.
    Remote paths (``s3://``) and sharded checkpoint folders go through Lightning's own code.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or get_protocol(str(path)) != "file":
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = tempfile.NamedTemporaryFile("wb", prefix=f".{target.name}.", suffix=".partial", dir=target.parent, delete=False)
        try:
            with partial:
                torch.save(checkpoint, partial)
                partial.flush()
                os.fsync(partial.fileno())
            os.chmod(partial.name, 0o666 & ~_UMASK)  # the temporary file is private; a checkpoint is not
            os.replace(partial.name, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial.name)
            raise
        folder = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself survives a crash
        finally:
            os.close(folder)

    def load_checkpoint(self, path, map_location=lambda storage, loc: storage, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if get_protocol(str(path)) == "file":
            check_checkpoint_file(Path(path))
        try:
            return super().load_checkpoint(path, map_location, weights_only)
        except Exception as err:  # torch.load's advice (weights_only=False) would be wrong for a damaged file
            raise ConfigError(f"checkpoint {path} cannot be read: {str(err).splitlines()[0]}") from err


_UMASK = os.umask(0)
os.umask(_UMASK)


def check_checkpoint_file(path: Path) -> None:
    """ConfigError naming ``path`` unless it is a checkpoint folder (FSDP2) or a complete zip
    archive whose every record matches its CRC-32."""
    if not path.exists():
        raise ConfigFileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():
        return
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise ConfigError(f"checkpoint {path} is damaged or not a checkpoint (truncated? {err}); resume from an earlier one") from None
    if damaged is not None:
        raise ConfigError(f"checkpoint {path} is damaged: record {damaged!r} fails its CRC-32 check; resume from an earlier one")


def find_last_checkpoint(trainer) -> str:
    """Where ``--ckpt_path last`` resumes from: the newest ``last.ckpt`` among this run's
    checkpoint folders, all of a logger's ``version_*`` folders included (a resumed run logs to
    a new one, where Lightning alone would look and find nothing). None is a ConfigError that
    says where it looked, rather than Lightning's warning and a run from scratch."""
    patterns = []
    for callback in trainer.checkpoint_callbacks:
        name = callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION
        if callback.dirpath is not None:
            patterns.append(Path(callback.dirpath) / name)
        elif trainer.loggers:
            logger = trainer.loggers[0]
            patterns.append(Path(logger.save_dir or trainer.default_root_dir) / str(logger.name or "") / "*" / "checkpoints" / name)
        else:
            patterns.append(Path(trainer.default_root_dir) / "checkpoints" / name)
    found = [path for pattern in patterns for path in glob.glob(str(pattern))]
    if not found:
        looked = ", ".join(map(str, patterns)) or "nowhere: checkpointing is off (trainer.enable_checkpointing)"
        raise ConfigError(f"--ckpt_path last: no checkpoint to resume from; looked for {looked}")
    return max(found, key=os.path.getmtime)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", eq. 1): the chance that k of the n, drawn without
    replacement, hold at least one correct, 1 - C(n - c, k) / C(n, k)."""
    require(1 <= k <= n, "PassAtK.ks", f"integers in [1, n] (n = {n} samples)", k)
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class PassAtK(Callback):
    """Logs ``val/pass@k`` for each k in ``ks``: after each validation batch, max(ks) responses are
    sampled for every held-out prompt (as a rollout samples, at the policy's temperature) and
    scored by the training reward; a response counts as correct when its raw score is at least
    ``threshold`` (1 for ``exact_answer``). pass@k is :func:`pass_at_k` averaged over prompts, so
    pass@1 is the accuracy of one sample (the mean reward when the reward is 0/1).
    """

    def __init__(self, ks: Sequence[int] = (1, 4), threshold: float = 1.0) -> None:
        ks = list(ks)
        require(len(ks) > 0 and all(isinstance(k, int) and k >= 1 for k in ks), "PassAtK.ks", "a list of integers >= 1", ks)
        self.ks, self.threshold, self.n = ks, threshold, max(ks)

    @torch.no_grad()
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.sanity_checking:  # Lightning discards what the sanity check logs: spare the sampling
            return
        prompts = [prompt for prompt in batch for _ in range(self.n)]  # a prompt's n samples adjacent
        rollout = pl_module.rollout(prompts)
        scores = pl_module.reward_model.checked_scores(rollout.prompts, rollout.responses)  # (prompts * n,)
        correct = (scores >= self.threshold).view(len(batch), self.n).sum(-1).tolist()  # per prompt
        metrics = {f"val/pass@{k}": sum(pass_at_k(self.n, c, k) for c in correct) / len(correct) for k in self.ks}
        pl_module.log_dict(metrics, batch_size=len(batch), sync_dist=True)


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
            logger.log_metrics({"timing/iteration_s": now - self._since}, step=pl_module.step)  # the iteration's step, as its other scalars
        self._since = now
