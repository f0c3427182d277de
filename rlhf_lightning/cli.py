"""The ``rlhf-lightning`` command: a LightningCLI over PPORLHF and PromptDataModule.

rlhf-lightning fit --config configs/tiny.yaml
rlhf-lightning fit --config configs/tiny.yaml --model.kl_estimator=k3 --model.sampling.temperature=0.7
rlhf-lightning plugins      # every registered plugin, by kind
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import shlex
import signal
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from rlhf_lightning.registry import REGISTRIES, load_plugins, preset_arguments, teach_jsonargparse_short_names

if TYPE_CHECKING:
    from lightning.pytorch.loggers import TensorBoardLogger


def print_plugins() -> None:
    """Every registered plugin: a table at the terminal's width, or one tab-separated line per
    plugin (kind, name, aliases, class with a preset's bound arguments, description) when the output is a pipe or a file."""
    from rich.console import Console
    from rich.table import Table

    rows = [
        (kind, entry.name, ", ".join(entry.aliases), entry.class_path + preset_arguments(entry.init_args), entry.description)
        for kind, reg in REGISTRIES.items()
        for entry in reg.entries()
    ]
    console = Console()
    if not console.is_terminal:
        print("\n".join("\t".join(row) for row in rows))
        return
    table = Table(title="rlhf-lightning plugins")
    for column in ("kind", "name", "aliases"):
        table.add_column(column, no_wrap=True)
    table.add_column("class", overflow="fold")
    table.add_column("description", ratio=1)  # wraps to the terminal's width
    for row in rows:
        table.add_row(*row)
    console.print(table)


class _DropAdvertisements(logging.Filter):
    """Lightning's start-up tip advertising a hosted logger is not the user's business."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("💡 Tip")


def quiet_library_noise() -> None:
    """Silence what libraries print that a user can do nothing about: Lightning's hosted logger tip
    and deprecation notices about library
    internals (transformers' gradient-checkpointing property, torch's pytree LeafSpec as Lightning
    uses it). Warnings about the user's own settings stay."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_DropAdvertisements())
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*is_gradient_checkpointing.*")
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*isinstance\(treespec, LeafSpec\).*")


def default_logger(root_dir: Optional[str], config_files: list) -> TensorBoardLogger:
    """Lightning's default TensorBoardLogger (``<root>/lightning_logs/version_N``) with the run's
    config files in the path, ``<root>/lightning_logs/quickstart/version_N`` (``tiny+fsdp2`` for two),
    so runs of different configs are not drawn on one axis, and without the placeholder ``hp_metric``.

    The run claims its ``version_N`` by creating the folder, which fails if it exists: two runs
    started at once on one root get different folders (Lightning only lists the existing ones, so
    both would take the same and overwrite each other's config and checkpoints)."""
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    class ClaimingTensorBoardLogger(TensorBoardLogger):
        def _get_next_version(self) -> int:
            version = super()._get_next_version()
            if rank_zero_only.rank != 0:  # the other ranks' log_dir is rank 0's, broadcast by the trainer
                return version
            Path(self.root_dir).mkdir(parents=True, exist_ok=True)
            while True:
                try:
                    (Path(self.root_dir) / f"version_{version}").mkdir()
                    return version
                except FileExistsError:  # another run claimed it since the listing
                    version += 1

        def log_metrics(self, metrics, step=None) -> None:
            # Lightning adds `epoch` to every step; as a tag it would sort above the run's own metrics.
            super().log_metrics({k: v for k, v in metrics.items() if k != "epoch"}, step)

    name = "+".join(Path(str(path)).stem for path in config_files)
    return ClaimingTensorBoardLogger(save_dir=Path(root_dir or ".") / "lightning_logs", name=name, default_hp_metric=False)


def build_cli(args: Optional[list[str]] = None, run: bool = True):
    """Construct the LightningCLI (it parses and, with ``run``, executes the subcommand)."""
    from jsonargparse import set_parsing_settings
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.plugins.io import CheckpointIO

    # Imported, their callbacks resolve by bare name (class_path: KLGuard, KLToOptimum): of the lab, the meter alone.
    import rlhf_lightning.exact.meter
    import rlhf_lightning.kl_monitor  # noqa: F401
    from rlhf_lightning.callbacks import InterruptibleRendezvous
    from rlhf_lightning.checkpoints import AtomicCheckpointIO, check_resume, find_last_checkpoint
    from rlhf_lightning.cpu import CPUSettings, apply_cpu_settings
    from rlhf_lightning.data import PromptDataModule
    from rlhf_lightning.module import PPORLHF
    from rlhf_lightning.progress import IterationProgressBar

    class RLHFLightningCLI(LightningCLI):
        def add_arguments_to_parser(self, parser) -> None:
            parser.add_class_arguments(CPUSettings, "cpu")
            add_old_keys(parser)

        def before_instantiate_classes(self) -> None:
            fold_old_keys(self.config[self.subcommand] if self.subcommand else self.config)

        def cpu_settings(self) -> CPUSettings:
            return (self.config_init[self.subcommand] if self.subcommand else self.config_init)["cpu"]

        def instantiate_classes(self) -> None:
            name_plugin_arguments(self._parser(self.subcommand))
            super().instantiate_classes()
            apply_cpu_settings(self.trainer, self.cpu_settings())

        def _parse_ckpt_path(self) -> None:
            """Nothing: Lightning's would load the checkpoint's saved model settings over the command
            line's, silently dropping a change. Here the command line and config are what runs; the
            module compares them with the checkpoint's when it loads (``checkpoints.check_compatible``)."""

        def _prepare_subcommand_kwargs(self, subcommand: str) -> dict:
            kwargs = super()._prepare_subcommand_kwargs(subcommand)
            if kwargs.get("ckpt_path") == "last":
                kwargs["ckpt_path"] = find_last_checkpoint(self.trainer)
                print(f"--ckpt_path last: {kwargs['ckpt_path']}", file=sys.stderr)
            if kwargs.get("ckpt_path"):
                check_resume(kwargs["ckpt_path"], self.model, self.trainer.strategy)
            check_world(self.trainer)
            return kwargs

        def _run_subcommand(self, subcommand: str) -> None:
            set_threads(self.cpu_settings().threads, processes=self.trainer.num_devices)
            for callback in self.trainer.callbacks:
                if isinstance(callback, InterruptibleRendezvous):
                    callback.arm(self.trainer)
            try:
                super()._run_subcommand(subcommand)
            except RuntimeError as err:
                refusal = world_not_formed(self.trainer, err)
                if refusal is None:
                    raise
                raise refusal from err
            if subcommand == "fit" and self.trainer.is_global_zero:
                print(where_the_logs_are(self.trainer.logger), flush=True)

        def _instantiate_trainer(self, config, callbacks):
            # Every checkpoint is written atomically and checked when read, unless the user chose a CheckpointIO.
            plugins = config.get("plugins")
            plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
            chosen = any(isinstance(plugin, CheckpointIO) for plugin in plugins) or getattr(config.get("strategy"), "_checkpoint_io", None)
            if not chosen:
                config = {**config, "plugins": [*plugins, AtomicCheckpointIO()]}
            if isinstance(config.get("strategy"), str):
                config = {**config, "strategy": strategy_setting(config["strategy"])}
            # A Rich progress bar (reward, KL, beta) unless the user disabled bars or chose one.
            chosen = [*(config.get("callbacks") or []), *callbacks]
            if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in chosen):
                callbacks = [*callbacks, IterationProgressBar()]
            if config.get("logger") in (None, True):  # Lightning's default logger, named after the run's config
                configs = (self.config.get(self.subcommand) if self.subcommand else self.config).get("config") or []
                config = {**config, "logger": default_logger(config.get("default_root_dir"), configs)}
            return super()._instantiate_trainer(config, [*callbacks, InterruptibleRendezvous()])

    load_plugins()  # before parsing: class_path and short names must resolve
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # --help shows each group field's docstring
    teach_jsonargparse_short_names()
    return RLHFLightningCLI(
        PPORLHF,
        PromptDataModule,
        args=args,
        run=run,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": False},  # never another run's config (each run has its own version_N)
        trainer_defaults={"log_every_n_steps": 1, "num_sanity_val_steps": 0},
    )


def strategy_setting(name: str):
    """``trainer.strategy`` given as a string: a Lightning strategy's registered name (``ddp``, ``fsdp``...) as it is,
    a strategy class's name alone (``DDPStrategy``, which jsonargparse leaves a string without init_args) as that
    class with its defaults; anything else refused naming the field and the choices (Lightning's own refusal is a
    traceback from inside the Trainer)."""
    from lightning.pytorch import strategies

    from rlhf_lightning.checks import ConfigError

    registered = ["auto", *strategies.StrategyRegistry.available_strategies()]
    if name.lower() in registered:
        return name
    cls = getattr(strategies, name, None)
    if isinstance(cls, type) and issubclass(cls, strategies.Strategy):
        return cls()
    classes = sorted(n for n in strategies.__all__ if n.endswith("Strategy") and n not in ("Strategy", "ParallelStrategy"))
    names = sorted(n for n in registered if "find_unused" not in n)  # each also with _find_unused_parameters_true/false
    raise ConfigError(
        f"trainer.strategy: {name!r} is no strategy; choose a registered name ({', '.join(names)}) "
        f"or a class ({', '.join(classes)}; its settings as --trainer.strategy.init_args.NAME=VALUE)"
    )


def set_threads(requested: Optional[int], processes: int) -> None:
    """Set torch's intra-op threads for the run (``cpu.threads``, ``OMP_NUM_THREADS`` or the machine's
    free cores: ``cpu.machine_threads``) and log the choice in one line, with the OpenMP wait policy."""
    import torch
    from lightning.pytorch.utilities import rank_zero_info

    from rlhf_lightning.cpu import machine_threads, wait_policy

    choice = machine_threads(requested, processes)
    torch.set_num_threads(choice.threads)
    rank_zero_info(choice.line(wait_policy() or "the runtime's default (idle threads spin a while)"))


def shown_path(path: Path) -> str:
    """``path`` as a user types it here: relative to the working folder where it lies inside it."""
    path = Path(os.path.abspath(path))  # not resolved: a virtualenv's python is a link out of it
    with contextlib.suppress(ValueError):
        path = path.relative_to(Path.cwd())
    return shlex.quote(str(path))


def name_plugin_arguments(parser) -> None:
    """Build each ``model.*`` plugin argument of ``parser`` within ``checks.building_plugin_for(key)``, so
    a plugin's check names the key the user wrote (``model.entropy_controller.init_args.target``),
    not its kind's (``beta_controller.target``), where one class serves two arguments.
    jsonargparse builds a ``class_path`` argument through its action's ``instantiate_classes`` and has no
    hook that is told the key; this wraps that method on each such action (once).
    tests/test_messages.py runs it through the command, so a jsonargparse release that builds
    otherwise fails there, where the message falls back to the plugin's own name."""
    from jsonargparse._typehints import ActionTypeHint

    from rlhf_lightning.checks import building_plugin_for

    for action in parser._actions:
        build = action.__dict__.get("instantiate_classes")
        if not isinstance(action, ActionTypeHint) or not action.dest.startswith("model.") or build is not None:
            continue

        def build_for_key(value, build=action.instantiate_classes, key=action.dest):
            with building_plugin_for(key):
                return build(value)

        action.instantiate_classes = build_for_key


def add_old_keys(parser) -> None:
    """0.2's top-level module arguments that 0.3 folded into a group (``args.FOLDED``: ``model.seed`` is
    ``model.loading.seed``), read under their old names until ``args.REMOVED_IN``: present in the parsed
    config only where given (a file or the command line), then moved to their keys by :func:`fold_old_keys`."""
    import argparse
    import typing

    from rlhf_lightning.args import FOLDED, GROUPS, REMOVED_IN

    for name, key in FOLDED.items():
        group, field = key.split(".")
        hint = typing.get_type_hints(GROUPS[group])[field]
        parser.add_argument(
            f"--model.{name}",
            type=Optional[hint],
            default=argparse.SUPPRESS,
            help=f"deprecated: model.{key} (this name is removed in {REMOVED_IN})",
        )


def fold_old_keys(config) -> None:
    """Each 0.2 name given (:func:`add_old_keys`) moved to its key now, with a FutureWarning naming the key and
    the release that stops reading the old name."""
    from rlhf_lightning.args import FOLDED, old_keys_warning

    given = [name for name in FOLDED if name in config.model]
    if given:
        warnings.warn(old_keys_warning(given), FutureWarning, stacklevel=2)
    for name in given:
        config.model[FOLDED[name]] = config.model.pop(name)


def where_the_logs_are(logger) -> str:
    """What a finished ``fit`` prints: the run's log folder (its ``version_N``) and, for TensorBoard's
    logs, the two commands that show them: TensorBoard on the folder and ``python -m tools.summarize_run``
    over blocks of 5 iterations (run from a source checkout's root, where ``tools`` imports: from elsewhere the
    command goes there first, with the run's folder in full)."""
    from lightning.pytorch.loggers import TensorBoardLogger

    if logger is None or logger.log_dir is None:
        return "no logger: this run wrote no logs (trainer.logger)"
    run = shown_path(Path(logger.log_dir))
    if not isinstance(logger, TensorBoardLogger):
        return f"logs: {run}"
    python = Path(sys.executable)
    tensorboard = python.parent / "tensorboard"
    summarize = f"{shown_path(python)} -m tools.summarize_run {run} --blocks 5"
    checkout = Path(__file__).resolve().parents[1]  # a source checkout's root, where tools/ lives
    if (checkout / "tools").is_dir() and Path.cwd().resolve() != checkout:
        folders = (shlex.quote(os.path.abspath(path)) for path in (checkout, python, logger.log_dir))
        summarize = "cd {} && {} -m tools.summarize_run {} --blocks 5".format(*folders)
    return "\n".join(
        (
            f"logs: {run}",
            f"  {shown_path(tensorboard) if tensorboard.exists() else 'tensorboard'} --logdir {run}"
            "   (then http://localhost:6006/#custom_scalars: reward, KL and its target, beta, the net objective)",
            f"  {summarize}",
        )
    )


def check_world(trainer) -> None:
    """Refuse a world that cannot form: ``trainer.num_nodes > 1`` with nothing that starts or finds
    the other nodes (no SLURM, torchrun, MPI or other cluster environment, and none of the
    variables a manual multi-node launch sets on every node: NODE_RANK, MASTER_ADDR). The run
    would otherwise wait at start-up for ranks that never come, until the process group times out."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from rlhf_lightning.checks import require

    environment = getattr(trainer.strategy, "cluster_environment", None)
    alone = isinstance(environment, LightningEnvironment) and not any(v in os.environ for v in ("NODE_RANK", "MASTER_ADDR"))
    require(
        trainer.num_nodes == 1 or not alone,
        "trainer.num_nodes",
        f"1 on a machine started alone (trainer.devices={trainer.num_devices} processes here, {trainer.num_nodes} x "
        f"{trainer.num_devices} in the world: the other nodes' ranks would never come); on several machines, start every node "
        "through SLURM or torchrun, or set NODE_RANK, MASTER_ADDR and MASTER_PORT on each",
        trainer.num_nodes,
    )


def world_not_formed(trainer, err: RuntimeError):
    """A ConfigError naming ``trainer.num_nodes`` and ``trainer.devices`` when ``err`` is the
    rendezvous giving up before the process group formed (a node never started, or with other
    settings, or MASTER_ADDR/MASTER_PORT unreachable); None for any other error."""
    import torch.distributed

    from rlhf_lightning.checks import ConfigError

    if not isinstance(err, torch.distributed.DistError) or torch.distributed.is_initialized():
        return None
    nodes, devices = trainer.num_nodes, trainer.num_devices
    where = f"MASTER_ADDR={os.environ.get('MASTER_ADDR', '127.0.0.1')} MASTER_PORT={os.environ.get('MASTER_PORT', '(Lightning default)')}"
    return ConfigError(
        f"the world of trainer.num_nodes={nodes} x trainer.devices={devices} = {nodes * devices} processes did not form "
        f"within trainer.strategy's timeout ({getattr(trainer.strategy, '_timeout', 'unknown')}): {str(err).splitlines()[0]} "
        f"Start every node with the same num_nodes and devices, NODE_RANK 0..{nodes - 1} once each, and {where} "
        "reachable from all; the wait is the strategy's timeout (docs/distributed.md#a-process-that-dies-or-hangs)"
    )


TRACEBACK_ENV = "RLHF_LIGHTNING_TRACEBACK"


def config_paths(argv: list[str]) -> list[str]:
    """The ``--config`` files of a command line, in order."""
    return [b for a, b in itertools.pairwise(argv) if a == "--config"] + [a[9:] for a in argv if a.startswith("--config=")]


def check_config_files(argv: list[str]) -> None:
    """Every ``--config`` file that exists must hold a mapping of settings: an empty file or a
    list says so, naming the file (jsonargparse's own message would be "Unexpected config"). A
    setting under its flat name of 0.1 (``model.lr``), in a file or on the command line, is refused
    naming its key now (``model.optim.lr``); 0.2's names of what 0.3 folded into a group are read
    (:func:`fold_old_keys`)."""
    import yaml

    from rlhf_lightning.args import FLAT_KEYS, FOLDED, MOVED_OUT, new_key
    from rlhf_lightning.checks import ConfigError

    paths = config_paths(argv)
    flat = {option.split("=")[0][len("--model.") :]: "the command line" for option in argv if option.startswith("--model.")}
    for path in map(Path, paths):
        if not path.is_file():
            continue  # jsonargparse names a missing file itself
        try:
            settings = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise ConfigError(f"--config {path}: not a readable YAML file ({err})") from None
        if settings is None:
            raise ConfigError(f"--config {path}: the file is empty; expected settings such as model:, data:, trainer:")
        if not isinstance(settings, dict):
            raise ConfigError(f"--config {path}: expected a mapping of settings (model:, data:, trainer:), got a {type(settings).__name__}")
        empty = empty_groups(settings)
        if empty:
            raise ConfigError(
                f"--config {path}: {', '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty: a group takes its settings under it; "
                "write {} for its defaults, or leave the key out"
            )
        flat.update({key: f"--config {path}" for key in settings.get("model") or {} if isinstance(settings.get("model"), dict)})
    moved = {key: where for key, where in flat.items() if (key in FLAT_KEYS and key not in FOLDED) or key in MOVED_OUT}
    if moved:
        raise ConfigError(
            "settings under their names before version 0.2, now in groups: "
            + "; ".join(f"model.{key} ({where}) is now {new_key(key)}" for key, where in moved.items())
            + " (docs/configuration.md)"
        )


def empty_groups(settings: dict) -> list[str]:
    """The keys of a config file's settings that are groups left empty (YAML ``off_policy:`` with every line under it
    commented out reads as null): the sections (``model:``), the module's groups (``model.off_policy``) and a plugin's
    ``init_args``. Each would otherwise be jsonargparse's "Unexpected config" or a TypeError; a plugin argument left
    empty (``model.beta_controller:``) is refused by the registry naming the choices."""
    from rlhf_lightning.args import GROUPS

    empty = [section for section in ("model", "data", "trainer", "cpu") if section in settings and settings[section] is None]
    model = settings.get("model") if isinstance(settings.get("model"), dict) else {}
    empty += [f"model.{name}" for name in GROUPS if name in model and model[name] is None]
    empty += [
        f"model.{name}.init_args"
        for name, value in model.items()
        if isinstance(value, dict) and "init_args" in value and value["init_args"] is None
    ]
    return empty


RUNS = ("fit", "validate", "test", "predict")  # the subcommands that run the trainer

# The top-level help, written here: Lightning's is built with every subcommand's parser, which needs the
# module class and so torch, Lightning and the plugins (seconds). tests/test_cli.py checks it lists LightningCLI's subcommands.
HELP = """usage: rlhf-lightning {fit,validate,test,predict,plugins} ...

PPO-RLHF with a KL penalty, on PyTorch Lightning.

subcommands:
  fit        train the policy: rollout, score, advantages, update
  validate   one pass over the validation prompts (reward, KL)
  test       one pass over the test prompts
  predict    responses to the prompts
  plugins    every registered plugin (KL estimators, beta controllers, rewards ...), by kind

  rlhf-lightning fit --config configs/tiny.yaml      a first run: a tiny model, a minute on a CPU
  rlhf-lightning fit --help                          every setting of a subcommand (loads torch first)

Lightning's options before the subcommand (--config, --print_config) work as in any LightningCLI.
"""


def prefer_passive_wait(argv: list[str]) -> None:
    """Let OpenMP's idle threads sleep (``threads.set_passive_wait``) where the environment chose no wait
    policy and a run may take more than one thread: with its default policy an idle thread spins for
    milliseconds on a core that other jobs on a shared machine want. The runtime reads its policy once,
    when torch loads it: the command sets it before importing torch, and where torch is loaded already
    (a module imported it first) starts afresh, in this process, with the policy set. Only where this
    process is the command (``rlhf-lightning`` or ``python -m rlhf_lightning.cli``), for a subcommand that runs the trainer."""
    from rlhf_lightning import threads

    main_module = sys.modules.get("__main__")
    command = (
        getattr(getattr(main_module, "__spec__", None), "name", None) == "rlhf_lightning.cli" or Path(sys.argv[0]).name == "rlhf-lightning"
    )
    one_thread = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip() == "1"
    if not command or not argv or argv[0] not in RUNS or one_thread or os.name != "posix" or threads.available_cores() < 2:
        return
    # now in os.environ, so a fresh start keeps it and does not restart again
    if threads.set_passive_wait() and "torch" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def main(args: Optional[list[str]] = None) -> None:
    """The command. A configuration error (an impossible value, an unknown plugin, a bad file) is
    printed as ``error: ...`` and exits with status 2, without a traceback unless the environment
    sets RLHF_LIGHTNING_TRACEBACK=1. The help and ``plugins`` load no more than they show; a subcommand
    that runs the trainer says so in a line before it loads torch and Lightning (seconds)."""
    from rlhf_lightning.checks import ConfigError
    from rlhf_lightning.registry import UnknownPluginError

    argv = sys.argv[1:] if args is None else list(args)
    if argv in ([], ["-h"], ["--help"]):
        print(HELP, end="", file=sys.stdout if argv else sys.stderr)
        sys.exit(0 if argv else 2)
    if args is None and argv[0] in RUNS:
        prefer_passive_wait(argv)
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once per run, not from each process a launcher starts
            print(f"rlhf-lightning {argv[0]}: loading torch, Lightning and the plugins ...", file=sys.stderr, flush=True)
    quiet_library_noise()
    try:
        if argv[:1] == ["plugins"]:
            load_plugins()
            print_plugins()
            return
        check_config_files(argv)
        build_cli(args)
    except SystemExit as stop:
        # Lightning's SIGTERMException, a SystemExit with no status: stopped by a signal is not success.
        # Its module is loaded wherever one can be raised.
        lightning_exceptions = sys.modules.get("lightning.pytorch.utilities.exceptions")
        if lightning_exceptions is None or not isinstance(stop, lightning_exceptions.SIGTERMException):
            raise
        exit_command(128 + signal.SIGTERM if stop.code is None else stop.code)
    except (ConfigError, UnknownPluginError, ValueError) as err:
        cause = user_error(err)
        if cause is None or os.environ.get(TRACEBACK_ENV, "").lower() in ("1", "true", "yes"):
            raise
        print(f"error: {cause}{how_to_make(cause, argv)}", file=sys.stderr)
        exit_command(getattr(cause, "status", 2))  # 2; 130 for a Ctrl+C while waiting for the sampler


def exit_command(status: int) -> None:
    """End the command with ``status``: through ``async_rollout.exit_process`` where a sampler's thread may still run
    (it ends the process at once rather than abort at the interpreter's exit), else ``sys.exit``."""
    async_rollout = sys.modules.get("rlhf_lightning.async_rollout")  # loaded wherever a sampler thread can run
    (async_rollout.exit_process if async_rollout is not None else sys.exit)(status)


def how_to_make(err: BaseException, argv: list[str]) -> str:
    """For a missing file a setting names (``ConfigFileNotFoundError.missing``), the command that makes it where a
    ``--config`` file's header names one: a comment line indented as a command, with the path on it
    (``#   python -m tools.make_teacher   # teachers/smollm2-exclaim: ...``); else nothing."""
    from rlhf_lightning.checks import ConfigFileNotFoundError

    missing = getattr(err, "missing", None) if isinstance(err, ConfigFileNotFoundError) else None
    for path in map(Path, config_paths(argv) if missing else []):
        header = itertools.takewhile(lambda line: line.startswith("#"), path.read_text().splitlines() if path.is_file() else [])
        for line in header:
            command = re.match(r"#\s{2,}(\S.*?)\s*(#|$)", line)
            if command and missing in line:
                return f"; make it with `{command.group(1)}` (the header of {path})"
    return ""


def user_error(err: BaseException) -> Optional[BaseException]:
    """The configuration error behind ``err``, if any: jsonargparse reports a plugin whose
    constructor refused a setting as "Does not validate against any of the Union subtypes",
    caused by our ConfigError, which names the field."""
    from rlhf_lightning.checks import ConfigError
    from rlhf_lightning.registry import UnknownPluginError

    while err is not None and not isinstance(err, (ConfigError, UnknownPluginError)):
        err = err.__cause__ or err.__context__
    return err


if __name__ == "__main__":
    main()
