"""KL monitoring: KLGuard's spikes, budgets, stop and rollback; TokenKLView's TensorBoard output."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlhf_lightning.kl_monitor import KLGuard, TokenKLView
from rlhf_lightning.module import PPORLHF

from helpers import fit, make_module


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class FakeModule:
    """What KLGuard reads from a PPORLHF in warn mode: the iteration counter, its step and log_dict."""

    def __init__(self):
        self.iteration, self.logged = 0, []

    step = PPORLHF.step

    def log_dict(self, metrics, **kwargs):
        self.logged.append(metrics)


def feed(guard: KLGuard, kl: list[float], kl_max: list[float]) -> tuple[list[str], SimpleNamespace, FakeModule]:
    """Run ``guard`` over a scripted metric sequence; return the warnings it raised."""
    trainer = SimpleNamespace(callback_metrics={}, loggers=[], is_global_zero=True, should_stop=False, optimizers=[])
    module = FakeModule()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kl_t, kl_max_t in zip(kl, kl_max, strict=True):
            module.iteration += 1
            metrics = {"objective/kl": kl_t, "objective/kl_max": kl_max_t}
            guard.on_train_batch_end(trainer, module, {"metrics": metrics, "skipped": False}, None, 0)
    return [str(w.message) for w in caught], trainer, module


def test_spikes_over_the_ema_level_warn_once_per_iteration():
    guard = KLGuard(spike_factor=3.0, level="ema", ema_decay=0.5, warmup=2, min_level=1.0)
    # objective/kl, EMA level before each iteration (level <- 0.5 level + 0.5 x), threshold 3 * max(level, 1):
    #  it1 0    (no level yet)      it2 0    (1 value < warmup)    it3 0.5 level 0 -> 3: no
    #  it4 1    level 0.25 -> 3: no  it5 1    level 0.625 -> 3: no  it6 6  level 0.8125 -> 3: SPIKE
    #  it7 1    level 3.406 -> 10.2  it8 1    level 2.203 -> 6.6    it9 6  level 1.602 -> 4.8: SPIKE
    kl = [0, 0, 0.5, 1, 1, 6, 1, 1, 6]
    # objective/kl_max = 2 kl spikes in the same iterations (one warning each), and alone at it5:
    # it5: EMA of kl_max over [0, 0, 1, 2] = 1.25 -> 3.75 < 4.
    kl_max = [2 * x for x in kl]
    kl_max[4] = 4.0
    messages, trainer, module = feed(guard, kl, kl_max)
    assert [m.split(":")[1].strip() for m in messages] == [
        "KL spike at iteration 4",
        "KL spike at iteration 5",
        "KL spike at iteration 8",
    ]  # messages name an iteration by its TensorBoard step (0-based): it5, it6, it9 above
    assert "objective/kl = 6 > 3 x running level 0.8125" in messages[1] and "objective/kl_max = 12" in messages[1]
    assert guard.counts == {"spikes": 3, "violations": 0, "rollbacks": 0}
    assert module.logged[-1] == {"system/kl_guard/spikes": 3.0, "system/kl_guard/violations": 0.0, "system/kl_guard/rollbacks": 0.0}
    assert not trainer.should_stop


def test_spikes_over_the_median_level():
    guard = KLGuard(spike_factor=3.0, level="median", window=3, warmup=3, min_level=0.0)
    # median of the last 3 values before it4: 1 -> 4 > 3 spike; it5: median(1,1,4)=1 -> 1 no;
    # it6: median(1,4,1)=1 -> 4 > 3 spike; it7: median(4,1,4)=4 -> 4 < 12 no; it8: median(1,4,4)=4 -> 12 > 12 no.
    kl = [1, 1, 1, 4, 1, 4, 4, 12]
    messages, _, _ = feed(guard, kl, kl)
    assert len(messages) == 2 and guard.counts["spikes"] == 2
    assert "iteration 3" in messages[0] and "iteration 5" in messages[1]  # it4 and it6, by their 0-based step


def test_state_dict_round_trip_continues_the_same_levels():
    kl = [1.0, 2.0, 1.5, 1.0]
    first = KLGuard(level="median", window=3)
    feed(first, kl, kl)
    second = KLGuard(level="median", window=3)
    second.load_state_dict(first.state_dict())
    assert second.state_dict() == first.state_dict()
    assert list(second.levels["objective/kl"].recent) == [2.0, 1.5, 1.0]
    messages, _, _ = feed(second, [9.0], [9.0])  # 9 > 3 * median(2, 1.5, 1) = 4.5, warmup already met
    assert len(messages) == 1 and second.counts["spikes"] == 1


def test_an_iteration_skipped_for_a_fault_is_not_judged():
    """A skipped iteration returns no metrics (callback_metrics still hold the previous iteration's KL)."""
    guard = KLGuard(max_kl=1.0)
    trainer = SimpleNamespace(callback_metrics={"objective/kl": torch.tensor(5.0)}, loggers=[], is_global_zero=True)
    module = FakeModule()
    module.iteration = 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.on_train_batch_end(trainer, module, {"metrics": {}, "skipped": True}, None, 0)
    assert guard.counts["violations"] == 0 and module.logged == [] and guard.levels["objective/kl"].n == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_kl": 0}, "max_kl"),
        ({"max_kl_max": -1.0}, "max_kl_max"),
        ({"action": "explode", "max_kl": 1.0}, "action"),
        ({"action": "stop"}, "action"),  # no budget to enforce
        ({"spike_factor": 1.0}, "spike_factor"),
        ({"level": "mean"}, "level"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"window": 0}, "window"),
        ({"warmup": 1.5}, "warmup"),
        ({"min_level": -0.1}, "min_level"),
        ({"snapshot_every": 0}, "snapshot_every"),
        ({"max_consecutive_rollbacks": 0}, "max_consecutive_rollbacks"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"KLGuard\.{field} must be"):
        KLGuard(**kwargs)


@pytest.mark.parametrize("field", ["every_n_iterations", "num_samples", "max_tokens", "line_chars"])
def test_token_kl_view_bad_arguments_name_the_field(field):
    with pytest.raises(ValueError, match=rf"TokenKLView\.{field} must be an integer >= 1"):
        TokenKLView(**{field: 0})


def script_kl(module, kl: dict[int, float]):
    """Make the module report objective/kl = kl[iteration] (1-based) where given; the real value elsewhere."""
    original = module.rollout_metrics

    def rollout_metrics(*args, **kwargs):
        metrics = original(*args, **kwargs)
        metrics["objective/kl"] = kl.get(module.iteration + 1, metrics["objective/kl"])
        return metrics

    module.rollout_metrics = rollout_metrics


def policy_vector(module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in module.parameters() if p.requires_grad])


class AfterGuard(Callback):
    """Weights, first optimizer's Adam state and beta after every iteration, as left by the callbacks before it."""

    def __init__(self):
        self.weights, self.exp_avg, self.beta = [], [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.weights.append(policy_vector(module))
        state = trainer.optimizers[0].state_dict()["state"]
        self.exp_avg.append(torch.cat([s["exp_avg"].flatten().clone() for s in state.values()]))
        self.beta.append(module.beta_controller.beta)


def test_budget_exceeded_with_stop_ends_the_run_after_that_iteration(tmp_path):
    module = make_module()
    script_kl(module, {1: 0.1, 2: 0.2, 3: 50.0})
    guard = KLGuard(max_kl=10.0, action="stop", spike_factor=None)
    logger = TensorBoardLogger(str(tmp_path), name="", version="stop")
    with pytest.warns(UserWarning, match=r"KLGuard: KL budget exceeded at iteration 2: objective/kl = 50 > max_kl = 10; stopping"):
        trainer, history = fit(module, tmp_path, iterations=6, batch_size=4, callbacks=[guard], logger=logger, log_every_n_steps=1)
    assert module.iteration == 3 and len(history.rows) == 3
    assert trainer.should_stop and "stopping the run" in guard.stop_reason
    assert float(trainer.callback_metrics["system/kl_guard/violations"]) == 1.0
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert "kl_guard/text_summary" in events.Tags()["tensors"]
    assert [e.value for e in events.Scalars("system/kl_guard/violations")] == [0.0, 0.0, 1.0]


def test_rollback_restores_the_last_good_weights_optimizer_state_and_beta(tmp_path):
    module = make_module(beta_controller="adaptive")  # beta moves every iteration
    script_kl(module, {3: 50.0})
    guard = KLGuard(max_kl=10.0, action="rollback", spike_factor=None, snapshot_every=1)
    after = AfterGuard()
    with pytest.warns(UserWarning, match=r"iteration 2: objective/kl = 50 > max_kl = 10; rolled back to the state after iteration 1"):
        _, history = fit(module, tmp_path, iterations=4, batch_size=4, callbacks=[guard, after])
    assert guard.counts == {"spikes": 0, "violations": 1, "rollbacks": 1}
    # Iteration 3 trained and changed everything; the rollback put back exactly the state after iteration 2.
    assert torch.equal(after.weights[2], after.weights[1])
    assert torch.equal(after.exp_avg[2], after.exp_avg[1])
    assert after.beta[1] != after.beta[0] and after.beta[2] == after.beta[1]  # moved each iteration, but not over it3
    # Iteration 4 started from it (its beta, logged in float32, is the beta after iteration 2) and trained on.
    assert history.rows[3]["objective/beta"] == pytest.approx(after.beta[1], rel=1e-6)
    assert not torch.equal(after.weights[3], after.weights[2])
    assert module.iteration == 4  # the counter is not rolled back


def test_token_kl_view_writes_an_image_and_a_histogram(tmp_path):
    module = make_module()
    view = TokenKLView(every_n_iterations=2, num_samples=2)
    logger = TensorBoardLogger(str(tmp_path), name="", version="view")
    _, history = fit(module, tmp_path, iterations=3, batch_size=4, callbacks=[view], logger=logger, log_every_n_steps=1)
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "histograms": 0})
    events.Reload()
    assert "kl_tokens/responses" in events.Tags()["images"]
    assert "kl_tokens/per_token" in events.Tags()["histograms"]
    images = events.Images("kl_tokens/responses")
    assert [i.step for i in images] == [0, 2] and images[0].width > 100 and images[0].height > 50
    # The last histogram is the per-token KL of the last iteration's response tokens.
    hist = events.Histograms("kl_tokens/per_token")[-1].histogram_value
    outputs = history.outputs[-1]
    mask = outputs["rollout"].response_mask.bool()
    assert hist.num == int(mask.sum())
    assert hist.sum == pytest.approx(float(outputs["kl"][mask].sum()), abs=1e-4)


def test_rollbacks_that_do_not_help_stop_the_run(tmp_path):
    module = make_module()
    script_kl(module, {2: 50.0, 3: 50.0})
    guard = KLGuard(max_kl=10.0, action="rollback", spike_factor=None, max_consecutive_rollbacks=1)
    with pytest.warns(UserWarning, match=r"iteration 2: .*1 rollbacks in a row did not help.*stopping the run"):
        fit(module, tmp_path, iterations=5, batch_size=4, callbacks=[guard])
    assert module.iteration == 3 and guard.counts == {"spikes": 0, "violations": 2, "rollbacks": 1}


def test_scalars_text_images_and_histograms_share_one_step_axis(tmp_path):
    """Every record of an iteration is stamped with its 0-based index, the step of its scalars."""
    module = make_module(runtime=dict(log_samples_every_n_steps=1))
    logger = TensorBoardLogger(str(tmp_path), name="", version="steps")
    fit(module, tmp_path, iterations=3, batch_size=4, callbacks=[TokenKLView(every_n_iterations=1)], logger=logger, log_every_n_steps=1)
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "histograms": 0, "tensors": 0, "scalars": 0})
    events.Reload()
    steps = [0, 1, 2]
    assert [e.step for e in events.Scalars("objective/kl")] == steps
    assert [e.step for e in events.Tensors("samples/text_summary")] == steps
    assert [e.step for e in events.Images("kl_tokens/responses")] == steps
    assert [e.step for e in events.Histograms("kl_tokens/per_token")] == steps
