"""Argparse types the tools share: a bad option ends in argparse's exit status 2 with a line that
names it, before any work starts, as a bad setting of the command does (rlhf_lightning.checks)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf_lightning.checks import ConfigError, require_number


def option_number(integer: bool = False, **bounds: float) -> Callable[[str], Any]:
    """An argparse ``type=`` for a tool's numeric option: its text read as an int (``integer``) or a
    float and checked as a setting is (:func:`require_number`: finite, within ``bounds``), so that
    argparse stops with ``argument --iters: must be an integer >= 1, got 0``, naming the option."""

    def parse(text: str) -> Any:
        try:
            value: Any = int(text) if integer else float(text)
        except ValueError:
            value = text
        try:
            require_number("option", value, integer=integer, **bounds)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix("option ")) from None
        return value

    return parse


def log_folder(text: str) -> str:
    """An argparse ``type=`` for a run's log folder (``lightning_logs/tiny/version_0``): it must exist,
    be a folder, and hold TensorBoard event files, else argparse names the option and the folder."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder" if path.exists() else f"folder {text!r} does not exist")
    if not any(path.glob("events.out.tfevents.*")):
        raise argparse.ArgumentTypeError(f"folder {text!r} holds no TensorBoard event files (events.out.tfevents.*): no run logged there")
    return text


def existing_file(text: str) -> str:
    """An argparse ``type=`` for a file that must exist (a config, a prompt or pair file)."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file" if Path(text).exists() else f"file {text!r} does not exist")
    return text
