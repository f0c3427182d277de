"""Checkpoints and resume: what a checkpoint holds beside Lightning's own state, how a run
resumes from one, when it is written, and how it is written and read.

- ``save_state`` / ``load_state``: the module's part of a checkpoint (iteration, plugin states,
  RNG, faults, a moved reference's weights), called from ``PPORLHF.on_save_checkpoint`` /
  ``on_load_checkpoint``. Resume semantics: the command line and config are what runs, the
  checkpoint supplies the state; settings that define the weights may not change (``RESUME_FIXED``).
- ``IterationCheckpoint``: ``last.ckpt`` every N PPO iterations and on SIGTERM / Ctrl+C.
- ``AtomicCheckpointIO``: files that are never half written, damaged ones named when read.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import random
import shutil
import signal
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from fsspec.utils import get_protocol
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from rlhf_lightning import args
from rlhf_lightning.checks import ConfigError, ConfigFileNotFoundError, require_number
from rlhf_lightning.registry import canonical_class_path, class_path

# Settings that may not change when a run resumes: they define the weights the checkpoint holds,
# the reference rebuilt from the config, or the optimizers whose state it holds.
RESUME_FIXED = (
    "policy",
    "tokenizer",
    "reference",
    "loading.tiny_config",
    "lora.rank",
    "lora.alpha",
    "lora.target_modules",
    "critic",
    "optim.optimizers",
)
STATEFUL_PLUGINS = ("beta_controller", "entropy_controller", "reward_model")


def save_state(module, checkpoint: dict) -> None:
    """Add the module's run state to ``checkpoint`` and drop the weights rebuilt from the config:
    the starting policy, and the reference until it first moves (a LoRA reference adapter is part
    of the policy; a foreign reference, rebuilt from ``model.reference``, whose identity is recorded instead). A
    sharded checkpoint keeps them: the strategy loads every submodule from it."""
    checkpoint["rlhf_lightning"] = {
        "iteration": module.iteration,
        **{name: _state_of(getattr(module, name)) for name in STATEFUL_PLUGINS},
        "rng": _rng_states(module.device),
        "generation_seed_base": module.generation_seed_base,
        "faults": module.faults.state_dict(),
        "reference_updates": module.reference_updates,
        "plugins": plugin_kinds(module),
        "plugin_args": plugin_arguments(module),
        "strategy": type(module.trainer.strategy).__name__ if module._trainer is not None else None,
        "sharded": module.networks.sharded,  # whole weights with the rebuilt ones left out, or every rank's shards of all
        "reference": module.reference_identity(),  # a foreign reference's spec and fingerprint (None: the starting policy)
        # model.off_policy: the batches drawn ahead and the versions the next ones are drawn from (docs/checkpoints.md)
        "async_rollouts": _async_rollouts_state(module),
    }
    rebuilt = () if module.networks.sharded else ("initial_model.",) if module.reference_updates else ("initial_model.", "ref_model.")
    for key in [k for k in checkpoint["state_dict"] if k.startswith(rebuilt)]:
        del checkpoint["state_dict"][key]


def load_state(module, checkpoint: dict) -> None:
    """Restore the module's run state from ``checkpoint`` after checking that the config can resume
    it (``check_compatible``), and log what the config changes. The RNG state is applied at the next
    training batch (loading and loader setup in between draw random numbers); the config's optimizer
    settings (lr, critic_lr, weight_decay) win over those stored beside the Adam moments, which
    Lightning loads next."""
    state = checkpoint_state(checkpoint)
    resume = check_compatible(
        module, checkpoint.get("hyper_parameters", {}), state.get("plugins", {}), state.get("plugin_args", {}), state.get("reference")
    )
    module.iteration = state["iteration"]
    module.generation_seed_base = state["generation_seed_base"]
    if module.sampler is not None:  # built before a checkpoint loads (configure_model)
        module.sampler.generation_seed_base = module.generation_seed_base
    module.faults.load_state_dict(state["faults"])
    module.reference_updates = state.get("reference_updates", 0)
    for name in STATEFUL_PLUGINS:
        plugin = getattr(module, name)
        if plugin is not None and name not in resume.fresh:
            _load_plugin_state(name, plugin, state.get(name))
    for name, setting in resume.restart_beta.items():  # a changed init_beta is where beta goes on from
        plugin, beta = getattr(module, name), float(getattr(module, name).init_args["init_beta"])
        resume.changes[setting] += f" (beta restarts at {beta!r}; the checkpoint's was {plugin.beta!r})"
        plugin.beta = beta
    if resume.changes:
        rank_zero_info("resuming with changed settings (checkpoint -> config): " + "; ".join(resume.changes.values()))
    _warn_dropped_prompt_ids(module)
    module._rng_to_restore = state.get("rng")
    if module.async_rollouts is not None:
        ranks, world = state.get("async_rollouts"), module.trainer.world_size if module._trainer is not None else 1
        mine = ranks[module.global_rank] if ranks is not None and len(ranks) == world else None
        dropped = module.async_rollouts.load_state_dict(mine, module.iteration)
        if ranks is not None and len(ranks) != world:
            dropped = f"the checkpoint's batches in flight were drawn by {len(ranks)} processes, not {world}"
        if dropped:
            rank_zero_info(f"resuming: {dropped}; the next batches are drawn from the checkpoint's weights, as at the start of a run")
    for prefix, model in (("ref_model.", module.ref_model), ("initial_model.", module.initial_model)):
        for key, value in ({} if model is None or "state_dict" not in checkpoint else model.state_dict()).items():
            checkpoint["state_dict"].setdefault(prefix + key, value)  # a moved reference comes from the checkpoint
    if len(checkpoint.get("optimizer_states", [])) > 1:  # one AdamW per model: one AdamW with their groups now
        checkpoint["optimizer_states"] = [merge_optimizer_states(checkpoint["optimizer_states"])]
    # Not strict: a checkpoint without optimizer states has none to update, and a count that
    # differs is refused by the optimizer's own load_state_dict with its message.
    for saved in checkpoint.get("optimizer_states", []):
        for saved_group, group in zip(saved["param_groups"], module.configure_optimizers().param_groups, strict=False):
            saved_group.update({key: value for key, value in group.items() if key != "params"})


def _warn_dropped_prompt_ids(module) -> None:
    """A per-prompt controller resumed on a prompt file whose ids are not the ones it keyed its betas by (another file,
    another ``data.id_column``, edited texts without ids): warn, naming how many and which, since those prompts' betas
    are kept but never read, and the file's new prompts start from the population's beta."""
    controller, table = module.beta_controller, module.prompt_table
    if not controller.keyed_by_prompt or table is None:
        return
    saved, now = controller.prompt_ids(), set(table.ids)
    dropped, new = [i for i in saved if i not in now], [i for i in table.ids if i not in set(saved)]
    if dropped:
        rank_zero_warn(
            f"resuming: {len(dropped)} of the {len(saved)} prompt ids model.beta_controller {type(controller).__name__} keyed its "
            f"betas by in the checkpoint are not in data.train_path ({', '.join(map(repr, dropped[:3]))}{', ...' if len(dropped) > 3 else ''}): "
            f"their betas are kept but unused, and {len(new)} of the file's {len(table.ids)} prompts start from beta "
            f"{controller.beta:.4g}; resume with the prompt file and data.id_column the run was trained with to keep each prompt's beta"
        )


# What a resume reads of the module's part of a checkpoint (``save_state``); the rest has defaults.
REQUIRED_STATE = ("iteration", "generation_seed_base", "faults")


def checkpoint_state(checkpoint: Any, path: Any = None, complete: bool = True) -> dict:
    """The module's part of a loaded checkpoint (``save_state``), or a ConfigError naming the file
    (``path``, when known) and what it lacks: a bare ``state_dict``, another LightningModule's
    checkpoint, or (``complete``) one of an rlhf-lightning version before the state a resume reads."""
    name = "the checkpoint" if path is None else f"checkpoint {path}"
    state = checkpoint.get("rlhf_lightning") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        if not isinstance(checkpoint, dict):
            what = f"a {type(checkpoint).__name__}"
        elif "state_dict" in checkpoint:
            what = f"another LightningModule's checkpoint (Lightning {checkpoint.get('pytorch-lightning_version', 'unknown')})"
        elif checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
            what = "a bare state_dict of tensors, as torch.save(model.state_dict()) writes"
        else:
            what = f"a dict with keys {', '.join(sorted(map(str, checkpoint))[:8]) or 'none'}"
        raise ConfigError(
            f"{name} has no 'rlhf_lightning' state: not written by rlhf-lightning ({what}). --ckpt_path resumes a run of this "
            "program from its own checkpoint (last.ckpt); to start from other weights, name their folder as model.policy"
        )
    missing = [key for key in REQUIRED_STATE if key not in state]
    if complete and missing:
        raise ConfigError(
            f"{name} was written by an earlier rlhf-lightning version: its 'rlhf_lightning' state lacks {', '.join(map(repr, missing))}, "
            "which a resume restores; it cannot be resumed: start a new run"
        )
    return state


PLUGINS = ("reward_model", "beta_controller", "entropy_controller", "kl_estimator", "advantage_estimator", "policy_loss")
PLUGINS += ("loss_aggregation", "reference_update")


def plugin_kinds(module) -> dict[str, Optional[str]]:
    """The class path of each plugin whose kind is fixed for a run (the gold reward, a measurement
    only, may change)."""
    return {name: None if getattr(module, name) is None else class_path(type(getattr(module, name))) for name in PLUGINS}


# Plugins whose kind may change on resume, as beta may: a measurement, how the same distribution is drawn, the regulariser
# (stateless; its beta goes on from the controller's). The change is logged.
CHANGEABLE_PLUGINS = ("gold_reward_model", "rollout_engine", "divergence")


def plugin_arguments(module) -> dict[str, Optional[dict]]:
    """Each plugin's class path and the arguments it was built with (``interfaces.Plugin.init_args``),
    as plain values (None for a plugin that is off); the entropy controller that ``model.ppo.entropy_coef`` builds is
    that setting's."""
    plugins = {name: getattr(module, name) for name in (*PLUGINS, *CHANGEABLE_PLUGINS)}
    if module.ppo.entropy_coef:
        del plugins["entropy_controller"]
    return {name: _plain(plugin) for name, plugin in plugins.items() if plugin is None or hasattr(plugin, "init_args")}


def _plugin_name(plain: Optional[dict]) -> str:
    return "none" if plain is None else plain["class_path"].rsplit(".", 1)[-1]


def _entropy_change(module, saved: dict, saved_kind: Optional[str], resume: Resume) -> None:
    """The entropy bonus may be switched on or off, or moved between a fixed ``model.ppo.entropy_coef``
    and a controller, on resume: such an entropy controller starts afresh (``resume.fresh``) from the
    config's coefficient or its ``init_beta``, and the change is logged. Only a controller replaced by
    a controller of another kind is refused (its state would not fit)."""
    coefficient = {"checkpoint": bool(saved.get("ppo.entropy_coef")), "config": bool(module.ppo.entropy_coef)}
    kind = class_path(type(module.entropy_controller)) if module.entropy_controller is not None else None
    if not (coefficient["checkpoint"] or coefficient["config"] or saved_kind is None or kind is None):
        return  # a controller before and after: the same kind resumes its state, another is refused
    resume.fresh.add("entropy_controller")
    old = "model.ppo.entropy_coef" if coefficient["checkpoint"] else saved_kind
    new = "model.ppo.entropy_coef" if coefficient["config"] else kind
    if old != new and {old, new} - {None, "model.ppo.entropy_coef"}:  # a switch on or off of the coefficient is its own change
        started = f" (starts at init_beta {module.entropy_controller.beta!r})" if new not in (None, "model.ppo.entropy_coef") else ""
        resume.changes["model.entropy_controller"] = f"model.entropy_controller: {old} -> {new}{started}"


def _plain(value: Any) -> Any:
    """``value`` as the plain Python values a checkpoint holds (``torch.load(weights_only=True)``):
    a plugin as its class path and arguments, anything else unknown as its type's name."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "init_args"):
        return {"class_path": class_path(type(value)), "init_args": _plain(value.init_args)}
    return f"<{type(value).__qualname__}>"


@dataclass
class Resume:
    """What a resume does beyond loading the checkpoint: each changed setting's log entry (by the
    field the user writes), the plugins that start afresh instead of from the checkpoint's state,
    and the controllers whose changed ``init_beta`` is where their beta goes on from (by the field)."""

    changes: dict[str, str] = field(default_factory=dict)
    fresh: set[str] = field(default_factory=set)
    restart_beta: dict[str, str] = field(default_factory=dict)


def check_compatible(
    module, saved: dict, saved_plugins: dict, saved_args: Optional[dict] = None, saved_reference: Optional[dict] = None
) -> Resume:
    """Settings that define the weights, the reference or the optimizers' layout (``RESUME_FIXED``)
    and every plugin's kind must equal the checkpoint's, else a ConfigError names each; any other
    changed setting, a plugin's arguments included, takes effect and is logged (``Resume``). A plugin
    class that has moved since the checkpoint was written is the same kind
    (``registry.canonical_class_path``).

    The entropy bonus may be switched on, off or between ``model.ppo.entropy_coef`` values: a fixed
    coefficient (``entropy_coef``) is the config's, and a controller added on resume starts from its
    ``init_beta``; only a controller replaced by another kind is refused.

    A foreign reference (``model.reference``) is part of the objective: its spec may not change (``RESUME_FIXED``),
    nor its weights under the same spec (``saved_reference``: the fingerprint the checkpoint recorded,
    ``PPORLHF.reference_identity``)."""
    hparams, saved, resume = settings(module.hparams), settings(saved), Resume()
    fixed = [*RESUME_FIXED, "loading.seed"] if hparams["policy"] == "tiny" else RESUME_FIXED  # the tiny model is rebuilt from its seed
    changed = {f: (saved[f], hparams[f]) for f in hparams if f in saved and saved[f] != hparams[f]}
    differ = [f"model.{f}: checkpoint {old!r}, config {new!r}" for f, (old, new) in changed.items() if f in fixed]
    resume.changes.update({f"model.{f}": f"model.{f}: {old!r} -> {new!r}" for f, (old, new) in changed.items() if f not in fixed})
    kinds = plugin_kinds(module)
    saved_kinds = {name: canonical_class_path(kind) if kind else None for name, kind in saved_plugins.items()}
    if "entropy_controller" in saved_kinds:
        _entropy_change(module, saved, saved_kinds["entropy_controller"], resume)
    for name, kind in kinds.items():
        if name in saved_kinds and name not in resume.fresh and saved_kinds[name] != kind:
            differ.append(f"model.{name}: checkpoint {saved_plugins[name]}, config {kind}")
    identity = module.reference_identity() if saved_reference is not None and saved.get("reference") == hparams["reference"] else None
    if identity is not None and identity["fingerprint"] != saved_reference["fingerprint"]:
        differ.append(
            f"model.reference: {identity['reference']!r} holds other weights than when the checkpoint was written (fingerprint: "
            f"checkpoint {saved_reference['fingerprint']}, now {identity['fingerprint']}; models.model_fingerprint)"
        )
    if differ:
        raise ConfigError("checkpoint is incompatible with this config (these settings cannot change on resume); " + "; ".join(differ))
    for name, plugin in plugin_arguments(module).items():
        old = (saved_args or {}).get(name)
        if name in resume.fresh or name not in (saved_args or {}) or (old is None and plugin is None):
            continue
        if old is None or plugin is None or canonical_class_path(old["class_path"]) != plugin["class_path"]:
            if name in CHANGEABLE_PLUGINS:  # another kind (the others were refused above)
                resume.changes[f"model.{name}"] = f"model.{name}: {_plugin_name(old)} -> {_plugin_name(plugin)}"
            continue
        old, new = old["init_args"], plugin["init_args"]
        for key in [k for k in {**old, **new} if old.get(k, "unset") != new.get(k, "unset")]:
            setting = f"model.{name}.init_args.{key}"
            resume.changes[setting] = f"{setting}: {old.get(key, 'unset')!r} -> {new.get(key, 'unset')!r}"
            if key == "init_beta" and name in STATEFUL_PLUGINS:
                resume.restart_beta[name] = setting
    return resume


def settings(hparams: dict) -> dict[str, Any]:
    """A module's saved settings by the key the user writes under ``model.`` (``optim.lr``): each
    group's fields under its name. A checkpoint of 0.1 holds them flat (``lr``), one of 0.2 the settings
    that 0.3 folded into ``loading`` (``seed``): read as their keys now (``args.FLAT_KEYS``), so it resumes
    and its changes are named in today's spelling; the CPU settings it holds left the module and are not compared."""
    flat = {}
    for name, value in hparams.items():
        if name in args.GROUPS and isinstance(value, dict):
            flat.update({f"{name}.{field}": v for field, v in value.items()})
        elif name not in args.MOVED_OUT:
            flat[args.FLAT_KEYS.get(name, name)] = value
    return flat


def _async_rollouts_state(module) -> Optional[list[dict]]:
    """Each rank's sampler state (``AsyncRollouts.state_dict``: its own prompts' batches in flight), gathered from
    every rank (each ``save_state`` runs on every rank; rank 0 writes); None for the synchronous loop."""
    if module.async_rollouts is None:
        return None
    state = module.async_rollouts.state_dict()
    world = module.trainer.world_size if module._trainer is not None else 1
    if world == 1:
        return [state]
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, state)
    return gathered


def _state_of(plugin) -> Optional[dict]:
    return None if plugin is None else plugin.state_dict()


def _load_plugin_state(name: str, plugin, state) -> None:
    """``plugin.load_state_dict(state)``, or a ConfigError naming the plugin when the checkpoint's
    state does not fit it (a checkpoint from an older version, or a different plugin)."""
    try:
        plugin.load_state_dict(state)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ConfigError(
            f"checkpoint: the saved state of model.{name} does not fit {type(plugin).__name__} ({type(err).__name__}: {err}); "
            "resume with the plugin the checkpoint was trained with"
        ) from None


def _rng_states(device: torch.device) -> dict:
    """The run's RNG states: torch's CPU generator, Python's, and the generator of ``device`` (this
    rank's GPU) alone. Every rank draws the same numbers from them (seeded alike, drawing alike),
    so the record of rank 0, which writes the checkpoint, serves every rank on any GPU count."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict, device: torch.device) -> None:
    """Restore ``_rng_states`` on this rank, its GPU generator on ``device``. Older checkpoints hold
    a list, one state per GPU rank 0 saw (``get_rng_state_all``, which raised when fewer GPUs
    were visible on resume): its first is rank 0's own GPU's."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    cuda = states.get("cuda")
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda[0] if isinstance(cuda, (list, tuple)) else cuda, device)


def merge_optimizer_states(states: list[dict]) -> dict:
    """One optimizer's state dict from those of several optimizers (checkpoints written with one
    AdamW per model): their parameter groups in order, the parameters renumbered to follow on."""
    merged, offset = {"state": {}, "param_groups": []}, 0
    for state in states:
        for group in state["param_groups"]:
            merged["param_groups"].append({**group, "params": [offset + i for i in group["params"]]})
        merged["state"].update({offset + i: value for i, value in state["state"].items()})
        offset += sum(len(group["params"]) for group in state["param_groups"])
    return merged


class IterationCheckpoint(ModelCheckpoint):
    """Saves ``last.ckpt`` every ``every_n_iterations`` PPO iterations, at the end of the run (so its
    last iteration is always in a checkpoint, whatever its length), and when the run is stopped by
    SIGTERM or Ctrl+C; otherwise a plain ModelCheckpoint (its end-of-epoch checkpoints, its folder,
    ``--ckpt_path last``), through Lightning's public API only (``trainer.save_checkpoint``).

    Lightning's ``every_n_train_steps`` counts optimizer steps, of which one PPO iteration takes
    ``ppo_epochs * num_minibatches`` per optimizer (and fewer when a step is skipped for a fault);
    this counts iterations (training batches). SIGTERM (what schedulers send before killing a job)
    and a first Ctrl+C let the current iteration finish, save ``last.ckpt`` and exit with status
    128 + the signal number (143, 130), so ``--ckpt_path last`` resumes exactly where the run
    stopped; a second Ctrl+C stops at once.
    """

    def __init__(self, every_n_iterations: int = 10, save_last: bool = True, save_top_k: int = 1, **kwargs) -> None:
        require_number("IterationCheckpoint.every_n_iterations", every_n_iterations, integer=True, at_least=1)
        # Given every_n_train_steps, Lightning turns its end-of-epoch save off unless asked for it (0: off).
        if kwargs.get("every_n_epochs") is None:
            kwargs["every_n_epochs"] = 1
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
        # Set before saving, as Lightning does (it is part of the state), so that its own end-of-epoch
        # save of last.ckpt overwrites this file instead of versioning a last-v1.ckpt beside it.
        self.last_model_path = str(path)
        # every rank takes part (sharded checkpoints); rank 0 writes a single file; the whole state a resume needs
        trainer.save_checkpoint(path, weights_only=False)
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

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._saved_at = pl_module.iteration  # every save of this run (last.ckpt is written beside an epoch's)

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_sigint()
        if self.save_last and pl_module.iteration and self._saved_at != pl_module.iteration and not trainer.fast_dev_run:
            self._save_last(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_sigint()
        if not isinstance(exception, SIGTERMException):
            return
        signum, self._stop_signal = self._stop_signal or signal.SIGTERM, None
        path = self._save_last(trainer, pl_module) if self._saved_at != pl_module.iteration else self._last_path()
        rank_zero_info(
            f"stopped by {signal.Signals(signum).name} after iteration {pl_module.iteration}; saved {path}; resume with --ckpt_path last"
        )
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
        # Opened outside the ``with`` below: the except clause needs its name to remove it.
        partial = tempfile.NamedTemporaryFile("wb", prefix=f".{target.name}.", suffix=".partial", dir=target.parent, delete=False)  # noqa: SIM115
        try:
            with partial:
                torch.save(checkpoint, partial)
                partial.flush()
                os.fsync(partial.fileno())
            os.chmod(partial.name, 0o666 & ~_UMASK)  # the temporary file is private; a checkpoint is not
            os.replace(partial.name, target)
        except BaseException as err:
            with contextlib.suppress(OSError):
                os.unlink(partial.name)
            if isinstance(err, (OSError, RuntimeError)):  # torch.save reports a failed write as "unexpected pos"
                raise write_error(target, err) from err
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
            checkpoint = super().load_checkpoint(path, map_location, weights_only)
        except Exception as err:  # torch.load's advice (weights_only=False) would be wrong for a damaged file
            raise ConfigError(f"checkpoint {path} cannot be read: {str(err).splitlines()[0]}") from err
        checkpoint_state(checkpoint, path)  # named here, with its file, rather than as a KeyError in load_state
        return checkpoint


_UMASK = os.umask(0)
os.umask(_UMASK)
FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


def write_error(target: Path, err: BaseException) -> OSError:
    """The OSError of a checkpoint that could not be written, naming ``target`` and the cause: the
    first OSError behind ``err`` (torch.save turns a failed write into a RuntimeError, "unexpected
    pos", with the OSError as its context), a full disk said in words, with the space left."""
    target, cause = Path(os.path.abspath(target)), err
    while cause is not None and not (isinstance(cause, OSError) and cause.errno):
        cause = cause.__cause__ or cause.__context__
    code = cause.errno if cause is not None else errno.EIO
    if code in FULL:
        free = shutil.disk_usage(target.parent).free if target.parent.exists() else 0
        reason = f"{FULL[code]} ({free / 2**20:.0f} MiB free in {target.parent})"
    else:
        reason = str(cause or err).splitlines()[0] if str(cause or err) else type(err).__name__
    return OSError(code, f"cannot write checkpoint {target}: {reason}; nothing was written, a previous {target.name} is intact")


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


def check_resume(path: str, module, strategy) -> None:
    """Before any model loads, what can be read of the checkpoint at ``path`` without its tensors
    (a file mapped, a sharded folder's ``meta.pt``): a strategy that can read it, and the config's
    settings against the checkpoint's (``check_compatible``: the refusals; the changes are logged
    when the state loads). A checkpoint that cannot be read here is left to the load, which names
    what is wrong with it; remote paths to Lightning."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if get_protocol(str(path)) != "file" or not Path(path).exists():
        return
    folder, sharded_strategy = Path(path).is_dir(), isinstance(strategy, ModelParallelStrategy)
    try:
        meta = torch.load(Path(path) / "meta.pt" if folder else path, mmap=True, weights_only=True, map_location="cpu")
    except Exception:  # damaged, truncated, or not a checkpoint: AtomicCheckpointIO's load says which
        meta = None
    saved = {} if meta is None else checkpoint_state(meta, path, complete=False)
    # A file of whole weights written without sharding leaves out the frozen reference the module rebuilds, which
    # FSDP2 would load strictly; one gathered from FSDP2's shards (save_distributed_checkpoint: false) has it.
    if folder != sharded_strategy and (folder or saved.get("sharded") is False):
        written = (
            "FSDP2 (a folder of per-rank shards)" if folder else f"{saved.get('strategy')} (whole weights, the frozen reference left out)"
        )
        raise ConfigError(
            f"checkpoint {path} was written by {written}; trainer.strategy {type(strategy).__name__} cannot resume it: "
            "resume with the strategy it was written with"
        )
    if meta is not None:
        check_compatible(
            module, meta.get("hyper_parameters", {}), saved.get("plugins", {}), saved.get("plugin_args", {}), saved.get("reference")
        )
        checkpoint_state(meta, path)  # then what an earlier version's checkpoint lacks


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
