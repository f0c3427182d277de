"""Length bias of the loss aggregations: a reward that ignores length, and which aggregations
still move the response length.

    python -m tools.studies.length_bias                      # 4 aggregations x 3 seeds, 30 iterations
    python -m tools.studies.length_bias --fast               # the test's version

The tiny random Llama (``policy: tiny``) is trained with REINFORCE without a baseline
(``advantage_estimator: reinforce``) on a constant reward of +1 (``rewards.toy:constant``), no KL
penalty: the true gradient of E[r] = 1 is zero, and every response's advantage is +1. The
policy-gradient term of response y_i is then w_i * grad log pi(y_i), with w_i its aggregation's
weight per token:

- ``seq_mean_token_sum`` and ``constant`` (Dr. GRPO): w_i does not depend on y_i, so the
  expected update is E[grad log pi(y)] = grad E[1] = 0: no drift, only noise;
- ``seq_mean_token_mean`` (GRPO's original 1/|y_i|): the expected update is grad E[1/|y|],
  which raises the probability of short responses: the length falls;
- ``token_mean``: 1 / (tokens in the batch), shared by all responses, so nearly unbiased.

(With a reward of -1 the sign flips and 1/|y| lengthens responses: Dr. GRPO's "longer wrong
answers", Liu et al. 2025.) Prints, per aggregation, the mean response length of the first and
last ``--window`` iterations averaged over the seeds, and writes ``length_bias.csv``.
"""

from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path

import torch
from lightning import Callback, Trainer, seed_everything

from rlhf_lightning.data import PromptDataModule
from rlhf_lightning.module import PPORLHF
from rlhf_lightning.trainer_settings import QUIET_TRAINER
from rlhf_lightning_plugins.rewards.function import CallableReward
from tools._cli_args import option_number, tool_parser

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")


class Lengths(Callback):
    """Records ``response/length`` of every iteration."""

    def __init__(self) -> None:
        self.lengths: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.lengths.append(float(trainer.callback_metrics["response/length"]))


def run(aggregation: str, seed: int, iterations: int, reward: float, workdir: Path) -> list[float]:
    """One fit; returns the mean response length of every iteration."""
    seed_everything(seed, verbose=False)
    module = PPORLHF(
        policy="tiny",
        seed=seed,
        advantage_estimator="reinforce",
        loss_aggregation=aggregation,
        reward_model=CallableReward(function="rlhf_lightning_plugins.rewards.toy:constant", kwargs={"value": reward}),
        beta_controller="fixed",
        kl=dict(placement="reward"),
        sampling=dict(max_new_tokens=24),
        ppo=dict(epochs=2, num_minibatches=1),
        optim=dict(lr=3e-3),
        runtime=dict(log_samples_every_n_steps=0),
    )
    module.beta_controller.beta = 0.0
    lengths = Lengths()
    trainer = Trainer(
        **QUIET_TRAINER,
        max_epochs=-1,
        max_steps=iterations * 2,
        limit_train_batches=iterations,
        callbacks=[lengths],
        default_root_dir=str(workdir),
    )
    trainer.fit(module, datamodule=PromptDataModule(batch_size=16))
    return lengths.lengths


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("--iterations", type=option_number(integer=True, at_least=1), help="PPO iterations per run (default 30; --fast 12)")
    parser.add_argument("--seeds", type=option_number(integer=True), nargs="+", help="seeds (default 0 1 2; --fast 0 1)")
    parser.add_argument(
        "--window", type=option_number(integer=True, at_least=1), default=5, help="iterations averaged at the start and at the end"
    )
    parser.add_argument("--reward", type=option_number(), default=1.0, help="the constant reward (negative: the sign flips)")
    parser.add_argument("--aggregations", nargs="+", default=list(AGGREGATIONS), choices=AGGREGATIONS)
    parser.add_argument("--out", default="runs/length_bias")
    parser.add_argument("--fast", action="store_true", help="fewer iterations and seeds (for tests)")
    args = parser.parse_args(argv)
    iterations = (12 if args.fast else 30) if args.iterations is None else args.iterations
    seeds = ([0, 1] if args.fast else [0, 1, 2]) if args.seeds is None else args.seeds
    torch.set_num_threads(1)  # the tiny model only loses time to thread hand-offs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary, rows = {}, []
    for aggregation in args.aggregations:
        start = time.perf_counter()
        runs = [run(aggregation, seed, iterations, args.reward, out / "lightning") for seed in seeds]
        first = statistics.mean(statistics.mean(r[: args.window]) for r in runs)
        last = statistics.mean(statistics.mean(r[-args.window :]) for r in runs)
        summary[aggregation] = (first, last)
        rows += [(aggregation, seed, i, length) for seed, r in zip(seeds, runs, strict=True) for i, length in enumerate(r)]
        print(f"{aggregation}: {len(seeds)} runs in {time.perf_counter() - start:.0f} s", flush=True)
    with open(out / "length_bias.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["aggregation", "seed", "iteration", "length"])
        writer.writerows(rows)
    print(
        f"\nconstant reward {args.reward:+g}, REINFORCE without a baseline, no KL; {iterations} iterations, "
        f"seeds {seeds}; mean response length (tokens, max 24) over the first and last {args.window} iterations\n"
    )
    print("| aggregation | first | last | change |\n|---|---:|---:|---:|")
    for aggregation, (first, last) in summary.items():
        print(f"| {aggregation} | {first:.2f} | {last:.2f} | {last - first:+.2f} |")
    print(f"\nwrote {out / 'length_bias.csv'}")
    return summary


if __name__ == "__main__":
    main()
