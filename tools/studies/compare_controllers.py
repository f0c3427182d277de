"""Compare the beta controllers on one task: KL and beta over time against the KL target.

    python -m tools.studies.compare_controllers [--iterations 80] [--target 4] [--out runs/compare_controllers] [--fast]
    python -m tools.studies.compare_controllers --advantage grpo --num-generations 4    # critic-free training

Runs fixed, adaptive, band, pid and dual through the real training loop on the same task and
seed: the tiny random Llama (``policy: tiny``) learning to write the letter "e" (reward =
number of "e"s, ``rlhf_lightning_plugins.rewards.toy:char_count``), k1 KL in the reward, 8
prompts per iteration. With beta fixed at the tiny config's 0.05 the KL of this task runs far
past a few nats within 20 iterations, so a target of a few nats gives the controllers work.
Every controller starts from the same beta (``--init-beta``); the controllers' other settings
are their defaults, except where ``CONTROLLERS`` below says (adaptive's horizon is scaled to
the batch, so that it can move beta within a short run at all). ``--advantage NAME`` trains with
that advantage estimator: ``--num-generations`` responses (default 4 for a group baseline) to
each of 8 / num_generations prompts, so every iteration still sees 8 responses.

Writes to ``--out``: ``trajectories.csv`` (iteration, controller, kl, beta, reward; beta is
the value used in that iteration), ``kl_beta.png`` and ``summary.md``, a table of per
controller settling time (the first iteration after which the KL, averaged over a trailing
window of ``--window`` iterations to smooth the sampling noise of 8 responses, stays within
+-``--tolerance`` of the target) and overshoot (max KL / target - 1, raw KL).
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from lightning import Callback, Trainer, seed_everything

from rlhf_lightning.data import PromptDataModule
from rlhf_lightning.interfaces import BetaController
from rlhf_lightning.module import PPORLHF
from rlhf_lightning.registry import registry
from rlhf_lightning.trainer_settings import QUIET_TRAINER
from rlhf_lightning_plugins.rewards.function import CallableReward
from tools._cli_args import option_number, tool_parser

BATCH_SIZE = 8
# name -> extra init_args beyond init_beta and target
CONTROLLERS: dict[str, dict] = {
    "fixed": {},
    "adaptive": {"horizon": 2 * BATCH_SIZE},  # beta * (1 +- 0.2 * 8 / 16): at most +-10% per iteration
    "band": {},
    "pid": {},
    "dual": {},
}


class Recorder(Callback):
    """Keeps (kl, beta, reward) of every iteration and stops the fit after ``iterations``."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations
        self.rows: list[tuple[float, float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        self.rows.append((float(m["objective/kl"]), float(m["objective/beta"]), float(m["objective/reward"])))
        if pl_module.iteration >= self.iterations:
            trainer.should_stop = True


def build_controller(name: str, target: float, init_beta: float) -> BetaController:
    kwargs = {"init_beta": init_beta, **({} if name == "fixed" else {"target": target}), **CONTROLLERS[name]}
    return registry("beta_controller").get(name)(**kwargs)


def run_controller(
    ctrl: BetaController,
    iterations: int,
    seed: int,
    max_new_tokens: int,
    workdir: Path,
    advantage: str = "gae",
    num_generations: int = 1,
) -> list[tuple]:
    """One fit of the tiny task (as tests/helpers.py ``fit``) with ``ctrl``; returns per-iteration rows."""
    seed_everything(seed, verbose=False)
    module = PPORLHF(
        policy="tiny",
        seed=seed,
        kl_estimator="k1",
        beta_controller=ctrl,
        advantage_estimator=advantage,
        sampling=dict(num_generations=num_generations, max_new_tokens=max_new_tokens),
        ppo=dict(epochs=2, num_minibatches=1, vf_coef=0.5),
        optim=dict(lr=3e-3),
        runtime=dict(log_samples_every_n_steps=0),
        reward_model=CallableReward(function="rlhf_lightning_plugins.rewards.toy:char_count", kwargs={"chars": "e"}),
    )
    recorder = Recorder(iterations)
    trainer = Trainer(**QUIET_TRAINER, max_epochs=-1, callbacks=[recorder], default_root_dir=str(workdir))
    trainer.fit(module, datamodule=PromptDataModule(batch_size=BATCH_SIZE // num_generations))
    return recorder.rows


def settling_time(kls: list[float], target: float, tolerance: float, window: int) -> int | None:
    """First iteration from which the trailing-window mean KL stays within target * (1 +- tolerance)."""
    settled = None
    for i in range(len(kls)):
        recent = kls[max(0, i - window + 1) : i + 1]
        inside = abs(sum(recent) / len(recent) - target) <= tolerance * target
        settled = (i if settled is None else settled) if inside else None
    return settled


def summary_table(results: dict[str, list[tuple]], target: float, tolerance: float, window: int) -> str:
    lines = [
        f"KL target {target:g} (nats per response); settling: first iteration after which the {window}-iteration "
        f"trailing mean KL stays within +-{tolerance:.0%} of the target; overshoot: max KL / target - 1.",
        "",
        "| controller | settling time (iteration) | overshoot | final KL (last 10 mean) | final beta | final reward (last 10 mean) |",
        "|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        kls, betas, rewards = zip(*rows, strict=True)
        settle = settling_time(list(kls), target, tolerance, window)
        tail = slice(-min(10, len(rows)), None)
        lines.append(
            f"| {name} | {'never' if settle is None else settle} | {max(kls) / target - 1:+.2f} | "
            f"{sum(kls[tail]) / len(kls[tail]):.2f} | {betas[-1]:.4g} | {sum(rewards[tail]) / len(rewards[tail]):.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict[str, list[tuple]], target: float, tolerance: float, path: Path, advantage: str = "gae") -> None:
    fig, (ax_kl, ax_beta) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name, rows in results.items():
        kls, betas, _ = zip(*rows, strict=True)
        ax_kl.plot(range(len(kls)), kls, label=name, linewidth=1.3)
        ax_beta.plot(range(len(betas)), betas, label=name, linewidth=1.3)
    ax_kl.axhline(target, color="black", linestyle="--", linewidth=1, label="target")
    ax_kl.axhspan(target * (1 - tolerance), target * (1 + tolerance), color="gray", alpha=0.15, label=f"+-{tolerance:.0%}")
    ax_kl.set_ylabel("KL (nats per response)")
    ax_kl.set_yscale("symlog", linthresh=1.0)
    ax_kl.legend(ncol=4, fontsize=8)
    ax_kl.set_title(f"Beta controllers on the tiny 'write e' task ({advantage})")
    ax_beta.set_ylabel("beta")
    ax_beta.set_yscale("symlog", linthresh=1e-3)  # dual's beta can be exactly 0
    ax_beta.set_ylim(bottom=0)
    ax_beta.set_xlabel("PPO iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument(
        "--iterations",
        type=option_number(integer=True, at_least=1),
        default=None,
        help="PPO iterations per controller (default 80; 4 with --fast)",
    )
    parser.add_argument("--target", type=option_number(above=0), default=4.0, help="KL target, nats per response (sequence_sum)")
    parser.add_argument("--init-beta", type=option_number(at_least=0), default=0.05, help="every controller's starting beta")
    parser.add_argument("--out", default="runs/compare_controllers")
    parser.add_argument("--seed", type=option_number(integer=True), default=0)
    parser.add_argument("--tolerance", type=option_number(above=0), default=0.5, help="settling band, a fraction of the target")
    parser.add_argument(
        "--window", type=option_number(integer=True, at_least=1), default=5, help="trailing-mean window for the settling time"
    )
    parser.add_argument("--controllers", nargs="+", default=list(CONTROLLERS), choices=list(CONTROLLERS))
    parser.add_argument("--fast", action="store_true", help="a few short iterations (smoke test)")
    parser.add_argument("--advantage", default="gae", help="advantage estimator (gae, grpo, dr_grpo, rloo, reinforce_pp)")
    parser.add_argument(
        "--num-generations",
        type=option_number(integer=True, at_least=1),
        help="responses per prompt (default: 4 for a group baseline, else 1)",
    )
    args = parser.parse_args(argv)
    min_group = registry("advantage_estimator").get(args.advantage).min_group_size
    args.num_generations = (4 if min_group > 1 else 1) if args.num_generations is None else args.num_generations
    if BATCH_SIZE % args.num_generations:
        parser.error(f"--num-generations must divide the {BATCH_SIZE} responses per iteration")
    # The tiny model gains nothing from intra-op threads, and on a busy 2-core machine they
    # oversubscribe the cores (iterations then take seconds instead of a fraction of one).
    torch.set_num_threads(1)
    iterations = (4 if args.fast else 80) if args.iterations is None else args.iterations
    max_new_tokens = 8 if args.fast else 16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    results: dict[str, list[tuple]] = {}
    for name in args.controllers:
        start = time.perf_counter()
        ctrl = build_controller(name, args.target, args.init_beta)
        results[name] = run_controller(ctrl, iterations, args.seed, max_new_tokens, out / "lightning", args.advantage, args.num_generations)
        print(f"{name}: {len(results[name])} iterations in {time.perf_counter() - start:.1f} s", flush=True)

    with open(out / "trajectories.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["iteration", "controller", "kl", "beta", "reward"])
        for name, rows in results.items():
            for i, (kl, beta, reward) in enumerate(rows):
                writer.writerow([i, name, f"{kl:.6g}", f"{beta:.6g}", f"{reward:.6g}"])
    plot(results, args.target, args.tolerance, out / "kl_beta.png", f"{args.advantage}, {args.num_generations} per prompt")
    table = summary_table(results, args.target, args.tolerance, args.window)
    (out / "summary.md").write_text(table)
    print(table)
    print(f"wrote {out / 'trajectories.csv'}, {out / 'kl_beta.png'}, {out / 'summary.md'}")
    if not all(math.isfinite(v) for rows in results.values() for row in rows for v in row):
        raise SystemExit("non-finite KL, beta or reward in the results")


if __name__ == "__main__":
    main()
