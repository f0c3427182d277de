"""Every tool in tools/ and its folders checks its arguments as the command checks its settings: 0 where at least
1 is needed, negative, NaN and inf numbers, and missing or empty folders and files end in argparse's
exit status 2 with a line naming the option (tools/_cli_args.py: ``option_number``, ``log_folder``,
``existing_file``), before any work starts."""

from __future__ import annotations

import importlib
import sys

import pytest

# Each tool's module, run as ``python -m <module>`` from the repository root.
MODULES = {
    "bench": "tools.benchmarks.bench",
    "compare_controllers": "tools.studies.compare_controllers",
    "compare_trl": "tools.benchmarks.compare_trl",
    "decode_bench": "tools.benchmarks.decode_bench",
    "gao_fit": "tools.studies.gao_fit",
    "kl_estimator_report": "tools.studies.kl_estimator_report",
    "kl_frontier": "tools.studies.kl_frontier",
    "length_bias": "tools.studies.length_bias",
    "make_arithmetic_prompts": "tools.make_arithmetic_prompts",
    "matmul_bench": "tools.benchmarks.matmul_bench",
    "optimum_check": "tools.studies.optimum_check",
    "regulariser_frontier": "tools.studies.regulariser_frontier",
    "reward_hacking_report": "tools.studies.reward_hacking_report",
    "summarize_run": "tools.summarize_run",
    "sweep_beta": "tools.studies.sweep_beta",
    "train_reward_model": "tools.train_reward_model",
}
TOOLS = tuple(MODULES)
# One count (at least 1) and one real-valued option per tool, and the arguments it needs besides.
COUNT = {
    "bench": "--iters",
    "compare_controllers": "--iterations",
    "compare_trl": "--iters",
    "decode_bench": "--rounds",
    "gao_fit": "--blocks",
    "kl_estimator_report": "--samples",
    "kl_frontier": "--iterations",
    "length_bias": "--iterations",
    "make_arithmetic_prompts": "--train",
    "matmul_bench": "--tokens",
    "optimum_check": "--iterations",
    "regulariser_frontier": "--iterations",
    "reward_hacking_report": "--iterations",
    "summarize_run": "--every",
    "sweep_beta": "--iterations",
    "train_reward_model": "--epochs",
}
REAL = {
    "compare_controllers": ("--target", "a finite number > 0"),
    "kl_estimator_report": ("--offpolicy-lr", "a finite number > 0"),
    "kl_frontier": ("--betas", "a finite number > 0"),
    "length_bias": ("--reward", "a finite number"),
    "optimum_check": ("--beta", "a finite number > 0"),
    "regulariser_frontier": ("--betas", "a finite number > 0"),
    "sweep_beta": ("--betas", "a finite number >= 0"),
    "train_reward_model": ("--temperature", "a finite number > 0"),
}


def run_tool(monkeypatch, capsys, tool: str, *argv: str) -> tuple[int, str]:
    """``python -m tools.[benchmarks. or studies.]<tool> <argv>`` in this process: its exit status and last line on stderr."""
    module = importlib.import_module(MODULES[tool])
    monkeypatch.setattr(sys, "argv", [MODULES[tool], *argv])
    with pytest.raises(SystemExit) as stopped:
        module.main()
    return stopped.value.code, capsys.readouterr().err.strip().splitlines()[-1]


def needed(tool: str, tmp_path) -> tuple[str, ...]:
    """Positional arguments a tool cannot run without: a logged run's folder."""
    if tool in ("summarize_run", "gao_fit"):
        run = tmp_path / "run"
        run.mkdir(exist_ok=True)
        (run / "events.out.tfevents.0").write_bytes(b"")
        return (f"a={run}",) if tool == "gao_fit" else (str(run),)
    return ()


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "2.5", "many"])
@pytest.mark.parametrize("tool", TOOLS)
def test_a_count_that_is_not_a_positive_integer_is_refused_naming_the_option(monkeypatch, capsys, tmp_path, tool, value):
    option = COUNT[tool]
    code, line = run_tool(monkeypatch, capsys, tool, *needed(tool, tmp_path), f"{option}={value}")
    assert code == 2
    shown = repr(value) if value in ("2.5", "nan", "inf", "many") else value
    assert line.endswith(f"error: argument {option}: must be an integer >= 1, got {shown}"), line


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1"])
@pytest.mark.parametrize("tool", sorted(REAL))
def test_a_real_option_that_is_not_finite_or_out_of_range_is_refused_naming_it(monkeypatch, capsys, tmp_path, tool, value):
    option, requirement = REAL[tool]
    if value == "-1" and requirement == "a finite number":
        value = "nan"  # a constant reward may be negative
    code, line = run_tool(monkeypatch, capsys, tool, f"{option}={value}")
    assert code == 2
    assert line.endswith(f"error: argument {option}: must be {requirement}, got {float(value)!r}"), line


@pytest.mark.parametrize("tool", ["summarize_run", "gao_fit"])
def test_a_missing_or_empty_run_folder_is_refused_naming_it(monkeypatch, capsys, tmp_path, tool):
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder, problem in ((tmp_path / "nope", "does not exist"), (empty, "holds no TensorBoard event files")):
        code, line = run_tool(monkeypatch, capsys, tool, f"a={folder}" if tool == "gao_fit" else str(folder))
        assert code == 2
        assert f"folder {str(folder)!r} {problem}" in line, line
        assert ("argument label=log_dir" if tool == "gao_fit" else "argument log_dir") in line, line


@pytest.mark.parametrize(
    "tool, option", [("sweep_beta", "--config"), ("reward_hacking_report", "--config"), ("train_reward_model", "--prompts")]
)
def test_a_missing_file_is_refused_naming_the_option(monkeypatch, capsys, tmp_path, tool, option):
    code, line = run_tool(monkeypatch, capsys, tool, f"{option}={tmp_path / 'nope.yaml'}")
    assert code == 2
    assert line.endswith(f"error: argument {option}: file {str(tmp_path / 'nope.yaml')!r} does not exist"), line
