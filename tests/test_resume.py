"""Exact resume: a run SIGKILLed mid-iteration and resumed from last.ckpt reproduces the
uninterrupted run's per-iteration metrics exactly (CPU, fixed seed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import CONFIGS, REPO, cli

sys.path.insert(0, str(REPO / "tools"))
from summarize_run import read_scalars  # noqa: E402

WATCHED = ("objective/reward", "objective/kl", "objective/beta", "objective/kl_max", "objective/kl_to_initial", "policy/loss", "value/loss")


def run_cli(root, *extra: str) -> subprocess.CompletedProcess:
    args = [
        "fit", "--config", str(CONFIGS / "tiny.yaml"),
        "--trainer.max_epochs=1", "--trainer.limit_train_batches=6", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}", "--model.beta_controller=BandBeta",
        "--model.beta_controller.init_args.target=0.5", "--model.max_new_tokens=10",
        "--trainer.callbacks.every_n_iterations=2", *extra,
    ]  # fmt: skip
    return cli(root, *args)


# Critic-free: 4 prompts x 2 responses per iteration, GRPO's group baseline, no value loss to watch.
GROUPED = ("--model.advantage_estimator=grpo", "--model.num_generations=2", "--data.batch_size=4")
# A moving reference: the checkpoint after iteration 2 holds the reference reset at its end (full
# fine-tuning: the moved copy), and the resumed run goes through the next reset; LoRA: the EMA
# reference adapter, moved after every iteration.
RESET = ("--model.reference_update=Reset", "--model.reference_update.init_args.every_n_iterations=2")
LORA_EMA = ("--model.lora_rank=4", "--model.reference_update=EMA", "--model.reference_update.init_args.alpha=0.5")


@pytest.mark.parametrize("extra", [(), GROUPED, RESET, LORA_EMA], ids=["gae", "grpo-n2", "reset", "lora-ema"])
def test_sigkill_mid_iteration_then_resume_reproduces_the_uninterrupted_run(tmp_path, extra):
    watched = WATCHED if extra != GROUPED else tuple(name for name in WATCHED if name != "value/loss")
    straight = run_cli(tmp_path / "straight", *extra)
    assert straight.returncode == 0, straight.stderr[-3000:]

    killed_root = tmp_path / "killed"
    killed = run_cli(killed_root, *extra, "--trainer.callbacks+=fault_callbacks.KillMidIteration", "--trainer.callbacks.iteration=3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    (ckpt_dir,) = (killed_root / "lightning_logs" / "tiny").glob("version_0/checkpoints")
    assert (ckpt_dir / "last.ckpt").exists()
    last = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    assert last["rlhf_lightning"]["iteration"] == 2  # saved after iteration 2, killed during iteration 4
    assert last["rlhf_lightning"]["reference_updates"] == {RESET: 1, LORA_EMA: 2}.get(extra, 0)

    resumed = run_cli(killed_root, *extra, f"--ckpt_path={ckpt_dir / 'last.ckpt'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "dataloader is not resumable" not in resumed.stderr

    logs = killed_root / "lightning_logs" / "tiny"
    reference = read_scalars(str(tmp_path / "straight" / "lightning_logs" / "tiny" / "version_0"))
    after = read_scalars(str(logs / "version_1"))
    # Both folders read as one run: version_1's steps replace the ones version_0 logged before the kill.
    combined = read_scalars([str(logs / "version_0"), str(logs / "version_1")])
    if extra == GROUPED:
        assert "value/loss" not in reference and set(reference["response/count"].values()) == {8.0}
    if extra == RESET:  # exactly 0 on the rollouts right after the resets (steps count iterations from 0)
        assert reference["objective/kl"][2] == reference["objective/kl"][4] == 0.0
        assert reference["objective/kl_to_initial"][4] > 0
    for name in watched:
        assert list(reference[name]) == list(range(6))  # the logged step is the iteration
        assert list(after[name]) == [2, 3, 4, 5], name  # iterations 3..6 (1-based) ran again after the resume
        assert combined[name] == reference[name], (name, combined[name], reference[name])
    assert len(set(reference["objective/beta"].values())) > 1  # the controller state had something to restore


def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_loadable(tmp_path, monkeypatch):
    """Lightning writes checkpoints inside an fsspec transaction (a temporary file renamed into
    place on success): a write that dies half way must not touch the existing file."""
    from fsspec.implementations.local import LocalFileOpener

    from helpers import fit, make_module

    trainer, _ = fit(make_module(), tmp_path, iterations=1)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    before = path.read_bytes()

    def die_half_way(self, data):
        self.f.write(data[: len(data) // 2])
        raise KeyboardInterrupt("killed during the write")

    trainer.lightning_module.iteration = 99
    monkeypatch.setattr(LocalFileOpener, "write", die_half_way)
    try:
        trainer.save_checkpoint(path)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert torch.load(path, weights_only=True)["rlhf_lightning"]["iteration"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name not in ("last.ckpt",) and p.is_file()]  # no stray partial file
