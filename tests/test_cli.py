"""The rlhf-lightning CLI: configs, short names, class paths, unknown names, third-party plugins."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import yaml

from rlhf_lightning import registry as registry_module
from rlhf_lightning.cli import build_cli, main
from rlhf_lightning.interfaces import BetaController, KLEstimator, RewardModel
from rlhf_lightning.registry import REGISTRIES, UnknownPluginError, registry

from helpers import CONFIGS, REPO

TINY = str(CONFIGS / "tiny.yaml")
PLUGIN_FIELDS = {
    "kl_estimator": "kl_estimator",
    "beta_controller": "beta_controller",
    "reward_model": "reward_model",
    "advantage_estimator": "advantage_estimator",
    "reference_update": "reference_update",
}


def print_config(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses_and_names_registered_plugins(config, capsys):
    parsed = print_config(["--config", str(config)], capsys)
    for field, kind in PLUGIN_FIELDS.items():
        value = parsed["model"].get(field)
        if isinstance(value, str):
            assert value in registry(kind), (config.name, field, value)
    assert config.read_text().startswith("#"), "every config opens with a comment on how to launch it"


def test_print_config_round_trip(tmp_path, capsys):
    first = print_config(["--config", TINY, "--model.kl_estimator=k3"], capsys)
    saved = tmp_path / "printed.yaml"
    saved.write_text(yaml.safe_dump(first))
    second = print_config(["--config", str(saved)], capsys)
    assert first == second
    assert first["model"]["kl_estimator"] == {"class_path": "rlhf_lightning_plugins.kl_estimators.K3"}


def test_short_names_and_class_paths_select_plugins():
    cli = build_cli(["--config", TINY, "--model.kl_estimator=low_var_kl", "--model.beta_controller=adaptive"], run=False)
    from rlhf_lightning_plugins.beta_controllers import AdaptiveBeta
    from rlhf_lightning_plugins.kl_estimators import K3

    assert isinstance(cli.model.kl_estimator, K3)
    assert isinstance(cli.model.beta_controller, AdaptiveBeta)
    assert cli.model.policy is None  # models load in configure_model, not at parse time


def test_a_short_name_takes_arguments_on_the_command_line_and_in_yaml(tmp_path):
    cli = build_cli(["--config", TINY, "--model.beta_controller=adaptive", "--model.beta_controller.target=4"], run=False)
    assert type(cli.model.beta_controller).__name__ == "AdaptiveBeta" and cli.model.beta_controller.target == 4.0
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(
        textwrap.dedent("""\
        model:
          beta_controller: {class_path: pid, init_args: {target: 2.5}}
          advantage_estimator: {class_path: gae, init_args: {lam: 0.9}}
          kl_estimator: k1+
          kl: {placement: loss, loss_weighting: none}
    """)
    )
    cli = build_cli(["--config", TINY, "--config", str(overlay)], run=False)
    assert type(cli.model.beta_controller).__name__ == "PIDBeta" and cli.model.beta_controller.target == 2.5
    assert cli.model.advantage_estimator.lam == 0.9
    # a preset is a name, not a class_path: the module builds it with its bound arguments
    assert type(cli.model.kl_estimator.value_estimator).__name__ == "K1"


def test_advantage_estimator_by_short_name_and_class_path():
    from rlhf_lightning_plugins.advantage_estimators import GAE, RLOO

    cli = build_cli(["--config", TINY, "--model.advantage_estimator=rloo", "--model.sampling.num_generations=4"], run=False)
    assert isinstance(cli.model.advantage_estimator, RLOO) and cli.model.critic is None
    cli = build_cli(
        ["--config", TINY, "--model.advantage_estimator.class_path=GAE", "--model.advantage_estimator.init_args.lam=1.0"], run=False
    )
    assert isinstance(cli.model.advantage_estimator, GAE) and cli.model.advantage_estimator.lam == 1.0

    cli = build_cli(
        ["--config", TINY, "--model.beta_controller=BandBeta", "--model.beta_controller.init_args.target=0.3"],
        run=False,
    )
    assert cli.model.beta_controller.target == 0.3 and cli.model.beta_controller.factor == 1.5


def test_unknown_plugin_name_fails_before_any_model_loads(monkeypatch):
    from rlhf_lightning import models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the plugin names were checked")

    monkeypatch.setattr(models, "load_causal_lm", refuse)
    with pytest.raises(UnknownPluginError) as err:
        build_cli(["--config", TINY, "--model.kl_estimator=k4"], run=False)
    message = str(err.value)
    assert "kl_estimator" in message and "'k4'" in message
    for name in ("k1", "k2", "k3", "abs", "full", "low_var_kl", "mse"):
        assert name in message


def test_wrong_type_for_a_plugin_argument_names_the_field(capsys):
    with pytest.raises(SystemExit):
        build_cli(["--config", TINY, "--model.beta_controller=AdaptiveBeta", "--model.beta_controller.init_args.target=abc"], run=False)
    assert "target" in capsys.readouterr().err


@pytest.mark.parametrize("value, field", [("-0.1", "init_beta"), ("0", "target")])
def test_impossible_controller_values_are_refused(value, field):
    with pytest.raises(ValueError, match=field):
        build_cli(
            ["--config", TINY, "--model.beta_controller=AdaptiveBeta", f"--model.beta_controller.init_args.{field}={value}"], run=False
        )


def test_plugins_command_lists_every_plugin_by_kind(capsys):
    main(["plugins"])  # captured: not a terminal, so one tab-separated line per plugin
    lines = {tuple(line.split("\t")[:3]) for line in capsys.readouterr().out.splitlines()}
    for kind, reg in REGISTRIES.items():
        for entry in reg.entries():
            assert (kind, entry.name, ", ".join(entry.aliases)) in lines, (kind, entry.name)


def install_entry_point(tmp_path, monkeypatch, module: str, source: str, kind: str, name: str):
    """A third-party package ``module`` (its ``source``), installed only as an entry point in the
    group rlhf_lightning.plugins; it registers the plugin ``name`` of ``kind``. Generator: a fixture's body."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = EntryPoint(name=module, value=module, group=registry_module.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry_module, "entry_points", lambda group: [entry] if group == entry.group else [])
    monkeypatch.setattr(registry_module, "_loaded", False)
    yield
    registry(kind)._entries.pop(name, None)
    registry(kind)._names.pop(name, None)
    sys.modules.pop(module, None)


@pytest.fixture
def external_plugin(tmp_path, monkeypatch):
    """A third-party KL estimator."""
    yield from install_entry_point(
        tmp_path,
        monkeypatch,
        "rlhf_ext_demo",
        """
        from rlhf_lightning.interfaces import KLEstimator
        from rlhf_lightning.registry import register

        @register("kl_estimator", "half_k1", description="half of k1 (a test plugin)")
        class HalfK1(KLEstimator):
            def __call__(self, logprobs, ref_logprobs, logits=None, ref_logits=None):
                return 0.5 * (logprobs - ref_logprobs)
        """,
        "kl_estimator",
        "half_k1",
    )


def test_third_party_plugin_is_selected_from_yaml(external_plugin, tmp_path):
    config = tmp_path / "ext.yaml"
    config.write_text(yaml.safe_dump({"model": {"kl_estimator": "half_k1"}}))
    cli = build_cli(["--config", TINY, "--config", str(config)], run=False)
    assert type(cli.model.kl_estimator).__name__ == "HalfK1"
    config.write_text(yaml.safe_dump({"model": {"kl_estimator": {"class_path": "rlhf_ext_demo.HalfK1"}}}))
    cli = build_cli(["--config", TINY, "--config", str(config)], run=False)
    assert type(cli.model.kl_estimator).__name__ == "HalfK1"


@pytest.fixture
def external_engine(tmp_path, monkeypatch):
    """A third-party rollout engine (say SGLang's): here ``hf``'s generate that counts its calls."""
    yield from install_entry_point(
        tmp_path,
        monkeypatch,
        "rlhf_ext_engine",
        """
        from rlhf_lightning.registry import register
        from rlhf_lightning_plugins.rollout_engines import HFGenerate

        @register("rollout_engine", "counting_hf", description="hf that counts its rollouts (a test plugin)")
        class CountingHF(HFGenerate):
            calls = 0

            def sample(self, module, enc, seed):
                type(self).calls += 1
                return super().sample(module, enc, seed)
        """,
        "rollout_engine",
        "counting_hf",
    )


def test_third_party_rollout_engine_samples_the_rollout(external_engine, tmp_path):
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump({"model": {"rollout_engine": "counting_hf"}}))
    cli = build_cli(["--config", TINY, "--config", str(config)], run=False)
    engine = cli.model.rollout_engine
    assert type(engine).__name__ == "CountingHF"
    cli.model.configure_model()
    rollout = cli.model.rollout(["hello", "abc"])
    assert type(engine).calls == 1 and rollout.responses.shape[0] == 2


def test_console_script_runs_the_tiny_config(tmp_path):
    """The installed command, as a user runs it: two iterations, metrics in TensorBoard under a folder
    named after the config, the Custom Scalars page with the KL target, no placeholder hp_metric, a
    checkpoint, and none of the libraries' start-up noise."""
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "rlhf-lightning"),
            "fit",
            "--config",
            TINY,
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2",
            "--trainer.callbacks=[]",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--model.beta_controller=adaptive",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = (tmp_path / "lightning_logs" / "tiny").iterdir()
    assert run_dir.name == "version_0"
    events = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    events.Reload()
    assert len(events.Scalars("objective/kl")) == 2
    assert [e.value for e in events.Scalars("objective/kl_target")] == [6.0, 6.0]  # adaptive's default target
    assert "hp_metric" not in events.Tags()["scalars"]
    assert "samples/text_summary" in events.Tags()["tensors"] and "custom_scalars__config__" in events.Tags()["tensors"]
    from tensorboard.plugins.custom_scalar import layout_pb2

    from rlhf_lightning.callbacks import HEALTH_CATEGORY, custom_scalars_layout

    (written,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(written.tensor_proto.string_val[0])
    expected = custom_scalars_layout(unit="sequence_sum", has_target=True, has_gold=False, kl_health=True)  # adaptive, no gold reward
    assert [(c.title, [(chart.title, list(chart.multiline.tag)) for chart in c.chart]) for c in layout.category] == [
        (category, [(title, tags) for title, (_, tags) in charts.items()]) for category, charts in expected.items()
    ]
    # every chart has its line (KL health's probes and checks log on their own schedules)
    drawn = {tag[1:-1] for c in layout.category if c.title != HEALTH_CATEGORY for chart in c.chart for tag in chart.multiline.tag}
    assert drawn <= set(events.Tags()["scalars"]), drawn - set(events.Tags()["scalars"])
    assert list((run_dir / "checkpoints").glob("*.ckpt"))
    assert "litlogger" not in result.stdout + result.stderr and "FutureWarning" not in result.stderr
    assert result.stderr.splitlines()[0] == "rlhf-lightning fit: loading torch, Lightning and the plugins ..."


def loaded_by(args: list[str], tmp_path) -> tuple[str, list[str]]:
    """What ``rlhf-lightning ARGS`` prints (stdout and stderr) and which of torch, Lightning and transformers it imports."""
    probe = (
        "import sys\nfrom rlhf_lightning.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print([m for m in ('torch', 'lightning', 'transformers') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    *printed, modules = done.stdout.splitlines()
    return "\n".join(printed) + done.stderr, yaml.safe_load(modules.replace("'", '"'))


def test_help_and_plugins_answer_without_loading_what_they_do_not_show(tmp_path):
    """The top-level help imports neither torch nor Lightning (Lightning's own help builds every subcommand's
    parser, which needs the module class: seconds on a busy machine), and names LightningCLI's subcommands and
    ``plugins``; ``plugins`` imports torch for the plugin classes, not Lightning."""
    from lightning.pytorch.cli import LightningCLI

    printed, modules = loaded_by(["--help"], tmp_path)
    assert modules == []
    assert printed.startswith(f"usage: rlhf-lightning {{{','.join([*LightningCLI.subcommands(), 'plugins'])}}} ...")
    printed, modules = loaded_by(["plugins"], tmp_path)
    assert modules == ["torch"] and "kl_estimator\tk3" in printed


def test_a_run_says_what_it_loads_before_it_loads_torch(tmp_path):
    """The first line of ``rlhf-lightning fit`` comes before torch's import (``-X importtime`` writes each
    import to stderr as it ends), so the seconds it takes are not silent."""
    (tmp_path / "empty.yaml").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    command = [sys.executable, "-X", "importtime", "-m", "rlhf_lightning.cli", "fit", "--config", "empty.yaml"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    lines = done.stderr.splitlines()
    said = lines.index("rlhf-lightning fit: loading torch, Lightning and the plugins ...")
    assert said < next(i for i, line in enumerate(lines) if re.search(r"\|\s+torch$", line)), lines[:said]
    assert done.returncode == 2 and "error: --config empty.yaml: the file is empty" in done.stderr


def test_plugin_bases_are_abstract():
    for base in (KLEstimator, BetaController, RewardModel):
        with pytest.raises(TypeError):
            base()


def test_docs_document_every_plugin_alias_and_argument():
    """docs/plugins.md's table has a row for every registered plugin (with its aliases), and
    docs/configuration.md names every argument of the module and the data module."""
    import dataclasses
    import inspect
    import re

    from rlhf_lightning.args import GROUPS
    from rlhf_lightning.data import PromptDataModule
    from rlhf_lightning.module import PPORLHF
    from rlhf_lightning.registry import REGISTRIES

    table = (REPO / "docs" / "plugins.md").read_text()
    rows = {(kind, name): aliases for kind, name, aliases in re.findall(r"^\| (\w+) \| `([^`]+)`( \([^)]*\))? \|", table, re.M)}
    for kind, reg in REGISTRIES.items():
        for entry in reg.entries():
            assert (kind, entry.name) in rows, f"docs/plugins.md's table lacks {kind} {entry.name}"
            for alias in entry.aliases:
                assert f"`{alias}`" in rows[(kind, entry.name)], f"docs/plugins.md lacks alias {alias} of {kind} {entry.name}"
    configuration = (REPO / "docs" / "configuration.md").read_text()
    documented = [f"model.{group}.{field.name}" for group, cls in GROUPS.items() for field in dataclasses.fields(cls)]
    for cls, prefix in ((PPORLHF, "model"), (PromptDataModule, "data")):
        for name, parameter in list(inspect.signature(cls.__init__).parameters.items())[1:]:
            if (
                parameter.kind is not parameter.VAR_KEYWORD and name not in GROUPS
            ):  # the flat names of earlier versions; each group field below
                documented.append(f"{prefix}.{name}")
    for key in documented:
        assert re.search(rf"`{re.escape(key)}`", configuration), f"docs/configuration.md does not document {key}"


def test_the_documented_plugin_package_installs_and_its_plugin_trains(tmp_path):
    """docs/plugins.md's my_kl.py and pyproject.toml, as printed: built and installed with pip (into a
    folder of their own, so the test environment is left as it was), then a short fit selects the
    plugin by its short name through the entry point."""
    import re

    page = (REPO / "docs" / "plugins.md").read_text()
    module = re.search(r"```python\n(# my_kl\.py\n.*?)```", page, re.S).group(1)
    pyproject = re.search(r"```toml\n(# pyproject\.toml of your package.*?)```", page, re.S).group(1)
    assert module in (REPO / "README.md").read_text(), "the README's my_kl.py is not docs/plugins.md's"
    package = tmp_path / "my-kl-package"
    package.mkdir()
    (package / "my_kl.py").write_text(module)
    (package / "pyproject.toml").write_text(pyproject)
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(site), str(package)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    fit = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_lightning.cli",
            "fit",
            "--config",
            TINY,
            "--model.kl_estimator=clipped_k1",
            "--trainer.limit_train_batches=1",
            "--trainer.max_epochs=1",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.callbacks=[]",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert fit.returncode == 0, fit.stderr[-3000:]  # an unknown kl_estimator name would stop it before any model loads
    (config,) = tmp_path.glob("lightning_logs/tiny/version_0/config.yaml")
    # the short name resolved to the plugin's class, recorded with its arguments
    assert yaml.safe_load(config.read_text())["model"]["kl_estimator"] == {"class_path": "my_kl.ClippedK1", "init_args": {"c": 1.0}}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.ppo.epochs=0"], "error: model.ppo.epochs must be an integer >= 1, got 0"),
        (["--model.beta_controller=pdi"], "error: unknown beta_controller 'pdi'; registered beta_controller names: adaptive, anneal, band"),
        (["--config", "EMPTY"], "error: --config EMPTY: the file is empty; expected settings such as model:, data:, trainer:"),
        (["--config", "LIST"], "error: --config LIST: expected a mapping of settings (model:, data:, trainer:), got a list"),
    ],
    ids=["impossible-value", "unknown-plugin", "empty-config", "list-config"],
)
def test_configuration_errors_print_one_line_and_exit_2_without_a_traceback(tmp_path, args, message):
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "list.yaml").write_text("- model\n")
    names = {"EMPTY": str(tmp_path / "empty.yaml"), "LIST": str(tmp_path / "list.yaml")}
    args = [names.get(a, a) for a in args]
    command = [sys.executable, "-m", "rlhf_lightning.cli", "fit", "--config", TINY, *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith(message.replace("EMPTY", names["EMPTY"]).replace("LIST", names["LIST"]))
    assert "Traceback" not in result.stderr
    debug = subprocess.run(
        command, capture_output=True, text=True, cwd=tmp_path, timeout=300, env={**os.environ, "RLHF_LIGHTNING_TRACEBACK": "1"}
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_an_unknown_choice_is_refused_at_parse_time_naming_the_field_and_the_choices(tmp_path):
    """A Literal argument (jsonargparse's own check, before any model loads): exit 2, the key and every valid value."""
    command = [sys.executable, "-m", "rlhf_lightning.cli", "fit", "--config", TINY, "--cpu.linear=fast"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-2:] == [
        'error: Parser key "cpu.linear":',
        "  Expected a typing.Literal['auto', 'onednn', 'aten']. Got value: fast",
    ]
