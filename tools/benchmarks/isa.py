"""Which instruction set the CPU kernels run with, and ``--isa avx2``: run as on an AVX2-only machine.

Every speed figure depends on the instruction set the matrix kernels run: oneDNN (``cpu.linear``)
and MKL (PyTorch's own ``linear``) each pick the widest the CPU has (MKL only on Intel CPUs; on
AMD it runs AVX2 at most, and its banner names no instruction set: "Intel(R) Architecture processors"), and ATen's vectorised ops (softmax, norms, AdamW) are built for several and
dispatch at start-up. The speed tools (``bench.py``, ``compare_trl.py``, ``decode_bench.py``) print
one line saying what each chose, read from the libraries' own verbose output in a probe process
with the tool's environment:

    ISA requested=<native|avx2> onednn="<oneDNN's isa>" mkl="<MKL's>" aten=<ATen's> cpu="<model name>"

``--isa avx2`` caps all three at AVX2 on a machine that has more (oneDNN's ``ONEDNN_MAX_CPU_ISA``,
MKL's ``MKL_ENABLE_INSTRUCTIONS``, ATen's ``ATEN_CPU_CAPABILITY``): the variables are read once,
when each library loads, so they are set before torch is imported, the tool re-executing itself
when torch is already loaded; every child process (workers, TRL's) inherits them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Optional

ISA_ENV = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
LINE = re.compile(r'ISA requested=(\w+) onednn="([^"]*)" mkl="([^"]*)" aten=(\S+) cpu="([^"]*)"')
_PROBE = """
import torch
a = torch.ones(16, 16)
torch.mm(a, a)
if torch.backends.mkldnn.is_available():
    torch.ops.mkldnn._linear_pointwise(a, a, None, "none", [], "")
print("ATEN_CAPABILITY", torch.backends.cpu.get_cpu_capability(), flush=True)
"""


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--isa",
        choices=tuple(ISA_ENV),
        default="native",
        help="native: the kernels' widest instruction set; avx2: oneDNN, MKL and ATen capped at AVX2 (an AVX2-only machine)",
    )


def apply(isa: str, module: str, argv: Sequence[str]) -> None:
    """Put ``isa``'s variables into this process's environment (children inherit it). Where torch
    is already loaded it has read the old ones: re-execute ``python -m module`` with ``argv`` instead
    (in the same folder, where ``module`` was found)."""
    env = ISA_ENV[isa]
    if all(os.environ.get(name) == value for name, value in env.items()):
        return
    os.environ.update(env)
    if "torch" in sys.modules:
        os.execv(sys.executable, [sys.executable, "-m", module, *argv])


def requested(env: Mapping[str, str]) -> str:
    """The ``--isa`` whose variables ``env`` carries."""
    return next((isa for isa, e in ISA_ENV.items() if e and all(env.get(k) == v for k, v in e.items())), "native")


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


def describe(env: Optional[Mapping[str, str]] = None) -> str:
    """The ISA line: what oneDNN, MKL and ATen chose in a probe process with ``env`` (default:
    this one's), from ``ONEDNN_VERBOSE`` and ``MKL_VERBOSE``; "none" for a library that said nothing."""
    env = {**(os.environ if env is None else env), "ONEDNN_VERBOSE": "1", "MKL_VERBOSE": "1"}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=300).stdout
    onednn = re.search(r"onednn_verbose,.*info,cpu,isa:(.*)", out)
    mkl = re.search(r"MKL_VERBOSE .*? architecture (.*?)(?: enabled processors| with support|,|$)", out, re.MULTILINE)
    aten = re.search(r"ATEN_CAPABILITY (\S+)", out)
    return (
        f'ISA requested={requested(env)} onednn="{onednn.group(1).strip() if onednn else "none"}" '
        f'mkl="{mkl.group(1).strip() if mkl else "none"}" aten={aten.group(1) if aten else "none"} cpu="{cpu_model()}"'
    )
