"""Iteration time under the command's thread choice against fixed thread counts, on an idle machine
and with other jobs burning cores: what ``cpu.threads`` null (``rlhf_lightning.cpu.choose_threads``,
OpenMP threads that sleep when idle) buys over torch's default.

    python -m tools.benchmarks.threads_bench                                  # configs/tiny.yaml, 4 iterations
    python -m tools.benchmarks.threads_bench --config configs/quickstart.yaml --iterations 3 --burners 0 1
    python -m tools.benchmarks.threads_bench --settings automatic one_thread --burners 2

Each run is ``rlhf-lightning fit --config <config>`` for ``--iterations`` iterations in a fresh process
(no validation, no progress bar, ``IterationTimer`` logging ``timing/iteration_s`` to a CSV file), under
one of the settings:

- ``as_written``: torch's default, one thread per core with libgomp's default spinning wait
  (``OMP_NUM_THREADS=<cores> GOMP_SPINCOUNT=300000``: what the command ran before it chose);
- ``cores_passive``: one thread per core, idle threads sleeping (``OMP_WAIT_POLICY=PASSIVE``);
- ``one_thread``: ``OMP_NUM_THREADS=1``;
- ``automatic``: no variable set, the command's own choice (its ``cpu:`` line is reported).

With ``--burners`` k, k processes spinning on a core each run alongside (started ``--settle`` seconds
before, so the 1-minute load has seen them). A row gives the 1-minute load when the run started, the
threads the run took, each iteration's seconds and the median of all but the first (the warm-up).
The machine's other jobs count too: read the load column.
"""

from __future__ import annotations

import csv
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools._cli_args import REPO, fit_with_overlay, option_number, tool_parser

SETTINGS = ("as_written", "cores_passive", "one_thread", "automatic")
CHOSEN = re.compile(r"cpu: (\d+) threads? per process \(([^)]*)\); OpenMP wait policy (.+)$", re.MULTILINE)


def environment(setting: str, cores: int) -> dict[str, str]:
    """The process environment of a run under ``setting``: this one's, less every thread and wait variable, plus the setting's."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    return (
        env
        | {
            "as_written": {"OMP_NUM_THREADS": str(cores), "GOMP_SPINCOUNT": "300000"},
            "cores_passive": {"OMP_NUM_THREADS": str(cores), "OMP_WAIT_POLICY": "PASSIVE"},
            "one_thread": {"OMP_NUM_THREADS": "1"},
            "automatic": {},
        }[setting]
    )


def run(config: str, iterations: int, setting: str, cores: int, extra: list[str]) -> dict:
    """One ``rlhf-lightning fit`` run: its load at start, threads, iteration seconds."""
    with tempfile.TemporaryDirectory(prefix="threads_bench_") as work:
        trainer = {
            "max_epochs": 1,
            "limit_train_batches": iterations,
            "limit_val_batches": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "default_root_dir": work,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": work, "name": "csv"}},
        }
        load = os.getloadavg()[0]
        timer = "--trainer.callbacks+=rlhf_lightning.callbacks.IterationTimer"
        done = fit_with_overlay(config, {"trainer": trainer}, Path(work), setting, environment(setting, cores), [timer, *extra])
        (metrics,) = Path(work).glob("csv/version_*/metrics.csv")
        with metrics.open() as f:
            seconds = [float(row["timing/iteration_s"]) for row in csv.DictReader(f) if row.get("timing/iteration_s")]
    chosen = CHOSEN.search(done.stderr)
    threads = f"{chosen.group(1)}, {chosen.group(3)}" if chosen else "?"
    return {"setting": setting, "load": load, "threads": threads, "seconds": seconds}


def main() -> None:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    parser.add_argument("--iterations", type=option_number(integer=True, at_least=1), default=4)
    parser.add_argument("--burners", type=option_number(integer=True, at_least=0), nargs="+", default=[0, 1])
    parser.add_argument("--settings", choices=SETTINGS, nargs="+", default=list(SETTINGS))
    parser.add_argument("--settle", type=option_number(at_least=0), default=30.0, help="seconds the burners run before the first run")
    parser.add_argument("extra", nargs="*", help="more arguments for the command (after --)")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    rows = []
    for burners in args.burners:
        spinning = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
        try:
            time.sleep(args.settle if burners else 0)
            for setting in args.settings:
                row = run(args.config, args.iterations, setting, cores, args.extra) | {"burners": burners}
                timed = row["seconds"][1:] or row["seconds"]
                row["median"] = statistics.median(timed)
                print(
                    f"THREADS setting={setting} burners={burners} load={row['load']:.2f} threads={row['threads']} "
                    f"iteration_s={[round(s, 2) for s in row['seconds']]} median_s={row['median']:.2f}",
                    flush=True,
                )
                rows.append(row)
        finally:
            for process in spinning:
                process.kill()
                process.wait()
    print(f"\n{Path(args.config).name}, {args.iterations} iterations, {cores} cores; median seconds per iteration after the first")
    print(f"{'setting':<14} {'burners':>7} {'load':>6} {'median_s':>9}  threads, wait policy")
    for row in rows:
        print(f"{row['setting']:<14} {row['burners']:>7} {row['load']:>6.2f} {row['median']:>9.2f}  {row['threads']}")


if __name__ == "__main__":
    main()
