"""A failure in the asynchronous sampler's thread (``model.off_policy.max_staleness`` > 0) ends the command as
docs/async.md promises: one ``error: ...`` line naming the cause and the setting, status 2 (130 for Ctrl+C), never an
abort after the message (``terminate called without an active exception``, status 134: a daemon thread still
inside torch when the interpreter finalises). The reward backends are tests/sampler_faults.py's."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from rlhf_lightning.args import OffPolicyArgs
from rlhf_lightning.checks import ConfigError

from helpers import CONFIGS, cli

STALE = (
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=4",
    "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false",
    "--model.sampling.max_new_tokens=8",
    "--model.sampling.old_logprobs=forward",
    "--model.off_policy.max_staleness=1",
)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def stale_cli(root, *extra: str) -> subprocess.CompletedProcess:
    """``rlhf-lightning fit --config configs/tiny.yaml`` with the sampler one update ahead, in ``root``."""
    return cli(root, "fit", "--config", str(CONFIGS / "tiny.yaml"), *STALE, *extra, timeout=600, env=ONE_THREAD)


def last_line(result: subprocess.CompletedProcess) -> str:
    assert "terminate called" not in result.stderr, result.stderr[-2000:]
    assert sum(line.startswith("error: ") for line in result.stderr.splitlines()) == 1, result.stderr[-2000:]
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("error", ["RuntimeError", "TimeoutError"])
def test_a_reward_that_raises_in_the_sampler_thread_is_one_line_naming_score_in_sampler(tmp_path, error):
    """The reward's second call (the batch of iteration 1, scored in the sampler's thread while iteration 0 trains)
    raises; the sampler is drawing iteration 2's batch when the trainer reports it (the run's abort, before). The
    backend's own TimeoutError is its error, not the sampler's timeout."""
    result = stale_cli(tmp_path, "--model.reward_model=sampler_faults.RaiseOnCall", f"--model.reward_model.init_args.error={error}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert last_line(result) == (
        "error: model.off_policy.score_in_sampler true: the sampler's thread failed scoring the batch of iteration 1 "
        f"(model.off_policy.max_staleness 1): {error}: the scoring service went away; a reward backend that runs only "
        "in the trainer's thread needs model.off_policy.score_in_sampler false"
    )


def test_a_sampler_that_hangs_past_the_timeout_is_one_line_naming_it(tmp_path):
    start = time.monotonic()
    result = stale_cli(tmp_path, "--model.reward_model=sampler_faults.HangOnCall", "--model.off_policy.sampler_timeout_s=2")
    assert result.returncode == 2, result.stderr[-2000:]
    assert last_line(result) == (
        "error: model.off_policy.sampler_timeout_s 2.0: the sampler drew no batch for iteration 1 in that time "
        "(model.off_policy.max_staleness 1); raise the timeout if sampling one batch takes longer, or never to wait for ever"
    )
    assert time.monotonic() - start < 300  # the hung reward sleeps an hour: the process did not wait for it


def test_ctrl_c_while_waiting_for_a_sampler_that_never_times_out_is_one_line(tmp_path):
    """``sampler_timeout_s: never`` and a reward that hangs on the batch of iteration 1: once iteration 0 is done
    (the trainer then waits for that batch), Ctrl+C (finish the iteration, which cannot) and Ctrl+C again (stop at
    once) end the command within seconds with one line and the shell's status for SIGINT."""
    record = tmp_path / "iterations.txt"
    command = [
        sys.executable,
        "-m",
        "rlhf_lightning.cli",
        "fit",
        "--config",
        str(CONFIGS / "tiny.yaml"),
        *STALE,
        "--model.reward_model=sampler_faults.HangOnCall",
        "--model.off_policy.sampler_timeout_s=never",
        "--trainer.callbacks+=fault_callbacks.RecordBeta",
        f"--trainer.callbacks.path={record}",
    ]
    import os

    from helpers import REPO

    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (record.exists() and record.read_text().strip()):  # iteration 0 done: its batch-end callback wrote
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or never finished iteration 0"
            time.sleep(0.2)
        time.sleep(1.0)  # the trainer publishes, hands over iteration 2's prompts and waits
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert time.monotonic() - stopped < 30, "the second Ctrl+C did not end the wait promptly"
    result = subprocess.CompletedProcess(command, proc.returncode, "", stderr)
    assert result.returncode == 128 + signal.SIGINT, stderr[-2000:]
    assert last_line(result) == (
        "error: stopped by Ctrl+C while waiting for the sampler's batch of iteration 1 (model.off_policy.max_staleness 1, "
        "model.off_policy.sampler_timeout_s never); the iteration under way is not saved"
    )


@pytest.mark.parametrize("value, seconds", [("never", None), (None, None), (30, 30.0), (0.5, 0.5)])
def test_the_timeout_is_a_number_of_seconds_or_never(value, seconds):
    assert OffPolicyArgs(sampler_timeout_s=value).sampler_timeout == seconds


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), "soon", True])
def test_any_other_timeout_is_refused_naming_the_field_and_the_choices(value):
    with pytest.raises(
        ConfigError, match=r"^model\.off_policy\.sampler_timeout_s must be a number of seconds > 0 or never \(wait for ever\), got "
    ):
        OffPolicyArgs(sampler_timeout_s=value)


def test_the_command_refuses_a_bad_timeout_at_start_up(tmp_path):
    result = stale_cli(tmp_path, "--model.off_policy.sampler_timeout_s=soon")
    assert result.returncode == 2, result.stderr[-2000:]
    assert (
        last_line(result)
        == "error: model.off_policy.sampler_timeout_s must be a number of seconds > 0 or never (wait for ever), got 'soon'"
    )


def test_a_reward_declared_bound_to_the_trainers_thread_is_refused_at_start_up_naming_score_in_sampler(tmp_path):
    result = stale_cli(tmp_path, "--model.reward_model=sampler_faults.DeclaredMainThreadOnly")
    assert result.returncode == 2, result.stderr[-2000:]
    assert last_line(result) == (
        "error: model.off_policy.score_in_sampler must be false with model.reward_model DeclaredMainThreadOnly, which runs "
        "only in the trainer's thread (thread_safe False; with model.off_policy.max_staleness 1 the sampler's thread "
        "scores), got True"
    )
    assert not list(tmp_path.glob("lightning_logs/tiny/*/events.*"))  # refused before anything trained


def test_a_reward_bound_to_the_trainers_thread_trains_with_score_in_sampler_false(tmp_path):
    """Undeclared, it fails at its first call in the sampler's thread, naming the setting; with the setting false
    the same backend, called in the trainer's thread, trains (and the declared one is not refused)."""
    failed = stale_cli(tmp_path / "in_sampler", "--model.reward_model=sampler_faults.MainThreadOnly")
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert "model.off_policy.score_in_sampler true: the sampler's thread failed scoring the batch of iteration 0" in last_line(failed)
    assert "RuntimeError: this client was created in another thread" in last_line(failed)
    trained = stale_cli(
        tmp_path / "in_trainer",
        "--model.reward_model=sampler_faults.DeclaredMainThreadOnly",
        "--model.off_policy.score_in_sampler=false",
        "--trainer.limit_train_batches=2",
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "terminate called" not in trained.stderr
