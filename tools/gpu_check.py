"""One command that checks the GPU paths on a machine with a GPU (docs/distributed.md#gpus).

    python -m tools.gpu_check            # every check, 3 at a time, within ~10 minutes on one GPU
    python -m tools.gpu_check --only tiny-bf16   # the checks whose name contains a string (none: exit 2)

Each check is a short ``rlhf-lightning fit`` in its own folder (3 PPO iterations unless said):

- ``tiny-<precision>`` and ``smollm2-<precision>`` for 32-true, bf16-mixed, bf16-true, 16-mixed:
  configs/tiny.yaml with ``old_logprobs: forward``, one epoch of one minibatch, so that the first
  minibatch's PPO ratio must be 1 (``policy/approxkl`` at iteration 0 below 1e-6, 1e-4 under a
  16-bit precision); configs/quickstart.yaml (SmolLM2, LoRA, shared critic, sampler log-probs).
- ``ddp-1``, ``fsdp2-1``: DDP and FSDP2 (configs/fsdp2.yaml) on CUDA with world size 1;
  ``ddp-gloo-2proc`` and ``fsdp2-gloo-2proc``: two processes over gloo sharing the one GPU (two
  "nodes" of one device each on this machine: NCCL refuses two ranks on one GPU); with several
  GPUs ``ddp-nccl`` and ``fsdp2-nccl`` run on all of them.
- ``deepspeed-2`` (bf16-mixed, ZeRO-2) and ``deepspeed-3`` (refused at start-up, naming the
  strategy) when ``deepspeed`` is installed.
- ``async-1`` and ``smollm2-async-1``: asynchronous rollouts (``model.off_policy.max_staleness: 1``, the sampler in
  its own thread on the GPU; ``old_logprobs: forward``, which they require) on the tiny model and on
  configs/quickstart.yaml.
- ``async-bench`` (on a GPU): ``python -m tools.benchmarks.bench --max-staleness 1 --mode both --critic shared ...``, the
  comparison docs/performance.md gives for this CPU (the quickstart's workload, LoRA and full fine-tuning, the sampler
  one update ahead against the synchronous loop); its note is the ``STALENESS`` line with both ratios.
- ``resume``: 4 iterations straight against a run stopped by SIGTERM in its 3rd iteration and
  resumed from ``last.ckpt``, deterministic algorithms on: it must log exactly what the straight
  run logged.
- ``vllm-sleep`` when vLLM is installed: configs/quickstart.yaml (SmolLM2, LoRA) with
  ``rollout_engine: vllm`` twice, ``sleep: 0`` and ``sleep: 1`` (the engine sleeps while the
  trainer scores and updates); each run records the GPU memory in use (``torch.cuda.mem_get_info``:
  vLLM's allocations are not in torch's allocator statistics) before every optimizer step, in the
  update (``fault_callbacks.RecordDeviceMemory``). It passes when both runs train and the sleeping
  engine's update holds less; the note gives both peaks in GiB.

A check passes when its run exits 0 with finite reward and KL (and whatever it adds). The table
gives seconds (runs share the GPU: not a speed measure), the first minibatch's approxkl, and the
peak allocated GPU memory (GiB) of each phase (``system/memory/<phase>_peak_gb``, the maximum over
iterations); its last line is ``GPU_CHECK passed=<n> failed=<n>``. Without a GPU it prints why and
exits 0. Exit status: 1 when a check failed.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from tools._cli_args import tool_parser

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")
PHASES = ("rollout", "forward", "score", "update")
SHORT = ("--trainer.max_epochs=1", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false")
TINY = ("--config", "configs/tiny.yaml", *SHORT, "--trainer.limit_train_batches=3", "--model.sampling.max_new_tokens=16")
# The first minibatch's ratio is exactly 1 only against a forward's log-probs, in one minibatch.
RATIO = ("--model.sampling.old_logprobs=forward", "--model.ppo.epochs=1", "--model.ppo.num_minibatches=1")
SMOLLM2 = ("--config", "configs/quickstart.yaml", *SHORT, "--trainer.limit_train_batches=3")
DEEPSPEED_3_REFUSAL = "trainer.strategy must be DeepSpeed ZeRO stage 0, 1 or 2"
# docs/performance.md's asynchronous-rollouts comparison (the quickstart's workload, LoRA and full fine-tuning)
ASYNC_BENCH = ("--max-staleness", "1", "--mode", "both", "--critic", "shared", "--ppo-epochs", "2", "--num-minibatches", "2")
ASYNC_BENCH += ("--max-new-tokens", "20", "--iters", "2", "--warmup", "1")


@dataclass
class Check:
    """One run: CLI arguments, processes (``nodes``: one process per simulated node), what passes."""

    name: str
    args: tuple[str, ...]
    nodes: int = 1
    ratio_tolerance: Optional[float] = None  # policy/approxkl at iteration 0 must be below it
    refusal: Optional[str] = None  # the run must exit 2 with this message instead
    resume: bool = False  # the exact-resume check (check_resume) on these arguments
    env: dict = field(default_factory=dict)
    vllm_sleep: bool = False  # the sleep-mode check (check_vllm_sleep) on these arguments
    bench: bool = False  # ``args`` are python -m tools.benchmarks.bench's (check_bench), not the command's


@dataclass
class Result:
    name: str
    passed: bool
    seconds: float
    approxkl: Optional[float] = None
    peak_gb: dict = field(default_factory=dict)
    note: str = ""


def checks(gpus: int, deepspeed: bool, accelerator: str = "gpu", vllm: bool = False) -> list[Check]:
    """Every check for a machine with ``gpus`` GPUs (``deepspeed``, ``vllm``: the package is installed)."""
    device = (f"--trainer.accelerator={accelerator}", "--trainer.devices=1")
    out = []
    for precision in PRECISIONS:
        tolerance = 1e-6 if precision == "32-true" else 1e-4
        out.append(Check(f"tiny-{precision}", (*TINY, *RATIO, *device, f"--trainer.precision={precision}"), ratio_tolerance=tolerance))
        out.append(Check(f"smollm2-{precision}", (*SMOLLM2, *device, f"--trainer.precision={precision}")))
    gloo = ("--trainer.devices=1", "--trainer.num_nodes=2", f"--trainer.accelerator={accelerator}")
    ddp_gloo = ("--trainer.strategy=DDPStrategy", "--trainer.strategy.process_group_backend=gloo")
    fsdp2 = ("--config", "configs/fsdp2.yaml")
    out += [
        Check("ddp-1", (*TINY, *device, "--trainer.strategy=ddp")),
        Check("fsdp2-1", (*TINY, *fsdp2, *device)),
        Check("ddp-gloo-2proc", (*TINY, *ddp_gloo, *gloo), nodes=2),
        Check("fsdp2-gloo-2proc", (*TINY, *fsdp2, "--trainer.strategy.init_args.process_group_backend=gloo", *gloo), nodes=2),
    ]
    if gpus > 1:
        every = (f"--trainer.accelerator={accelerator}", f"--trainer.devices={gpus}")
        out += [Check("ddp-nccl", (*TINY, *every, "--trainer.strategy=ddp")), Check("fsdp2-nccl", (*TINY, *fsdp2, *every))]
    if deepspeed:
        bf16 = (*device, "--trainer.precision=bf16-mixed")
        out += [
            Check("deepspeed-2", (*TINY, *bf16, "--trainer.strategy=deepspeed_stage_2")),
            Check("deepspeed-3", (*TINY, *bf16, "--trainer.strategy=deepspeed_stage_3"), refusal=DEEPSPEED_3_REFUSAL),
        ]
    stale = ("--model.sampling.old_logprobs=forward", "--model.off_policy.max_staleness=1")
    out += [Check("async-1", (*TINY, *device, *stale)), Check("smollm2-async-1", (*SMOLLM2, *device, *stale))]
    if accelerator == "gpu":
        out.append(Check("async-bench", ("--device", "cuda", *ASYNC_BENCH), bench=True))
    resume = (*TINY, *RATIO, *device, "--trainer.deterministic=true")
    out.append(Check("resume", resume, resume=True, env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}))
    if vllm:
        out.append(Check("vllm-sleep", (*SMOLLM2, *device), vllm_sleep=True))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(check: Check, root: Path, extra: tuple[str, ...] = (), timeout: float = 300) -> tuple[int, str]:
    """Run ``check`` in ``root``: one process, or one per simulated node (rank 0 logs); each writes
    ``output.<rank>.log`` there. Returns the worst exit status (124: killed after ``timeout``
    seconds) and the processes' output."""
    root.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "rlhf_lightning.cli", "fit", *check.args, *extra]
    command = [str(REPO / a) if a.startswith("configs/") else a for a in command]
    env = {**os.environ, **check.env}
    if check.nodes > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), LOCAL_RANK="0", WORLD_SIZE=str(check.nodes))
    procs = []
    for rank in range(check.nodes):
        with open(root / f"output.{rank}.log", "a") as log:
            rank_env = {**env, "NODE_RANK": str(rank)} if check.nodes > 1 else env
            procs.append(subprocess.Popen(command, cwd=root, env=rank_env, stdout=log, stderr=subprocess.STDOUT))
    deadline, status = time.monotonic() + timeout, 0
    try:
        status = max(p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs)
    except subprocess.TimeoutExpired:  # a rank that failed leaves the other waiting in a collective
        status = 124
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return status, "\n".join((root / f"output.{rank}.log").read_text() for rank in range(check.nodes))


def scalars(root: Path) -> dict[str, dict[int, float]]:
    """The run's logged scalars (TensorBoard), ``{tag: {step: value}}``."""
    from tools.summarize_run import read_scalars

    versions = sorted(root.glob("lightning_logs/**/version_*"), key=lambda v: int(v.name.split("_")[1]))
    return read_scalars([str(v) for v in versions]) if versions else {}


def run_check(check: Check, root: Path) -> Result:
    """Run one check and judge it."""
    if check.resume:
        return check_resume(check, root)
    if check.vllm_sleep:
        return check_vllm_sleep(check, root)
    if check.bench:
        return check_bench(check, root)
    start = time.perf_counter()
    status, output = launch(check, root)
    seconds = time.perf_counter() - start
    if check.refusal is not None:
        refused = status == 2 and check.refusal in output
        return Result(check.name, refused, seconds, note="refused at start-up" if refused else f"exit {status}: {last_line(output)}")
    if status != 0:
        return Result(check.name, False, seconds, note=f"exit {status}: {last_line(output)}")
    return judge(check, scalars(root), seconds)


def judge(check: Check, logged: dict[str, dict[int, float]], seconds: float) -> Result:
    """Pass or fail a finished run from its logged scalars."""
    peak = {phase: max(logged[f"system/memory/{phase}_peak_gb"].values()) for phase in PHASES if f"system/memory/{phase}_peak_gb" in logged}
    approxkl = next(iter(logged.get("policy/approxkl", {}).values()), None)
    values = [v for tag in ("objective/reward", "objective/kl") for v in logged.get(tag, {}).values()]
    result = Result(check.name, True, seconds, approxkl, peak)
    if not values or not all(math.isfinite(v) for v in values):
        result.passed, result.note = False, "no reward/KL logged, or not finite"
    elif check.ratio_tolerance is not None and (approxkl is None or approxkl > check.ratio_tolerance):
        result.passed, result.note = False, f"first minibatch approxkl {approxkl} > {check.ratio_tolerance}: the ratio is not 1"
    return result


def check_resume(check: Check, root: Path) -> Result:
    """4 iterations straight, and a run stopped by SIGTERM during its 3rd iteration (it finishes
    that iteration, saves ``last.ckpt`` and exits 143: tests/fault_callbacks.py) then resumed with
    ``--ckpt_path last``: every logged metric of the 4 iterations must equal the straight run's
    exactly (deterministic algorithms, one cuBLAS workspace size)."""
    start = time.perf_counter()
    check = replace(check, env={**check.env, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])})
    stop = ("--trainer.callbacks+=fault_callbacks.SignalMidIteration", "--trainer.callbacks.iteration=3")
    runs = [(root / "straight", (), 0), (root / "resumed", stop, 143), (root / "resumed", ("--ckpt_path", "last"), 0)]
    for folder, extra, expected in runs:
        status, output = launch(check, folder, ("--trainer.limit_train_batches=4", *extra))
        if status != expected:
            return Result(check.name, False, time.perf_counter() - start, note=f"exit {status} (not {expected}): {last_line(output)}")
    straight, resumed = scalars(root / "straight"), scalars(root / "resumed")
    compared = [t for t in ("objective/reward", "objective/kl", "policy/loss", "value/loss", "objective/beta") if t in straight]
    pairs = [(straight[t][s], resumed.get(t, {}).get(s, math.nan)) for t in compared for s in range(4)]
    exact = len(pairs) == 4 * len(compared) > 0 and all(a == b for a, b in pairs)
    note = "4 iterations bit-identical" if exact else f"max difference {max(abs(a - b) for a, b in pairs) if pairs else math.nan:.3g}"
    return Result(check.name, exact, time.perf_counter() - start, note=note)


def check_vllm_sleep(check: Check, root: Path) -> Result:
    """The same vLLM run without and with sleep mode (level 1); each writes the most GPU memory in use
    before an optimizer step (GiB). Passes when both exit 0 and sleeping holds less during the update."""
    start = time.perf_counter()
    check = replace(check, env={**check.env, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])})
    peaks = {}
    for level in (0, 1):
        folder = root / f"sleep{level}"
        engine = f"--model.rollout_engine={{class_path: vllm, init_args: {{sleep: {level}}}}}"
        record = ("--trainer.callbacks+=fault_callbacks.RecordDeviceMemory", f"--trainer.callbacks.path={folder / 'memory.txt'}")
        status, output = launch(check, folder, (engine, *record))
        if status != 0:
            return Result(check.name, False, time.perf_counter() - start, note=f"sleep {level}: exit {status}: {last_line(output)}")
        peaks[level] = max(float(v) for v in (folder / "memory.txt").read_text().split())
    note = f"GPU memory in use during the update: {peaks[0]:.2f} GiB awake, {peaks[1]:.2f} GiB asleep"
    return Result(check.name, peaks[1] < peaks[0], time.perf_counter() - start, note=note)


def check_bench(check: Check, root: Path, timeout: float = 1200) -> Result:
    """``python -m tools.benchmarks.bench`` with ``check.args``: passes when it exits 0 and prints its ``STALENESS`` line (the
    seconds per iteration with the sampler one update ahead over the synchronous loop's), which the note carries. A
    measure beside the other checks on the same GPU: rerun it alone (``--only async-bench --jobs 1``) for the figure."""
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    command = [sys.executable, "-m", "tools.benchmarks.bench", *check.args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}  # tools/, from root
    try:
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Result(check.name, False, time.perf_counter() - start, note=f"no result in {timeout:.0f} s")
    line = next((line for line in done.stdout.splitlines() if line.startswith("STALENESS")), None)
    seconds = time.perf_counter() - start
    if done.returncode != 0 or line is None:
        return Result(check.name, False, seconds, note=f"exit {done.returncode}: {last_line(done.stdout + done.stderr)}")
    return Result(check.name, True, seconds, note=line)


def last_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    return lines[-1][-160:] if lines else "(no output)"


def table(results: list[Result]) -> str:
    """The results as a Markdown table, then ``GPU_CHECK passed=<n> failed=<n>``."""
    rows = ["| check | result | s | approxkl@0 | " + " | ".join(f"{p} GiB" for p in PHASES) + " | note |"]
    rows.append("|---|---|---:|---:|" + "---:|" * len(PHASES) + "---|")
    for r in results:
        kl = "" if r.approxkl is None else f"{r.approxkl:.2e}"
        peaks = " | ".join(f"{r.peak_gb[p]:.2f}" if p in r.peak_gb else "" for p in PHASES)
        rows.append(f"| {r.name} | {'pass' if r.passed else 'FAIL'} | {r.seconds:.0f} | {kl} | {peaks} | {r.note} |")
    passed = sum(r.passed for r in results)
    rows.append(f"GPU_CHECK passed={passed} failed={len(results) - passed}")
    return "\n".join(rows)


def no_gpu_reason() -> Optional[str]:
    """Why this machine cannot run the checks, or None."""
    import torch

    if torch.cuda.is_available():
        return None
    build = (
        f"torch {torch.__version__} is a CPU build (tools/setup.sh --cuda)"
        if torch.version.cuda is None
        else f"torch {torch.__version__} sees no CUDA device"
    )
    return f"no GPU: {build}"


def main(
    argv: Optional[list[str]] = None,
    runner: Callable[[Check, Path], Result] = run_check,
    reason: Callable[[], Optional[str]] = no_gpu_reason,
) -> int:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("--only", default="", help="comma-separated substrings: run the checks whose name contains one")
    parser.add_argument("--jobs", type=int, default=3, help="checks run at the same time (they share the GPU)")
    parser.add_argument("--root", default=None, help="folder for the runs (default: a temporary one, removed after)")
    parser.add_argument("--accelerator", default="gpu", help="gpu; cpu runs the harness itself on a CPU (16-mixed becomes bf16-mixed)")
    args = parser.parse_args(argv)
    wanted = [s for s in args.only.split(",") if s]
    known = [c.name for c in checks(gpus=2, deepspeed=True, accelerator=args.accelerator, vllm=True)]  # every check on some machine
    unknown = [s for s in wanted if not any(s in name for name in known)]
    if unknown:  # before the GPU question: a typo is a typo on any machine
        parser.error(f"--only {','.join(unknown)}: no check's name contains it; the checks: {', '.join(known)}")
    why = reason() if args.accelerator == "gpu" else None
    if why is not None:
        print(f"GPU_CHECK skipped: {why}")
        return 0
    import torch

    gpus = torch.cuda.device_count()
    deepspeed = importlib_available("deepspeed")
    todo = checks(gpus, deepspeed, args.accelerator, vllm=importlib_available("vllm") and args.accelerator == "gpu")
    absent = [s for s in wanted if not any(s in c.name for c in todo)]
    if absent:  # a check this machine cannot run (one GPU, no deepspeed): refused, not passed=0 failed=0
        here = ", ".join(c.name for c in todo)
        parser.error(
            f"--only {','.join(absent)}: no such check on this machine ({gpus} GPU(s), deepspeed "
            f"{'installed' if deepspeed else 'not installed'}); the checks here: {here}"
        )
    todo = [c for c in todo if not wanted or any(s in c.name for s in wanted)]
    root = Path(args.root or tempfile.mkdtemp(prefix="gpu_check."))
    device = torch.cuda.get_device_name(0) if gpus else "CPU"
    print(
        f"{time.strftime('%Y-%m-%d')} {device} x{gpus}, torch {torch.__version__}, deepspeed {'installed' if deepspeed else 'not installed'}",
        flush=True,
    )
    try:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futures = [pool.submit(runner, check, root / check.name) for check in todo]
            results = []
            for future in futures:
                results.append(future.result())
                r = results[-1]
                print(f"  {r.name}: {'pass' if r.passed else 'FAIL'} {r.note}", flush=True)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    print(table(results))
    return int(not all(r.passed for r in results))


def importlib_available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    sys.exit(main())
