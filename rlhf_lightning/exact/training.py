"""Three ways to train on an enumerable task, each measured against the closed-form optimum.

- :func:`train`: the unchanged PPORLHF loop under a Lightning Trainer, from sampled rollouts, with an
  :class:`OptimumTracker` writing the exact distances every few iterations;
- :func:`expected_train`: the module's own loss with every rollout replaced by its exact expectation,
  so where it goes is where the loss's expected gradient leads (no sampling noise);
- :func:`sampled_ppo`: the module's loss pieces on a tabular policy (one logit vector per prompt and
  prefix), from sampled responses, so where it settles is the loss's doing, not a shared network's.

What they show (tests/test_exact.py, tools/studies/optimum_check/): with the penalty in the reward
only k1 reaches pi*. PPO differentiates the rewards only through log pi of the sampled token, so
E_pi[grad kl_t] is lost; it is 0 for k1, but not for k3 nor for full, which collapse towards the
reward maximiser there and reach pi* with kl_penalty 'both' and unwhitened advantages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

import torch
from lightning import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from rlhf_lightning import args as settings
from rlhf_lightning import inflight, recipes, sampling, trust_regions
from rlhf_lightning import ppo_math as pm
from rlhf_lightning.checks import require
from rlhf_lightning.exact.closed_form import (
    backward_induction,
    distance_scale,
    kl_divergence,
    length_report,
    optimal_logprobs,
    optimum_logprobs,
    optimum_report,
    prompt_betas,
    prompt_kls,
    weighted_fixed_point,
)
from rlhf_lightning.exact.episode_tasks import EpisodeTracker, ExactEpisodePPORLHF, ExactEpisodeTask
from rlhf_lightning.exact.tabular import conditional_tables, enumerate_responses, prefix_index, reward_to_go
from rlhf_lightning.exact.tasks import ExactPPORLHF, ExactTask
from rlhf_lightning.module import Trajectory
from rlhf_lightning.registry import registry
from rlhf_lightning.trainer_settings import QUIET_TRAINER

MEAN_BASELINES = ("rloo", "dr_grpo", "reinforce_pp")  # critic-free, the reward's baseline a mean, nothing divided per prompt


def recipe_class(module: ExactPPORLHF) -> str:
    """The class of the module's KL recipe (``recipes.kl_recipe``), with its loss aggregation."""
    kl = module.kl
    aggregation = recipes.aggregation_name(module.loss_aggregation)
    return recipes.kl_recipe(module.kl_estimator, kl.placement, kl.loss_weighting, kl.loss_scope, aggregation)[0]


def documented_optimum(module: ExactPPORLHF, ref_logprobs: Tensor, rewards: Tensor, beta: float) -> Optional[Tensor]:
    """log pi of where the module's recipe converges by the docs (docs/kl-estimators.md): pi* (``unbiased``,
    ``high_variance`` in expectation; a sequence-level divergence's pi*_f),
    the per-token fixed point (``per_token``), :func:`weighted_fixed_point` with weights 1 / |y|
    (``length_weighted``, the KL in the loss and a critic-free estimator with a mean baseline); None where
    the docs compute none (a biased recipe, a weighted one with a critic or with ``both``)."""
    recipe, task = recipe_class(module), module.task
    if recipe in ("unbiased", "high_variance") or not module.divergence.per_token:
        # pi* (in expectation for high_variance); a sequence-level divergence's penalty in the reward: J_f's
        return optimum_logprobs(ref_logprobs, rewards, beta, module.divergence)
    if recipe == "per_token":
        return backward_induction(ref_logprobs, rewards, beta, task.num_symbols, soft=False)
    mean_baseline = type(module.advantage_estimator) in {registry("advantage_estimator").get(name) for name in MEAN_BASELINES}
    if recipe == "length_weighted" and module.kl.placement == "loss" and mean_baseline:
        lengths = task.lengths
        return weighted_fixed_point(ref_logprobs, rewards, beta, task.num_symbols, 1.0 / lengths.double(), lengths, module.kl.loss_scope)
    return None


class OptimumTracker(Callback):
    """Every ``every`` PPO iterations (and after the last), the exact OptimumReport of the policy
    against the reference it trained on in that iteration, next to ``kl_logged``: the mean of the
    logged objective/kl over the iterations since the last row. The logged value of an iteration
    estimates the KL of the policy that sampled its rollout.

    Each row also measures the policy against the iterated optimum pi_k ∝ pi_0 exp(k r / beta), with
    k = 1 + the summed weights alpha of the reference updates before that iteration (k = 1, the
    plain optimum, for a frozen reference): ``k``, ``iterated_gap`` (the gap of J at beta / k with
    reference pi_0), ``iterated_kl_to_optimum`` = KL(pi || pi_k) and ``kl_to_initial`` = KL(pi || pi_0), pi_0 the policy
    at the start (with a teacher as the reference, ``ExactTask.teacher_seed``, not the reference).

    And the recipe's own optimum (:func:`documented_optimum`; NaN where the docs give none):
    ``own_distance`` = beta KL(pi || own) / |J*| (the gap's unit: 0 exactly there) and ``own_gap``, the gap
    of the own optimum itself (0 for pi*); lengths: ``mean_length`` and ``truncated`` (the share cut
    without EOS) of pi, ``optimum_mean_length`` and ``optimum_truncated`` of pi*.

    With a per-prompt controller the optimum is each prompt's, tilted at the prompt's own current beta (the gap
    E_x beta_x KL(pi || pi*) / |J*|; no per-token fixed point nor own optimum: NaN), and the row adds the budget
    columns of :meth:`_budget_row`. With a sequence-level ``model.divergence`` (not the reverse KL) the objective,
    optimum and gap are J_f's and pi* is pi*_f (``exact.f_divergence.divergence_optimal_logprobs``); the iterated optimum's
    theory is the reverse KL's, so its columns mean something there only with a frozen reference (k = 1, where
    they repeat the plain ones)."""

    READS = ("objective/kl", "rollout/logprob_diff_max")  # the logged metrics it reads (ExactPPORLHF's ``logged``)

    def __init__(self, every: int = 10, total: Optional[int] = None) -> None:
        self.every, self.total = every, total
        self.rows: list[dict[str, float]] = []
        self._logged: list[float] = []
        self._rewards: Optional[Tensor] = None
        self._initial: Optional[Tensor] = None  # log pi_ref at the start: pi_0 unless the reference is a teacher (prompts, responses)
        self._start: Optional[Tensor] = None  # log pi_0, the policy at the start
        self._ref: Optional[Tensor] = None  # log pi_ref before the iteration
        self._k = 1.0
        self._diff_max = 0.0  # the largest rollout/logprob_diff_max so far: the sampler against the trainer

    def on_train_start(self, trainer, pl_module: ExactPPORLHF) -> None:
        self._rewards = pl_module.task.rewards()
        self._initial, self._start = pl_module.exact_ref_logprobs(), pl_module.exact_logprobs()
        self._ref = self._initial
        self.rows.append(self._row(pl_module, 0, math.nan))

    def on_train_batch_start(self, trainer, pl_module: ExactPPORLHF, batch, batch_idx) -> None:
        done = pl_module.iteration
        self._k = 1.0 + sum(pl_module.reference_update.weight(i) for i in range(1, done + 1))
        if pl_module.reference_update.moves:
            self._ref = pl_module.exact_ref_logprobs()

    def on_train_batch_end(self, trainer, pl_module: ExactPPORLHF, outputs, batch, batch_idx) -> None:
        self._logged.append(float(trainer.callback_metrics["objective/kl"]))
        self._diff_max = max(self._diff_max, float(trainer.callback_metrics.get("rollout/logprob_diff_max", 0.0)))
        iteration = pl_module.iteration
        if iteration % self.every == 0 or iteration == self.total:
            self.rows.append(self._row(pl_module, iteration, sum(self._logged) / len(self._logged)))
            self._logged = []

    def _row(self, pl_module: ExactPPORLHF, iteration: int, kl_logged: float) -> dict[str, float]:
        logprobs, beta = pl_module.exact_logprobs(), pl_module.exact_beta()
        # With top_k / top_p the optimum is that of the declared objective at the policy's own kept sets.
        ref = pl_module.exact_ref_logprobs() if pl_module.truncates else self._ref
        task, per_prompt, divergence = pl_module.task, isinstance(beta, Tensor), pl_module.divergence
        num_tokens = None if per_prompt or not divergence.per_token else task.num_symbols
        report = optimum_report(logprobs, ref, self._rewards, beta, num_tokens, divergence)
        iterated = optimum_report(logprobs, self._initial, self._rewards, beta / self._k, divergence=divergence)
        own = None if per_prompt else documented_optimum(pl_module, ref, self._rewards, beta)
        own_distance = own_gap = math.nan
        if own is not None:
            own_distance = distance_scale(beta, report.optimum, self._rewards) * kl_divergence(logprobs, own)
            own_gap = optimum_report(own, ref, self._rewards, beta, divergence=divergence).gap
        lengths = length_report(logprobs, task.lengths, task.ended_with_eos)
        optimum = optimum_logprobs(ref, self._rewards, beta, divergence)
        optimum_lengths = length_report(optimum, task.lengths, task.ended_with_eos)
        return {
            "iteration": iteration,
            **vars(report),
            "kl_logged": kl_logged,
            "logprob_diff_max": self._diff_max,
            "k": self._k,
            "iterated_gap": iterated.gap,
            "iterated_kl_to_optimum": iterated.kl_to_optimum,
            "kl_to_initial": kl_divergence(logprobs, self._start),
            "own_distance": own_distance,
            "own_gap": own_gap,
            **lengths,
            "optimum_mean_length": optimum_lengths["mean_length"],
            "optimum_truncated": optimum_lengths["truncated"],
            **(self._budget_row(pl_module, logprobs, ref, beta) if per_prompt else {}),
        }

    def _budget_row(self, pl_module: ExactPPORLHF, logprobs: Tensor, ref: Tensor, betas: Tensor) -> dict[str, float]:
        """A per-prompt controller's columns: ``budget_max_rel_error``, max_x |KL_x(pi) / budget_x - 1| in the
        controller's unit, exact; ``optimum_budget_max_rel_error``, the same of pi* at the current betas (how far the
        betas are from where the budgets put them); ``beta_max_rel_error``, max_x |beta_x / beta_x^rest - 1| against
        the closed-form resting betas (``prompt_betas``); ``beta_min`` and ``beta_max``."""
        controller, task = pl_module.beta_controller, pl_module.task
        budgets = controller.budgets_of(pl_module.prompt_table.ids_of(list(task.prompts)))
        kls = prompt_kls(logprobs, ref, controller.unit, task.lengths)
        optimum_kls = prompt_kls(optimal_logprobs(ref, self._rewards, betas), ref, controller.unit, task.lengths)
        rest = prompt_betas(ref, self._rewards, budgets, controller.unit, task.lengths)
        return {
            "budget_max_rel_error": float((kls / budgets - 1).abs().max()),
            "optimum_budget_max_rel_error": float((optimum_kls / budgets - 1).abs().max()),
            "beta_max_rel_error": float((betas / rest - 1).abs().max()),
            "beta_min": float(betas.min()),
            "beta_max": float(betas.max()),
        }

    @property
    def last(self) -> dict[str, float]:
        return self.rows[-1]


def lr_factor(iteration: int, iterations: int, final: float, hold: float = 0.0) -> float:
    """The fraction of the lr at ``iteration`` of ``iterations``: 1 for the first ``hold`` fraction,
    then falling linearly to ``final`` at the last iteration."""
    progress = iteration / max(iterations - 1, 1)
    return 1.0 - (1.0 - final) * max(progress - hold, 0.0) / (1.0 - hold)


class LinearLRDecay(Callback):
    """Learning rates hold their configured values for the first ``hold`` fraction of ``iterations``
    PPO iterations, then fall linearly to ``final`` times them at the last, and start again after each
    ``iterations`` (one decay per reference phase when the reference is reset every ``iterations``):
    with a constant step size stochastic updates only reach a noise ball around the optimum; a
    decaying one lets the last iterate settle inside it."""

    def __init__(self, iterations: int, final: float = 0.1, hold: float = 0.0) -> None:
        require(0 <= hold < 1, "hold", "in [0, 1)", hold)
        self.iterations, self.final, self.hold = iterations, final, hold
        self._initial: list[list[float]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self._initial = [[group["lr"] for group in opt.param_groups] for opt in trainer.optimizers]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        factor = lr_factor(pl_module.iteration % self.iterations, self.iterations, self.final, self.hold)
        for opt, initial in zip(trainer.optimizers, self._initial, strict=True):
            for group, lr in zip(opt.param_groups, initial, strict=True):
                group["lr"] = lr * factor


def train(
    task: ExactTask,
    iterations: int,
    batch_size: int = 48,
    every: int = 10,
    seed: int = 0,
    lr_final: float = 1.0,
    lr_period: Optional[int] = None,
    lr_hold: float = 0.0,
    end_batch_size: Optional[int] = None,
    end_iterations: int = 0,
    trainer_options: Optional[dict[str, Any]] = None,
    **module_kwargs: Any,
) -> tuple[ExactPPORLHF, OptimumTracker | EpisodeTracker]:
    """Train ExactPPORLHF with a Lightning Trainer on CPU; return the module and its tracker.
    ``batch_size`` counts responses per iteration (prompts x ``num_generations``).
    ``lr_final`` < 1 decays the learning rates linearly to that fraction (LinearLRDecay), over
    the whole run or, restarting, over every ``lr_period`` iterations, after holding them for the
    first ``lr_hold`` fraction of it. The last ``end_iterations`` iterations sample ``end_batch_size``
    responses each: an end with less gradient noise at the same lr (a smaller final lr quiets the end
    too, but also slows the run). ``trainer_options`` go to the ``Trainer`` (e.g. ``devices=2,
    strategy="ddp"``: each rank samples ``batch_size`` responses of its own).

    ``seed`` is the sampling seed (rollouts, and the critic's head): one task can be trained with
    several. The policy's initialisation, hence pi_ref, is the task's (``task.model_seed``); for a task
    without one (``terminal``, ``bandit``) ``seed`` sets it too, as it always has. An
    :class:`~rlhf_lightning.exact.episode_tasks.ExactEpisodeTask` trains :class:`ExactEpisodePPORLHF` (its
    environment ``lab_chance``; ``policy_tokens_only`` among ``module_kwargs``) under an :class:`EpisodeTracker`."""
    num_generations = module_kwargs.get("num_generations", 1)
    for name, size in (("batch_size", batch_size), ("end_batch_size", end_batch_size or batch_size)):
        require(size % num_generations == 0, name, f"a multiple of num_generations={num_generations}", size)
    require(0 <= end_iterations <= iterations, "end_iterations", f"between 0 and the {iterations} iterations", end_iterations)
    require(
        (end_batch_size is None) == (end_iterations == 0),
        "end_batch_size and end_iterations",
        "given together",
        (end_batch_size, end_iterations),
    )

    seed_everything(seed, verbose=False)  # the module draws its sampling seed base from torch's initial seed
    episodes = isinstance(task, ExactEpisodeTask)  # two turns and an environment: their own module and exact row
    module_class, tracker_class = (ExactEpisodePPORLHF, EpisodeTracker) if episodes else (ExactPPORLHF, OptimumTracker)
    module = module_class(task, seed=seed if task.model_seed is None else task.model_seed, **module_kwargs)
    tracker = tracker_class(every=every, total=iterations)
    callbacks = [tracker] if lr_final == 1.0 else [LinearLRDecay(lr_period or iterations, lr_final, lr_hold), tracker]
    trainer = Trainer(**{**QUIET_TRAINER, **(trainer_options or {})}, max_epochs=1, callbacks=callbacks)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small only lose time to thread hand-offs
    try:
        trainer.fit(
            module,
            train_dataloaders=task.dataloader(
                iterations, batch_size // num_generations, (end_batch_size or batch_size) // num_generations, end_iterations
            ),
        )
    finally:
        torch.set_num_threads(threads)
    return module, tracker


def expected_train(
    task: ExactTask,
    iterations: int,
    beta: float,
    lr: float = 2e-3,
    lr_final: float = 0.1,
    lr_hold: float = 0.0,
    every: int = 50,
    num_minibatches: int = 2,
    responses: Optional[int] = None,
    seed: int = 0,
    kl_penalty: str = "loss",
    staleness: int = 0,
    correction: str = "sequence",
    correction_cap: float = math.inf,
    trust_band: Optional[Any] = None,
    sampler_drift: float = 0.0,
    inflight_every: int = 0,
    inflight_label: str = "token",
    **module_kwargs: Any,
) -> list[dict[str, float]]:
    """PPO with the KL in the loss (or, ``kl_penalty="both"``, in the loss and the reward) where every rollout
    is replaced by its exact expectation: no sampling noise, so where it goes is where the loss's expected gradient leads (bias against noise: the matrix of
    ``python -m tools.studies.optimum_check --expected-gradient``).

    Each iteration: pi_old = the current policy; the "rollout" is every response of every prompt, each
    response's per-token losses weighted by pi_old(y|x) / prompts times the module's loss aggregation in
    expectation (``token_mean``: 1 / E_old |y|; ``seq_mean_token_mean``: 1 / |y|; ``seq_mean_token_sum``: 1;
    ``constant``: 1 / its normaliser), so the weighted sum is the expectation of the module's loss; the
    advantage is exact, A_t = G_t - E_{pi_old}[G_t | x, y_<t] with the return G_t = r(x, y), minus beta
    sum_{t' >= t} k_t' of the estimator's values at pi_old where the reward carries the KL (any baseline of
    the prefix leaves the expectation unchanged); then ``ppo_epochs`` x
    ``num_minibatches`` full-batch AdamW steps (as many as the sampled loop takes, each on the whole
    expectation, of which a minibatch is an unbiased half, its gradients clipped to ``max_grad_norm`` as the
    module clips them) of the module's own :meth:`PPOUpdate.loss`:
    clipped surrogate plus beta times the KL loss of its ``kl_estimator``, ``kl_loss_weighting`` and
    ``kl_loss_scope``; the lr held for the first ``lr_hold`` fraction of the run, then decayed linearly
    to ``lr_final`` of ``lr``. A loss whose expected gradient is
    grad J at pi_old = pi_theta has pi* as its fixed point at every number of epochs (at a fixed point the
    first epoch's gradient is 0); a per-token one has :func:`backward_induction` (``soft=False``).
    Returns a row every ``every`` iterations and after the last: the iteration and the fields of
    :func:`optimum_report`.

    ``responses`` N puts back the sampling noise and nothing else of the sampled loop: each iteration
    draws N responses from pi_old (equally many per prompt, generator seeded by ``seed``) in
    ``num_minibatches`` minibatches, each used once per epoch, and a minibatch's step weighs each response
    by how often it was drawn instead of by pi_old (same advantage, same loss). Where the sampled matrix
    and this part ways is the sampled loop's (critic, engine); where this and the exact path part ways is
    the noise's.

    ``staleness`` k samples iteration i's "rollout" from the policy of k iterations ago, mu = the weights of
    version max(0, i - k) (version: completed iterations), as the asynchronous loop does: every response weighted
    by mu(y|x) instead of pi_old(y|x), pi_old (the PPO ratio's anchor, the KL's values) the proximal policy, the
    current weights; the advantage A_t = G_t - E_mu[G_t | x, y_<t] (a critic or group fitted to mu's samples), and
    the module's loss (``PPOUpdate.loss``) with the weights of ``model.off_policy.correction`` ``correction`` truncated at ``correction_cap``
    (uncapped by default) on every term (``sequence``: the whole response's pi_prox(y) / mu(y); ``token``: each
    token's; ``none``: no weight; ``args.OFF_POLICY_WEIGHTS``, docs/kl-estimators.md, "Stale samples"). Each row
    then also has ``off_policy/ess``, ``off_policy/clipped_fraction`` and ``off_policy/weight_mass`` of the last
    iteration's weights under mu (``sampling.off_policy_weight_metrics``). A sampler-side trust region (``correction``
    ``icepop``, ``ipo``, ``m2po``) takes its setting from ``trust_band`` (None: its default, ``trust_regions``).

    ``sampler_drift`` d injects a sampler that is off by a declared amount, as another engine's numerics are: mu's logit
    of the first content symbol is d higher than the weights' at every state (``PerturbedSampler``'s error, in the
    lab), at every staleness, 0 included; the correction then weighs from that mu (weights none without either).

    ``inflight_every`` N > 0 (with ``staleness`` >= 2) draws as in-flight weight updates do (``inflight.token_versions``):
    token t from version min(max(v0, i - 1), v0 + t // N), v0 = max(0, i - k), so mu(y|x) = prod_t mu_v(t)(y_t|x, y_<t),
    each token's mu the log-prob of its own version (``inflight_label`` ``token``, what the sampler records); ``newest``
    is the declared mistake of labelling the whole response with the newest version its tokens came from (each token's
    mu taken from that version), which the correction then divides by while the responses are drawn from the true mu."""
    require(isinstance(staleness, int) and staleness >= 0, "staleness", "an integer >= 0", staleness)
    require(not inflight_every or staleness >= 2, "staleness", f">= 2 with inflight_every {inflight_every}", staleness)
    require(inflight_label in ("token", "newest"), "inflight_label", "token or newest", inflight_label)
    require(correction in settings.OFF_POLICY_WEIGHTS, "correction", "one of " + ", ".join(settings.OFF_POLICY_WEIGHTS), correction)
    off = staleness or sampler_drift
    weight_mode = settings.OFF_POLICY_WEIGHTS[correction] if off else "none"  # synchronous and exact: mu is pi_old
    if correction in trust_regions.TRUST_REGIONS:
        correction_cap = trust_regions.setting_of(correction, trust_band)
    module = ExactPPORLHF(task, kl_penalty=kl_penalty, advantage_estimator="rloo", num_generations=2, lr=lr, **module_kwargs)
    module.configure_model()
    optimizer = module.configure_optimizers()
    rewards, length, num_tokens = task.rewards(), task.response_length, task.num_symbols
    ref_logprobs = module.exact_ref_logprobs()
    input_ids, attention_mask, mask = module._all_responses()
    prompts, response = rewards.shape[0], input_ids[:, -length:]
    with module.networks.reference() as ref:
        ref_logits = module.networks.response_logits(ref, input_ids, attention_mask, length)  # for an estimator that reads them (full)
    ref_token_logprobs = pm.logprobs_of(ref_logits, response)
    shape = (prompts, *[num_tokens] * length)
    # Each response's weight in the aggregation, as its share of the responses (the batch's denominators
    # in expectation): 1 / E[|y|] per token for token_mean, 1 / |y| for seq_mean_token_mean, ...
    aggregation = module.loss_aggregation.weights(mask, module.sampling.max_new_tokens) * len(mask)
    token_mean = recipes.aggregation_name(module.loss_aggregation) == "token_mean"
    if responses is not None:
        draws = torch.Generator().manual_seed(seed)
        per_minibatch = responses // (prompts * num_minibatches)
        require(per_minibatch >= 1, "responses", f"at least one per prompt and minibatch ({prompts} x {num_minibatches})", responses)
    rows, history, weight_metrics = [], [], {}  # history: each version's token log-probs and joint log pi(y|x)
    symbol = torch.tensor(module.symbol_ids[:1], device=input_ids.device)  # the logit a drifting sampler raises
    for iteration in range(iterations + 1):
        logprobs = module.exact_logprobs()
        if iteration % every == 0 or iteration == iterations:
            report = vars(optimum_report(logprobs, ref_logprobs, rewards, beta, num_tokens))
            rows.append({"iteration": iteration, **report, **weight_metrics})
        if iteration == iterations:
            break
        with torch.no_grad():
            old_logits = module.networks.response_logits(module.policy, input_ids, attention_mask, length)
            old_logprobs = pm.logprobs_of(old_logits, response)
            drawn_logprobs, drawn = old_logprobs, logprobs  # what this version's sampler draws: per token and log mu(y|x)
            if sampler_drift:
                drawn_logprobs = pm.logprobs_of(
                    old_logits.index_add(-1, symbol, torch.full_like(old_logits[..., :1], sampler_drift)), response
                )
                drawn = logprobs + ((drawn_logprobs.double() - old_logprobs.double()) * mask).sum(-1).view_as(logprobs).cpu()
        history = [*history, (drawn_logprobs, drawn)][-(staleness + 1) :]
        sampler_logprobs, behaviour = history[0]  # mu: the weights of version max(0, iteration - staleness)
        if inflight_every:  # token t from version v(t): history[j] is version iteration - len(history) + 1 + j
            versions = [v - iteration + len(history) - 1 for v in inflight.token_versions(iteration, staleness, inflight_every, length)]
            per_token = torch.stack([history[v][0][:, t] for t, v in enumerate(versions)], -1)
            behaviour = behaviour + ((per_token.double() - sampler_logprobs.double()) * mask).sum(-1).view_as(behaviour).cpu()
            sampler_logprobs = per_token if inflight_label == "token" else history[versions[-1]][0]
        mu_share = behaviour.exp().reshape(-1, 1) / prompts
        is_weights = sampling.correction_weights(old_logprobs, sampler_logprobs, mask, weight_mode, correction_cap, mu_share)
        if off:
            weight_metrics = sampling.off_policy_weight_metrics(old_logprobs, sampler_logprobs, mask, weight_mode, correction_cap, mu_share)
        rollout = Trajectory(
            # one group per row: enumerated responses are not independent samples, so no leave-one-out
            # baseline (ppo_math.kl_to_go_loss's groups); the exact expectation needs none
            prompts=[str(row) for row in range(len(input_ids))],
            response_texts=[],
            input_ids=input_ids,
            attention_mask=attention_mask,
            responses=response,
            response_mask=mask,
            ended_with_eos=task.ended_with_eos.repeat(prompts),
            old_logprobs=old_logprobs,
            trainer_logprobs=old_logprobs,
            sampler_logprobs=sampler_logprobs,
            ref_logprobs=ref_token_logprobs,
            ref_logits=ref_logits,
            old_logits=old_logits,
            old_values=None,
            entropy=torch.zeros_like(mask),
            is_weights=is_weights,
        )
        # The return from each token G_t = r - beta sum_{t' >= t} k_t' (the estimator's values at pi_old, with
        # the KL in the reward) and V_old(x, y_<t) = E_{pi_old}[G_t | x, y_<t]: sums of pi_old(y) G_t over the
        # responses sharing the prefix
        kl = module.regulariser.kl_per_token(rollout).double() if module.kl.in_reward else torch.zeros_like(mask, dtype=torch.float64)
        to_go = rewards.reshape(-1, 1) - beta * kl.flip(-1).cumsum(-1).flip(-1)  # (prompts * paths, length)
        joint, values = behaviour.exp().view(shape), []  # V^mu: E_mu[G_t | x, y_<t]
        for t in range(length):
            value = reward_to_go(joint, to_go[:, t].view(shape), t)
            values.append(value.reshape(prompts, -1).repeat_interleave(num_tokens ** (length - t), -1).reshape(-1))
        advantages = ((to_go - torch.stack(values, -1)) * mask).float()
        probs = behaviour.exp()  # (prompts, paths): mu(y | x) (pi_old without staleness), float64; 0 for a path that is no response
        if responses is None:  # the expectation itself, at every step
            shares = [probs] * num_minibatches
        else:  # each minibatch's draw, as the share of its responses that each one is
            drawn = [torch.multinomial(probs, per_minibatch, replacement=True, generator=draws) for _ in range(num_minibatches)]
            shares = [torch.zeros_like(probs).scatter_add_(1, d, torch.ones_like(d, dtype=probs.dtype)) / per_minibatch for d in drawn]
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(iteration, iterations, lr_final, lr_hold)
        rows_all = torch.arange(len(input_ids))
        for share in [share for _ in range(module.ppo.epochs) for share in shares]:
            share = share.view(-1, 1) / prompts
            per_token = mask / (share * mask).sum() if token_mean else aggregation
            weights = (share * per_token).float()
            loss = module.update.loss(rollout, advantages, None, rows_all, torch.full((len(input_ids),), beta), weights)
            loss.backward()
            module.on_before_optimizer_step(optimizer)  # the module's gradient clipping, as in the sampled loop
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return rows


def sampled_ppo(
    ref_logprobs: Tensor,
    rewards: Tensor,
    beta: float,
    num_tokens: int,
    estimator: str = "k1",
    scope: str = "per_token",
    iterations: int = 150,
    responses: int = 384,
    epochs: int = 1,
    updates: int = 8,
    lr: float = 0.05,
    lr_final: float = 0.1,
    cliprange: float = 0.2,
    seed: int = 0,
    advantage: Optional[str] = None,
    group_size: int = 8,
) -> Tensor:
    """PPO with the KL in the loss on a TABULAR policy (one logit vector per prompt and prefix, starting at
    pi_ref), from sampled responses, with the module's own loss pieces: ``ppo_math.policy_loss`` (token mean),
    the registered ``estimator``'s values weighted by ``ppo_math.importance_weighted_kl`` (its ratio carrying
    gradient, its ``score_baseline``) and, for ``scope="sequence"``, ``ppo_math.kl_to_go_loss`` on the log-ratio
    with the prompt group's baseline, as ``PPOUpdate.loss`` adds them. The advantage is exact (a perfect
    critic): A_t = E_old[r | x, y_<=t] - E_old[r | x, y_<t]; or, naming a critic-free ``advantage`` estimator
    (``rloo``, ``grpo``, ...), that estimator's on groups of ``group_size`` responses to a prompt, the KL scaled
    by its ``gradient_scale`` as the module scales it. Each iteration draws ``responses`` from pi_old,
    split evenly over the prompts, and takes ``updates`` Adam steps over ``epochs`` shuffled passes; the lr
    decays linearly to ``lr_final`` of ``lr``. Returns log pi(y | x), (prompts, K ** L).

    What it is for: each state's conditional moves on its own, so where the sampled loss settles is the loss's
    doing, not a shared network's (a tiny Llama can settle short of the per-token fixed point where this table
    lands on it)."""
    kl_estimator = registry("kl_estimator").create(estimator)
    estimator_of_advantage = None if advantage is None else registry("advantage_estimator").create(advantage)
    require(
        estimator_of_advantage is None or not estimator_of_advantage.needs_critic,
        "advantage",
        "a critic-free estimator (None: the exact advantage)",
        advantage,
    )
    require(scope in ("per_token", "sequence"), "scope", "per_token or sequence", scope)
    prompts, num_responses = ref_logprobs.shape
    per_prompt = responses // prompts
    require(
        responses % prompts == 0 and (advantage is None or per_prompt % group_size == 0) and responses * epochs % updates == 0,
        "responses",
        f"a multiple of the {prompts} prompts (with an advantage estimator: of {prompts} x group_size {group_size}) "
        f"whose epochs split into {updates} equal minibatches",
        responses,
    )
    all_responses = enumerate_responses(num_tokens, round(math.log(num_responses, num_tokens)))
    length = all_responses.shape[1]
    prefixes = prefix_index(all_responses, num_tokens)  # (R, L): y_<t's row within a prompt
    generator = torch.Generator().manual_seed(seed)
    ref_tables = conditional_tables(ref_logprobs.double(), num_tokens)
    table = [t.clone().requires_grad_() for t in ref_tables]
    optimizer = torch.optim.Adam(table, lr=lr)
    tree_shape = (prompts, *[num_tokens] * length)
    rewards = rewards.double()

    def rows(prompt: Tensor, response: Tensor, t: int) -> Tensor:  # row of (x, y_<t) in table t
        return prompt * num_tokens**t + prefixes[response, t]

    def token_logprobs_of(tables: Sequence[Tensor], prompt: Tensor, response: Tensor) -> Tensor:
        return torch.stack(
            [tables[t].log_softmax(-1)[rows(prompt, response, t), all_responses[response, t]] for t in range(length)], dim=-1
        )

    def joint_logprobs(tables: Sequence[Tensor]) -> Tensor:
        prompt = torch.arange(prompts).repeat_interleave(num_responses)
        response = torch.arange(num_responses).repeat(prompts)
        return token_logprobs_of(tables, prompt, response).sum(-1).view(prompts, num_responses)

    minibatch = per_prompt * prompts * epochs // updates
    for iteration in range(iterations):
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(iteration, iterations, lr_final)
        with torch.no_grad():
            old = [t.detach().clone() for t in table]
            probs = joint_logprobs(old).exp()
            tree, reward_tree = probs.view(tree_shape), rewards.view(tree_shape)
            to_go = [reward_to_go(tree, reward_tree, t) for t in range(length + 1)]  # E_old[r | x, y_<t]
            response = torch.multinomial(probs, per_prompt, replacement=True, generator=generator).flatten()
            prompt = torch.arange(prompts).repeat_interleave(per_prompt)
            advantages = torch.stack(
                [
                    to_go[t + 1].reshape(prompts, -1)[prompt, prefixes[response, t] * num_tokens + all_responses[response, t]]
                    - to_go[t].reshape(prompts, -1)[prompt, prefixes[response, t]]
                    for t in range(length)
                ],
                dim=-1,
            )
            kl_scale = torch.ones(len(response), dtype=torch.float64)
            if estimator_of_advantage is not None:
                scores = torch.zeros_like(advantages)
                scores[:, -1] = rewards[prompt, response]
                mask = torch.ones_like(scores)
                advantages = estimator_of_advantage.checked(scores, mask, None, group_size)[0]
                kl_scale = estimator_of_advantage.gradient_scale(scores, mask, group_size)
            old_logprobs = token_logprobs_of(old, prompt, response)
            ref_token_logprobs = token_logprobs_of(ref_tables, prompt, response)
        for _ in range(epochs):
            order = torch.randperm(len(response), generator=generator)
            for start in range(0, len(response), minibatch):
                idx = order[start : start + minibatch]
                logprobs = token_logprobs_of(table, prompt[idx], response[idx])
                mask = torch.ones_like(logprobs)
                loss = pm.policy_loss(logprobs, old_logprobs[idx], advantages[idx], mask, cliprange).loss
                kl = kl_estimator(logprobs, ref_token_logprobs[idx])
                kl_loss = pm.importance_weighted_kl(kl, logprobs, old_logprobs[idx], mask, True, kl_estimator.score_baseline)
                if scope == "sequence":
                    log_ratio = (logprobs - ref_token_logprobs[idx]).detach()
                    kl_loss = kl_loss + pm.kl_to_go_loss(logprobs, old_logprobs[idx], log_ratio, mask, groups=prompt[idx])
                optimizer.zero_grad()
                (loss + beta * (kl_scale[idx, None] * kl_loss).mean()).backward()
                optimizer.step()
    with torch.no_grad():
        return joint_logprobs(table)
