"""Same seed, same machine, same thread count: the same run, number for number, through the command
a user types (the README's reproducibility claim)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import CONFIGS


def scalars_of_a_tiny_run(root: Path, seed: int) -> dict[str, list[tuple[int, float]]]:
    """Three PPO iterations of configs/tiny.yaml in ``root``; every scalar (timings aside) by step."""
    subprocess.run(
        [sys.executable, "-m", "rlhf_lightning.cli", "fit", "--config", str(CONFIGS / "tiny.yaml"),
         "--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=0",
         "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
         f"--trainer.default_root_dir={root}", f"--seed_everything={seed}"],
        check=True, capture_output=True, timeout=600, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    (run,) = root.glob("lightning_logs/tiny/version_0")
    events = EventAccumulator(str(run))
    events.Reload()
    tags = [t for t in events.Tags()["scalars"] if not t.startswith("timing/")]
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags}


def test_the_same_seed_gives_the_same_run_and_another_seed_does_not(tmp_path):
    first, second, other = (tmp_path / name for name in ("first", "second", "other"))
    for root in (first, second, other):
        root.mkdir()
    a, b = scalars_of_a_tiny_run(first, seed=0), scalars_of_a_tiny_run(second, seed=0)
    assert len(a["objective/reward"]) == 3 and "policy/loss" in a
    assert a == b  # every metric at every step, exactly
    c = scalars_of_a_tiny_run(other, seed=1)
    assert c["objective/reward"] != a["objective/reward"]  # the seed reaches the weights and the samples
