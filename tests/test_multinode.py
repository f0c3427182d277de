"""Several machines, simulated on this one: ``--trainer.num_nodes=2 --trainer.devices=1`` launched
as two "nodes" (one process each, on gloo), by Lightning's own environment variables and by
torchrun; DDP and FSDP2. A rank killed mid-iteration stops the other with an error, and the run
resumes from the last complete checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import CONFIGS, RUN_ARGS, betas_by_iteration, cli, free_port, run_nodes

STRATEGIES = {"ddp": ("--trainer.strategy=ddp",), "fsdp2": ("--config", str(CONFIGS / "fsdp2.yaml"))}
# GRPO, two responses per prompt, 4 prompts per node, 2 iterations of 8 new tokens.
SHORT = (
    "--trainer.limit_train_batches=2",
    "--data.batch_size=4",
    "--model.sampling.max_new_tokens=8",
    "--model.advantage_estimator=grpo",
    "--model.sampling.num_generations=2",
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


@pytest.mark.slow  # long multi-process run: CI's convergence command leaves it out (README)
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


@pytest.mark.slow  # long multi-process run: CI's convergence command leaves it out (README)
@pytest.mark.convergence
def test_a_node_killed_mid_iteration_stops_the_other_with_an_error_and_the_run_resumes(tmp_path):
    """Node 1 is SIGKILLed in the middle of iteration 3 (FSDP2, a checkpoint every 2 iterations):
    node 0's next collective fails (gloo: the connection to the peer is reset) and it exits with
    that error within seconds, long before the collective timeout (set here to 2 minutes, the
    bound for a peer that hangs instead of dying); the two nodes then resume from last.ckpt
    (iteration 2) and run iterations 3 and 4, both ranks holding the same metrics."""
    root = tmp_path / "run"
    four = ("--trainer.limit_train_batches=4",)
    timeout = ("--trainer.strategy.init_args.timeout=0:02:00",)
    kill = ("--trainer.callbacks+=fault_callbacks.KillMidIteration", "--trainer.callbacks.iteration=2", "--trainer.callbacks.rank=1")
    survivor, killed = run_nodes(root, "env", 2, *STRATEGIES["fsdp2"], *SHORT, *four, *timeout, *kill, *recorders(root))
    assert killed.returncode == -9, killed.stderr[-2000:]
    print(f"node 1 killed at {killed.seconds:.1f} s; node 0 exited {survivor.returncode} at {survivor.seconds:.1f} s")
    assert survivor.returncode == 1 and survivor.seconds - killed.seconds < 60, survivor.stderr[-2000:]
    assert "Connection reset by peer" in survivor.stderr or "Connection closed by peer" in survivor.stderr, survivor.stderr[-2000:]
    (ckpt,) = (root / "lightning_logs").glob("*/version_0/checkpoints/last.ckpt")
    assert torch.load(ckpt / "meta.pt", weights_only=True)["rlhf_lightning"]["iteration"] == 2

    for node in run_nodes(root, "env", 2, *STRATEGIES["fsdp2"], *SHORT, *four, *timeout, f"--ckpt_path={ckpt}", *recorders(root)):
        assert node.returncode == 0, node.stderr[-4000:]
    metrics = metrics_by_iteration(root)  # iterations 1-2 before the kill, 3-4 resumed
    assert sorted(metrics) == [1, 2, 3, 4] and all(by_rank[0] == by_rank[1] for by_rank in metrics.values()), metrics


@pytest.mark.convergence
@pytest.mark.parametrize("node_rank, waits_for", [(0, "waiting for clients. 1/2 clients joined"), (1, "while trying to connect to")])
def test_a_world_whose_other_node_never_comes_fails_within_the_timeout_naming_num_nodes_and_devices(tmp_path, node_rank, waits_for):
    """Node 0 started alone waits for node 1; node 1 started alone cannot reach node 0's address. Each
    gives up after the strategy's timeout (3 s here; Lightning's default 30 minutes) with one line
    naming the world's shape, instead of torch's traceback."""
    port = str(free_port())
    env = {"NODE_RANK": str(node_rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2"}
    args = ("--trainer.num_nodes=2", "--trainer.devices=1", "--trainer.strategy=DDPStrategy", "--trainer.strategy.timeout=0:00:03")
    result = cli(tmp_path, "fit", "--config", str(CONFIGS / "tiny.yaml"), *RUN_ARGS, *args, env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith(
        "error: the world of trainer.num_nodes=2 x trainer.devices=1 = 2 processes did not form within trainer.strategy's timeout (0:00:03): "
    ), line
    assert waits_for in line and f"MASTER_ADDR=127.0.0.1 MASTER_PORT={port}" in line and "NODE_RANK 0..1" in line, line


def test_ctrl_c_while_the_world_forms_stops_at_once(tmp_path):
    """Node 0 started alone waits for node 1 in torch's rendezvous (in C++, where Python's Ctrl+C handler cannot run
    until the 30-minute timeout): the command says Ctrl+C stops at once, and it does, with the shell's status for
    SIGINT."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import REPO

    env = {**os.environ, "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), env.get("PYTHONPATH", "")])
    args = ("--trainer.num_nodes=2", "--trainer.devices=1", "--trainer.strategy=ddp")
    command = [sys.executable, "-m", "rlhf_lightning.cli", "fit", "--config", str(CONFIGS / "tiny.yaml"), *RUN_ARGS, *args]
    run = subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    lines, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        line = run.stderr.readline()
        lines.append(line)
        if not line or "Ctrl+C stops at once" in line:
            break
    assert "waiting for the world of trainer.num_nodes=2 x trainer.devices=1 processes to form" in lines[-1], "".join(lines)[-3000:]
    time.sleep(2.0)  # into the rendezvous
    run.send_signal(signal.SIGINT)
    started = time.monotonic()
    run.communicate(timeout=60)
    assert run.returncode == -signal.SIGINT and time.monotonic() - started < 30


def prompt_loaders(prompts: list[str], world: int):
    """The training loaders of ``world`` ranks (batches of one prompt), with a stand-in for the trainer
    they read their position from (batches started: ``trainer.fit_loop...ready``)."""
    from types import SimpleNamespace

    from rlhf_lightning.data import PromptLoader, PromptSampler

    progress = SimpleNamespace(ready=0)
    trainer = SimpleNamespace(
        current_epoch=0, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=progress)))
    )
    samplers = [PromptSampler(prompts, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True) for rank in range(world)]
    loaders = [PromptLoader(prompts, batch_size=1, sampler=s, drop_last=True, collate_fn=list, trainer=trainer) for s in samplers]
    return loaders, progress


@pytest.mark.parametrize(("before", "after", "twice"), [(2, 1, 0), (1, 2, 0), (2, 4, 0), (4, 3, 0), (3, 4, 2)])
def test_the_data_position_means_the_same_prompts_on_any_number_of_processes(before, after, twice):
    """6 prompts on each of ``before`` ranks, then resumed on ``after``: the prompts not yet seen,
    each once. Before: 6 x before prompts, the permutation's first (the ranks deal it out in
    turn); after, each rank skips 6 x before / after of its own share. 3 ranks -> 4: 18 prompts do
    not split in 4, each rank skips 4 (16), and 2 prompts come again (with a warning)."""
    import itertools
    import warnings

    prompts = [f"prompt {i}" for i in range(48)]
    loaders, progress = prompt_loaders(prompts, before)
    seen = [prompt for loader in loaders for batch in itertools.islice(loader, 6) for prompt in batch]
    progress.ready = 6
    state = loaders[0].state_dict()
    assert state == {"epoch": 0, "samples_done": 6, "world_size": before}
    loaders, _ = prompt_loaders(prompts, after)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for loader in loaders:
            loader.load_state_dict(state)
    rest = [prompt for loader in loaders for batch in loader for prompt in batch]
    assert len(rest) == 48 - 6 * before + twice and sorted(set(seen + rest)) == sorted(prompts)
    assert len([w for w in caught if "seen twice" in str(w.message)]) == (after if twice else 0)
