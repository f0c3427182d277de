"""Where in-flight weight updates land against J* (docs/async.md, "In-flight weight updates").

    python -m tools.studies.inflight                 # the docs' exact table (9 cells, seconds each)
    python -m tools.studies.inflight --sampled       # and the sampled cells (the asynchronous loop, ~20-50 s each)

Exact cells: ``exact.training.expected_train`` on random:3 (3-token responses; beta 1, k3 in the loss with its sequence
term, one epoch of 2 AdamW steps, 60 iterations at lr 2e-3 decayed to 1/10), the sampler k updates behind with a switch
every N tokens (token t from version min(i - 1, max(0, i - k) + t // N)), the ``sequence`` correction dividing by each
token's own version's mu (``own``) or, the declared mistake, by the newest version's alone (``newest``); the first cell
is the synchronous loop. Sampled cells: the matrix's recommended recipes (``tools.studies.optimum_check``'s settings,
sampling seed 0) trained by the asynchronous loop with ``model.off_policy.inflight_every`` N. Prints one ``INFLIGHT``
line per cell (``gap``: (J* - J) over the task's scale; the last iteration's ``off_policy/ess``) and a markdown table.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from rlhf_lightning.exact.tasks import task_named
from rlhf_lightning.exact.training import expected_train, train

RECIPE = dict(kl_estimator="k3", kl_penalty="loss", ppo_epochs=1)
SAMPLED = {"gae-k1-reward": dict(advantage="gae", estimator="k1", placement="reward"), "rloo-k3-loss-sequence": dict(advantage="rloo")}


def exact_cell(staleness: int, every: int, label: str, iterations: int = 60) -> dict[str, float]:
    """The last row of one exact cell (``every`` 0 with ``staleness`` 0: the synchronous loop)."""
    correction = "sequence" if staleness else "none"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = expected_train(
            task_named("random:3"),
            iterations,
            1.0,
            every=iterations,
            staleness=staleness,
            correction=correction,
            inflight_every=every,
            inflight_label=label,
            **RECIPE,
        )
    return rows[-1]


def sampled_cell(
    advantage: str,
    staleness: int,
    correction: str = "sequence",
    inflight_every: int = 0,
    seed: int = 0,
    estimator: str = "k3",
    placement: str = "loss",
) -> dict[str, float]:
    """One cell of ``python -m tools.studies.optimum_check --matrix --task random:3 --max-staleness K`` (one epoch, the
    matrix's own settings for the recipe ``advantage``, ``estimator``, ``placement``) trained by the asynchronous loop
    ``staleness`` updates behind, with in-flight updates every ``inflight_every`` tokens, at sampling seed ``seed``: the
    last exact row."""
    from tools.studies import optimum_check
    from tools.studies.optimum_check import matrix, recipes

    args = optimum_check.parse_args(["--task", "random:3", "--matrix"])
    settings = recipes.task_settings(args, "random:3")
    kwargs = recipes.recipe_settings(args, settings, advantage, estimator, placement, "importance", "sequence", 1)
    cell = matrix.Cell(
        "random:3", advantage, estimator, placement, "importance", "sequence", 1, seed, "token_mean", staleness, correction, inflight_every
    )
    iterations = recipes.iterations_of(settings, advantage, placement, "sequence")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, tracker = train(task_named("random:3"), iterations, every=iterations, seed=seed, **kwargs, **matrix.stale_settings(args, cell))
    return tracker.last


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--staleness", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--every", nargs="+", type=int, default=[1, 2], help="model.off_policy.inflight_every values")
    parser.add_argument("--sampled", action="store_true", help="also the sampled cells of the recommended recipes")
    parser.add_argument("--seed", type=int, default=0, help="the sampled cells' sampling seed")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a 16-wide model: more threads only synchronise (10-50x slower on a busy 2-core box)
    start = time.time()
    synchronous = exact_cell(0, 0, "token")["gap"]
    print(f"INFLIGHT exact staleness=0 every=0 gap={synchronous:.4f} seconds={time.time() - start:.0f}", flush=True)
    lines = ["| sampler (k, N) | own version per token | newest label |", "|---|---:|---:|"]
    for k in args.staleness:
        for every in args.every:
            cells = {}
            for label in ("token", "newest"):
                start = time.time()
                row = cells[label] = exact_cell(k, every, label)
                ess = row.get("off_policy/ess", 1.0)
                print(
                    f"INFLIGHT exact staleness={k} every={every} label={label} gap={row['gap']:.4f} ess={ess:.3f} seconds={time.time() - start:.0f}",
                    flush=True,
                )
            own, newest = cells["token"], cells["newest"]
            lines.append(f"| k = {k}, N = {every} | {own['gap']:.4f} (ESS {own.get('off_policy/ess', 1.0):.3f}) | {newest['gap']:.4f} |")
    print(f"\nsynchronous: {synchronous:.4f}\n" + "\n".join(lines))
    if not args.sampled:
        return
    lines = ["| recipe | " + " | ".join(f"k = {k}, N = {n}" for k in args.staleness for n in args.every) + " |"]
    lines.append("|---|" + "---:|" * (len(args.staleness) * len(args.every)))
    for recipe in SAMPLED:
        gaps = []
        for k in args.staleness:
            for every in args.every:
                start = time.time()
                gaps.append(sampled_cell(staleness=k, inflight_every=every, seed=args.seed, **SAMPLED[recipe])["gap"])
                print(
                    f"INFLIGHT sampled recipe={recipe} staleness={k} every={every} seed={args.seed} gap={gaps[-1]:.4f} seconds={time.time() - start:.0f}",
                    flush=True,
                )
        lines.append(f"| {recipe} | " + " | ".join(f"{g:.4f}" for g in gaps) + " |")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
