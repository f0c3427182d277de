"""tools/benchmarks/isa.py: the ISA line the speed tools print, read from oneDNN's, MKL's and ATen's own
reports, and ``--isa avx2`` reaching a torch loaded after it (re-executing when torch was loaded
before). No timing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tools.benchmarks import isa

from helpers import REPO

with open("/proc/cpuinfo") as f:
    CPUINFO = f.read().splitlines()
FLAGS = next((line.split(":", 1)[1].split() for line in CPUINFO if line.startswith("flags")), [])
INTEL = any(line.startswith("vendor_id") and "GenuineIntel" in line for line in CPUINFO)
needs_avx2 = pytest.mark.skipif("avx2" not in FLAGS, reason="capping at AVX2 needs a CPU that has it")


@needs_avx2
def test_isa_line_names_avx2_for_every_library_under_avx2_and_more_natively_where_the_cpu_has_more():
    line = isa.describe({**os.environ, **isa.ISA_ENV["avx2"]})
    match = isa.LINE.fullmatch(line)
    assert match, line
    requested, onednn, mkl, aten, cpu = match.groups()
    assert requested == "avx2" and aten == "AVX2"
    assert onednn == "Intel AVX2"  # oneDNN's verbose "isa:" field, capped by ONEDNN_MAX_CPU_ISA
    # MKL's banner, capped by MKL_ENABLE_INSTRUCTIONS; on another vendor's CPU (AMD) it names no instruction
    # set ("Intel(R) Architecture processors") and runs AVX2 at most
    assert ("AVX2" in mkl or not INTEL) and "512" not in mkl
    assert cpu
    env = {k: v for k, v in os.environ.items() if k not in isa.ISA_ENV["avx2"]}
    requested, onednn, _, aten, _ = isa.LINE.fullmatch(isa.describe(env)).groups()
    assert requested == "native"
    if "avx512f" in FLAGS:  # the machine has more than AVX2, and the native line says so
        assert aten == "AVX512" and onednn != "Intel AVX2"


@needs_avx2
def test_apply_reexecutes_a_process_that_loaded_torch_and_its_children_inherit_the_variables(tmp_path):
    (tmp_path / "tool.py").write_text(  # a tool run as `python -m tool` from its folder, as the tools are from the root
        "import os, subprocess, sys\n"
        "import torch\n"
        "from tools.benchmarks import isa\n"
        "isa.apply('avx2', 'tool', sys.argv[1:])\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"ONEDNN_MAX_CPU_ISA\"])'], capture_output=True, text=True)\n"
        "print(torch.backends.cpu.get_cpu_capability(), child.stdout.strip(), sys.argv[1:])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in isa.ISA_ENV["avx2"]}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))  # tools/
    out = subprocess.run([sys.executable, "-m", "tool", "--x"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    # Torch was loaded before apply: only a re-executed process runs its kernels at AVX2, with the same arguments.
    assert out.stdout.strip() == "AVX2 AVX2 ['--x']", out.stderr[-2000:]
