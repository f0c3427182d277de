"""Plugin registries: one per plugin kind, each mapping short names to plugin classes.

A plugin is a subclass of its kind's abstract base (see ``rlhf_lightning.interfaces``),
registered under a short lowercase name::

    from rlhf_lightning.registry import register

    @register("kl_estimator", "my_kl", description="...")
    class MyKL(KLEstimator): ...

The module accepts either a short name (``kl_estimator: k3``) or an instance, which
LightningCLI builds from ``class_path``/``init_args``. Built-in plugins live in
``rlhf_lightning_plugins`` (the repository's ``plugins/`` folder); third-party packages
register theirs by exposing a module in the entry-point group ``rlhf_lightning.plugins``.
"""

from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Callable, Iterator

ENTRY_POINT_GROUP = "rlhf_lightning.plugins"
DISABLE_AUTOLOAD_ENV = "RLHF_LIGHTNING_DISABLE_PLUGIN_AUTOLOAD"


def _normalise(name: str) -> str:
    """Names are case- and whitespace-insensitive: ``K3`` and `` k3 `` select ``k3``."""
    return name.strip().lower()


class UnknownPluginError(KeyError):
    """Raised for a name that no plugin of the requested kind is registered under."""

    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


@dataclass(frozen=True)
class PluginEntry:
    name: str
    cls: type
    description: str
    aliases: tuple[str, ...] = ()


class Registry:
    """Name -> plugin class for one plugin kind, refusing duplicate names."""

    def __init__(self, kind: str, base: type) -> None:
        self.kind = kind
        self.base = base
        self._entries: dict[str, PluginEntry] = {}
        self._names: dict[str, str] = {}  # name or alias -> canonical name

    def register(self, name: str, cls: type, description: str = "", aliases: tuple[str, ...] = ()) -> type:
        name, aliases = _normalise(name), tuple(_normalise(a) for a in aliases)
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{self.kind} plugin {name!r} must subclass {self.base.__name__}, got {cls!r}")
        for key in (name, *aliases):
            if key in self._names and self._entries[self._names[key]].cls is not cls:
                taken_by = self._entries[self._names[key]].cls
                raise ValueError(f"{self.kind} name {key!r} is already registered to {taken_by.__module__}.{taken_by.__qualname__}")
        description = description or next(iter((cls.__doc__ or "").strip().splitlines()), "")
        self._entries[name] = PluginEntry(name, cls, description, tuple(aliases))
        for key in (name, *aliases):
            self._names[key] = name
        return cls

    def get(self, name: str) -> type:
        _load_plugins()
        name = _normalise(name)
        if name not in self._names:
            raise UnknownPluginError(f"unknown {self.kind} {name!r}; registered {self.kind} names: {', '.join(self.names())}")
        return self._entries[self._names[name]].cls

    def build(self, spec: Any, field: str | None = None) -> Any:
        """Return ``spec`` itself if it is already a plugin instance, else instantiate the named class."""
        if isinstance(spec, self.base):
            return spec
        if isinstance(spec, str):
            return self.get(spec)()
        raise TypeError(
            f"{field or self.kind} must be a registered name ({', '.join(self.names())}) or a "
            f"{self.base.__name__} instance, got {type(spec).__name__}: {spec!r}"
        )

    def names(self) -> list[str]:
        _load_plugins()
        return sorted(self._names)

    def entries(self) -> Iterator[PluginEntry]:
        _load_plugins()
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def __contains__(self, name: str) -> bool:
        _load_plugins()
        return _normalise(name) in self._names


REGISTRIES: dict[str, Registry] = {}


def register_kind(kind: str, base: type) -> Registry:
    """Create the registry for a new plugin kind (e.g. advantage estimators)."""
    if kind in REGISTRIES:
        raise ValueError(f"plugin kind {kind!r} already exists")
    REGISTRIES[kind] = Registry(kind, base)
    return REGISTRIES[kind]


def registry(kind: str) -> Registry:
    if kind not in REGISTRIES:
        raise UnknownPluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(sorted(REGISTRIES))}")
    return REGISTRIES[kind]


def register(kind: str, name: str, description: str = "", aliases: tuple[str, ...] = ()) -> Callable[[type], type]:
    """Class decorator: register a plugin of ``kind`` under ``name`` (and ``aliases``)."""

    def decorator(cls: type) -> type:
        return registry(kind).register(name, cls, description, aliases)

    return decorator


_loaded = False


def _load_plugins() -> None:
    """Import the built-in plugins, then every module in the entry-point group (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    importlib.import_module("rlhf_lightning_plugins")
    if os.environ.get(DISABLE_AUTOLOAD_ENV, "").lower() in ("1", "true", "yes"):
        return
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as err:  # a broken third-party plugin must not take the CLI down
            warnings.warn(f"could not load rlhf_lightning plugin {ep.name!r} ({ep.value}): {err!r}", stacklevel=2)


def load_plugins() -> None:
    """Make every built-in and installed plugin importable by name (call before parsing a config)."""
    _load_plugins()
