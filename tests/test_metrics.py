"""The logged metrics as pure functions (rlhf_lightning/metrics.py), each against values worked out by hand on a
two-response trajectory:

    response 0: 3 tokens, ends with EOS, kl_t = (0.5, 0.25, 0.25), entropy (1, 1, 1), r = 1.0, beta 0.1
    response 1: 2 of 3 tokens, cut without EOS, kl_t = (1.0, 1.0, 0),  entropy (2, 2, -), r = 3.0, beta 0.3

so the KL per response is 1.0 and 2.0 (mean 1.5), per token 3.0 / 5 = 0.6, the entropy 7 / 5 = 1.4, the length
2.5, the penalty E[beta KL] = (0.1 * 1 + 0.3 * 2) / 2 = 0.35 and the net 2.0 - 0.35 = 1.65."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.data import PromptTable
from rlhf_lightning.metrics import entropy_controller_input, prompt_stats, rollout_metrics, staleness_metrics
from rlhf_lightning.trajectory import Scored, Trajectory

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
KL = torch.tensor([[0.5, 0.25, 0.25], [1.0, 1.0, 0.0]])
BETAS = torch.tensor([0.1, 0.3], dtype=torch.float64)


def trajectory(**overrides) -> Trajectory:
    logprobs = torch.full((2, 3), -1.0)
    fields = dict(
        prompts=["a", "b"],
        response_texts=["x", "y"],
        input_ids=torch.zeros(2, 4, dtype=torch.long),
        attention_mask=torch.ones(2, 4, dtype=torch.long),
        responses=torch.zeros(2, 3, dtype=torch.long),
        response_mask=MASK,
        ended_with_eos=torch.tensor([True, False]),
        old_logprobs=logprobs,
        trainer_logprobs=logprobs,
        sampler_logprobs=logprobs,
        ref_logprobs=logprobs,
        old_values=None,
        entropy=torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 9.0]]),  # 9: off the mask, never counted
        policy_version=torch.tensor([3, 1]),
    )
    return Trajectory(**{**fields, **overrides})


def scored() -> Scored:
    return Scored(KL, raw_scores=torch.tensor([1.0, 3.0]), scores=torch.tensor([1.0, 3.0]))


def identity(t, op="sum"):
    return t


def test_rollout_metrics_by_hand():
    m = rollout_metrics(trajectory(), scored(), BETAS, identity, per_token_divergence=True)
    expected = {
        "objective/reward": 2.0,
        "objective/kl": 1.5,
        "objective/kl_per_token": 0.6,
        "objective/kl_max": 2.0,
        "objective/kl_to_initial": 1.5,  # the reference does not move: the KL is the drift
        "objective/divergence": 1.5,  # the reverse KL's value: the KL estimate's sum
        "objective/non_score_reward": -0.35,
        "objective/net": 1.65,
        "objective/entropy": 1.4,
        "objective/beta": 0.2,
        "response/length": 2.5,
        "response/eos_fraction": 0.5,
        "response/truncated_fraction": 0.5,
        "response/count": 2.0,
        "rollout/logprob_diff_max": 0.0,
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(value), key
    for absent in ("objective/kl_target", "objective/gold_reward", "sampling/explore", "off_policy/staleness_mean", "off_policy/ess"):
        assert absent not in m


def test_rollout_metrics_weigh_the_kl_by_the_correction_and_add_what_is_given():
    """Correction weights (2, 0.5) on each response's tokens: KL per response 2.0 and 1.0, mean 1.5 again but the
    max 2.0 is response 0's; a sequence-level divergence's values (0.4, 0.8) are its own; the drift to pi_0, the gold
    reward, the target, epsilon, staleness at iteration 4 (versions 3 and 1: 1 and 3) and the weights' ESS."""
    weights = torch.tensor([[2.0], [0.5]]).expand(2, 3)
    rollout = trajectory(is_weights=weights)
    out = scored()
    out.divergence = torch.tensor([0.4, 0.8], dtype=torch.float64)
    m = rollout_metrics(
        rollout,
        out,
        BETAS,
        identity,
        per_token_divergence=False,
        kl_to_initial=torch.tensor([[1.0, 0.0, 0.0], [2.0, 0.0, 0.0]]),
        gold_scores=torch.tensor([0.0, 1.0]),
        kl_target=4.0,
        exploration=0.25,
        iteration=4,
        off_policy_weights=("seq_tis", 5.0),
    )
    assert m["objective/kl"] == pytest.approx((2 * 1.0 + 0.5 * 2.0) / 2)
    assert m["objective/kl_max"] == pytest.approx(2.0)
    assert m["objective/divergence"] == pytest.approx(0.6)
    assert m["objective/non_score_reward"] == pytest.approx(-(0.1 * 0.4 + 0.3 * 0.8) / 2)
    assert m["objective/kl_to_initial"] == pytest.approx(1.5)
    assert m["objective/gold_reward"] == pytest.approx(0.5)
    assert m["objective/kl_target"] == 4.0 and m["sampling/explore"] == 0.25
    assert m["off_policy/staleness_mean"] == pytest.approx(2.0) and m["off_policy/staleness_max"] == 3.0
    assert m["off_policy/ess"] == pytest.approx(1.0)  # the sampler's log-probs are the trainer's: every weight 1


def test_staleness_by_hand():
    m = staleness_metrics(torch.tensor([5, 5, 2, 4]), 6, identity)
    assert m == {"off_policy/staleness_mean": pytest.approx((1 + 1 + 4 + 2) / 4), "off_policy/staleness_max": 4.0}


@pytest.mark.parametrize("per_response, kl_b", [(True, 2.0), (False, 1.0)])
def test_prompt_stats_by_hand(per_response, kl_b):
    """Three prompts in the table, two sampled: a's KL 1.0 over 3 tokens, b's 2.0 over 2 (per token 1/3 and 1)."""
    table = PromptTable(ids=["id-a", "id-b", "id-c"], row_of={"a": 0, "b": 1, "c": 2}, budgets={"id-a": 1.0, "id-b": 4.0, "id-c": 2.0})
    budgets_of = lambda ids: torch.tensor([table.budgets[i] for i in ids], dtype=torch.float64)
    stats = prompt_stats(trajectory(), scored(), BETAS, table, identity, per_response=per_response, budgets_of=budgets_of)
    assert stats.ids == ["id-a", "id-b"]
    assert stats.kl.tolist() == pytest.approx([1.0 if per_response else 1.0 / 3, kl_b])
    assert stats.responses.tolist() == [1.0, 1.0] and stats.betas.tolist() == pytest.approx([0.1, 0.3])
    assert stats.budgets.tolist() == [1.0, 4.0]


def test_entropy_controller_input_mirrors_the_entropy_about_its_target():
    """H = 1 per token, 5 tokens: fed H itself without a target, 5 per response, and target^2 / H with one:
    4 / 1 = 4 (above the target 2: a KL controller raises the coefficient), 4 / 4 = 1 at H = 4."""
    metrics = {"objective/entropy": 1.0, "response/length": 5.0}
    assert entropy_controller_input(metrics, "token_mean", None) == 1.0
    assert entropy_controller_input(metrics, "sequence_sum", None) == 5.0
    assert entropy_controller_input(metrics, "token_mean", 2.0) == 4.0
    assert entropy_controller_input({"objective/entropy": 4.0}, "token_mean", 2.0) == 1.0
