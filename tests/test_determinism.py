"""Same seed, same machine, same thread count: the same run, number for number, through the command
a user types (the README's reproducibility claim)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.summarize_run import read_scalars

from helpers import CONFIGS, cli


def scalars_of_a_tiny_run(root: Path, seed: int) -> dict[str, dict[int, float]]:
    """Three PPO iterations of configs/tiny.yaml in ``root``; every scalar (timings aside) by step."""
    result = cli(
        root,
        "fit",
        "--config",
        str(CONFIGS / "tiny.yaml"),
        "--trainer.max_epochs=1",
        "--trainer.limit_train_batches=3",
        "--trainer.limit_val_batches=0",
        "--trainer.callbacks=[]",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}",
        f"--seed_everything={seed}",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    scalars = read_scalars(str(root / "lightning_logs" / "tiny" / "version_0"))
    return {tag: by_step for tag, by_step in scalars.items() if not tag.startswith("timing/")}


@pytest.mark.convergence
def test_the_same_seed_gives_the_same_run_and_another_seed_does_not(tmp_path):
    first, second, other = (tmp_path / name for name in ("first", "second", "other"))
    a, b = scalars_of_a_tiny_run(first, seed=0), scalars_of_a_tiny_run(second, seed=0)
    assert len(a["objective/reward"]) == 3 and "policy/loss" in a
    assert a == b  # every metric at every step, exactly
    c = scalars_of_a_tiny_run(other, seed=1)
    assert c["objective/reward"] != a["objective/reward"]  # the seed reaches the weights and the samples
