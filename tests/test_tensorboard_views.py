"""The Custom Scalars page TensorBoardViews writes: its charts, their titles (the only legend
TensorBoard gives a chart: one line each) and the tag each draws, in the order TensorBoard shows them; and the
Scalars tab of a real run, whose groups TensorBoard orders by tag prefix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlhf_lightning.callbacks import HEALTH_CATEGORY, MORE_CATEGORY, SEEDS_CATEGORY, custom_scalars_layout

from helpers import run_cli, tool


def charts(layout: dict, category: str) -> list[tuple[str, list[str]]]:
    """(title, tags) per chart of ``category``, in order; every chart a Multiline of exact tags."""
    found = []
    for title, (kind, regexes) in layout[category].items():
        assert kind == "Multiline", title
        assert all(r.startswith("^") and r.endswith("$") for r in regexes), regexes
        found.append((title, [r[1:-1] for r in regexes]))
    return found


def test_the_first_category_is_reward_kl_beside_its_target_beta_and_the_net_objective():
    layout = custom_scalars_layout(unit="sequence_sum", has_target=True, has_gold=False)
    assert list(layout) == [SEEDS_CATEGORY, MORE_CATEGORY]
    assert charts(layout, SEEDS_CATEGORY) == [
        ("reward, training batch: objective/reward", ["objective/reward"]),
        ("reward, held-out prompts: val/reward", ["val/reward"]),
        ("KL per response (nats), mean: objective/kl", ["objective/kl"]),
        ("the controller's KL target (nats per response): objective/kl_target", ["objective/kl_target"]),
        ("KL per response (nats), max: objective/kl_max", ["objective/kl_max"]),
        ("beta, the KL coefficient: objective/beta", ["objective/beta"]),
        ("net objective, reward - beta * KL, training batch: objective/net", ["objective/net"]),
        ("net objective, reward - beta * KL, held-out prompts: val/net", ["val/net"]),
    ]
    assert [tags for _, tags in charts(layout, MORE_CATEGORY)] == [
        ["objective/entropy"],
        ["response/length"],
        ["val/length"],
        ["policy/approxkl"],
        ["policy/clipfrac"],
    ]


def test_a_kl_health_monitor_adds_a_third_row():
    """With ``KLHealth`` running (the module's default): the KL's share of the update, the estimate and the exact
    KL (both nats per response), and the five checks' 0/1 flags."""
    layout = custom_scalars_layout(kl_health=True)
    assert list(layout) == [SEEDS_CATEGORY, MORE_CATEGORY, HEALTH_CATEGORY]
    assert [tags for _, tags in charts(layout, HEALTH_CATEGORY)] == [
        ["system/kl_health/kl_share"],
        ["system/kl_health/kl_estimate"],
        ["system/kl_health/kl_exact"],
        *(
            [f"system/kl_health/{name}"]
            for name in ("dead_kl", "reference_moved", "sampler_mismatch", "estimate_vs_exact", "reward_up_kl_zero")
        ),
    ]


def test_every_chart_draws_one_line_named_in_its_title():
    """TensorBoard colours a chart's lines by run, so two lines of one run on one chart share a colour and the
    layout has no legend (the KL's mean, max and target were three lines of one colour): each chart draws one
    tag, and its title names it."""
    for unit in ("sequence_sum", "token_mean"):
        for has_target in (True, False):
            layout = custom_scalars_layout(
                unit=unit, has_target=has_target, has_gold=True, reference="teachers/tiny-e", asynchronous=True, kl_health=True
            )
            for category in layout:
                for title, tags in charts(layout, category):
                    assert len(tags) == 1 and title.endswith(f": {tags[0]}"), (title, tags)


def test_every_title_names_its_lines_in_order():
    """The title is the legend: each tag a chart draws is named in its title, in the order drawn."""
    for unit in ("sequence_sum", "token_mean"):
        for has_target in (True, False):
            layout = custom_scalars_layout(unit=unit, has_target=has_target, has_gold=True, kl_health=True)
            for category in layout:
                for title, tags in charts(layout, category):
                    places = [title.find(tag) for tag in tags]
                    assert -1 not in places and places == sorted(places), (title, tags)


def test_a_per_token_target_is_charted_beside_the_per_token_kl():
    """A token_mean controller's target is per token: its chart follows the per-token KL's, before the
    per-response mean and max (sums over tokens)."""
    layout = custom_scalars_layout(unit="token_mean", has_target=True)
    kl_charts = [tags for _, tags in charts(layout, SEEDS_CATEGORY) if tags[0].startswith("objective/kl")]
    assert kl_charts == [["objective/kl_per_token"], ["objective/kl_target"], ["objective/kl"], ["objective/kl_max"]]
    assert "nats per token" in next(title for title, tags in charts(layout, SEEDS_CATEGORY) if tags == ["objective/kl_target"])


def test_no_target_no_target_line_and_a_gold_reward_gets_its_own_chart():
    """A fixed beta logs no objective/kl_target (a chart naming it would list a missing tag); a gold
    reward (0..1) is not drawn on the trained proxy's axis (a learned score of any scale)."""
    layout = custom_scalars_layout(unit="sequence_sum", has_target=False, has_gold=True)
    tags = [tag for _, chart_tags in charts(layout, SEEDS_CATEGORY) for tag in chart_tags]
    assert "objective/kl_target" not in tags and not any("target" in title for title in layout[SEEDS_CATEGORY])
    (gold,) = [chart_tags for _, chart_tags in charts(layout, SEEDS_CATEGORY) if "objective/gold_reward" in chart_tags]
    assert gold == ["objective/gold_reward"]
    assert charts(layout, SEEDS_CATEGORY)[0][1] == ["objective/reward"]


def test_every_charted_tag_is_a_documented_metric():
    """Each tag on the page is in docs/metrics.md (a renamed metric would leave an empty chart)."""
    from helpers import REPO

    page = (REPO / "docs" / "metrics.md").read_text()
    layout = custom_scalars_layout(unit="token_mean", has_target=True, has_gold=True, kl_health=True)
    tags = {tag for category in layout for _, chart_tags in charts(layout, category) for tag in chart_tags}
    missing = sorted(tag for tag in tags if not re.search(rf"`{re.escape(tag)}`", page))
    assert not missing, missing


# --- the Scalars tab of a run the command wrote

SEEDS_METRICS = {"objective/reward", "objective/kl", "objective/kl_max", "objective/beta", "objective/net"}


@pytest.fixture(scope="module")
def scalar_tags(tmp_path_factory) -> set[str]:
    """The scalar tags of a 2-iteration tiny run with a validation pass and the KL guard: every
    group the command logs on a CPU."""
    root = tmp_path_factory.mktemp("run")
    result = run_cli(root, "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1", "--trainer.callbacks+=KLGuard")
    assert result.returncode == 0, result.stderr[-3000:]
    (events,) = Path(root).glob("lightning_logs/tiny/version_0/events.out.tfevents.*")
    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    return set(accumulator.Tags()["scalars"])


def groups(tags: set[str]) -> list[str]:
    """The Scalars and Time Series tabs' groups in their order: tag prefixes, alphabetically."""
    return sorted({tag.split("/")[0] for tag in tags})


def test_the_machinerys_counts_sort_after_the_runs_own_measures(scalar_tags):
    """Fault and KL guard counts are under ``system/`` (after ``objective/``), not ``faults/`` and
    ``kl_guard/`` (before it); the seeds' metrics are all in the ``objective`` group."""
    assert scalar_tags >= SEEDS_METRICS
    assert scalar_tags >= {"system/faults/iteration_skipped", "system/faults/skipped_iterations", "system/kl_guard/spikes"}
    assert groups(scalar_tags) == ["objective", "policy", "prompts", "reference", "response", "rollout", "system", "timing", "val", "value"]
    assert "system/memory/param_numel_local" in scalar_tags
    assert "system/kl_health/sampler_mismatch" in scalar_tags  # the default KL health monitor (every iteration), beside the guard


def test_the_scalars_tab_opens_on_the_seeds_metrics(scalar_tags):
    assert groups(scalar_tags)[0] == "objective"


def test_summarize_run_prints_and_plots_two_runs_side_by_side(tmp_path):
    """python -m tools.summarize_run --runs: a table per folder (block means by hand) and, with --plot, one PNG."""

    from torch.utils.tensorboard import SummaryWriter

    for name, length in (("short", 10.0), ("long", 20.0)):
        with SummaryWriter(tmp_path / name) as writer:
            for step in range(4):
                writer.add_scalar("objective/kl", step, step)
                writer.add_scalar("response/length", length + step, step)
    png = tmp_path / "runs.png"
    runs = str(tmp_path / "short"), str(tmp_path / "long")
    out = tool("tools.summarize_run", *runs, "--runs", "--blocks", "2", "--plot", str(png), check=True).stdout
    short, long = out.split(f"== {tmp_path / 'long'}")
    assert f"== {tmp_path / 'short'}" in short
    assert re.search(r"0-1\s+0\.5000\s+10\.5000", short) and re.search(r"2-3\s+2\.5000\s+12\.5000", short), short
    assert re.search(r"2-3\s+2\.5000\s+22\.5000", long), long
    assert png.stat().st_size > 10_000


def test_summarize_run_shows_the_divergence_only_where_it_is_not_the_kl(tmp_path):
    """Under chi2 (a sequence-level divergence) objective/divergence is its own column, block means by hand; under the
    reverse KL it equals objective/kl and is left out."""

    from torch.utils.tensorboard import SummaryWriter

    for name, divergence in (("chi2", [5.0, 7.0, 1.0, 2.0]), ("kl", [0.0, 1.0, 2.0, 3.0])):
        with SummaryWriter(tmp_path / name) as writer:
            for step in range(4):
                writer.add_scalar("objective/kl", step, step)
                writer.add_scalar("objective/divergence", divergence[step], step)
    out = tool("tools.summarize_run", str(tmp_path / "chi2"), str(tmp_path / "kl"), "--runs", "--blocks", "2", check=True).stdout
    chi2, kl = out.split(f"== {tmp_path / 'kl'}")
    assert "divergence" in chi2 and "divergence" not in kl, out
    assert re.search(r"0-1\s+0\.5000\s+6\.0000", chi2) and re.search(r"2-3\s+2\.5000\s+1\.5000", chi2), chi2


def test_summarize_run_histograms_prints_each_iterations_exact_spread_and_draws_it(tmp_path):
    """python -m tools.summarize_run --histograms: per iteration the mean, std, min and max of the prompts/kl histogram's values
    (exact, from its moments: values 1, 2, 3, 6 have mean 3, std sqrt(3.5) = 1.8708), and one PNG for two runs."""

    import torch
    from torch.utils.tensorboard import SummaryWriter

    for name, scale in (("one_beta", 1.0), ("budgets", 0.5)):
        with SummaryWriter(tmp_path / name) as writer:
            for step in range(3):
                writer.add_histogram("prompts/kl", torch.tensor([1.0, 2.0, 3.0, 6.0]) * scale, step)
    png = tmp_path / "spread.png"
    out = tool("tools.summarize_run", str(tmp_path / "one_beta"), str(tmp_path / "budgets"), "--histograms", str(png), check=True).stdout
    one_beta, budgets = out.split(f"== {tmp_path / 'budgets'}")
    assert re.search(r"\n\s+2\s+3\.0000\s+1\.8708\s+1\.0000\s+6\.0000", one_beta), one_beta
    assert re.search(r"\n\s+2\s+1\.5000\s+0\.9354\s+0\.5000\s+3\.0000", budgets), budgets
    assert png.stat().st_size > 10_000
    missing = tool("tools.summarize_run", str(tmp_path / "one_beta"), "--histograms", str(png), "--tag", "prompts/beta")
    assert missing.returncode == 2 and "no histogram prompts/beta" in missing.stderr


def test_summarize_run_prompts_prints_each_prompts_kl_and_beta_and_the_means_of_each_budget_group(tmp_path):
    """python -m tools.summarize_run --prompts: per prompt over the last --last iterations of prompts.csv (PromptLog's rows) the
    KL's mean and std and the mean and last beta, by hand; then per budget, or per --groups column, the prompts' means;
    with --plot, a PNG of each group's KL and beta over the iterations."""
    import json

    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "run"
    with SummaryWriter(run) as writer:
        writer.add_scalar("objective/kl", 1.0, 0)
    rows = ["iteration,id,kl,responses,beta,budget"]
    for step, (a, b) in enumerate([(9.0, 9.0), (1.0, 4.0), (3.0, 8.0)]):  # iteration 0 is left out by --last 2
        rows += [f"{step},p0,{a},4,{0.1 * (step + 1)},1.5", f"{step},p1,{b},4,0.5,6.0"]
    (run / "prompts.csv").write_text("\n".join(rows) + "\n")
    out = tool("tools.summarize_run", str(run), "--prompts", "--last", "2", check=True).stdout
    # p0: KL 1, 3 -> mean 2, std sqrt(2) = 1.4142; beta 0.2, 0.3 -> mean 0.25, last 0.3. p1: KL 4, 8 -> 6, 2.8284
    assert re.search(r"p0\s+1\.5\s+2\.0000\s+1\.4142\s+0\.2500\s+0\.3000", out), out
    assert re.search(r"p1\s+6\.0\s+6\.0000\s+2\.8284\s+0\.5000\s+0\.5000", out), out
    assert "budget 1.5: 1 prompts, kl_mean 2.0000" in out and "budget 6.0: 1 prompts, kl_mean 6.0000" in out, out
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}", "id": f"p{i}", "group": "all"}) + "\n" for i in range(2)))
    groups = ("--groups", f"{prompts}:group", "--plot", str(tmp_path / "g.png"))
    grouped = tool("tools.summarize_run", str(run), "--prompts", "--last", "2", *groups, check=True).stdout
    assert "group all: 2 prompts, kl_mean 4.0000, kl_std 2.1213, beta_mean 0.3750" in grouped, grouped
    assert (tmp_path / "g.png").stat().st_size > 10_000  # each group's KL and beta over the iterations
    missing = tool("tools.summarize_run", str(run), "--prompts", "--groups", f"{prompts}:budget")
    assert missing.returncode == 2 and "column 'budget' not found" in missing.stderr, missing.stderr
