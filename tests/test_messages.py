"""Messages that name what the user wrote (issue #55): a plugin's argument by the module argument it
was built for, a run that cannot learn refused at start-up, a checkpoint that is not this program's
refused naming the file, a full disk named in words, nothing written half."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from rlhf_lightning.args import PromptArgs, SamplingArgs
from rlhf_lightning.checkpoints import AtomicCheckpointIO, checkpoint_state
from rlhf_lightning.checks import ConfigError, check_context, point_mass_warning
from rlhf_lightning.interfaces import RewardModel
from rlhf_lightning.reward_shaping import check_scores
from rlhf_lightning_plugins.rewards.classifier import HFClassifierReward
from tools import gpu_check

from helpers import CONFIGS, cli, command, fit, make_module

# --- 1. a plugin's argument is named by the module argument it was built for


@pytest.mark.parametrize("role", ["entropy_controller", "beta_controller"])
def test_a_controllers_infinite_target_names_the_argument_it_was_given_as(tmp_path, monkeypatch, capsys, role):
    """AdaptiveBeta serves both; its own check says ``beta_controller.target``, the user wrote the role's key."""
    code, line = command(tmp_path, monkeypatch, capsys, f"--model.{role}=adaptive", f"--model.{role}.init_args.target=.inf")
    assert (code, line) == (2, f"error: model.{role}.init_args.target must be a finite number in [1e-37, 3e+38], got inf")


def test_an_entropy_target_above_log_top_k_is_refused(tmp_path, monkeypatch, capsys):
    """The entropy is of the sampled distribution on its kept set: with top_k 5 at most log 5 nats a token."""
    code, line = command(
        tmp_path,
        monkeypatch,
        capsys,
        "--model.entropy_controller=adaptive",
        "--model.entropy_controller.init_args.target=3",
        "--model.entropy_controller.init_args.unit=token_mean",
        "--model.sampling.top_k=5",
    )
    assert code == 2
    assert line.startswith(
        "error: model.entropy_controller.init_args.target must be < 1.609 nats per token (log top_k) with model.sampling.top_k = 5 "
        "kept tokens"
    ), line


# --- 3. a group's field named alone


def test_a_negative_weight_decay_names_its_group_key_only(tmp_path, monkeypatch, capsys):
    code, line = command(tmp_path, monkeypatch, capsys, "--model.optim.weight_decay=-1")
    assert (code, line) == (2, "error: model.optim.weight_decay must be a finite number >= 0, got -1.0")


# --- 4. the remote backend without its url, through the command


@pytest.mark.parametrize("role", ["reward_model", "gold_reward_model"])
def test_the_remote_backend_without_a_url_names_its_argument(tmp_path, role):
    result = cli(tmp_path, "fit", "--config", str(CONFIGS / "tiny.yaml"), f"--model.{role}=remote", timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: model.{role}.init_args.url must be the scoring server's http:// or https:// address (http://host:port/path), got None"
    )
    assert "Union" not in result.stderr and "usage:" not in result.stderr


# --- 5. a sampled distribution that is a point mass


def test_top_k_1_is_refused_while_sampling():
    with pytest.raises(ConfigError, match=r"^model.sampling.top_k must be 0 or >= 2 \(top_k 1 keeps one token .* got 1$"):
        SamplingArgs(top_k=1)
    assert SamplingArgs(top_k=1, do_sample=False).top_k == 1  # greedy rollouts ignore top_k
    assert SamplingArgs(top_k=2).top_k == 2


def test_top_k_1_is_refused_at_start_up_through_the_command(tmp_path, monkeypatch, capsys):
    code, line = command(tmp_path, monkeypatch, capsys, "--model.sampling.top_k=1")
    assert code == 2 and line.startswith("error: model.sampling.top_k must be 0 or >= 2 (top_k 1 keeps one token"), line


def test_a_nucleus_below_one_over_v_is_refused_at_start_up(tmp_path, monkeypatch, capsys):
    """At top_p <= 1 / V the most likely token alone always fills the nucleus (the tiny tokenizer's V = 78)."""
    code, line = command(tmp_path, monkeypatch, capsys, "--model.sampling.top_p=0.01")
    assert code == 2
    assert line.startswith("error: model.sampling.top_p must be > 1 / V = 0.0128 with the tokenizer's V = 78 tokens"), line
    assert line.endswith("got 0.01")


@pytest.mark.parametrize(
    "sampling, setting",
    [({}, None), ({"top_p": 0.014}, "model.sampling.top_p 0.014"), ({"temperature": 1e-9}, "model.sampling.temperature 1e-09")],
    ids=["declared", "one-token-nucleus", "frozen-temperature"],
)
def test_a_first_rollout_sampled_from_one_token_is_named(sampling, setting):
    """The tiny model is near uniform over its 78 tokens (p about 0.013 each): a nucleus of 0.014 keeps
    the most likely token alone, as a temperature of 1e-9 does; the module warns with this at its first rollout."""
    module = make_module(sampling=dict(max_new_tokens=6, **sampling))
    rollout = module.rollout(module.repeat_prompts(["Write a story.", "Hello there", "Count to three", "Why?"]))
    message = point_mass_warning(module.sampling, rollout.old_logprobs, rollout.kept, rollout.response_mask)
    if setting is None:
        assert message is None
    else:
        assert message.startswith(f"{setting}: at the first rollout 100% of the response positions were sampled from one token alone")


# --- 6. the policy's context


def test_a_prompt_and_response_longer_than_the_context_are_refused():
    """A 512-position model asked for 400-token prompts and 112-token responses: 624 positions."""
    config = LlamaConfig(max_position_embeddings=512)
    with pytest.raises(ConfigError) as refused:
        check_context(PromptArgs(max_length=512), SamplingArgs(max_new_tokens=112), config, longest_prompt=401)
    assert str(refused.value) == (
        "the longest prompt (model.prompts.max_length 512 bounds it) + model.sampling.max_new_tokens must be <= 512 positions, the "
        "policy's context (its LlamaConfig's max_position_embeddings); lower model.sampling.max_new_tokens to at most 111, or shorten "
        "the prompts, got '401 + 112 = 513'"
    )
    check_context(PromptArgs(max_length=512), SamplingArgs(max_new_tokens=112), config, longest_prompt=400)  # the files' prompts fit
    with pytest.raises(ConfigError, match=r"^a one-token prompt \+ model.sampling.max_new_tokens must be <= 512 .* got '1 \+ 600 = 601'$"):
        check_context(PromptArgs(), SamplingArgs(max_new_tokens=600), config)  # no prompt files: prompts come in batches
    check_context(PromptArgs(), SamplingArgs(), object())  # a config without a context is not checked
    with pytest.raises(
        ConfigError, match=r"must be <= 512 positions, model\.reference's context \(its LlamaConfig's max_position_embeddings\)"
    ):
        check_context(PromptArgs(), SamplingArgs(max_new_tokens=600), config, whose="model.reference's")  # a teacher's shorter context


# --- 7. a reward model that reads only the prompt


def test_hf_classifier_reads_the_response_of_a_long_prompt_and_warns_naming_max_length(tiny_classifier):
    """Cut from the right, every response of a prompt longer than max_length scored the same."""
    path, _, _ = tiny_classifier
    rm = HFClassifierReward(path=str(path), max_length=32, shared_prompts=False)
    prompt = "Tell me a long story about the sea and the ships on it. " * 2
    responses = ["Waves", "A ship!", "no"]
    with pytest.warns(UserWarning, match=r"model.gold_reward_model.init_args.max_length 32: 1 of 1 prompts of data.train_path are longer"):
        rm.check_prompts([prompt], "data.train_path", "model.gold_reward_model")
    raw, _ = rm([prompt] * 3, responses, torch.ones(3, dtype=torch.bool))
    assert raw.unique().numel() == 3  # each response read
    fresh = HFClassifierReward(path=str(path), max_length=32)
    with pytest.warns(
        UserWarning, match=r"^model.reward_model.init_args.max_length 32: 3 of 3 texts are longer .* reads only their last 32"
    ):
        fresh([prompt] * 3, responses, torch.ones(3, dtype=torch.bool))


# --- 2. an absurd reward is the backend's fault, not the loss's


def test_an_absurd_score_names_the_backend_and_the_value():
    with pytest.raises(FloatingPointError) as fault:
        check_scores([1.0, 1e20], "CallableReward", 2)
    assert str(fault.value).startswith("model.reward_model CallableReward returned scores beyond +-1e+15 for responses [1]: [1e+20]")
    with pytest.raises(FloatingPointError, match=r"^model.gold_reward_model ExactAnswerReward returned scores beyond"):
        check_scores([-3e16], "ExactAnswerReward (model.gold_reward_model)", 1)
    assert check_scores([1e6, -5.0], "CallableReward", 2).tolist() == [1e6, -5.0]


class HugeReward(RewardModel):
    def score(self, prompts, responses):
        return [1e20] * len(responses)


def test_a_reward_of_1e20_stops_the_run_naming_the_backend_not_the_loss(tmp_path):
    module = make_module(reward_model=HugeReward(), runtime=dict(max_consecutive_faults=2))
    with pytest.warns(UserWarning), pytest.raises(RuntimeError) as stopped:
        fit(module, tmp_path, iterations=3)
    assert "last cause: model.reward_model HugeReward returned scores beyond +-1e+15" in str(stopped.value)
    assert "PPO loss:" not in str(stopped.value)


# --- 8. a checkpoint that is not this program's


def lightning_checkpoint(tmp_path) -> Path:
    ckpt = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"layer.weight": torch.zeros(2)}, "pytorch-lightning_version": "2.5.0", "hyper_parameters": {}}, ckpt)
    return ckpt


@pytest.mark.parametrize(
    "written, what",
    [
        (
            lambda p: torch.save({"layer.weight": torch.zeros(2)}, p),
            "a bare state_dict of tensors, as torch.save(model.state_dict()) writes",
        ),
        (
            lambda p: torch.save({"state_dict": {}, "pytorch-lightning_version": "2.5.0", "hyper_parameters": {}}, p),
            "another LightningModule's checkpoint (Lightning 2.5.0)",
        ),
    ],
    ids=["bare-state-dict", "another-module"],
)
def test_a_checkpoint_without_this_programs_state_is_refused_naming_the_file(tmp_path, monkeypatch, capsys, written, what):
    ckpt = tmp_path / "foreign.ckpt"
    written(ckpt)
    code, line = command(tmp_path, monkeypatch, capsys, f"--ckpt_path={ckpt}")
    assert (code, line) == (
        2,
        f"error: checkpoint {ckpt} has no 'rlhf_lightning' state: not written by rlhf-lightning ({what}). --ckpt_path resumes a "
        "run of this program from its own checkpoint (last.ckpt); to start from other weights, name their folder as model.policy",
    )
    with pytest.raises(ConfigError, match=rf"^checkpoint {ckpt} has no 'rlhf_lightning' state"):
        AtomicCheckpointIO().load_checkpoint(ckpt)


def test_an_earlier_versions_checkpoint_is_refused_naming_what_it_lacks(tmp_path, monkeypatch, capsys):
    """The first release saved the iteration and two plugin states only."""
    ckpt = tmp_path / "v0.ckpt"
    state = {"iteration": 3, "beta_controller": {"beta": 0.05}, "reward_model": {}}
    torch.save({"state_dict": {}, "hyper_parameters": {}, "rlhf_lightning": state}, ckpt)
    code, line = command(tmp_path, monkeypatch, capsys, f"--ckpt_path={ckpt}")
    assert (code, line) == (
        2,
        f"error: checkpoint {ckpt} was written by an earlier rlhf-lightning version: its 'rlhf_lightning' state lacks "
        "'generation_seed_base', 'faults', which a resume restores; it cannot be resumed: start a new run",
    )
    with pytest.raises(ConfigError, match=r"^the checkpoint was written by an earlier rlhf-lightning version"):
        checkpoint_state({"rlhf_lightning": state})


# --- 9. tools/gpu_check.py --only that selects nothing


@pytest.mark.parametrize("only, says", [("tiny-bf6", "no check's name contains it"), ("deepspeed-2", "no such check on this machine")])
def test_gpu_check_refuses_an_only_that_selects_nothing(capsys, monkeypatch, only, says):
    monkeypatch.setattr(gpu_check, "importlib_available", lambda name: False)
    ran = []
    with pytest.raises(SystemExit) as stopped:
        gpu_check.main(["--only", only], runner=lambda check, root: ran.append(check), reason=lambda: None)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and not ran
    assert f"error: --only {only}: {says}" in err and "tiny-bf16-mixed" in err


# --- 10. a full disk


@pytest.mark.parametrize("failure", ["oserror", "torch-runtime-error"])
def test_a_full_disk_names_the_checkpoint_and_leaves_the_previous_one(tmp_path, monkeypatch, failure):
    target = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"iteration": 1}, target)

    def full(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        if failure == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        try:  # what torch.save raises when its writer's write fails: the OSError as its context
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from None

    monkeypatch.setattr("rlhf_lightning.checkpoints.torch.save", full)
    with pytest.raises(OSError) as refused:
        io.save_checkpoint({"iteration": 2}, target)
    assert refused.value.errno == errno.ENOSPC
    message = str(refused.value)
    assert f"cannot write checkpoint {target}: no space left on device (" in message and "MiB free in" in message
    assert message.endswith("nothing was written, a previous last.ckpt is intact")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no partial file
    assert torch.load(target, weights_only=True) == {"iteration": 1}


# --- a hostile tour: what was a traceback or a parser's union error, now one line naming the field

TOUR = [
    (("--data.num_workers=-1",), "error: data.num_workers must be an integer >= 0, got -1"),
    (
        ("--model.sampling.max_new_tokens=8", "--model.sampling.min_new_tokens=20"),
        "error: model.sampling.min_new_tokens must be an integer in [0, model.sampling.max_new_tokens = 8], got 20",
    ),
    (
        ("--model.lora.target_modules=[q_proj]",),
        "error: model.lora.target_modules must be null with model.lora.rank 0 (full fine-tuning: no adapter is built; set "
        "model.lora.rank > 0 for LoRA), got ['q_proj']",
    ),
    (
        ("--model.reward_model=hf_classifier",),
        "error: model.reward_model.init_args.path must be a local folder (a Hugging Face sequence-classification checkpoint: config, "
        "weights, tokenizer), got None",
    ),
    (
        ("--model.gold_reward_model=hf_classifier", "--model.gold_reward_model.init_args.path=/nonexistent"),
        "error: model.gold_reward_model.init_args.path must be an existing folder (a Hugging Face sequence-classification checkpoint: "
        "config, weights, tokenizer), got '/nonexistent'",
    ),
    (("--model.reward_model=ensemble",), "error: model.reward_model.init_args.paths must be a list of at least 2 model folders, got None"),
    (
        ("--model.reward_model=embedding_similarity",),
        "error: model.reward_model.init_args.target must be a non-empty string (required), got None",
    ),
    (
        ("--model.beta_controller=pid", "--model.beta_controller.init_args.beta_min=0"),
        "error: model.beta_controller.init_args.beta_min must be a finite number > 0, got 0.0",
    ),
]


@pytest.mark.parametrize(
    "args, line",
    TOUR,
    ids=["num-workers", "min-new-tokens", "lora-modules-without-rank", "classifier-path", "classifier-folder", "ensemble", "target", "pid"],
)
def test_hostile_values_are_refused_in_one_line_naming_the_field(tmp_path, monkeypatch, capsys, args, line):
    assert command(tmp_path, monkeypatch, capsys, *args) == (2, line)


def test_the_module_refuses_a_response_past_the_policys_context_before_the_first_rollout():
    """The module checks the context when it builds the policy: the tiny model has 512 positions."""
    with pytest.raises(ConfigError, match=r"model.sampling.max_new_tokens must be <= 512 positions, the policy's context"):
        make_module(sampling=dict(max_new_tokens=600))


def test_the_first_training_rollout_from_a_near_zero_temperature_warns_naming_it(tmp_path):
    """A temperature so low that every sampled token has probability 1 in float32: a point mass, no gradient;
    the first training iteration says so, naming the setting."""
    with pytest.warns(UserWarning, match=r"model.sampling.temperature 1e-09: at the first rollout 100% of the response positions"):
        fit(make_module(sampling=dict(temperature=1e-9), ppo=dict(epochs=1)), tmp_path, iterations=1)


def test_a_policy_path_that_does_not_exist_is_one_line_naming_the_field(tmp_path, monkeypatch, capsys):
    from rlhf_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(CONFIGS / "tiny.yaml"), "--model.policy=/nonexistent/model"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: model.policy (or model.tokenizer) must be a built-in model (tiny, smollm2), a local checkpoint folder or a "
        ".gguf file, got '/nonexistent/model': no such folder or file"
    )


def test_lora_target_modules_the_policy_has_not_got_are_one_line_naming_the_field_and_its_layers(tmp_path):
    """peft raises a traceback when no target matches (and ignores one that does not, beside one that
    does); the tiny Llama's adaptable layers are its attention and MLP projections, embedding and head."""
    result = cli(
        tmp_path,
        "fit",
        "--config",
        str(CONFIGS / "tiny.yaml"),
        "--trainer.enable_progress_bar=false",
        "--model.lora.rank=4",
        "--model.lora.target_modules=[q_proj,qproj,mlp]",
        timeout=600,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "error: model.lora.target_modules must be names of the policy's layers LoRA can adapt (down_proj, embed_tokens, gate_proj, "
        "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj) or null for every linear layer; 'qproj', 'mlp' match none, "
        "got ['q_proj', 'qproj', 'mlp']"
    )
    assert "Traceback" not in result.stderr and not list(tmp_path.glob("lightning_logs/*/*/checkpoints/*"))
