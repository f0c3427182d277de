"""Fit Gao et al.'s over-optimisation law to measured gold-reward curves, and plot them.

    python -m tools.studies.gao_fit single=runs/overopt/single/lightning_logs/overoptimisation/version_0 \\
        min=runs/overopt/min/lightning_logs/overoptimisation+overoptimisation_ensemble/version_0 \\
        --out tools/figures/gao_fit.png

Gao, Schulman and Hilton (2022, "Scaling Laws for Reward Model Overoptimization", eq. 2) find that
the gold reward of a policy trained by RL on a proxy reward follows

    R(d) = d (alpha - beta log d),   d = sqrt(KL(pi || pi_init)),

with R measured relative to the initial policy (R(0) = 0). Given the points (d_i, R_i), the model
is linear in (alpha, beta): least squares on the columns [d, -d log d] (numpy ``lstsq``), with
0 log 0 = 0. The fitted curve peaks at d* = exp(alpha / beta - 1), where R(d*) = beta d*.

Each run is ``label=log_dir`` (a TensorBoard folder of ``rlhf-lightning fit`` with a
``gold_reward_model``; a resumed run ``label=first,second``, its folders in order, a later one's steps winning). Its points are one per iteration: d from ``objective/kl_to_initial``
(the KL estimate of the rollout to the starting policy, which with a frozen reference is
``objective/kl``; negative estimates count as 0), R = ``objective/gold_reward`` minus the gold of
the first iteration, whose policy is the initial one. Per run the tool prints alpha, beta, the
fit's R^2 = 1 - SS_res / SS_tot over those points, the fitted peak, and, from means over blocks
of ``--blocks`` iterations (a 16-prompt batch is noisy), the measured gold peak, the KL at that
peak and the gold of the last block. It writes the table as ``<out>.csv`` beside the figure
``<out>`` (points and fitted curves).

Runs that spend their KL at different rates (another divergence, another beta) are compared at matched KL:
``--kl-bins 0 5 10 20`` prints, per run and bin, the mean gold and proxy reward (``objective/reward``) of the
iterations whose KL lies in [edge, next edge), with their count, and writes them to ``<out>_bins.csv``;
``--proxy`` adds a panel of the proxy reward against d beside the gold's.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from tools._cli_args import log_folder, option_number, tool_parser
from tools.summarize_run import read_scalars


def gao_fit(d: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    """Least-squares (alpha, beta) of R(d) = d (alpha - beta log d) and the fit's R^2."""
    d, gold = np.asarray(d, dtype=float), np.asarray(gold, dtype=float)
    d_log_d = np.where(d > 0, d * np.log(np.where(d > 0, d, 1.0)), 0.0)  # 0 log 0 = 0
    design = np.stack([d, -d_log_d], axis=1)  # (points, 2)
    (alpha, beta), *_ = np.linalg.lstsq(design, gold, rcond=None)
    residual = gold - design @ np.array([alpha, beta])
    r2 = 1.0 - float(residual @ residual) / float(((gold - gold.mean()) ** 2).sum())
    return {"alpha": float(alpha), "beta": float(beta), "r2": r2}


def gao_curve(d: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    """R(d) = d (alpha - beta log d), 0 at d = 0."""
    d = np.asarray(d, dtype=float)
    return np.where(d > 0, d * (alpha - beta * np.log(np.where(d > 0, d, 1.0))), 0.0)


def run_points(log_dir: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(iterations, KL to the initial policy, gold reward, proxy reward), one per logged iteration."""
    scalars = read_scalars(log_dir.split(","))
    gold = scalars.get("objective/gold_reward")
    if not gold:
        raise ValueError(f"{log_dir} has no objective/gold_reward (was model.gold_reward_model set?)")
    kl = scalars.get("objective/kl_to_initial") or scalars["objective/kl"]
    proxy = scalars.get("objective/reward", {})
    steps = [s for s in gold if s in kl]
    return (
        np.array(steps),
        np.array([kl[s] for s in steps]),
        np.array([gold[s] for s in steps]),
        np.array([proxy.get(s, math.nan) for s in steps]),
    )


def kl_bins(kl: np.ndarray, values: np.ndarray, edges: Sequence[float]) -> list[tuple[float, int]]:
    """(mean of ``values``, count) over the points whose KL lies in [edges[i], edges[i + 1]), one per bin;
    (nan, 0) for a bin no point reached. Runs are then compared at the same KL, not the same iteration."""
    out = []
    for low, high in itertools.pairwise(edges):
        inside = (kl >= low) & (kl < high)
        out.append((float(values[inside].mean()) if inside.any() else math.nan, int(inside.sum())))
    return out


def summarise(label: str, kl: np.ndarray, gold: np.ndarray, blocks: int) -> dict:
    """The fit on per-iteration points and the measured peak and end from block means."""
    d = np.sqrt(np.clip(kl, 0.0, None))
    relative = gold - gold[0]  # the first iteration samples the initial policy
    fit = gao_fit(d, relative)
    d_star = math.exp(fit["alpha"] / fit["beta"] - 1) if fit["beta"] > 0 else math.inf
    n = len(gold) // blocks * blocks  # whole blocks only
    block_gold, block_kl = gold[:n].reshape(-1, blocks).mean(1), kl[:n].reshape(-1, blocks).mean(1)
    peak = int(block_gold.argmax())
    return {
        "run": label,
        "iterations": len(gold),
        "gold_initial": float(gold[0]),
        **fit,
        "fit_peak_kl": d_star**2,
        "fit_peak_gain": fit["beta"] * d_star,
        "peak_block": f"{peak * blocks}-{(peak + 1) * blocks - 1}",
        "peak_gold": float(block_gold[peak]),
        "peak_kl": float(block_kl[peak]),
        "end_gold": float(block_gold[-1]),
        "end_kl": float(block_kl[-1]),
    }


def plot(curves: list[tuple[str, np.ndarray, np.ndarray, dict]], path: Path, proxies: Optional[list[np.ndarray]] = None) -> None:
    """Gold gain against d with each run's fitted curve; with ``proxies`` (one per run), the proxy reward against d beside it."""
    fig, axes = plt.subplots(1, 2 if proxies else 1, figsize=(14 if proxies else 8, 5.5), squeeze=False)
    ax = axes[0, 0]
    for (label, d, relative, fit), color in zip(curves, plt.cm.tab10.colors, strict=False):
        ax.scatter(d, relative, s=12, alpha=0.55, color=color)
        grid = np.linspace(0, d.max() * 1.05, 200)
        ax.plot(
            grid,
            gao_curve(grid, fit["alpha"], fit["beta"]),
            color=color,
            label=f"{label}: alpha {fit['alpha']:.3f}, beta {fit['beta']:.3f}, R^2 {fit['r2']:.2f}",
        )
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("d = sqrt(KL to the initial policy) (sqrt nats)")
    ax.set_ylabel("gold reward - gold of the initial policy")
    ax.set_title("Gold reward per iteration and the fitted R(d) = d (alpha - beta log d) (Gao et al. 2022)", fontsize=10)
    ax.legend(fontsize=8)
    if proxies:
        right = axes[0, 1]
        for (label, d, _, _), proxy, color in zip(curves, proxies, plt.cm.tab10.colors, strict=False):
            right.plot(d, proxy, marker="o", markersize=3, linewidth=0.8, alpha=0.8, color=color, label=label)
        right.set_xlabel("d = sqrt(KL to the initial policy) (sqrt nats)")
        right.set_ylabel("proxy reward (objective/reward, trained on)")
        right.set_title("Proxy reward per iteration", fontsize=10)
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("runs", nargs="+", metavar="label=log_dir")
    parser.add_argument(
        "--blocks", type=option_number(integer=True, at_least=1), default=5, help="iterations per block for the measured peak and end"
    )
    parser.add_argument("--out", type=Path, default=Path("tools/figures/gao_fit.png"), help="the figure; the table goes to <out>.csv")
    parser.add_argument("--proxy", action="store_true", help="a second panel: the proxy reward (objective/reward) against d")
    parser.add_argument(
        "--kl-bins",
        nargs="+",
        type=option_number(at_least=0),
        metavar="EDGE",
        help="KL bin edges (nats, increasing): mean gold and proxy per run in each bin, to <out>_bins.csv",
    )
    args = parser.parse_args(argv)
    if args.kl_bins is not None and (len(args.kl_bins) < 2 or any(b <= a for a, b in itertools.pairwise(args.kl_bins))):
        parser.error(f"--kl-bins must be at least 2 increasing edges, got {args.kl_bins}")
    rows, curves, points = [], [], []
    for spec in args.runs:
        label, sep, log_dir = spec.partition("=")
        if not sep or not label or not log_dir:
            parser.error(f"each run must be label=log_dir, got {spec!r}")
        try:
            for folder in log_dir.split(","):
                log_folder(folder)
        except argparse.ArgumentTypeError as err:
            parser.error(f"argument label=log_dir {spec!r}: {err}")
        _, kl, gold, proxy = run_points(log_dir)
        if len(gold) < max(3, args.blocks):
            parser.error(f"{log_dir} has {len(gold)} iterations; the fit needs at least 3 and one block of {args.blocks}")
        row = summarise(label, kl, gold, args.blocks)
        rows.append(row)
        curves.append((label, np.sqrt(np.clip(kl, 0.0, None)), gold - gold[0], row))
        points.append((label, kl, gold, proxy))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(curves, args.out, [proxy for *_, proxy in points] if args.proxy else None)
    table = args.out.with_suffix(".csv")
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("run               alpha    beta    R^2  fit peak KL  peak gold (iters, KL)     end gold (KL)")
    for r in rows:
        print(
            f"{r['run']:<16} {r['alpha']:6.3f}  {r['beta']:6.3f}  {r['r2']:5.2f}  {r['fit_peak_kl']:11.3g}  "
            f"{r['peak_gold']:.3f} ({r['peak_block']}, {r['peak_kl']:.1f})  {r['end_gold']:.3f} ({r['end_kl']:.1f})"
        )
    written = [table]
    if args.kl_bins is not None:
        bins = args.out.with_name(args.out.stem + "_bins.csv")
        edges = args.kl_bins
        with bins.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["run", "kl_low", "kl_high", "iterations", "gold", "proxy"])
            print("run               KL bin         iters   gold   proxy")
            for label, kl, gold, proxy in points:
                for (low, high), (g, n), (p, _) in zip(
                    itertools.pairwise(edges), kl_bins(kl, gold, edges), kl_bins(kl, proxy, edges), strict=True
                ):
                    writer.writerow([label, low, high, n, g, p])
                    print(f"{label:<16} [{low:g}, {high:g})  {n:5d}  {g:6.3f}  {p:6.3f}")
        written.append(bins)
    print(f"wrote {args.out} and {' and '.join(map(str, written))}")
    return rows


if __name__ == "__main__":
    main()
