"""What the tools' command lines share: their parser (``python -m tools.<name>``), the argparse types that end a
bad option in argparse's exit status 2 with a line that names it, before any work starts, as a bad setting of the
command does (rlhf_lightning.checks), the opening of a speed tool's ``main``, and a study's run of the command with
its settings overlaid (:func:`fit_with_overlay`)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

from rlhf_lightning.checks import ConfigError, require_number
from tools.benchmarks import isa


def tool_parser(module: str, doc: str, first_paragraph: bool = False) -> argparse.ArgumentParser:
    """The parser of the tool ``module`` (``tools.summarize_run``), whose usage line names its command,
    ``python -m tools.summarize_run``: its docstring as the description, laid out as written (or its first
    paragraph alone, for a docstring that is the tool's manual)."""
    description = doc.split("\n\n")[0] if first_paragraph else doc
    return argparse.ArgumentParser(
        prog=f"python -m {module}", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def open_speed_tool(
    parse_args: Callable[[Optional[Sequence[str]]], argparse.Namespace],
    module: str,
    argv: Optional[Sequence[str]] = None,
    worker_main: Optional[Callable[[argparse.Namespace], None]] = None,
) -> Optional[argparse.Namespace]:
    """The opening of a speed tool's ``main`` (bench, compare_trl, decode_bench): its arguments, after
    ``--isa``'s variables are set (the process started again as ``python -m module`` where torch is loaded
    already: :func:`isa.apply`) and the ISA line printed, the tool's first; None in a worker process
    (``--worker``), which has run its part (``worker_main``) and prints no ISA line."""
    args = parse_args(argv)
    if getattr(args, "worker", None):
        worker_main(args)
        return None
    isa.apply(args.isa, module, sys.argv[1:] if argv is None else argv)
    print(isa.describe(), flush=True)
    return args


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


REPO = Path(__file__).resolve().parents[1]


def fit_with_overlay(config: str | Path, overlay: dict, folder: Path, label: str, env: Optional[dict] = None, extra: Sequence[str] = ()):
    """``rlhf-lightning fit --config config --config folder/overlay.yaml *extra`` in a fresh process from the
    repository's root (``overlay``: the settings written over the config's, as JSON, which is YAML); the finished
    process (its stderr captured), or the tool's exit with ``label``, the exit status and the end of its stderr."""
    path = Path(folder) / "overlay.yaml"
    path.write_text(json.dumps(overlay))
    command = [sys.executable, "-m", "rlhf_lightning.cli", "fit", "--config", str(config), "--config", str(path), *extra]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{label}: the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done
