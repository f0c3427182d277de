"""Configuration checks: the one error type and the one helper every setting is checked with."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Optional


def finite_number(value: Any) -> bool:
    """An int or float that is neither inf nor nan (what a numeric setting must be)."""
    return isinstance(value, (int, float)) and math.isfinite(value)


class ConfigError(ValueError):
    """A setting, a file it names, or a plugin's output that cannot work; its message names the
    field. The command prints it and exits with status 2, without a traceback."""


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """A file that a setting names does not exist."""


def require(condition: bool, field: str, requirement: str, value: Any) -> None:
    """Unless ``condition``: ``ConfigError("<field> must be <requirement>, got <value>")``, the one
    shape of every configuration error (``field`` as the user writes it: ``model.optim.lr``,
    ``KLGuard.max_kl``). A plugin names its arguments by its kind (``beta_controller.target``); while
    the command builds it for a module argument, the field is that argument's
    (``model.entropy_controller.init_args.target``: :func:`plugin_field`)."""
    if not condition:
        raise ConfigError(f"{plugin_field(field)} must be {requirement}, got {value!r}")


# A plugin's own argument as it names it: its kind, then the argument (``reward_model.url``).
_PLUGIN_FIELD = re.compile(r"(?!(?:model|data|trainer|cpu)\.)[a-z][a-z0-9_]*\.(\w+)")

# The module argument (``model.entropy_controller``) whose plugin the command is building, if any.
_BUILDING: ContextVar[Optional[str]] = ContextVar("building_plugin_for", default=None)


@contextlib.contextmanager
def building_plugin_for(key: str) -> Iterator[None]:
    """Within: plugins are built for the module argument ``key`` (``model.entropy_controller``), so
    their checks name their arguments under it (:func:`plugin_field`). The command enters it around
    its parser's building of each ``model.*`` argument (``cli.name_plugin_arguments``)."""
    token = _BUILDING.set(key)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def plugin_field(field: str) -> str:
    """``field`` as the user wrote it: a plugin's argument (``beta_controller.target``) is qualified by
    the module argument the command is building the plugin for (:func:`building_plugin_for`;
    ``model.entropy_controller``: the same class serves two arguments), into
    ``model.entropy_controller.init_args.target``; any other field, or a plugin built in Python, as it is."""
    match = _PLUGIN_FIELD.fullmatch(field)
    key = _BUILDING.get()
    return field if match is None or key is None else f"{key}.init_args.{match.group(1)}"


def require_number(
    field: str,
    value: Any,
    *,
    above: Optional[float] = None,
    at_least: Optional[float] = None,
    below: Optional[float] = None,
    at_most: Optional[float] = None,
    integer: bool = False,
    optional: bool = False,
) -> None:
    """The one check of a numeric setting: an int or float (an int with ``integer``; never a bool),
    finite (YAML's ``.inf`` and ``.nan`` parse as floats), within the bounds given, or None with
    ``optional``. Else ``ConfigError("<field> must be a finite number > 0, got inf")``, the
    requirement spelt from the bounds (``an integer >= 1``, ``a finite number in (0, 1]``)."""
    if optional and value is None:
        return
    low = (f"> {above}", f"({above}") if above is not None else (f">= {at_least}", f"[{at_least}") if at_least is not None else None
    high = (f"< {below}", f"{below})") if below is not None else (f"<= {at_most}", f"{at_most}]") if at_most is not None else None
    bounds = f" in {low[1]}, {high[1]}" if low and high else f" {(low or high)[0]}" if low or high else ""
    requirement = ("an integer" if integer else "a finite number") + bounds + (", or null" if optional else "")
    number = isinstance(value, int) if integer else finite_number(value)
    # Short-circuit: the bounds are compared only once the value is a number.
    ok = number and not isinstance(value, bool)
    ok = ok and (above is None or value > above) and (at_least is None or value >= at_least)
    ok = ok and (below is None or value < below) and (at_most is None or value <= at_most)
    require(ok, field, requirement, value)


def nonfinite_terms(terms: dict[str, Any], total: Any) -> str:
    """Which of a loss's logged terms (``policy/loss``, ``value/loss``, ...) are not finite, for the
    fault message of a skipped optimizer step; when none is, the sum itself (its weights) or, with
    a finite total here, another rank's loss."""
    names = [name for name, value in terms.items() if not math.isfinite(float(value))]
    return ", ".join(names) or ("the weighted sum of finite terms" if not math.isfinite(float(total)) else "another rank's loss")


@dataclass
class Faults:
    """Iterations and optimizer steps skipped for a non-finite reward, KL or loss (the weights untouched),
    and how many iterations in a row have had one; a run stops at ``limit`` in a row
    (``model.runtime.max_consecutive_faults``). The counts are checkpointed (``state_dict``)."""

    limit: int
    skipped_iterations: int = 0
    skipped_steps: int = 0
    consecutive: int = 0
    last_cause: str = ""
    COUNTS = ("skipped_iterations", "skipped_steps", "consecutive")

    def record(self, cause: str, iteration_skipped: bool, steps: int = 0) -> None:
        """Count one faulty iteration: skipped whole, or ``steps`` of its optimizer steps skipped."""
        self.skipped_iterations += int(iteration_skipped)
        self.skipped_steps += steps
        self.consecutive += 1
        self.last_cause = cause

    def stop_if_too_many(self) -> None:
        if self.consecutive >= self.limit:
            raise RuntimeError(
                f"stopping: {self.consecutive} iterations in a row had faults "
                f"(model.runtime.max_consecutive_faults={self.limit}); last cause: {self.last_cause}"
            )

    def metrics(self, iteration_skipped: bool) -> dict[str, float]:
        """``system/faults/iteration_skipped`` (1 at a skipped iteration's step, else 0) and the running counts."""
        counts = {f"system/faults/{name}": float(getattr(self, name)) for name in ("skipped_iterations", "skipped_steps")}
        return {"system/faults/iteration_skipped": float(iteration_skipped), **counts}

    def state_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.COUNTS}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for name in self.COUNTS:
            setattr(self, name, int(state[name]))
