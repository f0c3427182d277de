"""Hostile inputs of the newest features (issue #65), through the command from a fresh folder: one test per class
that the tour (tools/studies/hostile_tour.py) found silent, unclear, late or crashing, and the runs that must lose
nothing (a kill -9 while the sampler draws, a resume with other settings).

The refusals before any model loads run the command in this process (``helpers.command``: loading a model is an
error there); what a run prints or writes runs the command as a user does (``helpers.cli``)."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlhf_lightning.module import PPORLHF
from rlhf_lightning_plugins.divergences import AlphaDivergence
from tools.studies.hostile_tour import QUICK
from tools.summarize_run import read_scalars

from helpers import CONFIGS, RUN_ARGS, cli, command, save_tiny_teacher

TINY = str(CONFIGS / "tiny.yaml")
# QUICK: two iterations of 4 prompts, 4 tokens each (the tour's): about 10 s on an idle 2-core machine; a run's
# timeout is 10x that.
TIMEOUT = 100
ASYNC = ("--model.sampling.old_logprobs=forward", "--model.off_policy.max_staleness=1")


def fit(tmp_path, *args: str):
    return cli(tmp_path, "fit", "--config", TINY, *QUICK, *args, timeout=TIMEOUT)


def run_cli(root, *args: str):
    """``helpers.RUN_ARGS``' 6 iterations with a checkpoint every 2 (about 15 s idle), ``args`` after them."""
    return cli(root, "fit", "--config", TINY, *RUN_ARGS, *args, timeout=150)


def start_up_warnings(tmp_path, monkeypatch, *args: str) -> list[str]:
    """The warnings ``rlhf-lightning fit --config configs/tiny.yaml <args>`` gives before any model loads (run in this
    process, in ``tmp_path``, loading a model the end of it)."""
    from rlhf_lightning.cli import main

    def no_models(self, empty=False):
        raise AssertionError("a model loaded")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(PPORLHF, "load_policy", no_models)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(AssertionError, match="a model loaded"):
        warnings.simplefilter("always")
        main(["fit", "--config", TINY, "--trainer.enable_progress_bar=false", *args])
    return [str(w.message) for w in caught]


def prompt_file(path, budget=1.0, ids="q"):
    """Eight prompts with ids ``q0``..``q7`` (``ids``: the prefix) and a KL budget column ``b``, ``budget`` on q3."""
    rows = [{"prompt": f"Write about the number {i}.", "id": f"{ids}{i}", "b": budget if i == 3 else 1.0} for i in range(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


BUDGETS = ("--model.beta_controller=per_prompt", "--data.train_path=p.jsonl", "--data.id_column=id")


# --- settings that nothing reads are said, never ignored


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model.off_policy.sampler_timeout_s=5", "--model.off_policy.correction=token"],
            "model.off_policy.sampler_timeout_s 5.0, model.off_policy.correction 'token' are not used with "
            "model.off_policy.max_staleness 0 (no sampler runs ahead)",
        ),
        (
            [*ASYNC, "--model.off_policy.correction=none", "--model.off_policy.correction_cap=3"],
            "model.off_policy.correction_cap 3.0 is not used with model.off_policy.correction none",
        ),
        (["--model.sampling.explore_iterations=5"], "model.sampling.explore_iterations 5 is not used with model.sampling.explore 0"),
    ],
    ids=["async-without-staleness", "cap-without-correction", "explore-iterations-without-explore"],
)
def test_a_setting_nothing_reads_is_named_at_start_up(tmp_path, monkeypatch, args, message):
    warned = start_up_warnings(tmp_path, monkeypatch, *args)
    assert any(m.startswith(message) for m in warned), warned
    assert not any("is not used" in m or "are not used" in m for m in start_up_warnings(tmp_path, monkeypatch, *ASYNC))


# --- the KL recipes that are biased or inert warn at start-up, through the command


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model.kl_estimator=k3+", "--model.kl.placement=both"],
            "model.kl_estimator StraightThroughKL with model.kl.placement both, model.kl.loss_weighting importance gives a biased "
            "gradient of the KL: its gradient is not the derivative of its value (a straight-through estimator",
        ),
        (
            ["--model.kl_estimator=k3+", "--model.kl.placement=loss", "--model.kl.loss_weighting=none"],
            "model.kl_estimator StraightThroughKL in the loss with model.kl.loss_weighting none is right only on a rollout's first minibatch: "
            "with model.ppo.epochs 4 x model.ppo.num_minibatches 2",
        ),
    ],
    ids=["straight-through-in-both", "unweighted-over-epochs"],
)
def test_a_biased_kl_recipe_warns_through_the_command(tmp_path, monkeypatch, args, message):
    warned = start_up_warnings(tmp_path, monkeypatch, *args)
    assert any(m.startswith(message) for m in warned), warned


# --- numbers at the edge of float64 that would make the regulariser vanish or overflow


def test_an_alpha_near_0_keeps_the_penalty_of_the_reverse_kl():
    """f'(u) = (1 - u^(-alpha)) / alpha -> log u as alpha -> 0: at alpha 1e-300 the difference 1 - u^(-alpha) is 0 in
    float64 (the penalty was exactly 0); with expm1 it is -alpha log u, so f'(u) = log u, f(u) = u log u - u + 1."""
    log_u = torch.tensor([-3.0, -0.5, 0.0, 0.7, 4.0], dtype=torch.float64)
    tiny = AlphaDivergence(1e-300)
    assert torch.equal(tiny.f_prime(log_u), log_u)
    torch.testing.assert_close(tiny.f(log_u), log_u.exp() * log_u - log_u.exp() + 1, rtol=1e-15, atol=1e-15)
    assert torch.equal(tiny.log_f_prime_inverse(log_u), log_u)
    half = AlphaDivergence(0.5)  # by hand: f'(e^4) = 2 (1 - e^-2) = 1.7293294335267746; f(e^4) = 4 (e^2 - 1) - e^4 ... / ...
    assert half.f_prime(torch.tensor([4.0], dtype=torch.float64)).item() == pytest.approx(2 * (1 - math.exp(-2)), rel=1e-15)
    u = math.exp(4.0)
    assert half.f(torch.tensor([4.0], dtype=torch.float64)).item() == pytest.approx((u**0.5 - 0.5 * u - 0.5) / (0.5 * -0.5), rel=1e-14)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model.beta_controller.init_args.init_beta=1e300"],
            "model.beta_controller.init_args.init_beta must be a finite number in [0, 3e+38], got 1e+300",
        ),
        (
            ["--model.beta_controller.init_args.init_beta=1e-320"],
            "model.beta_controller.init_args.init_beta must be 0 or at least 1e-37 (below, beta is 0 in the float32 reward: the "
            "regulariser vanishes unsaid), got 1e-320",
        ),
        (
            ["--model.divergence=alpha", "--model.divergence.init_args.alpha=1e300"],
            "model.divergence.init_args.alpha must be a finite number in [-100.0, 100.0], got 1e+300",
        ),
        (
            ["--model.divergence=alpha", "--model.divergence.init_args.alpha=1e-320"],
            "model.divergence.init_args.alpha must be at least 2.22507e-308 in size, float64's smallest normal number",
        ),
        (
            ["--model.beta_controller=adaptive", "--model.beta_controller.init_args.target=1e-320"],
            "model.beta_controller.init_args.target must be a finite number in [1e-37, 3e+38], got 1e-320",
        ),
        (
            [*BUDGETS, "--data.batch_size=4", "--model.beta_controller.init_args.budget_column=b", "--files.budget=1e-320"],
            "data.train_path: prompt file 'p.jsonl', line 4: the KL budget in column 'b' (model.beta_controller.init_args.budget_column) "
            "must be a finite number in [1e-37, 3e+38] nats, got 1e-320",
        ),
        (
            [*BUDGETS, "--data.batch_size=4", "--model.beta_controller.init_args.budget_column=b", "--files.budget=1e308"],
            "data.train_path: prompt file 'p.jsonl', line 4: the KL budget in column 'b' (model.beta_controller.init_args.budget_column) "
            "must be a finite number in [1e-37, 3e+38] "
            "nats, got 1e+308",
        ),
        (
            ["--model.beta_controller=adaptive", "--model.beta_controller.init_args.horizon=1"],
            "model.beta_controller.init_args.horizon must be > 3.2, 0.2 x the 16 responses that one update counts (a step beta x "
            "(1 - 0.2 x 16 / horizon) leaves beta at or below 0), got 1.0",
        ),
        (
            [*BUDGETS, "--data.batch_size=4", "--model.beta_controller.init_args.horizon=1e-300", "--model.sampling.num_generations=2"],
            "model.beta_controller.init_args.horizon must be > 0.4, 0.2 x the 2 responses of one prompt that an update of its beta counts",
        ),
    ],
    ids=[
        "init-beta-1e300",
        "init-beta-1e-320",
        "alpha-1e300",
        "alpha-1e-320",
        "target-1e-320",
        "budget-1e-320",
        "budget-1e308",
        "horizon-below-a-batch",
        "per-prompt-horizon-1e-300",
    ],
)
def test_a_regulariser_that_would_vanish_or_overflow_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys, args, message):
    budget = [float(a.split("=")[1]) for a in args if a.startswith("--files.budget=")]
    prompt_file(tmp_path / "p.jsonl", *budget)
    code, line = command(tmp_path, monkeypatch, capsys, *[a for a in args if not a.startswith("--files.")])
    assert code == 2 and line.startswith("error: " + message), line


def test_a_beta_whose_penalty_overflows_the_reward_is_a_fault_naming_it():
    """beta 3e38 is float32's, but beta * kl_t of a KL above 1.13 nats is not: a fault naming the penalty, the responses
    and beta (the iteration is skipped, weights untouched), never an inf reward."""
    from rlhf_lightning.args import KLArgs
    from rlhf_lightning.regulariser import Regulariser
    from rlhf_lightning_plugins.divergences import ReverseKL
    from rlhf_lightning_plugins.kl_estimators import K1

    regulariser = Regulariser(K1(), ReverseKL(), KLArgs(), torch.tensor([], dtype=torch.long))
    kl = torch.tensor([[0.5, 0.1], [2.0, 0.0]])  # (batch, response_len)
    betas = torch.tensor([3e38, 3e38], dtype=torch.float64)
    assert regulariser.nonfinite(kl, None, betas) == (
        "the penalty beta * kl_t is not finite in the reward's torch.float32 for responses [1]: KL [2.0] (beta 3e+38)"
    )
    assert regulariser.nonfinite(kl, None, torch.tensor([1e30, 1e30], dtype=torch.float64)) is None


# --- non-finite weights never reach the sampler


def test_a_policy_checkpoint_with_nan_weights_is_refused_at_load(tmp_path):
    folder = save_tiny_teacher(tmp_path / "nan_policy")
    tensors = load_file(f"{folder}/model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    result = fit(tmp_path, f"--model.policy={folder}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: model.policy and model.reference must be checkpoints of finite weights (a nan or inf weight makes every log-prob "
            "the sampler draws with nan), got 'non-finite weights in policy model.layers.1.mlp.up_proj.weight, critic "
            "trunk.layers.1.mlp.up_proj.weight (2 of 43 tensors)'"
        )
    )
    assert not (tmp_path / "lightning_logs" / "tiny" / "version_0" / "checkpoints").exists()


def test_weights_an_update_overflows_stop_before_the_sampler_draws_from_them(tmp_path):
    """lr 1e300 is a finite number, but the first AdamW step (about lr per weight) is inf in float32: the run stops
    after that update, naming the weights and the learning rate, before the next rollout (no sampler error on nan)."""
    result = fit(tmp_path, "--model.optim.lr=1e300", "--trainer.limit_train_batches=3")
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the weights are not finite after this iteration's update: policy model.")
    assert (
        "though every loss was finite: a gradient or an optimizer step overflowed them; lower model.optim.lr (policy 1e+300, critic 1e+300)"
        in last
    )
    assert "probability tensor" not in result.stderr


# --- a path that is not a model is named as such


@pytest.mark.parametrize(
    "files, args, message",
    [
        (
            {"notes.txt": "hi"},
            ["--model.reference=notes.txt"],
            "model.reference must be a built-in model (smollm2), a local checkpoint "
            "folder or a .gguf file, got 'notes.txt': a file that is not a .gguf file",
        ),
        (
            {"folder/readme.md": "hi"},
            ["--model.policy=folder"],
            "model.tokenizer (or model.policy where it is unset) 'folder' holds no tokenizer that loads (",
        ),
        (
            {"tok/.keep": ""},
            ["--model.reference=tok"],
            "model.reference must be a built-in model (smollm2), a local checkpoint folder "
            "or a .gguf file, got 'tok (a folder without config.json)'",
        ),
    ],
    ids=["reference-a-text-file", "policy-a-folder-of-text", "reference-without-config"],
)
def test_a_path_that_is_not_a_model_is_named_before_any_model_loads(tmp_path, monkeypatch, capsys, files, args, message):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    if "tok/.keep" in files:  # a tokenizer, but no weights' config beside it
        from rlhf_lightning.models import char_tokenizer

        char_tokenizer().save_pretrained(tmp_path / "tok")
    code, line = command(tmp_path, monkeypatch, capsys, *args)
    assert code == 2 and line.startswith("error: " + message), line


# --- malformed prompt files: bytes that are no text are named, a byte-order mark is not a prompt's first character


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("p.txt", "".join(f"prompt {i}\x00x\n" for i in range(8)), "line 1: the prompt in column 'prompt' holds '\\x00' at character 8"),
        (
            "p.jsonl",
            "".join(json.dumps({"prompt": f"number {i}"}) + "\n" for i in range(7)) + '{"prompt": "half \\ud800"}\n',
            "line 8: "
            "the prompt in column 'prompt' holds '\\ud800' at character 5, which is no text (a control character, or half of a UTF-16 "
            "pair escaped in JSON)",
        ),
        ("p.txt", "".join(f"red {i}\x1b[31m\n" for i in range(8)), "line 1: the prompt in column 'prompt' holds '\\x1b' at character 5"),
    ],
    ids=["nul-bytes", "lone-surrogate", "terminal-escapes"],
)
def test_a_prompt_that_is_no_text_is_named_before_any_model_loads(tmp_path, monkeypatch, capsys, name, content, message):
    (tmp_path / name).write_text(content, encoding="utf-8", errors="surrogatepass")
    code, line = command(tmp_path, monkeypatch, capsys, f"--data.train_path={name}", "--data.batch_size=4")
    assert code == 2 and line.startswith(f"error: data.train_path: prompt file '{name}', " + message), line


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path, monkeypatch):
    """A csv saved by a Windows editor starts with U+FEFF: read as UTF-8 with a signature, its header is ``prompt``."""
    (tmp_path / "p.csv").write_bytes(("\ufeffprompt,id\n" + "".join(f"Say {i},{i}\n" for i in range(8))).encode("utf-8"))
    start_up_warnings(tmp_path, monkeypatch, "--data.train_path=p.csv", "--data.batch_size=4")  # reaches the model: read


def test_more_threads_than_the_machine_can_start_are_refused(tmp_path, monkeypatch, capsys):
    """cpu.threads 100000 was a segmentation fault (exit -11) in the OpenMP runtime."""
    code, line = command(tmp_path, monkeypatch, capsys, "--cpu.threads=100000")
    assert code == 2
    assert re.fullmatch(
        r"error: cpu.threads must be null or an integer in \[1, (\d+)\] \(8 x the (\d+) cores this process may use: more threads "
        r"than cores only wait on each other\), got 100000",
        line,
    ), line


# --- a settings group left empty in YAML (every line under it commented out reads as null)


@pytest.mark.parametrize(
    "yaml, empty",
    [
        ("model:\n  off_policy:\n    # max_staleness: 2\n", "model.off_policy is"),
        ("model:\n  sampling:\n", "model.sampling is"),
        ("model:\n", "model is"),
        ("trainer:\ncpu:\n", "trainer, cpu are"),
        ("model:\n  beta_controller:\n    class_path: adaptive\n    init_args:\n", "model.beta_controller.init_args is"),
    ],
    ids=["off_policy", "sampling", "model", "trainer-and-cpu", "init_args"],
)
def test_a_group_left_empty_in_yaml_is_named(tmp_path, monkeypatch, capsys, yaml, empty):
    """Was a TypeError ("argument after ** must be a mapping, not NoneType"), jsonargparse's "Unexpected config: model:",
    or (model.sampling) silently nothing."""
    (tmp_path / "extra.yaml").write_text(yaml)
    code, line = command(tmp_path, monkeypatch, capsys, "--config", "extra.yaml")
    assert (code, line) == (
        2,
        f"error: --config extra.yaml: {empty} empty: a group takes its settings under it; write {{}} for its defaults, or leave the key out",
    )


def test_a_group_written_as_an_empty_mapping_is_its_defaults(tmp_path, monkeypatch):
    (tmp_path / "extra.yaml").write_text("model:\n  off_policy: {}\n")
    start_up_warnings(tmp_path, monkeypatch, "--config", "extra.yaml")  # reaches the model: accepted


# --- resumes: every changed setting logged, nothing lost


def test_a_resume_with_another_engine_and_staleness_logs_both_and_goes_on(tmp_path):
    """Stopped by SIGTERM after iteration 3 with the sampler ahead (last.ckpt of iteration 3), resumed with the sampler
    in line (max_staleness 0) on an engine of another kind, with another divergence: each change logged, iterations 4..6 run."""
    stop = ("--trainer.callbacks+=fault_callbacks.SignalMidIteration", "--trainer.callbacks.iteration=3")
    first = run_cli(tmp_path, *ASYNC, *stop)
    assert first.returncode == 143, first.stderr[-3000:]
    resumed = run_cli(
        tmp_path,
        "--model.sampling.old_logprobs=forward",
        "--model.rollout_engine=hostile_plugins.RenamedHF",
        "--model.divergence=js",
        "--ckpt_path",
        "last",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (line,) = [line for line in resumed.stderr.splitlines() if "resuming with changed settings" in line]
    assert "model.off_policy.max_staleness: 1 -> 0" in line and "model.rollout_engine: HFGenerate -> RenamedHF" in line, line
    assert "model.divergence: ReverseKL -> JensenShannon" in line, line
    assert list(read_scalars(str(tmp_path / "lightning_logs" / "tiny" / "version_1"))["objective/kl"]) == [3, 4, 5]


def test_kill_9_while_the_sampler_draws_loses_nothing_and_the_resume_goes_on(tmp_path):
    """SIGKILL at iteration 4's first optimizer step, while the sampler thread draws iteration 5's batch: last.ckpt of
    iteration 2 is whole, and ``--ckpt_path last`` runs iterations 3..6."""
    killed = run_cli(tmp_path, *ASYNC, "--trainer.callbacks+=fault_callbacks.KillMidIteration", "--trainer.callbacks.iteration=3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    last = tmp_path / "lightning_logs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["rlhf_lightning"]["iteration"] == 2
    resumed = run_cli(tmp_path, *ASYNC, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert list(read_scalars(str(tmp_path / "lightning_logs" / "tiny" / "version_1"))["objective/kl"]) == [2, 3, 4, 5]


def test_a_resume_on_prompts_without_the_controllers_ids_warns_naming_them(tmp_path):
    prompt_file(tmp_path / "p.jsonl")
    budgets = (*BUDGETS, "--data.batch_size=4", "--model.beta_controller.init_args.horizon=8", "--trainer.limit_train_batches=2")
    first = run_cli(tmp_path, *budgets)
    assert first.returncode == 0, first.stderr[-3000:]
    same = run_cli(tmp_path, *budgets, "--ckpt_path", "last")  # the ids it was trained with: nothing to say
    assert same.returncode == 0 and "prompt ids" not in same.stderr, same.stderr[-3000:]
    prompt_file(tmp_path / "p.jsonl", ids="r")  # the same texts under other ids
    resumed = run_cli(tmp_path, *budgets, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "resuming: 8 of the 8 prompt ids model.beta_controller PromptBudgetBeta keyed its betas by in the checkpoint are not in "
        "data.train_path ('q"
    ) in resumed.stderr
    assert "and 8 of the file's 8 prompts start from beta " in resumed.stderr


def test_a_strategy_is_a_registered_name_or_a_class_and_nothing_else(tmp_path, monkeypatch, capsys):
    """``--trainer.strategy=DDPStrategy`` without init_args reaches the Trainer as the string 'DDPStrategy' (jsonargparse),
    which Lightning refused with a traceback: it is that class with its defaults; a misspelling is named with the choices."""
    from lightning.pytorch.strategies import DDPStrategy

    from rlhf_lightning.cli import strategy_setting

    assert strategy_setting("ddp") == "ddp" and strategy_setting("auto") == "auto"
    assert type(strategy_setting("DDPStrategy")) is DDPStrategy
    code, line = command(tmp_path, monkeypatch, capsys, "--trainer.strategy=DDPSstrategy")
    assert code == 2 and line.startswith("error: trainer.strategy: 'DDPSstrategy' is no strategy; choose a registered name (auto, ddp,"), (
        line
    )
    assert "DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy" in line, line
