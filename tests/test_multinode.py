"""Several machines, simulated on this one: ``--trainer.num_nodes=2 --trainer.devices=1`` launched
as two "nodes" (one process each, on gloo), by Lightning's own environment variables and by
torchrun; DDP and FSDP2. A rank killed mid-iteration stops the other with an error, and the run
resumes from the last complete checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import CONFIGS, betas_by_iteration, run_nodes

STRATEGIES = {"ddp": ("--trainer.strategy=ddp",), "fsdp2": ("--config", str(CONFIGS / "fsdp2.yaml"))}
# GRPO, two responses per prompt, 4 prompts per node, 2 iterations of 8 new tokens.
SHORT = (
    "--trainer.limit_train_batches=2",
    "--data.batch_size=4",
    "--model.max_new_tokens=8",
    "--model.advantage_estimator=grpo",
    "--model.num_generations=2",
    "--model.critic=none",
)


def recorders(root: Path) -> tuple[str, ...]:
    return (
        "--trainer.callbacks+=fault_callbacks.RecordBeta",
        f"--trainer.callbacks.path={root / 'beta.txt'}",
        "--trainer.callbacks+=fault_callbacks.RecordMetrics",
        f"--trainer.callbacks.path={root / 'metrics.txt'}",
        "--trainer.callbacks+=fault_callbacks.RecordGroups",
        f"--trainer.callbacks.path={root / 'groups.txt'}",
    )


def metrics_by_iteration(root: Path) -> dict[int, dict[int, dict[str, float]]]:
    """``{iteration: {rank: {metric: value}}}`` from fault_callbacks.RecordMetrics, without the
    ``timing/`` seconds (each rank's own clock)."""
    found: dict[int, dict[int, dict[str, float]]] = {}
    for line in (root / "metrics.txt").read_text().splitlines():
        rank, iteration, metrics = json.loads(line)
        found.setdefault(iteration, {})[rank] = {k: v for k, v in metrics.items() if not k.startswith("timing/")}
    return found


@pytest.mark.convergence
@pytest.mark.parametrize(("strategy", "launchers"), [("fsdp2", ("env", "torchrun")), ("ddp", ("torchrun",))])
def test_two_nodes_launched_by_lightning_variables_and_by_torchrun_run_the_same_world(tmp_path, strategy, launchers):
    runs = {}
    for launcher in launchers:
        root = tmp_path / launcher
        nodes = run_nodes(root, launcher, 2, *STRATEGIES[strategy], *SHORT, *recorders(root))
        for node in nodes:
            assert node.returncode == 0, node.stderr[-4000:]
        assert "MEMBER: 2/2" in nodes[1].stderr  # one world of two processes, not two worlds of one

        # Every rank holds the same beta and the same (all-reduced) metrics after every iteration.
        betas = betas_by_iteration((root / "beta.txt").read_text().split("\n"))
        assert sorted(betas) == [1, 2] and all(sorted(by_rank) == [0, 1] and by_rank[0] == by_rank[1] for by_rank in betas.values())
        metrics = metrics_by_iteration(root)
        assert sorted(metrics) == [1, 2] and all(by_rank[0] == by_rank[1] for by_rank in metrics.values()), metrics
        # The global batch: 2 nodes x 4 prompts x 2 responses; each node holds its 4 prompts' groups whole.
        assert all(by_rank[0]["response/count"] == 16.0 for by_rank in metrics.values())
        groups = [line.split() for line in (root / "groups.txt").read_text().splitlines()]
        assert sorted((int(rank), int(it)) for rank, it, _, _ in groups) == [(0, 1), (0, 2), (1, 1), (1, 2)]
        assert all((rows, runs) == ("8", "4") for _, _, rows, runs in groups), groups

        # Checkpoints written once, by global rank 0 (a shared folder here): one run folder, one last.ckpt.
        (checkpoints,) = (root / "lightning_logs").glob("*/version_*/checkpoints")
        assert (checkpoints / "last.ckpt").exists() and not list(root.rglob("*.partial"))
        if strategy == "fsdp2":  # a folder: each rank's shards and the metadata
            assert sorted(p.name for p in (checkpoints / "last.ckpt").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
        runs[launcher] = metrics
    # torchrun forms the same world (ranks, seeds, prompt shards): the same run, bit for bit.
    assert all(metrics == runs[launchers[0]] for metrics in runs.values())
