"""The ``rlhf-lightning`` command: a LightningCLI over PPORLHF and PromptDataModule.

    rlhf-lightning fit --config configs/tiny.yaml
    rlhf-lightning fit --config configs/tiny.yaml --model.kl_estimator=k3 --model.beta_controller=adaptive
    rlhf-lightning plugins      # every registered plugin, by kind
"""

from __future__ import annotations

import sys
from typing import Optional

from rlhf_lightning.registry import REGISTRIES, load_plugins


def print_plugins() -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="rlhf-lightning plugins")
    for column in ("kind", "name", "aliases", "class", "description"):
        table.add_column(column)
    for kind, reg in REGISTRIES.items():
        for entry in reg.entries():
            table.add_row(
                kind, entry.name, ", ".join(entry.aliases), f"{entry.cls.__module__}.{entry.cls.__qualname__}",
                entry.description,
            )  # fmt: skip
    Console(width=200).print(table)


def build_cli(args: Optional[list[str]] = None, run: bool = True):
    """Construct the LightningCLI (it parses and, with ``run``, executes the subcommand)."""
    from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
    from lightning.pytorch.cli import LightningCLI

    from rlhf_lightning.data import PromptDataModule
    from rlhf_lightning.module import PPORLHF

    class RLHFLightningCLI(LightningCLI):
        def _instantiate_trainer(self, config, callbacks):
            # A Rich progress bar (reward, KL, beta) unless the user disabled bars or chose one.
            chosen = [*(config.get("callbacks") or []), *callbacks]
            if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in chosen):
                callbacks = [*callbacks, RichProgressBar()]
            return super()._instantiate_trainer(config, callbacks)

    load_plugins()  # before parsing: class_path and short names must resolve
    return RLHFLightningCLI(
        PPORLHF,
        PromptDataModule,
        args=args,
        run=run,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        trainer_defaults={"log_every_n_steps": 1, "num_sanity_val_steps": 0},
    )


def main(args: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["plugins"]:
        load_plugins()
        print_plugins()
        return
    build_cli(args)


if __name__ == "__main__":
    main()
