"""rlhf_lightning.ppo_math: every function against hand-derived numbers or a plain reference loop.

Conventions: ``mask`` is a contiguous prefix of ones (real response tokens, up to and including
the first EOS) followed by zeros (padding); shapes are (batch, response_len).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_lightning import ppo_math as pm

from helpers import policy_batch

EPS = 1e-8  # the constant masked_whiten adds to the std


def _prefix_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).double()


class _FakeAllReduce:
    """Simulates all_reduce(SUM) across two ranks without knowing how a function packs its sums.

    Run the function once on rank B's data with ``record`` (identity, remembers each tensor it
    sees), then on rank A's data with ``replay`` (adds rank B's tensor from the same call index).
    """

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.calls = 0

    def record(self, t: torch.Tensor) -> torch.Tensor:
        self.seen.append(t.clone())
        return t

    def replay(self, t: torch.Tensor) -> torch.Tensor:
        other = self.seen[self.calls]
        self.calls += 1
        return t + other


# ---------------------------------------------------------------------------------------------
# masked_mean / masked_var / masked_whiten


@pytest.fixture
def masked_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=g, dtype=torch.float64) * 3 + 1
    mask = _prefix_mask([7, 3, 1, 5], 7)
    return x, mask


def test_masked_mean_hand_example():
    # valid entries: 1, 2, 3 (row 0) and 10 (row 1); masked 100s are ignored.
    # mean = (1 + 2 + 3 + 10) / 4 = 4
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert pm.masked_mean(x, mask).item() == pytest.approx(4.0)


def test_masked_var_hand_example():
    # valid entries 1, 2, 3, 10: mean 4; squared deviations 9 + 4 + 1 + 36 = 50;
    # unbiased var = 50 / (4 - 1) = 16.666...
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 100.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert pm.masked_var(x, mask).item() == pytest.approx(50.0 / 3.0)


def test_masked_whiten_hand_example():
    # valid 1, 2, 3, 10: mean 4, std = sqrt(50 / 3) = 4.08248...
    # whitened valid = (-3, -2, -1, 6) / 4.08248 = (-0.73485, -0.48990, -0.24495, 1.46969); masked -> 0
    x = torch.tensor([[1.0, 2.0, 3.0], [10.0, 100.0, -100.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    std = math.sqrt(50.0 / 3.0)
    expected = torch.tensor([[-3 / std, -2 / std, -1 / std], [6 / std, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(pm.masked_whiten(x, mask), expected, rtol=1e-7, atol=1e-7)


def test_masked_stats_match_manual_on_valid_entries(masked_batch):
    x, mask = masked_batch
    valid = x[mask.bool()]
    assert valid.numel() == 16
    torch.testing.assert_close(pm.masked_mean(x, mask), valid.mean())
    torch.testing.assert_close(pm.masked_var(x, mask), valid.var(unbiased=True))
    expected = torch.zeros_like(x)
    expected[mask.bool()] = (valid - valid.mean()) / (valid.std(unbiased=True) + EPS)
    torch.testing.assert_close(pm.masked_whiten(x, mask), expected)


def test_masked_whiten_without_shift_keeps_the_mean(masked_batch):
    # shift_mean=False (TRL's whiten): (x - mean) / std + mean on valid positions, 0 elsewhere.
    x, mask = masked_batch
    valid = x[mask.bool()]
    expected = torch.zeros_like(x)
    expected[mask.bool()] = (valid - valid.mean()) / (valid.std() + EPS) + valid.mean()
    out = pm.masked_whiten(x, mask, shift_mean=False)
    torch.testing.assert_close(out, expected)
    assert pm.masked_mean(out, mask).item() == pytest.approx(valid.mean().item(), abs=1e-9)


def test_masked_whiten_gives_zero_mean_unit_var(masked_batch):
    x, mask = masked_batch
    out = pm.masked_whiten(x, mask)
    assert pm.masked_mean(out, mask).item() == pytest.approx(0.0, abs=1e-9)
    assert pm.masked_var(out, mask).item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("fn", [pm.masked_mean, pm.masked_var, pm.masked_whiten])
def test_masked_positions_do_not_matter(masked_batch, fn):
    x, mask = masked_batch
    garbage = x.clone()
    garbage[~mask.bool()] = torch.linspace(-1e4, 1e4, int((~mask.bool()).sum()), dtype=x.dtype)
    assert not torch.equal(garbage, x)
    torch.testing.assert_close(fn(garbage, mask), fn(x, mask), rtol=0, atol=0)


def test_sum_fn_doubling_leaves_mean_unchanged(masked_batch):
    # Two identical ranks: all_reduce doubles every sum; the mean of two copies is the same mean.
    x, mask = masked_batch
    double = lambda t: 2 * t
    torch.testing.assert_close(pm.masked_mean(x, mask, sum_fn=double), pm.masked_mean(x, mask))


def test_sum_fn_doubling_gives_variance_of_two_copies(masked_batch):
    # Unbiased variance of the 32 values of two copies = pop_var * 32 / 31, not the local 16 / 15.
    x, mask = masked_batch
    double = lambda t: 2 * t
    valid = x[mask.bool()]
    both = torch.cat([valid, valid])
    torch.testing.assert_close(pm.masked_var(x, mask, sum_fn=double), both.var(unbiased=True))
    expected = torch.zeros_like(x)
    expected[mask.bool()] = (valid - both.mean()) / (both.std() + EPS)
    torch.testing.assert_close(pm.masked_whiten(x, mask, sum_fn=double), expected)


@pytest.mark.parametrize("fn", [pm.masked_mean, pm.masked_var])
def test_sum_fn_two_different_ranks_gives_global_statistic(fn):
    g = torch.Generator().manual_seed(1)
    xa, xb = torch.randn(3, 6, generator=g, dtype=torch.float64), 5 + torch.randn(2, 6, generator=g, dtype=torch.float64)
    ma, mb = _prefix_mask([6, 2, 4], 6), _prefix_mask([1, 5], 6)
    everything = torch.cat([xa[ma.bool()], xb[mb.bool()]])
    reduce = _FakeAllReduce()
    fn(xb, mb, sum_fn=reduce.record)
    got = fn(xa, ma, sum_fn=reduce.replay)
    expected = everything.mean() if fn is pm.masked_mean else everything.var(unbiased=True)
    torch.testing.assert_close(got, expected)
    # and the local statistic is different, so the test would notice an ignored sum_fn
    assert not torch.allclose(fn(xa, ma), expected)


def test_sum_fn_two_ranks_whiten():
    g = torch.Generator().manual_seed(2)
    xa, xb = torch.randn(2, 5, generator=g, dtype=torch.float64), 3 * torch.randn(2, 5, generator=g, dtype=torch.float64)
    ma, mb = _prefix_mask([5, 3], 5), _prefix_mask([2, 4], 5)
    everything = torch.cat([xa[ma.bool()], xb[mb.bool()]])
    reduce = _FakeAllReduce()
    pm.masked_whiten(xb, mb, sum_fn=reduce.record)
    got = pm.masked_whiten(xa, ma, sum_fn=reduce.replay)
    expected = ((xa - everything.mean()) / (everything.std() + EPS)) * ma
    torch.testing.assert_close(got, expected)


NONFINITE = [float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("bad", NONFINITE, ids=["inf", "-inf", "nan"])
def test_masked_mean_ignores_non_finite_masked_values(bad):
    # valid 1, 2 -> 1.5 (x * mask would give inf * 0 = nan)
    x = torch.tensor([[1.0, 2.0, bad]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert pm.masked_mean(x, mask).item() == 1.5


@pytest.mark.parametrize("bad", NONFINITE, ids=["inf", "-inf", "nan"])
def test_masked_var_ignores_non_finite_masked_values(bad):
    # valid 1, 2, 3, 4: mean 2.5, squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5 -> 5 / 3
    x = torch.tensor([[1.0, 2.0, 3.0, bad], [4.0, bad, bad, bad]], dtype=torch.float64)
    mask = _prefix_mask([3, 1], 4)
    assert pm.masked_var(x, mask).item() == pytest.approx(5.0 / 3.0, rel=1e-12)


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("bad", NONFINITE, ids=["inf", "-inf", "nan"])
def test_masked_whiten_ignores_non_finite_masked_values(bad, shift_mean):
    # valid 1, 2, 3, 4: mean 2.5, unbiased std sqrt(5 / 3); masked positions come out as 0
    x = torch.tensor([[1.0, 2.0, 3.0, bad], [4.0, bad, bad, bad]], dtype=torch.float64)
    mask = _prefix_mask([3, 1], 4)
    std = math.sqrt(5.0 / 3.0) + EPS
    shift = 0.0 if shift_mean else 2.5
    expected = torch.tensor([[-1.5 / std, -0.5 / std, 0.5 / std, 0.0], [1.5 / std, 0.0, 0.0, 0.0]], dtype=torch.float64)
    expected = expected + shift * mask
    out = pm.masked_whiten(x, mask, shift_mean=shift_mean)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn", [pm.masked_mean, pm.masked_var, pm.masked_whiten])
def test_non_finite_masked_values_give_the_clean_result(masked_batch, fn):
    x, mask = masked_batch
    dirty = x.clone()
    pad = ~mask.bool()
    dirty[pad] = torch.tensor(NONFINITE, dtype=x.dtype).repeat(int(pad.sum()))[: int(pad.sum())]
    assert not torch.isfinite(dirty).all()
    torch.testing.assert_close(fn(dirty, mask), fn(x * mask, mask), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# logprobs_of / entropy_of


def test_logprobs_and_entropy_match_categorical():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 11, generator=g) * 2
    tokens = torch.randint(0, 11, (3, 4), generator=g)
    dist = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(pm.logprobs_of(logits, tokens), dist.log_prob(tokens))
    torch.testing.assert_close(pm.entropy_of(logits), dist.entropy())


def test_logprobs_and_entropy_hand_example():
    # logits (0, 0, log 2) -> probs (1/4, 1/4, 1/2); log p(token 2) = log(1/2) = -0.693147
    # entropy = -(2 * 1/4 * log 1/4 + 1/2 * log 1/2) = 1.5 * log 2 = 1.039721
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)]]])
    assert pm.logprobs_of(logits, torch.tensor([[2]])).item() == pytest.approx(-math.log(2.0), abs=1e-6)
    assert pm.logprobs_of(logits, torch.tensor([[0]])).item() == pytest.approx(-math.log(4.0), abs=1e-6)
    assert pm.entropy_of(logits).item() == pytest.approx(1.5 * math.log(2.0), abs=1e-6)


def test_logprobs_of_upcasts_half_precision_logits():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    tokens = torch.tensor([[0, 1, 2], [3, 4, 6]])
    out = pm.logprobs_of(logits, tokens)
    assert out.dtype == torch.float32
    expected = torch.distributions.Categorical(logits=logits.float()).log_prob(tokens)
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------------------------------------
# response_mask


@pytest.mark.parametrize(
    "response, expected",
    [
        ([5, 2, 7, 2, 9], [1, 1, 0, 0, 0]),  # EOS in the middle: kept, everything after it dropped
        ([2, 5, 6, 7, 8], [1, 0, 0, 0, 0]),  # EOS first: only the EOS itself is real
        ([5, 6, 7, 8, 9], [1, 1, 1, 1, 1]),  # no EOS: the whole (truncated) response is real
        ([5, 6, 7, 8, 2], [1, 1, 1, 1, 1]),  # EOS last
        ([2, 2, 2, 2, 2], [1, 0, 0, 0, 0]),  # padded with EOS ids after the first EOS
    ],
)
def test_response_mask(response, expected):
    eos = 2
    out = pm.response_mask(torch.tensor([response]), eos)
    assert out.dtype == torch.float32
    assert out.tolist() == [expected]


def test_response_mask_batched_rows_are_independent():
    out = pm.response_mask(torch.tensor([[5, 2, 7], [2, 5, 6], [5, 6, 7]]), eos_token_id=2)
    assert out.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]


# ---------------------------------------------------------------------------------------------
# token_rewards


def test_token_rewards_hand_example():
    # beta = 0.5. Row 0: 4 real tokens, score 2 on the last.
    #   -0.5 * (0.1, 0.2, 0.3, 0.4) = (-0.05, -0.1, -0.15, -0.2); last: -0.2 + 2 = 1.8
    # Row 1: 2 real tokens (kl already masked), score -1 on token 1.
    #   -0.5 * (0.5, -0.5) = (-0.25, 0.25); token 1: 0.25 - 1 = -0.75; padding stays 0
    scores = torch.tensor([2.0, -1.0], dtype=torch.float64)
    kl = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, -0.5, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)
    expected = torch.tensor([[-0.05, -0.1, -0.15, 1.8], [-0.25, -0.75, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(pm.token_rewards(scores, kl, mask, beta=0.5), expected)


def test_token_rewards_sum_is_score_minus_beta_kl():
    g = torch.Generator().manual_seed(5)
    kl_raw = torch.rand(4, 6, generator=g, dtype=torch.float64)
    mask = _prefix_mask([6, 1, 3, 4], 6)
    kl = kl_raw * mask
    scores = torch.randn(4, generator=g, dtype=torch.float64)
    rewards = pm.token_rewards(scores, kl, mask, beta=0.2)
    torch.testing.assert_close(rewards.sum(-1), scores - 0.2 * kl.sum(-1))
    assert (rewards[~mask.bool()] == 0).all()


# ---------------------------------------------------------------------------------------------
# gae


def _gae_reference(rewards, values, mask, gamma, lam):
    """Per sequence, plain python, over the real tokens only; V after the last real token is 0."""
    advantages = torch.zeros_like(rewards)
    returns = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        length = int(mask[b].sum())
        r, v = rewards[b, :length].tolist(), values[b, :length].tolist()
        last = 0.0
        for t in reversed(range(length)):
            next_value = v[t + 1] if t + 1 < length else 0.0
            delta = r[t] + gamma * next_value - v[t]
            last = delta + gamma * lam * last
            advantages[b, t] = last
            returns[b, t] = last + v[t]
    return advantages, returns


def test_gae_hand_example():
    # gamma = lam = 0.5, rewards (1, 2), values (0.5, 1.0), then padding with value 7 (ignored)
    # t=1: delta = 2 + 0.5 * 0 - 1.0 = 1.0;            A1 = 1.0
    # t=0: delta = 1 + 0.5 * 1.0 - 0.5 = 1.0;          A0 = 1.0 + 0.25 * 1.0 = 1.25
    # returns = A + V = (1.75, 2.0)
    rewards = torch.tensor([[1.0, 2.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 1.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, ret = pm.gae(rewards, values, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[1.25, 1.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[1.75, 2.0, 0.0]], dtype=torch.float64))


def test_gae_matches_per_sequence_reference_loop():
    g = torch.Generator().manual_seed(6)
    lengths = [8, 1, 5, 3, 7]
    mask = _prefix_mask(lengths, 8)
    rewards = torch.randn(5, 8, generator=g, dtype=torch.float64)
    values = torch.randn(5, 8, generator=g, dtype=torch.float64)
    adv, ret = pm.gae(rewards, values, mask, gamma=0.99, lam=0.95)
    exp_adv, exp_ret = _gae_reference(rewards, values, mask, gamma=0.99, lam=0.95)
    torch.testing.assert_close(adv, exp_adv)
    torch.testing.assert_close(ret, exp_ret)


def test_gae_ignores_rewards_and_values_after_the_last_real_token():
    # The values on padding are non-zero garbage here; a bootstrap from them would change A
    # at the last real token (delta would include gamma * V_pad).
    g = torch.Generator().manual_seed(7)
    mask = _prefix_mask([2, 4, 6], 6)
    rewards = torch.randn(3, 6, generator=g, dtype=torch.float64)
    values = torch.randn(3, 6, generator=g, dtype=torch.float64)
    base = pm.gae(rewards * mask, values * mask, mask, 0.99, 0.95)
    garbage_values = torch.where(mask.bool(), values, torch.full_like(values, 50.0))
    garbage_rewards = torch.where(mask.bool(), rewards, torch.full_like(rewards, -30.0))
    noisy = pm.gae(garbage_rewards, garbage_values, mask, 0.99, 0.95)
    for a, b in zip(base, noisy, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # last real token of row 0 (t=1): A = r_1 - V_1 exactly (no bootstrap)
    assert noisy[0][0, 1].item() == pytest.approx((rewards[0, 1] - values[0, 1]).item())


def test_gae_gamma_lambda_one_gives_reward_to_go_minus_value():
    # With gamma = lam = 1, A_t = sum_{k>=t} r_k - V_t (telescoping), returns = reward-to-go.
    g = torch.Generator().manual_seed(8)
    mask = _prefix_mask([5, 3], 5)
    rewards = torch.randn(2, 5, generator=g, dtype=torch.float64) * mask
    values = torch.randn(2, 5, generator=g, dtype=torch.float64) * mask
    adv, ret = pm.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    to_go = rewards.flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(ret, to_go)
    torch.testing.assert_close(adv, (to_go - values) * mask)


@pytest.mark.parametrize("bad", NONFINITE, ids=["inf", "-inf", "nan"])
def test_gae_hand_example_with_non_finite_padding(bad):
    # As test_gae_hand_example, but reward and value on the padding are non-finite:
    # advantages (1.25, 1.0, 0), returns (1.75, 2.0, 0), all finite.
    rewards = torch.tensor([[1.0, 2.0, bad]], dtype=torch.float64)
    values = torch.tensor([[0.5, 1.0, bad]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, ret = pm.gae(rewards, values, mask, gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[1.25, 1.0, 0.0]], dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(ret, torch.tensor([[1.75, 2.0, 0.0]], dtype=torch.float64), rtol=0, atol=0)


def test_gae_with_nan_and_inf_padding_equals_the_clean_case():
    g = torch.Generator().manual_seed(9)
    mask = _prefix_mask([2, 6, 4, 1], 6)
    rewards = torch.randn(4, 6, generator=g, dtype=torch.float64) * mask
    values = torch.randn(4, 6, generator=g, dtype=torch.float64) * mask
    clean = pm.gae(rewards, values, mask, 0.99, 0.95)
    pad = ~mask.bool()
    dirty_rewards = torch.where(pad, torch.full_like(rewards, float("nan")), rewards)
    dirty_values = torch.where(pad, torch.full_like(values, float("inf")), values)
    dirty_values[0, 2] = float("-inf")
    dirty_values[3, 1] = float("nan")
    dirty = pm.gae(dirty_rewards, dirty_values, mask, 0.99, 0.95)
    for a, b in zip(clean, dirty, strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    exp_adv, exp_ret = _gae_reference(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(dirty[0], exp_adv)
    torch.testing.assert_close(dirty[1], exp_ret)


# ---------------------------------------------------------------------------------------------
# policy_loss


def test_policy_loss_hand_example():
    # per token: unclipped = -A r, clipped = -A clip(r, 0.8, 1.2), loss_t = max(unclipped, clipped)
    # row 0:
    #   r=1.5, A= 1: -1.5 vs -1.2   -> -1.2 (clipped wins)        clipfrac 1
    #   r=0.5, A= 1: -0.5 vs -0.8   -> -0.5                       0
    #   r=1.1, A=-2:  2.2 vs  2.2   ->  2.2 (inside the range)    0
    #   r=3.0, A= 5: masked
    # row 1:
    #   r=0.5, A=-1:  0.5 vs  0.8   ->  0.8 (clipped wins)        1
    #   r=1.0, A= 3: -3.0 vs -3.0   -> -3.0                       0
    #   r=2.0, A=-1:  2.0 vs  1.2   ->  2.0 (pessimistic bound)   0
    #   r=1.0, A= 0:  0   vs  0     ->  0                         0
    # loss = (-1.2 - 0.5 + 2.2 + 0.8 - 3.0 + 2.0 + 0) / 7 = 0.3 / 7; clipfrac = 2 / 7
    # approxkl = 0.5 * mean(log r ^ 2) over the 7 real tokens
    logprobs, old_logprobs, advantages, mask, _ratios = policy_batch()
    stats = pm.policy_loss(logprobs, old_logprobs, advantages, mask, cliprange=0.2)
    assert stats.loss.item() == pytest.approx(0.3 / 7)
    assert stats.clipfrac.item() == pytest.approx(2 / 7)
    logs = [math.log(r) for r in (1.5, 0.5, 1.1, 0.5, 1.0, 2.0, 1.0)]
    assert stats.approxkl.item() == pytest.approx(0.5 * sum(v * v for v in logs) / 7)
    assert not stats.clipfrac.requires_grad


def test_policy_loss_gradient_is_zero_on_clipped_tokens():
    # d loss / d logprob_t = -A_t r_t / 7 where the unclipped term is active, 0 where clipped
    # (and 0 on masked tokens):
    # row 0: (0, -0.5/7, 2.2/7, 0); row 1: (0, -3/7, 2/7, 0)
    logprobs, old_logprobs, advantages, mask, _ = policy_batch()
    pm.policy_loss(logprobs, old_logprobs, advantages, mask, cliprange=0.2).loss.backward()
    expected = torch.tensor([[0.0, -0.5, 2.2, 0.0], [0.0, -3.0, 2.0, 0.0]], dtype=torch.float64) / 7
    torch.testing.assert_close(logprobs.grad, expected)


def test_policy_loss_on_policy_is_minus_mean_advantage():
    # ratio 1 everywhere: loss = -mean(A) over real tokens, nothing clipped, approxkl 0.
    adv = torch.tensor([[1.0, -3.0, 2.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    lp = torch.full((2, 3), -0.7)
    stats = pm.policy_loss(lp, lp.clone(), adv, mask, cliprange=0.2)
    assert stats.loss.item() == pytest.approx(-(1 - 3 + 2 + 4) / 4)
    assert stats.clipfrac.item() == 0.0
    assert stats.approxkl.item() == 0.0


# ---------------------------------------------------------------------------------------------
# value_loss


def test_value_loss_hand_example():
    # cliprange_value = 0.2: V_clip = V_old + clamp(V - V_old, -0.2, 0.2)
    # t0: V_old 0, V 0.5, R  1.0: V_clip 0.2; (0.5-1)^2 = 0.25 vs (0.2-1)^2 = 0.64 -> 0.64, clipped
    # t1: V_old 0, V 0.1, R -1.0: V_clip 0.1; 1.21 vs 1.21                      -> 1.21
    # t2: V_old 1, V 0.7, R  0.0: V_clip 0.8; 0.49 vs 0.64                      -> 0.64, clipped
    # t3: V_old 0, V 0.5, R  0.1: V_clip 0.2; 0.16 vs 0.01                      -> 0.16
    # t4: masked (V 9)
    # loss = 0.5 * (0.64 + 1.21 + 0.64 + 0.16) / 4 = 0.33125; clipfrac = 2 / 4
    values = torch.tensor([[0.5, 0.1, 0.7, 0.5, 9.0]], dtype=torch.float64, requires_grad=True)
    old_values = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, -1.0, 0.0, 0.1, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.float64)
    stats = pm.value_loss(values, old_values, returns, mask, cliprange_value=0.2)
    assert stats.loss.item() == pytest.approx(0.33125)
    assert stats.clipfrac.item() == pytest.approx(0.5)
    # gradient flows only through the unclipped terms: d/dV 0.5 * (V - R)^2 / 4 = (V - R) / 4
    # t1: (0.1 + 1) / 4 = 0.275; t3: (0.5 - 0.1) / 4 = 0.1; clipped and masked tokens 0
    stats.loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.275, 0.0, 0.1, 0.0]], dtype=torch.float64))


def test_value_loss_without_clipping_is_half_mse():
    g = torch.Generator().manual_seed(9)
    values = torch.randn(3, 4, generator=g, dtype=torch.float64)
    returns = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = _prefix_mask([4, 2, 3], 4)
    # old_values == values: the clipped prediction equals the unclipped one
    stats = pm.value_loss(values, values.clone(), returns, mask, cliprange_value=0.2)
    expected = 0.5 * ((values - returns)[mask.bool()] ** 2).mean()
    torch.testing.assert_close(stats.loss, expected)
    assert stats.clipfrac.item() == 0.0


def test_losses_have_finite_gradients_when_padding_would_overflow():
    # At the padded position the log-ratio is 200: exp(200) = inf, times advantage 0 = nan,
    # unless the inputs are masked before the arithmetic.
    logprobs = torch.tensor([[0.0, 100.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0]])
    pm.policy_loss(logprobs, torch.tensor([[0.0, -100.0]]), torch.tensor([[1.0, 0.0]]), mask, 0.2).loss.backward()
    # d/dlogp of -A * exp(logp - old) at ratio 1 is -A = -1 on the real token; 0 on padding.
    assert torch.equal(logprobs.grad, torch.tensor([[-1.0, 0.0]]))
    values = torch.tensor([[1.0, float("inf")]], requires_grad=True)
    loss = pm.value_loss(values, torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0]]), mask, 0.2).loss
    loss.backward()
    # 0.5 * (1 - 2)^2 = 0.5 on the one real token; gradient (V - R) = -1 there.
    assert loss.item() == 0.5 and torch.equal(values.grad, torch.tensor([[-1.0, 0.0]]))


# ---------------------------------------------------------------------- importance-weighted KL
def test_importance_weighted_kl_hand_example_value_and_both_gradients():
    # log pi = log 0.5, log pi_ref = log 0.25, log pi_old = log 0.25: x = log 2, r = pi_ref / pi = 0.5,
    # k3 = r - 1 - log r = -0.5 + log 2 = 0.193147, w = pi / pi_old = 2, so w k3 = 0.386294.
    ref, old = torch.tensor([[math.log(0.25)]]), torch.tensor([[math.log(0.25)]])
    for ratio_gradient, expected_grad in ((True, 2 * math.log(2)), (False, 1.0)):
        logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
        x = logp - ref
        k3 = (-x).exp() - 1 + x
        weighted = pm.importance_weighted_kl(k3, logp, old, torch.ones(1, 1), ratio_gradient)
        assert weighted.item() == pytest.approx(2 * (math.log(2) - 0.5), abs=1e-6)  # 0.386294
        (grad,) = torch.autograd.grad(weighted.sum(), logp)
        # with the ratio's gradient: d(w k3)/d log pi = w k3 + w (1 - r) = w x = 2 log 2 = 1.386294
        # (the score-function term turns k3's (1 - r) into x); detached: w (1 - r) = 1.0
        assert grad.item() == pytest.approx(expected_grad, abs=1e-6)


def test_k1s_score_baseline_leaves_its_value_and_gives_each_sample_k3s_gradient():
    """k1 weighted in the loss with its score_baseline 1: the value is w k1 as before, and the gradient
    of every sampled token is w k1 s, exactly k3's (grad(w k3) = w k1 s), where without the baseline
    it is w (k1 + 1) s: the w s term, of mean 0, is the noise the baseline removes."""
    from rlhf_lightning.registry import registry

    k1, k3 = registry("kl_estimator").create("k1"), registry("kl_estimator").create("k3")
    assert (k1.score_baseline, k3.score_baseline) == (1.0, 0.0)
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(3, 5, 6, generator=g, dtype=torch.float64).requires_grad_()
    old = torch.randn(3, 5, 6, generator=g, dtype=torch.float64).log_softmax(-1)
    ref = torch.randn(3, 5, 6, generator=g, dtype=torch.float64).log_softmax(-1)
    tokens = torch.randint(0, 6, (3, 5), generator=g)
    mask = torch.ones(3, 5, dtype=torch.float64)

    def weighted(estimator, baseline):  # the per-token loss at the sampled tokens, its gradient per token
        logp = theta.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        old_t, ref_t = (t.gather(-1, tokens[..., None])[..., 0] for t in (old, ref))
        loss = pm.importance_weighted_kl(estimator(logp, ref_t), logp, old_t, mask, True, baseline)
        grads = [torch.autograd.grad(loss[i, t], theta, retain_graph=True)[0] for i in range(3) for t in range(5)]
        return loss.detach(), torch.stack(grads)

    value_b, grad_b = weighted(k1, k1.score_baseline)
    value_0, grad_0 = weighted(k1, 0.0)
    _, grad_k3 = weighted(k3, 0.0)
    torch.testing.assert_close(value_b, value_0)  # the value is untouched
    torch.testing.assert_close(grad_b, grad_k3)  # sample by sample, k3's gradient
    assert (grad_0 - grad_k3).abs().max() > 0.1  # without it, the extra w s


def test_importance_weighted_kl_is_zero_and_finite_off_the_mask():
    logp = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -200.0]])  # exp(200) at the padded position would overflow float32
    kl = torch.tensor([[0.3, float("inf")]])
    weighted = pm.importance_weighted_kl(kl, logp, old, torch.tensor([[1.0, 0.0]]))
    assert weighted.tolist() == [[pytest.approx(0.3), 0.0]]
    (grad,) = torch.autograd.grad(weighted.sum(), logp)
    assert torch.isfinite(grad).all() and grad[0, 1] == 0


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_importance_weighted_value_unbiased_estimators_have_the_exact_kl_gradient_off_policy(name):
    """sum_a pi_old(a) grad (w_a k(x_a)) = grad KL(pi_theta || pi_ref) exactly, with pi_old != pi_theta:
    E_{pi_old}[w k] = E_{pi_theta}[k] = KL for any theta, so their gradients agree (float64, no sampling)."""
    from rlhf_lightning.registry import registry

    estimator = registry("kl_estimator").create(name)
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(2, 7, generator=g, dtype=torch.float64).requires_grad_()
    old = torch.randn(2, 7, generator=g, dtype=torch.float64).log_softmax(-1)
    ref = torch.randn(2, 7, generator=g, dtype=torch.float64).log_softmax(-1)
    logp = theta.log_softmax(-1)
    (exact,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), theta)
    for baseline in (0.0, estimator.score_baseline, 3.0):  # any constant b * grad w has mean 0 under pi_old
        logp = theta.log_softmax(-1)
        weighted = pm.importance_weighted_kl(estimator(logp, ref), logp, old, torch.ones(2, 7), True, baseline)
        (grad,) = torch.autograd.grad((old.exp() * weighted).sum(), theta)
        torch.testing.assert_close(grad, exact)
    # Unweighted, the same samples from pi_old give another gradient (k1: E_old[grad log pi] != 0).
    (unweighted,) = torch.autograd.grad((old.exp() * estimator(theta.log_softmax(-1), ref)).sum(), theta)
    assert (unweighted - exact).abs().max() > 0.05
