"""Sampler-side trust regions (``trust_regions``: icepop, ipo, m2po as ``model.off_policy.correction`` modes) on
hand-made ratios, their declared class, and the guard that a run never trains on zero weights silently
(``weight_guard``); the lab's cells against J* are marked ``convergence``."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from rlhf_lightning import recipes, trust_regions
from rlhf_lightning.args import OffPolicyArgs, SamplingArgs
from rlhf_lightning.checks import ConfigError
from rlhf_lightning.interfaces import Samples
from rlhf_lightning.sampling import correction_weights, off_policy_weight_metrics
from rlhf_lightning.weight_guard import WeightGuard, ZeroWeightsError, weight_mass
from rlhf_lightning_plugins.rollout_engines import HFGenerate

LOG = math.log


def ratios(*r: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(trainer, sampler) log-probs of one response whose tokens have the ratios ``r`` = pi_prox / mu, mu = 0.1 each."""
    sampler = torch.full((1, len(r)), LOG(0.1))
    return sampler + torch.tensor([[LOG(x) for x in r]]), sampler


def test_icepop_keeps_the_ratios_inside_its_band():
    """Band [0.5, 5]: r = 0.4 and 6 leave it (weight 0), 0.6, 1 and 4.9 stay with their ratio as weight; a padded token is 0."""
    trainer, sampler = ratios(0.4, 0.6, 1.0, 4.9, 6.0)
    mask = torch.ones_like(trainer)
    weights = correction_weights(trainer, sampler, mask, "icepop", (0.5, 5.0))
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.6, 1.0, 4.9, 0.0]]))
    mask[0, 2] = 0
    assert correction_weights(trainer, sampler, mask, "icepop", (0.5, 5.0))[0, 2] == 0
    metrics = off_policy_weight_metrics(trainer, sampler, torch.ones_like(trainer), "icepop", (0.5, 5.0))
    # two of five masked; mass (0.6 + 1 + 4.9) / 5 = 1.3; ESS 6.5^2 / (5 * (0.36 + 1 + 24.01)); the band removes
    # 0.4 + 6 of the exact weights' 12.9
    assert metrics == pytest.approx(
        {
            "off_policy/clipped_fraction": 0.4,
            "off_policy/trust_masked_fraction": 0.4,
            "off_policy/weight_mass": 1.3,
            "off_policy/ess": 6.5**2 / (5 * 25.37),
            "off_policy/cap_removed": 6.4 / 12.9,
        }
    )


def test_ipo_masks_by_the_difference_in_probability():
    """mu = (0.5, 0.5, 0.1, 0.9), pi_prox = (0.85, 0.75, 0.45, 0.55): |pi - mu| = (0.35, 0.25, 0.35, 0.35), so at
    delta 0.3 only the second token stays, weight 0.75 / 0.5 = 1.5; at delta 0.4 all stay, each its ratio."""
    sampler = torch.tensor([[LOG(0.5), LOG(0.5), LOG(0.1), LOG(0.9)]])
    trainer = torch.tensor([[LOG(0.85), LOG(0.75), LOG(0.45), LOG(0.55)]])
    mask = torch.ones_like(trainer)
    torch.testing.assert_close(correction_weights(trainer, sampler, mask, "ipo", 0.3), torch.tensor([[0.0, 1.5, 0.0, 0.0]]))
    torch.testing.assert_close(correction_weights(trainer, sampler, mask, "ipo", 0.4), torch.tensor([[1.7, 1.5, 4.5, 0.55 / 0.9]]))
    # a large ratio on an unlikely token is kept (0.001 -> 0.01: 10x, 0.009 apart), which icepop's band would drop
    small = correction_weights(torch.tensor([[LOG(0.01)]]), torch.tensor([[LOG(0.001)]]), torch.ones(1, 1), "ipo", 0.3)
    assert small.item() == pytest.approx(10.0)


def test_m2po_masks_the_largest_second_moments_until_the_rest_fits():
    """log r = (0, 0.1, -0.2, 0.5, 1): M2 = (0, 0.01, 0.04, 0.25, 1), mean 0.26 > tau 0.04; masking 1 leaves 0.3 / 4 =
    0.075, still above; masking 0.25 too leaves 0.05 / 3 = 0.0167 <= 0.04: the last two masked, the rest weighed by r."""
    log_r = torch.tensor([[0.0, 0.1, -0.2, 0.5, 1.0]])
    sampler = torch.full_like(log_r, LOG(0.1))
    mask = torch.ones_like(log_r)
    weights = correction_weights(sampler + log_r, sampler, mask, "m2po", 0.04)
    torch.testing.assert_close(weights, torch.tensor([[1.0, math.exp(0.1), math.exp(-0.2), 0.0, 0.0]]))
    # already within tau: nothing masked. A share per row weighs the batch mean: M2 = (0, 0.09), tau 0.05: each row once,
    # 0.09 / 2 = 0.045 fits; row 1 twice, 0.18 / 3 = 0.06 does not, and row 1 is masked
    assert correction_weights(sampler + 0.1 * log_r, sampler, mask, "m2po", 0.04).ne(0).all()
    two = torch.tensor([[0.0], [0.3]])
    assert trust_regions.keep_mask("m2po", two, two, torch.ones_like(two), 0.05).flatten().tolist() == [True, True]
    keep = trust_regions.keep_mask("m2po", two, two, torch.ones_like(two), 0.05, share=torch.tensor([1.0, 2.0]))
    assert keep.flatten().tolist() == [True, False]


def test_the_settings_and_the_class():
    """model.off_policy.correction takes the trust regions, their setting from trust_band (null: the default), checked
    where declared naming the field; each is approximate and warns at start-up like the token correction."""
    sampling = SamplingArgs(old_logprobs="forward")
    assert OffPolicyArgs(max_staleness=1, correction="icepop").weights(sampling) == ("icepop", (0.5, 5.0))
    assert OffPolicyArgs(max_staleness=1, correction="icepop", trust_band=[0.8, 1.25]).weights(sampling) == ("icepop", (0.8, 1.25))
    assert OffPolicyArgs(max_staleness=2, correction="ipo").weights(sampling) == ("ipo", 0.3)
    assert OffPolicyArgs(max_staleness=2, correction="m2po", trust_band=0.1).weights(sampling) == ("m2po", 0.1)
    with pytest.raises(ConfigError, match=r"model\.off_policy\.trust_band.*icepop's band"):
        OffPolicyArgs(correction="icepop", trust_band=[2.0, 5.0])
    with pytest.raises(ConfigError, match=r"model\.off_policy\.trust_band"):
        OffPolicyArgs(correction="ipo", trust_band=-1.0)
    with pytest.raises(ConfigError, match=r"model\.off_policy\.min_weight_mass"):
        OffPolicyArgs(min_weight_mass=1.5)
    for name in trust_regions.TRUST_REGIONS:
        assert recipes.off_policy_recipe(name, 1)[0] == "approximate"
        assert recipes.off_policy_recipe(name, 0)[0] == "on_policy"
        text = recipes.off_policy_warning(name, 2)
        assert text.startswith(f"model.off_policy.correction {name} with model.off_policy.max_staleness 2 is approximate: the {name} trust")


def test_the_guard_warns_once_or_stops_by_hand():
    """Weights (0, 0.02; 0.04, pad): mass 0.06 / 3 = 0.02 < 0.05 warns once, naming the settings; stop raises."""
    weights, mask = torch.tensor([[0.0, 0.02], [0.04, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert weight_mass(weights, mask) == pytest.approx(0.02)
    guard = WeightGuard.of(OffPolicyArgs(max_staleness=2, correction="icepop"), SamplingArgs(old_logprobs="forward"))
    with pytest.warns(
        UserWarning, match=r"average 0\.02 per token.*model\.off_policy\.correction icepop with model\.off_policy\.trust_band"
    ):
        assert guard.check(weights, mask) == pytest.approx(0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.check(weights, mask)  # once
        assert guard.check(None, mask) is None and guard.check(torch.ones(2, 2), mask) == 1.0
    with pytest.raises(ZeroWeightsError, match=r"model\.sampling\.rollout_correction mis with model\.sampling\.rollout_correction_cap 2"):
        WeightGuard.of(OffPolicyArgs(stop_on_zero_weights=True), SamplingArgs(old_logprobs="forward", rollout_correction="mis")).check(
            weights, mask
        )
    assert WeightGuard(0.0, "").check(weights, mask) is None  # floor 0: no check


class FarOffSampler(HFGenerate):
    """``hf``'s draw with the sampler's log-probs replaced by 0 (it claims probability 1 for every token it drew): log-probs
    far off the trainer's, as an engine with a broken log-prob path returns them."""

    def sample(self, module, enc, seed) -> Samples:
        samples = super().sample(module, enc, seed)
        response = samples.sequences[:, enc["input_ids"].shape[1] :]
        return Samples(samples.sequences, logprobs=torch.zeros(response.shape))


def test_a_run_with_far_off_sampler_logprobs_never_trains_on_zero_weights_silently(tmp_path):
    """The tiny model, ``mis`` at cap 2 and a sampler whose log-probs say 1 for every token: every ratio pi_old / 1 is
    below 1 / 2 (the tiny model's tokens are far less likely), every weight 0, the loss 0. The run warns once, naming
    the correction, with off_policy-free metrics unchanged; with stop_on_zero_weights it stops with the error."""
    from helpers import fit, make_module

    run = dict(rollout_engine=FarOffSampler(), sampling=dict(old_logprobs="forward", rollout_correction="mis"), ppo=dict(epochs=1))
    module = make_module(**run)
    with pytest.warns(UserWarning, match=r"average 0 per token.*model\.sampling\.rollout_correction mis") as record:
        _, history = fit(module, tmp_path, 2, batch_size=4)
    assert sum("per token" in str(w.message) for w in record) == 1
    assert all(float(out["rollout"].is_weights.abs().sum()) == 0 for out in history.outputs)
    module = make_module(**run, off_policy=dict(stop_on_zero_weights=True))
    with pytest.raises(ZeroWeightsError, match=r"stop_on_zero_weights true"):
        fit(module, tmp_path / "stop", 1, batch_size=4)


# ---------------------------------------------------------------------- the lab: where each lands against J* (minutes)


@pytest.mark.convergence
@pytest.mark.parametrize("correction", ["icepop", "ipo", "m2po"])
def test_with_a_stale_sampler_each_trust_region_lands_on_pi_star(correction):
    """``python -m tools.studies.trust_regions --staleness 2 --drift --no-synchronous --corrections <name>``: k3 in the loss on
    random:3, 60 exact iterations, the sampler 2 updates behind. Where the policy stops moving mu = pi_prox, every ratio is 1
    and nothing is masked: each lands on pi* as the sequence correction does (docs/async.md, "Sampler-side trust
    regions": measured 0.0022 icepop, 0.0019 ipo, 0.0014 m2po; sequence 0.0018, synchronous 0.0021)."""
    from tools.studies.trust_regions import cell

    row = cell(correction, 2, 0.0)
    assert row["gap"] < 0.005, row
    assert row["off_policy/trust_masked_fraction"] < 0.05, row


@pytest.mark.convergence
@pytest.mark.parametrize("correction", ["sequence", "icepop", "ipo", "m2po"])
def test_a_sampler_that_stays_off_keeps_its_masked_tokens_off_pi_star(correction):
    """The sampler's logit of the first symbol 2 too high at every state (``--drift 2``), no staleness: the sequence
    weight pi_prox(y) / mu(y) is exact and lands on pi* (0.0018); icepop's band masks the drifted token where pi_prox
    gives it little mass (43% of the tokens, gap 0.131), ipo's delta where the probabilities part by more than 0.3 (34%,
    0.141), m2po nearly every token (99.8%, 1.25: the weights' mass 0.002, below the guard's floor), and their gradients
    are never taken: each lands off pi*."""
    from tools.studies.trust_regions import cell

    row = cell(correction, 0, 2.0)
    if correction == "sequence":
        assert row["gap"] < 0.005, row
    else:
        assert row["gap"] > 0.05 and row["off_policy/trust_masked_fraction"] > 0.05, row
