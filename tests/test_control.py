"""The pid and dual beta controllers (plugins/beta_controllers.py): hand-computed beta sequences, clamps,
state round trip, validation, closed-loop behaviour on a toy plant, and tools/studies/compare_controllers.py."""

from __future__ import annotations

import csv
import itertools
import json
import math
import subprocess
import sys

import pytest

from rlhf_lightning.interfaces import BetaController
from rlhf_lightning.registry import registry

from helpers import REPO

E = math.e


def controller(name: str, **kwargs) -> BetaController:
    return registry("beta_controller").get(name)(**kwargs)


def run(ctrl: BetaController, kls, n_samples: int = 64) -> list[float]:
    return [ctrl.update(kl, n_samples) for kl in kls]


def pid(**kwargs) -> BetaController:
    """A PID controller with round gains and no error clip or beta clamp in the way."""
    defaults = dict(init_beta=1.0, target=1.0, kp=0.5, ki=0.1, kd=0.2, integral_limit=100.0, error_clip=100.0, beta_min=1e-6, beta_max=1e6)
    return controller("pid", **{**defaults, **kwargs})


# ---------------------------------------------------------------------------------------------
# pid: log beta <- log beta + kp * e_t + ki * I_t + kd * (e_t - e_{t-1}),  e_t = log(KL_t / target)


def test_pid_sequence():
    # target 1, log beta_0 = 0, kp 0.5, ki 0.1, kd 0.2; KL = e^1, e^0.5, 1, e^-1 -> e = 1, 0.5, 0, -1
    # t1: e 1,   I 1,   D 0 (first step: no derivative kick)  step 0.5 + 0.1   + 0    =  0.6   -> log beta 0.6
    # t2: e 0.5, I 1.5, D -0.5                                step 0.25 + 0.15 - 0.1 =  0.3   -> 0.9
    # t3: e 0,   I 1.5, D -0.5                                step 0 + 0.15 - 0.1    =  0.05  -> 0.95
    # t4: e -1,  I 0.5, D -1                                  step -0.5 + 0.05 - 0.2 = -0.65  -> 0.30
    ctrl = pid()
    betas = run(ctrl, [E**1, E**0.5, 1.0, E**-1])
    assert betas == pytest.approx([math.exp(0.6), math.exp(0.9), math.exp(0.95), math.exp(0.30)], rel=1e-12)
    assert ctrl.integral == pytest.approx(0.5, abs=1e-12) and ctrl.prev_error == pytest.approx(-1.0, abs=1e-12)


def test_pid_error_is_relative_to_the_target():
    # target 6, KL 12 -> e = log 2;  kp 1 only: beta = 0.1 * e^(log 2) = 0.2;  KL 3 -> e = -log 2 -> 0.1
    ctrl = pid(init_beta=0.1, target=6.0, kp=1.0, ki=0.0, kd=0.0)
    assert run(ctrl, [12.0, 3.0]) == pytest.approx([0.2, 0.1], rel=1e-12)


def test_pid_derivative_term_alone():
    # kd 1 only: t1 e 1 (no previous error) -> step 0;  t2 e 1 -> D 0;  t3 e 0 -> D -1 -> log beta -1;
    # t4 e 0 -> D 0 -> stays -1
    ctrl = pid(kp=0.0, ki=0.0, kd=1.0)
    assert run(ctrl, [E, E, 1.0, 1.0]) == pytest.approx([1.0, 1.0, math.exp(-1), math.exp(-1)], rel=1e-12)


def test_pid_error_clip_and_kl_floor():
    # error_clip 1, kp 0.1 only.  KL 0 and KL -5 (k1 can be negative): KL / target floored at 1e-6,
    # log = -13.8 -> clipped to -1: beta * e^-0.1 each time.  KL 100 * target: log 100 = 4.6 -> +1.
    ctrl = pid(init_beta=0.5, target=2.0, kp=0.1, ki=0.0, kd=0.0, error_clip=1.0)
    assert run(ctrl, [0.0, -5.0, 200.0]) == pytest.approx([0.5 * math.exp(-0.1), 0.5 * math.exp(-0.2), 0.5 * math.exp(-0.1)], rel=1e-12)
    # Without a binding clip the floor itself is the error: log(1e-6) = -13.8155..., kp 0.1 -> -1.38155...
    unclipped = pid(init_beta=0.5, target=2.0, kp=0.1, ki=0.0, kd=0.0, error_clip=100.0)
    assert unclipped.update(0.0, 8) == pytest.approx(0.5 * math.exp(0.1 * math.log(1e-6)), rel=1e-12)
    assert unclipped.update(-3.0, 8) == pytest.approx(0.5 * math.exp(0.2 * math.log(1e-6)), rel=1e-12)


def test_pid_anti_windup_clamps_the_integral():
    # ki 0.1 only, integral_limit 1.5; e = +1 (KL = e) three times:
    #   I = 1, 2 -> 1.5, 2.5 -> 1.5:  steps 0.1, 0.15, 0.15  -> log beta 0.1, 0.25, 0.40
    # then e = -1: I = 0.5 -> +0.05 -> 0.45;  I = -0.5 -> -0.05 -> 0.40
    # (unclamped, I would be 3 and the two e = -1 steps would still push beta up: +0.2, +0.1)
    ctrl = pid(kp=0.0, ki=0.1, kd=0.0, integral_limit=1.5)
    betas = run(ctrl, [E, E, E, 1 / E, 1 / E])
    assert betas == pytest.approx([math.exp(v) for v in (0.1, 0.25, 0.40, 0.45, 0.40)], rel=1e-12)
    # The clamp is symmetric: a long run below the target winds the integral down to -1.5 only.
    run(ctrl, [1 / E] * 50)
    assert ctrl.integral == -1.5


def test_pid_clamps_beta_to_its_range():
    # kp 1: KL e^2 -> log beta += 2 each step: 0.1 -> 0.739 -> 5.46 -> 40 clamped to 10; then down:
    # KL e^-2 -> 10 * e^-2 = 1.353 -> 0.183 -> 0.0248 -> 0.00335 -> clamped to beta_min 0.01
    ctrl = pid(init_beta=0.1, kp=1.0, ki=0.0, kd=0.0, beta_min=0.01, beta_max=10.0)
    assert run(ctrl, [E**2] * 3) == pytest.approx([0.1 * E**2, 0.1 * E**4, 10.0], rel=1e-12)
    assert run(ctrl, [E**-2] * 4) == pytest.approx([10 * E**-2, 10 * E**-4, 10 * E**-6, 0.01], rel=1e-12)


def test_pid_state_dict_round_trip_continues_identically():
    kwargs = dict(init_beta=0.1, target=6.0, kp=0.1, ki=0.05, kd=0.3)
    a = controller("pid", **kwargs)
    run(a, [12.0, 0.1, 7.3, 30.0], n_samples=37)
    state = json.loads(json.dumps(a.state_dict()))  # plain numbers: survives any checkpoint format
    assert set(state) == {"beta", "integral", "prev_error"}
    b = controller("pid", **{**kwargs, "init_beta": 0.777})
    b.load_state_dict(state)
    assert (b.beta, b.integral, b.prev_error) == (a.beta, a.integral, a.prev_error)
    assert run(b, [9.0, 0.2, 3.0, 6.0]) == run(a, [9.0, 0.2, 3.0, 6.0])
    # Integral and previous error matter: restoring beta alone would continue differently.
    c = controller("pid", **kwargs)
    run(c, [12.0, 0.1, 7.3, 30.0], n_samples=37)
    beta_only = controller("pid", **{**kwargs, "init_beta": 0.777})
    beta_only.beta = c.beta
    assert run(beta_only, [9.0, 0.2]) != pytest.approx(run(c, [9.0, 0.2]), rel=1e-6)


def test_pid_fresh_state_round_trip():
    # Before any update prev_error is None (no derivative kick on the first step after loading either).
    a, b = controller("pid"), controller("pid", init_beta=0.5)
    b.load_state_dict(a.state_dict())
    assert b.prev_error is None and b.integral == 0.0
    assert b.update(8.0, 8) == a.update(8.0, 8)


# ---------------------------------------------------------------------------------------------
# dual: beta <- min(max(0, beta + lr * (KL - target)), beta_max)


def test_dual_sequence_and_projection_at_zero():
    # target 2, lr 0.05, beta 0.1
    # KL 6:  0.1 + 0.05 * 4     = 0.3
    # KL 2:  + 0                 = 0.3
    # KL 0:  0.3 - 0.05 * 2     = 0.2
    # KL -1: 0.2 - 0.05 * 3     = 0.05   (k1's KL can be negative)
    # KL 0:  0.05 - 0.1 = -0.05 -> projected to 0
    # KL 1:  0 - 0.05           -> 0     (stays on the boundary while the constraint holds)
    # KL 4:  0 + 0.05 * 2       = 0.1
    ctrl = controller("dual", init_beta=0.1, target=2.0, lr=0.05)
    betas = run(ctrl, [6.0, 2.0, 0.0, -1.0, 0.0, 1.0, 4.0])
    assert betas == pytest.approx([0.3, 0.3, 0.2, 0.05, 0.0, 0.0, 0.1], abs=1e-12)
    assert betas[4] == 0.0 and betas[5] == 0.0


def test_dual_ignores_n_samples():
    a, b = controller("dual", lr=0.01), controller("dual", lr=0.01)
    assert run(a, [10.0, 3.0], n_samples=1) == run(b, [10.0, 3.0], n_samples=4096)


def test_dual_beta_max():
    # lr 0.1, target 1: KL 5 -> 0.1 + 0.4 = 0.5;  KL 11 -> 0.5 + 1 = 1.5 -> clamped to 1;  KL 0 -> 1 - 0.1 = 0.9
    ctrl = controller("dual", init_beta=0.1, target=1.0, lr=0.1, beta_max=1.0)
    assert run(ctrl, [5.0, 11.0, 0.0]) == pytest.approx([0.5, 1.0, 0.9], abs=1e-12)


def test_dual_state_dict_round_trip_continues_identically():
    a = controller("dual", init_beta=0.1, target=6.0, lr=0.02)
    run(a, [12.0, 0.1, 7.3])
    b = controller("dual", init_beta=0.9, target=6.0, lr=0.02)
    b.load_state_dict(a.state_dict())
    assert b.beta == a.beta
    assert run(b, [9.0, 0.2, 30.0]) == run(a, [9.0, 0.2, 30.0])


# ---------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize(
    "name, kwargs, field",
    [
        ("pid", {"target": 0.0}, "target"),
        ("pid", {"target": -1.0}, "target"),
        ("pid", {"target": float("inf")}, "target"),
        ("pid", {"kp": -0.1}, "kp"),
        ("pid", {"ki": -0.1}, "ki"),
        ("pid", {"kd": -0.1}, "kd"),
        ("pid", {"kp": float("nan")}, "kp"),
        ("pid", {"integral_limit": -1.0}, "integral_limit"),
        ("pid", {"error_clip": 0.0}, "error_clip"),
        ("pid", {"beta_min": 0.0}, "beta_min"),  # log beta must exist
        ("pid", {"beta_min": -1.0}, "beta_min"),
        ("pid", {"beta_min": 0.5, "beta_max": 0.2, "init_beta": 0.3}, "beta_max"),
        ("pid", {"init_beta": 20.0}, "init_beta"),  # default beta_max 10
        ("pid", {"init_beta": 1e-5}, "init_beta"),  # default beta_min 1e-4
        ("pid", {"init_beta": -0.1}, "init_beta"),
        ("pid", {"unit": "tokens"}, "unit"),
        ("dual", {"target": 0.0}, "target"),
        ("dual", {"target": -6.0}, "target"),
        ("dual", {"lr": 0.0}, "lr"),
        ("dual", {"lr": -0.01}, "lr"),
        ("dual", {"lr": float("nan")}, "lr"),
        ("dual", {"beta_max": 0.05, "init_beta": 0.1}, "beta_max"),
        ("dual", {"init_beta": -0.1}, "init_beta"),
        ("dual", {"unit": "sequence_mean"}, "unit"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_field(name, kwargs, field):
    with pytest.raises(ValueError, match=f"beta_controller.{field}"):
        controller(name, **kwargs)


def test_boundary_values_are_accepted():
    # all gains 0: beta fixed (up to exp(log(beta)) rounding)
    assert controller("pid", kp=0, ki=0, kd=0, integral_limit=0).update(12.0, 8) == pytest.approx(0.1, rel=1e-15)
    assert controller("pid", init_beta=0.2, beta_min=0.2, beta_max=0.2).update(100.0, 8) == 0.2
    assert controller("dual", init_beta=0.0).update(0.0, 8) == 0.0
    assert controller("dual", init_beta=0.3, beta_max=0.3).update(100.0, 8) == 0.3
    assert controller("pid", unit="token_mean").unit == controller("dual", unit="token_mean").unit == "token_mean"


def test_registered_under_their_short_names():
    names = registry("beta_controller").names()
    assert "pid" in names and "dual" in names


# ---------------------------------------------------------------------------------------------
# Closed loop on a toy plant: KL_t = c / beta_t, so the KL target is met at beta* = c / target.


def closed_loop(ctrl: BetaController, steps: int, c: float = 2.0, drift: float = 0.0) -> list[float]:
    """KL seen at every step; the plant's c grows like exp(drift * t)."""
    kls = []
    for t in range(steps):
        kl = c * math.exp(drift * t) / max(ctrl.beta, 1e-12)
        kls.append(kl)
        ctrl.update(kl, 8)
    return kls


def settled_after(kls: list[float], target: float, tolerance: float) -> int | None:
    """First step from which every KL is within target * (1 +- tolerance)."""
    return next((i for i in range(len(kls)) if all(abs(k / target - 1) <= tolerance for k in kls[i:])), None)


@pytest.mark.parametrize("init_beta", [0.05, 2.0])  # KL starts 10x above the target (40), or 4x below (1)
@pytest.mark.parametrize("name", ["pid", "dual"])
def test_closed_loop_pid_and_dual_reach_the_target_with_default_gains(name, init_beta):
    # c 2, target 4: beta* = 0.5.  Measured with the defaults: pid within 3% from step 79 (from
    # below) / 71 (from above), dual from step 21 / 93 (its step lr * (KL - target) is small when
    # KL < target).  Bound: 150 steps, then the last 50 steps hold within 3%.
    kls = closed_loop(controller(name, init_beta=init_beta, target=4.0), 200)
    settle = settled_after(kls, 4.0, 0.03)
    assert settle is not None and settle <= 150, (name, settle, kls[-5:])
    assert kls[-1] == pytest.approx(4.0, rel=1e-3)


def test_closed_loop_pid_with_deadbeat_gain():
    # kp = 1 on this plant (log KL = log c - log beta, gain exactly -1 in log space) is deadbeat:
    # e_1 = log(40 / 4) = log 10 -> log beta += log 10 -> beta 0.5 = beta*, KL 4 from the second step on.
    kls = closed_loop(controller("pid", init_beta=0.05, target=4.0, kp=1.0, ki=0.0, kd=0.0, error_clip=10.0), 5)
    assert kls == pytest.approx([40.0, 4.0, 4.0, 4.0, 4.0], rel=1e-12)


def test_closed_loop_pid_integral_removes_the_lag_behind_a_drifting_plant():
    # c grows by 1% a step, so log beta* grows by 0.01 a step. Proportional-only (in log beta, i.e.
    # kp * e_t) settles with a constant lag e = 0.01 / kp = 0.1 (KL 10.5% above the target); the
    # integral term supplies the drift instead: e -> 0.
    p_only = closed_loop(controller("pid", init_beta=0.5, target=4.0, ki=0.0, kd=0.0, beta_max=1e3), 250, drift=0.01)
    assert math.log(p_only[-1] / 4.0) == pytest.approx(0.1, abs=1e-4)
    pid_kls = closed_loop(controller("pid", init_beta=0.5, target=4.0, integral_limit=10.0, beta_max=1e3), 250, drift=0.01)
    assert all(abs(k / 4.0 - 1) < 0.01 for k in pid_kls[-50:])


def test_closed_loop_band_settles_inside_its_band_not_at_the_target():
    # band (x1.5 above 1.5 * target, /1.5 below 0.5 * target) stops moving once KL is in [2, 6]:
    # from beta 0.05 (KL 40): 40 -> 26.7 -> 17.8 -> 11.9 -> 7.9 -> 5.27, then beta stays 0.38.
    kls = closed_loop(controller("band", init_beta=0.05, target=4.0), 30)
    assert kls[:6] == pytest.approx([40.0, 40 / 1.5, 40 / 1.5**2, 40 / 1.5**3, 40 / 1.5**4, 40 / 1.5**5], rel=1e-12)
    assert all(k == kls[5] for k in kls[5:]) and 2.0 <= kls[-1] <= 6.0
    assert abs(kls[-1] / 4.0 - 1) > 0.3  # a band, not a set point


@pytest.mark.parametrize("init_beta, above", [(0.05, True), (2.0, False)])
def test_closed_loop_adaptive_moves_toward_the_target(init_beta, above):
    # adaptive (horizon 100, n 8: at most +-1.6% a step) is slow here, but every step moves KL toward
    # the target: beta up while KL > target, down while KL < target, with no overshoot in 50 steps.
    ctrl = controller("adaptive", init_beta=init_beta, target=4.0, horizon=100)
    kls = closed_loop(ctrl, 50)
    gaps = [abs(math.log(k / 4.0)) for k in kls]
    assert all(b < a for a, b in itertools.pairwise(gaps))
    assert all((k > 4.0) == above for k in kls)
    assert (ctrl.beta > init_beta) == above


# ---------------------------------------------------------------------------------------------
# python -m tools.studies.compare_controllers


@pytest.mark.convergence
def test_compare_controllers_tool_fast(tmp_path):
    out = tmp_path / "compare"
    result = subprocess.run(
        [sys.executable, "-m", "tools.studies.compare_controllers", "--fast", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: the run takes seconds, about 16 at load 4
        cwd=REPO,  # where tools/ imports; everything it writes goes to --out
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out / "trajectories.csv") as f:
        rows = list(csv.DictReader(f))
    assert set(rows[0]) == {"iteration", "controller", "kl", "beta", "reward"}
    by_controller: dict[str, list[dict]] = {}
    for row in rows:
        by_controller.setdefault(row["controller"], []).append(row)
    assert set(by_controller) == {"fixed", "adaptive", "band", "pid", "dual"}
    for name, ctrl_rows in by_controller.items():
        assert [int(r["iteration"]) for r in ctrl_rows] == list(range(len(ctrl_rows))) and len(ctrl_rows) >= 2, name
        assert all(math.isfinite(float(r[k])) for r in ctrl_rows for k in ("kl", "beta", "reward")), name
    # Same task, seed and starting beta: the first iteration is identical for every controller.
    assert len({(r[0]["kl"], r[0]["reward"], r[0]["beta"]) for r in by_controller.values()}) == 1
    png = out / "kl_beta.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "summary.md").read_text()
    assert all(f"| {name} |" in table for name in by_controller) and "settling" in table
    assert table.strip() in result.stdout
