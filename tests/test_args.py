"""Start-up warnings and refusals for combinations that are legal but biased, or that cannot learn:
the KL recipes from the one table in the code (``recipes.kl_recipe``), checked against the docs'
matrix; group estimators without sampling; clip ranges that remove the lower clip; numeric extremes
named by the field the user wrote."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from rlhf_lightning import args
from rlhf_lightning.module import PPORLHF
from rlhf_lightning.recipes import kl_recipe
from rlhf_lightning.registry import registry

from helpers import CONFIGS, char_reward, command

DOCS = Path(__file__).resolve().parents[1] / "docs"


def start_up_warnings(**settings) -> list[str]:
    """The warnings PPORLHF gives at construction (before any model loads) with ``settings``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PPORLHF(**args.merge_settings(dict(policy="tiny", reward_model=char_reward()), settings))
    return [str(w.message) for w in caught]


def docs_matrix() -> list[tuple[str, str, str, str]]:
    """(estimator, placement, weighting, class) of every row of docs/kl-estimators.md's measured matrix."""
    rows = []
    for line in (DOCS / "kl-estimators.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1] in ("reward", "loss", "both"):
            rows.append((cells[0], cells[1], cells[2] or "n/a", cells[5].split(" (")[0]))
    return rows


def test_the_docs_matrix_is_the_code_table():
    """Every class the docs' measured matrix gives (25 cells: 5 estimators x reward, loss, both x
    none, importance) is the one ``recipes.kl_recipe`` gives: the docs cannot drift from the warnings."""
    rows = docs_matrix()
    assert len(rows) == 25 and {r[3] for r in rows} == {"unbiased", "biased", "drift", "high_variance"}
    assert {r[:3]: kl_recipe(registry("kl_estimator").create(r[0]), *r[1:3])[0] for r in rows} == {r[:3]: r[3] for r in rows}


def test_the_advantage_docs_kl_in_the_loss_table_is_the_code_table():
    """docs/advantages-and-losses.md's KL-in-the-loss table (critic-free estimator x k1/k3 x weighting):
    each cell's class is tools/studies/optimum_check/matrix.py's expected class (recipes.kl_recipe, and grpo's std), and
    PPORLHF warns at start-up exactly for the cells it calls biased."""
    from tools.studies.optimum_check.matrix import expected_class

    columns = [("k1", "importance"), ("k3", "importance"), ("k1", "none"), ("k3", "none")]
    cells = {}
    for line in (DOCS / "advantages-and-losses.md").read_text().splitlines():
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(row) == 5 and row[0].strip("`") in ("rloo", "dr_grpo", "reinforce_pp", "grpo") and "(" in row[1]:
            for (estimator, weighting), cell in zip(columns, row[1:], strict=True):
                cells[(row[0].strip("`"), estimator, weighting)] = cell.split()[-1]
    assert len(cells) == 16 and set(cells.values()) == {"unbiased", "biased"}, cells
    for (advantage, estimator, weighting), documented in cells.items():
        assert expected_class(estimator, "loss", weighting, "sequence", advantage) == documented, (advantage, estimator, weighting)
        settings = dict(advantage_estimator=advantage, num_generations=4, kl_estimator=estimator, kl_penalty="loss")
        messages = start_up_warnings(**settings, kl_loss_weighting=weighting)
        warned = [m for m in messages if "converges away from the KL-regularised optimum" in m]
        assert bool(warned) == (documented == "biased"), (advantage, estimator, weighting, messages)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "k3+", "k1+", "full", "abs"])
def test_every_biased_kl_recipe_warns_at_start_up_and_no_other_does(estimator):
    """Each registered estimator in each placement and weighting: a warning naming the estimator,
    the placement and why, exactly where the table says biased (and one of drift exactly where it says
    drift and the rollout is reused) (the docs: reward k3, loss k1 unweighted,
    k2 or k3+ weighted, any straight-through estimator in 'both', ...)."""
    for placement in ("reward", "loss", "both"):
        for weighting in ("none", "importance") if placement != "reward" else ("importance",):
            scope = "per_token" if estimator in ("k2", "abs") and placement == "loss" else "sequence"  # k2, abs: no sequence scope
            settings = dict(kl_estimator=estimator, kl_penalty=placement, kl_loss_weighting=weighting, kl_loss_scope=scope)
            if placement != "reward":
                settings["whiten_advantages"] = False
            warned = start_up_warnings(**settings)
            messages = [m for m in warned if "gives a biased gradient of the KL" in m]
            recipe, reason = kl_recipe(registry("kl_estimator").create(estimator), placement, weighting, scope)
            assert len(messages) == (recipe == "biased"), (placement, weighting, messages)
            if messages:
                assert messages[0].startswith(f"model.kl_estimator {type(registry('kl_estimator').create(estimator)).__name__} ")
                assert f"model.kl.placement {placement}" in messages[0] and reason in messages[0]
            noisy = [m for m in warned if "with no baseline" in m]
            assert len(noisy) == (recipe == "high_variance"), (placement, weighting, noisy)
            drifting = [m for m in warned if "is right only on a rollout's first minibatch" in m]
            assert len(drifting) == (recipe == "drift"), (placement, weighting, drifting)  # 4 PPO epochs by default
            if recipe == "drift":  # one epoch of one minibatch: always on-policy, nothing to warn of
                assert "with model.ppo.epochs 4 x model.ppo.num_minibatches 1 the later steps" in drifting[0], drifting
                one_step = [m for m in start_up_warnings(**settings, ppo_epochs=1) if "first minibatch" in m]
                assert one_step == [], one_step


def test_the_recipe_table_names_why():
    """The reasons, by hand: k3 in the reward, k1 unweighted in the loss, k3+ weighted, k2 weighted."""
    create = registry("kl_estimator").create
    assert kl_recipe(create("k3"), "reward", "importance") == (
        "biased",
        "as a per-token reward only a score-function gradient reaches the policy, and this estimator's is not the KL's (k1's is)",
    )
    assert kl_recipe(create("k1"), "loss", "none")[1].startswith("unweighted in the loss its pathwise gradient is not the KL's")
    assert kl_recipe(create("k3+"), "both", "none")[1].startswith("its gradient is not the derivative of its value")
    assert kl_recipe(create("k2"), "loss", "importance", "per_token")[1].startswith("its value is not an unbiased per-token KL")
    assert kl_recipe(create("k3"), "loss", "importance", "per_token") == ("per_token", "")
    assert kl_recipe(create("full"), "both", "none") == ("unbiased", "")


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_group_estimator_without_sampling_is_refused_and_a_near_greedy_temperature_warns(estimator):
    """Greedy decoding gives a group one response repeated: every advantage 0, nothing learnt."""
    name = type(registry("advantage_estimator").create(estimator)).__name__
    with pytest.raises(
        ValueError, match=rf"^model.sampling.do_sample must be true with model.advantage_estimator {name} \(greedy decoding"
    ):
        PPORLHF(policy="tiny", reward_model=char_reward(), advantage_estimator=estimator, sampling=dict(num_generations=2, do_sample=False))
    cold = start_up_warnings(advantage_estimator=estimator, num_generations=2, temperature=0.01)
    assert [m for m in cold if m.startswith(f"model.sampling.temperature 0.01 with model.advantage_estimator {name}: below 0.1")]
    assert not [m for m in start_up_warnings(advantage_estimator=estimator, num_generations=2) if "model.sampling.temperature" in m]
    assert not [m for m in start_up_warnings(temperature=0.01) if "model.sampling.temperature" in m]  # gae: a critic, no group


@pytest.mark.parametrize(
    "loss, args, message",
    [
        ("clip_higher", {"clip_low": 1.0}, "policy_loss.clip_low must be a finite number in (0, 1), got 1.0"),
        ("gspo", {"clip_low": 2.0}, "policy_loss.clip_low must be a finite number in (0, 1), got 2.0"),
        ("ppo_clip", {"cliprange": 1.5}, "policy_loss.cliprange must be a finite number in (0, 1), got 1.5"),
        ("dual_clip", {"cliprange": float("inf")}, "policy_loss.cliprange must be a finite number in (0, 1), got inf"),
        ("clip_higher", {"clip_high": float("nan")}, "policy_loss.clip_high must be a finite number > 0, got nan"),
    ],
)
def test_a_clip_range_that_removes_the_lower_clip_is_refused(loss, args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        registry("policy_loss").create(loss, **args)
    assert registry("policy_loss").create("clip_higher", clip_low=0.2, clip_high=5.0).clip_high == 5.0  # no bound above


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"entropy_coef": float("inf")}, "model.ppo.entropy_coef must be a finite number >= 0, got inf"),
        ({"entropy_coef": float("nan")}, "model.ppo.entropy_coef must be a finite number >= 0, got nan"),
        ({"entropy_coef": -0.1}, "model.ppo.entropy_coef must be a finite number >= 0, got -0.1"),
        ({"entropy_coef": 0.1, "entropy_controller": "adaptive"}, "model.ppo.entropy_coef must be 0 when model.entropy_controller is set"),
        ({"log_samples_every_n_steps": -1}, "model.runtime.log_samples_every_n_steps must be an integer >= 0, got -1"),
        ({"num_logged_samples": -2}, "model.runtime.num_logged_samples must be an integer >= 0, got -2"),
    ],
)
def test_numeric_extremes_are_refused_naming_the_field_written(settings, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        PPORLHF(policy="tiny", reward_model=char_reward(), **settings)


# ---------------------------------------------------------------------------------------------
# Through the command, before any model loads


@pytest.mark.parametrize("role", ["reward_model", "gold_reward_model"])
def test_exact_answer_on_prompts_without_a_question_is_refused_at_start_up(tmp_path, monkeypatch, capsys, role):
    """The built-in prompts are requests for text, not arithmetic: exact_answer cannot know any answer."""
    code, line = command(tmp_path, monkeypatch, capsys, f"--model.{role}=exact_answer")
    assert code == 2
    assert re.fullmatch(
        rf"error: data.train_path: prompt 0 \('Write the opening line of a story about '\.\.\.\) holds no arithmetic question 'a \+ b', 'a - b' or 'a \* b', which "
        rf"model.{role} exact_answer computes its answer from \(360 such prompts\)",
        line,
    ), line
    arithmetic = str(Path(__file__).resolve().parents[1] / "rlhf_lightning" / "prompts" / "arithmetic_train.jsonl")
    from rlhf_lightning.data import load_prompts
    from rlhf_lightning_plugins.rewards.verifiable import ExactAnswerReward

    ExactAnswerReward().check_prompts(load_prompts(arithmetic), "data.train_path", "model.reward_model")  # every prompt a question


@pytest.mark.parametrize(
    "unit, target, message",
    [
        ("token_mean", 5.0, "< 4.357 nats per token (log V) with the tokenizer's V = 78 tokens"),
        ("sequence_sum", 120.0, "< 104.6 nats per response (max_new_tokens x log V) with the tokenizer's V = 78 tokens"),
    ],
)
def test_an_entropy_target_no_policy_reaches_is_refused_at_start_up(tmp_path, monkeypatch, capsys, unit, target, message):
    code, line = command(
        tmp_path,
        monkeypatch,
        capsys,
        "--model.entropy_controller=adaptive",
        f"--model.entropy_controller.init_args.target={target}",
        f"--model.entropy_controller.init_args.unit={unit}",
    )
    assert code == 2
    assert line.startswith(f"error: model.entropy_controller.init_args.target must be {message}"), line


def test_a_world_that_cannot_form_is_refused_naming_num_nodes(tmp_path, monkeypatch, capsys):
    """Two nodes asked for on a machine started alone: nothing would start the other node's ranks."""
    for name in ("NODE_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    code, line = command(tmp_path, monkeypatch, capsys, "--trainer.num_nodes=2")
    assert code == 2
    assert line.startswith(
        "error: trainer.num_nodes must be 1 on a machine started alone (trainer.devices=1 processes here, 2 x 1 in the world: "
        "the other nodes' ranks would never come)"
    ), line
    assert line.endswith("got 2")


@pytest.mark.parametrize("sharded", [True, False], ids=["fsdp2-folder-under-one-process", "one-process-file-under-fsdp2"])
def test_a_checkpoint_from_another_strategy_is_refused_naming_it_before_any_model_loads(tmp_path, monkeypatch, capsys, sharded):
    import torch

    ckpt = tmp_path / "last.ckpt"
    if sharded:
        ckpt.mkdir()  # what FSDP2 writes: a folder of per-rank shards
        args, written, strategy = (), "FSDP2 (a folder of per-rank shards)", "SingleDeviceStrategy"
    else:
        torch.save({"rlhf_lightning": {"sharded": False, "strategy": "SingleDeviceStrategy"}}, ckpt)
        args = ("--config", str(CONFIGS / "fsdp2.yaml"), "--trainer.devices=2")
        written, strategy = "SingleDeviceStrategy (whole weights, the frozen reference left out)", "FSDP2Strategy"
    code, line = command(tmp_path, monkeypatch, capsys, *args, f"--ckpt_path={ckpt}")
    assert code == 2
    assert line == (
        f"error: checkpoint {ckpt} was written by {written}; trainer.strategy {strategy} cannot resume it: "
        "resume with the strategy it was written with"
    )


# The rows of docs/troubleshooting.md added with these checks, through the command as a user types them.
REFUSED_ROWS = [
    (
        ("--model.advantage_estimator=grpo", "--model.sampling.num_generations=2", "--model.sampling.do_sample=false"),
        "error: model.sampling.do_sample must be true with model.advantage_estimator GRPO (greedy decoding gives every response of a group "
        "the same text: every advantage is 0 and the policy never changes), got False",
    ),
    (
        ("--model.policy_loss=clip_higher", "--model.policy_loss.clip_low=1"),
        "error: model.policy_loss.init_args.clip_low must be a finite number in (0, 1), got 1.0",
    ),
    (("--model.ppo.entropy_coef=.inf",), "error: model.ppo.entropy_coef must be a finite number >= 0, got inf"),
]
WARNED_ROWS = [
    (
        ("--model.kl_estimator=k3",),
        "model.kl_estimator K3 with model.kl.placement reward gives a biased gradient of the KL: as a per-token reward",
    ),
    (
        ("--model.kl_estimator=k3+", "--model.kl.placement=both", "--model.ppo.whiten_advantages=false"),
        "model.kl_estimator StraightThroughKL with model.kl.placement both, model.kl.loss_weighting importance gives a biased gradient",
    ),
    (
        ("--model.advantage_estimator=rloo", "--model.sampling.num_generations=2", "--model.sampling.temperature=0.05"),
        "model.sampling.temperature 0.05 with model.advantage_estimator RLOO: below 0.1 the responses of a group are mostly identical",
    ),
]


@pytest.mark.parametrize("args, line", REFUSED_ROWS, ids=["group-greedy", "clip-low", "entropy-inf"])
def test_troubleshooting_refusals_through_the_command(tmp_path, monkeypatch, capsys, args, line):
    code, last = command(tmp_path, monkeypatch, capsys, *args)
    assert (code, last) == (2, line)


@pytest.mark.parametrize("args, start", WARNED_ROWS, ids=["k3-reward", "k3+-both", "group-cold"])
def test_troubleshooting_warnings_through_the_command(args, start):
    from rlhf_lightning.cli import build_cli

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_cli(["--config", str(CONFIGS / "tiny.yaml"), *args], run=False)
    assert [str(w.message) for w in caught if str(w.message).startswith(start)], [str(w.message) for w in caught]


def test_a_checkpoint_incompatible_with_the_config_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """The settings that may not change on resume are compared with the checkpoint's saved ones (read
    without its tensors) before the models are built: the refusal costs no model load."""
    import torch

    ckpt = tmp_path / "last.ckpt"
    saved = {"critic": "shared", "lora_rank": 4, "policy": "tiny", "seed": 0}
    torch.save({"hyper_parameters": saved, "rlhf_lightning": {"plugins": {}, "sharded": False}}, ckpt)
    code, line = command(tmp_path, monkeypatch, capsys, f"--ckpt_path={ckpt}")
    assert (code, line) == (
        2,
        "error: checkpoint is incompatible with this config (these settings cannot change on resume); "
        "model.critic: checkpoint 'shared', config 'separate'; model.lora.rank: checkpoint 4, config 0",
    )


def test_the_module_takes_at_most_25_top_level_arguments():
    """What is not a plugin or a network lives in a group (args.py): the signature stays readable, with room for the next plugin kind."""
    import inspect

    parameters = list(inspect.signature(PPORLHF.__init__).parameters.values())[1:]
    assert len([p for p in parameters if p.kind is not p.VAR_KEYWORD]) <= 25


def test_a_config_written_for_0_2_runs_with_a_warning_naming_each_new_key_and_the_release_that_removes_the_old(tmp_path):
    """0.2's top-level seed, tiny_config and trust_remote_code are model.loading's since 0.3: a YAML written for 0.2
    (and the command line) still sets them, with a FutureWarning naming the new keys and 0.4.0."""
    from rlhf_lightning.cli import build_cli

    old = tmp_path / "for_0_2.yaml"
    old.write_text("model:\n  seed: 3\n  tiny_config: {hidden_size: 32, intermediate_size: 64}\n  trust_remote_code: false\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = build_cli(["--config", str(CONFIGS / "tiny.yaml"), "--config", str(old)], run=False).model
    (message,) = [str(w.message) for w in caught if w.category is FutureWarning]
    assert message == (
        "settings under the names of earlier versions are deprecated and removed in 0.4.0: model.trust_remote_code is now "
        "model.loading.trust_remote_code, model.tiny_config is now model.loading.tiny_config, model.seed is now model.loading.seed"
    )
    assert module.loading == args.LoadingArgs(trust_remote_code=False, tiny_config={"hidden_size": 32, "intermediate_size": 64}, seed=3)
    assert module.hparams["loading"]["seed"] == 3 and "seed" not in module.hparams
    with pytest.warns(FutureWarning, match=r"removed in 0\.4\.0: model\.seed is now model\.loading\.seed$"):
        module = build_cli(["--config", str(CONFIGS / "tiny.yaml"), "--model.seed=5"], run=False).model
    assert module.loading.seed == 5


def test_flat_settings_from_python_warn_naming_each_new_key_and_the_release_that_removes_them():
    with pytest.warns(
        FutureWarning, match=r"removed in 0\.4\.0: model\.lr is now model\.optim\.lr, model\.seed is now model\.loading\.seed$"
    ):
        module = PPORLHF(policy="tiny", reward_model=char_reward(), lr=1e-3, seed=2)
    assert (module.optim.lr, module.loading.seed) == (1e-3, 2)
