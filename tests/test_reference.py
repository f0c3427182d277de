"""A reference from another model (``model.reference``, a teacher): its tokenizer checked against the
policy's before any model loads, its log-probs the teacher's own, the starting policy kept beside it for
the drift, under full fine-tuning and LoRA, its identity in the checkpoint and a changed one refused on
resume, and a moving reference refused with it."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning import checkpoints
from rlhf_lightning.checks import ConfigError
from rlhf_lightning.models import char_tokenizer, load_causal_lm, model_fingerprint, tokenizer_difference
from rlhf_lightning.module import PPORLHF
from rlhf_lightning_plugins.beta_controllers import FixedBeta
from rlhf_lightning_plugins.rewards.function import CallableReward

from helpers import CONFIGS, TEACHER_SEED, cli, fit, make_module, response_logprobs, run_cli, save_tiny_teacher


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return save_tiny_teacher(tmp_path_factory.mktemp("teacher"))


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_foreign_reference_scores_with_the_teachers_log_probs_and_the_starting_policy_is_kept_for_the_drift(teacher, lora_rank):
    """The rollout's log pi_ref are the teacher model's own (loaded apart by transformers), log pi_0 the
    student's at the start (equal to pi_old before any update), so objective/kl is the k1 estimate of KL to
    the teacher and objective/kl_to_initial 0 at iteration 0; under LoRA too, where the reference is a
    separate model and pi_0 the adapter-disabled policy."""
    from transformers import AutoModelForCausalLM

    module = make_module(reference=teacher, lora=dict(rank=lora_rank))
    assert module.ref_model is not None and (module.initial_model is not None) == (lora_rank == 0)
    assert not module.networks.reference_is_policy()
    module.check_reference()
    rollout = module.rollout(["abc", "hello", "xyz", "e"])
    mask = rollout.response_mask
    teacher_logprobs = response_logprobs(AutoModelForCausalLM.from_pretrained(teacher), rollout)
    assert torch.allclose(rollout.ref_logprobs * mask, teacher_logprobs, atol=1e-4), (
        (rollout.ref_logprobs * mask - teacher_logprobs).abs().max()
    )
    # pi_old from the sampler's KV-cached logits, pi_0 from a forward: equal up to float rounding
    assert torch.allclose(rollout.initial_logprobs * mask, rollout.old_logprobs * mask, atol=1e-5)
    kl = module.regulariser.kl_per_token(rollout)
    assert torch.allclose(kl, (rollout.old_logprobs - teacher_logprobs) * mask, atol=1e-4)
    assert float(kl.sum(-1).mean()) > 0.1  # another model: far from the student
    assert float(module.regulariser.kl_per_token(rollout, to_initial=True).abs().max()) < 1e-5


def test_a_foreign_reference_trains_and_logs_the_kl_to_it_and_the_drift_from_the_start(teacher, tmp_path):
    """Reward 0 with the teacher as the reference (beta 1, k1 in the reward): the logged KL to the teacher
    falls from its first iteration, and the drift from the starting policy, 0 at the first (to rounding), grows."""
    module = make_module(
        reference=teacher,
        reward_model=CallableReward(function="rlhf_lightning_plugins.rewards.toy:constant", kwargs={"value": 0.0}),
        beta_controller=FixedBeta(init_beta=1.0),
    )
    _, history = fit(module, tmp_path, iterations=6, batch_size=16)
    kl, drift = history.series("objective/kl"), history.series("objective/kl_to_initial")
    print("objective/kl", [round(v, 2) for v in kl], "objective/kl_to_initial", [round(v, 2) for v in drift])
    assert history.series("objective/reward") == [0.0] * 6
    assert abs(drift[0]) < 1e-4 and drift[-1] > 0.5
    assert kl[-1] < 0.8 * kl[0]


def test_the_reference_tokenizer_must_be_the_policys_and_what_differs_is_named(tmp_path):
    """Checked before any model loads (the module's ``setup``): another vocabulary, or the same vocabulary
    with another special token, is refused naming model.reference and what differs; a folder without a
    tokenizer, the tiny model and a missing path are refused naming the field."""
    other = save_tiny_teacher(tmp_path / "other", tokenizer=char_tokenizer("abc"))
    with pytest.raises(
        ConfigError,
        match=r"^model\.reference must be a model with the policy's tokenizer \(the policy's vs the reference's: the vocabulary: 78 tokens vs 6, 75 token ids differ \('\\n': 4 vs None, ' ': 3 vs None",
    ):
        unbuilt(other).check_reference()

    tokenizer, eos_a = char_tokenizer(), char_tokenizer()
    eos_a.eos_token = "a"
    assert tokenizer_difference(tokenizer, char_tokenizer()) is None
    assert tokenizer_difference(tokenizer, eos_a) == "the special tokens: eos_token '<eos>' vs 'a'"

    bare = tmp_path / "bare"
    load_causal_lm("tiny", len(tokenizer), 1).save_pretrained(bare)
    with pytest.raises(ConfigError, match=r"model\.reference .* has no tokenizer to check against the policy's"):
        unbuilt(str(bare)).check_reference()
    with pytest.raises(
        ConfigError, match=r"^model\.reference must be a built-in model \(smollm2\), a local checkpoint folder .*no such folder or file"
    ):
        unbuilt(str(tmp_path / "missing")).check_reference()
    with pytest.raises(ConfigError, match=r"model\.reference must be a checkpoint folder, a \.gguf file or smollm2"):
        unbuilt("tiny").check_reference()
    with pytest.raises(
        ConfigError, match=r"model\.reference must be a model whose output layer scores the policy's 78 tokens \(its own scores 6\)"
    ):
        make_module(reference=other)  # past the tokenizer check (a tokenizer saved beside other weights): the model's own size


def unbuilt(reference: str) -> PPORLHF:
    """A module with ``reference``, its networks not built: what the command has when ``setup`` checks the reference."""
    return PPORLHF(policy="tiny", reward_model=CallableReward(function="rlhf_lightning_plugins.rewards.toy:constant"), reference=reference)


@pytest.mark.parametrize("update", ["sync", "reset", "ema"])
def test_a_moving_reference_update_is_refused_with_a_foreign_reference_naming_both_fields(teacher, update):
    with pytest.raises(ConfigError, match=r"model\.reference_update must be none with model\.reference '.*teacher"):
        make_module(reference=teacher, reference_update=update)


def test_the_checkpoint_records_the_reference_and_a_changed_one_is_refused_on_resume(teacher, tmp_path):
    """The checkpoint holds the reference's spec and fingerprint and leaves its weights out (rebuilt from the
    spec); resuming with the same reference passes the check, with another spec or other weights under the
    same spec (the folder overwritten) it is refused naming model.reference."""
    folder = save_tiny_teacher(tmp_path / "teacher")
    module = make_module(reference=folder)
    trainer, _ = fit(module, tmp_path, iterations=1)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    assert saved["rlhf_lightning"]["reference"] == {"reference": folder, "fingerprint": model_fingerprint(folder)}
    assert not any(key.startswith("ref_model.") for key in saved["state_dict"])
    checkpoints.check_resume(str(path), make_module(reference=folder), trainer.strategy)

    with pytest.raises(ConfigError, match=rf"model\.reference: checkpoint '{folder}', config '{teacher}'"):
        checkpoints.check_resume(str(path), make_module(reference=teacher), trainer.strategy)
    with pytest.raises(ConfigError, match=r"model\.reference: checkpoint '.*', config None"):
        checkpoints.check_resume(str(path), make_module(), trainer.strategy)
    save_tiny_teacher(folder, seed=TEACHER_SEED + 1)  # other weights in the same folder
    with pytest.raises(ConfigError, match=r"model\.reference: '.*' holds other weights than when the checkpoint was written"):
        checkpoints.check_resume(str(path), make_module(reference=folder), trainer.strategy)


def test_the_command_refuses_a_reference_with_another_tokenizer_before_any_model_loads(tmp_path):
    """Through the command: one line, exit status 2, from the module's setup (no weights loaded yet: the
    mismatched folder's output layer, which would be refused after loading, is never reached)."""
    other = save_tiny_teacher(tmp_path / "other", tokenizer=char_tokenizer("abc"))
    done = cli(tmp_path, "fit", "--config", str(CONFIGS / "tiny.yaml"), f"--model.reference={other}", "--trainer.limit_train_batches=1")
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: model.reference must be a model with the policy's tokenizer (the policy's vs the reference's: the vocabulary"
    ), last
    moving = cli(tmp_path, "fit", "--config", str(CONFIGS / "tiny.yaml"), f"--model.reference={other}", "--model.reference_update=sync")
    assert moving.returncode == 2 and "error: model.reference_update must be none with model.reference" in moving.stderr, moving.stderr[
        -3000:
    ]


def test_a_run_with_a_foreign_reference_killed_mid_iteration_resumes_as_if_uninterrupted(tmp_path):
    """SIGKILL during iteration 4 after the checkpoint of iteration 2, then ``--ckpt_path last``: the teacher and
    the starting policy, left out of the checkpoint, are rebuilt from the config and the policy's weights come
    from it, so iterations 3-6 log what the uninterrupted run logged, the KL to the teacher and the drift included."""
    from tools.summarize_run import read_scalars

    teacher = f"--model.reference={save_tiny_teacher(tmp_path / 'teacher')}"
    straight = run_cli(tmp_path / "straight", teacher)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed_root = tmp_path / "killed"
    killed = run_cli(killed_root, teacher, "--trainer.callbacks+=fault_callbacks.KillMidIteration", "--trainer.callbacks.iteration=3")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run_cli(killed_root, teacher, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    logs = killed_root / "lightning_logs" / "tiny"
    reference = read_scalars(str(tmp_path / "straight" / "lightning_logs" / "tiny" / "version_0"))
    combined = read_scalars([str(logs / "version_0"), str(logs / "version_1")])
    assert reference["objective/kl"][0] > 10 and reference["objective/kl_to_initial"][5] > 0.1
    for name in ("objective/reward", "objective/kl", "objective/kl_to_initial", "policy/loss", "value/loss"):
        assert combined[name] == reference[name], (name, combined[name], reference[name])


def test_the_tensorboard_charts_name_the_reference_model_and_the_direction_and_chart_the_drift():
    from rlhf_lightning.callbacks import SEEDS_CATEGORY, custom_scalars_layout

    for unit in ("sequence_sum", "token_mean"):
        layout = custom_scalars_layout(unit=unit, has_target=False, reference="teachers/tiny-e")[SEEDS_CATEGORY]
        kl_titles = [title for title, (_, tags) in layout.items() if "^objective/kl$" in tags or "^objective/kl_per_token$" in tags]
        assert kl_titles and all(
            title.startswith("KL(pi || teachers/tiny-e), the reverse KL to the reference model,") for title in kl_titles
        )
        drift = "drift from the starting policy, KL(pi || pi_0) per response (nats): objective/kl_to_initial"
        assert layout[drift] == ["Multiline", ["^objective/kl_to_initial$"]]
    assert not any("kl_to_initial" in title for title in custom_scalars_layout()[SEEDS_CATEGORY])  # the starting policy: no drift chart


def test_a_config_whose_teacher_is_not_made_yet_names_the_command_that_makes_it(tmp_path):
    """configs/distill.yaml from a fresh folder (no teachers/ there): one line naming the missing folder and the
    command of the config's header that writes it, exit status 2."""
    done = cli(tmp_path, "fit", "--config", str(CONFIGS / "distill.yaml"))
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: model.reference must be a built-in model"), last
    assert last.endswith(
        f"got 'teachers/smollm2-exclaim': no such folder or file; make it with `python -m tools.make_teacher` (the header of {CONFIGS / 'distill.yaml'})"
    ), last
