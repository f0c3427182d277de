"""The ``vllm`` rollout engine against the trainer, on tiny random models (vLLM loads them from the
safetensors folder the engine writes): weight sync (full, LoRA merged, tied embeddings), the same
responses as ``hf`` where sampling is deterministic, the kept set and EOS rules, the mismatch metrics
and exact resume. Marked ``vllm``: skipped where vLLM is not importable (tools/setup.sh --vllm
installs it and runs them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from rlhf_lightning.interfaces import ConfigError
from rlhf_lightning_plugins.reference_updates import Sync
from rlhf_lightning_plugins.rollout_engines import VLLMEngine

from helpers import RecordWeights, StopAfter, declared_optimum_run, fit, make_module, response_logprobs, save_tiny_teacher

pytestmark = pytest.mark.vllm

# vLLM's CPU attention has kernels for heads of 32 dimensions and more: the tiny model with 2 heads of 32.
HEADS_OF_32 = {"num_attention_heads": 2, "num_key_value_heads": 2}
PROMPTS = ["hello", "abc", "the cat", "q"]
FP32_ROUNDING = 1e-4  # measured 1e-6 to 3e-5: the engine's kernels and the trainer's differ in summation order


def small_engine() -> VLLMEngine:
    return VLLMEngine(kv_cache_gib=0.125)  # the tiny models' KV cache: 128 MiB, not the default 1 GiB


def vllm_module(**overrides):
    kwargs = dict(rollout_engine=small_engine(), old_logprobs="forward", tiny_config=HEADS_OF_32, temperature=0.8, top_p=0.9)
    return make_module(**{**kwargs, **overrides})


def max_diff(rollout) -> float:
    return float(((rollout.trainer_logprobs - rollout.sampler_logprobs) * rollout.response_mask).abs().max())


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"lora_rank": 4, "lora_sync": "merged"},
        {"lora_rank": 4},
        {"tiny_config": {**HEADS_OF_32, "tie_word_embeddings": True}},
    ],
    ids=["full", "lora_merged", "lora_adapter", "tied_embeddings"],
)
def test_weight_sync_makes_the_engine_score_as_the_trainer(overrides):
    """Before any update the engine's log-probs are the trainer's (fp32 rounding); after the policy's
    weights change they are not until a sync, and after it they are again. LoRA: by default
    (``lora_sync: auto``) the engine serves the adapter apart and a sync moves the adapter's bytes
    alone (rank 4 on the tiny model: 1/10 of the model's); ``merged`` moves the whole model."""
    overrides = dict(overrides)
    engine = VLLMEngine(kv_cache_gib=0.125, lora_sync=overrides.pop("lora_sync", "auto"))  # built here: collected without vLLM too
    module = vllm_module(rollout_engine=engine, **overrides)
    assert max_diff(module.rollout(PROMPTS * 2)) < FP32_ROUNDING
    assert (engine.adapter is not None) == (overrides.get("lora_rank", 0) > 0 and engine.lora_sync == "auto")
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for name, param in module.policy.named_parameters():
            if param.requires_grad and (not overrides.get("lora_rank") or "lora_B" in name):
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    stale = max_diff(module.rollout(PROMPTS * 2))  # global_step unchanged: the engine does not know
    assert stale > 100 * FP32_ROUNDING and engine.syncs == 0
    engine.sync(module)
    assert max_diff(module.rollout(PROMPTS * 2)) < FP32_ROUNDING and engine.syncs == 1
    model_bytes = sum(p.numel() * p.element_size() for n, p in module.policy.named_parameters() if "lora_" not in n)
    adapter_bytes = sum(p.numel() * p.element_size() for n, p in module.policy.named_parameters() if ".lora_" in n)
    tied = overrides.get("tiny_config", {}).get("tie_word_embeddings", False)
    expected = adapter_bytes if engine.adapter is not None else model_bytes
    assert engine.sync_bytes == [expected], (engine.sync_bytes, model_bytes, adapter_bytes, tied)
    print(f"bytes per sync: {engine.sync_bytes[0]} ({engine.sync_bytes[0] / model_bytes:.3f} of the model's)")


def test_greedy_responses_equal_hf_and_sampled_ones_follow_its_rules():
    """Greedy: vLLM's responses are ``hf``'s token for token (same prompts, EOS, lengths). Sampled
    with top_k, top_p and min_new_tokens: every token in the trainer's kept set, no EOS before
    min_new_tokens, at most max_new_tokens, and the log-probs of the declared distribution."""
    prompts = PROMPTS * 2
    greedy = {
        name: make_module(rollout_engine=engine, sampling=dict(do_sample=False), tiny_config=HEADS_OF_32).rollout(prompts)
        for name, engine in (("hf", "hf"), ("vllm", small_engine()))
    }
    assert torch.equal(greedy["hf"].responses, greedy["vllm"].responses)
    assert torch.equal(greedy["hf"].response_mask, greedy["vllm"].response_mask)
    module = vllm_module(top_k=30, top_p=0.8, min_new_tokens=4, max_new_tokens=10)
    rollout = module.rollout(prompts * 4)
    mask = rollout.response_mask.bool()
    assert rollout.responses.shape[1] <= 10
    assert rollout.kept.gather(-1, rollout.responses[..., None])[..., 0][mask].all()
    assert not (rollout.responses[:, :4] == module.tokenizer.eos_token_id).any()
    assert max_diff(rollout) < FP32_ROUNDING
    assert rollout.ended_with_eos.any() or mask.all()


def test_training_syncs_after_every_update_and_logs_the_mismatch(tmp_path):
    """Three iterations: a sync before each rollout after the first (the weights changed), none
    when nothing did, and every iteration's logged mismatch at fp32 rounding."""
    module = vllm_module(ppo_epochs=1, lr=1e-2, critic_lr=1e-2)
    _, history = fit(module, tmp_path, iterations=3, batch_size=4)
    assert module.rollout_engine.syncs == 2
    for row in history.rows:
        assert row["rollout/logprob_diff_max"] < FP32_ROUNDING
        assert row["rollout/sampler_trainer_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    module.rollout(PROMPTS)  # the third update's weights: one more sync
    module.rollout(PROMPTS)  # nothing changed: none
    assert module.rollout_engine.syncs == 3 and module.rollout_engine.synced_step == module.global_step


def test_refused_under_fsdp_version_1_only():
    """At set-up (``PPORLHF.setup``, before any rollout): FSDP (version 1) is refused, naming the field;
    FSDP2, DDP and more than one process are served (one engine per rank: tests/test_vllm_ranks.py); asynchronous
    rollouts (DDP or one process: FSDP2 is refused by the sampler) with any but sleep mode."""
    engine = vllm_module().rollout_engine
    synchronous, stale = SimpleNamespace(max_staleness=0), SimpleNamespace(max_staleness=1)
    message = r"model.rollout_engine must be 'hf' under FSDP \(version 1.*, got 'vllm with FSDPStrategy'"
    with pytest.raises(ConfigError, match=message):
        engine.setup(SimpleNamespace(_trainer=SimpleNamespace(strategy=FSDPStrategy(), world_size=1), off_policy=synchronous))
    for strategy, processes in ((ModelParallelStrategy, 2), (SingleDeviceStrategy, 2)):
        engine.setup(SimpleNamespace(_trainer=SimpleNamespace(strategy=strategy(), world_size=processes), off_policy=synchronous))
    engine.setup(SimpleNamespace(_trainer=SimpleNamespace(strategy=SingleDeviceStrategy(), world_size=2), off_policy=stale))
    engine.sleep = 1
    message = r"^model\.off_policy\.max_staleness must be 0 with rollout_engine\.sleep .*got '1 with rollout_engine\.sleep 1'"
    with pytest.raises(ConfigError, match=message):
        engine.setup(SimpleNamespace(_trainer=SimpleNamespace(strategy=SingleDeviceStrategy(), world_size=1), off_policy=stale))


def test_groups_of_generations_differ_and_a_moving_reference_is_followed(tmp_path):
    """GRPO with 4 generations per prompt: each group's rows draw from seeds of their own, so no group
    is 4 copies of one response; with the reference synced to the policy after every iteration,
    every later rollout's KL is exactly 0 (the trainer scores pi_old and the reference, equal weights)
    while the engine keeps following the policy (a sync per update, mismatch at fp32 rounding)."""
    settings = dict(
        ppo_epochs=1, lr=1e-2, critic_lr=None, num_generations=4, advantage_estimator="grpo", critic="none", reference_update=Sync(1)
    )
    module = vllm_module(**settings)
    _, history = fit(module, tmp_path, iterations=3, batch_size=2)
    initial = vllm_module(**settings).policy  # the same seeded initialisation: the policy did move away from it
    assert max((p - q).abs().max().item() for p, q in zip(module.policy.parameters(), initial.parameters(), strict=True)) > 1e-3
    for output in history.outputs:
        responses = output["rollout"].response_texts
        assert len(responses) == 8 and all(len(set(responses[i : i + 4])) > 1 for i in (0, 4)), responses
    assert history.series("objective/kl") == pytest.approx([0.0, 0.0, 0.0], abs=1e-6)  # the first: the reference starts as the policy
    assert module.rollout_engine.syncs == 2 and max(history.series("rollout/logprob_diff_max")) < FP32_ROUNDING


class SaveAtIteration(Callback):
    def __init__(self, iteration: int, path) -> None:
        self.iteration, self.path = iteration, path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.iteration == self.iteration:
            trainer.save_checkpoint(self.path)


def test_resume_draws_the_same_responses(tmp_path):
    """Four iterations straight, checkpointed after the second; a new module resumed from it runs
    the last two: the engine restarts from the checkpoint's weights, each row's seed is the run's,
    so the rollouts and metrics are the straight run's."""
    path = tmp_path / "half.ckpt"
    _, straight = fit(vllm_module(ppo_epochs=1), tmp_path / "a", iterations=4, batch_size=4, callbacks=[SaveAtIteration(2, path)])
    _, resumed = fit(vllm_module(ppo_epochs=1), tmp_path / "b", iterations=4, batch_size=4, ckpt_path=str(path))
    assert len(resumed.rows) == 2
    for key in ("objective/kl", "objective/reward", "response/length", "rollout/logprob_diff_max"):
        assert resumed.series(key) == pytest.approx(straight.series(key)[2:], abs=1e-5), key
    assert [o["rollout"].response_texts for o in resumed.outputs] == [o["rollout"].response_texts for o in straight.outputs[2:]]


def test_training_with_vllm_reaches_the_declared_optimum_with_the_correction():
    """``optimum_check --engine vllm --temperature 0.7 --top-p 0.9 --beta 1 --rollout-correction tis`` (about
    30 s): vLLM samples, log pi_old from the trainer's forward weighted by the truncated IS ratio; the gap
    to the declared objective's optimum is <= 0.02 and that optimum is not a point mass. Top-p 0.9 as in
    the hf engine's test: at 0.8 the kept sets shrink to one response on some sampling streams (2 kept,
    top probability 0.88 with hf on 2026-11-28), where the optimum is that response."""
    last, kept = declared_optimum_run(rollout_engine=small_engine(), old_logprobs="forward", rollout_correction="tis", top_p=0.9)
    assert last["gap"] <= 0.02
    assert 2 <= kept["responses"] < 27 and kept["optimum_top_prob"] < 0.8 and last["optimum_kl_to_ref"] > 0.05


def test_with_a_foreign_reference_the_engine_serves_the_policy_and_the_teacher_scores_log_pi_ref(tmp_path):
    """``model.reference`` another model (a teacher) with the vllm engine: the engine samples and scores the
    policy only (its log-probs the trainer's, fp32 rounding), log pi_ref are the teacher's own from a plain
    transformers forward, and the KL is taken between the two, before and after a trained iteration."""
    from transformers import AutoModelForCausalLM

    teacher = save_tiny_teacher(tmp_path / "teacher")
    module = vllm_module(reference=teacher, temperature=1.0, top_p=1.0)  # the raw distributions: the teacher's log-softmax
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher)
    for trained in (False, True):
        if trained:  # an update, then a sync at the next rollout: the engine follows the policy, not the teacher
            fit(module, tmp_path / "run", iterations=1, batch_size=4)
        rollout = module.rollout(PROMPTS * 2)
        mask = rollout.response_mask
        assert max_diff(rollout) < FP32_ROUNDING and module.rollout_engine.syncs == int(trained)
        teacher_logprobs = response_logprobs(teacher_model, rollout)
        assert torch.allclose(rollout.ref_logprobs * mask, teacher_logprobs, atol=1e-4)
        assert float(((rollout.sampler_logprobs - teacher_logprobs) * mask).abs().max()) > 0.1  # the engine is not the teacher
        kl = module.regulariser.kl_per_token(rollout)
        assert torch.allclose(kl, (rollout.old_logprobs - teacher_logprobs) * mask, atol=1e-4)


# ---------------------------------------------------------------------- asynchronous rollouts (model.off_policy)

# k = 1; temperature 1 and top-p 1: the engine's log-probs are the raw distribution's, a plain forward's
STALE = dict(off_policy=dict(max_staleness=1), ppo_epochs=1, lr=1e-2, critic_lr=1e-2, temperature=1.0, top_p=1.0)


def stale_fit(tmp_path, concurrent: bool = True, iterations: int = 4, callbacks=(), ckpt_path=None, **overrides):
    module = vllm_module(**{**STALE, **overrides})
    module.async_rollouts.concurrent = concurrent
    weights = RecordWeights()
    _, history = fit(module, tmp_path, iterations, batch_size=4, callbacks=[weights, *callbacks], ckpt_path=ckpt_path)
    return module, history, weights.versions


def test_asynchronous_batches_are_drawn_by_the_weights_one_update_old(tmp_path):
    """k = 1, four iterations, the sampler thread driving the engine: each iteration i's responses and behaviour
    log-probs are those the engine draws from version i - 1's weights (i = 0: 0) with iteration i's seed, token for
    token; those log-probs are version i - 1's own (a plain forward of those weights, fp32 rounding: the engine
    served them), and version i's weights draw other responses for some batch."""
    module, history, versions = stale_fit(tmp_path)
    engine = module.rollout_engine
    assert module.async_rollouts.handed_ahead == 3  # iterations 1, 2, 3 drawn while the one before trained
    assert history.series("off_policy/staleness_mean") == [0.0, 1.0, 1.0, 1.0]
    differs = 0
    for i, out in enumerate(history.outputs):
        rollout = out["rollout"]
        mask = rollout.response_mask
        assert rollout.policy_version.tolist() == [max(0, i - 1)] * len(rollout.prompts)
        drawn = {}
        for version in (max(0, i - 1), i):  # the engine brought to each version's weights by hand, then drawing batch i
            with torch.no_grad():
                for name, p in module.policy.named_parameters():
                    p.copy_(versions[version][name])
            engine.sync(module)
            enc = module.sampler.encode(rollout.prompts)
            samples = engine.checked_sample(module, enc, module.sampler.seed(i))
            drawn[version] = (samples.sequences[:, enc["input_ids"].shape[1] :], samples.logprobs)
        by_hand, mu = drawn[max(0, i - 1)]
        n = rollout.responses.shape[1]
        assert torch.equal(by_hand[:, :n].masked_fill(mask == 0, 0), rollout.responses.masked_fill(mask == 0, 0)), i
        torch.testing.assert_close(rollout.sampler_logprobs * mask, mu[:, :n] * mask, rtol=0, atol=0)
        with torch.no_grad():
            for name, p in module.policy.named_parameters():
                p.copy_(versions[max(0, i - 1)][name])
        assert float((rollout.sampler_logprobs * mask - response_logprobs(module.policy, rollout)).abs().max()) < FP32_ROUNDING
        differs += not torch.equal(drawn[i][0], by_hand)
    assert differs >= 1  # the stale weights' batches are not the current weights'


@pytest.mark.parametrize("overrides", [{}, {"lora_rank": 4}], ids=["full", "lora_adapter"])
def test_asynchronous_thread_and_in_line_sampler_train_the_same_weights(tmp_path, overrides):
    """k = 1, four iterations: the engine driven by the sampler thread and by the trainer's thread (the in-line
    sampler) gives the same responses, metrics and final weights, bit for bit; under LoRA each sync moves the
    adapter alone (the engine serves it apart)."""
    (a, ha, _), (b, hb, _) = (stale_fit(tmp_path / str(c), c, **overrides) for c in (False, True))
    for (name, p), q in zip(a.policy.named_parameters(), b.policy.parameters(), strict=True):
        assert torch.equal(p, q), name
    for key in ("objective/reward", "objective/kl", "policy/loss", "rollout/logprob_diff_max"):
        assert ha.series(key) == hb.series(key), key
    assert [o["rollout"].response_texts for o in ha.outputs] == [o["rollout"].response_texts for o in hb.outputs]
    assert ha.series("objective/kl")[-1] != 0  # the policy moved away from the reference
    engine = b.rollout_engine
    assert engine.syncs == 2  # versions 1 and 2 (iterations 2 and 3); iterations 0 and 1 are drawn from version 0
    if overrides:
        adapter = sum(p.numel() * p.element_size() for n, p in b.policy.named_parameters() if ".lora_" in n)
        assert engine.adapter is not None and engine.sync_bytes == [adapter, adapter]


def test_asynchronous_run_stopped_and_resumed_trains_the_weights_of_one_never_stopped(tmp_path):
    """k = 1: six iterations straight against three, a checkpoint holding the batch in flight, and three more from it
    (a fresh engine started from the checkpoint's weights): the same weights and metrics, bit for bit."""
    straight, history, _ = stale_fit(tmp_path / "straight", iterations=6)
    ckpt = tmp_path / "stopped.ckpt"
    stopped, _, _ = stale_fit(tmp_path / "stopped", iterations=6, callbacks=[StopAfter(3, ckpt)])
    assert stopped.iteration == 3
    resumed, after, _ = stale_fit(tmp_path / "resumed", iterations=6, ckpt_path=str(ckpt))
    assert resumed.iteration == 6
    for (name, p), q in zip(straight.policy.named_parameters(), resumed.policy.parameters(), strict=True):
        assert torch.equal(p, q), name
    for key in ("objective/reward", "objective/kl", "policy/loss", "off_policy/staleness_mean"):
        assert after.series(key) == history.series(key)[3:], key


def test_asynchronous_training_with_vllm_reaches_the_declared_optimum():
    """The optimum test above sampled one update behind by the engine (max_staleness 1, the default sequence
    correction from the engine's own log-probs as mu): the gap to the declared objective's optimum is <= 0.02
    (0.0054 on 2026-11-29)."""
    last, kept = declared_optimum_run(rollout_engine=small_engine(), old_logprobs="forward", off_policy=dict(max_staleness=1), top_p=0.9)
    assert last["gap"] <= 0.02
    assert 2 <= kept["responses"] < 27 and kept["optimum_top_prob"] < 0.8 and last["optimum_kl_to_ref"] > 0.05


def test_episodes_on_the_vllm_engine_score_the_ids_it_drew():
    """Two-turn episodes drawn by vLLM, the environment's text appended between its turns: the trainer's forward over
    the episode gives vLLM's log-probs of the policy's tokens (fp32 rounding), and greedy episodes are ``hf``'s."""
    from helpers import Echo

    module = vllm_module(environment=Echo(text="ok", turns=2), max_new_tokens=6)
    rollout = module.rollout(PROMPTS * 2)
    assert rollout.episode.policy_turns.tolist() == [2] * 8
    assert max_diff(rollout) < FP32_ROUNDING
    greedy = {
        name: make_module(
            rollout_engine=engine, environment=Echo(text="ok", turns=2), sampling=dict(do_sample=False), tiny_config=HEADS_OF_32
        ).rollout(PROMPTS)
        for name, engine in (("hf", "hf"), ("vllm", small_engine()))
    }
    assert torch.equal(greedy["hf"].responses, greedy["vllm"].responses)
    assert torch.equal(greedy["hf"].response_mask, greedy["vllm"].response_mask)


def test_a_policy_vllm_cannot_serve_is_refused_at_start_up_and_a_failure_inside_it_names_the_engine(monkeypatch):
    """Heads of 16 dimensions (the default tiny model's), which vLLM's CPU attention has no kernel for, are refused
    before any model loads; any other failure of vLLM's start is one error naming model.rollout_engine and the
    settings it was started with, not vLLM's traceback alone."""
    import vllm

    from rlhf_lightning.checks import ConfigError

    module = make_module(rollout_engine=small_engine(), tiny_config={"num_attention_heads": 4, "num_key_value_heads": 4})
    with pytest.raises(ConfigError, match=r"model.rollout_engine must be 'hf' for a policy whose attention heads have fewer than 32"):
        module.rollout_engine.setup(module)
    module = vllm_module()
    module.rollout_engine.setup(module)  # heads of 32: served

    def fails(*args, **kwargs):
        raise RuntimeError("Not enough memory for the KV cache")

    monkeypatch.setattr(vllm, "LLM", fails)
    with pytest.raises(ConfigError, match=r"model.rollout_engine vllm could not start on the policy \(RuntimeError: Not enough memory"):
        module.rollout(PROMPTS)
