"""Policy losses and loss aggregations against hand-computed values, the contract over the
registry, the entropy bonus and its controller, and the length bias of the aggregations
(tools/studies/length_bias.py). Gradient accumulation under every aggregation: tests/test_module.py."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning import ppo_math as pm
from rlhf_lightning.metrics import entropy_controller_input
from rlhf_lightning.registry import registry
from rlhf_lightning_plugins.beta_controllers import AdaptiveBeta
from rlhf_lightning_plugins.policy_losses import (
    CISPO,
    GSPO,
    ClipHigher,
    ConstantNormaliser,
    DualClip,
    PPOClip,
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    TokenMean,
)
from tools.studies import length_bias

from helpers import make_module, policy_batch

pytestmark = pytest.mark.filterwarnings("ignore:.*eval mode.*", "ignore:.*val_dataloader.*", "ignore:.*LeafSpec.*")


def batch():
    """helpers.policy_batch, test_ppo_math's PPO example: ratios r = pi / pi_old chosen directly (log pi_old = -1)."""
    return policy_batch()[:4]


# ---------------------------------------------------------------------- policy losses by hand
def test_ppo_clip_per_token():
    loss, clipped = PPOClip(0.2)(*batch())
    # max(-A r, -A clip(r, 0.8, 1.2)): row 0: -1.2 (clipped), -0.5, 2.2, masked; row 1: 0.8 (clipped), -3, 2.0, 0.
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 2.2, 0.0], [0.8, -3.0, 2.0, 0.0]], dtype=torch.float64))
    assert clipped.tolist() == [[1, 0, 0, 0], [1, 0, 0, 0]]


def test_clip_higher_per_token():
    loss, clipped = ClipHigher(clip_low=0.2, clip_high=0.28)(*batch())
    # clip to [0.8, 1.28]: r = 1.5, A = 1 -> max(-1.5, -1.28) = -1.28 (clipped); r = 2, A = -1 -> max(2, 1.28) = 2;
    # the rest as PPO's.
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -0.5, 2.2, 0.0], [0.8, -3.0, 2.0, 0.0]], dtype=torch.float64))
    assert clipped.tolist() == [[1, 0, 0, 0], [1, 0, 0, 0]]


def test_dual_clip_caps_negative_advantages():
    ratios = torch.tensor([[4.0, 4.0, 2.0]], dtype=torch.float64)
    advantages = torch.tensor([[-1.0, 1.0, -1.0]], dtype=torch.float64)
    old = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    loss, clipped = DualClip(cliprange=0.2, clip_ratio_c=3.0)(ratios.log(), old, advantages, mask)
    # r = 4, A = -1: PPO gives max(4, 1.2) = 4, capped at -A c = 3; r = 4, A = 1: max(-4, -1.2) = -1.2 (clipped);
    # r = 2, A = -1: max(2, 1.2) = 2 < 3, untouched.
    torch.testing.assert_close(loss, torch.tensor([[3.0, -1.2, 2.0]], dtype=torch.float64))
    assert clipped.tolist() == [[1, 1, 0]]


def test_cispo_truncates_the_weight_and_keeps_every_gradient():
    logprobs, old, advantages, mask = batch()
    loss, clipped = CISPO(clip_high=0.28)(logprobs, old, advantages, mask)
    # loss_t = -min(r, 1.28) * A * log pi; r = 1.5: -1.28 * 1 * (-1 + log 1.5) = 0.761004.
    assert loss[0, 0].item() == pytest.approx(-1.28 * (-1 + math.log(1.5)), abs=1e-9)
    assert clipped.tolist() == [[1, 0, 0, 0], [0, 0, 1, 0]]  # r = 1.5 and r = 2 exceed 1.28
    pm.masked_mean(loss, mask).backward()
    # d/d log pi = -min(r, 1.28) * A / 7 on every real token, clipped ones included (PPO gives them 0).
    weight = torch.tensor([[1.28, 0.5, 1.1, 0.0], [0.5, 1.0, 1.28, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, -weight * advantages * mask / 7)


def test_gspo_clips_one_length_normalised_ratio_per_sequence():
    logprobs, old, advantages, mask = batch()
    loss, clipped = GSPO(clip_low=3e-4, clip_high=4e-4)(logprobs, old, advantages, mask)
    # Row 0: s = exp((log 1.5 + log 0.5 + log 1.1) / 3) = 0.937888, clip range [0.9997, 1.0004]:
    # A = 1: max(-s, -0.9997) = -s; A = -2: max(2s, 1.9994) = 1.9994 (clipped).
    s0 = math.exp((math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3)
    assert s0 == pytest.approx(0.937888, abs=1e-6)
    # Row 1: s = exp((log 0.5 + 0 + log 2 + 0) / 4) = 1: loss = -A.
    expected = torch.tensor([[-s0, -s0, 2 * 0.9997, 0.0], [1.0, -3.0, 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(loss, expected)
    assert clipped.tolist() == [[0, 0, 1, 0], [0, 0, 0, 0]]
    # Gradient with the sequence mean (GSPO's aggregation): every unclipped token of row i gets
    # -A_t * s_i / (|y_i| * N): row 1 (s = 1, |y| = 4, N = 2): (1, -3, 1, 0) / 8.
    weights = SeqMeanTokenMean().weights(mask, max_new_tokens=4)
    (weights * loss).sum().backward()
    torch.testing.assert_close(logprobs.grad[1], torch.tensor([1.0, -3.0, 1.0, 0.0], dtype=torch.float64) / 8)
    torch.testing.assert_close(logprobs.grad[0], torch.tensor([-s0, -s0, 0.0, 0.0], dtype=torch.float64) / 6)


# ---------------------------------------------------------------------- aggregations by hand
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # lengths 3 and 1


@pytest.mark.parametrize(
    "aggregation, row0, row1",
    [
        (TokenMean(), 1 / 4, 1 / 4),  # 4 tokens
        (SeqMeanTokenMean(), 1 / (3 * 2), 1 / (1 * 2)),  # 1 / (|y_i| N)
        (SeqMeanTokenSum(), 1 / 2, 1 / 2),  # 1 / N
        (ConstantNormaliser(), 1 / (2 * 4), 1 / (2 * 4)),  # 1 / (N max_new_tokens)
        (ConstantNormaliser(normaliser=2), 1 / (2 * 2), 1 / (2 * 2)),
    ],
    ids=["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant", "constant-2"],
)
def test_aggregation_weights_by_hand(aggregation, row0, row1):
    weights = aggregation.weights(MASK, max_new_tokens=4)
    torch.testing.assert_close(weights, torch.tensor([[row0] * 3 + [0.0], [row1, 0.0, 0.0, 0.0]]))
    # Two ranks holding the same rows: every global denominator doubles.
    torch.testing.assert_close(aggregation.weights(MASK, max_new_tokens=4, sum_fn=lambda t: 2 * t), weights / 2)


@pytest.mark.parametrize("name", [e.name for e in registry("policy_loss").entries()])
def test_policy_loss_contract(name):
    """Shapes, zero off the mask, a 0/1 clip marker, and on-policy (r = 1) the REINFORCE gradient -A / tokens."""
    loss_fn = registry("policy_loss").build(name)
    gen = torch.Generator().manual_seed(0)
    logprobs = torch.randn(3, 5, generator=gen, dtype=torch.float64).requires_grad_(True)
    advantages = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float64)
    loss, clipped = loss_fn(logprobs, logprobs.detach(), advantages, mask)
    assert loss.shape == clipped.shape == (3, 5)
    assert (loss[mask == 0] == 0).all() and set(clipped.flatten().tolist()) <= {0.0, 1.0} and (clipped == 0).all()
    pm.masked_mean(loss, mask).backward()
    torch.testing.assert_close(logprobs.grad, -advantages * mask / mask.sum())


@pytest.mark.parametrize("name", [e.name for e in registry("loss_aggregation").entries()])
def test_aggregation_contract_weights_are_non_negative_and_zero_off_the_mask(name):
    weights = registry("loss_aggregation").build(name).weights(MASK, max_new_tokens=4)
    assert weights.shape == MASK.shape and (weights >= 0).all() and (weights[MASK == 0] == 0).all()
    assert (weights[MASK == 1] > 0).all()


# ---------------------------------------------------------------------- in the module
def test_loss_aggregation_defaults_follow_the_plugins_and_conflicts_are_refused():
    from rlhf_lightning.module import PPORLHF

    assert isinstance(PPORLHF(policy="tiny").loss_aggregation, TokenMean)
    assert isinstance(PPORLHF(policy="tiny", policy_loss="gspo").loss_aggregation, SeqMeanTokenMean)
    assert isinstance(
        PPORLHF(policy="tiny", advantage_estimator="dr_grpo", sampling=dict(num_generations=2)).loss_aggregation, ConstantNormaliser
    )
    explicit = PPORLHF(policy="tiny", advantage_estimator="dr_grpo", sampling=dict(num_generations=2), loss_aggregation="token_mean")
    assert isinstance(explicit.loss_aggregation, TokenMean)
    with pytest.raises(
        ValueError,
        match=r"model.loss_aggregation must be set when model.policy_loss GSPO and "
        r"model.advantage_estimator DrGRPO are defined with different aggregations",
    ):
        PPORLHF(policy="tiny", policy_loss="gspo", advantage_estimator="dr_grpo", sampling=dict(num_generations=2))
    with pytest.raises(KeyError, match=r"unknown policy_loss 'ppo'; registered policy_loss names: cispo, clip_higher"):
        PPORLHF(policy="tiny", policy_loss="ppo")
    with pytest.raises(ValueError, match=r"policy_loss.clip_high must be a finite number > 0, got -0.1"):
        ClipHigher(clip_high=-0.1)


def test_entropy_bonus_is_minus_coef_times_the_weighted_entropy():
    module = make_module(ppo=dict(entropy_coef=0.5), critic="shared")
    torch.manual_seed(0)
    rollout = module.rollout(["hello", "abc"])
    zeros = torch.zeros_like(rollout.response_mask)
    weights = TokenMean().weights(rollout.response_mask, max_new_tokens=12)
    with torch.no_grad():
        loss = module.update.loss(rollout, zeros, rollout.old_values, torch.arange(2), kl_coef=torch.zeros(2), weights=weights)
        logits, _values = module.networks.policy_outputs(rollout.input_ids, rollout.attention_mask, rollout.responses.shape[1])
    # Zero advantages, values equal to their targets: only the bonus is left (on-policy, entropy as sampled).
    entropy = pm.masked_mean(pm.entropy_of(logits), rollout.response_mask)
    assert loss.item() == pytest.approx(-0.5 * entropy.item(), rel=1e-5)
    with pytest.raises(ValueError, match=r"model.ppo.entropy_coef must be 0 when model.entropy_controller is set, got 0.1"):
        make_module(ppo=dict(entropy_coef=0.1), entropy_controller="adaptive")


@pytest.mark.parametrize("entropy, expected_coef", [(1.0, 0.1 * (1 + 0.2 / 10)), (3.0, 0.1 * (1 - 0.2 / 10)), (2.0, 0.1)])
def test_entropy_controller_raises_the_coefficient_below_the_target(entropy, expected_coef):
    """Adaptive controller, target 2 nats per token, horizon 10, one sample: the input is 4 / H;
    H = 1: 4 / 2 - 1 = 1, clipped to +0.2: beta * (1 + 0.2 / 10); H = 3: 4 / 6 - 1 = -1/3, clipped
    to -0.2: beta * (1 - 0.2 / 10); H = 2: error 0."""
    module = make_module(entropy_controller=AdaptiveBeta(init_beta=0.1, target=2.0, horizon=10, unit="token_mean"))
    module.entropy_controller.update(
        entropy_controller_input({"objective/entropy": entropy, "response/length": 5.0}, "token_mean", 2.0), n_samples=1
    )
    assert module.entropy_controller.beta == pytest.approx(expected_coef)


def test_entropy_controller_state_is_checkpointed():
    module = make_module(entropy_controller=AdaptiveBeta(init_beta=0.1, target=2.0, horizon=10, unit="token_mean"))
    module.entropy_controller.update(
        entropy_controller_input({"objective/entropy": 1.0, "response/length": 5.0}, "token_mean", 2.0), n_samples=1
    )
    checkpoint = {"state_dict": {}}
    module.on_save_checkpoint(checkpoint)
    restored = make_module(entropy_controller=AdaptiveBeta(init_beta=0.1, target=2.0, horizon=10, unit="token_mean"))
    restored.on_load_checkpoint(checkpoint)
    assert restored.entropy_controller.beta == module.entropy_controller.beta == pytest.approx(0.102)


# ---------------------------------------------------------------------- the length bias, measured
def test_a_length_blind_reward_shortens_responses_only_under_the_per_response_token_mean(tmp_path):
    """tools/studies/length_bias.py --fast: constant reward +1, REINFORCE without a baseline. The 1/|y|
    weights make short responses likelier (measured 18.5 -> 12.8 tokens in 12 iterations); the
    length-independent token sum does not move the length (19.2 -> 19.3)."""
    summary = length_bias.main(
        ["--fast", "--seeds", "0", "--aggregations", "seq_mean_token_mean", "seq_mean_token_sum", "--out", str(tmp_path)]
    )
    first, last = summary["seq_mean_token_mean"]
    assert last < first - 3, summary
    first, last = summary["seq_mean_token_sum"]
    assert abs(last - first) < 2, summary


@pytest.mark.convergence
def test_regulariser_frontier_fast_puts_the_kl_penalty_on_the_exact_frontier(tmp_path):
    """tools/studies/regulariser_frontier.py --fast: the beta = 0.5 run lands on the exact frontier well short
    of the reward maximiser's KL, while PPO's clip alone (beta = 0) runs to the maximiser (KL ~4)."""
    from tools.studies import regulariser_frontier

    finals = {row["family"]: row for row in regulariser_frontier.main(["--fast", "--out", str(tmp_path)])}
    assert set(finals) == {"kl_penalty", "clip_higher", "entropy", "none"}
    assert abs(finals["kl_penalty"]["frontier_gap"]) < 0.05 and finals["kl_penalty"]["kl"] < 2.0, finals
    assert finals["none"]["kl"] > 3.0 and finals["none"]["reward"] > 2.9, finals
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "frontier.csv").read_text().startswith("family,setting,seed,iteration,reward,kl")
