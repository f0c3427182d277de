"""The experiment tools, in --fast mode: the beta sweep shows that a larger beta keeps the policy
closer to the reference, and the reward-hacking report shows that the KL penalty stops the
policy from spamming the proxy's favourite character."""

from __future__ import annotations

import csv
import math

import pytest

from tools.studies import reward_hacking_report, sweep_beta

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.convergence
def test_sweep_beta_fast_writes_csv_and_plot_and_larger_beta_keeps_kl_lower(tmp_path):
    sweep_beta.main(["--fast", "--out", str(tmp_path)])

    with (tmp_path / "sweep_beta.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [float(r["beta"]) for r in rows] == list(sweep_beta.FAST_BETAS)
    for row in rows:
        values = {k: float(v) for k, v in row.items()}
        assert all(math.isfinite(v) for v in values.values()), row
        assert values["net"] == pytest.approx(values["reward"] - values["beta"] * values["kl"])
    png = tmp_path / "sweep_beta.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    for beta in sweep_beta.FAST_BETAS:  # TensorBoard logs live under --out, one folder per beta
        assert list((tmp_path / f"beta_{beta:g}" / "lightning_logs").glob("tiny/version_*/events.out.tfevents.*"))

    unpenalised, penalised = rows[0], rows[-1]
    # The trade-off, not just "it ran": the largest beta ends well below half of beta = 0's KL,
    # and pays for it in reward (the tiny model's reference scores about 0.4 "e" per response).
    assert float(penalised["kl"]) < 0.5 * float(unpenalised["kl"])
    assert float(penalised["reward"]) < float(unpenalised["reward"])


@pytest.mark.convergence
def test_reward_hacking_report_fast_shows_the_kl_penalty_prevents_the_exploit(tmp_path):
    reference, unpenalised, penalised = reward_hacking_report.main(["--fast", "--out", str(tmp_path)])

    assert (reference.beta, unpenalised.beta, penalised.beta) == (None, 0.0, 0.5)
    assert reference.kl == 0.0  # the untrained policy is the reference
    # Without the penalty the policy learns to spam "!"; with it "!" stays close to the reference's
    # base rate (about 1 character in 60 for the random tiny model).
    assert unpenalised.char_share > 3 * penalised.char_share
    assert unpenalised.exploiting > penalised.exploiting + 0.3
    assert penalised.exploiting <= reference.exploiting + 0.1
    assert unpenalised.proxy_reward > penalised.proxy_reward
    assert unpenalised.kl > 2 * penalised.kl
    report = (tmp_path / "reward_hacking.md").read_text()
    for row in ("| reference (untrained) | - |", "| no_penalty | 0 |", "| penalised | 0.5 |"):
        assert row in report
