"""The phase benchmark: each mode's runs in a worker process of its own (``--strategy ddp|fsdp2``: one per run,
on ``--devices`` processes), the machine's roofline measured once here, then the tables and the last lines."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from tools.benchmarks import roofline
from tools.benchmarks.bench.memory import MEMORY_MMAP_THRESHOLD, memory_line
from tools.benchmarks.bench.report import bench_line, engine_lines, format_roofline, format_table
from tools.benchmarks.bench.worker import RESULT_PREFIX

REPO = Path(__file__).resolve().parents[3]


# The settings a worker is given on its command line when set (--name-with-dashes VALUE).
WORKER_SETTINGS = [
    "iters",
    "warmup",
    "policy",
    "batch_size",
    "max_new_tokens",
    "num_minibatches",
    "num_generations",
    "critic",
    "old_logprobs",
    "engine",
    "cpu_linear",
    "cpu_malloc",
    "lora_rank",
    "reward",
    "device",
    "threads",
    "profile_rows",
    "strategy",
    "devices",
    "results_dir",
]


def worker_argv(args: argparse.Namespace, mode: str) -> list[str]:
    """The command line of one mode's runs: this benchmark (run from the repository root) with every setting spelled out."""
    argv = [sys.executable, "-m", "tools.benchmarks.bench", "--worker", "--mode", mode, "--ppo-epochs"]
    argv += [str(epochs) for epochs in args.ppo_epochs]
    for name in WORKER_SETTINGS:
        if getattr(args, name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for flag in ("no_chat_template", "bf16", "profile", "profile_shapes", "memory"):
        if getattr(args, flag):
            argv.append(f"--{flag.replace('_', '-')}")
    return argv


def measure_peaks(args: argparse.Namespace) -> dict[str, float]:
    """``roofline.machine_peaks`` once, in this process, with the workers' threads and dtype."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    peaks = roofline.machine_peaks(args.device, "bfloat16" if args.bf16 else "float32", seconds=0.2 if args.tiny else 1.0)
    print(
        f"machine: {peaks['flops_per_s'] / 1e9:.1f} GFLOP/s sustained matmul, {peaks['bytes_per_s'] / 1e9:.1f} GB/s read "
        f"({torch.get_num_threads()} thread(s))",
        flush=True,
    )
    return peaks


def run_subprocess(argv: list[str], env: Optional[dict] = None) -> list[dict]:
    """Run one worker, echoing its output and a line per finished run; return its results."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    results, start = [], time.perf_counter()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env) as proc:
        for line in proc.stdout:
            if not line.startswith(RESULT_PREFIX):
                print(line, end="", flush=True)
                continue
            r = json.loads(line[len(RESULT_PREFIX) :])
            results.append(r)
            print(
                f"{r['mode']}, ppo_epochs={r['ppo_epochs']}: {r['iter_s']:.3f} s per iteration, "
                f"{r['tokens_per_s']:.1f} tokens/s (done after {time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    if proc.returncode:
        raise SystemExit(f"benchmark run failed (exit code {proc.returncode}): {' '.join(argv)}")
    return results


def main(args: argparse.Namespace, modes: Sequence[str]) -> list[dict]:
    """Each mode's runs in its workers (with ``--memory`` one process's first, with ``--engine`` hf's after), then
    the tables, the BENCH line and the mode's last lines; every run's results."""
    peaks = measure_peaks(args)
    env = {"MALLOC_MMAP_THRESHOLD_": str(MEMORY_MMAP_THRESHOLD)} if args.memory else {}
    single = [argparse.Namespace(**{**vars(args), "strategy": "single", "devices": 1})] if args.memory else []
    results = []
    # --engine vllm: the hf engine's runs follow in the same invocation, for the ENGINE lines side by side
    engines = [
        argparse.Namespace(**{**vars(one), "engine": engine}) for one in [*single, args] for engine in dict.fromkeys((args.engine, "hf"))
    ]
    for mode in modes:
        for one in engines:
            if one.devices == 1:
                results += run_subprocess(worker_argv(one, mode), env)
            # Several processes: one worker per run (a second Trainer in a worker would launch its ranks again).
            for ppo_epochs in one.ppo_epochs if one.devices > 1 else ():
                with tempfile.TemporaryDirectory(prefix="rlhf_bench_ranks_") as results_dir:
                    run = argparse.Namespace(**{**vars(one), "ppo_epochs": [ppo_epochs], "results_dir": results_dir})
                    results += run_subprocess(worker_argv(run, mode), env)
                    results += [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))]
        if args.save:
            Path(args.save).write_text(json.dumps(results, indent=1))
    print(format_table(results))
    print(format_roofline(results, peaks))
    print(bench_line(results, peaks), flush=True)
    for r in results:
        if r.get("engine", "hf") != "hf":  # the rollout against a bare generate of the same prompts, measured right after it
            print(
                f"DECODE {r['engine']}_vs_hf={1 / r['rollout_vs_generate']:.3f} mode={r['mode']} ppo_epochs={r['ppo_epochs']} "
                f"batch={r['batch']} response_len={r['response_len']} load={r['load'][0]:.2f}-{r['load'][1]:.2f}",
                flush=True,
            )
    if args.engine != "hf":
        for line in engine_lines(results):
            print(line, flush=True)
    if args.memory:
        print(memory_line(results), flush=True)
    return results
