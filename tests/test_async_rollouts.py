"""Asynchronous rollouts (``model.off_policy``, rlhf_lightning/async_rollout.py): the batch of iteration i is the
one the weights of version max(0, i - k) sample with iteration i's seed, whether the sampler runs in its own
thread or in the trainer's; the start-up checks; the staleness metrics."""

from __future__ import annotations

import threading

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from rlhf_lightning.async_rollout import SamplerError
from rlhf_lightning.checks import ConfigError
from rlhf_lightning.data import Lookahead
from rlhf_lightning.networks import Networks
from rlhf_lightning_plugins.rollout_engines import HFGenerate

from helpers import RecordWeights, StopAfter, fit, make_module

STALE = dict(sampling=dict(old_logprobs="forward"), ppo=dict(epochs=1))


def stale_fit(tmp_path, k: int, concurrent: bool, iterations: int = 4, **overrides):
    module = make_module(**{**STALE, "off_policy": dict(max_staleness=k), **overrides})
    if module.async_rollouts is not None:
        module.async_rollouts.concurrent = concurrent
    weights = RecordWeights()
    _, history = fit(module, tmp_path, iterations, batch_size=4, callbacks=[weights])
    return module, history, weights.versions


def resample(module, versions, iteration: int, k: int, prompts: list[str]):
    """Iteration ``iteration``'s batch as version max(0, iteration - k) samples it by hand: a fresh module with those
    weights, the engine called with ``module``'s seed of that iteration."""
    fresh = make_module(**{**STALE, "off_policy": dict(max_staleness=0)})
    with torch.no_grad():
        for name, p in fresh.policy.named_parameters():
            p.copy_(versions[max(0, iteration - k)][name])
    enc = fresh.sampler.encode(prompts)
    return enc, fresh.rollout_engine.checked_sample(fresh.sampler, enc, module.sampler.seed(iteration))


@pytest.mark.parametrize("concurrent", [False, True], ids=["in_line", "thread"])
def test_each_batch_is_sampled_by_the_weights_k_updates_old(tmp_path, concurrent):
    """k = 1, four iterations: each iteration's responses and behaviour log-probs are those the weights of version
    i - 1 (i = 0: 0) draw with iteration i's seed, token for token; the trained weights have moved between versions
    (so version i's own weights would have sampled other responses); policy_version and the staleness metrics
    say so."""
    module, history, versions = stale_fit(tmp_path, 1, concurrent)
    assert any(not torch.equal(versions[1][n], versions[2][n]) for n in versions[1])
    differs = 0
    for i, out in enumerate(history.outputs):
        rollout = out["rollout"]
        assert rollout.policy_version.tolist() == [max(0, i - 1)] * len(rollout.prompts)
        enc, samples = resample(module, versions, i, 1, rollout.prompts)
        prompt_len = enc["input_ids"].shape[1]
        by_hand = samples.sequences[:, prompt_len:]
        n = rollout.responses.shape[1]
        assert torch.equal(
            by_hand[:, :n].masked_fill(rollout.response_mask == 0, 0), rollout.responses.masked_fill(rollout.response_mask == 0, 0)
        )
        mu = torch.log_softmax(samples.logits.float(), -1).gather(-1, by_hand[:, :n, None])[..., 0]
        torch.testing.assert_close(rollout.sampler_logprobs * rollout.response_mask, mu * rollout.response_mask, rtol=0, atol=1e-5)
        _, own = resample(module, versions, i, 0, rollout.prompts)  # the current weights' own draw
        differs += not torch.equal(own.sequences, samples.sequences)
    assert differs >= 1  # stale sampling is not the current weights' sampling
    assert module.async_rollouts.handed_ahead == 3  # iterations 1, 2, 3 were drawn while the one before trained
    assert history.series("off_policy/staleness_mean") == [0.0, 1.0, 1.0, 1.0]
    assert history.series("off_policy/staleness_max") == [0.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "k, overrides",
    [(2, {}), (1, dict(lora=dict(rank=4), critic="shared"))],
    ids=["full-k2", "lora-shared-critic-k1"],
)
def test_the_thread_and_the_in_line_sampler_train_the_same_weights(tmp_path, k, overrides):
    """Five iterations: the sampler thread and the in-line sampler give the same responses, metrics and final
    weights, bit for bit (the same jobs in the same order on the same copy; under LoRA the copy's adapter is
    replaced at each version, its base restored as built)."""
    runs = [stale_fit(tmp_path / str(c), k, c, iterations=5, **overrides) for c in (False, True)]
    (a, ha, _), (b, hb, _) = runs
    for (name, p), q in zip(a.policy.named_parameters(), b.policy.parameters(), strict=True):
        assert torch.equal(p, q), name
    for key in ("objective/reward", "objective/kl", "policy/loss", "off_policy/staleness_mean"):
        assert ha.series(key) == hb.series(key), key
    assert ha.series("off_policy/staleness_mean") == [min(i, k) for i in range(5)]
    assert ha.series("objective/kl")[-1] != 0  # the policy moved away from the reference


@pytest.mark.parametrize(
    "overrides, in_sampler",
    [
        ({}, True),
        (dict(lora=dict(rank=4), critic="shared"), True),
        (dict(kl_estimator="full", kl=dict(placement="loss")), True),
        (dict(reference_update="ema"), False),
    ],
    ids=["full", "lora-shared-critic", "full-estimator", "moving-reference"],
)
def test_scoring_in_the_sampler_trains_what_scoring_in_the_trainer_does(tmp_path, monkeypatch, overrides, in_sampler):
    """k = 1, four iterations, the sampler in its thread: with ``score_in_sampler`` the reward and a frozen
    reference's pass run in the sampler's thread (a reference that moves stays in the trainer's), and the run
    trains the very weights and logs the very metrics of the run that scores in the trainer."""
    threads = []
    reference_logits = Networks.reference_logits
    monkeypatch.setattr(
        Networks, "reference_logits", lambda *a, **kw: threads.append(threading.current_thread().name) or reference_logits(*a, **kw)
    )
    runs = {}
    for scoring in (False, True):
        threads.clear()
        off_policy = dict(max_staleness=1, score_in_sampler=scoring)
        runs[scoring] = stale_fit(tmp_path / str(scoring), 1, True, **{**overrides, "off_policy": off_policy})
        on_sampler = {name == "rlhf-lightning-sampler" for name in threads}
        assert on_sampler == ({scoring and in_sampler} if threads else set()), threads
    (a, ha, _), (b, hb, _) = runs[False], runs[True]
    for (name, p), q in zip(a.policy.named_parameters(), b.policy.parameters(), strict=True):
        assert torch.equal(p, q), name
    for key in ("objective/reward", "objective/kl", "policy/loss"):
        assert ha.series(key) == hb.series(key), key
    assert ha.series("objective/kl")[-1] != 0
    assert "timing/sampler_score_s" not in ha.rows[-1] and hb.series("timing/sampler_score_s")[-1] > 0


def test_a_reward_fault_found_by_the_sampler_skips_its_iteration(tmp_path):
    """The sampler scores the batches; a NaN reward in the batch of iteration 1 skips iteration 1 alone, as in the
    synchronous loop (tests/test_faults.py), with the same warning naming the backend."""
    from test_faults import FlakyReward

    with pytest.warns(UserWarning, match=r"FlakyReward returned non-finite scores for responses \[1\]"):
        module, history, versions = stale_fit(tmp_path, 1, True, reward_model=FlakyReward(nan_calls={1}))
    assert [out["skipped"] for out in history.outputs] == [False, True, False, False]
    assert all(torch.equal(versions[1][n], versions[2][n]) for n in versions[1])  # iteration 1 left the weights as they were
    assert module.faults.state_dict()["skipped_iterations"] == 1


def test_max_staleness_0_is_the_synchronous_loop(tmp_path):
    """k = 0: no sampler, no staleness metrics; each response carries the version that trains on it."""
    module = make_module()
    assert module.async_rollouts is None
    _, history = fit(module, tmp_path, 2, batch_size=4)
    assert [out["rollout"].policy_version.unique().tolist() for out in history.outputs] == [[0], [1]]
    assert "off_policy/staleness_mean" not in history.rows[-1]


def test_start_up_checks_name_the_fields():
    with pytest.raises(ConfigError, match=r"model\.sampling\.old_logprobs must be 'forward' with model\.off_policy\.max_staleness 1"):
        make_module(off_policy=dict(max_staleness=1))
    with pytest.raises(ConfigError, match=r"model\.off_policy\.max_staleness must be an integer >= 0, got -1"):
        make_module(off_policy=dict(max_staleness=-1))
    with pytest.raises(ConfigError, match=r"model\.off_policy\.sampler_timeout_s must be a number of seconds > 0 or never"):
        make_module(off_policy=dict(sampler_timeout_s=0))


def test_lookahead_shows_the_batches_after_the_one_trained():
    """Lightning fetches one batch ahead: the batch it handed out but has not trained on counts as upcoming."""
    ahead = Lookahead(iter([[0], [1], [2], [3]]))
    assert next(ahead) == [0] and next(ahead) == [1]  # the loop trains [0], [1] prefetched
    assert ahead.consume([0])
    assert ahead.upcoming(2) == [[1], [2]]
    assert next(ahead) == [2]  # read ahead, handed out in order
    assert ahead.consume([1]) and ahead.upcoming(5) == [[2], [3]]
    assert not ahead.consume([9])


def test_the_one_page_view_charts_the_staleness_and_every_charted_tag_is_documented():
    import re

    from rlhf_lightning.callbacks import MORE_CATEGORY, custom_scalars_layout

    from helpers import REPO

    page = (REPO / "docs" / "metrics.md").read_text()
    layout = custom_scalars_layout(asynchronous=True)[MORE_CATEGORY]
    tags = [re.sub(r"^\^|\$$", "", tag) for _, (_, chart) in layout.items() for tag in chart]
    assert {"off_policy/staleness_mean", "off_policy/staleness_max", "off_policy/clipped_fraction", "off_policy/ess"} <= set(tags)
    assert "timing/sampler_wait_s" in tags
    assert all(f"`{tag}`" in page for tag in tags), [tag for tag in tags if f"`{tag}`" not in page]
    assert "off_policy/staleness_mean" not in str(custom_scalars_layout())


@pytest.mark.parametrize("k", [1, 2])
def test_a_run_stopped_and_resumed_trains_the_weights_of_one_never_stopped(tmp_path, k):
    """Six iterations straight against three, a checkpoint, and three more from it: the batches in flight at the
    checkpoint (k of them, drawn by the sampler thread from older weights) are in it and resumed, so every weight
    and every logged metric of the resumed iterations equal the uninterrupted run's, bit for bit."""
    straight, history, _ = stale_fit(tmp_path / "straight", k, True, iterations=6)
    ckpt = tmp_path / "stopped.ckpt"
    stopped = make_module(**{**STALE, "off_policy": dict(max_staleness=k)})
    fit(stopped, tmp_path / "stopped", 6, batch_size=4, callbacks=[StopAfter(3, ckpt)])
    assert stopped.iteration == 3
    state = torch.load(ckpt, weights_only=False)["rlhf_lightning"]["async_rollouts"][0]
    assert [d["iteration"] for d in state["drawn"]] == list(range(3, 3 + k))
    assert [d["version"] for d in state["drawn"]] == [i - k for i in range(3, 3 + k)]
    resumed = make_module(**{**STALE, "off_policy": dict(max_staleness=k)})
    _, after = fit(resumed, tmp_path / "resumed", 6, batch_size=4, ckpt_path=str(ckpt))
    assert resumed.iteration == 6
    for (name, p), q in zip(straight.policy.named_parameters(), resumed.policy.parameters(), strict=True):
        assert torch.equal(p, q), name
    for key in ("objective/reward", "objective/kl", "policy/loss", "off_policy/staleness_mean"):
        assert after.series(key) == history.series(key)[3:], key


class FaultyEngine(HFGenerate):
    """``hf``, but its ``calls``-th draw (from 0) raises, or blocks until ``release`` is set."""

    def __init__(self, calls: int, block: bool = False) -> None:
        self.calls, self.block, self.release, self.seen = calls, block, threading.Event(), 0

    def sample(self, module, enc, seed):
        self.seen += 1
        if self.seen - 1 == self.calls:
            if not self.block:
                raise RuntimeError("the engine's device went away")
            self.release.wait()
        return super().sample(module, enc, seed)


def test_a_sampler_that_raises_stops_the_run_with_one_line_naming_the_setting(tmp_path):
    module = make_module(**STALE, off_policy=dict(max_staleness=1), rollout_engine=FaultyEngine(calls=2))
    with pytest.raises(SamplerError) as stopped:
        fit(module, tmp_path, 4, batch_size=4)
    message = str(stopped.value)
    assert "\n" not in message and isinstance(stopped.value, ConfigError)
    assert message == (
        "model.off_policy.max_staleness 1: the sampler failed drawing the batch of iteration 2: RuntimeError: the engine's device went away"
    )
    assert module.iteration == 2  # the iterations before it ran


class ShortTimeoutFrom(Callback):
    """From iteration ``n`` on, the trainer waits ``seconds`` for the sampler (earlier draws: the default)."""

    def __init__(self, n: int, seconds: float) -> None:
        self.n, self.seconds = n, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if pl_module.iteration == self.n:
            pl_module.async_rollouts.timeout_s = self.seconds


def test_a_sampler_that_hangs_stops_the_run_after_the_timeout_naming_it(tmp_path):
    """The engine blocks on its second draw (iteration 1's batch, handed over during iteration 0) for ever; with
    the timeout set to 0.2 s from iteration 1 on (the draws before it are not timed against it, so the test
    assumes nothing of the machine's speed), the trainer stops at iteration 1 instead of waiting for ever."""
    engine = FaultyEngine(calls=1, block=True)
    module = make_module(**STALE, off_policy=dict(max_staleness=1), rollout_engine=engine)
    try:
        with pytest.raises(SamplerError, match=r"^model\.off_policy\.sampler_timeout_s 0\.2: the sampler drew no batch for iteration 1"):
            fit(module, tmp_path, 3, batch_size=4, callbacks=[ShortTimeoutFrom(1, 0.2)])
    finally:
        engine.release.set()
        module.async_rollouts.close()  # no draw left running when the tests end
    assert module.iteration == 1


def test_bench_max_staleness_prints_the_ratio_of_the_two_loops(capsys):
    """``python -m tools.benchmarks.bench --tiny --max-staleness 1``: both loops run (alternating), the ratio is the medians'."""
    from tools.benchmarks import bench

    (result,) = bench.main(["--tiny", "--max-staleness", "1", "--mode", "full", "--iters", "2", "--threads", "1"])
    assert result["ratio"] == pytest.approx(result["iter_s"] / result["iter_s_synchronous"])
    assert len(result["seconds"]["k"]) == len(result["seconds"]["sync"]) == 4 and min(result["seconds"]["sync"]) > 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"STALENESS k=1 full_ratio={result['ratio']:.3f} ")


def test_bench_inflight_arm_runs_beside_the_two_loops_on_responses_that_end_at_eos(capsys):
    """``--max-staleness 2 --inflight-every 1 --eos``: three arms alternating, each ratio its median over the synchronous one's."""
    from tools.benchmarks import bench

    argv = ["--tiny", "--max-staleness", "2", "--inflight-every", "1", "--eos", "--mode", "full", "--iters", "2", "--threads", "1"]
    (result,) = bench.main(argv)
    assert result["inflight_ratio"] == pytest.approx(result["iter_s_inflight"] / result["iter_s_synchronous"])
    assert {arm: len(seconds) for arm, seconds in result["seconds"].items()} == {"inflight": 4, "k": 4, "sync": 4}
    assert "full_inflight_ratio=" in capsys.readouterr().out.strip().splitlines()[-1]
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "--max-staleness", "1", "--inflight-every", "1"])  # in-flight needs k >= 2


def test_an_engine_that_cannot_sample_older_weights_is_refused_naming_both_settings():
    from rlhf_lightning.interfaces import RolloutEngine

    class OwnWeights(RolloutEngine):
        def sample(self, module, enc, seed):
            raise AssertionError("not reached")

    with pytest.raises(
        ConfigError, match=r"^model\.rollout_engine must be 'hf' or 'vllm' with model\.off_policy\.max_staleness 1 .*got 'OwnWeights'"
    ):
        make_module(**STALE, off_policy=dict(max_staleness=1), rollout_engine=OwnWeights())


def test_two_process_ddp_samples_ahead_on_every_rank_and_checkpoints_each_ranks_batches(tmp_path):
    """k = 1 on two DDP processes (gloo), greedy rollouts (a function of the weights alone) against one process with
    the same global batch: the same trajectory to float summation order; the checkpoint holds each rank's sampler
    state (gathered from both)."""
    import math

    from helpers import global_batch_run

    runs = {}
    for devices in (1, 2):
        root = tmp_path / str(devices)
        runs[devices] = global_batch_run(root, devices, "--model.sampling.old_logprobs=forward", "--model.off_policy.max_staleness=1")
        last = torch.load(root / "lightning_logs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False)
        ranks = last["rlhf_lightning"]["async_rollouts"]
        # written at the epoch's end: no batch in flight (the next epoch's prompts are not read yet), and version 3,
        # which the next epoch's first batch (iteration 4) is drawn from, kept on every rank
        assert len(ranks) == devices and all(rank["drawn"] == [] and list(rank["versions"]) == [3] for rank in ranks)
    assert runs[2]["off_policy/staleness_mean"] == [0.0, 1.0, 1.0, 1.0]
    assert runs[2]["objective/reward"][-1] > runs[2]["objective/reward"][0]  # it learns
    for name in ("objective/reward", "objective/kl", "response/length", "off_policy/staleness_max"):
        for a, b in zip(runs[1][name], runs[2][name], strict=True):
            assert math.isclose(a, b, rel_tol=2e-3, abs_tol=1e-4), (name, runs[1][name], runs[2][name])


def test_the_command_stopped_mid_epoch_with_a_batch_in_flight_exits_cleanly(tmp_path):
    """``rlhf-lightning fit`` with max_staleness 1 stopped by ``limit_train_batches`` before the epoch's end: the
    sampler is drawing the next batch when fit returns; the process waits for that draw and exits with status 0
    (a thread still in torch at the interpreter's exit aborted it, status 134)."""
    from helpers import run_cli

    result = run_cli(
        tmp_path, "--trainer.limit_train_batches=2", "--model.sampling.old_logprobs=forward", "--model.off_policy.max_staleness=1"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "terminate called" not in result.stderr


def test_strategies_whose_shards_no_version_gathers_are_refused_naming_the_setting():
    """One process, DDP and FSDP2 (ModelParallelStrategy) serve the sampler; FSDP version 1 is refused at start-up with
    the field and the strategies that are served."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from rlhf_lightning.async_rollout import check_strategy

    for served in (DDPStrategy(), ModelParallelStrategy()):
        check_strategy(SimpleNamespace(strategy=served), 1)
    with pytest.raises(ConfigError, match=r"model\.off_policy\.max_staleness must be 0 under FSDPStrategy \(.*DDP and FSDP2"):
        check_strategy(SimpleNamespace(strategy=FSDPStrategy()), 1)
