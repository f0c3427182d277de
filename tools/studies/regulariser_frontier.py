"""What the KL penalty buys over the KL-free regularisers: reward against the exact KL to the
reference on the enumerable task, for a beta sweep, a clip-higher sweep, an entropy-target sweep
and beta = 0 alone.

    python -m tools.studies.regulariser_frontier                 # 2 seeds, 60 iterations per run (a few CPU minutes)
    python -m tools.studies.regulariser_frontier --fast          # the tests' version

Every run trains the unchanged PPO loop on ``rlhf_lightning.exact``'s terminal task (3 prompts,
3-token responses over 3 letters, reward = count of the prompt's letter, at most 3), where the
expected reward and KL(pi || pi_ref) of a policy are exact sums. The families:

- ``kl_penalty``: k1 in the reward at a fixed beta (``--betas``), PPO's clip;
- ``clip_higher``: beta = 0, DAPO's decoupled clip with eps_high in ``--eps-high``;
- ``entropy``: beta = 0, an entropy bonus whose coefficient a PID controller (on log coef,
  kp 0.3, ki 0.02, kd 0.2) moves toward a target entropy (``--entropy-targets``, nats per token;
  the uniform policy's is log 3 = 1.10);
- ``none``: beta = 0, PPO's clip alone.

The exact frontier is the KL-regularised optimum pi*_beta ∝ pi_ref exp(r / beta) over a grid of
betas: for each KL it is the largest expected reward any policy reaches within that KL (the
optimum of max E r s.t. KL <= eps is pi* for some beta). Each run's distance below it at its own
KL is ``frontier_gap``. Writes ``<out>/frontier.csv`` (every run's exact reward and KL every
``--every`` iterations), ``<out>/frontier.png`` and prints the table of final points.
"""

from __future__ import annotations

import argparse
import csv
import logging
import statistics
import time
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

from rlhf_lightning.exact.closed_form import expected_reward, kl_divergence, optimal_logprobs
from rlhf_lightning.exact.tasks import TASKS, ExactPPORLHF
from rlhf_lightning.exact.training import train
from rlhf_lightning_plugins.beta_controllers import FixedBeta, PIDBeta
from rlhf_lightning_plugins.policy_losses import ClipHigher
from tools._cli_args import option_number, tool_parser

PPO = dict(batch_size=48, lr=2e-3, critic_lr=2e-3, lr_final=0.1, ppo_epochs=4, num_minibatches=2, vf_coef=0.5, log_samples_every_n_steps=0)


def runs(args: argparse.Namespace) -> list[tuple[str, float, dict]]:
    """(family, setting, module arguments) of every run."""
    out = [("kl_penalty", beta, dict(beta_controller=FixedBeta(beta))) for beta in args.betas]
    out += [
        ("clip_higher", eps, dict(beta_controller=FixedBeta(0.0), policy_loss=ClipHigher(clip_low=0.2, clip_high=eps)))
        for eps in args.eps_high
    ]
    out += [
        (
            "entropy",
            target,
            dict(
                beta_controller=FixedBeta(0.0),
                entropy_controller=PIDBeta(
                    init_beta=0.05, target=target, kp=0.3, ki=0.02, kd=0.2, beta_min=1e-4, beta_max=10.0, unit="token_mean"
                ),
            ),
        )
        for target in args.entropy_targets
    ]
    out.append(("none", 0.0, dict(beta_controller=FixedBeta(0.0))))
    return out


FRONTIER_BETAS = np.geomspace(0.05, 50, 200)


def exact_frontier(seed: int, betas: np.ndarray = FRONTIER_BETAS) -> tuple[np.ndarray, np.ndarray]:
    """(KL, reward) of pi*_beta for each beta, KL increasing, against the reference that train()
    builds for ``seed`` (each seed initialises its own tiny model, hence its own pi_ref)."""
    module = ExactPPORLHF(TASKS["terminal"], seed=seed)
    module.configure_model()
    ref, rewards = module.exact_ref_logprobs(), TASKS["terminal"].rewards()
    points = [(kl_divergence(opt, ref), expected_reward(opt, rewards)) for opt in (optimal_logprobs(ref, rewards, b) for b in betas)]
    kls, reward = map(np.array, zip(*sorted(points), strict=True))
    return kls, reward


def main(argv: list[str] | None = None) -> list[dict]:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("--betas", type=option_number(above=0), nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    parser.add_argument("--eps-high", type=option_number(above=0), nargs="+", default=[0.28, 0.5, 1.0])
    parser.add_argument("--entropy-targets", type=option_number(above=0), nargs="+", default=[0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--seeds", type=option_number(integer=True), nargs="+", default=[0, 1])
    parser.add_argument("--iterations", type=option_number(integer=True, at_least=1), default=60)
    parser.add_argument(
        "--every", type=option_number(integer=True, at_least=1), default=10, help="record the exact point every N iterations"
    )
    parser.add_argument("--out", default="runs/regulariser_frontier")
    parser.add_argument("--fast", action="store_true", help="one setting per family, one seed, 20 iterations")
    args = parser.parse_args(argv)
    if args.fast:
        args.betas, args.eps_high, args.entropy_targets, args.seeds, args.iterations = [0.5], [1.0], [0.5], [0], 20
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # Points only exist once every run's policy has an exact reward and KL: the tracker's rows.
    frontiers = {seed: exact_frontier(seed) for seed in args.seeds}
    trajectories, finals = [], []
    for family, setting, kwargs in runs(args):
        start = time.perf_counter()
        ends = []
        for seed in args.seeds:
            _, tracker = train(TASKS["terminal"], args.iterations, every=args.every, seed=seed, kl_estimator="k1", **PPO, **kwargs)
            trajectories += [(family, setting, seed, row["iteration"], row["reward"], row["kl_to_ref"]) for row in tracker.rows]
            end = tracker.last
            ends.append((end["reward"], end["kl_to_ref"], float(np.interp(end["kl_to_ref"], *frontiers[seed])) - end["reward"]))
        reward, kl, gap = (statistics.mean(values) for values in zip(*ends, strict=True))
        finals.append({"family": family, "setting": setting, "reward": reward, "kl": kl, "frontier_gap": gap})
        print(
            f"{family} {setting:g}: reward {finals[-1]['reward']:.3f}, KL {finals[-1]['kl']:.3f} ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )

    with open(out / "frontier.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["family", "setting", "seed", "iteration", "reward", "kl"])
        writer.writerows(trajectories)
    plot(trajectories, finals, *frontiers[args.seeds[0]], out / "frontier.png")
    print(
        f"\nterminal task, {args.iterations} iterations, seeds {args.seeds}; exact expected reward (max 3) and "
        "KL(pi || pi_ref) of the final policy; frontier_gap = the exact frontier's reward at that KL minus the run's "
        "(each against its seed's own pi_ref); means over seeds\n"
    )
    print("| family | setting | reward | KL | frontier_gap |\n|---|---:|---:|---:|---:|")
    for row in finals:
        print(f"| {row['family']} | {row['setting']:g} | {row['reward']:.3f} | {row['kl']:.3f} | {row['frontier_gap']:+.3f} |")
    print(f"\nwrote {out / 'frontier.csv'} and {out / 'frontier.png'}")
    return finals


def plot(trajectories, finals, frontier_kl, frontier_reward, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot(frontier_kl, frontier_reward, color="black", linewidth=1.5, label="exact frontier (pi*_beta)")
    colors = {"kl_penalty": "tab:blue", "clip_higher": "tab:orange", "entropy": "tab:green", "none": "tab:red"}
    for row in finals:
        path_rows = [t for t in trajectories if t[0] == row["family"] and t[1] == row["setting"] and t[2] == trajectories[0][2]]
        ax.plot([t[5] for t in path_rows], [t[4] for t in path_rows], color=colors[row["family"]], alpha=0.35, linewidth=1)
        ax.scatter(row["kl"], row["reward"], color=colors[row["family"]], s=30, zorder=3)
        ax.annotate(f"{row['setting']:g}", (row["kl"], row["reward"]), textcoords="offset points", xytext=(4, -10), fontsize=7)
    for family, color in colors.items():
        ax.scatter([], [], color=color, label=family)
    ax.set_xlabel("exact KL(pi || pi_ref) (nats per response)")
    ax.set_ylabel("exact expected reward")
    ax.set_title("Final points (mean over seeds) and the first seed's paths\nagainst its exact frontier", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
