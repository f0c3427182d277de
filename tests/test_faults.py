"""Faults inside training: non-finite rewards, KL or losses skip the update and are counted;
too many in a row stop the run with the cause."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from rlhf_lightning.interfaces import RewardModel
from tools.summarize_run import read_scalars

from helpers import fit, make_module


class FlakyReward(RewardModel):
    """Counts 'e's, but returns NaN for the calls listed in ``nan_calls`` (0-based)."""

    def __init__(self, nan_calls=(), **options):
        super().__init__(**options)
        self.nan_calls, self.calls = set(nan_calls), 0

    def score(self, prompts, responses):
        scores = [float(r.count("e")) for r in responses]
        if self.calls in self.nan_calls:
            scores[1] = float("nan")
        self.calls += 1
        return scores


def policy_snapshot(module):
    return torch.cat([p.detach().flatten().clone() for p in module.policy.parameters()])


class Snapshots(Callback):
    """Policy weights before and after each iteration."""

    def __init__(self):
        self.before, self.after = [], []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before.append(policy_snapshot(module))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after.append(policy_snapshot(module))


def test_nan_reward_skips_that_iteration_and_leaves_weights_untouched(tmp_path):
    snaps = Snapshots()
    module = make_module(reward_model=FlakyReward(nan_calls={1}))
    with pytest.warns(UserWarning, match=r"FlakyReward returned non-finite scores for responses \[1\]"):
        _, history = fit(module, tmp_path, iterations=4, callbacks=[snaps])
    assert torch.equal(snaps.before[1], snaps.after[1])  # the skipped iteration changed nothing
    assert not torch.equal(snaps.before[2], snaps.after[2])  # training went on afterwards
    assert module.faults.state_dict() == {"skipped_iterations": 1, "skipped_steps": 0, "consecutive": 0}
    assert history.rows[-1]["system/faults/skipped_iterations"] == 1.0
    assert module.iteration == 4


def test_consecutive_faults_stop_the_run_naming_the_cause(tmp_path):
    module = make_module(reward_model=FlakyReward(nan_calls={0, 1}), runtime=dict(max_consecutive_faults=2))
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match=r"2 iterations in a row.*FlakyReward returned non-finite"):
        fit(module, tmp_path, iterations=4)


def test_non_finite_loss_skips_only_that_optimizer_step(tmp_path, monkeypatch):
    module = make_module(ppo=dict(epochs=2, num_minibatches=1))
    calls = {"n": 0}
    original = module.update.loss

    def loss_with_one_nan(*args, **kwargs):
        loss = original(*args, **kwargs)
        calls["n"] += 1
        return loss * float("nan") if calls["n"] == 2 else loss  # the second of two minibatch steps

    monkeypatch.setattr(module.update, "loss", loss_with_one_nan)
    snaps = Snapshots()
    with pytest.warns(
        UserWarning,
        match=r"non-finite PPO loss: 1 optimizer step\(s\) skipped \(not finite: the weighted sum of finite terms; beta 0.1; rewards up to [0-9.e+]+ from model.reward_model \w+\)",
    ):
        fit(module, tmp_path, iterations=1, callbacks=[snaps])
    assert module.faults.skipped_steps == 1 and module.faults.skipped_iterations == 0
    assert torch.isfinite(snaps.after[0]).all()
    assert not torch.equal(snaps.before[0], snaps.after[0])  # the first, finite step was taken


def test_a_fault_in_the_loop_names_its_cause_the_value_and_beta(tmp_path, monkeypatch):
    """A non-finite advantage makes the policy loss term non-finite: the skipped step's warning names
    that term and beta; an infinite KL estimate names the estimator, the responses, their values, beta."""
    module = make_module(ppo=dict(epochs=1))
    original = module.compute_advantages
    monkeypatch.setattr(module, "compute_advantages", lambda *a: (original(*a)[0] * float("nan"), original(*a)[1]))
    with pytest.warns(
        UserWarning, match=r"skipped \(not finite: policy/loss; beta 0.1; rewards up to [0-9.e+]+ from model.reward_model \w+\)"
    ):
        fit(module, tmp_path, iterations=1)

    module = make_module()
    estimate = module.kl_estimator.checked

    def infinite_for_the_second(*args):
        kl = estimate(*args).clone()
        kl[1, 0] = float("inf")
        return kl

    monkeypatch.setattr(module.kl_estimator, "checked", infinite_for_the_second)
    with pytest.warns(
        UserWarning, match=r"iteration 0: the K1 KL estimate is not finite for responses \[1\]: \[inf\] \(beta 0.1\); skipped"
    ):
        fit(module, tmp_path, iterations=1)


def test_a_skipped_iteration_shows_in_tensorboard_as_skipped_without_stale_metrics(tmp_path):
    module = make_module(reward_model=FlakyReward(nan_calls={1}))
    logger = TensorBoardLogger(str(tmp_path), name="", version="run")
    with pytest.warns(UserWarning, match=r"iteration 1: reward model FlakyReward returned non-finite scores"):
        _, history = fit(module, tmp_path, iterations=3, logger=logger, log_every_n_steps=1)
    scalars = read_scalars(logger.log_dir)
    assert scalars["system/faults/iteration_skipped"] == {0: 0.0, 1: 1.0, 2: 0.0}  # the step the warning names
    assert scalars["system/faults/skipped_iterations"] == {0: 0.0, 1: 1.0, 2: 1.0}
    assert list(scalars["objective/reward"]) == [0, 2]  # nothing logged for the skipped step
    assert [o["skipped"] for o in history.outputs] == [False, True, False] and history.outputs[1]["metrics"] == {}
