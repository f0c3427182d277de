"""Reward backends (rlhf_lightning_plugins.rewards) and the RewardModel post-processing."""

from __future__ import annotations

import shutil
import sys
import textwrap

import numpy as np
import pytest
import torch

from rlhf_lightning.interfaces import RewardModel
from rlhf_lightning.reward_shaping import RunningMeanStd
from rlhf_lightning_plugins.rewards.classifier import HFClassifierReward
from rlhf_lightning_plugins.rewards.function import CallableReward, import_function
from tools.benchmarks.bench.measure import PassCounter

# Helper reward functions live in a module under tmp_path (tests/ is not a package, so the
# test module itself has no stable 'module:function' name).
HELPER_MODULE = "_rlhf_test_reward_fns"
HELPER_SOURCE = textwrap.dedent(
    """
    def one_too_few(prompts, responses):
        return [1.0] * (len(responses) - 1)

    def two_columns(prompts, responses):
        return [[1.0, 2.0] for _ in responses]

    def nan_at_two(prompts, responses):
        return [0.0, 1.0, float("nan"), 3.0][: len(responses)]

    def inf_at_zero_and_three(prompts, responses):
        return [float("inf"), 1.0, 2.0, float("-inf")][: len(responses)]

    def explodes(prompts, responses):
        raise KeyError("no score for you")

    def as_tensor(prompts, responses):
        import torch
        return torch.tensor([float(len(r)) for r in responses], dtype=torch.float64, requires_grad=True)

    def echo_prompt_len(prompts, responses, offset=0.0):
        return [len(p) + offset for p in prompts]
    """
)


@pytest.fixture
def helpers(tmp_path, monkeypatch):
    (tmp_path / f"{HELPER_MODULE}.py").write_text(HELPER_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(HELPER_MODULE, None)
    yield HELPER_MODULE
    sys.modules.pop(HELPER_MODULE, None)


def eos(*flags: bool) -> torch.Tensor:
    return torch.tensor(flags, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------
# CallableReward + toy rewards


def test_char_count_gives_exact_counts():
    rm = CallableReward(function="rlhf_lightning_plugins.rewards.toy:char_count")
    responses = ["eee", "hello", "", "EeE", "the cheese"]
    raw, scores = rm(["p"] * 5, responses, eos(True, True, True, True, True))
    # lowercase 'e' only: 3, 1, 0, 1 ('E' does not count), 'the cheese' -> 1 + 3 = 4
    assert raw.tolist() == [3.0, 1.0, 0.0, 1.0, 4.0]
    assert scores.tolist() == raw.tolist()
    assert raw.dtype == torch.float32 and scores.dtype == torch.float32


def test_callable_reward_passes_kwargs():
    # chars 'lo' in 'hello' -> l, l, o = 3, times scale 0.5 = 1.5; 'wool' -> o, o, l = 3 -> 1.5; 'x' -> 0
    rm = CallableReward(function="rlhf_lightning_plugins.rewards.toy:char_count", kwargs={"chars": "lo", "scale": 0.5})
    raw, _ = rm(["", "", ""], ["hello", "wool", "x"], eos(True, True, True))
    assert raw.tolist() == [1.5, 1.5, 0.0]


def test_callable_reward_receives_prompts(helpers):
    rm = CallableReward(function=f"{helpers}:echo_prompt_len", kwargs={"offset": 0.5})
    raw, _ = rm(["ab", "abcd"], ["x", "y"], eos(True, True))
    assert raw.tolist() == [2.5, 4.5]


def test_exclamation_count_caps():
    rm = CallableReward(function="rlhf_lightning_plugins.rewards.toy:exclamation_count", kwargs={"cap": 3})
    raw, _ = rm(["", "", ""], ["hi!", "!!!!!!", "none"], eos(True, True, True))
    assert raw.tolist() == [1.0, 3.0, 0.0]


def test_tensor_scores_are_detached_float32(helpers):
    rm = CallableReward(function=f"{helpers}:as_tensor")
    raw, _scores = rm(["", ""], ["abc", "a"], eos(True, True))
    assert raw.dtype == torch.float32 and not raw.requires_grad
    assert raw.tolist() == [3.0, 1.0]


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("no_colon_here", "package.module:function"),
        (":char_count", "package.module:function"),
        ("rlhf_lightning_plugins.rewards.toy:", "package.module:function"),
        ("definitely_not_a_module_xyz:fn", "cannot import module 'definitely_not_a_module_xyz'"),
        ("rlhf_lightning_plugins.rewards.toy:no_such_fn", "no callable 'no_such_fn'"),
        ("rlhf_lightning_plugins.rewards.toy:__doc__", "no callable '__doc__'"),
    ],
)
def test_bad_function_spec_mentions_the_field(spec, fragment):
    with pytest.raises(ValueError, match=r"reward_model.function") as info:
        CallableReward(function=spec)
    assert fragment in str(info.value)


def test_import_function_uses_the_given_field_name():
    with pytest.raises(ValueError, match=r"my.field"):
        import_function("nope", field="my.field")


# ---------------------------------------------------------------------------------------------
# RewardModel.__call__ validation


def test_wrong_number_of_scores_mentions_the_shape(helpers):
    rm = CallableReward(function=f"{helpers}:one_too_few")
    with pytest.raises(ValueError, match=r"shape \(2,\).*shape \(3,\)"):
        rm(["", "", ""], ["a", "b", "c"], eos(True, True, True))


def test_two_dimensional_scores_are_refused(helpers):
    rm = CallableReward(function=f"{helpers}:two_columns")
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        rm(["", ""], ["a", "b"], eos(True, True))


def test_nan_score_names_the_bad_index(helpers):
    rm = CallableReward(function=f"{helpers}:nan_at_two")
    with pytest.raises(FloatingPointError, match=r"responses \[2\]"):
        rm([""] * 4, ["a", "b", "c", "d"], eos(True, True, True, True))


def test_inf_scores_name_every_bad_index(helpers):
    rm = CallableReward(function=f"{helpers}:inf_at_zero_and_three")
    with pytest.raises(FloatingPointError, match=r"responses \[0, 3\]"):
        rm([""] * 4, ["a", "b", "c", "d"], eos(True, True, True, True))


def test_raising_function_gives_runtime_error_naming_the_function(helpers):
    rm = CallableReward(function=f"{helpers}:explodes")
    with pytest.raises(RuntimeError, match=f"{helpers}:explodes") as info:
        rm([""], ["a"], eos(True))
    assert "KeyError" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError)


# ---------------------------------------------------------------------------------------------
# missing-EOS penalty, normalisation, clipping


class ConstantScores(RewardModel):
    """Returns the scores it is given, in order, one batch per call."""

    def __init__(self, batches, **options):
        super().__init__(**options)
        self.batches = [list(b) for b in batches]

    def score(self, prompts, responses):
        return self.batches.pop(0)


def _call(rm: RewardModel, n: int, ended=None, **kwargs):
    ended = torch.ones(n, dtype=torch.bool) if ended is None else ended
    return rm([""] * n, ["r"] * n, ended, **kwargs)


def test_missing_eos_penalty_subtracts_exactly_on_responses_without_eos():
    # raw (3, 1, 0, -2), ended (T, F, F, T), penalty 0.5 -> (3, 0.5, -0.5, -2)
    rm = ConstantScores([[3.0, 1.0, 0.0, -2.0]], missing_eos_penalty=0.5)
    raw, scores = _call(rm, 4, ended=eos(True, False, False, True))
    assert raw.tolist() == [3.0, 1.0, 0.0, -2.0]
    assert scores.tolist() == [3.0, 0.5, -0.5, -2.0]


def test_no_penalty_by_default():
    rm = ConstantScores([[3.0, 1.0]])
    _, scores = _call(rm, 2, ended=eos(False, False))
    assert scores.tolist() == [3.0, 1.0]


def test_normalize_uses_running_stats_over_everything_seen():
    b1 = [1.0, 2.0, 3.0, 10.0]
    b2 = [-4.0, 0.5, 7.0]
    rm = ConstantScores([b1, b2], normalize=True)
    _, s1 = _call(rm, 4)
    # after batch 1: mean 4, population std sqrt(((-3)^2 + (-2)^2 + (-1)^2 + 6^2) / 4) = sqrt(12.5)
    expected1 = (np.array(b1) - 4.0) / (np.sqrt(12.5) + 1e-8)
    np.testing.assert_allclose(s1.numpy(), expected1, rtol=1e-6)
    _, s2 = _call(rm, 3)
    seen = np.array(b1 + b2)
    expected2 = (np.array(b2) - seen.mean()) / (seen.std() + 1e-8)  # numpy std: population (ddof=0)
    np.testing.assert_allclose(s2.numpy(), expected2, rtol=1e-6)
    assert rm.shaping.stats.count == 7
    assert rm.shaping.stats.mean == pytest.approx(seen.mean())
    assert rm.shaping.stats.var == pytest.approx(seen.var())


def test_normalize_without_update_uses_stats_so_far():
    rm = ConstantScores([[1.0, 3.0], [100.0, 5.0]], normalize=True)
    _call(rm, 2)  # mean 2, std 1
    before = rm.shaping.stats.state_dict()
    _, s = _call(rm, 2, update_stats=False)
    assert rm.shaping.stats.state_dict() == before
    np.testing.assert_allclose(s.numpy(), [(100.0 - 2.0) / (1 + 1e-8), (5.0 - 2.0) / (1 + 1e-8)], rtol=1e-6)


def test_normalize_stats_include_the_penalty():
    # penalty applied before normalisation: the stats see (2, 0) -> mean 1, std 1 -> (1, -1)
    rm = ConstantScores([[2.0, 1.0]], normalize=True, missing_eos_penalty=1.0)
    _, s = _call(rm, 2, ended=eos(True, False))
    np.testing.assert_allclose(s.numpy(), [1.0, -1.0], rtol=1e-6)


def test_clip_clamps():
    rm = ConstantScores([[5.0, -3.0, 1.0, -2.0, 2.0]], clip=2.0)
    raw, scores = _call(rm, 5)
    assert raw.tolist() == [5.0, -3.0, 1.0, -2.0, 2.0]
    assert scores.tolist() == [2.0, -2.0, 1.0, -2.0, 2.0]


def test_clip_applies_after_normalisation():
    # (0, 0, 0, 10): mean 2.5, population std sqrt((3 * 6.25 + 56.25) / 4) = sqrt(18.75) = 4.3301
    # normalised: (-0.57735, x3, 1.73205); clip 1 -> (-0.57735, x3, 1.0)
    rm = ConstantScores([[0.0, 0.0, 0.0, 10.0]], normalize=True, clip=1.0)
    _, s = _call(rm, 4)
    z = -2.5 / np.sqrt(18.75)
    np.testing.assert_allclose(s.numpy(), [z, z, z, 1.0], rtol=1e-6)


@pytest.mark.parametrize("clip", [0.0, -1.0])
def test_non_positive_clip_is_refused(clip):
    with pytest.raises(ValueError, match=r"reward_model.clip"):
        ConstantScores([], clip=clip)


def test_reward_model_state_dict_round_trip():
    a = ConstantScores([[1.0, 2.0, 6.0]], normalize=True)
    _call(a, 3)
    b = ConstantScores([[1.0, 2.0]], normalize=True)
    b.load_state_dict(a.state_dict())
    assert b.shaping.stats.state_dict() == a.shaping.stats.state_dict()
    _, s = _call(b, 2, update_stats=False)
    np.testing.assert_allclose(s.numpy(), (np.array([1.0, 2.0]) - 3.0) / (np.std([1.0, 2.0, 6.0]) + 1e-8), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# RunningMeanStd


def test_running_mean_std_matches_torch_over_concatenated_batches():
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randn(5, generator=g) * 2 + 1,
        torch.randn(1, generator=g) + 30,
        torch.randn(17, generator=g) * 0.5 - 4,
        torch.randn(3, generator=g),
    ]
    rms = RunningMeanStd()
    for i, batch in enumerate(batches):
        rms.update(batch)
        seen = torch.cat(batches[: i + 1]).double()
        assert rms.count == seen.numel()
        assert rms.mean == pytest.approx(seen.mean().item(), rel=1e-9, abs=1e-9)
        assert rms.var == pytest.approx(seen.var(unbiased=False).item(), rel=1e-9)
        assert rms.std == pytest.approx(seen.std(unbiased=False).item(), rel=1e-9)


def test_running_mean_std_initial_state():
    rms = RunningMeanStd()
    assert (rms.count, rms.mean, rms.var, rms.std) == (0.0, 0.0, 1.0, 1.0)


def test_running_mean_std_sum_fn_gives_global_stats():
    # Two ranks: rank B's three sums are added to rank A's, as all_reduce(SUM) would.
    a = torch.tensor([1.0, 2.0, 3.0])
    b = torch.tensor([10.0, -5.0])
    other = {}

    def record(t):
        other["b"] = t.clone()
        return t

    RunningMeanStd().update(b, sum_fn=record)
    rms = RunningMeanStd()
    rms.update(a, sum_fn=lambda t: t + other["b"])
    both = torch.cat([a, b]).double()
    assert rms.count == 5
    assert rms.mean == pytest.approx(both.mean().item())  # 11 / 5 = 2.2
    assert rms.var == pytest.approx(both.var(unbiased=False).item())


def test_running_mean_std_two_single_value_batches():
    # Values 0 and 2: mean 1, population var ((0 - 1)^2 + (2 - 1)^2) / 2 = 1. The placeholder
    # var = 1 held after the first value must not be merged in as data (that gave 1.5).
    rms = RunningMeanStd()
    rms.update(torch.tensor([0.0]))
    rms.update(torch.tensor([2.0]))
    assert rms.count == 2
    assert rms.mean == 1.0
    assert rms.var == 1.0
    assert rms.std == 1.0


def test_running_mean_std_constant_values_have_zero_variance():
    # 5, then 5, 5: all equal -> var 0 exactly (merging the placeholder var 1 gave 1/3).
    rms = RunningMeanStd()
    rms.update(torch.tensor([5.0]))
    rms.update(torch.tensor([5.0, 5.0]))
    assert (rms.count, rms.mean, rms.var, rms.std) == (3, 5.0, 0.0, 0.0)


def test_running_mean_std_is_one_until_two_values_then_exact():
    rms = RunningMeanStd()
    rms.update(torch.tensor([7.0]))
    # one value seen: mean is that value, std the placeholder 1, and no spread recorded
    assert (rms.count, rms.mean, rms.var, rms.std) == (1, 7.0, 1.0, 1.0)
    assert rms.state_dict()["m2"] == 0.0
    # 7 and 10: mean 8.5, var (1.5^2 + 1.5^2) / 2 = 2.25, std 1.5
    rms.update(torch.tensor([10.0]))
    assert (rms.count, rms.mean, rms.var, rms.std) == (2, 8.5, 2.25, 1.5)


def test_running_mean_std_single_values_match_torch():
    # One value per batch (e.g. one response per rank and step): stats of everything seen.
    values = [3.0, -1.0, 4.0, 1.5, -9.0, 2.6]
    rms = RunningMeanStd()
    for i, v in enumerate(values):
        rms.update(torch.tensor([v]))
        seen = torch.tensor(values[: i + 1]).double()  # the float32 values update() saw
        assert rms.mean == pytest.approx(seen.mean().item(), rel=1e-12, abs=1e-12)
        expected_var = seen.var(unbiased=False).item() if i >= 1 else 1.0
        assert rms.var == pytest.approx(expected_var, rel=1e-12)


@pytest.mark.parametrize("primed", [False, True], ids=["fresh", "after-data"])
def test_running_mean_std_empty_update_is_a_no_op(primed):
    rms = RunningMeanStd()
    if primed:
        rms.update(torch.tensor([1.0, 3.0]))  # mean 2, var 1
    before = rms.state_dict()
    rms.update(torch.tensor([]))
    assert rms.state_dict() == before
    expected = (2, 2.0, 1.0) if primed else (0, 0.0, 1.0)
    assert (rms.count, rms.mean, rms.var) == expected

    # Under DDP a rank with no values must still all-reduce (else the others hang) and then hold
    # the global stats: the other rank adds values 5, 7 (sums n=2, s=12, ss=74).
    calls = []

    def other_rank_has_5_and_7(t):
        calls.append(t.clone())
        return t + torch.tensor([2.0, 12.0, 74.0], dtype=t.dtype)

    rms.update(torch.tensor([]), sum_fn=other_rank_has_5_and_7)
    assert len(calls) == 1 and calls[0].tolist() == [0.0, 0.0, 0.0]
    # fresh: {5, 7} -> mean 6, var 1;  primed: {1, 3, 5, 7} -> mean 4, var (9 + 1 + 1 + 9) / 4 = 5
    assert (rms.count, rms.mean, rms.var) == ((4, 4.0, 5.0) if primed else (2, 6.0, 1.0))


def test_running_mean_std_state_dict_round_trip():
    batches = [torch.tensor([4.0]), torch.tensor([1.0, 2.0, 6.0]), torch.tensor([-3.0, 0.5])]
    a = RunningMeanStd()
    for b in batches:
        a.update(b)
    seen = torch.cat(batches).double()
    assert set(a.state_dict()) == {"count", "mean", "m2"}
    assert a.var == pytest.approx(seen.var(unbiased=False).item(), rel=1e-12)

    restored = RunningMeanStd()
    restored.update(torch.tensor([100.0, -100.0, 50.0]))  # its own history is overwritten
    restored.load_state_dict(a.state_dict())
    assert (restored.count, restored.mean, restored.var, restored.std) == (a.count, a.mean, a.var, a.std)

    more = [torch.tensor([9.0]), torch.tensor([2.0, -7.0, 0.25])]
    for m in more:
        a.update(m)
        restored.update(m)
        assert (restored.count, restored.mean, restored.var) == (a.count, a.mean, a.var)
    everything = torch.cat(batches + more).double()
    assert restored.count == everything.numel()
    assert restored.mean == pytest.approx(everything.mean().item(), rel=1e-12)
    assert restored.var == pytest.approx(everything.var(unbiased=False).item(), rel=1e-12)


def test_normalize_with_one_score_per_call_uses_the_exact_running_std():
    # Scores 0 then 2, one per call: the first normalises to (0 - 0) / 1 = 0; the second sees
    # mean 1, population std 1 -> (2 - 1) / 1 = 1 (the old merge gave std sqrt(1.5) -> 0.8165).
    rm = ConstantScores([[0.0], [2.0]], normalize=True)
    _, s1 = _call(rm, 1)
    _, s2 = _call(rm, 1)
    assert s1.tolist() == [0.0]
    np.testing.assert_allclose(s2.numpy(), [1.0 / (1.0 + 1e-8)], rtol=1e-7)


# ---------------------------------------------------------------------------------------------
# HFClassifierReward on a tiny random Llama classifier with the character tokenizer


def _score_one_by_one(model, tokenizer, texts):
    out = []
    with torch.no_grad():
        for text in texts:
            enc = tokenizer(text, return_tensors="pt")
            assert enc["input_ids"].shape[0] == 1 and (enc["attention_mask"] == 1).all()
            out.append(model(**enc).logits[0, 0].item())
    return torch.tensor(out)


PROMPTS = ["Say hi.", "Count:", "Q", "Why is the sky blue?", "ok"]
RESPONSES = ["hi", "one two three four", "A!", "", "Rayleigh scattering."]


@pytest.mark.parametrize("batch_size", [1, 2, 32])
def test_hf_classifier_matches_unbatched_model(tiny_classifier, batch_size):
    path, model, tokenizer = tiny_classifier
    rm = HFClassifierReward(path=str(path), batch_size=batch_size)
    raw, scores = rm(PROMPTS, RESPONSES, torch.ones(5, dtype=torch.bool))
    expected = _score_one_by_one(model, tokenizer, [p + "\n" + r for p, r in zip(PROMPTS, RESPONSES, strict=True)])
    assert raw.shape == (5,) and raw.dtype == torch.float32
    torch.testing.assert_close(raw, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(scores, raw)
    # the scores differ between texts, so a broadcast/pooling mix-up would be caught
    assert raw.unique().numel() == 5


def test_hf_classifier_response_only_and_separator(tiny_classifier):
    path, model, tokenizer = tiny_classifier
    only = HFClassifierReward(path=str(path), include_prompt=False, batch_size=4)
    raw, _ = only(PROMPTS, [*RESPONSES[:3], "x", "y"], torch.ones(5, dtype=torch.bool))
    torch.testing.assert_close(raw, _score_one_by_one(model, tokenizer, [*RESPONSES[:3], "x", "y"]), rtol=1e-4, atol=1e-5)
    sep = HFClassifierReward(path=str(path), separator=" | ", batch_size=4)
    raw, _ = sep(PROMPTS, RESPONSES, torch.ones(5, dtype=torch.bool))
    texts = [p + " | " + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    torch.testing.assert_close(raw, _score_one_by_one(model, tokenizer, texts), rtol=1e-4, atol=1e-5)


def test_hf_classifier_scores_a_shared_prompt_once_as_it_scores_whole_texts(tiny_classifier):
    """Groups of responses to one prompt run the tokens their texts share once and score as each whole text
    does alone, groups split across batches (3) or not (32); the tokens the trunk runs are counted."""
    path, model, tokenizer = tiny_classifier
    prompts = ["Tell me about the weather in the mountains."] * 3 + ["Write a short poem about the sea."] * 3 + ["Q"] * 2
    responses = ["Cold.", "Snow, mostly", "", "Waves", "The sea is wide", "s", "A", "B!"]
    texts = [p + "\n" + r for p, r in zip(prompts, responses, strict=True)]
    alone = _score_one_by_one(model, tokenizer, texts)
    for batch_size in (3, 32):
        rm = HFClassifierReward(path=str(path), batch_size=batch_size)
        rm.setup(torch.device("cpu"))
        tokens = []
        rm.model.model.register_forward_pre_hook(lambda _, args, __, seen=tokens: seen.append(args[0].numel()), with_kwargs=True)
        raw, _ = rm(prompts, responses, torch.ones(8, dtype=torch.bool))
        assert rm.shares and raw.unique().numel() == 8
        torch.testing.assert_close(raw, alone, rtol=1e-4, atol=1e-5)
    # one batch: the 3 distinct prefixes left-padded to the longest, then every row's rest right-padded
    rows = tokenizer(texts)["input_ids"]
    prefix_len = [len(rows[2]) - 1, len(rows[3]) - 5, len(rows[6]) - 1]  # up to the newline; each row keeps a token
    rests = [len(r) - prefix_len[g] for r, g in zip(rows, [0, 0, 0, 1, 1, 1, 2, 2], strict=True)]
    assert tokens == [3 * max(prefix_len), 8 * max(rests)]
    assert sum(tokens) < 0.6 * 8 * max(map(len, rows))  # the whole texts, padded
    counter = PassCounter()  # the two calls are one pass over the reward model for tools/benchmarks/bench/measure.py
    counter.watch("reward", rm.model)
    rm(prompts, responses, torch.ones(8, dtype=torch.bool))
    assert counter.take() == {"all": {"reward fwd": 1}}
    off = HFClassifierReward(path=str(path), batch_size=4, shared_prompts=False)
    torch.testing.assert_close(off(prompts, responses, torch.ones(8, dtype=torch.bool))[0], alone, rtol=1e-4, atol=1e-5)
    assert not off.shares


def test_hf_classifier_scores_the_chat_templated_conversation(tiny_classifier, tmp_path):
    """With ``chat_template`` the model reads the prompt's user turn and the response's assistant turn in
    its tokenizer's template (no tokens added), shared prompts or not; refused without a template and with
    the options it replaces."""
    path, model, tokenizer = tiny_classifier
    chat = tmp_path / "chat_rm"
    shutil.copytree(path, chat)
    template = "{% for m in messages %}[{{ m['role'][0] }}] {{ m['content'] }}\n{% endfor %}"
    (chat / "chat_template.jinja").write_text(template)
    prompts, responses = ["Say hi.", "Say hi.", "Count:", "Q"], ["hi", "hello", "one two", "A!"]
    texts = [f"[u] {p}\n[a] {r}\n" for p, r in zip(prompts, responses, strict=True)]
    expected = _score_one_by_one(model, tokenizer, texts)
    for shared in (True, False):
        rm = HFClassifierReward(path=str(chat), chat_template=True, shared_prompts=shared)
        raw, _ = rm(prompts, responses, torch.ones(4, dtype=torch.bool))
        assert rm.texts(prompts, responses) == texts and rm.shares == shared
        torch.testing.assert_close(raw, expected, rtol=1e-4, atol=1e-5)
    plain, _ = HFClassifierReward(path=str(chat))(prompts, responses, torch.ones(4, dtype=torch.bool))
    assert (plain - expected).abs().min() > 1e-4  # "prompt\nresponse" is another text
    with pytest.raises(ValueError, match=r"reward_model.chat_template must be false: the tokenizer in .* has no chat template"):
        HFClassifierReward(path=str(path), chat_template=True).setup(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"reward_model.include_prompt must be true with reward_model.chat_template"):
        HFClassifierReward(path=str(chat), chat_template=True, include_prompt=False)
    with pytest.raises(ValueError, match=r"reward_model.separator must be left out with reward_model.chat_template"):
        HFClassifierReward(path=str(chat), chat_template=True, separator=" | ")


def test_hf_classifier_runs_what_distinct_prompts_start_with_once(tiny_classifier):
    """Where no prompt repeats, the texts' common beginning (a system prompt) runs once for the batch; the
    scores are each text's alone; texts that share no first token are scored whole."""
    path, model, tokenizer = tiny_classifier
    prompts = ["System: be kind. " + p for p in ("Hi", "Write a poem", "Q")]
    responses = ["Hello!", "Roses", "A"]
    texts = [p + "\n" + r for p, r in zip(prompts, responses, strict=True)]
    rm = HFClassifierReward(path=str(path))
    rm.setup(torch.device("cpu"))
    tokens = []
    rm.model.model.register_forward_pre_hook(lambda _, args, __: tokens.append(tuple(args[0].shape)), with_kwargs=True)
    raw, _ = rm(prompts, responses, torch.ones(3, dtype=torch.bool))
    torch.testing.assert_close(raw, _score_one_by_one(model, tokenizer, texts), rtol=1e-4, atol=1e-5)
    rows = tokenizer(texts)["input_ids"]
    shared = len("System: be kind. ")  # the character tokenizer: one token a character
    assert tokens == [(1, shared), (3, max(map(len, rows)) - shared)]
    tokens.clear()
    rm(["Hi", "Q"], ["a", "b"], torch.ones(2, dtype=torch.bool))
    assert tokens == [(2, 4)]  # "Hi\na", "Q\nb": nothing in common, whole texts


@pytest.fixture(scope="module")
def tiny_encoder_classifier(tmp_path_factory):
    """A bidirectional classifier (BERT) on the character tokenizer: a prefix's states see what follows it."""
    from transformers import BertConfig, BertForSequenceClassification

    from rlhf_lightning.models import char_tokenizer

    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=1
    )
    path = tmp_path_factory.mktemp("tiny_bert_rm")
    BertForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_hf_classifier_scores_whole_texts_on_a_bidirectional_model(tiny_encoder_classifier):
    rm = HFClassifierReward(path=str(tiny_encoder_classifier))
    rm.setup(torch.device("cpu"))
    assert not rm.shares
    with pytest.raises(ValueError, match=r"reward_model.shared_prompts must be false: .* is not causal"):
        HFClassifierReward(path=str(tiny_encoder_classifier), shared_prompts=True).setup(torch.device("cpu"))


def test_hf_classifier_label_index_out_of_range(tiny_classifier):
    path, _, _ = tiny_classifier
    rm = HFClassifierReward(path=str(path), label_index=1)
    with pytest.raises(ValueError, match=r"reward_model.label_index must be in \[0, 1\): .* has 1 labels, got 1"):
        rm(["p"], ["r"], torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="label_index"):
        HFClassifierReward(path=str(path), label_index=-1).setup(torch.device("cpu"))


# ---------------------------------------------------------------------------------------------
# EnsembleReward: K classifiers combined by mean, min or mean - lambda std (Coste et al. 2023)


class FixedScores(RewardModel):
    """A member whose scores are given (the ensemble's combination checked against hand values)."""

    def __init__(self, scores):
        super().__init__()
        self.scores = torch.tensor(scores)

    def score(self, prompts, responses):
        return self.scores


def ensemble_of(tmp_path, member_scores, stats=None, **options):
    """An EnsembleReward over folders holding only ``reward_stats.json``, its members replaced by fixed scores."""
    import json

    from rlhf_lightning_plugins.rewards.classifier import EnsembleReward

    paths = []
    for k, _scores in enumerate(member_scores):
        (tmp_path / f"m{k}").mkdir(parents=True)
        (tmp_path / f"m{k}" / "reward_stats.json").write_text(json.dumps(stats[k] if stats else {"mean": 0.0, "std": 1.0}))
        paths.append(str(tmp_path / f"m{k}"))
    ensemble = EnsembleReward(paths=paths, **options)
    ensemble.members = [FixedScores(scores) for scores in member_scores]
    return ensemble


# Three members, two responses: column 1 holds 1, 3, 2 (mean 2, population variance 2/3), column 2
# holds 4, 0, 2 (mean 2, variance 8/3).
MEMBERS = [[1.0, 4.0], [3.0, 0.0], [2.0, 2.0]]


@pytest.mark.parametrize(
    "combine, std_coef, expected",
    [
        ("mean", 1.0, [2.0, 2.0]),
        ("min", 1.0, [1.0, 0.0]),
        # 2 - 0.5 sqrt(2/3) = 1.591752, 2 - 0.5 sqrt(8/3) = 1.183503: the same mean, the more
        # disputed response pays more.
        ("mean_minus_std", 0.5, [1.591752, 1.183503]),
        ("mean_minus_std", 0.0, [2.0, 2.0]),
    ],
)
def test_ensemble_combines_members_as_derived_by_hand(tmp_path, combine, std_coef, expected):
    ensemble = ensemble_of(tmp_path, MEMBERS, combine=combine, std_coef=std_coef)
    np.testing.assert_allclose(ensemble.checked_scores(["a", "b"], ["x", "y"]).numpy(), expected, rtol=1e-6)


def test_ensemble_standardises_each_member_by_its_reward_stats(tmp_path):
    # Member 1 is member 0 shifted by +10 and scaled by 3: standardised, the two agree exactly,
    # so their std is 0 and min = mean = (r - 1) / 2.
    stats = [{"mean": 1.0, "std": 2.0}, {"mean": 13.0, "std": 6.0}]
    members = [[1.0, 5.0], [13.0, 25.0]]
    for combine in ("min", "mean_minus_std"):
        ensemble = ensemble_of(tmp_path / combine, members, stats, combine=combine)
        np.testing.assert_allclose(ensemble.checked_scores(["a", "b"], ["x", "y"]).numpy(), [0.0, 2.0], atol=1e-6)
    # Unstandardised, the offset decides the minimum: member 0's raw scores.
    raw = ensemble_of(tmp_path / "raw", members, stats, combine="min", standardize=False)
    np.testing.assert_allclose(raw.checked_scores(["a", "b"], ["x", "y"]).numpy(), [1.0, 5.0])


def test_ensemble_of_classifiers_loads_each_member_once_and_scores_in_one_pass_each(tiny_classifier, tmp_path):
    import json
    import shutil

    from rlhf_lightning_plugins.rewards.classifier import EnsembleReward

    path, _model, _tokenizer = tiny_classifier
    prompts, responses = ["Say hi.", "Describe rain.", "Count.", "Hm."], ["hello there", "wet", "one two three", ""]
    single = HFClassifierReward(path=str(path))
    single.setup(torch.device("cpu"))
    raw = single.checked_scores(prompts, responses)
    # Two copies of one model, the second's stats saying its scores are raw * 2 + 1 relative to the first.
    paths = [tmp_path / "a", tmp_path / "b"]
    for folder, stats in zip(paths, [{"mean": 0.0, "std": 1.0}, {"mean": -1.0, "std": 2.0}], strict=True):
        shutil.copytree(path, folder)
        (folder / "reward_stats.json").write_text(json.dumps(stats))
    ensemble = EnsembleReward(paths=[str(p) for p in paths], combine="mean_minus_std", std_coef=2.0)
    ensemble.setup(torch.device("cpu"))
    loaded = [member.model for member in ensemble.members]
    ensemble.setup(torch.device("cpu"))  # a second setup (a resumed fit) keeps the loaded models
    assert [member.model for member in ensemble.members] == loaded
    calls = []
    for member in ensemble.members:
        member.model.register_forward_hook(lambda module, args, out: calls.append(len(out.logits)))
    scores = ensemble.checked_scores(prompts, responses)
    assert calls == [4, 4]  # one forward per member, the whole batch in it
    # Standardised: raw and (raw + 1) / 2; mean (3 raw + 1) / 4, std |raw - 1| / 4, minus 2 std.
    expected = (3 * raw + 1) / 4 - 2 * (raw - 1).abs() / 4
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"paths": ["only_one"]}, r"reward_model.paths must be a list of at least 2 model folders"),
        ({"paths": "a,b"}, r"reward_model.paths must be a list"),
        ({"paths": ["a", "b"], "combine": "median"}, r"reward_model.combine must be one of mean, min, mean_minus_std, got 'median'"),
        ({"paths": ["a", "b"], "std_coef": -1}, r"reward_model.std_coef must be a finite number >= 0"),
        ({"paths": ["no/such/folder", "b"]}, r"reward_model.paths must be model folders with a reward_stats.json.*no/such/folder"),
    ],
)
def test_ensemble_config_errors_name_the_field(options, message):
    from rlhf_lightning.interfaces import ConfigError
    from rlhf_lightning_plugins.rewards.classifier import EnsembleReward

    with pytest.raises(ConfigError, match=message):
        EnsembleReward(**options)
