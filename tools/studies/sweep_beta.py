"""Sweep the KL coefficient beta: one PPO-RLHF run per beta, same seed, fixed controller.

    python -m tools.studies.sweep_beta                                   # the default task, 6 betas, 80 iterations
    python -m tools.studies.sweep_beta --betas 0 0.1 1 --iterations 60 --out /tmp/my_sweep
    python -m tools.studies.sweep_beta --fast                            # 2 betas, 10 iterations (the tests)
    python -m tools.studies.sweep_beta --full                            # 9 betas, 80 iterations
    python -m tools.studies.sweep_beta --config configs/quickstart.yaml --betas 0 0.05 0.2 --iterations 40
    python -m tools.studies.sweep_beta --advantage grpo --num-generations 4     # critic-free, GRPO's group baseline

Every run trains ``--config`` (any rlhf-lightning YAML) through LightningCLI with the beta
controller replaced by ``FixedBeta(beta)``; the seed, prompts and everything else stay as the
config and the ``--override`` arguments say. Per beta it records the mean of
``objective/reward`` and ``objective/kl`` over the last ``--last`` iterations, the
KL-regularised objective net = reward - beta * KL, and the final policy's reward and KL on the
validation prompts.

The default task is configs/tiny.yaml (the tiny model learns to write "e") with half a point
per "e" and twice its learning rate (DEFAULT_TASK). ``--advantage NAME`` trains with that advantage
estimator (``--num-generations`` responses per prompt, default 4 for the group baselines; with
the default task the prompts per iteration are divided by it, so every run sees 16 responses). With one point per "e", every beta up to 0.1
has the same optimum (nothing but "e"s: a point outweighs beta * ~4 nats of KL per "e"), so those
runs differ only in how fast they get there and their order is noise; and at a high learning rate
beta = 0 collapses its entropy on a plateau short of all "e"s. At half a point the optima spread
over the default betas and 80 iterations reach them: reward and KL fall together as beta rises,
from all "e"s at the smallest betas to the reference's neighbourhood at the largest. The measured
sweeps: docs/results.md ("The beta frontier").

Writes ``<out>/sweep_beta.csv``, ``<out>/sweep_beta.png`` (reward, KL and net per beta; the
reward-vs-KL frontier) and each run's TensorBoard logs under ``<out>/beta_<beta>/``, and prints
a table. The sweep drops the config's callbacks (progress bar, policy export) and checkpoints,
and runs torch with ``--threads`` intra-op threads (default 1): the tiny model gains nothing
from more, and on a busy CPU spinning OpenMP threads make it many times slower.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from lightning.pytorch.callbacks import Callback

from tools._cli_args import existing_file, option_number, tool_parser

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "tiny.yaml"
DEFAULT_BETAS = (0.0, 0.01, 0.05, 0.1, 0.2, 0.5)
FULL_BETAS = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
FAST_BETAS = (0.0, 0.5)
DEFAULT_TASK = (  # applied only when --config is not given; see the docstring
    '--model.reward_model.init_args.kwargs={"chars": "e", "scale": 0.5}',
    "--model.optim.lr=6e-3",
)
DEFAULT_TASK_PROMPTS = 16  # configs/tiny.yaml's data.batch_size
# Every run: no progress bar or export callbacks, no checkpoints, as many epochs as the iterations need
# (StopAfter ends it), and one validation, after training, on every validation prompt.
RUN_OVERRIDES = (
    "--trainer.callbacks=[]",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_model_summary=false",
    "--trainer.max_epochs=-1",
    "--trainer.limit_train_batches=1.0",
    "--trainer.limit_val_batches=1.0",
    "--trainer.check_val_every_n_epoch=1000000",
)


class StopAfter(Callback):
    """Records the logged metrics of every PPO iteration and stops training after ``iterations``
    (whatever the epoch length: ``global_step`` counts optimizer steps, not iterations)."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        if pl_module.iteration >= self.iterations:
            trainer.should_stop = True

    def last_mean(self, key: str, last: int) -> float:
        values = [row[key] for row in self.rows[-last:]]
        return sum(values) / len(values)


def train(config: str | Path, overrides: Sequence[str], iterations: int, root_dir: str | Path, callbacks: Sequence[Callback] = ()):
    """One run of ``config`` + ``overrides`` for ``iterations`` PPO iterations, logging to ``root_dir``,
    with ``callbacks`` after the one that stops it. Returns the LightningCLI (trainer, model, datamodule)
    and the per-iteration metrics."""
    from rlhf_lightning.cli import build_cli

    args = ["--config", str(config), *RUN_OVERRIDES, f"--trainer.default_root_dir={root_dir}", *overrides]
    cli = build_cli(args, run=False)  # seeds from the config's seed_everything, so every run starts alike
    history = StopAfter(iterations)
    cli.trainer.callbacks.extend([history, *callbacks])
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if cli.model.iteration < iterations:
        raise RuntimeError(f"the run stopped after {cli.model.iteration} of {iterations} iterations")
    return cli, history


def fixed_beta(beta: float) -> list[str]:
    return ["--model.beta_controller=FixedBeta", f"--model.beta_controller.init_args.init_beta={beta}"]


@dataclass
class SweepRow:
    beta: float
    reward: float  # mean objective/reward over the last iterations
    kl: float  # mean objective/kl (nats per response) over the same iterations
    net: float  # reward - beta * kl
    val_reward: float  # final policy on the validation prompts
    val_kl: float
    iterations: int
    seconds: float


def run_beta(beta: float, config, iterations: int, last: int, out: Path, extra: Sequence[str] = ()) -> SweepRow:
    start = time.perf_counter()
    cli, history = train(config, [*fixed_beta(beta), *extra], iterations, out / f"beta_{beta:g}")
    (val,) = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    reward, kl = history.last_mean("objective/reward", last), history.last_mean("objective/kl", last)
    return SweepRow(
        beta=beta,
        reward=reward,
        kl=kl,
        net=reward - beta * kl,
        val_reward=val["val/reward"],
        val_kl=val["val/kl"],
        iterations=iterations,
        seconds=time.perf_counter() - start,
    )


def write_csv(rows: Sequence[SweepRow], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


def frontier_labels(rows: Sequence[SweepRow], close: float = 0.03) -> list[tuple[SweepRow, str]]:
    """One label per group of points closer than ``close`` of each axis' range (betas that reach the
    same optimum land on one spot): (first row of the group, "b1, b2, ...")."""
    span_kl = (max(r.kl for r in rows) - min(r.kl for r in rows)) or 1.0
    span_reward = (max(r.reward for r in rows) - min(r.reward for r in rows)) or 1.0
    groups: list[list[SweepRow]] = []
    for row in rows:
        for group in groups:
            if abs(row.kl - group[0].kl) < close * span_kl and abs(row.reward - group[0].reward) < close * span_reward:
                group.append(row)
                break
        else:
            groups.append([row])
    return [(group[0], ", ".join(f"{r.beta:g}" for r in group)) for group in groups]


def plot(rows: Sequence[SweepRow], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{row.beta:g}" for row in rows]
    x = range(len(rows))  # categorical: beta = 0 has no place on a log axis
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    left.plot(x, [r.reward for r in rows], "o-", color="tab:green", label="raw reward")
    left.plot(x, [r.net for r in rows], "s--", color="tab:blue", label="net = reward - beta * KL")
    left.set_xticks(list(x), labels)
    left.set_xlabel("beta (fixed)")
    left.set_ylabel("reward per response")
    kl_axis = left.twinx()
    kl_axis.plot(x, [r.kl for r in rows], "^-", color="tab:red", label="KL (nats per response)")
    kl_axis.set_ylabel("KL to the reference (nats per response)", color="tab:red")
    handles = left.get_legend_handles_labels()[0] + kl_axis.get_legend_handles_labels()[0]
    left.legend(handles, [h.get_label() for h in handles], loc="lower left", fontsize=8)
    left.set_title("final reward, KL and net objective per beta")

    right.plot([r.kl for r in rows], [r.reward for r in rows], "o", color="tab:purple")
    for i, (row, betas) in enumerate(frontier_labels(rows)):  # alternate sides: neighbours often sit close
        right.annotate(
            f"beta={betas}",
            (row.kl, row.reward),
            textcoords="offset points",
            fontsize=8,
            xytext=(8, -12) if i % 2 else (-8, 6),
            ha="left" if i % 2 else "right",
        )
    right.set_xlabel("KL to the reference (nats per response)")
    right.set_ylabel("raw reward per response")
    right.set_title("reward-KL frontier: higher beta stays closer to the reference")
    right.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(rows: Sequence[SweepRow]) -> str:
    lines = ["| beta | reward | KL | net | val reward | val KL | seconds |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.beta:g} | {r.reward:.3f} | {r.kl:.3f} | {r.net:.3f} | {r.val_reward:.3f} | {r.val_kl:.3f} | {r.seconds:.0f} |")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("--config", type=existing_file, help="rlhf-lightning YAML (default: configs/tiny.yaml with DEFAULT_TASK)")
    parser.add_argument(
        "--betas", type=option_number(at_least=0), nargs="+", help=f"fixed betas to run (default: {' '.join(map(str, DEFAULT_BETAS))})"
    )
    parser.add_argument(
        "--iterations", type=option_number(integer=True, at_least=1), help="PPO iterations per run (default: 80; --fast: 10)"
    )
    parser.add_argument(
        "--last", type=option_number(integer=True, at_least=1), default=5, help="average the training metrics over the last K iterations"
    )
    parser.add_argument("--out", default="runs/sweep_beta", help="folder for the CSV, the PNG and the TensorBoard logs")
    parser.add_argument(
        "--threads", type=option_number(integer=True, at_least=0), default=1, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="ARG",
        help="extra CLI argument for every run, e.g. --override=--model.kl_estimator=k3",
    )
    parser.add_argument("--advantage", help="advantage estimator for every run (gae, grpo, dr_grpo, rloo, reinforce_pp)")
    parser.add_argument(
        "--num-generations",
        type=option_number(integer=True, at_least=1),
        help="responses per prompt (default: 4 for an estimator with a group baseline, else 1)",
    )
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--fast", action="store_true", help=f"betas {FAST_BETAS}, 10 iterations (for tests)")
    speed.add_argument("--full", action="store_true", help=f"betas {FULL_BETAS}, 80 iterations")
    args = parser.parse_args(argv)
    preset_betas, preset_iterations = (FAST_BETAS, 10) if args.fast else (FULL_BETAS, 80) if args.full else (DEFAULT_BETAS, 80)
    args.betas = list(preset_betas) if args.betas is None else args.betas
    args.iterations = preset_iterations if args.iterations is None else args.iterations
    group = advantage_overrides(args.advantage, args.num_generations)
    if args.config is None:
        generations = int(group[-1].split("=")[1]) if group else 1
        args.config = str(DEFAULT_CONFIG)
        args.override = [*DEFAULT_TASK, f"--data.batch_size={DEFAULT_TASK_PROMPTS // generations}", *group, *args.override]
    else:
        args.override = [*group, *args.override]
    return args


def advantage_overrides(name: Optional[str], num_generations: Optional[int]) -> list[str]:
    """CLI arguments selecting an advantage estimator; the last one is always ``--model.sampling.num_generations``."""
    if name is None:
        if num_generations is not None:
            raise SystemExit("--num-generations goes with --advantage")
        return []
    from rlhf_lightning.registry import load_plugins, registry

    load_plugins()
    estimator = registry("advantage_estimator").get(name)
    num_generations = num_generations or (4 if estimator.min_group_size > 1 else 1)
    return [f"--model.advantage_estimator={name}", f"--model.sampling.num_generations={num_generations}"]


def prepare(threads: int, out: str) -> Path:
    """Quiet logs, torch threads, and the output folder: what every experiment tool starts with."""
    import torch

    for name in ("lightning.pytorch", "lightning.fabric"):  # Lightning sets their levels itself
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter is intended to run from within Python")
    warnings.filterwarnings("ignore", message=".*module\\(s\\) in eval mode")  # the frozen reference, on purpose
    if threads:
        torch.set_num_threads(threads)
    Path(out).mkdir(parents=True, exist_ok=True)
    return Path(out)


def main(argv: Optional[Sequence[str]] = None) -> list[SweepRow]:
    args = parse_args(argv)
    out = prepare(args.threads, args.out)
    last = min(args.last, args.iterations)
    rows = []
    for beta in args.betas:
        rows.append(run_beta(beta, args.config, args.iterations, last, out, args.override))
        print(f"beta={beta:g}: reward {rows[-1].reward:.3f}, KL {rows[-1].kl:.3f} ({rows[-1].seconds:.0f} s)", flush=True)
    bad = [r.beta for r in rows if not all(math.isfinite(v) for v in asdict(r).values())]
    write_csv(rows, out / "sweep_beta.csv")
    title = f"{Path(args.config).name} {' '.join(args.override)}\n{args.iterations} iterations, metrics averaged over the last {last}"
    plot(rows, out / "sweep_beta.png", title)
    print(f"task: {args.config} {' '.join(args.override)}")
    print(format_table(rows))
    print(f"wrote {out / 'sweep_beta.csv'} and {out / 'sweep_beta.png'}")
    if bad:
        raise SystemExit(f"non-finite metrics for beta = {bad}")
    return rows


if __name__ == "__main__":
    main()
