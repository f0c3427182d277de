"""tools/compare_trl.py without TRL: the ratios it prints, and the config our side runs (the
options a user would set reach ``model:``)."""

from __future__ import annotations

import argparse

import pytest

import compare_trl


def test_summary_is_the_median_over_all_rounds_and_its_ratio_to_trl_with_the_same_epochs():
    results = [
        {"setup": "trl", "ppo_epochs": 1, "seconds": [10.0, 12.0], "peak_rss_mb": 7000.0},
        {"setup": "trl", "ppo_epochs": 1, "seconds": [14.0], "peak_rss_mb": 7100.0},  # a second round
        {"setup": "full", "ppo_epochs": 1, "seconds": [6.0, 9.0, 7.0], "peak_rss_mb": 6000.0},
        {"setup": "lora", "ppo_epochs": 4, "seconds": [5.0], "peak_rss_mb": 3000.0},  # no TRL run with 4 epochs
    ]
    rows = {(r["setup"], r["ppo_epochs"]): r for r in compare_trl.summarise(results)}
    # TRL: median of 10, 12, 14 = 12 over both rounds; full: median of 6, 9, 7 = 7, so 7 / 12.
    assert rows["trl", 1]["median_s"] == 12.0 and rows["trl", 1]["n"] == 3 and rows["trl", 1]["peak_rss_mb"] == 7100.0
    assert rows["full", 1]["vs_trl"] == pytest.approx(7 / 12)
    assert rows["lora", 4]["vs_trl"] != rows["lora", 4]["vs_trl"]  # nan: nothing to compare with
    assert compare_trl.format_table(list(rows.values())).splitlines()[-1] == "COMPARE full_1=0.583 lora_4=nan"


@pytest.mark.parametrize("setup", ["full", "lora"])
def test_our_config_carries_the_setup_and_the_chosen_options(tmp_path, setup):
    args = compare_trl.parse_args(["--cpu-linear", "aten", "--cpu-malloc", "default", "--old-logprobs", "forward"])
    args.worker, args.workdir, args.epochs, args.reward_path = setup, str(tmp_path), 4, "rm"
    model = compare_trl.our_config(args)["model"]
    assert (model["cpu_linear"], model["cpu_malloc"], model["old_logprobs"]) == ("aten", "default", "forward")
    assert model["ppo_epochs"] == 4 and model["min_new_tokens"] == model["max_new_tokens"] == 32
    assert (model["lora_rank"], model["critic"]) == ((16, "shared") if setup == "lora" else (0, "separate"))
    unset = argparse.Namespace(**{**vars(args), "cpu_linear": None, "cpu_malloc": None, "old_logprobs": None})
    defaults = compare_trl.our_config(unset)["model"]
    assert not {"cpu_linear", "cpu_malloc", "old_logprobs"} & set(defaults)  # unset: the module's own defaults
