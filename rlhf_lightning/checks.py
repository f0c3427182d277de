"""Configuration checks: the one error type and the one helper every setting is checked with."""

from __future__ import annotations

import math
from typing import Any


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
    shape of every configuration error (``field`` as the user writes it: ``model.lr``,
    ``beta_controller.target``, ``KLGuard.max_kl``)."""
    if not condition:
        raise ConfigError(f"{field} must be {requirement}, got {value!r}")
