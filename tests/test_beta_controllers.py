"""Built-in beta controllers: hand-computed beta sequences, validation, state round trip, contract."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning.checks import ConfigError
from rlhf_lightning.interfaces import BetaController
from rlhf_lightning.registry import registry
from rlhf_lightning_plugins.beta_controllers import FixedBeta, PromptBudgetBeta


def controller(name: str, **kwargs) -> BetaController:
    return registry("beta_controller").get(name)(**kwargs)


def run(ctrl: BetaController, kls, n_samples: int = 64) -> list[float]:
    return [ctrl.update(kl, n_samples) for kl in kls]


# ---------------------------------------------------------------------------------------------
# band


def test_band_sequence():
    # target 0.02: up when KL > 1.5 * 0.02 = 0.03, down when KL < 0.5 * 0.02 = 0.01 (both strict)
    # 0.01 -> not < 0.01: 0.1;  0.02 -> 0.1;  0.05 > 0.03 -> 0.1 * 1.5 = 0.15;
    # 0.1 -> 0.15 * 1.5 = 0.225;  0.03 -> not > 0.03: 0.225;  0.02 -> 0.225
    ctrl = controller("band", init_beta=0.1, target=0.02)
    betas = run(ctrl, [0.01, 0.02, 0.05, 0.1, 0.03, 0.02])
    assert betas == pytest.approx([0.1, 0.1, 0.15, 0.225, 0.225, 0.225], rel=1e-12)


def test_band_moves_down_below_half_the_target():
    # target 1: 0.4 < 0.5 -> 0.3 / 1.5 = 0.2;  0.1 -> 0.2 / 1.5 = 0.13333;  1.0 -> unchanged
    ctrl = controller("band", init_beta=0.3, target=1.0)
    assert run(ctrl, [0.4, 0.1, 1.0]) == pytest.approx([0.2, 0.2 / 1.5, 0.2 / 1.5], rel=1e-12)


def test_band_custom_factor():
    # factor 2: KL 10 > 1.5 -> 0.1 * 2 = 0.2; KL 0 < 0.5 -> 0.2 / 2 = 0.1 (twice -> 0.05)
    ctrl = controller("band", init_beta=0.1, target=1.0, factor=2.0)
    assert run(ctrl, [10.0, 0.0, 0.0]) == pytest.approx([0.2, 0.1, 0.05], rel=1e-12)


def test_band_clamps_at_beta_max():
    # 0.1 -> 0.15 -> 0.225 clamped to 0.2 -> stays 0.2
    ctrl = controller("band", init_beta=0.1, target=1.0, beta_max=0.2)
    assert run(ctrl, [10.0, 10.0, 10.0]) == pytest.approx([0.15, 0.2, 0.2], rel=1e-12)


def test_band_clamps_at_beta_min():
    # 0.1 -> 0.0667 -> 0.0444 clamped to 0.05 -> stays 0.05; then up again: 0.05 * 1.5 = 0.075
    ctrl = controller("band", init_beta=0.1, target=1.0, beta_min=0.05)
    assert run(ctrl, [0.0, 0.0, 0.0, 5.0]) == pytest.approx([0.1 / 1.5, 0.05, 0.05, 0.075], rel=1e-12)


def test_band_init_beta_must_lie_in_the_clamp_range():
    outside = [
        {"init_beta": 0.5, "beta_max": 0.2},
        {"init_beta": 0.01, "beta_min": 0.05},
        {"init_beta": 0.0},  # default beta_min is 1e-4
        {"init_beta": 11.0},  # default beta_max is 10
    ]
    for kwargs in outside:
        with pytest.raises(ValueError, match="init_beta"):
            controller("band", target=1.0, **kwargs)
    # the bounds themselves are inside (inclusive check):
    # init at beta_max 0.2: KL 10 > 1.5 -> 0.2 * 1.5 = 0.3 clamped to 0.2; KL 0 -> 0.2 / 1.5
    top = controller("band", init_beta=0.2, target=1.0, beta_max=0.2)
    assert run(top, [10.0, 0.0]) == pytest.approx([0.2, 0.2 / 1.5], rel=1e-12)
    # init at beta_min 0.05: KL 0 -> 0.05 / 1.5 clamped to 0.05; KL 10 -> 0.075
    bottom = controller("band", init_beta=0.05, target=1.0, beta_min=0.05)
    assert run(bottom, [0.0, 10.0]) == pytest.approx([0.05, 0.075], rel=1e-12)


# ---------------------------------------------------------------------------------------------
# adaptive (Ziegler et al., 2019)


def test_adaptive_sequence():
    # beta <- beta * (1 + clip(KL / 6 - 1, -0.2, 0.2) * 64 / 10000)
    # KL 12:  error 1 -> 0.2;   factor 1.00128;  beta = 0.1 * 1.00128        = 0.100128
    # KL 6:   error 0;          factor 1;        beta                          = 0.100128
    # KL 3:   error -0.5 -> -0.2; factor 0.99872; beta = 0.100128 * 0.99872   = 0.09999983616
    # KL 6.6: error 0.1;        factor 1.00064;  beta = 0.09999983616 * 1.00064 = 0.1000638360551424
    ctrl = controller("adaptive", init_beta=0.1, target=6.0, horizon=10000)
    betas = run(ctrl, [12.0, 6.0, 3.0, 6.6], n_samples=64)
    assert betas == pytest.approx([0.100128, 0.100128, 0.09999983616, 0.1000638360551424], rel=1e-12)


def test_adaptive_step_scales_with_n_samples_over_horizon():
    # n_samples = horizon / 2 = 50, error clipped 0.2: factor 1 + 0.2 * 0.5 = 1.1
    ctrl = controller("adaptive", init_beta=0.5, target=1.0, horizon=100)
    assert ctrl.update(100.0, 50) == pytest.approx(0.55, rel=1e-12)
    # error -0.2 (KL 0): factor 1 - 0.2 * 0.5 = 0.9 -> 0.495
    assert ctrl.update(0.0, 50) == pytest.approx(0.495, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# fixed


def test_fixed_never_changes():
    ctrl = controller("fixed", init_beta=0.05)
    assert run(ctrl, [0.0, 1e6, 6.0, -3.0, 1e-9], n_samples=1000) == [0.05] * 5
    assert ctrl.beta == 0.05


# ---------------------------------------------------------------------------------------------
# anneal


def test_anneal_follows_its_geometric_schedule_whatever_the_kl_and_then_stays():
    """init 2, final 0.5, over 4 iterations: beta = 2 * 0.25 ** (i / 4) after update i, by hand
    2 * 0.25**0.25 = sqrt(2) = 1.41421, 2 * 0.25**0.5 = 1, 2 * 0.25**0.75 = 0.70711, then 0.5 for ever."""
    ctrl = controller("anneal", init_beta=2.0, final_beta=0.5, iterations=4)
    assert ctrl.beta == 2.0
    assert run(ctrl, [0.0, 1e6, -3.0, 6.0, 1.0, 50.0], n_samples=64) == pytest.approx([2**0.5, 1.0, 0.5**0.5, 0.5, 0.5, 0.5])
    rising = controller("anneal", init_beta=0.1, final_beta=0.4, iterations=2)
    assert run(rising, [1.0, 1.0, 1.0]) == pytest.approx([0.2, 0.4, 0.4])


def test_anneal_through_the_command_logs_its_schedule(tmp_path):
    """The way a user picks it: rlhf-lightning fit with the anneal controller by its short name; the logged
    objective/beta of iterations 0-3 is init, then 0.5 * 0.1 ** (i / 2), then final: 0.5, 0.15811, 0.05, 0.05."""
    from tools.summarize_run import read_scalars

    from helpers import CONFIGS, cli

    result = cli(
        tmp_path,
        "fit",
        "--config",
        str(CONFIGS / "tiny.yaml"),
        "--model.beta_controller=anneal",
        "--model.beta_controller.init_args.init_beta=0.5",
        "--model.beta_controller.init_args.final_beta=0.05",
        "--model.beta_controller.init_args.iterations=2",
        "--model.sampling.max_new_tokens=8",
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=4",
        "--trainer.limit_val_batches=0",
        "--trainer.callbacks=[]",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    betas = read_scalars(str(tmp_path / "lightning_logs" / "tiny" / "version_0"))["objective/beta"]
    assert list(betas.values()) == pytest.approx([0.5, 0.5 * 0.1**0.5, 0.05, 0.05])


def test_anneal_resumes_where_its_schedule_was():
    a = controller("anneal", init_beta=1.0, final_beta=0.01, iterations=4)
    run(a, [1.0, 1.0])
    b = controller("anneal", init_beta=1.0, final_beta=0.01, iterations=4)
    b.load_state_dict(a.state_dict())
    assert b.beta == pytest.approx(0.1) and run(b, [1.0, 1.0, 1.0]) == pytest.approx([0.01**0.75, 0.01, 0.01])


# ---------------------------------------------------------------------------------------------
# state_dict round trip, validation


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("fixed", {"init_beta": 0.3}),
        ("adaptive", {"init_beta": 0.1, "target": 6.0, "horizon": 1000}),
        ("band", {"init_beta": 0.1, "target": 1.0}),
    ],
)
def test_state_dict_round_trip(name, kwargs):
    a = controller(name, **kwargs)
    run(a, [12.0, 0.1, 7.3], n_samples=37)
    b = controller(name, **{**kwargs, "init_beta": 0.777})
    b.load_state_dict(a.state_dict())
    assert b.beta == a.beta
    assert run(b, [9.0, 0.2, 3.0]) == run(a, [9.0, 0.2, 3.0])
    if name != "fixed":  # the updates after loading moved beta: the comparison above is not trivial
        assert a.beta != pytest.approx(kwargs["init_beta"])


@pytest.mark.parametrize(
    "name, kwargs, field",
    [
        ("fixed", {"init_beta": -0.1}, "init_beta"),
        ("adaptive", {"init_beta": -1.0}, "init_beta"),
        ("adaptive", {"init_beta": 0.0}, "init_beta must be a finite number > 0"),  # multiplicative: 0 stays 0
        ("band", {"init_beta": 0.0, "beta_min": 0.0}, "init_beta must be a finite number > 0"),
        ("band", {"init_beta": float("nan")}, "init_beta"),
        ("fixed", {"init_beta": float("inf")}, "init_beta"),
        ("adaptive", {"target": 0.0}, "target"),
        ("adaptive", {"target": -6.0}, "target"),
        ("band", {"target": 0.0}, "target"),
        ("adaptive", {"horizon": 0}, "horizon"),
        ("adaptive", {"horizon": -10}, "horizon"),
        ("band", {"factor": 1.0}, "factor"),
        ("band", {"factor": 0.5}, "factor"),
        ("band", {"beta_min": 1.0, "beta_max": 0.5}, "beta_max"),  # beta_max must be >= beta_min
        ("band", {"beta_min": -1.0}, "beta_min"),
        ("fixed", {"unit": "tokens"}, "unit"),
        ("adaptive", {"unit": "sequence_mean"}, "unit"),
        ("band", {"unit": "token_sum"}, "unit"),
        ("anneal", {"init_beta": 0.0}, "init_beta must be a finite number > 0"),
        ("anneal", {"final_beta": 0.0}, "final_beta must be a finite number > 0"),
        ("anneal", {"iterations": 0}, "iterations"),
        ("anneal", {"iterations": 2.5}, "iterations"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(name, kwargs, field):
    with pytest.raises(ValueError, match=field):
        controller(name, **kwargs)


@pytest.mark.parametrize("unit", ["sequence_sum", "token_mean"])
def test_valid_units_are_accepted(unit):
    assert controller("adaptive", unit=unit).unit == unit


def test_zero_init_beta_is_allowed_for_fixed():
    assert controller("fixed", init_beta=0).update(5.0, 8) == 0.0


# ---------------------------------------------------------------------------------------------
# Contract, over every registered controller


@pytest.mark.parametrize("name", registry("beta_controller").names())
def test_contract_update_returns_finite_non_negative_float_equal_to_beta(name):
    ctrl = controller(name)
    assert isinstance(ctrl, BetaController)
    for kl, n in [(0.0, 8), (1.0, 64), (6.0, 64), (100.0, 512), (3.0, 1), (1e-6, 64)]:
        out = ctrl.update(kl, n)
        assert isinstance(out, float)
        assert math.isfinite(out) and out >= 0
        assert ctrl.beta == out


@pytest.mark.parametrize("name", registry("beta_controller").names())
def test_contract_state_dict_restores_beta(name):
    a, b = controller(name), controller(name)
    run(a, [100.0, 100.0])
    b.load_state_dict(a.state_dict())
    assert b.beta == a.beta


# ---------------------------------------------------------------------------------------------
# The per-prompt questions, answered by every controller (the loop asks them whatever its kind)

ONE_BETA = [name for name in registry("beta_controller").names() if not controller(name).keyed_by_prompt]


@pytest.mark.parametrize("name", ONE_BETA)
def test_a_controller_with_one_beta_gives_it_for_every_prompt_and_ignores_the_prompts_kls(name):
    ctrl = controller(name)
    run(ctrl, [100.0, 0.5])  # a beta away from init_beta
    ids = ["a", "b", "a", "c"]
    betas = ctrl.checked_betas(ids)
    assert betas.dtype == torch.float64 and betas.tolist() == [ctrl.beta] * 4
    assert ctrl.betas_of([]).shape == (0,)
    state = ctrl.state_dict()
    ctrl.set_budgets({"a": 9.0})
    ctrl.update_prompts(["a", "b"], torch.tensor([50.0, 0.0], dtype=torch.float64), torch.tensor([4, 4]))
    assert ctrl.state_dict() == state  # nothing moved: the one beta moves in update()
    # its budget: the target it steers toward, for every prompt (the set budgets are a per-prompt controller's)
    target = getattr(ctrl, "target", None)
    budgets = ctrl.budgets_of(ids)
    assert budgets is None if target is None else budgets.tolist() == [target] * 4


def test_budgets_of_a_controller_with_one_beta_by_hand():
    """fixed steers toward nothing: no budget; adaptive toward its target 6 (the default), dual toward 2."""
    assert controller("fixed").budgets_of(["a"]) is None
    assert controller("adaptive").budgets_of(["a", "b"]).tolist() == [6.0, 6.0]
    assert controller("dual", target=2.0).budgets_of(["x"]).tolist() == [2.0]


def test_only_a_per_prompt_controller_is_keyed_by_prompt():
    assert [name for name in registry("beta_controller").names() if controller(name).keyed_by_prompt] == ["per_prompt"]
    ctrl = PromptBudgetBeta(init_beta=0.5, target=2.0)
    ctrl.set_budgets({"a": 1.0})
    ctrl.betas["a"] = 0.25
    assert ctrl.checked_betas(["a", "new"]).tolist() == [0.25, 0.5]  # its own, or beta before it has one
    assert ctrl.budgets_of(["a", "new"]).tolist() == [1.0, 2.0]  # its budget, or the target


def test_checked_betas_refuses_a_beta_that_is_not_finite_or_negative():
    scalar = FixedBeta(0.1)
    scalar.beta = float("nan")
    with pytest.raises(
        ConfigError, match=r"the beta of beta controller FixedBeta must be a finite number in \[0, 3e\+38\] \(float32's range"
    ):
        scalar.checked_betas(["a"])
    per_prompt = PromptBudgetBeta()
    per_prompt.betas["a"] = -1.0
    with pytest.raises(
        ConfigError, match=r"the betas of beta controller PromptBudgetBeta must be finite numbers in \[0, 3e\+38\] .*, got \[-1.0, 0.1\]"
    ):
        per_prompt.checked_betas(["a", "b"])
