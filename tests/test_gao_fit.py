"""tools/studies/gao_fit.py: the least-squares fit of R(d) = d (alpha - beta log d) (Gao et al. 2022)
recovers known coefficients, its R^2 is 1 - SS_res / SS_tot, and a logged run is read, made
relative to its first iteration, summarised by blocks and plotted."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tools.studies import gao_fit


def test_fit_recovers_known_alpha_and_beta_from_exact_points():
    d = np.array([0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 5.5])
    gold = gao_fit.gao_curve(d, alpha=0.3, beta=0.12)
    fit = gao_fit.gao_fit(d, gold)
    assert fit["alpha"] == pytest.approx(0.3, abs=1e-12) and fit["beta"] == pytest.approx(0.12, abs=1e-12)
    assert fit["r2"] == pytest.approx(1.0, abs=1e-12)
    # The curve itself: R(1) = alpha (log 1 = 0), R(e) = e (alpha - beta).
    np.testing.assert_allclose(gao_fit.gao_curve(np.array([0.0, 1.0, math.e]), 0.3, 0.12), [0.0, 0.3, math.e * 0.18])


def test_fit_with_residual_orthogonal_to_the_model_keeps_the_coefficients_and_r2_is_one_minus_ss_res_over_ss_tot():
    # Three points: the columns d = (1, e, e^2) and d log d = (0, e, 2 e^2) span a plane; a residual
    # along their cross product is orthogonal to it, so least squares returns the coefficients that
    # made the points and leaves exactly that residual.
    d = np.array([1.0, math.e, math.e**2])
    columns = np.stack([d, -d * np.log(d)], axis=1)
    residual = np.cross(columns[:, 0], columns[:, 1])
    residual *= 0.05 / np.linalg.norm(residual)
    gold = columns @ np.array([0.4, 0.1]) + residual
    fit = gao_fit.gao_fit(d, gold)
    assert (fit["alpha"], fit["beta"]) == pytest.approx((0.4, 0.1), abs=1e-12)
    ss_tot = ((gold - gold.mean()) ** 2).sum()
    assert fit["r2"] == pytest.approx(1 - 0.05**2 / ss_tot, abs=1e-12) and fit["r2"] < 1


def test_a_logged_run_is_made_relative_to_its_first_iteration_and_summarised_by_blocks(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    # 10 iterations on the curve alpha 0.2, beta 0.1 (d = 0 .. 9, peak at d* = e), gold of the
    # initial policy 0.25; one KL estimate below zero, which counts as d = 0.
    d = np.arange(10.0)
    kl, gold = d**2, 0.25 + gao_fit.gao_curve(d, 0.2, 0.1)
    kl[0] = -0.01
    writer = SummaryWriter(str(tmp_path / "run"))
    for step in range(10):
        writer.add_scalar("objective/gold_reward", gold[step], step)
        writer.add_scalar("objective/kl", kl[step], step)
    writer.close()
    out = tmp_path / "fig" / "gao.png"
    (row,) = gao_fit.main([f"single={tmp_path / 'run'}", "--blocks", "5", "--out", str(out)])
    assert row["alpha"] == pytest.approx(0.2, abs=1e-6) and row["beta"] == pytest.approx(0.1, abs=1e-6)
    assert row["gold_initial"] == pytest.approx(0.25, abs=1e-6)
    # Fitted peak: d* = exp(0.2 / 0.1 - 1) = e, KL e^2, gain beta d* = 0.1 e.
    assert row["fit_peak_kl"] == pytest.approx(math.e**2, rel=1e-5) and row["fit_peak_gain"] == pytest.approx(0.1 * math.e, rel=1e-5)
    # Blocks 0-4 and 5-9: means of the logged gold and KL.
    assert row["peak_block"] == "0-4" and row["peak_gold"] == pytest.approx(gold[:5].mean(), abs=1e-6)
    assert row["peak_kl"] == pytest.approx(kl[:5].mean(), abs=1e-6)
    assert (row["end_gold"], row["end_kl"]) == pytest.approx((gold[5:].mean(), kl[5:].mean()), abs=1e-6)
    assert gold[5:].mean() < gold[:5].mean()  # past the peak, the gold falls
    assert out.stat().st_size > 0 and out.with_suffix(".csv").read_text().startswith("run,iterations")


def test_a_run_without_gold_is_refused(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "run"))
    writer.add_scalar("objective/kl", 1.0, 0)
    writer.close()
    with pytest.raises(ValueError, match="no objective/gold_reward"):
        gao_fit.main([f"x={tmp_path / 'run'}", "--out", str(tmp_path / "g.png")])


def test_kl_bins_average_the_points_inside_each_half_open_bin_and_count_them():
    kl = np.array([0.0, 1.0, 4.9, 5.0, 7.5, 12.0, 30.0])
    gold = np.array([0.1, 0.2, 0.3, 0.4, 0.6, 0.9, 5.0])
    # [0, 5): 0.1, 0.2, 0.3 -> 0.2 (3); [5, 10): 0.4, 0.6 -> 0.5 (2); [10, 20): 0.9 (1); [20, 25): none; 30 is past the last edge.
    bins = gao_fit.kl_bins(kl, gold, [0, 5, 10, 20, 25])
    assert [n for _, n in bins] == [3, 2, 1, 0]
    assert [g for g, _ in bins[:3]] == pytest.approx([0.2, 0.5, 0.9], abs=1e-12)
    assert math.isnan(bins[3][0])


def test_two_runs_are_compared_at_matched_kl_with_the_proxy_panel(tmp_path):
    """--kl-bins writes each run's mean gold and proxy per KL bin (<out>_bins.csv), whatever iteration the KL was reached at."""
    import csv

    from torch.utils.tensorboard import SummaryWriter

    runs = {"fast": (np.array([0.0, 2.0, 6.0, 8.0]), 0.01), "slow": (np.array([0.0, 1.0, 3.0, 4.0, 6.5, 7.0]), 0.02)}
    for name, (kl, slope) in runs.items():
        writer = SummaryWriter(str(tmp_path / name))
        for step, k in enumerate(kl):
            writer.add_scalar("objective/gold_reward", 0.2 + slope * k, step)
            writer.add_scalar("objective/reward", 0.5 * k, step)
            writer.add_scalar("objective/kl", k, step)
        writer.close()
    out = tmp_path / "cmp.png"
    args = [
        f"fast={tmp_path / 'fast'}",
        f"slow={tmp_path / 'slow'}",
        "--blocks",
        "2",
        "--proxy",
        "--kl-bins",
        "0",
        "5",
        "10",
        "--out",
        str(out),
    ]
    gao_fit.main(args)
    rows = list(csv.DictReader(out.with_name("cmp_bins.csv").open()))
    got = {(r["run"], float(r["kl_low"])): (int(r["iterations"]), float(r["gold"]), float(r["proxy"])) for r in rows}
    # fast: [0, 5) holds KL 0, 2 (gold 0.2 + 0.01 x mean KL 1); [5, 10) KL 6, 8 (mean 7). slow: [0, 5) KL 0, 1, 3, 4 (mean 2), [5, 10) 6.5, 7.
    assert got[("fast", 0.0)] == pytest.approx((2, 0.21, 0.5), abs=1e-6)
    assert got[("fast", 5.0)] == pytest.approx((2, 0.27, 3.5), abs=1e-6)
    assert got[("slow", 0.0)] == pytest.approx((4, 0.24, 1.0), abs=1e-6)
    assert got[("slow", 5.0)] == pytest.approx((2, 0.335, 3.375), abs=1e-6)
    assert out.stat().st_size > 0


def test_kl_bins_must_increase(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "run"))
    for step in range(3):
        writer.add_scalar("objective/gold_reward", 0.2, step)
        writer.add_scalar("objective/kl", float(step), step)
    writer.close()
    with pytest.raises(SystemExit):
        gao_fit.main([f"x={tmp_path / 'run'}", "--blocks", "1", "--kl-bins", "5", "2", "--out", str(tmp_path / "g.png")])


def test_a_resumed_run_reads_its_folders_in_order_as_one(tmp_path):
    """label=first,second: the steps of both folders, a later folder's step replacing the same step of an earlier one."""
    from torch.utils.tensorboard import SummaryWriter

    d = np.arange(10.0)
    kl, gold = d**2, 0.25 + gao_fit.gao_curve(d, 0.2, 0.1)
    for name, steps in (("whole", range(10)), ("first", range(6)), ("second", range(5, 10))):
        writer = SummaryWriter(str(tmp_path / name))
        for step in steps:
            stale = 1.0 if name == "first" and step == 5 else 0.0  # step 5 logged again after the resumption
            writer.add_scalar("objective/gold_reward", gold[step] + stale, step)
            writer.add_scalar("objective/kl", kl[step], step)
        writer.close()
    (whole,) = gao_fit.main([f"a={tmp_path / 'whole'}", "--blocks", "5", "--out", str(tmp_path / "w.png")])
    (resumed,) = gao_fit.main([f"a={tmp_path / 'first'},{tmp_path / 'second'}", "--blocks", "5", "--out", str(tmp_path / "r.png")])
    assert resumed == pytest.approx(whole) and resumed["iterations"] == 10
