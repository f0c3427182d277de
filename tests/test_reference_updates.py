"""A reference that moves: the update plugins' schedules, the parameter update by hand, exactly zero
KL right after a sync, the LoRA reference adapter, the optimizer reset, and checkpoints."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rlhf_lightning.cli import build_cli
from rlhf_lightning.exact.closed_form import ema_reference_logprobs, iterated_optimal_logprobs, optimal_logprobs
from rlhf_lightning.models import move_toward
from rlhf_lightning.registry import registry
from rlhf_lightning_plugins.reference_updates import EMA, NoUpdate, Reset, Sync

from helpers import CONFIGS, fit, make_module

pytestmark = pytest.mark.filterwarnings("ignore:.*eval mode.*", "ignore:.*val_dataloader.*", "ignore:.*LeafSpec.*")


# ---------------------------------------------------------------------- the plugins
def test_schedules_by_hand():
    iterations = range(1, 7)
    assert [NoUpdate().weight(i) for i in iterations] == [0.0] * 6
    assert [Sync(3).weight(i) for i in iterations] == [0, 0, 1, 0, 0, 1]
    assert [Reset(2).weight(i) for i in iterations] == [0, 1, 0, 1, 0, 1]
    assert [EMA(0.25, every_n_iterations=2).weight(i) for i in iterations] == [0, 0.25, 0, 0.25, 0, 0.25]
    assert [EMA(0.25).weight(i) for i in iterations] == [0.25] * 6
    assert Reset.reset_optimizer and not Sync.reset_optimizer and not EMA.reset_optimizer
    assert not NoUpdate.moves and Sync.moves and EMA.moves
    assert {"none", "sync", "reset", "ema"} <= set(registry("reference_update").names())


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Sync(0), "reference_update.every_n_iterations must be an integer >= 1, got 0"),
        (lambda: EMA(0.0), "reference_update.alpha must be a finite number in (0, 1], got 0.0"),
        (lambda: EMA(1.5), "reference_update.alpha must be a finite number in (0, 1], got 1.5"),
        (lambda: EMA(math.nan), "reference_update.alpha must be a finite number in (0, 1], got nan"),
    ],
)
def test_bad_settings_are_refused(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        build()


def test_move_toward_by_hand():
    target, source = [torch.tensor([1.0, 2.0])], [torch.tensor([3.0, 6.0])]
    move_toward(target, source, 0.25)  # 1 + 0.25 * (3 - 1) = 1.5, 2 + 0.25 * (6 - 2) = 3
    assert target[0].tolist() == [1.5, 3.0]
    target = [torch.tensor([1e20, 0.1])]
    move_toward(target, [torch.tensor([1.0, 0.3])], 1.0)  # a copy, bit for bit (1e20 + (1 - 1e20) would be 0)
    assert target[0].tolist() == torch.tensor([1.0, 0.3]).tolist()


def test_ema_of_lora_factors_is_not_the_ema_of_their_product():
    # B_t = 1, A_t = 2, B_s = 3, A_s = 4, alpha = 1/2: lerp(B) lerp(A) = 2 * 3 = 6, lerp(B A) = (2 + 12) / 2 = 7;
    # the difference -1 = -alpha (1 - alpha) (B_s - B_t)(A_s - A_t) = -0.25 * 2 * 2.
    b, a = [torch.tensor([[1.0]])], [torch.tensor([[2.0]])]
    move_toward(b, [torch.tensor([[3.0]])], 0.5)
    move_toward(a, [torch.tensor([[4.0]])], 0.5)
    assert (b[0] @ a[0]).item() == 6.0 and 6.0 - 7.0 == -0.25 * 2 * 2


# ---------------------------------------------------------------------- the exact iterated optimum
BANDIT_REF = torch.tensor([[0.5, 0.5]], dtype=torch.float64).log()
BANDIT_REWARDS = torch.tensor([[1.0, 0.0]], dtype=torch.float64)


def test_iterated_optimum_by_hand():
    # beta = 0.5, k = 2: pi_2 ∝ (0.5 e^4, 0.5), pi_2(a) = e^4 / (e^4 + 1) = 0.982014; and it is the optimum of pi_1's optimum.
    pi_2 = iterated_optimal_logprobs(BANDIT_REF, BANDIT_REWARDS, 0.5, 2)
    assert pi_2.exp()[0, 0].item() == pytest.approx(math.exp(4) / (math.exp(4) + 1), abs=1e-12)
    assert pi_2.exp()[0, 0].item() == pytest.approx(0.982014, abs=1e-6)
    twice = optimal_logprobs(optimal_logprobs(BANDIT_REF, BANDIT_REWARDS, 0.5), BANDIT_REWARDS, 0.5)
    torch.testing.assert_close(pi_2, twice)
    pi_1 = iterated_optimal_logprobs(BANDIT_REF, BANDIT_REWARDS, 0.5, 1)
    torch.testing.assert_close(pi_1, optimal_logprobs(BANDIT_REF, BANDIT_REWARDS, 0.5))


def test_ema_reference_follows_the_iterated_optimum_and_only_stops_on_the_reward_maximiser():
    # One update with alpha = 1/4 from (1/2, 1/2): pi* = (e^2, 1) / (e^2 + 1); the geometric mixture
    # (1/2)^(3/4) pi*^(1/4) ∝ (e^(1/2), 1): ref(a) = e^0.5 / (e^0.5 + 1) = 0.622459 = pi_{1/4}(a).
    ref = ema_reference_logprobs(BANDIT_REF, BANDIT_REWARDS, 0.5, 0.25)
    assert ref.exp()[0, 0].item() == pytest.approx(math.exp(0.5) / (math.exp(0.5) + 1), abs=1e-12)
    assert ref.exp()[0, 0].item() == pytest.approx(0.622459, abs=1e-6)
    # n updates of weight alpha are pi_{n alpha}, on a random 27-response task too.
    gen = torch.Generator().manual_seed(0)
    pi_0 = torch.randn(3, 27, generator=gen, dtype=torch.float64).log_softmax(-1)
    rewards = torch.randn(3, 27, generator=gen, dtype=torch.float64)
    ref, rewards_seen = pi_0, []
    for _ in range(8):
        ref = ema_reference_logprobs(ref, rewards, 0.5, 0.25)
        rewards_seen.append(float((ref.exp() * rewards).sum(-1).mean()))
    torch.testing.assert_close(ref, iterated_optimal_logprobs(pi_0, rewards, 0.5, 8 * 0.25))
    assert all(a < b for a, b in itertools.pairwise(rewards_seen))  # every update raises the reward
    # A fixed point needs ref = pi*(ref) = ref exp(r / beta) / Z: an interior reference always moves, ...
    assert (ema_reference_logprobs(pi_0, rewards, 0.5, 0.25) - pi_0).abs().max() > 0.01
    # ... a reference on the reward's maximisers stays, and the iteration tends to it.
    argmax = torch.full_like(rewards, -math.inf).scatter(-1, rewards.argmax(-1, keepdim=True), 0.0)
    assert torch.equal(ema_reference_logprobs(argmax, rewards, 0.5, 0.25), argmax)
    far = iterated_optimal_logprobs(pi_0, rewards, 0.5, 400 * 0.25)
    assert float((far.exp() * rewards).sum(-1).mean()) == pytest.approx(float(rewards.max(-1).values.mean()), abs=1e-6)


# ---------------------------------------------------------------------- the module
def _policy_params(module):
    return [p for n, p in module.policy.named_parameters() if ".reference." not in n]


@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_update_reference_applies_the_ema_by_hand(lora_rank):
    module = make_module(lora=dict(rank=lora_rank), reference_update=EMA(0.25, every_n_iterations=2))
    refs, policy = module.networks.reference_parameters()
    assert len(refs) == len(policy) and refs and not any(p.requires_grad for p in refs)
    with torch.no_grad():
        for p in policy:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    before = [r.clone() for r in refs]
    module.iteration = 1  # not an update iteration
    module.update_reference()
    assert all(torch.equal(r, b) for r, b in zip(refs, before, strict=True)) and module.reference_updates == 0
    module.iteration = 2
    module.update_reference()
    assert module.reference_updates == 1
    for r, b, p in zip(refs, before, policy, strict=True):
        torch.testing.assert_close(r, b + 0.25 * (p - b), rtol=0, atol=1e-7)


def test_lora_reference_adapter_is_frozen_and_starts_as_the_base():
    module = make_module(lora=dict(rank=4), reference_update="sync")
    plain = make_module(lora=dict(rank=4))
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable == {n for n, p in plain.policy.named_parameters() if p.requires_grad}  # the same optimizer
    assert not any(".reference." in n for n in trainable)
    enc = module.sampler.encode(["hello there", "a b"])
    with torch.no_grad():
        with module.policy.disable_adapter():
            base = module.networks.response_logits(module.policy, enc["input_ids"], enc["attention_mask"], 3)
        with module.networks.reference() as ref:
            reference = module.networks.response_logits(ref, enc["input_ids"], enc["attention_mask"], 3)
    assert torch.equal(reference, base)  # the copied adapter's B is 0: the base, bit for bit
    assert {n for n, p in module.policy.named_parameters() if p.requires_grad} == trainable  # restored


@pytest.mark.parametrize("old_logprobs", ["forward", "sampler"])
@pytest.mark.parametrize("lora_rank", [0, 4], ids=["full", "lora"])
def test_kl_is_exactly_zero_on_the_rollout_after_a_sync(tmp_path, lora_rank, old_logprobs):
    # sampler: log pi_old from generate differs from a forward by rounding, so the zeros hold only
    # because a reference equal to the policy takes the policy's own log-probs.
    module = make_module(lora=dict(rank=lora_rank), sampling=dict(old_logprobs=old_logprobs), reference_update=Sync(2))
    _, history = fit(module, tmp_path, iterations=5)
    kl, kl_max, kl_initial = (history.series(k) for k in ("objective/kl", "objective/kl_max", "objective/kl_to_initial"))
    assert history.series("reference/updates") == [0, 0, 1, 1, 2]  # logged before the update after iterations 2 and 4
    assert kl[0] == 0.0 and kl[2] == 0.0 and kl[4] == 0.0 and kl_max[2] == kl_max[4] == 0.0, kl
    assert kl[1] != 0.0 and kl[3] != 0.0
    assert kl_initial[1] == kl[1]  # before the first sync the reference is the starting policy
    assert kl_initial[2] != 0.0 and kl_initial[4] != 0.0  # the drift the penalty no longer sees
    assert module.reference_updates == 2


def test_frozen_reference_logs_kl_to_initial_as_kl(tmp_path):
    _, history = fit(make_module(), tmp_path, iterations=2)
    assert history.series("objective/kl_to_initial") == history.series("objective/kl")
    assert history.series("reference/updates") == [0.0, 0.0]


def test_reset_clears_the_policy_optimizer_state_and_keeps_the_critics(tmp_path):
    module = make_module(reference_update=Reset(3))
    trainer, _ = fit(module, tmp_path, iterations=3)  # the reset runs at the end of iteration 3
    (opt,) = trainer.optimizers
    policy_group, critic_group = opt.param_groups
    assert not any(p in opt.state for p in policy_group["params"]) and all(p in opt.state for p in critic_group["params"])
    module = make_module(reference_update=Sync(3))
    trainer, _ = fit(module, tmp_path, iterations=3)
    assert all(p in trainer.optimizers[0].state for p in module.policy.parameters())  # a sync keeps it


def test_checkpoint_holds_a_moved_reference_and_restores_it(tmp_path):
    module = make_module(reference_update=Sync(2))
    trainer, _ = fit(module, tmp_path, iterations=2)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["rlhf_lightning"]["reference_updates"] == 1
    keys = checkpoint["state_dict"]
    assert any(k.startswith("ref_model.") for k in keys) and not any(k.startswith("initial_model.") for k in keys)
    restored = make_module(reference_update=Sync(2))
    restored.on_load_checkpoint(checkpoint)
    restored.load_state_dict(checkpoint["state_dict"])
    assert restored.reference_updates == 1
    for a, b in zip(restored.ref_model.parameters(), module.policy.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(restored.initial_model.parameters(), make_module().policy.parameters(), strict=True):
        assert torch.equal(a, b)  # pi_0 is rebuilt from the config


def test_reference_update_from_the_cli_by_short_name_and_class_path():
    cli = build_cli(["--config", str(CONFIGS / "tiny.yaml"), "--model.reference_update=reset"], run=False)
    assert type(cli.model.reference_update) is Reset and cli.model.reference_update.every_n_iterations == 1
    cli = build_cli(
        ["--config", str(CONFIGS / "tiny.yaml"), "--model.reference_update=EMA", "--model.reference_update.init_args.alpha=0.2"], run=False
    )
    assert type(cli.model.reference_update) is EMA and cli.model.reference_update.alpha == 0.2
