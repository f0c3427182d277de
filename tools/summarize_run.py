"""Print the main metrics of a finished run, iteration by iteration, from its TensorBoard events.

    python tools/summarize_run.py lightning_logs/quickstart/version_0 [--every 5]
    python tools/summarize_run.py lightning_logs/quickstart/version_0 --blocks 5   # means over blocks of 5 iterations
    python tools/summarize_run.py lightning_logs/tiny/version_0 lightning_logs/tiny/version_1   # a run and its resumption

Iterations are numbered by the logged step (a resumed run goes on from where it stopped); with
several log folders, a step logged in a later folder replaces the same step of an earlier one.
"""

from __future__ import annotations

import argparse

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


def read_scalars(log_dirs: str | list[str]) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} in step order, over one log folder or several (later folders winning)."""
    scalars: dict[str, dict[int, float]] = {}
    for log_dir in [log_dirs] if isinstance(log_dirs, str) else log_dirs:
        events = EventAccumulator(log_dir, size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update((e.step, e.value) for e in events.Scalars(tag))
    return {tag: dict(sorted(by_step.items())) for tag, by_step in scalars.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_dirs", nargs="+", metavar="log_dir", type=log_folder)
    parser.add_argument("--every", type=option_number(integer=True, at_least=1), default=1, help="print every n-th iteration")
    parser.add_argument(
        "--blocks", type=option_number(integer=True, at_least=1), help="print the mean of each block of n iterations instead"
    )
    args = parser.parse_args()
    scalars = read_scalars(args.log_dirs)
    # kl_to_initial only where the reference moved (with a frozen one it is objective/kl)
    columns = [c for c in COLUMNS if c in scalars and not (c == "objective/kl_to_initial" and scalars[c] == scalars["objective/kl"])]
    steps = list(scalars[columns[0]])
    if args.blocks:
        print("iters    " + "  ".join(f"{c.split('/')[-1]:>11}" for c in columns))
        for start in range(0, len(steps), args.blocks):
            block = steps[start : start + args.blocks]
            means = [sum(scalars[c][i] for i in block) / len(block) for c in columns]
            print(f"{block[0]:>3}-{block[-1]:<3}  " + "  ".join(f"{m:>11.4f}" for m in means))
    else:
        print("iter  " + "  ".join(f"{c.split('/')[-1]:>9}" for c in columns))
        for k, i in enumerate(steps):
            if k % args.every == 0 or k == len(steps) - 1:
                print(f"{i:>4}  " + "  ".join(f"{scalars[c][i]:>9.4f}" for c in columns))
    for tag in sorted(t for t in scalars if t.startswith(("val/", "timing/"))):
        values = list(scalars[tag].values())
        print(f"{tag}: last {values[-1]:.4f}" + (f", mean {sum(values) / len(values):.4f}" if len(values) > 1 else ""))


if __name__ == "__main__":
    main()
