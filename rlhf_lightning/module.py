"""PPO-RLHF with a KL penalty to a frozen reference policy, as one LightningModule.

One ``training_step`` is one PPO iteration on a batch of prompts x:

1. rollout     y ~ pi_theta(. | x), ``num_generations`` responses per prompt, from the rollout
               engine plugin (``hf``: KV-cached ``generate``; ``vllm``) at ``temperature``, ``top_k``,
               ``top_p``; its log-probs are log pi_old (``old_logprobs: sampler``, default). Every
               distribution is the declared one: tempered, on the sampler's kept set (sampling.py).
2. score       r_RM(x, y) from the reward backend on the decoded text; one batched forward
               each for log pi_ref and a separate critic's V_old (and log pi_old with
               ``old_logprobs: forward``); per-token KL estimate kl_t and per-token reward
               R_t = r_RM * 1[t = T] - beta * kl_t.
3. advantages  the advantage estimator plugin: GAE(gamma, lambda) on R_t and V_old, whitened over
               the global batch (default), or a critic-free group / batch baseline (grpo, rloo, ...).
4. update      ppo_epochs passes over num_minibatches: the policy-loss plugin (PPO's clipped
               surrogate by default) (+ vf_coef * clipped value loss with a critic) (+ beta * kl_t
               as a loss term when kl_penalty is 'loss'/'both') (- an entropy bonus), each per-token
               term summed with the loss-aggregation plugin's weights (a token mean by default).

Then the beta controller sees the global mean KL (in its declared unit) and updates beta (and an
entropy controller, if any, the entropy bonus's coefficient), and the reference update plugin
may move the reference toward the policy (default ``none``: the reference stays the frozen
starting policy; ``sync``, ``reset`` or ``ema`` every N iterations). ``reference`` names another
model as the reference instead (a teacher: on-policy distillation; docs/reference.md).

Where things live: the networks (policy, critic, reference, sampling model) and their passes in
networks.py (``self.networks``), their loading in models.py,
argument checks and the fault counts in checks.py, checkpoint and resume in checkpoints.py, the math in
ppo_math.py, CPU kernels in cpu.py (a Lightning precision plugin around each step).

Left out on purpose: reward-model training (tools/) and any home-made distributed code: every
cross-rank statistic goes through the Lightning strategy's ``reduce``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from functools import partial
from typing import Any, Literal, Optional, Union

import torch
from lightning import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torchmetrics import MeanMetric

from rlhf_lightning import args, checkpoints, checks, fsdp2, gpu, models, sampling
from rlhf_lightning import ppo_math as pm
from rlhf_lightning.args import KLArgs, LoadingArgs, LoraArgs, OffPolicyArgs, OptimArgs, PPOArgs, PromptArgs, RuntimeArgs, SamplingArgs
from rlhf_lightning.async_rollout import AsyncRollouts, Drawn, staleness_metrics
from rlhf_lightning.callbacks import TensorBoardViews, Timer
from rlhf_lightning.checks import Faults, nonfinite_terms, require
from rlhf_lightning.data import PromptTable, encode_prompts, token_ids
from rlhf_lightning.interfaces import (
    AdvantageEstimator,
    BetaController,
    Divergence,
    KLEstimator,
    LossAggregation,
    PerPromptBetaController,
    PolicyLoss,
    ReferenceUpdate,
    RewardModel,
    RolloutEngine,
)
from rlhf_lightning.models import ValueModel, add_lora, frozen_copy, load_tokenizer, shard_models
from rlhf_lightning.networks import Networks
from rlhf_lightning.trajectory import IterationOutputs, PromptStats, Scored, Trajectory

# The frozen reference copy is in eval mode on purpose (dropout is off everywhere anyway).
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")

UPDATE_STATS = ("policy/loss", "policy/clipfrac", "policy/approxkl", "value/loss", "value/clipfrac", "policy/kl_loss", "policy/entropy")


class PPORLHF(LightningModule):
    """PPO-RLHF: rollout -> score -> advantages -> update, with a pluggable KL penalty.

    The plugins are flat arguments: a registered short name (``k3``, ``adaptive``), a class name or
    ``class_path`` with ``init_args`` (docs/plugins.md). So are the network keys: ``policy``
    (``tiny``, ``smollm2``, a local HF checkpoint folder or a ``.gguf`` file), ``tokenizer`` (default:
    the policy's own; ``char`` for ``tiny``), ``reference`` (the model the KL is to: null, the starting
    policy, or another causal LM with the policy's tokenizer, a checkpoint folder, a ``.gguf`` file or
    ``smollm2``: a teacher, docs/reference.md), ``critic`` (the value head's trunk: a ``separate``
    copy of the policy's, ``shared`` with it, or ``none`` for the critic-free estimators; null: what
    the advantage estimator needs). Every other setting is in a group, each field documented where it
    is declared (args.py): ``sampling``, ``prompts``, ``kl``, ``ppo``, ``optim``, ``lora``, ``runtime``,
    ``off_policy``, ``loading`` (how the networks are built: ``trust_remote_code``, the ``tiny`` model's
    ``tiny_config`` and ``seed``). The flat names of earlier versions (``lr=...``, ``seed=...``) still work
    from Python until 0.4.0, with a FutureWarning naming the new key.
    """

    def __init__(
        self,
        policy: str = "tiny",
        tokenizer: Optional[str] = None,
        reference: Optional[str] = None,
        reward_model: Union[RewardModel, str] = "callable",
        kl_estimator: Union[KLEstimator, str] = "k1",
        divergence: Union[Divergence, str] = "reverse_kl",
        beta_controller: Union[BetaController, str] = "fixed",
        advantage_estimator: Union[AdvantageEstimator, str] = "gae",
        policy_loss: Union[PolicyLoss, str] = "ppo_clip",
        loss_aggregation: Union[LossAggregation, str, None] = None,
        entropy_controller: Union[BetaController, str, None] = None,
        gold_reward_model: Union[RewardModel, str, None] = None,
        rollout_engine: Union[RolloutEngine, str] = "hf",
        reference_update: Union[ReferenceUpdate, str] = "none",
        critic: Optional[Literal["separate", "shared", "none"]] = None,
        sampling: SamplingArgs = SamplingArgs(),
        prompts: PromptArgs = PromptArgs(),
        kl: KLArgs = KLArgs(),
        ppo: PPOArgs = PPOArgs(),
        optim: OptimArgs = OptimArgs(),
        lora: LoraArgs = LoraArgs(),
        runtime: RuntimeArgs = RuntimeArgs(),
        off_policy: OffPolicyArgs = OffPolicyArgs(),
        loading: LoadingArgs = LoadingArgs(),
        **flat_settings: Any,
    ) -> None:
        super().__init__()
        groups = args.build_groups({name: value for name, value in locals().items() if name in args.GROUPS}, flat_settings)
        plugin_specs = {name: value for name, value in locals().items() if name in args.PLUGIN_ARGUMENTS}
        # Plugins first: an unknown name fails here, before any model loads.
        plugins = args.build_plugins(plugin_specs, groups["ppo"])
        self.reward_model: RewardModel = plugins["reward_model"]
        self.kl_estimator: KLEstimator = plugins["kl_estimator"]
        self.divergence: Divergence = plugins["divergence"]
        self.beta_controller: BetaController = plugins["beta_controller"]
        self.advantage_estimator: AdvantageEstimator = plugins["advantage_estimator"]
        self.policy_loss: PolicyLoss = plugins["policy_loss"]
        self.loss_aggregation: LossAggregation = plugins["loss_aggregation"]
        self.entropy_controller: Optional[BetaController] = plugins["entropy_controller"]
        self.gold_reward_model: Optional[RewardModel] = plugins["gold_reward_model"]
        self.reference_update: ReferenceUpdate = plugins["reference_update"]
        self.rollout_engine: RolloutEngine = plugins["rollout_engine"]
        groups.update(args.check_across_groups(critic, groups, plugins))
        args.check_reference(reference, self.reference_update)
        self.sampling: SamplingArgs = groups["sampling"]
        self.prompts: PromptArgs = groups["prompts"]
        self.kl: KLArgs = groups["kl"]
        self.ppo: PPOArgs = groups["ppo"]
        self.optim: OptimArgs = groups["optim"]
        self.lora: LoraArgs = groups["lora"]
        self.runtime: RuntimeArgs = groups["runtime"]
        self.off_policy: OffPolicyArgs = groups["off_policy"]
        self.loading: LoadingArgs = groups["loading"]
        # The saved hyperparameters: the network keys and each group as plain values, resolved.
        network = dict(policy=policy, tokenizer=tokenizer, reference=reference, critic=groups["critic"])
        self.save_hyperparameters({**network, **{name: dataclasses.asdict(groups[name]) for name in args.GROUPS}})
        self._kl_reads_sampled_token = self.kl_estimator.reads_sampled_token()
        self.automatic_optimization = False

        self.tokenizer = load_tokenizer(tokenizer or ("char" if policy == "tiny" else policy), self.loading.trust_remote_code)
        self.kl_ignore_ids = token_ids(self.tokenizer, self.kl.ignore_tokens or [], "each of model.kl.ignore_tokens")
        self.policy: Optional[nn.Module] = None
        self.ref_model: Optional[nn.Module] = None
        self.initial_model: Optional[nn.Module] = None  # full fine-tuning with a moving or foreign reference: pi_0
        self.reference_updates = 0  # times the reference has moved (checkpointed)
        self.critic: Optional[ValueModel] = None
        self.networks: Optional[Networks] = None  # the part that runs them, once built (configure_model)
        self.update_stats = nn.ModuleDict({name.replace("/", "__"): MeanMetric() for name in UPDATE_STATS})
        self._loss_terms: dict[str, Tensor] = {}  # a micro-batch's logged terms, named in the fault when a loss is not finite
        self.iteration = 0  # PPO iterations done; global_step counts optimizer steps instead
        self._rng_to_restore: Optional[dict] = None
        self.generation_seed_base = int(torch.initial_seed()) % 2**31  # saved with checkpoints
        self.faults = Faults(limit=self.runtime.max_consecutive_faults)
        self.longest_prompt: Optional[int] = None  # tokens, of the data module's prompt files (setup)
        self.prompt_table: Optional[PromptTable] = None  # the training prompts' ids and budgets (setup; prompt_stats)
        # max_staleness k > 0: the sampler that runs ahead (async_rollout.py); None: the synchronous loop
        self.async_rollouts = AsyncRollouts(self) if self.off_policy.max_staleness else None

    # ------------------------------------------------------------------ setup
    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        # Lightning logs, at each step, every step value it still holds from earlier steps: a skipped
        # iteration would repeat the previous one's metrics at its own step (tests/test_faults.py).
        if self.trainer._results is not None:
            self.trainer._results.reset(metrics=False, fx="training_step")
        if self._rng_to_restore is not None:
            checkpoints.set_rng_states(self._rng_to_restore, self.device)
            self._rng_to_restore = None

    # ------------------------------------------------------------------ the loop
    def training_step(self, prompts: list[str], batch_idx: int) -> IterationOutputs:
        """One PPO iteration. What it returns reaches callbacks' ``on_train_batch_end`` as ``outputs``."""
        timer = Timer(self.device)
        rows = self.repeat_prompts(prompts)
        rollout = self.rollout(rows, timer, critic_values=not self.old_values_in_update, drawn=self.draw_ahead(prompts, rows, timer))
        betas = self.row_betas(rollout.prompts)
        with timer("score"):
            scored = self.score(rollout, betas)
        if scored.fault is not None:  # on some rank: every rank skips together, or collectives would hang
            return self.skip_iteration(rollout, scored)
        with timer("update"):
            values = self._first_critic_values(rollout)
            advantages, returns = self.compute_advantages(scored.rewards, rollout)
            scale = self.advantage_estimator.gradient_scale(
                scored.rewards, rollout.response_mask, self.sampling.num_generations, self._reduce
            )
            skipped_steps = self.ppo_update(rollout, advantages, returns, betas.to(scale.dtype) * scale, values)
        metrics = self.rollout_metrics(rollout, scored, betas)
        prompt_stats = self.prompt_stats(rollout, scored, betas)
        self.update_controllers(metrics, prompt_stats)
        outputs = self.end_iteration(rollout, scored, metrics, skipped_steps, timer, prompt_stats)
        self.update_reference()
        return outputs

    def repeat_prompts(self, prompts: list[str]) -> list[str]:
        """Each prompt ``num_generations`` times, its group in consecutive rows of this rank's batch."""
        checks.check_batch_split(len(prompts), self.sampling, self.ppo)
        return [prompt for prompt in prompts for _ in range(self.sampling.num_generations)]

    def draw_ahead(self, prompts: list[str], rows: list[str], timer: Timer) -> Optional[Drawn]:
        """With ``model.off_policy.max_staleness`` k > 0: this iteration's batch (``rows``) from the sampler, drawn
        from the weights k updates old, the next k batches' prompts handed to it (read ahead from the training
        loader: ``data.Lookahead``, within the epoch's batches); None for the synchronous loop."""
        if self.async_rollouts is None:
            return None
        lookahead = getattr(self.trainer.train_dataloader, "lookahead", None) if self._trainer is not None else None
        upcoming = []
        if lookahead is not None and lookahead.consume(prompts):
            left = self.trainer.num_training_batches - self.trainer.fit_loop.epoch_loop.batch_idx - 1
            upcoming = [self.repeat_prompts(batch) for batch in lookahead.upcoming(min(self.off_policy.max_staleness, left))]
        return self.async_rollouts.draw(rows, upcoming, timer)

    def sampling_seed(self, iteration: int) -> int:
        """The seed the rollout engine draws iteration ``iteration``'s responses with, per (run, rank, iteration): ranks
        sample independently, and a resumed run or a sampler running ahead draws the same responses."""
        return self.generation_seed_base + 7919 * self.global_rank + 104729 * iteration

    @property
    def exploration(self) -> float:
        """epsilon of this iteration's draw (``model.sampling.explore``); 0 outside training (validation samples pi)."""
        return self.sampling.exploration(self.iteration) if self.training else 0.0

    def teardown(self, stage: str) -> None:
        if self.async_rollouts is not None:
            self.async_rollouts.close()

    def configure_callbacks(self) -> list:
        return [TensorBoardViews(self.runtime.log_samples_every_n_steps, self.runtime.num_logged_samples)]

    def on_fit_start(self) -> None:
        self._setup_reward_models()

    def _setup_reward_models(self) -> None:
        self.reward_model.setup(self.device)
        if self.gold_reward_model is not None:
            self.gold_reward_model.setup(self.device)

    on_validation_start = on_test_start = _setup_reward_models

    def row_betas(self, prompts: list[str]) -> Tensor:
        """beta of each row (batch,), float64 on the module's device: the controller's one beta, or with a
        per-prompt controller each row's prompt's own (by its id in ``prompt_table``), checked >= 0."""
        if not isinstance(self.beta_controller, PerPromptBetaController):
            return torch.full((len(prompts),), self.beta_controller.checked_beta(), dtype=torch.float64, device=self.device)
        betas = self.beta_controller.betas_of(self.prompt_table.ids_of(prompts))
        require(
            bool(torch.isfinite(betas).all() and (betas >= 0).all()),
            f"the betas of beta controller {type(self.beta_controller).__name__}",
            "finite numbers >= 0",
            betas.tolist(),
        )
        return betas.to(self.device)

    def score(self, rollout: Trajectory, betas: Tensor) -> Scored:
        """r_RM from the reward backend, the per-token KL estimate, and the per-token rewards
        R_t = r_RM * 1[t = T] - beta * kl_t (the KL term only when the penalty is in the reward), beta the
        row's (``betas``, (batch,)); with a sequence-level divergence R_t = (r_RM - beta f'(u)) * 1[t = T], u the
        response's probability ratio to the reference (``divergence_terms``). A non-finite reward, KL or penalty on
        any rank is a fault, named in ``Scored.fault``: the penalty beta f'(u) as the reward holds it (float32), so
        a u finite in float64 but past float32's range (chi2: log u > 88 + log(1 / 2 beta)) is not a silent inf."""
        kl, raw_scores, fault = self.kl_per_token(rollout), rollout.raw_scores, rollout.reward_fault
        penalty, divergence = self.divergence_terms(rollout, kl)
        if penalty is not None:  # beta f'(u) in float64; the reward holds it in kl's dtype, where e^(log u) overflows sooner
            penalty = betas.to(penalty.device, penalty.dtype) * penalty
        if raw_scores is None and fault is None:  # not scored by the sampler ahead
            raw_scores, fault = self.reward(rollout.prompts, rollout.response_texts)
        bad = []
        if fault is None and not torch.isfinite(kl).all():
            bad = (~torch.isfinite(kl)).any(-1).nonzero().flatten().tolist()
            fault = f"the {type(self.kl_estimator).__name__} KL estimate is not finite for responses {bad}: {kl.sum(-1)[bad].tolist()}"
        elif fault is None and penalty is not None and not (finite := torch.isfinite(penalty.to(kl.dtype))).all():
            bad = (~finite).nonzero().flatten().tolist()
            fault = (
                f"the {type(self.divergence).__name__} penalty beta f'(u) is not finite in the reward's {kl.dtype} "
                f"for responses {bad}: {penalty[bad].tolist()}"
            )
        if bad:
            bad_betas = sorted(set(betas[bad].tolist()))  # one beta, or each bad row's prompt's
            fault += f" (beta {bad_betas[0] if len(bad_betas) == 1 else bad_betas})"
        if self.networks.any_rank(fault is not None):
            return Scored(kl, raw_scores, fault=fault or "a non-finite reward, KL or penalty on another rank")
        scores = self.reward_model.shape_scores(raw_scores, rollout.ended_with_eos, sum_fn=self._reduce).to(self.device)
        kl_in_reward = kl if self.kl.in_reward and penalty is None else torch.zeros_like(kl)
        row_betas = betas.to(kl.dtype).unsqueeze(-1)  # (batch, 1)
        penalised = scores if penalty is None else scores - penalty.to(scores.device, scores.dtype)
        rewards = pm.token_rewards(penalised, kl_in_reward, rollout.response_mask, row_betas)
        return Scored(kl, raw_scores, scores, rewards, divergence=divergence)

    def reward(self, prompts: list[str], responses: list[str]) -> tuple[Optional[Tensor], Optional[str]]:
        """``(raw_scores, fault)``: the reward backend's checked scores, or why they are not finite (then None)."""
        try:
            with gpu.no_autocast(self.device):
                return self.reward_model.checked_scores(prompts, responses), None
        except FloatingPointError as err:
            return None, str(err)

    def divergence_terms(self, rollout: Trajectory, kl: Tensor) -> tuple[Optional[Tensor], Tensor]:
        """``(penalty, value)`` per response (batch,): the sequence-level penalty f'(u) (None for the reverse KL,
        whose penalty is the per-token ``kl``) and the divergence's value from this sample, f(u) / u (its batch
        mean estimates D_f: ``objective/divergence``; the reverse KL's is the KL estimate's sum, ``objective/kl``),
        with log u = sum_t log pi_old(y_t) - log pi_ref(y_t) over the response, in float64."""
        if self.divergence.per_token:
            return None, kl.sum(-1)
        log_u = pm.masked_select(rollout.trainer_logprobs.double() - rollout.ref_logprobs.double(), rollout.response_mask).sum(-1)
        return self.divergence.f_prime(log_u), self.divergence.value(log_u)

    def skip_iteration(self, rollout: Trajectory, scored: Scored) -> IterationOutputs:
        """Count a faulty iteration (weights untouched) and log it as skipped, without stale metrics."""
        self.iteration += 1
        self._record_fault(scored.fault, iteration_skipped=True)
        return {"rollout": rollout, "kl": scored.kl, "scores": scored.raw_scores, "metrics": {}, "skipped": True, "prompts": None}

    def update_controllers(self, metrics: dict[str, float], prompt_stats: Optional[PromptStats] = None) -> None:
        """The beta controller sees the global mean divergence (``objective/divergence``: the KL under the reverse
        KL, the default) or, with unit ``token_mean``, the KL per token (a per-prompt controller also each prompt's
        KL, ``prompt_stats``); an entropy controller, if any, the entropy (see ``_update_entropy_controller``)."""
        n_samples = int(metrics["response/count"])
        unit = self.beta_controller.unit  # sequence_sum: the divergence's value (the KL's, under the reverse KL)
        self.beta_controller.update(
            metrics["objective/divergence" if unit == "sequence_sum" else "objective/kl_per_token"], n_samples=n_samples
        )
        if isinstance(self.beta_controller, PerPromptBetaController):
            self.beta_controller.update_prompts(prompt_stats.ids, prompt_stats.kl, prompt_stats.responses)
        if self.entropy_controller is not None:
            metrics["objective/entropy_coef"] = self.entropy_controller.beta
            self._update_entropy_controller(metrics, n_samples)

    def end_iteration(
        self,
        rollout: Trajectory,
        scored: Scored,
        metrics: dict[str, float],
        skipped_steps: int,
        timer: Timer,
        prompt_stats: Optional[PromptStats] = None,
    ) -> IterationOutputs:
        """Count the iteration and its faults; log its metrics (docs/metrics.md)."""
        self.iteration += 1
        if skipped_steps:
            beta = metrics["objective/beta"]
            rewards = f"rewards up to {float(scored.raw_scores.abs().max()):.3g} from model.reward_model {type(self.reward_model).__name__}"
            cause = f"non-finite PPO loss: {skipped_steps} optimizer step(s) skipped (not finite: {self.nonfinite_terms}; beta {beta}; {rewards})"
            self._record_fault(cause, iteration_skipped=False, steps=skipped_steps)
        else:
            self.faults.consecutive = 0
        metrics.update(self.faults.metrics(iteration_skipped=False))
        metrics.update(self.consume_update_stats())
        metrics.update(prompt_stats.metrics() if prompt_stats is not None else {})
        metrics.update(timer.metrics())
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(rollout.prompts))
        for key, label in (("objective/reward", "reward"), ("objective/kl", "kl"), ("objective/beta", "beta")):
            self.log(label, metrics[key], prog_bar=True, logger=False, on_step=True, batch_size=len(rollout.prompts))
        return {
            "rollout": rollout,
            "kl": scored.kl,
            "scores": scored.raw_scores,
            "metrics": metrics,
            "skipped": False,
            "prompts": prompt_stats,
        }

    @torch.no_grad()
    def rollout(
        self, prompts: list[str], timer: Optional[Timer] = None, critic_values: bool = True, drawn: Optional[Drawn] = None
    ) -> Trajectory:
        """Sample one response per prompt with the rollout engine (timed as ``rollout``), or take the batch the
        sampler ``drawn`` ahead from older weights; then pi_old and V_old (``_old_policy``; a separate critic's
        only with ``critic_values``) and log pi_ref (one batched forward of the reference, on the sampler's kept
        set), timed as ``forward``."""
        timer = timer or Timer(self.device)
        if drawn is None:
            enc, version = self.encode_prompts(prompts), self.iteration
            if self.rollout_engine.stale(self):  # an engine with its own copy of the weights, behind the policy's
                with timer("weight_sync"):
                    self.rollout_engine.sync(self)
            with timer("rollout"):
                samples = self.rollout_engine.checked_sample(self, enc, self.sampling_seed(self.iteration))
        else:
            enc, samples, version = drawn.enc, drawn.samples, drawn.version
        input_ids, attention_mask, response, mask, ended = self.assemble(enc, samples)
        keep_logits = self.kl_estimator.needs_logits
        with timer("forward"):
            old = self.networks.old_policy(samples, input_ids, attention_mask, response, mask, critic_values, self.exploration)
            if drawn is not None and drawn.ref_logprobs is not None:  # the sampler ran the reference (score_in_sampler)
                ref_logprobs, ref_logits = drawn.ref_logprobs, drawn.ref_logits
            else:
                if self.networks.reference_is_policy():  # the same function: the log-probs just computed, and a KL of exactly 0
                    ref_logits = old.logits
                else:
                    ref_logits = self.networks.reference_logits(input_ids, attention_mask, response.shape[1], old.kept)
                ref_logprobs = pm.logprobs_of(ref_logits, response)
            initial_logits = None
            if self.networks.initial_is_apart:  # the starting policy, for objective/kl_to_initial
                with self.networks.initial() as initial:
                    initial_logits = self.networks.kept_logits(initial, input_ids, attention_mask, response.shape[1], old.kept)
        trajectory = Trajectory(
            prompts=list(prompts),
            response_texts=self.tokenizer.batch_decode(response, skip_special_tokens=True),
            input_ids=input_ids,
            attention_mask=attention_mask,
            responses=response,
            response_mask=mask,
            ended_with_eos=ended,
            old_logprobs=old.sampler_logprobs if self.sampling.old_logprobs == "sampler" and not self.exploration else old.trainer_logprobs,
            trainer_logprobs=old.trainer_logprobs,
            sampler_logprobs=old.sampler_logprobs,
            ref_logprobs=ref_logprobs,
            old_values=None if old.values is None else old.values * mask,
            entropy=pm.entropy_of(old.logits),
            old_logits=old.logits if keep_logits else None,
            ref_logits=ref_logits if keep_logits else None,
            initial_logprobs=None if initial_logits is None else pm.logprobs_of(initial_logits, response),
            initial_logits=initial_logits if keep_logits else None,
            kept=old.kept,
            policy_version=torch.full((len(prompts),), version, dtype=torch.long, device=self.device),
            is_weights=sampling.correction_weights(
                old.trainer_logprobs, old.sampler_logprobs, mask, *self.off_policy.weights(self.sampling, self.exploration)
            ),
            raw_scores=None if drawn is None else drawn.raw_scores,
            reward_fault=None if drawn is None else drawn.reward_fault,
        )
        if self.training and self.iteration == 0:  # a sampler that draws one token alone: nothing to learn, said once
            untrainable = checks.point_mass_warning(self.sampling, trajectory.old_logprobs, trajectory.kept, trajectory.response_mask)
            if untrainable:
                rank_zero_warn(untrainable)
        return trajectory

    def assemble(self, enc: dict[str, Tensor], samples) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """A rollout's rows from the prompts' encoding ``enc`` and the engine's ``samples``: ``(input_ids,
        attention_mask, response, response_mask, ended_with_eos)``, the response's padding after EOS pad tokens."""
        response = samples.sequences[:, enc["input_ids"].shape[1] :].to(self.device)  # right-padded with pad
        mask = pm.response_mask(response, self.tokenizer.eos_token_id)
        ended = ((response == self.tokenizer.eos_token_id) & mask.bool()).any(-1)
        attention_mask = torch.cat([enc["attention_mask"], mask.to(enc["attention_mask"].dtype)], dim=1)
        # Padding after EOS becomes pad tokens, whatever the sampler wrote there.
        response = torch.where(mask.bool(), response, torch.full_like(response, self.tokenizer.pad_token_id))
        return torch.cat([enc["input_ids"], response], dim=1), attention_mask, response, mask, ended

    def kl_per_token(self, rollout: Trajectory, to_initial: bool = False) -> Tensor:
        """The penalised per-token KL estimate (batch, response_len), zero off the KL mask; with
        ``to_initial`` the same estimate against the starting policy (a moving reference only); of the
        trainer's pi_old (a rollout correction weighs its reward through the policy loss)."""
        ref_logprobs, ref_logits = (
            (rollout.initial_logprobs, rollout.initial_logits) if to_initial else (rollout.ref_logprobs, rollout.ref_logits)
        )
        kl = self.kl_estimator.checked(rollout.trainer_logprobs, ref_logprobs, rollout.old_logits, ref_logits)
        return pm.masked_select(kl, self.kl_mask(rollout.responses, rollout.response_mask))

    def kl_mask(self, response: Tensor, mask: Tensor) -> Tensor:
        """The response mask without the positions of ``kl_ignore_tokens``."""
        if not len(self.kl_ignore_ids):
            return mask
        return mask * ~torch.isin(response, self.kl_ignore_ids.to(response.device))

    def compute_advantages(self, rewards: Tensor, rollout: Trajectory) -> tuple[Tensor, Optional[Tensor]]:
        """The advantage estimator on the per-token rewards (and V_old with a critic), checked,
        then whitened over the global batch when ``whiten_advantages``."""
        advantages, returns = self.advantage_estimator.checked(
            rewards, rollout.response_mask, rollout.old_values, self.sampling.num_generations, self._reduce
        )
        if self.ppo.whiten_advantages:
            advantages = pm.masked_whiten(advantages, rollout.response_mask, sum_fn=self._reduce)
        return advantages, returns

    def ppo_update(
        self, rollout: Trajectory, advantages: Tensor, returns: Optional[Tensor], kl_coef: Tensor, values: Optional[Tensor] = None
    ) -> int:
        """All PPO epochs over the rollout, one optimizer step per minibatch; ``kl_coef`` (batch,) is
        beta times the advantage estimator's gradient scale of each response (a KL in the loss is
        weighed against the reward as configured); ``values``: the first minibatch's critic forward
        (``_first_critic_values``). Returns how many steps were skipped because a loss was not finite
        on some rank (gradients dropped, weights untouched)."""
        opt, skipped = self.optimizers(), 0  # clipped in on_before_optimizer_step (models.py)
        for _ in range(self.ppo.epochs):
            order = torch.randperm(rollout.input_ids.shape[0], device=self.device)
            for minibatch in order.chunk(self.ppo.num_minibatches):
                if self._accumulate_gradients(rollout, advantages, returns, minibatch, kl_coef, values):
                    opt.step()
                else:
                    skipped += 1
                opt.zero_grad(set_to_none=True)
                values = None
        return skipped

    def _accumulate_gradients(
        self,
        rollout: Trajectory,
        advantages: Tensor,
        returns: Optional[Tensor],
        minibatch: Tensor,
        kl_coef: Tensor,
        values: Optional[Tensor],
    ) -> bool:
        """Backward over the minibatch's micro-batches; False (and stop) at a non-finite loss. Given the
        critic's ``values`` of every row, the value loss goes first, freeing their graph."""
        size = len(minibatch) // self.ppo.gradient_accumulation_steps
        # The loss of the minibatch is sum w * loss_t over all its tokens on all ranks, with the
        # aggregation's weights w (global denominators), times the world size that DDP divides by.
        weights = self.loss_aggregation.weights(rollout.response_mask[minibatch], self.sampling.max_new_tokens, self._reduce)
        weights = weights * self.trainer.world_size
        micro_batches = list(zip(minibatch.split(size), weights.split(size), strict=True))
        for i, (idx, micro_weights) in enumerate(micro_batches):
            self._loss_terms = {}
            with self._no_grad_sync(last=i == len(micro_batches) - 1):
                losses = [partial(self.ppo_loss, rollout, advantages, returns, idx, kl_coef, micro_weights)]
                if values is not None:
                    losses.insert(0, partial(self.value_loss, rollout, returns, idx, micro_weights, values[idx]))
                elif self._critic_apart:
                    losses.append(partial(self.value_loss, rollout, returns, idx, micro_weights))
                for loss_of in losses:  # the policy's forward and backward, a separate critic's after or before
                    loss = loss_of()
                    if self.networks.any_rank(not torch.isfinite(loss)):
                        self.nonfinite_terms = nonfinite_terms(self._loss_terms, loss)
                        return False
                    self.manual_backward(loss)
        return True

    def ppo_loss(
        self, rollout: Trajectory, advantages: Tensor, returns: Optional[Tensor], idx: Tensor, kl_coef: Tensor, weights: Tensor
    ) -> Tensor:
        """On the rows ``idx``: the policy loss (+ ``value_loss`` with a critic, unless it is
        ``_critic_apart``) (+ kl_coef * KL in the loss) (- entropy bonus), each per-token term summed
        with ``weights``. The critic (gae) learns the returns of the reward alone when the KL is in
        the loss: the KL's future is carried by the loss's sequence term, not by the values."""
        input_ids, attention_mask, mask = rollout.input_ids[idx], rollout.attention_mask[idx], rollout.response_mask[idx]
        response_len = rollout.responses.shape[1]
        logits, values = self.networks.policy_outputs(input_ids, attention_mask, response_len, critic=not self._critic_apart)
        logits = sampling.restrict(logits, None if rollout.kept is None else rollout.kept[idx])
        logprobs, old_logprobs = pm.logprobs_of(logits, rollout.responses[idx]), rollout.old_logprobs[idx]
        pg_loss, clipped = self.policy_loss(logprobs, old_logprobs, advantages[idx], mask)
        is_weights = 1.0 if rollout.is_weights is None else rollout.is_weights[idx]
        pg_loss = pg_loss * is_weights
        loss = (weights * pg_loss).sum()
        stats = {
            "policy/loss": pm.masked_mean(pg_loss, mask),
            "policy/clipfrac": pm.masked_mean(clipped, mask),
            "policy/approxkl": pm.approx_kl(logprobs, old_logprobs, mask),
        }
        if values is not None:
            loss = loss + self.value_loss(rollout, returns, idx, weights, values)
        if self.kl.in_loss:
            ref_logits = rollout.ref_logits[idx] if rollout.ref_logits is not None else None
            kl_mask = self.kl_mask(rollout.responses[idx], mask)
            kl = pm.masked_select(self.kl_estimator(logprobs, rollout.ref_logprobs[idx], logits, ref_logits), kl_mask)
            kl_loss = kl
            # The ratio corrects the sampling of y_t (full sums over the vocabulary: none); its gradient
            # only where no reward carries k's score term.
            if self.kl.loss_weighting == "importance" and self._kl_reads_sampled_token:
                ratio_gradient, baseline = self.kl.placement == "loss", self.kl_estimator.score_baseline
                kl_loss = pm.importance_weighted_kl(kl, logprobs, old_logprobs, kl_mask, ratio_gradient, baseline)
            # The KL still to come after each token (ppo_math.kl_to_go_loss) from the log-ratio's values (unbiased,
            # light-tailed; full's exact ones), a group baseline on the KL's score terms. 'both': in the returns.
            if self.kl.placement == "loss" and self.kl.loss_scope == "sequence":
                values = pm.masked_select(logprobs - rollout.ref_logprobs[idx], kl_mask) if self._kl_reads_sampled_token else kl
                kl_loss = kl_loss + pm.kl_to_go_loss(logprobs, old_logprobs, values, kl_mask, groups=pm.group_ids(rollout.prompts, idx))
            # The advantage estimator's gradient scale (a group std, a mean baseline's (n - 1) / n) on
            # the KL as on the reward, so that beta weighs one against the other as configured.
            loss = loss + (weights * kl_coef[idx, None] * is_weights * kl_loss).sum()
            stats["policy/kl_loss"] = pm.masked_mean(kl_loss, kl_mask)
        if self.entropy_controller is not None and self.entropy_controller.beta:
            entropy = pm.masked_select(pm.entropy_of(logits), mask)
            loss = loss - self.entropy_controller.beta * (weights * entropy).sum()
            stats["policy/entropy"] = pm.masked_mean(entropy, mask)
        self._record_terms(stats)
        return loss

    def value_loss(self, rollout: Trajectory, returns: Tensor, idx: Tensor, weights: Tensor, values: Optional[Tensor] = None) -> Tensor:
        """On the rows ``idx``: vf_coef * the clipped value loss, each per-token term summed with
        ``weights``, of ``values`` (a shared critic's, from the policy's forward) or of a forward of
        the separate critic."""
        mask, response_len = rollout.response_mask[idx], rollout.responses.shape[1]
        if values is None:
            values = self.networks.critic_values(rollout.input_ids[idx], rollout.attention_mask[idx], response_len)
        vf = pm.value_loss_terms(values, rollout.old_values[idx], returns[idx], mask, self.ppo.cliprange_value)
        self._record_terms({"value/loss": pm.masked_mean(vf.loss, mask), "value/clipfrac": pm.masked_mean(vf.clipped, mask)})
        return self.ppo.vf_coef * (weights * vf.loss).sum()

    def _record_terms(self, terms: dict[str, Tensor]) -> None:
        """A loss's logged terms: into the iteration's update statistics, and kept for a fault's message."""
        self._loss_terms.update(terms)
        for name, value in terms.items():
            self.update_stats[name.replace("/", "__")].update(value.detach().float())

    # ------------------------------------------------------------------ the networks
    def configure_model(self) -> None:
        """Build the networks (models.py) and the part that runs them (``self.networks``). Under FSDP2
        (ModelParallelStrategy) no rank holds a full copy of them: the critic's trunk and the reference
        are skeletons on the meta device, and so is the policy when its checkpoint is a safetensors
        folder; once sharded, each rank reads its own rows of every tensor (``fsdp2.materialise``). A
        policy built whole (the tiny model, a GGUF file) is the one full copy, freed once its shards are taken."""
        if self.policy is not None:
            return
        hp, sharded = self.hparams, self.device_mesh is not None  # ModelParallelStrategy: FSDP2 over the data-parallel mesh
        copy_of = fsdp2.meta_copy if sharded else copy.deepcopy
        policy, rows = self.load_policy(empty=sharded)
        checks.check_context(self.prompts, self.sampling, policy.config, self.longest_prompt)
        self.critic = None if hp.critic == "none" else ValueModel.from_policy(policy, shared=hp.critic == "shared", copy_of=copy_of)
        foreign = self.hparams.reference is not None
        if self.lora.rank > 0:
            self.policy = add_lora(policy, self.lora, self.reference_update.moves)
        else:
            self.policy = policy
            self.ref_model = None if foreign else frozen_copy(policy, copy_of)
            self.initial_model = frozen_copy(policy, copy_of) if self.reference_update.moves or foreign else None
        reference_rows = None
        if foreign:  # a separate frozen model, under LoRA too (the adapter-disabled policy is then pi_0)
            reference, reference_rows = self.load_reference(empty=sharded)
            checks.check_context(self.prompts, self.sampling, reference.config, self.longest_prompt, "model.reference's")
            models.check_reference_vocabulary(policy, reference)
            self.ref_model = frozen_copy(reference, copy_of=lambda model: model)
        if sharded and self.async_rollouts is not None:
            self.async_rollouts.keep_skeleton(self.policy)
        if sharded:
            shard_models(
                self.device_mesh, self.policy, self.critic, self.ref_model, self.initial_model, rows, self.lora.rank > 0, reference_rows
            )
        self.networks = Networks(
            self.policy,
            self.critic,
            self.ref_model,
            self.initial_model,
            sampling=self.sampling,
            shared_prompts=self.runtime.shared_prompts,
            lora=self.lora,
            reference_moves=self.reference_update.moves,
            foreign_reference=foreign,
            eos_token_id=self.tokenizer.eos_token_id,
            reduce=self._reduce,
        )

    def load_policy(self, empty: bool = False) -> tuple[nn.Module, fsdp2.Rows]:
        """The policy network as configured, unsharded and without LoRA (``models.load_policy``): where a
        subclass changes it before the reference and the critic are copied from it (the lab's tasks do)."""
        hp, loading = self.hparams, self.loading
        return models.load_policy(
            hp.policy, self.tokenizer, self.sampling, loading.seed, loading.trust_remote_code, loading.tiny_config, self._trainer, empty
        )

    def load_reference(self, empty: bool = False) -> tuple[nn.Module, fsdp2.Rows]:
        """The foreign reference network (``model.reference``), unsharded, and where its rows are read from
        (``models.load_policy``, as the policy's): where a subclass builds another (the lab's teacher)."""
        hp, loading = self.hparams, self.loading
        return models.load_policy(
            hp.reference, self.tokenizer, self.sampling, loading.seed, loading.trust_remote_code, None, self._trainer, empty
        )

    def check_reference(self) -> None:
        """Before any model loads: a foreign ``model.reference`` exists and shares the policy's tokenizer
        (``models.check_reference_tokenizer``)."""
        if self.hparams.reference is not None:
            models.check_reference_tokenizer(self.tokenizer, self.hparams.reference, self.loading.trust_remote_code)

    def reference_identity(self) -> Optional[dict[str, str]]:
        """What a checkpoint records of a foreign reference (``checkpoints.save_state``) and a resume compares:
        its spec and a fingerprint of its files (``models.model_fingerprint``); None for the starting policy."""
        spec = self.hparams.reference
        return None if spec is None else {"reference": spec, "fingerprint": models.model_fingerprint(spec)}

    def on_train_start(self) -> None:
        # What this rank holds of policy, critic and reference: its shards under FSDP2.
        self.param_numel_local = fsdp2.local_numel(self.policy, self.critic, self.ref_model, self.initial_model)
        for logger in self.loggers:
            logger.log_metrics({"system/memory/param_numel_local": float(self.param_numel_local)}, step=self.iteration)

    # ------------------------------------------------------------------ optimizers
    def configure_optimizers(self) -> torch.optim.AdamW:
        """One AdamW over the parameter groups ``policy`` (lr) and ``critic`` (critic_lr), each with
        its own weight decay: AdamW's update is per parameter, so this is the update of one AdamW
        per model (tests/test_gpu.py), and it is what DeepSpeed supports (one optimizer);
        one optimizer step, one GradScaler update under 16-mixed. ``optimizers: separate`` clips
        each group's gradient norm on its own, ``shared`` the norm of both (``on_before_optimizer_step``)."""
        optim = self.optim
        groups = [{"name": "policy", "params": [p for p in self.policy.parameters() if p.requires_grad], "lr": optim.lr}]
        if self.critic is not None:
            groups.append({"name": "critic", "params": list(self.critic.parameters()), "lr": optim.critic_lr or optim.lr})
        # fused: one kernel per step instead of a dozen per tensor. Not under 16-mixed/bf16-mixed:
        # a fused AdamW unscales 16-mixed gradients inside its step, after they would be clipped,
        # so the multi-tensor (foreach) AdamW steps instead.
        fused = not (self._trainer is not None and isinstance(self.trainer.precision_plugin, MixedPrecision))
        return torch.optim.AdamW(groups, weight_decay=optim.weight_decay, fused=fused)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Clip the gradients to ``max_grad_norm`` here, where Lightning calls this hook: after the
        precision plugin has unscaled them (16-mixed: ``scaler.unscale_``) and before the step, so
        the clip sees the true norm. Per parameter group (``optimizers: separate``) or over all
        (``shared``). DeepSpeed clips inside its own step, from its config (``gpu.configure_deepspeed``).
        Without a trainer too (``exact.expected_train`` steps its optimizer itself)."""
        optim = self.optim
        if not optim.max_grad_norm or (self._trainer is not None and gpu.is_deepspeed(self.trainer.strategy)):
            return
        groups = [group["params"] for group in optimizer.param_groups]
        for params in groups if optim.optimizers == "separate" else [[p for group in groups for p in group]]:
            torch.nn.utils.clip_grad_norm_(params, optim.max_grad_norm)

    @property
    def _critic_apart(self) -> bool:
        """A separate critic's value loss is a forward and backward pass of its own, after the policy's
        (the graphs share no tensor: the gradients are those of the sum): FSDP2 frees a root unit's
        gathered weights and full gradient only when a backward pass ends, so neither model's root
        nor activations are then held through the other's backward. Not under DDP, whose reducer
        expects every parameter's gradient in each pass, nor without a trainer."""
        ddp = isinstance(getattr(self._trainer, "model", None), DistributedDataParallel)
        return self.critic is not None and not self.networks.shared_critic and self._trainer is not None and not ddp

    @property
    def old_values_in_update(self) -> bool:
        """Whether a separate critic's V_old comes from the update's first forward of it instead of a
        forward of its own while scoring: when that first minibatch is the whole batch in one
        micro-batch (one minibatch, no accumulation), where the critic still has V_old's weights. One
        critic trunk forward per iteration fewer, the same values (tests/test_module.py)."""
        return self._critic_apart and self.ppo.num_minibatches == 1 and self.ppo.gradient_accumulation_steps == 1

    def _first_critic_values(self, rollout: Trajectory) -> Optional[Tensor]:
        """With ``old_values_in_update``: the separate critic's forward of the first minibatch (the
        whole batch), its graph kept for that minibatch's value loss; V_old is its detached values."""
        if rollout.old_values is not None or not self.old_values_in_update:
            return None
        values = self.networks.critic_values(rollout.input_ids, rollout.attention_mask, rollout.responses.shape[1])
        rollout.old_values = values.detach() * rollout.response_mask
        return values

    # ------------------------------------------------------------------ pieces
    def setup(self, stage: str) -> None:
        """At start-up, before any model loads: the checks that need the tokenizer or the data
        module's prompts (``checks.check_setup``); the CPU and GPU settings (cpu.py, gpu.py)."""
        if self._trainer is not None:
            gpu.setup(self.trainer, self)
            if self.async_rollouts is not None:
                self.async_rollouts.setup(self.trainer)
        self.rollout_engine.setup(self)
        self.check_reference()
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        self.longest_prompt = checks.check_setup(self, datamodule, stage)
        if stage == "fit":
            self.prompt_table = self.training_prompt_table(datamodule)
            controller = self.beta_controller
            if isinstance(controller, PerPromptBetaController):
                require(
                    self.prompt_table is not None,
                    "model.beta_controller",
                    "a controller with one beta for all prompts when the training batches come from no prompt file (a "
                    "per-prompt controller names its prompts by the ids of PromptDataModule's data.train_path)",
                    f"{type(controller).__name__} with data {type(datamodule).__name__ if datamodule is not None else 'from a dataloader'}",
                )
                controller.set_budgets(self.prompt_table.budgets)

    def training_prompt_table(self, datamodule) -> Optional[PromptTable]:
        """The training prompts' ids and KL budgets (``data.PromptTable``; a per-prompt controller's ``budget_column``)
        from the data module's prompt file, read at start-up before any model loads; None for batches from elsewhere."""
        if not hasattr(datamodule, "prompt_table"):
            return None
        return datamodule.prompt_table(getattr(self.beta_controller, "budget_column", None))

    def encode_prompts(self, prompts: list[str], field: str = "the prompts") -> dict[str, Tensor]:
        """``data.encode_prompts`` with this module's tokenizer and settings, on its device."""
        enc = encode_prompts(
            self.tokenizer, prompts, self.prompts.chat_template, self.prompts.max_length, self.prompts.special_tokens, field
        )
        return {k: v.to(self.device) for k, v in enc.items()}

    def _update_entropy_controller(self, metrics: dict[str, float], n_samples: int) -> None:
        """The entropy controller raises its coefficient while the entropy is below its target: it
        is fed target^2 / H, the entropy mirrored about the target in log space (log(input / target)
        = -log(H / target)), which a KL controller (raising beta while its input exceeds the target)
        turns into exactly that: the same log error with the opposite sign, and never negative."""
        controller = self.entropy_controller
        entropy = metrics["objective/entropy"]  # nats per token
        if controller.unit == "sequence_sum":
            entropy *= metrics["response/length"]
        target = getattr(controller, "target", None)
        controller.update(entropy if target is None else target**2 / max(entropy, 1e-6), n_samples=n_samples)

    @property
    def step(self) -> int:
        """The TensorBoard step of the latest iteration, for every record of it (scalars, text,
        images, warnings): its 0-based index, the step Lightning logs the scalars at. Read it once
        the iteration has been counted (``iteration`` is then its 1-based number)."""
        return self.iteration - 1

    def update_reference(self) -> None:
        """After an iteration, ref <- (1 - alpha) ref + alpha policy when the reference update plugin
        says alpha > 0 for it; a reset also clears the policy parameters' optimizer state."""
        alpha = self.reference_update.weight(self.iteration)
        if not alpha:
            return
        self.networks.move_reference(alpha)
        self.reference_updates += 1
        if self.reference_update.reset_optimizer:
            policy_params = {p for p in self.policy.parameters() if p.requires_grad}
            for opt in self.trainer.optimizers:
                for param in [p for p in opt.state if p in policy_params]:
                    del opt.state[param]

    def _reduce(self, t: Tensor, op: Literal["sum", "max"] = "sum") -> Tensor:
        """``t`` summed (or maxed) over all ranks, through the strategy; ``t`` itself on one process."""
        if self._trainer is None or self.trainer.world_size == 1:
            return t
        return self.trainer.strategy.reduce(t.to(self.device), reduce_op=op).to(t.device)

    def _record_fault(self, cause: str, iteration_skipped: bool, steps: int = 0) -> None:
        """Count and report a skipped iteration or update; stop after too many in a row."""
        self.faults.record(cause, iteration_skipped, steps)
        rank_zero_warn(f"iteration {self.step}: {cause}; skipped (weights untouched)")
        if iteration_skipped:  # only the fault counts: no metric of an iteration that did not happen
            self.log_dict(self.faults.metrics(iteration_skipped=True), on_step=True, on_epoch=False, batch_size=1)
        self.faults.stop_if_too_many()

    def _no_grad_sync(self, last: bool):
        """Skip DDP's gradient all-reduce on all but the last micro-batch of a minibatch."""
        if last or self._trainer is None or not hasattr(self.trainer.strategy, "block_backward_sync"):
            return contextlib.nullcontext()
        return self.trainer.strategy.block_backward_sync()

    # ------------------------------------------------------------------ metrics
    def rollout_metrics(self, rollout: Trajectory, scored: Scored, betas: Tensor) -> dict[str, float]:
        """Global (all-rank) means of what the rollout saw, ``betas`` each row's beta (batch,); each name is
        documented in docs/metrics.md."""
        mask, kl, raw_scores, scores = rollout.response_mask, scored.kl, scored.raw_scores, scored.scores
        kl = kl if rollout.is_weights is None else kl * rollout.is_weights  # E_sampler[w k] = E_pi_old[k]
        kl_seq = kl.sum(-1)
        counts = [torch.tensor(float(len(raw_scores)), device=self.device), raw_scores.to(self.device).sum(), scores.to(self.device).sum()]
        sums = [kl_seq.sum(), kl.sum(), mask.sum(), (rollout.entropy * mask).sum(), rollout.ended_with_eos.float().sum()]
        # the divergence's value per response (the reverse KL's: the KL estimate's sum, which the rollout correction weighs)
        divergence_seq = kl_seq if self.divergence.per_token else scored.divergence.to(kl_seq.device)
        sums.append(divergence_seq.sum())
        penalty = [betas.sum(), (betas * divergence_seq.double()).sum()]
        totals = self._reduce(torch.stack([t.double() for t in counts + sums + penalty]))
        n, reward, reward_trained, kl_total, kl_tokens, n_tokens, entropy, n_eos, divergence_total, beta_total, penalty_total = (
            totals.tolist()
        )
        kl_mean, divergence = kl_total / n, divergence_total / n
        kl_to_initial = kl_mean  # the same estimate against pi_0, which is the reference unless it moves
        if rollout.initial_logprobs is not None:
            kl_to_initial = float(self._reduce(self.kl_per_token(rollout, to_initial=True).sum().double().to(self.device))) / n
        gold = {}
        if self.gold_reward_model is not None:
            with gpu.no_autocast(self.device):
                gold_scores = self.gold_reward_model.checked_scores(rollout.prompts, rollout.response_texts, "model.gold_reward_model")
            gold = {"objective/gold_reward": float(self._reduce(gold_scores.sum().double().to(self.device))) / n}
        return {
            "objective/reward": reward / n,
            "objective/reward_trained": reward_trained / n,
            "objective/kl": kl_mean,
            "objective/kl_per_token": kl_tokens / n_tokens,
            "objective/kl_max": float(self._reduce(kl_seq.max().double(), op="max")),
            "objective/kl_to_initial": kl_to_initial,
            "reference/updates": float(self.reference_updates),
            "objective/divergence": divergence,
            "objective/non_score_reward": -penalty_total / n,  # -E[beta_x D_x]: -beta * objective/divergence with one beta
            "objective/net": reward / n - penalty_total / n,
            "objective/entropy": entropy / n_tokens,
            "objective/beta": beta_total / n,  # the mean over the responses: the beta, with one
            **({"objective/kl_target": float(self.beta_controller.target)} if hasattr(self.beta_controller, "target") else {}),
            "response/length": n_tokens / n,
            "response/eos_fraction": n_eos / n,
            "response/truncated_fraction": 1.0 - n_eos / n,  # cut at max_new_tokens without EOS
            "response/count": n,
            **sampling.mismatch_metrics(rollout.trainer_logprobs, rollout.sampler_logprobs, mask, self._reduce),
            **({"sampling/explore": self.exploration} if self.sampling.explore else {}),
            **(staleness_metrics(rollout.policy_version, self.iteration, self._reduce) if self.async_rollouts else {}),
            **self.off_policy_weight_metrics(rollout),
            **gold,
        }

    def off_policy_weight_metrics(self, rollout: Trajectory) -> dict[str, float]:
        """With stale samples (``model.off_policy.max_staleness`` > 0): ``off_policy/clipped_fraction`` and
        ``off_policy/ess`` of the correction's weights from mu to pi_prox (``sampling.off_policy_weight_metrics``)."""
        if not self.off_policy.max_staleness:
            return {}
        mode, cap = self.off_policy.weights(self.sampling)
        logprobs = (rollout.trainer_logprobs, rollout.sampler_logprobs, rollout.response_mask)
        return sampling.off_policy_weight_metrics(*logprobs, mode, cap, sum_fn=self._reduce)

    def prompt_stats(self, rollout: Trajectory, scored: Scored, betas: Tensor) -> Optional[PromptStats]:
        """Each training prompt's mean KL in the beta controller's unit, its responses and the beta its rows used,
        over all ranks: one row per prompt of ``prompt_table`` summed through the strategy's reduce, so every rank
        holds the same; its budget (a per-prompt controller's, another's target). None without a prompt table."""
        table = self.prompt_table
        if table is None:
            return None
        kl = scored.kl if rollout.is_weights is None else scored.kl * rollout.is_weights
        ones = torch.ones_like(betas)
        per_row = torch.stack([kl.sum(-1).double(), rollout.response_mask.sum(-1).double(), ones, betas])  # (4, batch)
        rows = table.rows(rollout.prompts).to(self.device)
        sums = torch.zeros(4, len(table.ids), dtype=torch.float64, device=self.device).index_add_(1, rows, per_row)
        sums = self._reduce(sums).cpu()
        seen = sums[2] > 0
        kl_total, tokens, responses, beta_total = sums[:, seen]
        ids = [table.ids[row] for row in seen.nonzero().flatten().tolist()]
        controller = self.beta_controller
        budgets = None
        if isinstance(controller, PerPromptBetaController):
            budgets = controller.budgets_of(ids)
        elif hasattr(controller, "target"):
            budgets = torch.full((len(ids),), float(controller.target), dtype=torch.float64)
        kl_mean = kl_total / (responses if controller.unit == "sequence_sum" else tokens)
        return PromptStats(ids, kl_mean, responses, beta_total / responses, budgets)

    def consume_update_stats(self) -> dict[str, float]:
        """Means of the update statistics over every micro-batch of this iteration (all ranks)."""
        out = {}
        for key, metric in self.update_stats.items():
            if metric.update_count:
                out[key.replace("__", "/")] = float(metric.compute())
            metric.reset()
        return out

    # ------------------------------------------------------------------ evaluation
    def validation_step(self, prompts: list[str], batch_idx: int) -> None:
        self._evaluate(prompts, "val")

    def test_step(self, prompts: list[str], batch_idx: int) -> None:
        self._evaluate(prompts, "test")

    def _evaluate(self, prompts: list[str], stage: str) -> None:
        rollout = self.rollout(prompts, critic_values=False)
        with gpu.no_autocast(self.device):
            raw_scores, _ = self.reward_model(rollout.prompts, rollout.response_texts, rollout.ended_with_eos, update_stats=False)
        reward = raw_scores.mean().item()
        kl_tokens = self.kl_per_token(rollout)
        kl, divergence = kl_tokens.sum(-1).mean().item(), self.divergence_terms(rollout, kl_tokens)[1].mean().item()
        metrics = {
            f"{stage}/reward": reward,
            f"{stage}/kl": kl,
            f"{stage}/divergence": divergence,
            f"{stage}/net": reward - self.beta_controller.beta * divergence,
            f"{stage}/length": rollout.response_mask.sum(-1).mean().item(),
        }
        self.log_dict(metrics, batch_size=len(prompts), sync_dist=True)

    # ------------------------------------------------------------------ checkpoints (checkpoints.py)
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoints.save_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        checkpoints.load_state(self, checkpoint)
