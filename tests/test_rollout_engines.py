"""Rollout engines and the declared sampling distribution (rlhf_lightning/sampling.py): the kept set
against transformers' own warpers, the renormalised log-probs, the rollout correction's weights and
the mismatch metrics by hand, the KL estimators' means against the enumerated KL of the declared
distributions, and a sampler with a known log-prob error corrected back to the optimum."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from rlhf_lightning import sampling
from rlhf_lightning.exact.closed_form import kl_divergence
from rlhf_lightning.exact.tasks import TASKS, ExactPPORLHF
from rlhf_lightning.exact.training import train
from rlhf_lightning.interfaces import ConfigError, Samples
from rlhf_lightning.registry import registry
from rlhf_lightning_plugins.beta_controllers import FixedBeta
from rlhf_lightning_plugins.rollout_engines import DeclaredDraw, HFGenerate, VLLMEngine

from helpers import EXACT_RUN, declared_optimum_run, make_module


# ------------------------------------------------------------------ the kept set, by hand and against transformers
def test_kept_set_by_hand():
    # probabilities 0.5, 0.3, 0.15, 0.05; ascending cumulative 0.05, 0.2, 0.5, 1: top_p 0.75 removes
    # every token whose cumulative is <= 0.25 (the last two); top_k 3 removes the 0.05 token.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert sampling.kept_tokens(logits, top_p=0.75).tolist() == [True, True, False, False]
    assert sampling.kept_tokens(logits, top_k=3).tolist() == [True, True, True, False]
    assert sampling.kept_tokens(logits, top_p=0.3).tolist() == [True, False, False, False]  # the most likely always stays
    assert sampling.kept_tokens(logits) is None
    # renormalised on {0, 1}: 0.5 / 0.8 and 0.3 / 0.8
    restricted = sampling.restrict(logits, sampling.kept_tokens(logits, top_p=0.75)).log_softmax(-1).exp()
    assert restricted.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-6)
    banned = torch.tensor([True, False, False, False])  # EOS before min_new_tokens: removed before top-p
    assert sampling.kept_tokens(logits, top_p=0.75, banned=banned).tolist() == [False, True, True, False]


@pytest.mark.parametrize("top_k, top_p", [(0, 0.8), (5, 1.0), (7, 0.6), (0, 0.95)])
def test_kept_set_is_transformers_warpers_set(top_k, top_p):
    """The same tokens as transformers' TemperatureLogitsWarper -> TopK -> TopP chain (what generate samples from)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(top_k)) * 3
    chain = [TemperatureLogitsWarper(0.7)] + ([TopKLogitsWarper(top_k)] if top_k else []) + [TopPLogitsWarper(top_p)]
    scores = LogitsProcessorList(chain)(None, logits.clone())
    kept = sampling.kept_tokens(logits / 0.7, top_k, top_p)
    assert torch.equal(kept, torch.isfinite(scores))
    assert 0 < kept.sum(-1).float().mean() < 50  # it truncates


def test_correction_weights_and_mismatch_metrics_by_hand():
    # trainer log-probs minus the sampler's: log 4, log 0.25, log 1.5, 0 -> w = 4, 0.25, 1.5, 1
    trainer = torch.tensor([[math.log(4), math.log(0.25)], [math.log(1.5), 0.0]]) - 1.0
    sampler = torch.full((2, 2), -1.0)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # the last token is padding: left out (weight 0)
    weights = {mode: sampling.correction_weights(trainer, sampler, mask, mode, 2.0) for mode in ("tis", "mis", "seq_tis", "seq_mis")}
    assert weights["tis"].flatten().tolist() == pytest.approx([2.0, 0.25, 1.5, 0.0])
    assert weights["mis"].flatten().tolist() == pytest.approx([0.0, 0.0, 1.5, 0.0])
    # per response: 4 * 0.25 = 1 for the first, 1.5 for the second (its padding's 1 left out)
    assert weights["seq_tis"].flatten().tolist() == pytest.approx([1.0, 1.0, 1.5, 0.0])
    assert weights["seq_mis"].flatten().tolist() == pytest.approx([1.0, 1.0, 1.5, 0.0])
    assert sampling.correction_weights(trainer, sampler, mask, "none", 2.0) is None
    metrics = sampling.mismatch_metrics(trainer, sampler, mask)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(math.log(4))
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx((2 * math.log(4) + math.log(1.5)) / 3)
    assert metrics["rollout/sampler_trainer_ratio_mean"] == pytest.approx((0.25 + 4 + 1 / 1.5) / 3)
    assert metrics["rollout/sampler_trainer_ratio_max"] == pytest.approx(4.0)


# ------------------------------------------------------------------ the hf engine in the module
def test_hf_rollout_samples_inside_the_kept_set_and_replays_it():
    """With top_k and top_p every sampled token is in its kept set, the trainer's forward on the kept
    set gives the sampler's log-probs (fp32 rounding), EOS is out of the kept set before
    min_new_tokens, and each position's declared distribution sums to 1."""
    module = make_module(sampling=dict(top_k=20, top_p=0.7, temperature=0.8, min_new_tokens=3, old_logprobs="forward"))
    rollout = module.rollout(["hello", "abc", "xyz", "q"] * 4)
    kept, response, mask = rollout.kept, rollout.responses, rollout.response_mask.bool()
    assert kept.gather(-1, response.unsqueeze(-1)).squeeze(-1)[mask].all()
    assert not kept[:, :3, module.tokenizer.eos_token_id].any()
    assert kept.sum(-1)[mask].float().mean() < 20  # top-p truncates below top-k
    assert (rollout.trainer_logprobs - rollout.sampler_logprobs)[mask].abs().max() < 1e-4
    probs = sampling.restrict(module.networks.response_logits(module.policy, rollout.input_ids, rollout.attention_mask, 12), kept).softmax(
        -1
    )
    assert torch.allclose(probs.sum(-1), torch.ones(()), atol=1e-5) and probs[~kept].max() == 0


def test_vllm_engine_without_vllm_is_refused_naming_the_field():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ConfigError, match=r"model.rollout_engine must be an installed vLLM for 'vllm'"):
        make_module(rollout_engine="vllm")


@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_a_kv_cache_that_is_not_positive_is_refused_before_vllm_is_looked_for(value):
    with pytest.raises(ConfigError, match=r"rollout_engine.kv_cache_gib must be a finite number > 0, got"):
        VLLMEngine(kv_cache_gib=value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"top_p": 0.0}, r"model.sampling.top_p must be a finite number in \(0, 1\]"),
        ({"top_p": 1.5}, r"model.sampling.top_p must be a finite number in \(0, 1\]"),
        ({"top_k": -1}, r"model.sampling.top_k must be an integer >= 0"),
        ({"rollout_correction": "clip"}, r"model.sampling.rollout_correction must be one of none, tis, mis, seq_tis, seq_mis"),
        (
            {"rollout_correction": "tis"},
            r"model.sampling.rollout_correction must be 'none' unless model.sampling.old_logprobs is 'forward'",
        ),
        ({"rollout_correction_cap": 0.5}, r"model.sampling.rollout_correction_cap must be a finite number >= 1"),
        ({"rollout_engine": "sglang"}, r"unknown rollout_engine 'sglang'; registered rollout_engine names: hf, vllm"),
    ],
)
def test_bad_sampling_settings_are_refused_before_any_model_loads(overrides, message):
    with pytest.raises((ConfigError, KeyError), match=message):
        make_module(**overrides)


# ------------------------------------------------------------------ the KL of the declared distributions
def _declared_tables(module: ExactPPORLHF, estimator) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q(y), E-terms) per prompt and response: the policy's declared log-probs and the estimator's
    summed value on every response, with the policy's kept sets replayed for the reference."""
    input_ids, attention_mask, _ = module._all_responses()
    length = module.task.response_length
    logits = module.networks.response_logits(module.policy, input_ids, attention_mask, length)
    with module.networks.reference() as ref:
        ref_logits = module.networks.response_logits(ref, input_ids, attention_mask, length)
    kept = sampling.kept_tokens(logits, module.sampling.top_k, module.sampling.top_p)
    logits, ref_logits = sampling.restrict(logits, kept), sampling.restrict(ref_logits, kept)
    response = input_ids[:, -length:]
    logprobs, ref_logprobs = logits.log_softmax(-1).gather(-1, response[..., None])[..., 0], None
    ref_logprobs = ref_logits.log_softmax(-1).gather(-1, response[..., None])[..., 0]
    values = estimator(logprobs, ref_logprobs, logits, ref_logits).sum(-1)
    shape = (len(module.task.prompts), -1)
    return logprobs.double().sum(-1).view(shape), values.double().view(shape)


def test_estimator_means_equal_the_enumerated_kl_of_the_declared_distributions():
    """Temperature 0.7, top-p 0.8 on the enumerable task, policy moved away from the reference: each
    registered estimator's mean over 3000 sampled responses equals its expectation enumerated over
    every response under the declared distributions within 3 standard errors; for the estimators
    with an unbiased value (k1, k3, full) that expectation is the enumerated KL(q || r_K). The KL of
    the untruncated tempered distributions is more than 3 standard errors away: the test tells them apart."""
    torch.manual_seed(0)
    module = ExactPPORLHF(TASKS["terminal"], temperature=0.7, top_p=0.8, kl_estimator="full", seed=0)
    module.configure_model()
    with torch.no_grad():
        for param in module.policy.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    rollout = module.rollout(list(module.task.prompts) * 1000)
    assert rollout.kept is not None and (rollout.kept.sum(-1) < 3)[rollout.response_mask.bool()].float().mean() > 0.3
    declared_kl = kl_divergence(module.exact_logprobs(), module.exact_ref_logprobs())
    untruncated = ExactPPORLHF(TASKS["terminal"], temperature=0.7, seed=0)
    untruncated.configure_model()
    untruncated.policy.load_state_dict(module.policy.state_dict())
    untruncated_kl = kl_divergence(untruncated.exact_logprobs(), untruncated.exact_ref_logprobs())
    for name in [entry.name for entry in registry("kl_estimator").entries()]:
        estimator = registry("kl_estimator").create(name)
        samples = estimator(rollout.trainer_logprobs, rollout.ref_logprobs, rollout.old_logits, rollout.ref_logits)
        samples = (samples * rollout.response_mask).sum(-1).double()
        mean, stderr = samples.mean().item(), samples.std().item() / math.sqrt(len(samples))
        logq, values = _declared_tables(module, estimator)
        expected = (logq.exp() * values).sum(-1).mean().item()  # prompts equally often in the rollout
        assert abs(mean - expected) < 3 * stderr, (name, mean, expected, stderr)
        if estimator.unbiased_value:
            assert expected == pytest.approx(declared_kl, abs=1e-5), name
            assert abs(mean - untruncated_kl) > 3 * stderr, (name, mean, untruncated_kl, stderr)


# ------------------------------------------------------------------ the declared objective's optimum
def test_kept_report_without_truncation_keeps_every_response():
    """top_p 1: all 27 responses kept, the best of them is "aaa" for prompt A (reward 3), and the
    optimum's top probability is that of pi* = pi_ref exp(r / beta) / Z, enumerated here."""
    module = ExactPPORLHF(TASKS["terminal"], temperature=0.7, beta_controller=FixedBeta(1.0), seed=0)
    module.configure_model()
    report = module.kept_report()
    assert report["responses"] == 27 and report["best_kept_reward"] == 3.0
    tilted = module.exact_ref_logprobs().exp() * module.task.rewards().exp()
    assert report["optimum_top_prob"] == pytest.approx((tilted.amax(-1) / tilted.sum(-1)).mean().item(), rel=1e-9)


@pytest.mark.convergence
def test_training_reaches_the_declared_optimum_at_temperature_07_top_p_09():
    """Temperature 0.7, top-p 0.9, beta 1 on the terminal task (the one-head model, 100 iterations,
    about 20 s): the gap to the closed-form optimum of the declared objective at the final kept sets is
    <= 0.02, and that optimum is not a point mass: top-p truncates (13 of 27 responses kept per prompt
    when measured) and pi* spreads over them (top probability 0.49 when measured). At top-p 0.8 the kept
    sets shrink to one response per prompt on some sampling streams, where the optimum is that response
    (seeds 0-3: 1, 1, 3.33, 1 responses; docs/rollout-engines.md)."""
    last, kept = declared_optimum_run(top_p=0.9)
    assert last["gap"] <= 0.02
    assert 2 <= kept["responses"] < 27 and kept["optimum_top_prob"] < 0.8 and last["optimum_kl_to_ref"] > 0.05


# ------------------------------------------------------------------ a sampler with a known mismatch
class PerturbedSampler(HFGenerate):
    """An engine like vLLM whose log-probs differ from the trainer's by a known amount: ``hf``'s
    generate with ``bias`` added to one content token's logit (a sampler with its own kernels or
    precision), returning its log-probs of the sampled tokens and no logits, so the module scores
    pi_old with the trainer's forward as it does for ``vllm``."""

    def __init__(self, bias: float = 1.0, token: int = 0) -> None:
        self.bias, self.token = bias, token

    def sample(self, module, enc, seed) -> Samples:
        token = module.sampled_token_ids[self.token]

        def shift(mod, inputs, out):
            return out + self.bias * torch.nn.functional.one_hot(torch.tensor(token), out.shape[-1]).to(out.dtype)

        handle = module.policy.lm_head.register_forward_hook(shift)
        try:
            samples = super().sample(module, enc, seed)
        finally:
            handle.remove()
        hp, response = module.sampling, samples.sequences[:, enc["input_ids"].shape[1] :]
        logits = samples.logits.float() / hp.temperature
        logits = sampling.restrict(logits, sampling.kept_tokens(logits, hp.top_k, hp.top_p))
        return Samples(samples.sequences, logprobs=logits.log_softmax(-1).gather(-1, response.unsqueeze(-1)).squeeze(-1))


@pytest.mark.slow  # a long convergence run: CI's convergence command leaves it out (README)
@pytest.mark.convergence
def test_a_sampler_with_a_known_error_is_corrected_back_to_the_optimum():
    """Terminal task, beta 0.5, a sampler whose logit of "a" is 1 too high (the rewarded token of prompt
    A: log-prob errors up to ~1 nat). Its log-probs as log pi_old (``old_logprobs: sampler``) misplace the
    PPO ratio and the policy lands far from pi*; log pi_old from the trainer's forward and the
    per-token truncated IS weight (``tis``) bring it within 0.02. The logged mismatch is what was injected."""
    common = dict(rollout_engine=PerturbedSampler(1.0), beta_controller=FixedBeta(0.5), **EXACT_RUN)
    _, biased = train(TASKS["terminal"], 100, batch_size=48, old_logprobs="sampler", **common)
    _, corrected = train(
        TASKS["terminal"], 100, batch_size=48, old_logprobs="forward", rollout_correction="tis", rollout_correction_cap=10.0, **common
    )
    assert biased.last["gap"] > 0.05
    assert corrected.last["gap"] <= 0.02


def test_optimum_check_prints_the_kept_line_only_for_a_truncating_run(capsys):
    """python -m tools.studies.optimum_check (2 iterations): a top-p run ends with the KEPT line, whose J* and
    KL(q*||r_K) are the ones the run printed above it; a run without truncation has none."""
    from tools.studies import optimum_check

    optimum_check.main(["--temperature", "0.7", "--top-p", "0.8", "--iterations", "2", "--every", "2"])
    lines = capsys.readouterr().out.splitlines()
    kept = dict(item.split("=", 1) for item in lines[-1].split()[1:])
    assert lines[-1].startswith("KEPT ") and kept["responses"].endswith("/27") and 1 <= float(kept["responses"][:-3]) <= 27
    assert kept["J*"] == f"{float(lines[-4].split()[2]):.4f}"  # the last row: iter, J, J*, ...
    assert f"KL(pi*||pi_ref)={kept['kl_opt']}" in lines[-3]
    optimum_check.main(["--iterations", "2", "--every", "2"])
    assert not any(line.startswith("KEPT ") for line in capsys.readouterr().out.splitlines())


# ------------------------------------------------------------------ the draw
def test_draw_is_the_inverse_cdf_of_the_uniform_it_takes():
    """sampling.draw on 64 rows over 5000 tokens (some of probability exactly 0, some rows peaked): the first
    index whose float64 cumulative probability exceeds each row's u, u the same uniforms from the same seed;
    never a token of probability 0; and over 20000 draws of one row, frequencies within 4 standard errors."""
    gen = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(64, 5000, generator=gen)
    logits[:, ::7] = sampling.OUTSIDE_LOGIT
    logits[:8, 123] = 60.0  # peaked rows
    torch.manual_seed(3)
    tokens = sampling.draw(logits)
    torch.manual_seed(3)
    u = torch.rand(64, 1, dtype=torch.float64)
    cdf = torch.softmax(logits.float(), -1).double().cumsum(-1)
    assert torch.equal(tokens, torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0])
    assert (tokens % 7 != 0).all() and (tokens[:8] == 123).all()
    row = torch.randn(1, 40, generator=gen).expand(20000, -1)
    counts = torch.bincount(sampling.draw(row), minlength=40).double()
    probs = torch.softmax(row[0].double(), -1)
    assert ((counts / 20000 - probs).abs() <= 4 * (probs * (1 - probs) / 20000).sqrt() + 1e-12).all()


def test_declared_draw_takes_temperature_top_k_and_the_eos_ban():
    """DeclaredDraw on 8000 copies of one row of scores, EOS (id 3) the most likely token: at the first
    response position (EOS banned, min_new_tokens 2) and at the third, every row gets 0 at one token and -inf
    elsewhere, and the tokens' frequencies match softmax(scores / 0.7) on the top 5 (EOS out while banned)
    within 4 standard errors."""
    scores = torch.randn(1, 50, generator=torch.Generator().manual_seed(1)).expand(8000, -1).clone()
    scores[:, 3] = scores.max() + 0.5
    draw = DeclaredDraw(temperature=0.7, top_k=5, top_p=1.0, eos_token_id=3, min_new_tokens=2, prompt_len=10)
    for prompt_and_response, eos_allowed in ((10, False), (12, True)):
        torch.manual_seed(0)
        out = draw(torch.zeros(8000, prompt_and_response, dtype=torch.long), scores.clone())
        assert ((out == 0).sum(-1) == 1).all() and (out.isinf().sum(-1) == 49).all()
        declared = scores[0].double() / 0.7
        if not eos_allowed:
            declared[3] = -torch.inf
        declared[declared < declared.topk(5).values[-1]] = -torch.inf
        probs = torch.softmax(declared, -1)
        freq = torch.bincount(out.argmax(-1), minlength=50).double() / 8000
        assert ((freq - probs).abs() <= 4 * (probs * (1 - probs) / 8000).sqrt() + 1e-12).all()
        assert (freq[3] > 0.2) == eos_allowed


def test_hf_engine_samples_inside_top_k_and_bans_eos_before_min_new_tokens():
    """The hf engine, top-k 3 and min_new_tokens 2 on 64 rows: every sampled token is among the 3 largest
    of the logits it recorded for that step (EOS out of the first two), and no row ends before 2 tokens."""
    module = make_module(sampling=dict(temperature=0.7, top_k=3, min_new_tokens=2, max_new_tokens=4))
    enc = module.sampler.encode(["Hello there", "Count to three"] * 32)
    samples = module.rollout_engine.sample(module.sampler, enc, seed=11)
    response, logits = samples.sequences[:, enc["input_ids"].shape[1] :], samples.logits.float()
    eos = module.tokenizer.eos_token_id
    assert not (response[:, :2] == eos).any()
    logits[:, :2, eos] = -torch.inf
    top3 = logits.topk(3, dim=-1).indices
    steps = response.shape[1]
    assert (top3[:, :steps] == response[..., None]).any(-1)[response != module.tokenizer.pad_token_id].all()
