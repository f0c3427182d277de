"""Print the main metrics of a finished run, iteration by iteration, from its TensorBoard events.

    python tools/summarize_run.py lightning_logs/quickstart/version_0 [--every 5]
    python tools/summarize_run.py lightning_logs/quickstart/version_0 --blocks 5   # means over blocks of 5 iterations
    python tools/summarize_run.py lightning_logs/tiny/version_0 lightning_logs/tiny/version_1   # a run and its resumption
    python tools/summarize_run.py runs/a/version_0 runs/b/version_0 --runs --plot ab.png   # two runs, side by side


Iterations are numbered by the logged step (a resumed run goes on from where it stopped); with
several log folders, a step logged in a later folder replaces the same step of an earlier one, unless
``--runs`` makes each folder a run of its own (a table each). ``--plot PNG`` draws the KL, beta, the
response length and the share of responses cut at ``max_new_tokens`` over the iterations, one line per run;
``--plot-tags`` other logged tags instead (configs/distill.yaml's figure: ``--plot-tags objective/kl
objective/kl_to_initial objective/gold_reward``).
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from _cli_args import log_folder, option_number

COLUMNS = (
    "objective/reward",
    "objective/gold_reward",
    "objective/kl",
    "objective/kl_to_initial",
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
    # kl_to_initial only where the reference moved (with a frozen one it is objective/kl)
    columns = [c for c in COLUMNS if c in scalars and not (c == "objective/kl_to_initial" and scalars[c] == scalars["objective/kl"])]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_dirs", nargs="+", metavar="log_dir", type=log_folder)
    parser.add_argument("--every", type=option_number(integer=True, at_least=1), default=1, help="print every n-th iteration")
    parser.add_argument(
        "--blocks", type=option_number(integer=True, at_least=1), help="print the mean of each block of n iterations instead"
    )
    parser.add_argument("--runs", action="store_true", help="each log folder is a run of its own, not a resumption of the one before")
    parser.add_argument("--plot", metavar="PNG", help="draw KL, beta, length and the cut share over the iterations, a line per run")
    parser.add_argument(
        "--plot-tags", nargs="+", metavar="TAG", help="with --plot: these logged tags instead (objective/kl objective/kl_to_initial ...)"
    )
    args = parser.parse_args()
    runs = {folder: read_scalars(folder) for folder in args.log_dirs} if args.runs else {args.log_dirs[-1]: read_scalars(args.log_dirs)}
    for folder, scalars in runs.items():
        if args.runs:
            print(f"== {folder}")
        print_table(scalars, args.every, args.blocks)
    if args.plot:
        plot(runs, args.plot, tuple(args.plot_tags) if args.plot_tags else PLOTTED)


if __name__ == "__main__":
    main()
