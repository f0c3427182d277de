"""tools/bench.py in --tiny mode (full, LoRA and GRPO): every run finishes and the BENCH line carries finite, positive numbers."""

from __future__ import annotations

import math
import re
import subprocess
import sys

from helpers import REPO

BENCH_LINE = re.compile(r"BENCH rollout_vs_generate=(\S+) iteration_vs_floors=(\S+) lora_vs_full_rss=(\S+) iter_s=(\S+) tokens_per_s=(\S+)")


def test_bench_tiny_prints_a_parsable_last_line_of_finite_positive_numbers():
    # One thread: on a busy 2-core CPU spinning OpenMP threads only add noise (and minutes).
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench.py"), "--tiny", "--threads", "1"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    match = BENCH_LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    values = [float(v) for v in match.groups()]
    assert all(math.isfinite(v) and v > 0 for v in values), lines[-1]
    # Every (mode, epochs) run is in the table: full, LoRA and critic-free GRPO, 1 and 4 PPO epochs.
    for mode, critic in (("full", "separate"), ("lora", "shared"), ("grpo", "none")):
        for epochs in (1, 4):
            assert any(line.startswith((f"| {mode} | {epochs} |", f"| {mode} | {critic} | {epochs} |")) for line in lines), (mode, epochs)
