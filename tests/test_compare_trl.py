"""tools/benchmarks/compare_trl.py without TRL: the ratios it prints, and the config our side runs (the
options a user would set reach ``model:``)."""

from __future__ import annotations

import argparse

import pytest

from tools.benchmarks import compare_trl


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
    config = compare_trl.our_config(args)
    model = config["model"]
    assert (config["cpu"], model["sampling"]["old_logprobs"]) == ({"linear": "aten", "malloc": "default"}, "forward")
    assert model["ppo"]["epochs"] == 4 and model["sampling"]["min_new_tokens"] == model["sampling"]["max_new_tokens"] == 32
    assert (model["lora"]["rank"], model["critic"]) == ((16, "shared") if setup == "lora" else (0, "separate"))
    assert model["reward_model"]["init_args"] == {"path": "rm", "chat_template": True}  # the conversation, as TRL's reward reads
    unset = argparse.Namespace(**{**vars(args), "cpu_linear": None, "cpu_malloc": None, "old_logprobs": None})
    defaults = compare_trl.our_config(unset)
    assert "cpu" not in defaults and "old_logprobs" not in defaults["model"]["sampling"]  # unset: the defaults


def test_grpo_rows_are_compared_with_trls_grpo_and_the_line_gives_time_and_cpu_ratios():
    results = [
        {"setup": "trl_grpo", "ppo_epochs": 1, "seconds": [40.0], "phases": {"cpu": [20.0]}, "peak_rss_mb": 5000.0, "passes": {}},
        {"setup": "grpo", "ppo_epochs": 1, "seconds": [18.0], "phases": {"cpu": [9.0]}, "peak_rss_mb": 4000.0, "passes": {}},
        {"setup": "trl_grpo", "ppo_epochs": 2, "seconds": [80.0], "phases": {"cpu": [40.0]}, "peak_rss_mb": 5000.0, "passes": {}},
        {"setup": "grpo", "ppo_epochs": 2, "seconds": [30.0], "phases": {"cpu": [16.0]}, "peak_rss_mb": 4000.0, "passes": {}},
        {"setup": "trl", "ppo_epochs": 1, "seconds": [10.0], "peak_rss_mb": 7000.0},  # PPO's TRL: not GRPO's peer
    ]
    rows = compare_trl.summarise(results)
    # 18 / 40 = 0.45 and 30 / 80 = 0.375 in time; 9 / 20 = 0.45 and 16 / 40 = 0.4 in CPU seconds.
    assert compare_trl.format_table(rows).splitlines()[-1] == "COMPARE_GRPO ratio_1=0.450 ratio_2=0.375 cpu_ratio_1=0.450 cpu_ratio_2=0.400"


def test_grpo_config_is_configs_grpo_yaml_on_the_workload(tmp_path):
    args = compare_trl.parse_args(["--grpo", "--beta", "0.04", "--cpu-linear", "aten"])
    assert args.setups == ["trl_grpo", "grpo"] and args.ppo_epochs == [1, 2]
    args.worker, args.workdir, args.epochs, args.reward_path = "grpo", str(tmp_path), 2, "rm"
    config = compare_trl.our_config(args)
    model = config["model"]
    # From configs/grpo.yaml: GRPO's group advantages, no critic, k3 as a loss term.
    assert (model["advantage_estimator"], model["critic"], model["kl_estimator"], model["kl"]["placement"]) == (
        "grpo",
        "none",
        "k3",
        "loss",
    )
    # The workload: full fine-tuning as TRL's GRPOTrainer without PEFT, 4 generations of exactly 32 tokens
    # for each of 8 prompts, 2 updates of one minibatch, TRL's beta held fixed, the kernel chosen.
    sampling = model["sampling"]
    assert model["lora"]["rank"] == 0 and sampling["num_generations"] == 4 and config["data"]["batch_size"] == 8
    assert sampling["min_new_tokens"] == sampling["max_new_tokens"] == 32 and (model["ppo"]["epochs"], model["ppo"]["num_minibatches"]) == (
        2,
        1,
    )
    assert model["beta_controller"] == {"class_path": "fixed", "init_args": {"init_beta": 0.04}} and config["cpu"]["linear"] == "aten"
    assert model["reward_model"]["init_args"] == {"path": "rm", "chat_template": True}
    with pytest.raises(SystemExit):
        compare_trl.parse_args(["--grpo", "--setups", "lora"])  # a PPO setup has no GRPO peer


def test_max_staleness_adds_the_asynchronous_grpo_run_compared_with_trls(tmp_path):
    """``--grpo --max-staleness 1``: a third setup, ours with the sampler one update ahead (and the PPO ratio at the
    current weights), its time over TRL's on the last line; the config is grpo's otherwise."""
    args = compare_trl.parse_args(["--grpo", "--max-staleness", "1"])
    assert args.setups == ["trl_grpo", "grpo", "grpo_async"]
    args.worker, args.workdir, args.epochs, args.reward_path = "grpo_async", str(tmp_path), 1, "rm"
    model = compare_trl.our_config(args)["model"]
    assert model["off_policy"] == {"max_staleness": 1} and model["sampling"]["old_logprobs"] == "forward"
    args.worker = "grpo"
    assert "off_policy" not in compare_trl.our_config(args)["model"]
    results = [
        {"setup": "trl_grpo", "ppo_epochs": 1, "seconds": [40.0], "phases": {"cpu": [20.0]}, "peak_rss_mb": 5000.0},
        {"setup": "grpo", "ppo_epochs": 1, "seconds": [18.0], "phases": {"cpu": [9.0]}, "peak_rss_mb": 4000.0},
        {"setup": "grpo_async", "ppo_epochs": 1, "seconds": [14.0], "phases": {"cpu": [11.0]}, "peak_rss_mb": 4500.0},
    ]
    line = compare_trl.format_table(compare_trl.summarise(results)).splitlines()[-1]
    assert line == "COMPARE_GRPO ratio_1=0.450 cpu_ratio_1=0.450 async_ratio_1=0.350"  # 14 / 40
    with pytest.raises(SystemExit):
        compare_trl.parse_args(["--grpo", "--setups", "grpo_async"])  # without --max-staleness
