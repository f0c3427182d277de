"""Checkpoints through the command: the last iteration of every run is in last.ckpt, and
checkpoints written before the built-in plugins were regrouped by kind (plugins/control.py,
reward_models.py, ... until 2026-11-25) resume: their recorded plugin class paths name the old
modules, and the resume check compares them through registry.canonical_class_path."""

from __future__ import annotations

import pytest
import torch

from tools.summarize_run import read_scalars

from helpers import run_cli

# What a checkpoint of the previous layout recorded for configs/tiny.yaml with RUN_ARGS's BandBeta.
OLD_PLUGINS = {
    "reward_model": "rlhf_lightning_plugins.reward_models.CallableReward",
    "beta_controller": "rlhf_lightning_plugins.beta_controllers.BandBeta",
}


def test_the_last_iteration_is_in_last_ckpt_and_a_checkpoint_of_the_old_plugin_layout_resumes(tmp_path):
    """3 iterations with a checkpoint every 2 (RUN_ARGS), not a multiple of it: last.ckpt holds the
    third. Its plugin class paths rewritten to the previous layout's, ``--ckpt_path last`` resumes
    after the third iteration; a moved path of another plugin kind is still refused."""
    first = run_cli(tmp_path, "--trainer.limit_train_batches=3")
    assert first.returncode == 0, first.stderr[-3000:]
    (ckpt,) = tmp_path.glob("lightning_logs/*/version_0/checkpoints/last.ckpt")
    checkpoint = torch.load(ckpt, weights_only=False)
    assert checkpoint["rlhf_lightning"]["iteration"] == 3
    assert checkpoint["rlhf_lightning"]["plugins"]["reward_model"] == "rlhf_lightning_plugins.rewards.function.CallableReward"
    resume = ("--trainer.limit_train_batches=3", "--trainer.max_epochs=2", "--ckpt_path", str(ckpt))

    checkpoint["rlhf_lightning"]["plugins"]["beta_controller"] = "rlhf_lightning_plugins.control.PIDBeta"  # moved, and another kind
    torch.save(checkpoint, ckpt)
    refused = run_cli(tmp_path / "refused", *resume)
    assert refused.returncode == 2
    assert (
        "model.beta_controller: checkpoint rlhf_lightning_plugins.control.PIDBeta, config rlhf_lightning_plugins.beta_controllers.BandBeta"
        in refused.stderr
    )

    checkpoint["rlhf_lightning"]["plugins"].update(OLD_PLUGINS)
    torch.save(checkpoint, ckpt)
    resumed = run_cli(tmp_path, "--trainer.limit_train_batches=3", "--trainer.max_epochs=2", "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"--ckpt_path last: {ckpt.relative_to(tmp_path)}" in resumed.stderr
    (log,) = tmp_path.glob("lightning_logs/*/version_1")
    assert sorted(read_scalars(str(log))["objective/beta"]) == [3, 4, 5]  # the second epoch's iterations, 0-based steps


def test_a_checkpoint_written_before_the_groups_resumes_and_names_changes_in_todays_spelling():
    """Checkpoints of 0.1 hold the module's settings flat (``lr``, ``ppo_epochs``, ``cpu_linear``): read as
    their grouped keys, the one that differs is logged as model.optim.lr, and the CPU settings, which left the
    module for the command's cpu section, are not compared."""
    from rlhf_lightning import checkpoints

    from helpers import make_module

    module = make_module()  # lr 3e-3, 2 epochs, 12 new tokens
    flat = {"policy": "tiny", "tokenizer": None, "critic": "separate", "seed": 0, "lr": 1e-3, "ppo_epochs": 2, "max_new_tokens": 12}
    resume = checkpoints.check_compatible(module, {**flat, "kl_penalty": "reward", "cpu_linear": "onednn"}, {})
    assert resume.changes == {"model.optim.lr": "model.optim.lr: 0.001 -> 0.003"}
    with pytest.raises(ValueError, match=r"model.lora.rank: checkpoint 4, config 0"):
        checkpoints.check_compatible(module, {**flat, "lora_rank": 4}, {})


def test_a_checkpoint_of_0_2_resumes_with_the_settings_0_3_folded_into_loading():
    """A checkpoint of 0.2 holds ``seed``, ``tiny_config`` and ``trust_remote_code`` at the top of its settings, the
    groups nested: read as model.loading's, the same values resume, and a changed seed of the tiny model (which
    defines its weights) is refused under today's key."""
    import dataclasses

    from rlhf_lightning import args, checkpoints

    from helpers import make_module

    module = make_module()
    saved = {"policy": "tiny", "tokenizer": None, "reference": None, "critic": "separate"}
    saved |= {name: dataclasses.asdict(getattr(module, name)) for name in args.GROUPS if name != "loading"}
    saved |= {"seed": 0, "tiny_config": None, "trust_remote_code": False}
    assert checkpoints.check_compatible(module, saved, {}).changes == {}
    with pytest.raises(ValueError, match=r"model.loading.seed: checkpoint 1, config 0"):
        checkpoints.check_compatible(module, {**saved, "seed": 1}, {})
