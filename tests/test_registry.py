"""rlhf_lightning.registry: names, aliases, errors, new kinds, and entry-point plugin loading.

The registries are global: every test that registers something works on copies installed
with monkeypatch, so the built-in registries are exactly as before when it ends.
"""

from __future__ import annotations

import math
import sys
import textwrap
import warnings
from abc import ABC, abstractmethod
from importlib.metadata import EntryPoint

import pytest
import torch

import rlhf_lightning.registry as reg_mod
from rlhf_lightning.interfaces import BetaController, KLEstimator
from rlhf_lightning.registry import (
    DISABLE_AUTOLOAD_ENV,
    ENTRY_POINT_GROUP,
    UnknownPluginError,
    load_plugins,
    register,
    register_kind,
    registry,
    resolve_short_class_path,
)
from rlhf_lightning_plugins.kl_estimators import K1, K2, K3


@pytest.fixture
def isolated(monkeypatch):
    """Work on copies of every registry's tables and of the kind table; restored afterwards."""
    load_plugins()
    monkeypatch.setattr(reg_mod, "REGISTRIES", dict(reg_mod.REGISTRIES))
    for r in reg_mod.REGISTRIES.values():
        monkeypatch.setattr(r, "_entries", dict(r._entries))
        monkeypatch.setattr(r, "_names", dict(r._names))
    return monkeypatch


class OtherKL(KLEstimator):
    """A KL estimator that is not registered anywhere."""

    def __call__(self, logprobs, ref_logprobs, logits=None, ref_logits=None):
        return 3 * (logprobs - ref_logprobs)


# ---------------------------------------------------------------------------------------------
# Names, duplicates, errors


def test_builtin_names_and_aliases():
    names = registry("kl_estimator").names()
    assert {"k1", "abs", "k2", "mse", "k3", "low_var_kl", "full"} <= set(names)
    assert names == sorted(names)
    assert {"fixed", "adaptive", "band"} <= set(registry("beta_controller").names())
    assert {"callable", "hf_classifier"} <= set(registry("reward_model").names())
    assert registry("kl_estimator").get("k3") is K3
    assert "mse" in registry("kl_estimator") and "nope" not in registry("kl_estimator")


def test_duplicate_name_to_a_different_class_names_the_existing_class(isolated):
    kl = registry("kl_estimator")
    with pytest.raises(ValueError, match=r"'k1' is already registered to rlhf_lightning_plugins\.kl_estimators\.K1"):
        kl.register("k1", OtherKL)
    assert kl.get("k1") is K1


def test_duplicate_alias_is_refused_and_nothing_is_registered(isolated):
    kl = registry("kl_estimator")
    with pytest.raises(ValueError, match=r"'mse' is already registered to .*\.K2"):
        kl.register("fresh_name", OtherKL, aliases=("mse",))
    assert "fresh_name" not in kl
    assert kl.get("mse") is K2


def test_re_registering_the_same_class_is_idempotent(isolated):
    kl = registry("kl_estimator")
    before = kl.names()
    assert kl.register("k3", K3, aliases=("low_var_kl",)) is K3
    assert kl.names() == before and kl.get("k3") is K3


def test_unknown_name_lists_kind_and_registered_names():
    with pytest.raises(UnknownPluginError) as info:
        registry("kl_estimator").get("k4")
    message = str(info.value)
    assert "unknown kl_estimator 'k4'" in message
    assert "registered kl_estimator names: " + ", ".join(registry("kl_estimator").names()) in message
    assert isinstance(info.value, KeyError)  # callers catching KeyError still work
    assert not message.startswith('"')  # shown plainly, not KeyError-quoted


def test_unknown_kind_lists_kinds():
    with pytest.raises(UnknownPluginError, match=r"unknown plugin kind 'nope'; kinds: .*kl_estimator"):
        registry("nope")


@pytest.mark.parametrize("bad", [int, BetaController, OtherKL()], ids=["int", "other-kind-base", "instance"])
def test_non_subclass_is_refused(isolated, bad):
    with pytest.raises(TypeError, match="must subclass KLEstimator"):
        registry("kl_estimator").register("bad_one", bad)
    assert "bad_one" not in registry("kl_estimator")


def test_register_decorator_returns_the_class(isolated):
    @register("kl_estimator", "triple_k1", aliases=("k1x3",))
    class Triple(OtherKL):
        """Three times k1."""

    kl = registry("kl_estimator")
    assert kl.get("k1x3") is Triple is kl.get("triple_k1")
    (entry,) = [e for e in kl.entries() if e.name == "triple_k1"]
    assert entry.description == "Three times k1."  # first docstring line when none is given
    assert entry.aliases == ("k1x3",)


def test_a_preset_binds_arguments_and_a_name_cannot_be_rebound(isolated):
    kl = registry("kl_estimator")

    class Scaled(OtherKL):
        def __init__(self, scale: float = 1.0) -> None:
            self.scale = scale

    kl.register("scaled", Scaled)
    kl.register("double", Scaled, init_args={"scale": 2.0})
    kl.register("double", Scaled, init_args={"scale": 2.0})  # the same registration again (a re-import): allowed
    assert kl.create("double").scale == 2.0 and kl.create("double", scale=3.0).scale == 3.0
    assert kl.build("double").scale == 2.0 and kl.build("scaled").scale == 1.0
    with pytest.raises(ValueError, match=r"'double' is already registered to .*Scaled\(scale=2.0\)"):
        kl.register("double", Scaled, init_args={"scale": 4.0})
    assert resolve_short_class_path(KLEstimator, "scaled").endswith("Scaled")
    assert resolve_short_class_path(KLEstimator, "double") is None  # a preset is built from its name
    assert resolve_short_class_path(BetaController, "scaled") is None  # another kind's name


# ---------------------------------------------------------------------------------------------
# build()


def test_build_passes_instances_through():
    est = OtherKL()
    assert registry("kl_estimator").build(est) is est


@pytest.mark.parametrize("spec, cls", [("k3", K3), (" K3 ", K3), ("MSE", K2), ("k1", K1)])
def test_build_instantiates_names(spec, cls):
    built = registry("kl_estimator").build(spec)
    assert type(built) is cls
    x = torch.tensor([[0.5, -1.0]])
    # x = (0.5, -1): k1 = x; k2 = x^2 / 2; k3 = exp(-x) - 1 + x = (e^-0.5 - 0.5, e - 2)
    expected = {K1: [[0.5, -1.0]], K2: [[0.125, 0.5]], K3: [[math.exp(-0.5) - 0.5, math.e - 2.0]]}
    torch.testing.assert_close(built(x, torch.zeros_like(x)), torch.tensor(expected[cls]))


@pytest.mark.parametrize("name", ["K3", " k3 ", "\tK3\n", "LOW_VAR_KL", " Low_Var_KL "])
def test_get_is_case_and_whitespace_insensitive_like_build(name):
    kl = registry("kl_estimator")
    assert kl.get(name) is K3
    assert type(kl.build(name)) is K3


@pytest.mark.parametrize(
    "kind, name, expected",
    [("kl_estimator", " MSE", "K2"), ("beta_controller", "Band ", "BandBeta"), ("reward_model", "CALLABLE", "CallableReward")],
)
def test_get_normalises_names_for_every_kind(kind, name, expected):
    assert registry(kind).get(name).__name__ == expected


def test_get_unknown_name_after_normalising_still_raises():
    with pytest.raises(UnknownPluginError, match="unknown kl_estimator 'k4'"):
        registry("kl_estimator").get(" K4 ")


def test_build_refuses_other_types_naming_the_field():
    with pytest.raises(ValueError, match=r"model\.kl_estimator must be a registered name \(.*k3.*\).*got 3"):
        registry("kl_estimator").build(3, "model.kl_estimator")
    with pytest.raises(UnknownPluginError, match="unknown kl_estimator 'k9'"):
        registry("kl_estimator").build("k9")


# ---------------------------------------------------------------------------------------------
# New kinds


def test_register_kind_creates_a_working_registry(isolated):
    class AdvantageEstimator(ABC):
        """Base of the test kind."""

        @abstractmethod
        def __call__(self, rewards): ...

    created = register_kind("advantage_estimator_test", AdvantageEstimator)
    assert registry("advantage_estimator_test") is created

    @register("advantage_estimator_test", "reward_to_go", aliases=("rtg",))
    class RewardToGo(AdvantageEstimator):
        """A_t = sum_{k >= t} r_k."""

        def __call__(self, rewards):
            return rewards.flip(-1).cumsum(-1).flip(-1)

    assert created.names() == ["reward_to_go", "rtg"]
    est = created.build("RTG")
    assert isinstance(est, RewardToGo)
    # (1, 2, 3) -> (6, 5, 3)
    assert est(torch.tensor([1.0, 2.0, 3.0])).tolist() == [6.0, 5.0, 3.0]
    with pytest.raises(TypeError, match="must subclass AdvantageEstimator"):
        created.register("k1", K1)
    with pytest.raises(ValueError, match="'advantage_estimator_test' already exists"):
        register_kind("advantage_estimator_test", AdvantageEstimator)


def test_existing_kinds_cannot_be_recreated():
    with pytest.raises(ValueError, match="'kl_estimator' already exists"):
        register_kind("kl_estimator", KLEstimator)


def test_isolation_left_no_test_kind_behind():
    # runs after the test above in file order: the kind it created must be gone
    assert "advantage_estimator_test" not in reg_mod.REGISTRIES


# ---------------------------------------------------------------------------------------------
# Entry-point loading (third-party plugins)

EXT_MODULE = "_rlhf_test_ext_plugin"
EXT_SOURCE = textwrap.dedent(
    """
    from rlhf_lightning.interfaces import KLEstimator
    from rlhf_lightning.registry import register

    @register("kl_estimator", "test_ext_kl", description="twice k1, from a fake third-party package")
    class TwiceK1(KLEstimator):
        def __call__(self, logprobs, ref_logprobs, logits=None, ref_logits=None):
            return 2.0 * (logprobs - ref_logprobs)
    """
)


class BrokenEntryPoint:
    name = "broken_pkg"
    value = "broken_pkg.plugins"
    group = ENTRY_POINT_GROUP

    def load(self):
        raise RuntimeError("boom at import")


@pytest.fixture
def fresh_loader(isolated, tmp_path):
    """Unloaded registry state, autoload enabled, and an importable fake plugin module."""
    (tmp_path / f"{EXT_MODULE}.py").write_text(EXT_SOURCE)
    isolated.syspath_prepend(str(tmp_path))
    isolated.delenv(DISABLE_AUTOLOAD_ENV, raising=False)
    isolated.setattr(reg_mod, "_loaded", False)
    sys.modules.pop(EXT_MODULE, None)
    calls = []

    def use(*eps):
        def fake_entry_points(group=None, **kwargs):
            calls.append(group)
            return list(eps) if group == ENTRY_POINT_GROUP else []

        isolated.setattr(reg_mod, "entry_points", fake_entry_points)
        return calls

    yield use
    sys.modules.pop(EXT_MODULE, None)


def _ext_entry_point():
    return EntryPoint(name="fake_pkg", value=EXT_MODULE, group=ENTRY_POINT_GROUP)


def test_entry_point_plugin_is_loaded_once(fresh_loader):
    calls = fresh_loader(_ext_entry_point())
    assert "test_ext_kl" not in registry("kl_estimator")._names
    load_plugins()
    assert calls == [ENTRY_POINT_GROUP]
    cls = registry("kl_estimator").get("test_ext_kl")
    assert cls.__module__ == EXT_MODULE
    # x = (0.5, -1) -> 2x = (1, -2)
    x = torch.tensor([[0.5, -1.0]])
    assert cls()(x, torch.zeros_like(x)).tolist() == [[1.0, -2.0]]
    load_plugins()
    registry("kl_estimator").names()
    assert calls == [ENTRY_POINT_GROUP]  # the group is scanned once per process


def test_registry_lookup_triggers_loading(fresh_loader):
    fresh_loader(_ext_entry_point())
    assert "test_ext_kl" in registry("kl_estimator").names()


def test_entry_point_plugin_isolation_cleaned_up():
    # runs after the tests above: the fake plugin must not leak into the real registry
    assert "test_ext_kl" not in registry("kl_estimator")._names


@pytest.mark.parametrize(
    "broken",
    [BrokenEntryPoint(), EntryPoint(name="missing_pkg", value="_rlhf_no_such_module_xyz", group=ENTRY_POINT_GROUP)],
    ids=["load-raises", "module-missing"],
)
def test_broken_entry_point_warns_and_the_others_still_load(fresh_loader, broken):
    fresh_loader(broken, _ext_entry_point())
    with pytest.warns(UserWarning, match=f"could not load rlhf_lightning plugin '{broken.name}'"):
        load_plugins()
    assert "test_ext_kl" in registry("kl_estimator")
    assert registry("kl_estimator").get("k3") is K3


def test_broken_entry_point_warning_names_value_and_error(fresh_loader):
    fresh_loader(BrokenEntryPoint())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_plugins()
    (w,) = caught
    assert "broken_pkg.plugins" in str(w.message) and "RuntimeError('boom at import')" in str(w.message)


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_env_var_disables_entry_points(fresh_loader, value, monkeypatch):
    calls = fresh_loader(_ext_entry_point())
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, value)
    load_plugins()
    assert calls == []
    assert "test_ext_kl" not in registry("kl_estimator")
    assert registry("kl_estimator").get("k3") is K3  # the built-ins are still there


@pytest.mark.parametrize("value", ["0", "", "no"])
def test_env_var_other_values_keep_autoload(fresh_loader, value, monkeypatch):
    calls = fresh_loader(_ext_entry_point())
    monkeypatch.setenv(DISABLE_AUTOLOAD_ENV, value)
    load_plugins()
    assert calls == [ENTRY_POINT_GROUP]
    assert "test_ext_kl" in registry("kl_estimator")


def test_mixed_case_registration_is_found_under_any_case(isolated):
    @reg_mod.register("kl_estimator", "MyCaseKL", aliases=("My_Alias",))
    class MyCaseKL(KLEstimator):
        def __call__(self, logprobs, ref_logprobs, logits=None, ref_logits=None):
            return logprobs - ref_logprobs

    kl = registry("kl_estimator")
    assert kl.get("MyCaseKL") is MyCaseKL and kl.get("mycasekl") is MyCaseKL and kl.get("MY_ALIAS") is MyCaseKL
    assert "MyCaseKL" in kl and " k3 " in kl and "K3" in kl


NUMERIC = ("float", "int", "Optional[float]", "Optional[int]")
REQUIRED = {
    "remote": {"url": "http://127.0.0.1:1/score"},
    "hf_classifier": {"path": "unused"},
    "embedding_similarity": {"target": "x"},
    "ensemble": {"paths": ["unused_0", "unused_1"], "standardize": False},
}
REWARD_OPTIONS = ("clip", "missing_eos_penalty")  # every reward backend's **options (RewardModel's own arguments)


def numeric_arguments():
    """(kind, name, argument) for every numeric constructor argument of every registered plugin."""
    import inspect

    load_plugins()
    for kind, plugins in reg_mod.REGISTRIES.items():
        for entry in plugins.entries():
            parameters = inspect.signature(entry.cls.__init__).parameters
            numbers = [n for n, p in parameters.items() if str(p.annotation) in NUMERIC]
            if kind == "reward_model" and any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                numbers += REWARD_OPTIONS
            yield from ((kind, entry.name, argument) for argument in numbers)


NUMERIC_ARGUMENTS = list(numeric_arguments())


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("kind, name, argument", NUMERIC_ARGUMENTS, ids=[f"{name}.{argument}" for _, name, argument in NUMERIC_ARGUMENTS])
def test_every_numeric_plugin_argument_refuses_non_finite_values_naming_it(kind, name, argument, value):
    """One check (interfaces.require_number) in every plugin constructor: YAML's .inf and .nan are
    refused at start-up with a ConfigError naming <kind>.<argument>, never accepted silently."""
    from rlhf_lightning.interfaces import ConfigError

    with pytest.raises(ConfigError, match=rf"^{kind}\.{argument} must be (a finite number|an integer).*, got {value}$"):
        registry(kind).get(name)(**REQUIRED.get(name, {}), **{argument: value})


def test_a_plugin_without_arguments_refuses_one_rather_than_swallowing_it():
    """k1 has no arguments; Plugin.__new__ would let object.__init__ accept any, so ``K1(clip=-1)``
    built an unclipped k1 without a word. The command's parser refuses it too (no such init_arg)."""
    with pytest.raises(TypeError, match=r"^K1\(\) takes no arguments, got clip$"):
        registry("kl_estimator").create("k1", clip=-1.0)
    assert registry("kl_estimator").create("k1").init_args == {}


def test_moved_plugin_paths_resolve_to_where_they_live_now():
    """Configs and checkpoints written before plugins/ was arranged by kind name the old modules
    (``rlhf_lightning_plugins.control.PIDBeta``): class paths, reward functions and YAML's
    ``class_path`` all reach the same objects."""
    import importlib

    from jsonargparse import _typehints

    from rlhf_lightning.registry import MOVED_CLASSES, MOVED_MODULES, canonical_class_path, class_path, teach_jsonargparse_short_names
    from rlhf_lightning_plugins.beta_controllers import PIDBeta
    from rlhf_lightning_plugins.rewards.classifier import EnsembleReward
    from rlhf_lightning_plugins.rewards.function import CallableReward, import_function
    from rlhf_lightning_plugins.rewards.toy import char_count

    for module in MOVED_MODULES.values():
        importlib.import_module(module)
    for path in MOVED_CLASSES.values():
        module, _, name = path.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), name), type)
    assert canonical_class_path("rlhf_lightning_plugins.control.PIDBeta") == class_path(PIDBeta)
    assert canonical_class_path("rlhf_lightning_plugins.reward_models.EnsembleReward") == class_path(EnsembleReward)
    assert canonical_class_path("rlhf_lightning_plugins.reward_models.CallableReward") == class_path(CallableReward)
    assert canonical_class_path("rlhf_lightning_plugins.kl_straight_through.StraightThroughKL").endswith("kl_estimators.StraightThroughKL")
    for current in (class_path(PIDBeta), class_path(K3), "my_package.plugins.MyKL", "PIDBeta", "k3+"):
        assert canonical_class_path(current) == current
    assert import_function("rlhf_lightning_plugins.toy_rewards:char_count") is char_count
    teach_jsonargparse_short_names()
    assert _typehints.resolve_class_path_by_name(BetaController, "rlhf_lightning_plugins.control.PIDBeta") == class_path(PIDBeta)
