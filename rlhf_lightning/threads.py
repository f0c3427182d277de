"""Threads per process and the OpenMP wait policy (``cpu.threads``; cpu.py's module docstring, **Threads**).
Nothing here imports torch: the command sets the wait policy before torch loads, which reads it once."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Optional

# The variables that set how idle OpenMP threads wait: the standard one, GNU libgomp's (torch's Linux
# builds) and Intel's or LLVM's OpenMP. PASSIVE: an idle thread sleeps at once instead of spinning.
WAIT_POLICY_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def wait_policy(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The OpenMP wait policy ``environ`` sets (``OMP_WAIT_POLICY=PASSIVE``), None where it sets none."""
    return next((f"{name}={environ[name]}" for name in WAIT_POLICY_ENV if environ.get(name)), None)


def set_passive_wait(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Ask the OpenMP runtime to let idle threads sleep at once (``OMP_WAIT_POLICY=PASSIVE``, and
    ``KMP_BLOCKTIME=0`` for Intel's and LLVM's runtimes) unless ``environ`` chooses a policy; True where
    this set it. The runtime reads these when it loads, with torch: set them before ``import torch``."""
    if wait_policy(environ) is not None:
        return False
    environ.update(OMP_WAIT_POLICY="PASSIVE", KMP_BLOCKTIME="0")
    return True


@dataclass(frozen=True)
class ThreadChoice:
    """How many intra-op threads a process runs, and why (:func:`choose_threads`)."""

    threads: int
    reason: str

    def line(self, wait_policy: str) -> str:
        """The one log line: threads, the OpenMP wait policy and why."""
        plural = "" if self.threads == 1 else "s"
        return f"cpu: {self.threads} thread{plural} per process ({self.reason}); OpenMP wait policy {wait_policy}"


def choose_threads(
    cores: int, load: float, processes: int = 1, requested: Optional[int] = None, omp_num_threads: Optional[str] = None
) -> ThreadChoice:
    """Threads per process: ``requested`` (``cpu.threads``) where given; else ``omp_num_threads`` (the
    environment's ``OMP_NUM_THREADS``, its first number) where it is a positive integer; else the ``cores``
    this process may use, less the ``load`` (1-minute load average, rounded: the cores other jobs hold,
    counted before this run starts), shared among the machine's ``processes`` of this run, at least 1.
    A thread on a core another job holds makes every barrier wait for it, so a busy core is left out."""
    if requested is not None:
        return ThreadChoice(requested, "cpu.threads")
    first = (omp_num_threads or "").split(",")[0].strip()
    if first.isdigit() and int(first) >= 1:
        return ThreadChoice(int(first), f"OMP_NUM_THREADS={omp_num_threads}")
    held = min(cores, max(0, round(load)))
    threads = max(1, (cores - held) // max(1, processes))
    shared = f", {processes} processes" if processes > 1 else ""
    return ThreadChoice(threads, f"{cores} cores, 1-minute load {load:.1f}: {cores - held} free{shared}; cpu.threads to choose")


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota
    (``/sys/fs/cgroup/cpu.max``, a container's ``--cpus``) where one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def machine_threads(requested: Optional[int], processes: int = 1, environ: Mapping[str, str] = os.environ) -> ThreadChoice:
    """:func:`choose_threads` on this machine: its available cores and 1-minute load, ``environ``'s ``OMP_NUM_THREADS``."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average (Windows): count every core as free
        load = 0.0
    return choose_threads(available_cores(), load, processes, requested, environ.get("OMP_NUM_THREADS"))
