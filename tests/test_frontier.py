"""The reward-KL plane (rlhf_lightning/exact/frontier.py): best-of-N and soft best-of-N enumerated exactly
against hand-computed cases and brute-force samplers, Beirami et al.'s bound against the exact KL,
the frontier against its own points, and the distance-to-optimum meter against enumeration."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rlhf_lightning.exact import frontier as fr
from rlhf_lightning.exact.closed_form import kl_divergence, log_partition, optimal_logprobs
from rlhf_lightning.exact.meter import KLToOptimum
from rlhf_lightning.exact.tasks import TASKS, ExactPPORLHF, reference_logprobs, task_named

pytestmark = pytest.mark.filterwarnings("ignore:.*eval mode.*", "ignore:.*val_dataloader.*", "ignore:.*LeafSpec.*")


def random_task(seed: int, responses: int = 27, ties: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(ref_logprobs, rewards) of 2 prompts: a random pi_ref in float64 and rewards with ties (integers 0-3)
    or without (integers plus distinct fractions)."""
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(2, responses, generator=g, dtype=torch.float64).log_softmax(-1)
    rewards = torch.randint(0, 4, (2, responses), generator=g).double()
    if not ties:
        rewards = rewards + torch.randperm(2 * responses, generator=g).view(2, responses).double() / (4 * responses)
    return ref, rewards


def sampled_bon(ref: torch.Tensor, rewards: torch.Tensor, n: int, draws: int, lam: float = 0.0) -> torch.Tensor:
    """Frequencies of best-of-n (``lam`` 0: the first of the highest rewards; else soft, kept ∝ exp(r / lam))
    over ``draws`` brute-force draws of n responses from row 0 of ``ref``."""
    g = torch.Generator().manual_seed(n)
    idx = torch.multinomial(ref[0].exp(), draws * n, replacement=True, generator=g).view(draws, n)
    r = rewards[0][idx]
    if lam:
        pick = torch.multinomial((r / lam).softmax(-1), 1, generator=g).squeeze(-1)
    else:
        pick = (r == r.max(-1, keepdim=True).values).double().argmax(-1)  # the first maximiser
    chosen = idx[torch.arange(draws), pick]
    return torch.bincount(chosen, minlength=ref.shape[1]).double() / draws


def assert_matches_sampler(exact: torch.Tensor, freq: torch.Tensor, draws: int) -> None:
    """The chi-square statistic below df + 4 sqrt(2 df) (about its 0.999 quantile; no scipy here), and every
    response within 4 standard errors (3 would fail one run in 14 over 27 responses by chance alone)."""
    se = (exact * (1 - exact) / draws).sqrt()
    assert ((freq - exact).abs() <= 4 * se + 1e-12).all(), ((freq - exact) / se).abs().max()
    chi2 = float(((freq - exact) ** 2 / exact).sum() * draws)
    df = len(exact) - 1
    assert chi2 < df + 4 * math.sqrt(2 * df), chi2


# ---------------------------------------------------------------------- best-of-N
def test_bon_by_hand_with_a_tie():
    # pi_ref (0.5, 0.25, 0.25), rewards (0, 1, 1). N = 2: the best reward is 1 unless both draws are the
    # first response, 1 - 0.5^2 = 0.75, shared by the tied pair as pi_ref shares it: 0.375 each.
    ref, rewards = torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64).log(), torch.tensor([[0.0, 1.0, 1.0]])
    assert fr.bon_logprobs(ref, rewards, 2).exp().tolist()[0] == pytest.approx([0.25, 0.375, 0.375], abs=1e-12)
    # N = 3: 1 - 0.5^3 = 0.875. KL = 0.125 log(0.125 / 0.5) + 0.875 log(0.875 / 0.5), the law of the reward's KL.
    bon = fr.bon_logprobs(ref, rewards, 3)
    assert bon.exp().tolist()[0] == pytest.approx([0.125, 0.4375, 0.4375], abs=1e-12)
    assert kl_divergence(bon, ref) == pytest.approx(0.125 * math.log(0.25) + 0.875 * math.log(1.75), abs=1e-12)
    # Without the tie, rewards (0, 1, 2) and N = 2: F = 0.5, 0.75, 1 -> 0.25, 0.75^2 - 0.25 = 0.3125, 1 - 0.5625 = 0.4375.
    assert fr.bon_logprobs(ref, torch.tensor([[0.0, 1.0, 2.0]]), 2).exp().tolist()[0] == pytest.approx([0.25, 0.3125, 0.4375], abs=1e-12)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("ties", [True, False])
def test_bon_distribution_matches_a_brute_force_sampler(n, ties):
    ref, rewards = random_task(0, ties=ties)
    draws = 100_000
    assert_matches_sampler(fr.bon_logprobs(ref, rewards, n)[0].exp(), sampled_bon(ref, rewards, n, draws), draws)


def test_bon_kl_bound_holds_for_every_n_and_is_approached_only_by_a_continuous_law():
    ref, rewards = random_task(1, ties=True)
    distinct_ref, distinct = random_task(1, ties=False)
    n_atoms = 4000  # many equally likely distinct rewards: close to a continuous law
    uniform = torch.full((1, n_atoms), -math.log(n_atoms), dtype=torch.float64)
    fine = torch.arange(n_atoms, dtype=torch.float64).unsqueeze(0)
    for n in range(1, 65):
        bound = fr.bon_kl_bound(n)
        for r, p in ((rewards, ref), (distinct, distinct_ref), (fine, uniform)):
            assert kl_divergence(fr.bon_logprobs(p, r, n), p) <= bound + 1e-12, n
        if n <= 16:
            assert kl_divergence(fr.bon_logprobs(uniform, fine, n), uniform) == pytest.approx(bound, abs=5e-3), n
    # Four reward values: the KL is that of a 4-point law, far below the bound at large N.
    assert fr.bon_kl_bound(64) - kl_divergence(fr.bon_logprobs(ref, rewards, 64), ref) > 1.0
    assert fr.bon_kl_bound(1) == 0 and fr.bon_kl_bound(2) == pytest.approx(math.log(2) - 0.5)


# ---------------------------------------------------------------------- soft best-of-N
def test_soft_bon_sums_to_one_and_meets_its_limits():
    ref, rewards = random_task(2, ties=False)
    for n, lam in ((1, 0.5), (2, 0.3), (16, 0.05), (64, 10.0)):
        assert fr.soft_bon_logprobs(ref, rewards, n, lam).exp().sum(-1).tolist() == pytest.approx([1.0, 1.0], abs=1e-9)
    torch.testing.assert_close(fr.soft_bon_logprobs(ref, rewards, 1, 0.7), ref, atol=1e-9, rtol=0)  # N = 1 is pi_ref
    # lam = 1/20 of the smallest reward gap (1): best-of-N itself, to within exp(-20); lam below range / 700 refused
    spread = torch.randperm(27, generator=torch.Generator().manual_seed(0)).double().expand(2, 27)
    torch.testing.assert_close(fr.soft_bon_logprobs(ref, spread, 4, 0.05).exp(), fr.bon_logprobs(ref, spread, 4).exp(), atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="underflows"):
        fr.soft_bon_logprobs(ref, spread, 4, 0.03)
    # N -> infinity: the tilted optimum at beta = lam, the distance shrinking like 1 / N
    tilted = optimal_logprobs(ref, rewards, 1.0)
    gaps = [kl_divergence(fr.soft_bon_logprobs(ref, rewards, n, 1.0), tilted) for n in (4, 64, 1024)]
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-3, gaps


def test_soft_bon_matches_a_brute_force_sampler():
    ref, rewards = random_task(3, ties=True)
    draws = 100_000
    exact = fr.soft_bon_logprobs(ref, rewards, 4, 0.5)[0].exp()
    assert_matches_sampler(exact, sampled_bon(ref, rewards, 4, draws, lam=0.5), draws)


# ---------------------------------------------------------------------- the frontier
def test_frontier_inverts_the_tilted_curve_and_dominates_bon_and_soft_bon():
    ref, rewards = random_task(4, ties=True)
    for beta in (0.1, 0.5, 2.0, 10.0):
        point = fr.tilted_point(ref, rewards, beta)
        assert fr.frontier_reward(ref, rewards, point.kl) == pytest.approx(point.reward, abs=1e-7)
        assert fr.frontier_gap(point, ref, rewards) == pytest.approx(0.0, abs=1e-7)
    for n in (2, 8, 64):
        for lam in (None, 0.3, 3.0):
            logp = fr.bon_logprobs(ref, rewards, n) if lam is None else fr.soft_bon_logprobs(ref, rewards, n, lam)
            gap = fr.frontier_gap(fr.plane_point(logp, ref, rewards), ref, rewards)
            # strictly below, except where best-of-64 has reached the frontier's end: pi_ref on the best reward
            assert gap > 1e-6 if n < 64 else gap > -1e-9, (n, lam, gap)
    # Past the reward maximiser's KL the frontier is the maximum reward; at KL 0 the reference's.
    assert fr.frontier_reward(ref, rewards, 100.0) == pytest.approx(3.0, abs=1e-3)
    assert fr.frontier_reward(ref, rewards, 0.0) == pytest.approx(float((ref.exp() * rewards).sum(-1).mean()))


# ---------------------------------------------------------------------- the meter
def test_log_partition_estimate_by_hand():
    # beta 1, rewards (0, log 3): w = (1, 3), mean 2 -> log 2; ESS = 16 / 10 = 1.6; n / ESS - 1 = 0.25,
    # Var(log mean w) ~ 0.25 / 2 = 0.125: se 0.3536, bias -0.0625.
    est = fr.log_partition_estimate(torch.tensor([[0.0, math.log(3)]]), 1.0)
    assert float(est.plug_in) == pytest.approx(math.log(2))
    assert float(est.ess) == pytest.approx(1.6)
    assert float(est.se) == pytest.approx(math.sqrt(0.125))
    assert float(est.bias) == pytest.approx(-0.0625)
    assert float(est.corrected) == pytest.approx(math.log(2) + 0.0625)
    assert est.untrusted(min_ess=8) is not None and est.untrusted(min_ess=1.5) is None
    const = fr.log_partition_estimate(torch.full((1, 10), 2.0), 0.5)  # every weight equal: exact, ESS = n
    assert float(const.plug_in) == pytest.approx(4.0) and float(const.ess) == pytest.approx(10) and float(const.se) < 1e-7


def test_log_partition_delta_method_bias_matches_monte_carlo():
    # r ~ N(0, 1), beta 1: log Z = 1/2, Var(w) / E[w]^2 = e - 1, so with n = 100 the plug-in's bias is
    # about -(e - 1) / 200 = -0.0086; 4000 replicates measure it to about 0.002.
    g = torch.Generator().manual_seed(0)
    est = fr.log_partition_estimate(torch.randn(4000, 100, generator=g, dtype=torch.float64), 1.0)
    plug_in_bias, corrected_bias = float(est.plug_in.mean()) - 0.5, float(est.corrected.mean()) - 0.5
    assert plug_in_bias == pytest.approx(-(math.e - 1) / 200, abs=0.004)
    assert abs(corrected_bias) < 0.004 and abs(corrected_bias) < abs(plug_in_bias) / 2
    assert float(est.plug_in.std()) == pytest.approx(float(est.se.mean()), rel=0.15)  # the delta se is the spread


def test_meter_with_exact_log_z_equals_the_enumerated_kl_to_the_optimum():
    ref, rewards = random_task(5, ties=True)
    policy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).log_softmax(-1)
    for beta in (0.2, 1.0, 5.0):
        distance = fr.kl_to_optimum(policy - ref, rewards, log_partition(ref, rewards, beta), beta, weights=policy.exp())
        exact = kl_divergence(policy, optimal_logprobs(ref, rewards, beta))
        assert distance.kl_to_optimum == pytest.approx(exact, abs=1e-6)
        assert distance.gap == pytest.approx(beta * exact, abs=1e-6) and distance.se == 0


def test_meter_from_samples_lands_within_its_interval_of_the_exact_value():
    ref, rewards = random_task(6, ties=True)
    policy = optimal_logprobs(ref, rewards, 0.5)  # some policy away from pi_1
    g = torch.Generator().manual_seed(2)
    ys = torch.multinomial(policy.exp(), 4000, replacement=True, generator=g)
    pool = torch.multinomial(ref.exp(), 4000, replacement=True, generator=g)
    log_z = fr.log_partition_estimate(rewards.gather(1, pool), 1.0)
    distance = fr.kl_to_optimum((policy - ref).gather(1, ys), rewards.gather(1, ys), log_z, 1.0)
    exact = kl_divergence(policy, optimal_logprobs(ref, rewards, 1.0))
    assert abs(distance.kl_to_optimum - exact) < 3 * distance.se and distance.se < 0.05, (distance, exact)


def test_meter_fall_cancels_log_z_and_its_se_is_the_spread_of_the_fall_over_policy_draws():
    """Two measurements from one reference pool: the fall is the difference of the two distances, log Z's error
    cancels in it, so its standard error holds only the policy samples' parts; over 2000 pairs of policy draws
    (the pool fixed) the fall's spread matches that se, while each distance's se also counts log Z's."""
    ref, rewards = random_task(7, ties=False)
    start, later = ref, optimal_logprobs(ref, rewards, 1.0)  # the reference, then a policy nearer pi_beta
    g = torch.Generator().manual_seed(3)
    log_z = fr.log_partition_estimate(rewards.gather(1, torch.multinomial(ref.exp(), 30, replacement=True, generator=g)), 0.5)

    def measure(policy: torch.Tensor) -> fr.OptimumDistance:
        ys = torch.multinomial(policy.exp(), 40, replacement=True, generator=g)
        return fr.kl_to_optimum((policy - ref).gather(1, ys), rewards.gather(1, ys), log_z, 0.5)

    falls, ses = [], []
    for _ in range(2000):
        a, b = measure(start), measure(later)
        fall, se = b.fall_since(a)
        assert fall == pytest.approx(a.kl_to_optimum - b.kl_to_optimum) and se == pytest.approx(math.hypot(a.samples_se, b.samples_se))
        assert b.se == pytest.approx(math.hypot(b.samples_se, float(log_z.se.pow(2).sum().sqrt()) / 2))
        falls.append(fall)
        ses.append(se)
    exact_fall = kl_divergence(start, optimal_logprobs(ref, rewards, 0.5)) - kl_divergence(later, optimal_logprobs(ref, rewards, 0.5))
    falls = torch.tensor(falls, dtype=torch.float64)
    assert float(falls.mean()) == pytest.approx(exact_fall, abs=4 * float(falls.std()) / math.sqrt(2000))
    assert float(falls.std()) == pytest.approx(sum(ses) / len(ses), rel=0.1)
    assert float(log_z.se.mean()) > 0.5 * sum(ses) / len(ses)  # log Z's error is not small here: it would have counted


# ---------------------------------------------------------------------- from a reference pool
def test_bon_from_a_pool_by_brute_force_over_subsets():
    pool = torch.tensor([[0.3, -1.0, 0.3, 2.0, 0.5, -0.2]], dtype=torch.float64)
    for n in range(1, 7):
        subsets = [max(s) for s in itertools.combinations(pool[0].tolist(), n)]
        assert float(fr.bon_reward_from_pool(pool, n)) == pytest.approx(sum(subsets) / len(subsets))
    # the plug-in KL is the exact best-of-N KL of the pool's law: with one tie, below the distinct pool's
    distinct = pool + torch.arange(6).double() * 1e-3
    assert float(fr.bon_kl_from_pool(pool, 4)) < float(fr.bon_kl_from_pool(distinct, 4)) <= fr.bon_kl_bound(4)


# ---------------------------------------------------------------------- the callback and the tool
@pytest.mark.convergence
def test_kl_to_optimum_callback_tracks_the_exact_distance_while_training():
    from lightning import Trainer, seed_everything

    from rlhf_lightning.trainer_settings import QUIET_TRAINER
    from rlhf_lightning_plugins.beta_controllers import FixedBeta

    task, exact = TASKS["terminal"], []

    class Exact(KLToOptimum.__mro__[1]):  # the enumerated distance where the meter measures: the start, then iteration 3
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if pl_module.iteration == 0:
                exact.append(pl_module.exact_report().kl_to_optimum)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if pl_module.iteration == 3:
                exact.append(pl_module.exact_report().kl_to_optimum)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    seed_everything(0, verbose=False)
    module = ExactPPORLHF(task, seed=0, beta_controller=FixedBeta(1.0), lr=2e-3, critic_lr=2e-3, log_samples_every_n_steps=0)
    meter = KLToOptimum(every=3, num_prompts=3, reference_samples=1500, policy_samples=1500)
    # a second run from the same reference with the first's pool loaded (tools/studies/kl_frontier.py's later betas): no new
    # pool, and the start still measured, with the first's prompts and reference scores
    reused = KLToOptimum(every=3, beta=2.0, num_prompts=1, reference_samples=10, policy_samples=200)
    try:
        Trainer(**QUIET_TRAINER, max_epochs=1, callbacks=[Exact(), meter]).fit(module, train_dataloaders=task.dataloader(3, 48))
        reused.load_state_dict(meter.state_dict())
        seed_everything(0, verbose=False)
        second = ExactPPORLHF(task, seed=0, beta_controller=FixedBeta(2.0), lr=2e-3, critic_lr=2e-3, log_samples_every_n_steps=0)
        Trainer(**QUIET_TRAINER, max_epochs=1, callbacks=[reused]).fit(second, train_dataloaders=task.dataloader(1, 48))
    finally:
        torch.set_num_threads(threads)
    assert [row["iteration"] for row in reused.rows] == [0] and reused.reference_scores is meter.reference_scores
    start = kl_divergence(reference_logprobs(task), optimal_logprobs(reference_logprobs(task), task.rewards(), 2.0))
    assert abs(reused.rows[0]["distance"].kl_to_optimum - start) < 3 * reused.rows[0]["distance"].se + 1e-3
    assert [row["iteration"] for row in meter.rows] == [0, 3] and len(exact) == 2
    assert meter.rows[0]["sampled"].kl_to_ref == 0  # before the first update the policy is the reference
    for row, value in zip(meter.rows, exact, strict=True):
        assert abs(row["distance"].kl_to_optimum - value) < 3 * row["distance"].se + 1e-3, (row, value)
    fall, fall_se = meter.rows[1]["fall"]  # the start's own fall is 0 +- its samples' se times sqrt 2
    assert meter.rows[0]["fall"] == (0.0, pytest.approx(math.sqrt(2) * meter.rows[0]["distance"].samples_se))
    assert fall == meter.rows[0]["distance"].kl_to_optimum - meter.rows[1]["distance"].kl_to_optimum
    assert exact[0] - exact[1] > 0.1 and abs(fall - (exact[0] - exact[1])) < 3 * fall_se + 1e-3, (fall, fall_se, exact)
    torch.testing.assert_close(meter.reference_scores.shape, (3, 1500))


def test_kl_to_optimum_refuses_a_small_beta_and_bad_arguments():
    from rlhf_lightning.checks import ConfigError

    with pytest.raises(ConfigError, match=r"KLToOptimum\.every"):
        KLToOptimum(every=0)
    with pytest.raises(ConfigError, match=r"KLToOptimum\.beta"):
        KLToOptimum(beta=0.0)
    meter = KLToOptimum(reward_max=3.0, max_tail=0.1)
    meter.reference_scores = torch.tensor([[0.0] * 63 + [1.0]], dtype=torch.float64)  # 64 samples of one prompt, one rewarded

    class Module:  # what _untrusted reads of the module
        class reward_model:
            class shaping:
                normalize = False

    assert "ESS" in meter._untrusted(Module, 0.05)  # the one rewarded sample's weight e^20 is all of Z: ESS ~1
    assert "unseen tail" in meter._untrusted(Module, 0.5)  # ESS 42, but 3 / 64 of the mass at reward 3 could be unseen
    assert meter._untrusted(Module, 50.0) is None
    assert "beta is 0" in meter._untrusted(Module, 0.0)


@pytest.mark.convergence
def test_frontier_tool_fast_prints_its_line(tmp_path, capsys):
    """tools/studies/kl_frontier.py --exact --fast (about 10 s): one PPO run at beta 0.5 within 0.02 of the frontier,
    and best-of-N's exact KL on the terminal task (4 reward values) far below the bound at N = 64."""
    from tools.studies import kl_frontier as tool

    line = tool.main(["--exact", "--fast", "--out", str(tmp_path)])
    assert line in capsys.readouterr().out
    fields = dict(field.split("=") for field in line.split()[1:])
    assert line.startswith("FRONTIER ") and set(fields) == {"ppo_max_gap", "bon_kl_bound_max_error"}
    assert -0.005 < float(fields["ppo_max_gap"]) < 0.02
    assert float(fields["bon_kl_bound_max_error"]) > 0.5
    assert (tmp_path / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_frontier_anneal_from_lowers_beta_over_the_first_half_then_holds_it():
    """tools/studies/kl_frontier.py --anneal-from 2: each PPO run's controller goes 2 -> its beta geometrically over half the
    iterations (2 * 0.25 ** (i / 75) at beta 0.5 over 150), then stays; without the option, fixed."""
    from rlhf_lightning_plugins.beta_controllers import AnnealedBeta, FixedBeta
    from tools.studies import kl_frontier as tool

    args = tool.parse_args(["--exact", "--task", "random:3", "--betas", "0.5", "--anneal-from", "2"])
    ctl = tool.beta_ctl(0.5, args.anneal_from, 150)
    assert isinstance(ctl, AnnealedBeta) and ctl.iterations == 75
    betas = [ctl.update(1.0, 384) for _ in range(150)]
    assert betas[0] == pytest.approx(2 * 0.25 ** (1 / 75)) and betas[36] == pytest.approx(1.0, rel=0.02)
    assert betas[74:] == [0.5] * 76
    assert type(tool.beta_ctl(0.5, None, 150)) is FixedBeta


def test_train_on_meter_prompts_writes_the_first_prompts_of_the_configs_set(tmp_path):
    """tools/studies/kl_frontier.py --train-on-meter-prompts: the first --prompts prompts of the config's training set (the
    built-in one for the quickstart, else its data.train_path) in <out>/meter_prompts.jsonl, which the data module
    reads back as that set, in that order."""
    import yaml

    from rlhf_lightning.data import BUILTIN_TRAIN, load_prompts
    from tools.studies import kl_frontier as tool

    args = tool.parse_args(["--smollm2", "--prompts", "3", "--train-on-meter-prompts", "--out", str(tmp_path)])
    args.out = tmp_path
    assert load_prompts(tool.meter_prompt_file(args)) == load_prompts(BUILTIN_TRAIN)[:3]
    own = tmp_path / "own.txt"
    own.write_text("first\nsecond\nthird\nfourth\n")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"data": {"train_path": str(own)}}))
    args.config, args.prompts = str(config), 2
    assert load_prompts(tool.meter_prompt_file(args)) == ["first", "second"]


def test_smollm2_mode_on_the_tiny_config_prints_the_meter_and_its_fall(tmp_path, capsys):
    """tools/studies/kl_frontier.py --smollm2's whole path (pool, PPO run, meter lines, CSV, figure) on configs/tiny.yaml in
    seconds: best-of-N lines for each N, one PPO line per measurement (the start and iterations 1, 2), each with
    the meter and its fall since the start (0 at the start), the figure written."""
    from tools.studies import kl_frontier as tool

    argv = "--smollm2 --config configs/tiny.yaml --prompts 2 --pool 16 --policy-samples 4 --betas 10 --iterations 2 --meter-every 1"
    argv += " --train-on-meter-prompts --bon 1 2 --bootstrap 5 --reward-max 24 --max-tail 100"
    tool.main([*argv.split(), "--out", str(tmp_path)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("SMOLLM2 ppo")]
    fields = [dict(field.split("=", 1) for field in line.split()[2:] if "=" in field) for line in lines]
    assert [f["iteration"] for f in fields] == ["0", "1", "2"], lines
    assert fields[0]["fall"].startswith("0.000+-") and all("refused" not in line for line in lines)
    for f in fields[1:]:
        start, now = (float(g["kl_to_optimum"].split("+-")[0]) for g in (fields[0], f))
        assert float(f["fall"].split("+-")[0]) == pytest.approx(start - now, abs=2e-3)
    assert (tmp_path / "frontier_smollm2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.convergence
def test_annealed_beta_reaches_the_optimum_a_fixed_beta_stops_short_of():
    """random:3 at beta 0.5, k1 in the reward, 150 iterations of 384 (tools/studies/kl_frontier.py's settings), sampling seeds
    0, 1, 2: annealed from beta 2 over the first 75 iterations, every run ends within 0.005 of the frontier (0.0008,
    0.0004, 0.0003); fixed, most stop about 0.022 below it (0.0012, 0.0220, 0.0221: a mode the sampler stops
    visiting, which seed 0 finds by chance since the random tasks' network has a position embedding; 0.0232,
    0.0225, 0.0231 without it; docs/results.md)."""
    from rlhf_lightning.exact.training import train
    from tools.studies import kl_frontier as tool
    from tools.studies.regulariser_frontier import PPO

    task = task_named("random:3")
    ref, rewards = reference_logprobs(task, 0), task.rewards()
    gaps = {None: [], 2.0: []}
    for seed, anneal_from in itertools.product((0, 1, 2), gaps):
        _, tracker = train(
            task,
            150,
            every=150,
            seed=seed,
            kl_estimator="k1",
            beta_controller=tool.beta_ctl(0.5, anneal_from, 150),
            **{**PPO, "batch_size": 384},
        )
        gaps[anneal_from].append(fr.frontier_gap(fr.PlanePoint(kl=tracker.last["kl_to_ref"], reward=tracker.last["reward"]), ref, rewards))
    assert max(gaps[2.0]) < 0.005 and sorted(gaps[None])[1] > 0.02, gaps
