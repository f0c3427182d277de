"""Plugin registries: one per plugin kind, each mapping short names to plugin classes.

A plugin is a subclass of its kind's abstract base (see ``rlhf_lightning.interfaces``),
registered under a short lowercase name::

    from rlhf_lightning.registry import register

    @register("kl_estimator", "my_kl", description="...")
    class MyKL(KLEstimator): ...

A preset binds constructor arguments to a name, the way Lightning's strategy registry names
``deepspeed_stage_3``::

    registry("kl_estimator").register("k3+", StraightThroughKL, init_args={"value": "k3", "gradient": "k2"})

The module accepts either a short name (``kl_estimator: k3``) or an instance, which
LightningCLI builds from ``class_path``/``init_args``; a short name of a class (not a preset)
is a ``class_path`` too (``class_path: adaptive``, or ``--model.beta_controller=adaptive
--model.beta_controller.target=4``: see ``resolve_short_class_path``). Built-in plugins live in
``rlhf_lightning_plugins`` (the repository's ``plugins/`` folder); third-party packages
register theirs by exposing a module in the entry-point group ``rlhf_lightning.plugins``.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any, Optional

from rlhf_lightning.checks import require

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
    init_args: Mapping[str, Any] = field(default_factory=dict)  # a preset's bound constructor arguments

    @property
    def class_path(self) -> str:
        return class_path(self.cls)


def class_path(cls: type) -> str:
    """``package.module.Class``: what a ``class_path`` names and a checkpoint records of a plugin."""
    return f"{cls.__module__}.{cls.__qualname__}"


# Built-in plugin modules that moved (old -> new module; the classes and functions in them kept
# their names): configs and checkpoints written before the move name the old paths.
MOVED_MODULES = {
    "rlhf_lightning_plugins.control": "rlhf_lightning_plugins.beta_controllers",
    "rlhf_lightning_plugins.kl_straight_through": "rlhf_lightning_plugins.kl_estimators",
    "rlhf_lightning_plugins.reward_models": "rlhf_lightning_plugins.rewards.function",  # CallableReward, import_function
    "rlhf_lightning_plugins.toy_rewards": "rlhf_lightning_plugins.rewards.toy",
    "rlhf_lightning_plugins.text_rewards": "rlhf_lightning_plugins.rewards.text",
    "rlhf_lightning_plugins.remote_reward": "rlhf_lightning_plugins.rewards.remote",
    "rlhf_lightning_plugins.verifiable_rewards": "rlhf_lightning_plugins.rewards.verifiable",
}
# The classes of rlhf_lightning_plugins.reward_models that went elsewhere than its CallableReward.
MOVED_CLASSES = {
    "rlhf_lightning_plugins.reward_models.HFClassifierReward": "rlhf_lightning_plugins.rewards.classifier.HFClassifierReward",
    "rlhf_lightning_plugins.reward_models.EnsembleReward": "rlhf_lightning_plugins.rewards.classifier.EnsembleReward",
}


def canonical_class_path(path: str) -> str:
    """The current path of a ``class_path`` (``package.module.Class``) or a reward function
    (``package.module:function``) that may name a built-in plugin where it lived before it moved
    (``MOVED_MODULES``, ``MOVED_CLASSES``); any other path unchanged. A checkpoint's recorded
    plugin class paths are compared through it."""
    if path in MOVED_CLASSES:
        return MOVED_CLASSES[path]
    module, sep, name = path.partition(":") if ":" in path else path.rpartition(".")
    return f"{MOVED_MODULES[module]}{sep}{name}" if module in MOVED_MODULES else path


class Registry:
    """Name -> plugin class for one plugin kind, refusing duplicate names."""

    def __init__(self, kind: str, base: type) -> None:
        self.kind = kind
        self.base = base
        self._entries: dict[str, PluginEntry] = {}
        self._names: dict[str, str] = {}  # name or alias -> canonical name

    def register(
        self, name: str, cls: type, description: str = "", aliases: tuple[str, ...] = (), init_args: Optional[dict] = None
    ) -> type:
        """Register ``cls`` under ``name`` and ``aliases``; with ``init_args``, a preset: the name
        builds ``cls(**init_args)``."""
        name, aliases = _normalise(name), tuple(_normalise(a) for a in aliases)
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"{self.kind} plugin {name!r} must subclass {self.base.__name__}, got {cls!r}")
        init_args = dict(init_args or {})
        for key in (name, *aliases):
            taken = self._entries.get(self._names.get(key, ""))
            if taken is not None and (taken.cls, dict(taken.init_args)) != (cls, init_args):
                raise ValueError(f"{self.kind} name {key!r} is already registered to {taken.class_path}{preset_arguments(taken.init_args)}")
        description = description or next(iter((cls.__doc__ or "").strip().splitlines()), "")
        self._entries[name] = PluginEntry(name, cls, description, aliases, MappingProxyType(init_args))
        for key in (name, *aliases):
            self._names[key] = name
        return cls

    def entry(self, name: str) -> PluginEntry:
        _load_plugins()
        name = _normalise(name)
        if name not in self._names:
            raise UnknownPluginError(f"unknown {self.kind} {name!r}; registered {self.kind} names: {', '.join(self.names())}")
        return self._entries[self._names[name]]

    def get(self, name: str) -> type:
        """The class registered under ``name`` (a preset's class, without its arguments: see ``create``)."""
        return self.entry(name).cls

    def create(self, name: str, **init_args: Any) -> Any:
        """An instance of the plugin named ``name``: a preset's bound arguments, updated with ``init_args``."""
        entry = self.entry(name)
        return entry.cls(**{**entry.init_args, **init_args})

    def build(self, spec: Any, field: str | None = None) -> Any:
        """Return ``spec`` itself if it is already a plugin instance, else instantiate the named plugin."""
        if isinstance(spec, self.base):
            return spec
        if isinstance(spec, str):
            return self.create(spec)
        require(False, field or self.kind, f"a registered name ({', '.join(self.names())}) or a {self.base.__name__} instance", spec)

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


def register(
    kind: str, name: str, description: str = "", aliases: tuple[str, ...] = (), init_args: Optional[dict] = None
) -> Callable[[type], type]:
    """Class decorator: register a plugin of ``kind`` under ``name`` (and ``aliases``); with
    ``init_args``, a preset of the class (register the class itself too, under its own name)."""

    def decorator(cls: type) -> type:
        return registry(kind).register(name, cls, description, aliases, init_args)

    return decorator


def preset_arguments(init_args: Mapping[str, Any]) -> str:
    """A preset's bound arguments as a call's: ``(value='k3', gradient='k2')``; empty for a class."""
    return f"({', '.join(f'{k}={v!r}' for k, v in init_args.items())})" if init_args else ""


def resolve_short_class_path(base: type | tuple, name: str) -> Optional[str]:
    """The import path of the class registered under the short name ``name`` for the plugin kind
    whose base is ``base``; None for a preset (its bound arguments are not a ``class_path``'s: the
    module builds it from the name) or a name no registry knows."""
    bases = base if isinstance(base, tuple) else (base,)
    for reg in REGISTRIES.values():
        if reg.base in bases and name in reg:
            entry = reg.entry(name)
            return None if entry.init_args else entry.class_path
    return None


def teach_jsonargparse_short_names() -> None:
    """Make jsonargparse resolve a registered short name wherever it resolves a bare class name:
    ``class_path: adaptive`` in YAML and ``--model.beta_controller=adaptive
    --model.beta_controller.target=4`` on the command line. jsonargparse resolves a bare name
    among the imported subclasses of the argument's type (``class_path: AdaptiveBeta``) in
    ``_typehints.resolve_class_path_by_name``, which has no extension point; this wraps it (once),
    trying the registries first, and maps the dotted ``class_path`` of a moved built-in plugin
    (``rlhf_lightning_plugins.control.PIDBeta``) to where it lives now (``canonical_class_path``).
    tests/test_cli.py runs these forms through the CLI, so a jsonargparse release that moves the
    function fails there, not in a user's run."""
    from jsonargparse import _typehints

    resolve = _typehints.resolve_class_path_by_name
    if getattr(resolve, "registry_aware", False):
        return

    def resolve_class_path_by_name(cls, name: str) -> str:
        bases = cls if isinstance(cls, tuple) else _typehints.get_class_types(cls)  # cls may be Optional[Base]
        return ("." not in name and resolve_short_class_path(bases, name)) or resolve(cls, canonical_class_path(name))

    resolve_class_path_by_name.registry_aware = True
    _typehints.resolve_class_path_by_name = resolve_class_path_by_name


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
