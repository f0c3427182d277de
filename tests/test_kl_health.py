"""The KL health monitor (kl_health.py): each check caught within its declared iterations when its failure is
injected into a tiny run, silent on a healthy one; the module installs it unless the user configured one."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from rlhf_lightning import ppo_math as pm
from rlhf_lightning.checks import ConfigError
from rlhf_lightning.kl_health import KLHealth, KLHealthError, trend
from rlhf_lightning.networks import Networks
from rlhf_lightning.regulariser import Regulariser

from helpers import CONFIGS, StopAfter, cli, fit, make_module, run_cli


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def health_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("KLHealth")]


def run(module, tmp_path, iterations: int, health: KLHealth, callbacks=(), **kwargs) -> tuple[list[str], object]:
    """``iterations`` of ``module`` with ``health``; the KLHealth warnings and the trainer."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = fit(module, tmp_path, iterations, callbacks=[health, *callbacks], **kwargs)
    return health_warnings(caught), trainer


def stopped_at(module, tmp_path, iterations: int, health: KLHealth, match: str) -> int:
    """Run under ``mode: stop`` until the check named ``match`` fires; the iteration (from 1) it fired after."""
    assert health.mode == "stop"
    with pytest.raises(KLHealthError, match=match) as raised:
        fit(module, tmp_path, iterations, callbacks=[health])
    assert "KLHealth.mode: stop" in str(raised.value)
    return module.iteration


# every check each iteration, 2 failing observations in a row: each injected failure is caught within 3 iterations
# (the first, iteration 1, sees the reference equal to the policy: a KL of exactly 0, which no probe judges)
FAST = dict(every_n_iterations=1, patience=2)
DECLARED = 1 + FAST["every_n_iterations"] * FAST["patience"]


@pytest.mark.parametrize(
    "settings",
    [dict(kl=dict(placement="reward")), dict(kl=dict(placement="loss")), dict(lora=dict(rank=4))],
    ids=["reward", "loss", "lora"],
)
def test_a_healthy_run_is_silent_and_logs_the_kl_share(tmp_path, settings):
    """LoRA: the reference is the base weights, which the merge for generation rounds, beside an adapter that PEFT
    freezes while it is disabled: neither is a moved reference."""
    module = make_module(**settings)
    health = KLHealth(**FAST)
    caught, trainer = run(module, tmp_path, 5, health)
    assert caught == []
    assert trainer.callback_metrics["system/kl_health/kl_share"] > 1e-3
    assert trainer.callback_metrics["system/kl_health/dead_kl"] == 0


def test_dead_kl_in_the_reward_is_caught(tmp_path, monkeypatch):
    """The score path builds the rewards without the KL (slime's kl_coef computed and never applied)."""
    token_rewards = pm.token_rewards
    monkeypatch.setattr(pm, "token_rewards", lambda scores, kl, mask, beta: token_rewards(scores, torch.zeros_like(kl), mask, beta))
    health = KLHealth(mode="stop", checks=["dead_kl"], **FAST)
    assert stopped_at(make_module(), tmp_path, 8, health, r"dead_kl .*model\.kl\.placement \(reward\)") <= DECLARED


def test_dead_kl_in_the_loss_is_caught(tmp_path, monkeypatch):
    """The KL's loss term is zeros: the loss's gradient has no KL part."""
    loss_term = Regulariser.loss_term
    monkeypatch.setattr(Regulariser, "loss_term", lambda self, *a: (torch.zeros_like(loss_term(self, *a)[0]), loss_term(self, *a)[1]))
    health = KLHealth(mode="stop", checks=["dead_kl"], **FAST)
    module = make_module(kl=dict(placement="loss"))
    assert stopped_at(module, tmp_path, 8, health, r"dead_kl .*the loss's gradient") <= DECLARED


class NudgeReference(Callback):
    """Adds 1e-3 to the reference's weights after iteration ``at`` (or at the start of fit: ``at`` 0)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def nudge(self, pl_module) -> None:
        with torch.no_grad():
            for p in pl_module.ref_model.parameters():
                p.add_(1e-3)

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.at == 0:
            self.nudge(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.at and pl_module.iteration == self.at:
            self.nudge(pl_module)


def test_a_reference_moved_mid_run_is_caught_at_the_next_probe(tmp_path):
    health = KLHealth(every_n_iterations=2, checks=["reference_moved"])
    caught, _ = run(make_module(), tmp_path, 6, health, callbacks=[NudgeReference(at=3)])
    assert len(caught) == 1 and "KLHealth reference_moved at iteration 3" in caught[0], caught  # step 3: iteration 4, the next probe
    assert "model.reference_update" in caught[0]


@pytest.mark.parametrize("changed", [False, True], ids=["same", "changed"])
def test_a_resume_compares_the_reference_with_the_checkpoints(tmp_path, changed):
    """NeMo-RL's reference drifted across resumes: the rebuilt reference is compared with the checkpoint's fingerprint."""
    path = tmp_path / "two.ckpt"
    first = KLHealth(checks=["reference_moved"])
    assert run(make_module(), tmp_path / "a", 4, first, callbacks=[StopAfter(2, path)]) == ([], first.module.trainer)
    assert first.state_dict()["fingerprint"] == first.fingerprint
    resumed = KLHealth(checks=["reference_moved"])
    callbacks = [NudgeReference(at=0)] if changed else []
    caught, _ = run(make_module(), tmp_path / "b", 3, resumed, callbacks=callbacks, ckpt_path=str(path))
    if changed:
        assert len(caught) == 1 and "differs from the checkpoint's" in caught[0], caught
    else:
        assert caught == []


def test_a_sampler_whose_logprobs_differ_is_caught(tmp_path, monkeypatch):
    old_policy = Networks.old_policy

    def shifted(self, *args, **kwargs):
        out = old_policy(self, *args, **kwargs)
        return out._replace(sampler_logprobs=out.sampler_logprobs - 0.5)

    monkeypatch.setattr(Networks, "old_policy", shifted)
    health = KLHealth(mode="stop", checks=["sampler_mismatch"], **FAST)
    assert stopped_at(make_module(), tmp_path, 6, health, r"rollout/logprob_diff_mean = 0\.5 > KLHealth\.max_logprob_diff") <= 2


def test_a_stale_batch_fires_at_once_and_a_low_ess_after_patience():
    health = KLHealth(patience=2, checks=["sampler_mismatch"])
    module = SimpleNamespace(off_policy=SimpleNamespace(max_staleness=1), rollout_engine=None, step=4)
    trainer = SimpleNamespace(is_global_zero=True, loggers=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert health.sampler_mismatch(trainer, module, {"off_policy/staleness_max": 2.0}) == {"sampler_mismatch": 1.0}
        assert health.sampler_mismatch(trainer, module, {"off_policy/ess": 0.05}) == {"sampler_mismatch": 0.0}
        assert health.sampler_mismatch(trainer, module, {"off_policy/ess": 0.05}) == {"sampler_mismatch": 1.0}
        assert health.sampler_mismatch(trainer, module, {"off_policy/ess": 0.05}) == {"sampler_mismatch": 1.0}  # one warning per episode
    messages = health_warnings(caught)
    assert len(messages) == 2, messages
    assert "model.off_policy.max_staleness = 1" in messages[0] and "off_policy/ess = 0.05 < KLHealth.min_ess" in messages[1]


def test_a_cap_that_removes_a_quarter_of_the_weights_fires_after_patience():
    """off_policy/cap_removed 0.41 (the lab's 8-token responses at a sampler drift of 2, docs/async.md) fires after
    ``patience`` iterations naming the correction and the remedy; 0.02 (drift 1) never does."""
    health = KLHealth(patience=2, checks=["sampler_mismatch"])
    module = SimpleNamespace(off_policy=SimpleNamespace(max_staleness=2, correction="sequence"), rollout_engine=None, step=4)
    trainer = SimpleNamespace(is_global_zero=True, loggers=[])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fired = [health.sampler_mismatch(trainer, module, {"off_policy/cap_removed": 0.02})["sampler_mismatch"] for _ in range(4)]
        assert fired == [0.0] * 4
        fired = [health.sampler_mismatch(trainer, module, {"off_policy/cap_removed": 0.41})["sampler_mismatch"] for _ in range(2)]
        assert fired == [0.0, 1.0]
    (message,) = health_warnings(caught)
    assert "off_policy/cap_removed = 0.41 > KLHealth.max_cap_removed = 0.25" in message
    assert "model.off_policy.correction sequence" in message and "model.off_policy.correction: token" in message
    with pytest.raises(ConfigError, match=r"KLHealth\.max_cap_removed"):
        KLHealth(max_cap_removed=1.5)


def test_an_estimate_three_times_the_exact_kl_is_caught(tmp_path, monkeypatch):
    module = make_module(kl_estimator="k3", optim=dict(lr=1e-2))
    estimator = type(module.kl_estimator)
    call = estimator.__call__
    monkeypatch.setattr(estimator, "__call__", lambda self, *args: 3 * call(self, *args))
    health = KLHealth(mode="stop", checks=["estimate_vs_exact"], estimate_abs_tol=0.1, **FAST)
    assert stopped_at(module, tmp_path, 8, health, r"estimate_vs_exact .*model\.kl_estimator: full") <= DECLARED


def test_the_reward_rising_while_the_kl_stays_zero_is_caught(tmp_path, monkeypatch):
    """The reference is the policy itself: the KL is exactly 0 while the reward climbs."""
    monkeypatch.setattr(Networks, "reference_is_policy", lambda self: True)
    health = KLHealth(mode="stop", checks=["reward_up_kl_zero"], reward_window=3, **FAST)
    module = make_module(optim=dict(lr=1e-2))
    assert stopped_at(module, tmp_path, 10, health, r"reward_up_kl_zero .*model\.reference_update") <= 10


def test_the_trend_is_the_least_squares_slope():
    assert trend([1.0, 2.0, 3.0]) == 1.0 and trend([3.0, 1.0, 2.0]) == -0.5  # by hand: sum (x - 1)(y - 2) / 2


def test_the_module_installs_one_unless_the_user_did(tmp_path):
    trainer, _ = fit(make_module(), tmp_path, 1)
    (installed,) = [c for c in trainer.callbacks if isinstance(c, KLHealth)]
    assert installed.mode == "warn" and installed.every_n_iterations == 5
    mine = KLHealth(mode="off")
    trainer, _ = fit(make_module(), tmp_path, 5, callbacks=[mine])
    assert [c for c in trainer.callbacks if isinstance(c, KLHealth)] == [mine]
    assert not any(key.startswith("system/kl_health/") for key in trainer.callback_metrics)


def test_a_config_names_it_by_its_bare_class_name(tmp_path):
    """``trainer.callbacks: - class_path: KLHealth`` resolves (the command imports kl_health.py with the module)."""
    result = cli(
        tmp_path,
        "fit",
        "--config",
        str(CONFIGS / "tiny.yaml"),
        "--trainer.callbacks+=KLHealth",
        "--trainer.callbacks.mode=off",
        "--print_config",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "class_path: rlhf_lightning.kl_health.KLHealth" in result.stdout and "mode: 'off'" in result.stdout, result.stdout


def test_the_command_on_the_tiny_config_is_silent_and_logs_the_scalars(tmp_path):
    from tools.summarize_run import read_scalars

    result = run_cli(tmp_path, "--trainer.limit_train_batches=6")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "KLHealth" not in result.stderr
    scalars = read_scalars(str(tmp_path / "lightning_logs" / "tiny" / "version_0"))
    names = {"dead_kl", "kl_share", "reference_moved", "sampler_mismatch", "estimate_vs_exact", "kl_estimate", "kl_exact"}
    assert {f"system/kl_health/{name}" for name in names | {"reward_up_kl_zero"}} <= set(scalars)
    assert all(set(scalars[f"system/kl_health/{name}"].values()) == {0.0} for name in CHECKS_LOGGED), scalars
    # a probe's values at its own iteration (the 5th: step 4) only, never repeated at the iterations after it
    assert list(scalars["system/kl_health/kl_share"]) == [4] and list(scalars["system/kl_health/sampler_mismatch"]) == list(range(6))


CHECKS_LOGGED = ("dead_kl", "reference_moved", "sampler_mismatch", "estimate_vs_exact", "reward_up_kl_zero")
