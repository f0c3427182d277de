"""The loop with an environment (``model.environment: lab_chance``) against the soft-Bellman optimum of two-turn tasks
with a stochastic environment (rlhf_lightning/exact/episode_tasks.py): the recommended recipes land within 0.02 of J*,
and the two mistakes land elsewhere: counting the environment's token as the policy's (``policy_tokens_only: false``)
settles where :func:`~rlhf_lightning.exact.episodes.environment_tokens_counted` says, and the episode tilt, the target
a whole-trajectory reading of the objective would give, is never reached: its value lies far above what any policy
earns, and the runs' first turns are far from its. About 1.5 minutes a cell on an idle 2-vCPU machine, 5-6 at load 10
(convergence tier).

The tasks: ExactEpisodeTask.random(seed) for the seeds in ``TASKS``, the three of seeds 0-11 where the tilt's policy
earns least against J* (the effect is large): 2 prompts, turns of 2 tokens over 2 symbols, 2 observations; at beta
0.5 under each network's reference (docs/results.md, "Episodes: the recipes against the soft-Bellman optimum"):

    seed  J*     the tilt's value  the tilt's policy  the counted environment's fixed point
    5     0.827  1.607             0.572              0.641
    7     1.064  1.665             0.666              0.450
    8     0.705  2.100             0.134              -0.246

The settings (2026-12-08, issue #66): 400 iterations of 384 episodes, 2 PPO epochs of 4 minibatches (96 episodes a
step). What held the first try (100 iterations, 1 epoch of 8 minibatches of 48) 0.09 short of J* was the run, not the
loop nor the network: the loop's rollouts of this task are the enumerated ones, its rewards, returns and values as the
recursion needs them (tests/test_exact_episodes.py, test_the_loops_episodes_on_the_lab_task_are_the_enumerated_ones);
exact gradient ascent on J through the same tiny network ends 0.0045 below J* on task 5 (its capacity); and the loop's
gap keeps falling with iterations: at 200 iterations the recipes ended 0.007 to 0.022 short of J* on task 5, at 400
0.003 to 0.010.
"""

from __future__ import annotations

import pytest

from rlhf_lightning.exact.episode_tasks import ExactEpisodeTask
from rlhf_lightning.exact.training import train
from rlhf_lightning_plugins.advantage_estimators import GAE
from rlhf_lightning_plugins.beta_controllers import FixedBeta

pytestmark = [
    pytest.mark.convergence,
    pytest.mark.filterwarnings("ignore:.*eval mode.*", "ignore:.*val_dataloader.*", "ignore:.*LeafSpec.*", "ignore:.*policy_tokens_only.*"),
]

BETA = 0.5
TASKS = (5, 7, 8)
ITERATIONS = 400
GAE_SETTINGS = dict(advantage_estimator=GAE(lam=1.0), critic_lr=2e-3, vf_coef=0.5, lr_final=0.1)
RLOO_SETTINGS = dict(advantage_estimator="rloo", num_generations=8, lr_final=0.02)
RECIPES = {
    "k1-reward-gae": dict(kl_estimator="k1", kl_penalty="reward", **GAE_SETTINGS),
    "k3-loss-sequence-rloo": dict(kl_estimator="k3", kl_penalty="loss", kl_loss_scope="sequence", whiten_advantages=False, **RLOO_SETTINGS),
    "k3-loss-sequence-gae": dict(kl_estimator="k3", kl_penalty="loss", kl_loss_scope="sequence", whiten_advantages=False, **GAE_SETTINGS),
    "full-both-gae": dict(kl_estimator="full", kl_penalty="both", kl_loss_scope="sequence", whiten_advantages=False, **GAE_SETTINGS),
}


def run(task: int, seed: int, **settings) -> dict[str, float]:
    """The last exact row of a run on task ``task`` at ``BETA`` with sampling seed ``seed``."""
    _, tracker = train(
        ExactEpisodeTask.random(task),
        ITERATIONS,
        batch_size=384,
        every=ITERATIONS,
        seed=seed,
        beta_controller=FixedBeta(BETA),
        lr=2e-3,
        ppo_epochs=2,
        num_minibatches=4,
        log_samples_every_n_steps=0,
        **settings,
    )
    return tracker.last


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("task", TASKS)
def test_recommended_recipes_reach_the_soft_bellman_optimum_not_the_tilt(task, recipe, seed):
    end = run(task, seed, **RECIPES[recipe])
    assert end["optimum"] - end["objective"] < 0.02, end
    assert end["tilt_value"] - end["objective"] > 0.5, end  # the tilt's value is out of any policy's reach
    assert end["distance_to_tilt"] > 5 * end["kl_to_optimum"], end  # and its first turn is not where the run went


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("task", TASKS)
def test_counting_the_environments_token_lands_where_the_lab_says(task, seed):
    """policy_tokens_only: false with k1 in the reward and gae: the policy also learns to predict o, and its first turn
    settles on the counted fixed point, 0.19 to 0.98 below J* (2026-12-08: KL(pi1 || pi1_counted) 0.0016-0.030 at the
    end where KL(pi1 || pi1*) is 0.37-1.96; J within 0.03 of the fixed point's on tasks 5 and 8, 0.07-0.09 above it on
    task 7, a third of its distance to J* at most)."""
    end = run(task, seed, policy_tokens_only=False, old_logprobs="forward", **RECIPES["k1-reward-gae"])
    assert end["optimum"] - end["objective"] > 0.1, end
    assert end["distance_to_counted"] < 0.05 * end["kl_to_optimum"], end
    assert abs(end["objective"] - end["counted_objective"]) < (end["optimum"] - end["objective"]) / 3, end
