"""tools/gpu_check.py without a GPU (skipped, exit 0), its judging and table with a fake runner,
and tools/setup.sh's choice of torch build (dry run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import gpu_check

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_a_gpu_the_check_is_skipped_with_the_reason():
    result = subprocess.run([sys.executable, "-m", "tools.gpu_check"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0
    assert result.stdout.strip().splitlines()[-1].startswith("GPU_CHECK skipped: no GPU: torch ")


def test_the_table_counts_passes_and_failures_from_the_runner(capsys):
    """A fake runner passes every check but one; the table has a row per check, the last line
    counts them, and the exit status is 1."""
    seen = []

    def runner(check, root):
        seen.append(check.name)
        peak = {"rollout": 1.5, "update": 2.25}
        return gpu_check.Result(check.name, check.name != "tiny-16-mixed", 3.0, 1e-9, peak, "x" if check.name == "tiny-16-mixed" else "")

    status = gpu_check.main(["--only", "tiny-,resume", "--jobs", "2"], runner=runner, reason=lambda: None)
    lines = capsys.readouterr().out.strip().splitlines()
    assert status == 1
    assert seen == ["tiny-32-true", "tiny-bf16-mixed", "tiny-bf16-true", "tiny-16-mixed", "resume"]
    assert lines[-1] == "GPU_CHECK passed=4 failed=1"
    assert "| tiny-16-mixed | FAIL | 3 | 1.00e-09 | 1.50 |  |  | 2.25 | x |" in lines


def test_checks_cover_the_issue_list():
    """One GPU with deepspeed: 8 precision runs, DDP and FSDP2 at world size 1 and over gloo, ZeRO-2
    and ZeRO-3 (refused), asynchronous rollouts (tiny and SmolLM2), the resume; several GPUs add NCCL runs; no deepspeed, no DeepSpeed runs."""
    names = [c.name for c in gpu_check.checks(gpus=1, deepspeed=True)]
    assert len(names) == 18 and {
        "ddp-1",
        "async-1",
        "async-bench",
        "smollm2-async-1",
        "fsdp2-1",
        "ddp-gloo-2proc",
        "fsdp2-gloo-2proc",
        "deepspeed-2",
        "deepspeed-3",
        "resume",
    } < set(names)
    assert {"ddp-nccl", "fsdp2-nccl"} < {c.name for c in gpu_check.checks(gpus=4, deepspeed=False)}
    assert not any("deepspeed" in c.name for c in gpu_check.checks(gpus=1, deepspeed=False))


def test_judging_a_run_from_its_scalars():
    check = gpu_check.Check("tiny-bf16-mixed", (), ratio_tolerance=1e-4)
    logged = {"objective/reward": {0: 1.0, 1: 2.0}, "objective/kl": {0: 0.0, 1: 0.1}, "system/memory/update_peak_gb": {0: 0.5, 1: 0.75}}
    assert gpu_check.judge(check, {**logged, "policy/approxkl": {0: 3e-5, 1: 0.2}}, 1.0).peak_gb == {"update": 0.75}
    assert not gpu_check.judge(check, {**logged, "policy/approxkl": {0: 1.2e-3}}, 1.0).passed  # bf16 logits' ratio
    assert not gpu_check.judge(check, {**logged, "objective/kl": {0: float("nan")}, "policy/approxkl": {0: 0.0}}, 1.0).passed


@pytest.mark.parametrize(
    "flag, nvidia_smi, build",
    [("", "echo 'GPU 0: NVIDIA H100'", "cuda"), ("", "exit 9", "cpu"), ("--cuda", "exit 9", "cuda")],
)
def test_setup_installs_the_cuda_build_where_a_gpu_answers(tmp_path, flag, nvidia_smi, build):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\n{nvidia_smi}\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SETUP_DRY_RUN": "1"}
    args = ["bash", str(REPO / "tools" / "setup.sh"), *([flag] if flag else [])]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120, check=True).stdout
    assert out.splitlines()[0].startswith(f"torch: the {build} build")
    if build == "cuda":  # this venv's torch is a CPU build: replaced from PyTorch's CUDA index
        assert "--index-url https://download.pytorch.org/whl/cu128" in out
    else:
        assert "whl/cu" not in out


def test_the_async_bench_check_passes_on_the_staleness_line_and_carries_it(tmp_path, monkeypatch):
    """``async-bench`` runs docs/performance.md's comparison (bench.py --max-staleness 1 on CUDA): it passes when the
    benchmark exits 0 with its STALENESS line, which the note carries; without the line or with an exit status, it fails."""
    import subprocess

    (check,) = [c for c in gpu_check.checks(gpus=1, deepspeed=False) if c.name == "async-bench"]
    assert check.bench and check.args[:2] == ("--device", "cuda") and "--max-staleness" in check.args
    line = "STALENESS k=1 full_ratio=0.736 full_iter_s=10.411 lora_ratio=0.663 lora_iter_s=8.121 load=0.5-0.6"
    for stdout, status, passed in ((f"full: ...\n{line}\n", 0, True), ("no line\n", 0, False), (f"{line}\n", 1, False)):
        monkeypatch.setattr(subprocess, "run", lambda *a, s=status, out=stdout, **kw: subprocess.CompletedProcess(a, s, out, ""))
        result = gpu_check.run_check(check, tmp_path / str(status))
        assert result.passed is passed and (result.note == line) is passed, result
