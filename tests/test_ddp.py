"""Two-process DDP on CPU (gloo): global statistics, identical beta on every rank, and the same
trajectory as one process with the same global batch."""

from __future__ import annotations

import math

import pytest

from helpers import COMPARED, betas_by_iteration, global_batch_run, save_tiny_teacher


def run(root, devices: int, *extra: str):
    """:func:`helpers.global_batch_run` with each rank's beta per iteration recorded."""
    scalars = global_batch_run(
        root, devices, "--trainer.callbacks+=fault_callbacks.RecordBeta", f"--trainer.callbacks.path={root / 'beta.txt'}", *extra
    )
    return scalars, (root / "beta.txt").read_text().split("\n")


@pytest.mark.convergence
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_two_process_ddp_matches_one_process_with_the_same_global_batch(tmp_path, aggregation):
    """Also with a per-response aggregation: its weights' denominators (responses, each response's
    length) are global, so the sharded loss is the one-process loss."""
    single, _ = run(tmp_path / "single", 1, f"--model.loss_aggregation={aggregation}")
    ddp, beta_lines = run(tmp_path / "ddp", 2, f"--model.loss_aggregation={aggregation}")
    betas = betas_by_iteration(beta_lines)
    assert sorted(betas) == [1, 2, 3, 4]
    assert all(by_rank[0] == by_rank[1] for by_rank in betas.values()), betas  # bit-identical on both ranks
    # Greedy rollouts make the responses a function of the weights alone; every statistic is global
    # and the loss is the global token mean, so the runs differ only by float summation order.
    assert ddp["objective/kl"][-1] > 1 and ddp["objective/reward"][-1] > 2 * ddp["objective/reward"][0]  # it learns
    for name in COMPARED:
        for a, b in zip(single[name], ddp[name], strict=True):
            assert math.isclose(a, b, rel_tol=2e-3, abs_tol=1e-4), (name, single[name], ddp[name])
    assert len(set(ddp["objective/beta"])) > 1


def test_two_process_ddp_with_a_group_estimator_keeps_groups_on_one_rank_and_statistics_global(tmp_path):
    """GRPO with 2 sampled responses per prompt: each rank samples its own 4 prompts x 2 (groups
    never straddle ranks), the logged count is the global 16, and beta, fed the all-rank KL, is
    bit-identical on both ranks although the ranks sample different responses."""
    root = tmp_path / "grpo"
    ddp, beta_lines = run(
        root,
        2,
        "--model.sampling.do_sample=true",
        "--model.advantage_estimator=grpo",
        "--model.sampling.num_generations=2",
        "--trainer.callbacks+=fault_callbacks.RecordGroups",
        f"--trainer.callbacks.path={root / 'groups.txt'}",
    )
    betas = betas_by_iteration(beta_lines)
    assert sorted(betas) == [1, 2, 3, 4] and all(by_rank[0] == by_rank[1] for by_rank in betas.values()), betas
    assert len(set(ddp["objective/beta"])) > 1
    groups = [line.split() for line in (root / "groups.txt").read_text().splitlines()]
    assert sorted((int(rank), int(it)) for rank, it, _, _ in groups) == [(r, i) for r in (0, 1) for i in (1, 2, 3, 4)]
    assert all((rows, runs) == ("8", "4") for _, _, rows, runs in groups), groups  # 4 prompts, each in one run of 2
    assert ddp["response/count"] == [16.0] * 4
    assert "value/loss" not in ddp and all(math.isfinite(v) for v in ddp["policy/loss"])


@pytest.mark.convergence
def test_two_process_ddp_with_a_moving_reference_holds_the_same_reference_on_every_rank(tmp_path):
    """An EMA reference moved after every iteration (alpha 0.5): the ranks apply the same update to
    the same all-reduced weights, so their reference parameters hash the same after every iteration,
    and the DDP run logs what one process with the same global batch logs."""
    moving = ("--model.reference_update=EMA", "--model.reference_update.init_args.alpha=0.5")
    single, _ = run(tmp_path / "single", 1, *moving)
    root = tmp_path / "ddp"
    ddp, _ = run(root, 2, *moving, "--trainer.callbacks+=fault_callbacks.RecordReference", f"--trainer.callbacks.path={root / 'ref.txt'}")
    hashes: dict[int, set[str]] = {}
    for line in (root / "ref.txt").read_text().splitlines():
        _, iteration, digest = line.split()
        hashes.setdefault(int(iteration), set()).add(digest)
    assert sorted(hashes) == [1, 2, 3, 4] and all(len(digests) == 1 for digests in hashes.values()), hashes
    assert ddp["reference/updates"] == [0.0, 1.0, 2.0, 3.0]
    for name in ("objective/kl", "objective/kl_to_initial", "objective/reward"):
        for a, b in zip(single[name], ddp[name], strict=True):
            assert math.isclose(a, b, rel_tol=2e-3, abs_tol=1e-4), (name, single[name], ddp[name])
    assert ddp["objective/kl_to_initial"][-1] > ddp["objective/kl"][-1] > 0  # the reference trails the policy


@pytest.mark.convergence
def test_two_process_ddp_with_a_foreign_reference_logs_what_one_process_logs(tmp_path):
    """model.reference: a teacher's folder, loaded whole on every rank as a frozen model beside the policy (DDP
    averages only the trainable gradients): the KL to the teacher and the drift from the starting policy are
    what one process with the same global batch logs."""
    teacher = save_tiny_teacher(tmp_path / "teacher")
    single, _ = run(tmp_path / "single", 1, f"--model.reference={teacher}")
    ddp, _ = run(tmp_path / "ddp", 2, f"--model.reference={teacher}")
    assert ddp["objective/kl"][0] > 10 and ddp["objective/kl_to_initial"][0] < 1e-4
    for name in ("objective/kl", "objective/kl_to_initial", "objective/reward"):
        for a, b in zip(single[name], ddp[name], strict=True):
            assert math.isclose(a, b, rel_tol=2e-3, abs_tol=1e-4), (name, single[name], ddp[name])
