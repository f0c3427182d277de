"""Advantage estimators: hand-computed advantages on handmade batches, the plugin contract over the
registry, the module's start-up checks, and critic-free training against the closed-form optimum."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from rlhf_lightning import ppo_math as pm
from rlhf_lightning.exact.tasks import TASKS
from rlhf_lightning.exact.training import train
from rlhf_lightning.interfaces import AdvantageEstimator
from rlhf_lightning.registry import registry
from rlhf_lightning_plugins.advantage_estimators import GAE, GRPO, RLOO, DrGRPO, ReinforcePlusPlus
from rlhf_lightning_plugins.beta_controllers import FixedBeta

from helpers import fit, make_module

pytestmark = pytest.mark.filterwarnings("ignore:.*eval mode.*", "ignore:.*val_dataloader.*", "ignore:.*LeafSpec.*")


def grouped_batch():
    """Two prompts x 3 responses. Per-token rewards whose masked sums (the returns) are
    group 1: 1, 2, 6 and group 2: 0.5, 0.5, 0.5; the 99s sit after each response's end and must not count."""
    rewards = torch.tensor(
        [
            [0.0, 0.0, 1.0, 99.0],
            [0.5, 1.5, 99.0, 99.0],
            [-1.0, 2.0, 5.0, 0.0],
            [0.5, 99.0, 99.0, 99.0],
            [0.25, 0.25, 99.0, 99.0],
            [0.0, 0.0, 0.25, 0.25],
        ]
    )
    mask = torch.tensor(
        [
            [1, 1, 1, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 1],
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 1],
        ],
        dtype=torch.float32,
    )
    return rewards, mask


def per_response(advantages: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The one advantage each response carries, after checking every real token carries it and padding is 0."""
    first = advantages[:, 0]
    torch.testing.assert_close(advantages, first.unsqueeze(-1) * mask)
    return first.tolist()


# ---------------------------------------------------------------------- formulas by hand
def test_grpo_by_hand():
    rewards, mask = grouped_batch()
    advantages, returns = GRPO()(rewards, mask, None, group_size=3)
    assert returns is None
    # Group 1: returns 1, 2, 6, mean 3, deviations -2, -1, 3, unbiased variance (4 + 1 + 9) / 2 = 7,
    # std 2.645751: A = -0.755929, -0.377964, 1.133893. Group 2: all 0.5, so exactly 0.
    got = per_response(advantages, mask)
    assert got[:3] == pytest.approx([-2 / math.sqrt(7), -1 / math.sqrt(7), 3 / math.sqrt(7)], abs=1e-6)
    assert got[:3] == pytest.approx([-0.755929, -0.377964, 1.133893], abs=1e-6)
    assert got[3:] == [0.0, 0.0, 0.0]


def test_dr_grpo_by_hand():
    rewards, mask = grouped_batch()
    advantages, returns = DrGRPO()(rewards, mask, None, group_size=3)
    assert returns is None
    assert per_response(advantages, mask) == pytest.approx([-2.0, -1.0, 3.0, 0.0, 0.0, 0.0], abs=1e-6)
    assert DrGRPO.loss_aggregation == "constant" and GRPO.loss_aggregation is None


def test_rloo_by_hand():
    rewards, mask = grouped_batch()
    advantages, returns = RLOO()(rewards, mask, None, group_size=3)
    assert returns is None
    # Leave one out: 1 - (2 + 6) / 2 = -3, 2 - (1 + 6) / 2 = -1.5, 6 - (1 + 2) / 2 = 4.5; group 2: 0.
    assert per_response(advantages, mask) == pytest.approx([-3.0, -1.5, 4.5, 0.0, 0.0, 0.0], abs=1e-6)


def test_reinforce_pp_by_hand():
    rewards = torch.tensor([[-0.5, 0.0, 1.0], [0.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = ReinforcePlusPlus()(rewards, mask, None, group_size=1)
    assert returns is None
    # Returns to go (gamma 1): row 0: 0.5, 1, 1; row 1: 2, 2 (the 9 is padding). Over the five real
    # tokens: mean 1.3, squared deviations 0.64 + 0.09 + 0.09 + 0.49 + 0.49 = 1.8, unbiased var 0.45,
    # std 0.670820: A = (G - 1.3) / 0.670820.
    std = math.sqrt(0.45)
    expected = torch.tensor([[-0.8 / std, -0.3 / std, -0.3 / std], [0.7 / std, 0.7 / std, 0.0]])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    # gamma 0.5: row 0: -0.5 + 0.5 * 0 + 0.25 * 1 = -0.25, 0 + 0.5 * 1 = 0.5, 1; row 1: 0 + 0.5 * 2 = 1, 2.
    torch.testing.assert_close(pm.reward_to_go(rewards, mask, 0.5), torch.tensor([[-0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]))


def test_gradient_scales_by_hand():
    """The factor each estimator puts on a response's expected policy gradient, which the KL in the
    loss is weighed by: a group-mean baseline keeps (n - 1) / n of it (n = 3: 2/3), leave-one-out all
    of it, GRPO's std division is not carried over (one std-0 group would weigh its KL a million
    times), REINFORCE++ divides by the batch std of the returns to go (0.670820, as above)."""
    rewards, mask = grouped_batch()
    for estimator, factor in ((GRPO(), 2 / 3), (DrGRPO(), 2 / 3), (RLOO(), 1.0), (GAE(), 1.0)):
        torch.testing.assert_close(estimator.gradient_scale(rewards, mask, group_size=3), torch.full((6,), factor))
    rewards = torch.tensor([[-0.5, 0.0, 1.0], [0.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    scale = ReinforcePlusPlus().gradient_scale(rewards, mask, group_size=1)
    torch.testing.assert_close(scale, torch.full((2,), 1 / math.sqrt(0.45)), atol=1e-5, rtol=0)


def test_reward_to_go_matches_a_plain_reverse_loop():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 7, generator=gen)
    lengths = [7, 3, 1, 5, 6]
    mask = torch.tensor([[float(t < n) for t in range(7)] for n in lengths])
    for gamma in (1.0, 0.9):
        expected = torch.zeros_like(rewards)
        for b, n in enumerate(lengths):
            running = 0.0
            for t in reversed(range(n)):
                running = float(rewards[b, t]) + gamma * running
                expected[b, t] = running
        torch.testing.assert_close(pm.reward_to_go(rewards, mask, gamma), expected, atol=1e-5, rtol=0)


def test_gae_estimator_is_ppo_math_gae_with_its_own_gamma_and_lambda():
    gen = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    advantages, returns = GAE(gamma=0.9, lam=0.8)(rewards, mask, values, group_size=1)
    expected = pm.gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(advantages, expected[0])
    torch.testing.assert_close(returns, expected[1])
    assert GAE().gamma == 1.0 and GAE().lam == 0.95  # the module's former defaults: old configs train the same


@pytest.mark.parametrize("estimator", [GRPO(), DrGRPO(), RLOO()], ids=["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_in_a_group_give_exactly_zero_advantage_and_no_policy_gradient(estimator):
    returns = [0.1, 0.1, 0.1, 0.1, 1 / 3, 1 / 3, 1 / 3, 1 / 3]  # sums that do not round to their mean exactly
    mask = torch.ones(8, 2)
    rewards = torch.stack([torch.tensor([0.0, r]) for r in returns])
    advantages, _ = estimator(rewards, mask, None, group_size=4)
    assert not advantages.isnan().any()
    assert (advantages == 0).all()
    logprobs = torch.randn(8, 2, requires_grad=True)
    loss = pm.policy_loss(logprobs, logprobs.detach() - 0.1, advantages, mask, cliprange=0.2).loss
    loss.backward()
    assert (logprobs.grad == 0).all()


def test_group_advantages_refuses_an_unknown_baseline():
    with pytest.raises(ValueError, match="baseline must be 'mean' or 'leave_one_out'"):
        pm.group_advantages(torch.zeros(4), 2, baseline="median")


# ---------------------------------------------------------------------- the contract, for every registered estimator
NAMES = [entry.name for entry in registry("advantage_estimator").entries()]


@pytest.mark.parametrize("name", NAMES)
def test_contract_shapes_masking_and_returns(name):
    estimator: AdvantageEstimator = registry("advantage_estimator").build(name)
    group_size = max(2, estimator.min_group_size)
    gen = torch.Generator().manual_seed(2)
    rewards = torch.randn(4 * group_size, 6, generator=gen)
    values = torch.randn(4 * group_size, 6, generator=gen)
    mask = (torch.arange(6) < torch.randint(1, 7, (4 * group_size, 1), generator=gen)).float()
    advantages, returns = estimator(rewards, mask, values if estimator.needs_critic else None, group_size)
    assert advantages.shape == rewards.shape and torch.isfinite(advantages).all()
    assert (advantages[mask == 0] == 0).all()
    assert (returns is not None) == estimator.needs_critic
    if returns is not None:
        assert returns.shape == rewards.shape and (returns[mask == 0] == 0).all()
    assert estimator.loss_aggregation in (None, *registry("loss_aggregation").names()) and estimator.min_group_size >= 1


def test_builtin_estimators_are_registered_and_listed():
    assert {"gae", "grpo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "reinforce++"} <= set(registry("advantage_estimator").names())
    assert isinstance(registry("advantage_estimator").build("REINFORCE++"), ReinforcePlusPlus)


# ---------------------------------------------------------------------- the module
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(advantage_estimator="gae", critic="none"),
            r"model.critic must be separate or shared with model.advantage_estimator GAE, got 'none'",
        ),
        (
            dict(advantage_estimator="rloo", num_generations=4, critic="shared"),
            r"model.critic must be none with model.advantage_estimator RLOO, got 'shared'",
        ),
        (dict(advantage_estimator="grpo"), r"model.sampling.num_generations must be >= 2 with model.advantage_estimator GRPO .*, got 1"),
        (
            dict(advantage_estimator="rloo", num_generations=2, critic_lr=1e-3),
            r"model.optim.critic_lr and model.optim.optimizers must be unset without a critic",
        ),
        (dict(num_generations=0), r"model.sampling.num_generations must be an integer >= 1, got 0"),
        (
            dict(advantage_estimator="median"),
            r"unknown advantage_estimator 'median'; registered advantage_estimator names: dr_grpo, gae, grpo",
        ),
        (dict(advantage_estimator="gae", critic="tiny"), r"model.critic must be 'separate', 'shared', 'none' or null, got 'tiny'"),
    ],
)
def test_start_up_checks_name_both_fields(kwargs, message):
    from rlhf_lightning.module import PPORLHF

    with pytest.raises((ValueError, KeyError), match=message):
        PPORLHF(policy="tiny", **kwargs)


def test_critic_free_module_has_no_critic_anywhere(tmp_path):
    module = make_module(advantage_estimator="grpo", sampling=dict(num_generations=2), optim=dict(critic_lr=None))
    assert module.hparams.critic == "none" and module.critic is None and module.ppo.whiten_advantages is False
    trainer, history = fit(module, tmp_path, iterations=2, batch_size=4)
    assert len(trainer.optimizers) == 1
    assert not [k for k in module.state_dict() if k.startswith("critic")]
    ckpt = tmp_path / "c.ckpt"
    trainer.save_checkpoint(ckpt)
    assert not [k for k in torch.load(ckpt, weights_only=True)["state_dict"] if "critic" in k]
    assert history.series("response/count") == [8.0, 8.0]  # 4 prompts x 2 responses
    assert "value/loss" not in history.rows[-1] and math.isfinite(history.rows[-1]["policy/loss"])


def test_the_default_still_builds_a_whitened_gae_with_a_separate_critic():
    module = make_module()
    assert isinstance(module.advantage_estimator, GAE)
    assert module.hparams.critic == "separate" and module.critic.trunk is not None
    assert module.ppo.whiten_advantages is True


def test_rollout_groups_each_prompts_responses_in_consecutive_rows(tmp_path):
    seen = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((list(batch), outputs["rollout"].prompts, list(outputs["rollout"].response_texts)))

    fit(
        make_module(advantage_estimator="rloo", sampling=dict(num_generations=3), optim=dict(critic_lr=None)),
        tmp_path,
        iterations=1,
        batch_size=2,
        callbacks=[Record()],
    )
    ((batch, prompts, responses),) = seen
    assert prompts == [batch[0]] * 3 + [batch[1]] * 3
    assert len(set(responses)) > 1  # each response of a group is its own sample


def test_a_plugin_returning_the_wrong_shape_is_named():
    class Broken(RLOO):
        def __call__(self, rewards, mask, values, group_size, sum_fn=None):
            return rewards[:, :1], None

    module = make_module(advantage_estimator=Broken(), sampling=dict(num_generations=2), optim=dict(critic_lr=None))
    rollout = module.rollout(["hello", "hello"])
    with pytest.raises(ValueError, match=r"shapes of advantage estimator Broken must be \(\(2, \d+\), None\).*got \(\(2, 1\), None\)"):
        module.compute_advantages(torch.zeros_like(rollout.response_mask), rollout)


# ---------------------------------------------------------------------- against the closed-form optimum
@pytest.mark.parametrize("name, num_generations", [("rloo", 4), ("grpo", 4), ("reinforce_pp", 1)])
def test_critic_free_estimators_with_k1_in_the_reward_reach_the_optimum(name, num_generations):
    """The fast version of python -m tools.studies.optimum_check --advantage NAME: 60 iterations of 48 responses
    on the enumerable task (a few seconds each); measured gaps 0.0027 (rloo), 0.0044 (grpo), 0.0133 (reinforce_pp)."""
    _, tracker = train(
        TASKS["terminal"],
        60,
        batch_size=48,
        every=60,
        seed=0,
        lr_final=0.1,
        lr=2e-3,
        ppo_epochs=4,
        num_minibatches=2,
        kl_estimator="k1",
        beta_controller=FixedBeta(0.5),
        advantage_estimator=name,
        num_generations=num_generations,
        log_samples_every_n_steps=0,
    )
    start, end = tracker.rows[0], tracker.last
    assert start["gap"] > 0.3
    assert end["gap"] < 0.02, end


def test_reinforce_is_the_plain_return_to_go():
    rewards = torch.tensor([[-0.5, 0.0, 1.0], [0.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = registry("advantage_estimator").build("reinforce")(rewards, mask, None, group_size=1)
    assert returns is None
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 1.0, 1.0], [2.0, 2.0, 0.0]]))  # the sums by hand
