"""Print the main metrics of a finished run, iteration by iteration, from its TensorBoard events.

    python -m tools.summarize_run lightning_logs/quickstart/version_0 [--every 5]
    python -m tools.summarize_run lightning_logs/quickstart/version_0 --blocks 5   # means over blocks of 5 iterations
    python -m tools.summarize_run lightning_logs/tiny/version_0 lightning_logs/tiny/version_1   # a run and its resumption
    python -m tools.summarize_run runs/a/version_0 runs/b/version_0 --runs --plot ab.png   # two runs, side by side
    python -m tools.summarize_run runs/a/version_0 runs/b/version_0 --runs --histograms spread.png   # per-prompt KL spread


Iterations are numbered by the logged step (a resumed run goes on from where it stopped); with
several log folders, a step logged in a later folder replaces the same step of an earlier one, unless
``--runs`` makes each folder a run of its own (a table each). ``--plot PNG`` draws the KL, beta, the
response length and the share of responses cut at ``max_new_tokens`` over the iterations, one line per run;
``--plot-tags`` other logged tags instead (configs/distill.yaml's figure: ``--plot-tags objective/kl
objective/kl_to_initial objective/gold_reward``).
``--histograms PNG`` reads the histogram ``prompts/kl`` (each prompt's KL in the iteration, logged with a prompt
file: docs/metrics.md), prints its spread per iteration (mean, std, min, max: exact, from the histogram's
moments) and draws it over the iterations with, beside it, the histogram pooled over the last ``--last``
iterations, one colour per run: the spread one beta leaves between prompts, and what per-prompt budgets make of it.
``--prompts`` reads each run's ``prompts.csv`` (the ``PromptLog`` callback's rows: each prompt's KL and beta by id) and
prints, per prompt over the last ``--last`` iterations, its budget, the mean and std of its KL, its mean beta and its
last, then the same means per group of prompts with one budget; ``--groups FILE:COLUMN`` groups every run's prompts by
a column of a prompt file instead (``configs/budget_prompts.jsonl:kl_budget``: the one-beta run by the budgets of the other),
and ``--plot PNG`` draws each group's mean KL and mean beta over the iterations, a colour per run.

    python -m tools.summarize_run runs/a/version_0 runs/b/version_0 --runs --prompts --last 10 --groups prompts.jsonl:kl_budget
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tools._cli_args import log_folder, option_number, tool_parser

COLUMNS = (
    "objective/reward",
    "objective/gold_reward",
    "objective/kl",
    "objective/kl_to_initial",
    "objective/divergence",
    "objective/beta",
    "objective/net",
    "objective/entropy",
    "response/length",
)
PLOTTED = ("objective/kl", "objective/beta", "response/length", "response/truncated_fraction")


def read_scalars(log_dirs: str | list[str]) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} in step order, over one log folder or several (later folders winning)."""
    scalars: dict[str, dict[int, float]] = {}
    for log_dir in [log_dirs] if isinstance(log_dirs, str) else log_dirs:
        events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update((e.step, e.value) for e in events.Scalars(tag))
    return {tag: dict(sorted(by_step.items())) for tag, by_step in scalars.items()}


def print_table(scalars: dict[str, dict[int, float]], every: int, blocks: int | None) -> None:
    """The COLUMNS of one run, every ``every``-th iteration or as means over ``blocks`` iterations, then the val/ and timing/ tags."""
    # kl_to_initial only where the reference moved, divergence only under another divergence than the reverse KL
    # (otherwise each is objective/kl)
    same_as_kl = ("objective/kl_to_initial", "objective/divergence")
    columns = [c for c in COLUMNS if c in scalars and not (c in same_as_kl and scalars[c] == scalars["objective/kl"])]
    steps = list(scalars[columns[0]])
    if blocks:
        print("iters    " + "  ".join(f"{c.split('/')[-1]:>11}" for c in columns))
        for start in range(0, len(steps), blocks):
            block = steps[start : start + blocks]
            means = [sum(scalars[c][i] for i in block) / len(block) for c in columns]
            print(f"{block[0]:>3}-{block[-1]:<3}  " + "  ".join(f"{m:>11.4f}" for m in means))
    else:
        print("iter  " + "  ".join(f"{c.split('/')[-1]:>9}" for c in columns))
        for k, i in enumerate(steps):
            if k % every == 0 or k == len(steps) - 1:
                print(f"{i:>4}  " + "  ".join(f"{scalars[c][i]:>9.4f}" for c in columns))
    for tag in sorted(t for t in scalars if t.startswith(("val/", "timing/"))):
        values = list(scalars[tag].values())
        print(f"{tag}: last {values[-1]:.4f}" + (f", mean {sum(values) / len(values):.4f}" if len(values) > 1 else ""))


def plot(runs: dict[str, dict[str, dict[int, float]]], path: str, tags: tuple[str, ...] = PLOTTED) -> None:
    """One panel per tag of ``tags`` (PLOTTED by default) that some run logged, one line per run (labelled by its folder)."""
    missing = [t for t in tags if not any(t in scalars for scalars in runs.values())]
    if missing and tags != PLOTTED:  # the defaults that a run did not log are left out
        raise SystemExit(f"--plot-tags: no run logged {', '.join(missing)}")
    tags = [t for t in tags if any(t in scalars for scalars in runs.values())]
    fig, axes = plt.subplots(len(tags), 1, figsize=(8, 2.2 * len(tags)), sharex=True, squeeze=False)
    for ax, tag in zip(axes[:, 0], tags, strict=True):
        for label, scalars in runs.items():
            if tag in scalars:
                ax.plot(list(scalars[tag]), list(scalars[tag].values()), label=label, linewidth=1.3)
        ax.set_ylabel(tag.split("/")[-1])
    axes[0, 0].legend(fontsize=8)
    axes[-1, 0].set_xlabel("PPO iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def read_histograms(log_dir: str, tag: str) -> list:
    """The HistogramEvents of ``tag`` in ``log_dir``, in step order (empty where the run logged none)."""
    events = EventAccumulator(log_dir, size_guidance={"histograms": 0})
    events.Reload()
    return sorted(events.Histograms(tag), key=lambda e: e.step) if tag in events.Tags()["histograms"] else []


def histogram_spread(histo) -> tuple[float, float, float, float]:
    """(mean, std, min, max) of the values of one TensorBoard histogram, exact from its stored moments."""
    mean = histo.sum / histo.num
    return mean, max(histo.sum_squares / histo.num - mean**2, 0.0) ** 0.5, histo.min, histo.max


def plot_histograms(runs: dict[str, list], path: str, tag: str, last: int) -> None:
    """Left: each run's spread of ``tag`` per iteration (mean, +-std, min-max); right: its histogram pooled over the last iterations."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, events) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        steps = [e.step for e in events]
        mean, std, low, high = zip(*(histogram_spread(e.histogram_value) for e in events), strict=True)
        left.plot(steps, mean, color=color, label=run_label(label), linewidth=1.4)
        left.fill_between(
            steps, [m - s for m, s in zip(mean, std, strict=True)], [m + s for m, s in zip(mean, std, strict=True)], color=color, alpha=0.25
        )
        left.fill_between(steps, low, high, color=color, alpha=0.08)
        counts: dict[float, float] = {}
        for event in events[-last:]:
            h = event.histogram_value
            for limit, count in zip(h.bucket_limit, h.bucket, strict=True):
                counts[limit] = counts.get(limit, 0.0) + count
        pooled = sorted((limit, count) for limit, count in counts.items() if count)
        values = [v for limit, count in pooled for v in [limit] * round(count)]
        right.hist(values, bins=20, color=color, alpha=0.5, label=f"{run_label(label)} (last {min(last, len(events))} iterations)")
    left.set(xlabel="PPO iteration", ylabel=f"{tag}: mean, +-std, min-max")
    right.set(xlabel=f"{tag} (bucket upper limits)", ylabel="prompt-iterations")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def print_histograms(runs: dict[str, list], tag: str) -> None:
    for folder, events in runs.items():
        print(f"== {folder}: {tag} over the iteration's prompts\niter      mean       std       min       max")
        for event in events:
            print(f"{event.step:>4}  " + "  ".join(f"{v:>8.4f}" for v in histogram_spread(event.histogram_value)))


def read_prompt_log(log_dir: str) -> dict[str, list[dict[str, float | str]]]:
    """{prompt id: its rows of ``<log_dir>/prompts.csv`` in iteration order} (``PromptLog``; a resumed run's rows of
    one iteration replace the earlier ones)."""
    rows: dict[str, dict[int, dict[str, float | str]]] = {}
    with (Path(log_dir) / "prompts.csv").open(newline="") as file:
        for row in csv.DictReader(file):
            budget = float(row["budget"]) if row["budget"] else ""
            entry = {"kl": float(row["kl"]), "beta": float(row["beta"]), "budget": budget}
            rows.setdefault(row["id"], {})[int(row["iteration"])] = entry
    return {prompt: [by_step[i] for i in sorted(by_step)] for prompt, by_step in rows.items()}


def print_prompts(log_dir: str, last: int, groups: dict[str, str] | None) -> None:
    """Per prompt over its last ``last`` iterations: budget, KL mean and std, mean beta, last beta; then per group
    (the prompts' budgets, or ``groups``: id -> group) the means of those columns over its prompts."""
    table, log = {}, read_prompt_log(log_dir)
    for prompt, rows in log.items():
        kls, betas = [r["kl"] for r in rows[-last:]], [r["beta"] for r in rows[-last:]]
        std = statistics.stdev(kls) if len(kls) > 1 else 0.0
        table[prompt] = (rows[-1]["budget"], statistics.fmean(kls), std, statistics.fmean(betas), betas[-1], len(kls))
    print(f"== {log_dir}: each prompt over its last {last} iterations\nprompt      budget   kl_mean    kl_std  beta_mean  beta_last")
    for prompt, (budget, kl, std, beta, beta_last, _) in sorted(table.items()):
        print(f"{prompt:<10}{budget:>8}  {kl:>8.4f}  {std:>8.4f}  {beta:>9.4f}  {beta_last:>9.4f}")
    by_group: dict[str, list[tuple]] = {}
    for prompt, values in table.items():
        by_group.setdefault(group_of(prompt, log[prompt], groups), []).append(values)
    for group, members in sorted(by_group.items()):
        kl, std, beta = (statistics.fmean(m[i] for m in members) for i in (1, 2, 3))
        label = "budget" if groups is None else "group"
        print(f"{label} {group}: {len(members)} prompts, kl_mean {kl:.4f}, kl_std {std:.4f}, beta_mean {beta:.4f}")


def run_label(folder: str) -> str:
    """A run's name in a legend: its config names (the folder above ``version_N``) and version."""
    path = Path(folder)
    return f"{path.parent.name}/{path.name}" if path.name.startswith("version_") else path.name


def group_of(prompt: str, rows: list[dict], groups: dict[str, str] | None) -> str:
    """A prompt's group: its value in ``groups`` (``--groups``), else its budget in the run."""
    return str(rows[-1]["budget"]) if groups is None else groups.get(prompt, "none")


def plot_prompt_groups(runs: dict[str, dict[str, list[dict]]], path: str, groups: dict[str, str] | None) -> None:
    """Each group's mean KL (left) and mean beta (right) over the iterations, a colour per run and a line style per
    group, with a group named by a number drawn as that level on the KL panel (its budget)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    colors, styles = plt.rcParams["axes.prop_cycle"].by_key()["color"], ["-", "--", ":", "-."]
    names = sorted({group_of(p, rows, groups) for log in runs.values() for p, rows in log.items()})
    for i, (label, log) in enumerate(runs.items()):
        for k, name in enumerate(names):
            members = [rows for p, rows in log.items() if group_of(p, rows, groups) == name]
            if not members:
                continue
            steps = range(min(len(rows) for rows in members))
            style = dict(color=colors[i % len(colors)], linestyle=styles[k % len(styles)], linewidth=1.3)
            left.plot(
                steps, [statistics.fmean(rows[t]["kl"] for rows in members) for t in steps], label=f"{run_label(label)}: {name}", **style
            )
            right.plot(steps, [statistics.fmean(rows[t]["beta"] for rows in members) for t in steps], **style)
    for name in names:
        with contextlib.suppress(ValueError):
            left.axhline(float(name), color="grey", linewidth=0.8, linestyle=":")
    left.set(xlabel="PPO iteration", ylabel="mean KL of the group's prompts")
    right.set(xlabel="PPO iteration", ylabel="mean beta of the group's prompts", yscale="log")
    left.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def prompt_groups(text: str) -> dict[str, str]:
    """``FILE:COLUMN`` -> {prompt id (the file's ``id`` column): its value in COLUMN}, for ``--groups``."""
    from rlhf_lightning.checks import ConfigError
    from rlhf_lightning.data import load_prompt_records

    path, _, column = text.rpartition(":")
    if not path or not column:
        raise argparse.ArgumentTypeError(f"{text!r} is not FILE:COLUMN")
    try:
        records = load_prompt_records(path, field="--groups", extra={"id": "--groups", column: "--groups"})
    except (ConfigError, FileNotFoundError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return {str(extra["id"]): str(extra[column]) for _, _, extra in records}


def main() -> None:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("log_dirs", nargs="+", metavar="log_dir", type=log_folder)
    parser.add_argument("--every", type=option_number(integer=True, at_least=1), default=1, help="print every n-th iteration")
    parser.add_argument(
        "--blocks", type=option_number(integer=True, at_least=1), help="print the mean of each block of n iterations instead"
    )
    parser.add_argument("--runs", action="store_true", help="each log folder is a run of its own, not a resumption of the one before")
    parser.add_argument(
        "--plot",
        metavar="PNG",
        help="draw KL, beta, length and the cut share over the iterations, a line per run; with --prompts each group's KL and beta",
    )
    parser.add_argument(
        "--plot-tags", nargs="+", metavar="TAG", help="with --plot: these logged tags instead (objective/kl objective/kl_to_initial ...)"
    )
    parser.add_argument("--histograms", metavar="PNG", help="print and draw the spread of the per-prompt histogram --tag, a colour per run")
    parser.add_argument(
        "--tag", default="prompts/kl", help="the histogram of --histograms (default prompts/kl; prompts/beta, prompts/kl_over_budget)"
    )
    parser.add_argument(
        "--last",
        type=option_number(integer=True, at_least=1),
        default=5,
        help="--histograms pools, --prompts averages the last n iterations (default 5)",
    )
    parser.add_argument(
        "--prompts", action="store_true", help="print each prompt's KL and beta over the last --last iterations from prompts.csv"
    )
    parser.add_argument("--groups", type=prompt_groups, metavar="FILE:COLUMN", help="with --prompts: group by a prompt file's column")
    args = parser.parse_args()
    if args.prompts:
        missing = [folder for folder in args.log_dirs if not (Path(folder) / "prompts.csv").is_file()]
        if missing:
            parser.error(f"--prompts: no prompts.csv in {', '.join(missing)} (written by the PromptLog callback)")
        for folder in args.log_dirs:
            print_prompts(folder, args.last, args.groups)
        if args.plot:
            plot_prompt_groups({folder: read_prompt_log(folder) for folder in args.log_dirs}, args.plot, args.groups)
        return
    if args.histograms:
        histograms = {folder: read_histograms(folder, args.tag) for folder in args.log_dirs}
        missing = [folder for folder, events in histograms.items() if not events]
        if missing:
            parser.error(f"--histograms: no histogram {args.tag} in {', '.join(missing)} (logged with a prompt file: docs/metrics.md)")
        print_histograms(histograms, args.tag)
        plot_histograms(histograms, args.histograms, args.tag, args.last)
        return
    runs = {folder: read_scalars(folder) for folder in args.log_dirs} if args.runs else {args.log_dirs[-1]: read_scalars(args.log_dirs)}
    for folder, scalars in runs.items():
        if args.runs:
            print(f"== {folder}")
        print_table(scalars, args.every, args.blocks)
    if args.plot:
        plot(runs, args.plot, tuple(args.plot_tags) if args.plot_tags else PLOTTED)


if __name__ == "__main__":
    main()
