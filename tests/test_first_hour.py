"""The first hour at the command line (issue 55): the thread count and OpenMP wait policy the command
chooses from the machine, the one line that says so, the progress bar (iterations, time left, reward,
KL, beta; no ``v_num``; no checkpoint notes inside it), the end-of-run message naming the run's folder
and the commands that show it, ``cpu.threads``, and tools/setup.sh's one line per step."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning import Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from rlhf_lightning import cpu
from rlhf_lightning.cli import main, where_the_logs_are
from rlhf_lightning.progress import IterationProgressBar

from helpers import CONFIGS, REPO, RUN_ARGS, cli


def openmp_runtime_strings() -> str:
    """The text of the OpenMP runtime torch ships (Linux wheels: GNU libgomp), or '' where it ships none."""
    libs = sorted(Path(torch.__file__).parent.glob("lib/libgomp*.so*"))
    return libs[0].read_bytes().decode("latin-1") if libs else ""


CPU_LINE = re.compile(r"^cpu: (\d+) threads? per process \((.*)\); OpenMP wait policy (.*)$", re.MULTILINE)


@pytest.mark.parametrize(
    "cores, load, processes, threads",
    [
        (2, 0.0, 1, 2),  # idle: every core
        (2, 0.4, 1, 2),  # rounds to no core held
        (2, 0.6, 1, 1),  # one core mostly held by another job
        (2, 11.0, 1, 1),  # the machine at load 11: never fewer than one
        (16, 3.2, 1, 13),  # 16 - round(3.2)
        (16, 3.2, 2, 6),  # 13 free cores shared by 2 processes of the run
        (8, 0.0, 16, 1),  # more processes than cores
    ],
)
def test_threads_are_the_free_cores(cores, load, processes, threads):
    choice = cpu.choose_threads(cores, load, processes)
    assert choice.threads == threads
    assert f"{cores} cores, 1-minute load {load:.1f}" in choice.reason


def test_cpu_threads_then_omp_num_threads_override_the_machine():
    assert cpu.choose_threads(2, 9.0, requested=4, omp_num_threads="1") == cpu.ThreadChoice(4, "cpu.threads")
    assert cpu.choose_threads(2, 9.0, omp_num_threads="3") == cpu.ThreadChoice(3, "OMP_NUM_THREADS=3")
    assert cpu.choose_threads(16, 0.0, omp_num_threads="4,2").threads == 4  # nested levels: the outer one
    for unusable in (None, "", "0", "many"):  # not a count: the machine decides
        assert cpu.choose_threads(16, 3.2, omp_num_threads=unusable).threads == 13


def test_the_log_line_names_threads_policy_and_why():
    line = cpu.choose_threads(2, 1.3).line("OMP_WAIT_POLICY=PASSIVE")
    assert (
        line
        == "cpu: 1 thread per process (2 cores, 1-minute load 1.3: 1 free; cpu.threads to choose); OpenMP wait policy OMP_WAIT_POLICY=PASSIVE"
    )
    assert CPU_LINE.fullmatch(cpu.ThreadChoice(2, "cpu.threads").line("GOMP_SPINCOUNT=0")).groups() == (
        "2",
        "cpu.threads",
        "GOMP_SPINCOUNT=0",
    )


def test_passive_wait_unless_the_environment_chose_a_policy():
    environ: dict[str, str] = {}
    assert cpu.set_passive_wait(environ) and environ == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    assert cpu.wait_policy(environ) == "OMP_WAIT_POLICY=PASSIVE"
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"), ("KMP_BLOCKTIME", "200")):
        environ = {name: value}
        assert not cpu.set_passive_wait(environ) and environ == {name: value}
        assert cpu.wait_policy(environ) == f"{name}={value}"


def openmp_spins(tmp_path, env: dict, torch_first: bool = False) -> list[str]:
    """The GOMP_SPINCOUNT libgomp shows (OMP_DISPLAY_ENV) at each start of ``rlhf-lightning fit`` on an
    empty config (refused before any model loads): how long its idle threads spin, 0 where they sleep at once.
    ``torch_first``: the command started from Python that imported torch before it."""
    (tmp_path / "empty.yaml").write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", *cpu.WAIT_POLICY_ENV)} | env | {"OMP_DISPLAY_ENV": "verbose"}
    start = ["-c", "import sys, torch; sys.argv[0] = 'rlhf-lightning'; from rlhf_lightning.cli import main; main()"]
    command = [sys.executable, *(start if torch_first else ["-m", "rlhf_lightning.cli"]), "fit", "--config", str(tmp_path / "empty.yaml")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and "the file is empty" in done.stderr, done.stderr[-3000:]
    return re.findall(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr)


@pytest.mark.skipif("GOMP_SPINCOUNT" not in openmp_runtime_strings(), reason="torch's OpenMP runtime is not GNU libgomp")
def test_idle_openmp_threads_sleep_without_being_told(tmp_path):
    """No variable set: the command sets the passive policy before torch loads, which the runtime then
    reads (spin 0 where its default is 300000), in one start; where torch loaded first, the command starts
    once more with the policy. A policy of the user's: one start, as set (so too with OMP_NUM_THREADS=1,
    no thread to wait: every other command-line test here)."""
    assert openmp_spins(tmp_path, {}) == ["0"]
    assert openmp_spins(tmp_path, {}, torch_first=True) == ["300000", "0"]
    assert openmp_spins(tmp_path, {"GOMP_SPINCOUNT": "1000"}) == ["1000"]


def test_available_cores_are_this_process_s():
    assert 1 <= cpu.available_cores() <= len(os.sched_getaffinity(0))


def test_cpu_threads_is_applied_and_checked(tmp_path):
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    before = torch.get_num_threads()
    try:
        cpu.apply_cpu_settings(trainer, cpu.CPUSettings(threads=3, malloc="default"))
        assert torch.get_num_threads() == 3
        cpu.apply_cpu_settings(trainer, cpu.CPUSettings(malloc="default"))  # null from Python: left as it is
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match=r"cpu\.threads"):
        cpu.CPUSettings(threads=0)


def test_the_bar_drops_v_num_and_keeps_the_module_s_metrics(tmp_path):
    trainer = Trainer(logger=TensorBoardLogger(tmp_path), enable_checkpointing=False, default_root_dir=tmp_path)
    trainer._logger_connector._progress_bar_metrics = {"reward": 0.5, "kl": 1.25, "beta": 0.1}
    metrics = IterationProgressBar().get_metrics(trainer, None)
    assert metrics == {"reward": 0.5, "kl": 1.25, "beta": 0.1}  # Lightning's own bar adds v_num


def test_where_the_logs_are_names_the_folder_and_both_commands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    logger = TensorBoardLogger(tmp_path / "lightning_logs", name="tiny", version=3)
    lines = where_the_logs_are(logger).splitlines()
    assert lines[0] == "logs: lightning_logs/tiny/version_3"
    assert re.fullmatch(
        r"  \S*tensorboard --logdir lightning_logs/tiny/version_3   \(then http://localhost:6006/#custom_scalars: .*\)", lines[1]
    )
    # from outside the checkout, the command goes to its root first (where tools/ imports), the run's folder in full
    summarize = f"{shlex.quote(str(tmp_path / 'lightning_logs' / 'tiny' / 'version_3'))} --blocks 5"
    assert re.fullmatch(rf"  cd \S+ && \S*python\S* -m tools.summarize_run {re.escape(summarize)}", lines[2]), lines[2]
    monkeypatch.chdir(REPO)  # from the checkout's root, as the README's quickstart runs
    logger = TensorBoardLogger(REPO / "lightning_logs", name="tiny", version=3)
    assert re.fullmatch(
        r"  \S*python\S* -m tools.summarize_run lightning_logs/tiny/version_3 --blocks 5", where_the_logs_are(logger).splitlines()[2]
    )
    assert where_the_logs_are(None).startswith("no logger")


def test_a_run_logs_its_threads_once_shows_the_bar_and_ends_with_its_logs(tmp_path):
    """A tiny run with the bar on, its second run in this folder (version_1): one ``cpu:`` line (the tests'
    OMP_NUM_THREADS=1), the bar's last state (4/4, the pace, reward, kl and beta, no v_num), no
    ``weights_only`` note at its two checkpoints, and the closing lines whose summarize_run command works."""
    (tmp_path / "lightning_logs" / "tiny" / "version_0").mkdir(parents=True)  # an earlier run's folder
    args = [a for a in RUN_ARGS if a not in ("--trainer.enable_progress_bar=false", "--trainer.limit_train_batches=6")]
    env = {"OMP_NUM_THREADS": "1", "COLUMNS": "200"}  # the bar's one line, not wrapped at 80 columns
    done = cli(tmp_path, "fit", "--config", str(CONFIGS / "tiny.yaml"), *args, "--trainer.limit_train_batches=4", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = CPU_LINE.findall(done.stderr)
    assert len(chosen) == 1 and chosen[0][:2] == ("1", "OMP_NUM_THREADS=1"), done.stderr
    assert "weights_only" not in done.stdout + done.stderr
    bar = [line for line in done.stdout.splitlines() if "4/4" in line][-1]
    assert re.search(r"4/4 \d+:\d\d:\d\d • 0:00:00 \d+\.\d+(it/s|s/it) reward: \S+ kl: \S+ beta: \S+", bar), bar
    assert "v_num" not in done.stdout
    run = tmp_path / "lightning_logs" / "tiny" / "version_1"
    assert (run / "checkpoints").is_dir() and any(run.glob("events.out.tfevents.*"))
    closing = done.stdout.rstrip().splitlines()[-3:]
    assert closing[0] == "logs: lightning_logs/tiny/version_1"
    summarize = subprocess.run(closing[2], shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert summarize.returncode == 0 and summarize.stdout.splitlines()[1].startswith("  0-3 "), summarize.stderr


def test_cpu_threads_on_the_command_line_wins_over_omp_num_threads(tmp_path, capsys, monkeypatch):
    tiny = ["fit", "--config", str(CONFIGS / "tiny.yaml"), *RUN_ARGS, "--trainer.limit_train_batches=1"]
    done = cli(tmp_path, *tiny, "--cpu.threads=1", env={"OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert [c[:2] for c in CPU_LINE.findall(done.stderr)] == [("1", "cpu.threads")]
    monkeypatch.setattr(sys, "argv", ["rlhf-lightning"])  # pytest's own arguments are not the command's
    with pytest.raises(SystemExit) as refused:
        main([*tiny, "--cpu.threads=0"])
    assert refused.value.code == 2 and "cpu.threads" in capsys.readouterr().err


def test_setup_prints_a_line_per_step():
    env = {**os.environ, "SETUP_DRY_RUN": "1"}
    out = subprocess.run(
        ["bash", str(REPO / "tools" / "setup.sh"), "--cpu"], capture_output=True, text=True, env=env, timeout=120, check=True
    ).stdout
    steps = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("setup: ")]
    assert [s.split(" ", 1)[0] for s in steps] == ["virtualenv", "torch:", "rlhf-lightning", "the", "done:"], out
    lines = out.splitlines()
    step = "setup: rlhf-lightning (editable) with its test tools and SkyRL-Gym (the skyrl_gym environment)"
    assert lines.index("pip install -e .[test,skyrl]") == lines.index(step) + 1


def test_a_conversion_shows_its_stages_and_silences_transformers_bars(capfd):
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from rlhf_lightning.models import stage_progress

    gguf_tqdm, bars_on = gguf_utils.tqdm, hf_logging.is_progress_bar_enabled()
    with stage_progress("converting x.gguf (once)", ("reading", "writing")) as next_stage:
        for stage in range(2):
            next_stage()
            assert not hf_logging.is_progress_bar_enabled() and list(gguf_utils.tqdm(range(3), desc="de-quantizing")) == [0, 1, 2]
            print(f"stage {stage}", file=sys.stderr)
    assert hf_logging.is_progress_bar_enabled() == bars_on and gguf_utils.tqdm is gguf_tqdm  # as they were
    lines = capfd.readouterr().err.splitlines()  # not a terminal: a line per stage, no bar
    assert lines[:-1] == ["converting x.gguf (once)", "  reading (1/2)", "stage 0", "  writing (2/2)", "stage 1"]
    assert re.fullmatch(r"  done in \d+ s", lines[-1])
