"""Checkpoints written before the third renovation still resume, and the resumed run is the run that
version would have continued: ``tests/data/checkpoints_0.2`` holds two checkpoints written by the code
of c29c648 (0.2.0) after 2 iterations of ``configs/tiny.yaml`` (BandBeta, 10 new tokens, one OpenMP
thread), one of the synchronous loop and one with the sampler one update ahead
(``model.off_policy.max_staleness 1``, a batch in flight inside it), and ``resumed_metrics.json`` the
metrics that code logged at iterations 3 and 4 after resuming each (``--trainer.max_epochs=2``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.summarize_run import read_scalars

from helpers import CONFIGS, RUN_ARGS, cli

DATA = Path(__file__).parent / "data" / "checkpoints_0.2"
RESUME_ARGS = (*RUN_ARGS, "--trainer.max_epochs=2", "--trainer.limit_train_batches=2")  # the later value wins
ASYNC = ("--model.off_policy.max_staleness=1", "--model.sampling.old_logprobs=forward")


@pytest.mark.parametrize(("name", "extra"), [("tiny", ()), ("tiny_async", ASYNC)])
def test_a_checkpoint_written_by_0_2_resumes_and_continues_as_0_2_did(tmp_path, monkeypatch, name, extra):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the thread count the expected run had
    ckpt = DATA / f"{name}.ckpt"
    result = cli(tmp_path, "fit", "--config", str(CONFIGS / "tiny.yaml"), *RESUME_ARGS, *extra, f"--ckpt_path={ckpt}")
    assert result.returncode == 0, result.stderr[-3000:]
    scalars = read_scalars(str(tmp_path / "lightning_logs" / "tiny" / "version_0"))
    expected = json.loads((DATA / "resumed_metrics.json").read_text())[name]
    for tag, by_step in expected.items():
        got = {str(step): value for step, value in scalars[tag].items()}
        assert got == pytest.approx(by_step, rel=1e-5, abs=1e-6), tag
