"""The LightningModule: rollout masks and log-probs, the reference, updates, checkpoints, learning."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from rlhf_lightning import ppo_math as pm
from rlhf_lightning.module import PPORLHF
from rlhf_lightning.prefix import position_ids, trim_left_padding

from helpers import char_reward, fit, make_module

PROMPTS = ["Write a short review of a train journey.", "Hi", "Describe a snowy weekend in two sentences.", "Go"]


def push_adapter(module, std: float = 0.5) -> None:
    """Move every LoRA B matrix away from its zero init, the same way whatever the global RNG."""
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * std)


def test_repeated_prompts_encode_as_each_alone_would(smollm2_tokenizer):
    """A rollout's prompt list repeats each prompt num_generations times; each distinct one is rendered and
    tokenised once, and every row equals what the tokenizer gives the whole list (chat template, left padding)."""
    module = make_module(tokenizer="smollm2")
    prompts = ["a much longer prompt than the other", "short", "a much longer prompt than the other", "short", "short"]
    enc = module.sampler.encode(prompts)
    texts = [
        smollm2_tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in prompts
    ]
    expected = smollm2_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert torch.equal(enc["input_ids"], expected["input_ids"]) and torch.equal(enc["attention_mask"], expected["attention_mask"])


def test_sampler_and_forward_logprobs_agree_with_chat_template(smollm2_tokenizer):
    """PPO's ratio is only right if the forward pass scores tokens exactly as the sampler drew them.

    The SmolLM2 pad token is its EOS, which also closes the chat turns inside the prompt: a mask
    built from ids != pad would hide those, and left padding needs matching position ids.
    """
    module = make_module(tokenizer="smollm2", tiny_config={"hidden_size": 32, "intermediate_size": 64}, sampling=dict(max_new_tokens=6))
    enc = module.sampler.encode(PROMPTS)
    eos = smollm2_tokenizer.eos_token_id
    in_prompt_eos = (enc["input_ids"] == eos) & (enc["attention_mask"] == 1)
    assert in_prompt_eos.sum(-1).min() >= 2  # system and user turns end with <|im_end|>, and stay attended

    torch.manual_seed(0)
    out = module.policy.generate(**enc, output_scores=True, return_dict_in_generate=True)
    prompt_len = enc["input_ids"].shape[1]
    response = out.sequences[:, prompt_len:]
    mask = pm.response_mask(response, eos)
    attention_mask = torch.cat([enc["attention_mask"], mask.long()], dim=1)
    with torch.no_grad():
        logits = module.networks.response_logits(module.policy, out.sequences, attention_mask, response.shape[1])
    ours = pm.logprobs_of(logits, response)
    sampler = pm.logprobs_of(torch.stack(out.scores, dim=1), response)
    assert torch.allclose(ours * mask, sampler * mask, atol=1e-4)


def test_left_padding_changes_nothing():
    """A prompt scores the same alone and left-padded beside a longer one, whatever the pad ids."""
    module = make_module()
    enc = module.sampler.encode(["a much longer prompt than the other", "short"])
    response = torch.tensor([[10, 11, 12], [13, 14, 15]])
    ids = torch.cat([enc["input_ids"], response], 1)
    attn = torch.cat([enc["attention_mask"], torch.ones_like(response)], 1)
    with torch.no_grad():
        batched = pm.logprobs_of(module.networks.response_logits(module.policy, ids, attn, 3), response)
        garbage = ids.clone()
        garbage[attn == 0] = 7  # change every padded prompt position
        garbled = pm.logprobs_of(module.networks.response_logits(module.policy, garbage, attn, 3), response)
        alone_enc = module.sampler.encode(["short"])
        alone_ids = torch.cat([alone_enc["input_ids"], response[1:]], 1)
        alone_attn = torch.cat([alone_enc["attention_mask"], torch.ones_like(response[1:])], 1)
        alone = pm.logprobs_of(module.networks.response_logits(module.policy, alone_ids, alone_attn, 3), response[1:])
    assert torch.allclose(batched, garbled, atol=1e-5)
    assert torch.allclose(batched[1], alone[0], atol=1e-5)


def test_trim_left_padding_drops_exactly_the_columns_padded_in_every_row():
    ids = torch.arange(12).view(2, 6)
    attn = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 0]])  # columns 0-1 are pad in both rows, column 2 is not
    trimmed_ids, trimmed_attn = trim_left_padding(ids, attn)
    assert torch.equal(trimmed_ids, ids[:, 2:]) and torch.equal(trimmed_attn, attn[:, 2:])
    assert trim_left_padding(ids, torch.ones_like(attn))[0].shape == (2, 6)  # no pad column: nothing dropped


@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_a_minibatch_of_short_prompts_scores_the_same_without_the_batchs_padding(critic):
    """Log-probs and values of the short rows equal (to fp32 rounding) those of the untrimmed
    forward, whose extra columns are the long prompt's padding: trimming changes the cost only."""
    module = make_module(critic=critic)
    enc = module.sampler.encode(["a much longer prompt than the other two", "short", "tiny"])
    response = torch.tensor([[10, 11, 12], [13, 14, 15], [16, 17, 18]])
    ids, attn = torch.cat([enc["input_ids"], response], 1)[1:], torch.cat([enc["attention_mask"], torch.ones_like(response)], 1)[1:]
    assert (attn[:, 0] == 0).all()  # the minibatch carries all-pad columns
    with torch.no_grad():
        logits, values = module.networks.policy_outputs(ids, attn, 3)
        out = module.policy(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), output_hidden_states=True)
        untrimmed = out.logits[:, -4:-1].float()
        untrimmed_values = (
            module.critic(ids, attn, position_ids(attn))[:, -4:-1]
            if critic == "separate"
            else module.critic(hidden=out.hidden_states[-1][:, -4:-1])
        )
    torch.testing.assert_close(pm.logprobs_of(logits, response[1:]), pm.logprobs_of(untrimmed, response[1:]), rtol=0, atol=1e-5)
    torch.testing.assert_close(values, untrimmed_values, rtol=0, atol=1e-5)


def test_rollout_masks_after_eos_and_puts_score_on_last_token():
    module = make_module(sampling=dict(max_new_tokens=40))
    torch.manual_seed(1)
    rollout = module.rollout(PROMPTS * 4)
    eos, pad = module.tokenizer.eos_token_id, module.tokenizer.pad_token_id
    lengths = rollout.response_mask.sum(-1).long()
    for row, length in zip(rollout.responses, lengths, strict=True):
        assert (row[length:] == pad).all()  # nothing after the first EOS survives
        assert (row[: length - 1] != eos).all()
    assert rollout.ended_with_eos.any() and (rollout.old_values * (1 - rollout.response_mask)).abs().sum() == 0
    # Every response ends with EOS or runs to max_new_tokens.
    assert ((lengths == 40) | rollout.ended_with_eos).all()
    scores = torch.arange(len(lengths), dtype=torch.float32)
    kl = module.regulariser.kl_per_token(rollout)
    rewards = pm.token_rewards(scores, kl, rollout.response_mask, beta=0.5)
    last = lengths - 1
    expected = -0.5 * kl
    expected[torch.arange(len(lengths)), last] += scores
    assert torch.allclose(rewards, expected)


def test_lora_reference_is_the_adapter_disabled_policy():
    module = make_module(lora=dict(rank=4))
    assert module.ref_model is None
    enc = module.sampler.encode(PROMPTS[:2])
    ids, attn = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad():
        base = module.networks.response_logits(module.policy.get_base_model(), ids, attn, 3)
        push_adapter(module)
        policy = module.networks.response_logits(module.policy, ids, attn, 3)
        with module.networks.reference() as ref:
            reference = module.networks.response_logits(ref, ids, attn, 3)
        after = module.networks.response_logits(module.policy, ids, attn, 3)
    assert not torch.allclose(policy, base, atol=1e-3)
    assert torch.allclose(reference, base, atol=1e-6)
    assert torch.allclose(after, policy)  # the adapter is back on after the reference pass
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_lora_generation_with_merged_adapter_samples_the_policy_and_restores_the_base():
    """Sampling with the adapter merged draws what the unmerged policy draws, from the policy (not
    the reference), and leaves the base weights where they were to within float32 rounding."""
    responses = {}
    for merge in (True, False):
        torch.manual_seed(0)  # peft draws lora_A from the global generator
        module = make_module(lora=dict(rank=4, merge_for_generation=merge), sampling=dict(max_new_tokens=8), seed=3)
        push_adapter(module)
        base = {n: p.detach().clone() for n, p in module.policy.named_parameters() if "base_layer" in n}
        rollout = module.rollout(PROMPTS)
        responses[merge] = rollout.responses
        drift = max(float((p - base[n]).abs().max()) for n, p in module.policy.named_parameters() if n in base)
        assert drift < 1e-6
        assert not any(getattr(m, "merged", False) for m in module.policy.modules())
        # the sampled tokens are likely under the policy: its old log-probs beat the reference's
        assert (
            float(pm.masked_mean(rollout.old_logprobs - rollout.ref_logprobs, rollout.response_mask)) > 0
        )  # E_pi = KL(pi, ref); E_ref would be < 0
    assert torch.equal(responses[True], responses[False])


def test_fit_raises_reward_and_logs_every_metric(tmp_path):
    """End to end on the tiny model: reward (number of 'e's) rises within 20 iterations."""
    module = make_module(sampling=dict(max_new_tokens=16), ppo=dict(num_minibatches=2, epochs=4, vf_coef=0.5))
    _, history = fit(module, tmp_path, iterations=20, batch_size=16)
    reward = history.series("objective/reward")
    assert len(reward) == 20
    first, last = sum(reward[:6]) / 6, sum(reward[-6:]) / 6
    assert last > first + 1.5, (first, last)
    for name in (
        "objective/kl",
        "objective/kl_max",
        "objective/kl_per_token",
        "objective/non_score_reward",
        "objective/net",
        "objective/entropy",
        "objective/beta",
        "policy/loss",
        "policy/clipfrac",
        "policy/approxkl",
        "value/loss",
        "value/clipfrac",
        "response/length",
        "timing/rollout_s",
        "timing/forward_s",
        "timing/score_s",
        "timing/update_s",
    ):
        assert all(torch.isfinite(torch.tensor(history.series(name)))), name
    row = history.rows[-1]
    assert abs(row["objective/net"] - (row["objective/reward"] - row["objective/beta"] * row["objective/kl"])) < 1e-4
    assert abs(row["objective/non_score_reward"] + row["objective/beta"] * row["objective/kl"]) < 1e-5
    assert row["objective/kl_max"] >= row["objective/kl"]
    assert module.iteration == 20


def test_adaptive_beta_follows_the_logged_kl(tmp_path):
    """beta_{t+1} = beta_t * (1 + clip(KL_t / target - 1, +-0.2) * n / horizon), with KL_t as logged."""
    from rlhf_lightning_plugins.beta_controllers import AdaptiveBeta

    controller = AdaptiveBeta(init_beta=0.2, target=0.5, horizon=40)
    _, history = fit(make_module(beta_controller=controller, kl_estimator="k3"), tmp_path, iterations=6)
    betas, kls = history.series("objective/beta"), history.series("objective/kl")
    expected = [0.2]
    for kl in kls[:-1]:
        expected.append(expected[-1] * (1 + min(max(kl / 0.5 - 1, -0.2), 0.2) * 8 / 40))
    assert torch.allclose(torch.tensor(betas), torch.tensor(expected), rtol=1e-5)
    assert len(set(round(b, 8) for b in betas)) > 1  # it moved


class _GradRecorder(Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(torch.cat([p.grad.flatten() for g in optimizer.param_groups for p in g["params"]]))


@pytest.mark.parametrize(
    "policy_loss, aggregation",
    [("ppo_clip", "token_mean"), ("gspo", "seq_mean_token_mean"), ("cispo", "seq_mean_token_sum"), ("dual_clip", "constant")],
)
def test_gradient_accumulation_equals_one_big_minibatch(tmp_path, policy_loss, aggregation):
    """Four accumulated micro-batches of 2 give the gradient of one minibatch of 8, for every
    aggregation: its weights' denominators are those of the whole minibatch."""
    grads = {}
    for steps in (1, 4):
        recorder = _GradRecorder()
        module = make_module(
            reward_model=char_reward("aeiou "),
            ppo=dict(gradient_accumulation_steps=steps, epochs=1),
            optim=dict(optimizers="shared", max_grad_norm=None),
            kl=dict(placement="both"),
            policy_loss=policy_loss,
            loss_aggregation=aggregation,
        )
        fit(module, tmp_path, iterations=1, callbacks=[recorder])
        grads[steps] = recorder.grads[0]
    assert grads[1].abs().sum() > 0
    assert torch.allclose(grads[1], grads[4], atol=1e-6, rtol=1e-4)


def _gradients_and_backward_passes(tmp_path, monkeypatch, apart: bool) -> tuple[list[torch.Tensor], int]:
    """One iteration with a separate critic: each optimizer step's gradients and the backward
    passes run; without ``apart`` the value loss is in the policy's (one backward pass of the sum)."""
    monkeypatch.setattr(PPORLHF, "_critic_apart", property(lambda self: apart))
    recorder, passes = _GradRecorder(), []
    module = make_module(critic="separate", ppo=dict(num_minibatches=2, gradient_accumulation_steps=2), kl=dict(placement="both"))
    manual_backward = module.manual_backward
    module.manual_backward = lambda loss: (passes.append(loss), manual_backward(loss))
    fit(module, tmp_path, iterations=1, callbacks=[recorder])
    return recorder.grads, len(passes)


def test_a_separate_critics_own_backward_pass_gives_the_gradients_of_the_summed_loss(tmp_path, monkeypatch):
    """A separate critic's value loss is a forward and backward pass of its own, after the policy's
    (under FSDP2 no root unit of one model is then held through the other's backward:
    docs/distributed.md): every optimizer step's gradients are, bit for bit, those of one backward
    pass of the sum, over two epochs of two minibatches of two accumulated micro-batches each."""
    apart, passes = _gradients_and_backward_passes(tmp_path, monkeypatch, apart=True)
    summed, summed_passes = _gradients_and_backward_passes(tmp_path, monkeypatch, apart=False)
    assert (passes, summed_passes) == (16, 8)  # 2 epochs x 2 minibatches x 2 micro-batches
    assert len(apart) == 4 and apart[0].abs().sum() > 0
    assert all(torch.equal(a, b) for a, b in zip(apart, summed, strict=True))


def _critic_forwards_and_gradients(tmp_path, monkeypatch, in_update: bool):
    """Two iterations of 2 epochs, one minibatch, a separate critic: each optimizer step's
    gradients, the critic trunk's forwards and each iteration's V_old; without ``in_update`` V_old
    is a forward of its own while scoring."""
    monkeypatch.setattr(PPORLHF, "old_values_in_update", property(lambda self: in_update and self._critic_apart))
    recorder, forwards = _GradRecorder(), []
    module = make_module(critic="separate", ppo=dict(epochs=2, whiten_advantages=True))
    module.critic.trunk.register_forward_pre_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    _, history = fit(module, tmp_path, iterations=2, callbacks=[recorder])
    return recorder.grads, forwards, [out["rollout"].old_values for out in history.outputs]


def test_a_separate_critics_old_values_come_from_the_first_minibatchs_forward(tmp_path, monkeypatch):
    """With one minibatch in one micro-batch, V_old is the update's first critic forward (the critic
    still has V_old's weights there): one no-grad trunk forward per iteration fewer, and the same
    V_old and optimizer-step gradients as with a forward of its own."""
    grads, forwards, old_values = _critic_forwards_and_gradients(tmp_path, monkeypatch, in_update=True)
    own_grads, own_forwards, own_old_values = _critic_forwards_and_gradients(tmp_path, monkeypatch, in_update=False)
    assert own_forwards == [False, True, True] * 2 and forwards == [True, True] * 2
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(old_values, own_old_values, strict=True))
    assert len(grads) == 4 and grads[0].abs().sum() > 0
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(grads, own_grads, strict=True))


def test_kl_as_loss_with_full_estimator(tmp_path):
    module = make_module(kl=dict(placement="loss"), ppo=dict(whiten_advantages=False), kl_estimator="full")
    _, history = fit(module, tmp_path, iterations=2)
    assert history.rows[-1]["policy/kl_loss"] >= 0  # the exact KL is never negative
    # The penalty is not in the reward: the trained reward is the raw score.
    assert history.rows[-1]["objective/reward_trained"] == history.rows[-1]["objective/reward"]


def test_checkpoint_round_trip_restores_beta_weights_and_iteration(tmp_path):
    from rlhf_lightning_plugins.beta_controllers import BandBeta

    module = make_module(beta_controller=BandBeta(init_beta=0.1, target=0.001))
    trainer, _ = fit(module, tmp_path, iterations=3)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert not any(k.startswith("ref_model.") for k in checkpoint["state_dict"])  # no second copy on disk
    assert module.beta_controller.beta != 0.1

    restored = make_module(beta_controller=BandBeta(init_beta=0.1, target=0.001))
    restored.on_load_checkpoint(checkpoint)
    restored.load_state_dict(checkpoint["state_dict"], strict=True)
    assert restored.beta_controller.beta == module.beta_controller.beta
    assert restored.iteration == 3
    for (name, a), b in zip(module.state_dict().items(), restored.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_kl_ignore_tokens_leaves_those_positions_out_of_the_penalty():
    module = make_module(sampling=dict(max_new_tokens=40), kl=dict(ignore_tokens=["eos", "e"]))
    torch.manual_seed(3)
    rollout = module.rollout(PROMPTS * 4)
    kl = module.regulariser.kl_per_token(rollout)
    full = (rollout.old_logprobs - rollout.ref_logprobs) * rollout.response_mask  # k1, no ignored tokens
    ignored = (rollout.responses == module.tokenizer.eos_token_id) | (rollout.responses == module.tokenizer.convert_tokens_to_ids("e"))
    assert ignored[rollout.response_mask.bool()].any()
    assert torch.equal(kl[ignored], torch.zeros_like(kl[ignored]))
    assert torch.equal(kl[~ignored], full[~ignored])
    with pytest.raises(ValueError, match=r"each of model.kl.ignore_tokens must be 'eos' or a single token of this tokenizer, got 'ee'"):
        make_module(kl=dict(ignore_tokens=["ee"]))


def test_gold_reward_is_logged_beside_the_proxy(tmp_path):
    module = make_module(reward_model=char_reward("e"), gold_reward_model=char_reward("aeiou"))
    _, history = fit(module, tmp_path, iterations=2)
    rollout = history.outputs[-1]["rollout"]
    expected = sum(sum(ch in "aeiou" for ch in r) for r in rollout.response_texts) / len(rollout.response_texts)
    assert history.rows[-1]["objective/gold_reward"] == pytest.approx(expected)
    assert history.rows[-1]["objective/gold_reward"] >= history.rows[-1]["objective/reward"]  # 'e' is a vowel


def test_export_merges_lora_and_transformers_loads_it(tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhf_lightning.callbacks import export_policy

    module = make_module(lora=dict(rank=4))
    push_adapter(module)
    export_policy(module, tmp_path / "policy")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, module.policy(input_ids=ids).logits, atol=1e-4)
    assert (tmp_path / "policy" / "tokenizer_config.json").exists()


def test_the_exported_files_have_the_permissions_of_the_run_s_other_files(tmp_path):
    """safetensors writes model.safetensors 0600 (a temporary file renamed): the export gives every file the mode
    a file written there gets (under umask 027: 0640, as Lightning's hparams.yaml beside it)."""
    from rlhf_lightning.callbacks import export_policy

    before = os.umask(0o027)
    try:
        (tmp_path / "hparams.yaml").write_text("{}\n")
        export_policy(make_module(), tmp_path / "policy")
    finally:
        os.umask(before)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "policy").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {stat.S_IMODE((tmp_path / "hparams.yaml").stat().st_mode)} == {0o640}
    assert not list((tmp_path / "policy").glob(".mode-probe*"))


@pytest.mark.parametrize("reference_update", [None, "EMA"])
def test_a_sharded_lora_policy_is_exported_through_an_unsharded_copy_built_from_the_config(tmp_path, monkeypatch, reference_update):
    """Under FSDP2 the export loads the gathered state into a copy the module builds again (its
    policy, then its adapters, with a moving reference's second one): the sharding stubbed out here,
    the rebuilt copy must take the state and export the same logits."""
    from transformers import AutoModelForCausalLM

    from rlhf_lightning import callbacks
    from rlhf_lightning_plugins.reference_updates import EMA

    moving = {"reference_update": EMA(0.5)} if reference_update else {}
    module = make_module(lora=dict(rank=4), **moving)
    push_adapter(module)
    monkeypatch.setattr(callbacks, "is_sharded", lambda policy: True)
    monkeypatch.setattr(callbacks, "full_state_dict", lambda policy: policy.state_dict())
    callbacks.export_policy(module, tmp_path / "policy")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, module.policy(input_ids=ids).logits, atol=1e-4)


@pytest.mark.parametrize("critic", ["shared", "separate"])
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_old_logprobs_and_values_from_the_sampler_equal_a_fresh_forward(smollm2_tokenizer, critic, lora_rank):
    """old_logprobs: sampler reuses generate's logits (and, with a shared critic, its last hidden
    states): the rollout must equal the one that recomputes them with a forward pass, on the
    same sampled tokens, with the chat template's in-prompt EOS tokens and left padding."""
    rollouts = {}
    for source in ("sampler", "forward"):
        torch.manual_seed(0)
        module = make_module(
            tokenizer="smollm2",
            tiny_config={"hidden_size": 32, "intermediate_size": 64},
            sampling=dict(max_new_tokens=6, temperature=0.7, old_logprobs=source),
            lora=dict(rank=lora_rank),
            critic=critic,
        )
        with torch.no_grad():
            module.critic.head.weight.copy_(torch.linspace(-1, 1, module.critic.head.weight.numel()).view_as(module.critic.head.weight))
        push_adapter(module)
        rollouts[source] = module.rollout(PROMPTS)
    sampler, forward = rollouts["sampler"], rollouts["forward"]
    assert torch.equal(sampler.responses, forward.responses)
    mask = forward.response_mask
    assert mask.sum() > 10
    for field in ("old_logprobs", "old_values", "entropy", "ref_logprobs"):
        assert torch.allclose(getattr(sampler, field) * mask, getattr(forward, field) * mask, atol=1e-4), field
    assert forward.old_values.abs().max() > 1e-3  # a zero value head would make the values check vacuous


def test_unknown_old_logprobs_source_is_refused():
    with pytest.raises(ValueError, match=r"model.sampling.old_logprobs must be 'sampler' or 'forward', got 'cache'"):
        PPORLHF(policy="tiny", reward_model=char_reward(), sampling=dict(old_logprobs="cache"))


@pytest.mark.parametrize("kl_penalty", ["loss", "both"])
def test_whitening_with_a_kl_loss_term_is_refused(kl_penalty):
    """Whitening divides the reward's advantages by their std and not the KL loss term: beta then no longer
    weighs the KL as configured (tests/test_exact.py, README: gap 0.50 instead of 0.001 on the bandit)."""
    with pytest.raises(ValueError, match=r"model.ppo.whiten_advantages must be false when the KL is in the loss"):
        PPORLHF(
            policy="tiny", reward_model=char_reward(), kl=dict(placement=kl_penalty), ppo=dict(whiten_advantages=True), kl_estimator="k3"
        )
    # By default (null) GAE whitens only while the KL is in the reward alone.
    assert (
        PPORLHF(policy="tiny", reward_model=char_reward(), kl=dict(placement=kl_penalty), kl_estimator="k3").ppo.whiten_advantages is False
    )
    assert PPORLHF(policy="tiny", reward_model=char_reward(), kl=dict(placement="reward")).ppo.whiten_advantages is True


def test_unknown_kl_loss_weighting_is_refused():
    with pytest.raises(ValueError, match=r"model.kl.loss_weighting must be 'none' or 'importance', got 'ratio'"):
        PPORLHF(policy="tiny", reward_model=char_reward(), kl=dict(loss_weighting="ratio"))


@pytest.mark.parametrize("estimator, warns", [("k3+", True), ("k1+", True), ("k3", False), ("full", False), ("k2", False)])
def test_straight_through_estimator_with_importance_weighting_warns(estimator, warns):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for weighting in ("importance", "none"):
            PPORLHF(
                policy="tiny",
                reward_model=char_reward(),
                kl=dict(placement="loss", loss_weighting=weighting, loss_scope="per_token"),
                ppo=dict(whiten_advantages=False),
                kl_estimator=estimator,
            )
    messages = [str(w.message) for w in caught if "not the derivative of its value" in str(w.message)]
    assert len(messages) == int(warns), messages


def test_grpo_with_the_kl_in_the_loss_warns_that_its_std_division_moves_the_optimum():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for advantage in ("grpo", "dr_grpo", "rloo"):
            PPORLHF(
                policy="tiny",
                reward_model=char_reward(),
                advantage_estimator=advantage,
                sampling=dict(num_generations=2),
                kl=dict(placement="loss"),
                kl_estimator="k3",
            )
    messages = [str(w.message) for w in caught if "group's reward std" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith("model.advantage_estimator GRPO divides"), messages


@pytest.mark.parametrize("estimator, refused", [("k2", True), ("abs", True), ("k1", False), ("k3", False), ("full", False), ("k3+", False)])
def test_the_sequence_kl_loss_needs_an_estimator_whose_value_is_unbiased(estimator, refused):
    """The KL still to come is estimated from the estimator's values: k2 and abs estimate another quantity."""
    build = lambda: PPORLHF(policy="tiny", reward_model=char_reward(), kl=dict(placement="loss"), kl_estimator=estimator)
    if refused:
        with pytest.raises(ValueError, match=r"model.kl.loss_scope must be 'per_token' with model.kl_estimator .* or use k1, k3 or full"):
            build()
    else:
        assert build().kl.loss_scope == "sequence"


def test_kl_loss_is_the_importance_weighted_term_and_the_rollout_kl_stays_unweighted(tmp_path):
    """policy/kl_loss is the mean of w_t k_t over the minibatches; objective/kl is the rollout's own
    (unweighted) estimate. On the first minibatch w = 1 exactly (old_logprobs: forward), so the loss
    term there equals the rollout's per-token mean."""
    module = make_module(
        kl=dict(placement="loss"), ppo=dict(whiten_advantages=False, epochs=1), sampling=dict(old_logprobs="forward"), kl_estimator="k3"
    )
    seen = []
    original = module.update.loss

    def recording(rollout, advantages, returns, idx, beta, weights, critic=True):
        loss = original(rollout, advantages, returns, idx, beta, weights, critic)
        seen.append((float(module.update_stats["policy__kl_loss"].compute()), idx))
        return loss

    module.update.loss = recording
    _, history = fit(module, tmp_path, iterations=1)
    rollout, kl = history.outputs[-1]["rollout"], history.outputs[-1]["kl"]
    first_kl_loss, first_idx = seen[0]
    mask = rollout.response_mask[first_idx]
    assert first_kl_loss == pytest.approx(float((kl[first_idx] * mask).sum() / mask.sum()), rel=1e-5)
    assert history.rows[-1]["objective/kl"] == pytest.approx(float(kl.sum(-1).mean()), rel=1e-5)


def test_only_estimators_that_read_the_sampled_token_take_the_importance_ratio():
    """The ratio pi_theta(y_t) / pi_old(y_t) corrects the sampling of y_t; full sums over the whole
    vocabulary at t, so its value does not depend on y_t and it is left unweighted."""
    from rlhf_lightning.registry import registry

    depends = {name: registry("kl_estimator").build(name).reads_sampled_token() for name in ("k1", "k3", "k3+", "full")}
    assert depends == {"k1": True, "k3": True, "k3+": True, "full": False}


def test_iteration_timer_logs_the_wall_clock_between_batch_ends(monkeypatch):
    """timing/iteration_s: the first iteration from its own start, each later one from the end of
    the one before (so the time between batches counts), at the iteration's step (0-based, as its other scalars)."""
    from types import SimpleNamespace

    from rlhf_lightning import callbacks

    clock = iter([10.0, 12.5, 17.0])  # start of batch 0, its end, the end of batch 1 (no read at its start)
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    logged = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append((step, metrics)))
    trainer, module = SimpleNamespace(loggers=[logger]), SimpleNamespace(device=torch.device("cpu"), step=0)
    timer = callbacks.IterationTimer()
    timer.on_train_batch_start(trainer, module, None, 0)
    timer.on_train_batch_end(trainer, module, None, None, 0)
    module.step = 1
    timer.on_train_batch_start(trainer, module, None, 1)
    timer.on_train_batch_end(trainer, module, None, None, 1)
    assert logged == [(0, {"timing/iteration_s": 2.5}), (1, {"timing/iteration_s": 4.5})]
