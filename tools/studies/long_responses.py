"""The ``sequence`` correction on long responses: what its weight keeps on SmolLM2 as the responses and the staleness
grow (issue #67; docs/async.md, "The correction on long responses").

    python -m tools.studies.long_responses                                  # L = 32, 128, 256 at k = 1, 2, 4
    python -m tools.studies.long_responses --full                           # every weight trained, not the adapter
    python -m tools.studies.long_responses --lengths 32 --staleness 1 2 --correction token
    python -m tools.studies.long_responses --lab                            # the exact lab's 8-token cells (1 min)

Each cell is ``rlhf-lightning fit --config configs/quickstart.yaml`` in a fresh process (SmolLM2-135M-Instruct with
its rank-16 LoRA adapter, or every weight with ``--full``, VADER, k1 in the reward, GAE with the shared critic) with every response exactly L tokens
(``min_new_tokens`` = ``max_new_tokens`` = L), ``model.off_policy.max_staleness`` k, ``batch_size`` prompts an
iteration, k + ``--iterations`` iterations, no validation, no checkpoints. The sampler runs at exactly k from iteration
k on, so the table is the mean over those iterations of the correction's metrics ([Metrics](docs/metrics.md)):
``off_policy/ess`` (Kish, over the responses for ``sequence``), ``off_policy/clipped_fraction`` (the tokens whose
weight the cap changed), ``off_policy/cap_removed`` (the share of the exact weights' mass the cap took away) and
``off_policy/weight_mass`` (the mean weight per token the loss keeps), with the run's wall seconds and the 1-minute
load at its end. One line per cell, ``LONG L=... k=...``, then the table.

``--lab``: what the cap does to the objective, where sampling noise cannot hide it: ``exact.training.expected_train``
(every rollout replaced by its expectation) on ``ExactTask.random(0, num_tokens=2, length=8)`` (256 responses of 8
tokens; beta 1, k3 in the loss with its sequence term, 60 iterations), the sampler's logit of the first symbol d too
high at every state (another engine's numerics; the drift compounds over the tokens), for the ``sequence`` weight at
its default cap 5 and uncapped, and the ``token`` weight at cap 5. One ``LAB`` line per cell and the table: the gap
(J* - J over the task's scale) and the last iteration's ESS and share of the exact weights the cap removes.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from tools._cli_args import REPO, fit_with_overlay, option_number, tool_parser

METRICS = ("off_policy/ess", "off_policy/clipped_fraction", "off_policy/cap_removed", "off_policy/weight_mass")


def run(length: int, staleness: int, correction: str, iterations: int, batch_size: int, full: bool, work: Path) -> dict[str, float]:
    """One cell: the means of ``METRICS`` over the iterations at full staleness, the wall seconds and the load."""
    from tools.summarize_run import read_scalars

    out = work / f"L{length}_k{staleness}_{correction}"
    out.mkdir(parents=True)
    overlay = {
        "trainer": {
            "max_epochs": 1,
            "limit_train_batches": staleness + iterations,
            "limit_val_batches": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": str(out),
            "callbacks": [],
        },
        "model": {
            "sampling": {"max_new_tokens": length, "min_new_tokens": length, "old_logprobs": "forward"},
            "off_policy": {"max_staleness": staleness, "correction": correction},
        }
        | ({"lora": {"rank": 0}} if full else {}),
        "data": {"batch_size": batch_size},
    }
    start = time.perf_counter()
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    fit_with_overlay(REPO / "configs" / "quickstart.yaml", overlay, out, f"L={length} k={staleness}", environment)
    seconds = time.perf_counter() - start
    (log_dir,) = out.glob("lightning_logs/*/version_0")
    scalars = read_scalars(str(log_dir))
    steps = [s for s, v in scalars["off_policy/staleness_max"].items() if v >= staleness]
    row = {name: statistics.mean(scalars[name][s] for s in steps) for name in METRICS}
    return row | {"iterations": len(steps), "wall_s": seconds, "load": os.getloadavg()[0]}


LAB_CELLS = (("sequence", 5.0), ("sequence", math.inf), ("token", 5.0))
LAB_LENGTH = 8


def lab_cell(correction: str, cap: float, drift: float, length: int = LAB_LENGTH, iterations: int = 60) -> dict[str, float]:
    """The last row of one ``--lab`` cell (module docstring)."""
    from rlhf_lightning.exact.tasks import ExactTask
    from rlhf_lightning.exact.training import expected_train

    task = ExactTask.random(0, num_tokens=2, length=length)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        settings = dict(correction=correction, correction_cap=cap, sampler_drift=drift, kl_estimator="k3", kl_penalty="loss", ppo_epochs=1)
        rows = expected_train(task, iterations, 1.0, every=iterations, **settings)
    return rows[-1]


def lab(drifts: list[float]) -> None:
    """Print each ``--lab`` cell at each drift, then the table (a cell: gap (ESS, cap removed))."""
    rows = []
    for drift in drifts:
        cells = []
        for correction, cap in LAB_CELLS:
            row = lab_cell(correction, cap, drift)
            print(
                f"LAB d={drift:g} correction={correction} cap={cap:g} gap={row['gap']:.4g} ess={row['off_policy/ess']:.3g} cap_removed={row['off_policy/cap_removed']:.3g}",
                flush=True,
            )
            cells.append(f"{row['gap']:.4f} ({row['off_policy/ess']:.2f}, {row['off_policy/cap_removed']:.2f})")
        rows.append(f"| {drift:g} | " + " | ".join(cells) + " |")
    print("| sampler drift d | " + " | ".join(f"`{c}` cap {cap:g}" for c, cap in LAB_CELLS) + " |\n|---:|" + "---:|" * len(LAB_CELLS))
    print("\n".join(rows))


def main() -> None:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("--lengths", type=option_number(integer=True, at_least=1), nargs="+", default=[32, 128, 256])
    parser.add_argument("--staleness", type=option_number(integer=True, at_least=1), nargs="+", default=[1, 2, 4])
    parser.add_argument("--correction", choices=("sequence", "token", "icepop", "ipo", "m2po"), default="sequence")
    parser.add_argument("--iterations", type=option_number(integer=True, at_least=1), default=3, help="at full staleness, per cell")
    parser.add_argument("--batch-size", type=option_number(integer=True, at_least=2), default=8)
    parser.add_argument("--full", action="store_true", help="train every weight (model.lora.rank 0) instead of the LoRA adapter")
    parser.add_argument("--lab", action="store_true", help="the exact lab's cells instead (module docstring)")
    parser.add_argument("--drifts", type=option_number(at_least=0), nargs="+", default=[1.0, 2.0, 3.0], help="--lab's sampler drifts")
    args = parser.parse_args()
    if args.lab:
        return lab(args.drifts)
    mode = "every weight trained" if args.full else "the LoRA adapter trained"
    print(f"quickstart.yaml, {mode}, correction {args.correction}, 1-minute load {os.getloadavg()[0]:.2f} at the start", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="long_responses_") as work:
        for length in args.lengths:
            for staleness in args.staleness:
                row = {"L": length, "k": staleness} | run(
                    length, staleness, args.correction, args.iterations, args.batch_size, args.full, Path(work)
                )
                rows.append(row)
                print("LONG " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    print("\n| L | k | ESS | clipped tokens | exact mass removed | mass kept per token | iterations | wall s | load |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        values = " | ".join(f"{row[name]:.3f}" for name in METRICS)
        print(f"| {row['L']} | {row['k']} | {values} | {row['iterations']} | {row['wall_s']:.0f} | {row['load']:.1f} |")


if __name__ == "__main__":
    main()
