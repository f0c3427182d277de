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

Where things live: the sampler that draws and assembles a rollout in sampler.py (``self.sampler``), episodes with
an environment in episodes.py, the sampler that runs ahead in async_rollout.py; the networks in networks.py
(``self.networks``), their loading in models.py; the KL's terms in regulariser.py; the PPO epochs in update.py;
metrics in metrics.py; arguments in args.py, checks in checks.py; checkpoints in checkpoints.py; math in ppo_math.py.

Left out on purpose: reward-model training (tools/) and any home-made distributed code: every
cross-rank statistic goes through the Lightning strategy's ``reduce``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Literal, Optional, Union

import torch
from lightning import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from rlhf_lightning import args, checkpoints, checks, fsdp2, gpu, models
from rlhf_lightning import ppo_math as pm
from rlhf_lightning.args import KLArgs, LoadingArgs, LoraArgs, OffPolicyArgs, OptimArgs, PPOArgs, PromptArgs, RuntimeArgs, SamplingArgs
from rlhf_lightning.async_rollout import AsyncRollouts, check_strategy
from rlhf_lightning.callbacks import Timer, module_callbacks
from rlhf_lightning.checks import Faults
from rlhf_lightning.data import Lookahead, PromptTable, check_prompts, prompt_place, token_ids
from rlhf_lightning.interfaces import (
    AdvantageEstimator,
    BetaController,
    Divergence,
    Environment,
    KLEstimator,
    LossAggregation,
    PolicyLoss,
    ReferenceUpdate,
    RewardModel,
    RolloutEngine,
)
from rlhf_lightning.memory import check_memory
from rlhf_lightning.metrics import entropy_controller_input, prompt_stats, rollout_metrics, update_means
from rlhf_lightning.models import ValueModel, load_tokenizer
from rlhf_lightning.networks import Networks, build_networks
from rlhf_lightning.regulariser import Regulariser
from rlhf_lightning.sampler import Drawn, Sampler
from rlhf_lightning.trajectory import IterationOutputs, PromptStats, Scored, Trajectory
from rlhf_lightning.update import PPOUpdate
from rlhf_lightning.weight_guard import WeightGuard

# The frozen reference copy is in eval mode on purpose (dropout is off everywhere anyway).
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")


class PPORLHF(LightningModule):
    """PPO-RLHF: rollout -> score -> advantages -> update, with a pluggable KL penalty.

    The plugins are flat arguments: a registered short name (``k3``, ``adaptive``), a class name or ``class_path``
    with ``init_args`` (docs/plugins.md). So are the network keys (``policy``, ``tokenizer``, ``reference``,
    ``critic``; docs/configuration.md). Every other setting is in a group, each field documented where it is
    declared (args.py): ``sampling``, ``prompts``, ``kl``, ``ppo``, ``optim``, ``lora``, ``runtime``, ``off_policy``,
    ``loading`` (how the networks are built). The names of earlier versions (``lr=...``, ``seed=...``) still work
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
        environment: Union[Environment, str, None] = None,
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
        for name, plugin in plugins.items():  # self.reward_model, self.kl_estimator, ...: the types of the signature
            setattr(self, name, plugin)
        groups.update(args.check_across_groups(critic, groups, plugins))
        args.check_reference(reference, self.reference_update)
        for name in args.GROUPS:  # self.sampling, self.prompts, ...: the groups of args.py
            setattr(self, name, groups[name])
        # The saved hyperparameters: the network keys and each group as plain values, resolved.
        network = dict(policy=policy, tokenizer=tokenizer, reference=reference, critic=groups["critic"])
        self.save_hyperparameters({**network, **{name: dataclasses.asdict(groups[name]) for name in args.GROUPS}})
        self.automatic_optimization = False

        self.tokenizer = load_tokenizer(tokenizer or ("char" if policy == "tiny" else policy), self.loading.trust_remote_code)
        ignore_ids = token_ids(self.tokenizer, self.kl.ignore_tokens or [], "each of model.kl.ignore_tokens")
        self.regulariser = Regulariser(self.kl_estimator, self.divergence, self.kl, ignore_ids)
        self.policy: Optional[nn.Module] = None
        self.ref_model: Optional[nn.Module] = None
        self.initial_model: Optional[nn.Module] = None  # full fine-tuning with a moving or foreign reference: pi_0
        self.reference_updates = 0  # times the reference has moved (checkpointed)
        self.critic: Optional[ValueModel] = None
        self.networks: Optional[Networks] = None  # the part that runs them, once built (configure_model)
        self.sampler: Optional[Sampler] = None  # the part that draws rollouts with them (configure_model)
        self.update: Optional[PPOUpdate] = None  # the part that runs the PPO epochs on them (configure_model)
        self.async_rollouts: Optional[AsyncRollouts] = None  # max_staleness > 0: the sampler that runs ahead; None: synchronous
        self.iteration = 0  # PPO iterations done; global_step counts optimizer steps instead
        self._rng_to_restore: Optional[dict] = None
        self.generation_seed_base = int(torch.initial_seed()) % 2**31  # saved with checkpoints
        self.faults = Faults(limit=self.runtime.max_consecutive_faults)
        self.weight_guard = WeightGuard.of(self.off_policy, self.sampling)  # a batch whose correction weights are ~0: warn or stop
        self.longest_prompt: Optional[int] = None  # tokens, of the data module's prompt files (setup)
        self.prompt_table: Optional[PromptTable] = None  # the training prompts' ids and budgets (setup; prompt_stats)

    # ------------------------------------------------------------------ setup
    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        # Lightning logs, at each step, every step value it still holds from earlier steps: a skipped iteration
        # would repeat the previous one's metrics at its own step (tests/test_faults.py), and a callback's value
        # logged every N iterations (KLHealth's probes) each iteration after.
        if self.trainer._results is not None:
            for fx in ("training_step", "on_train_batch_end"):
                self.trainer._results.reset(metrics=False, fx=fx)
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
            skipped_steps = self.update.run(rollout, advantages, returns, betas.to(scale.dtype) * scale, values, **self.update_context())
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
        upcoming = [self.repeat_prompts(batch) for batch in Lookahead.of(self._trainer, prompts, self.off_policy.max_staleness)]
        return self.async_rollouts.draw(rows, upcoming, self.iteration, self.global_step, timer)

    def rollout(
        self, prompts: list[str], timer: Optional[Timer] = None, critic_values: bool = True, drawn: Optional[Drawn] = None
    ) -> Trajectory:
        """The rollout phase (``Sampler.rollout``): ``prompts`` sampled from the current weights (exploring while
        training, ``exploration``), or the batch the asynchronous sampler ``drawn`` ahead; pi_old, V_old (a separate
        critic's only with ``critic_values``) and log pi_ref."""
        first = self.training and self.iteration == 0  # the run's first rollout: a sampler that draws one token alone is said
        return self.sampler.rollout(prompts, self.iteration, self.global_step, self.exploration, timer, critic_values, drawn, first)

    @property
    def exploration(self) -> float:
        """epsilon of this iteration's draw (``model.sampling.explore``); 0 outside training (validation samples pi)."""
        return self.sampling.exploration(self.iteration) if self.training else 0.0

    def teardown(self, stage: str) -> None:
        if self.async_rollouts is not None:
            self.async_rollouts.close()

    def configure_callbacks(self) -> list:
        return module_callbacks(self._trainer, self.runtime)  # TensorBoard's views; the KL health monitor unless the user's

    def on_fit_start(self) -> None:
        self._setup_reward_models()

    def _setup_reward_models(self) -> None:
        self.reward_model.setup(self.device)
        if self.gold_reward_model is not None:
            self.gold_reward_model.setup(self.device)

    on_validation_start = on_test_start = _setup_reward_models

    def row_betas(self, prompts: list[str]) -> Tensor:
        """beta of each row (batch,), float64 on the module's device: the controller's for each row's prompt, by its id
        in ``prompt_table`` (``BetaController.checked_betas``; one beta for all with a scalar controller)."""
        ids = prompts if self.prompt_table is None else self.prompt_table.ids_of(prompts)
        return self.beta_controller.checked_betas(ids).to(self.device)

    def score(self, rollout: Trajectory, betas: Tensor) -> Scored:
        """r_RM from the reward backend, the per-token KL estimate, and the per-token rewards
        R_t = r_RM * 1[t = T] - beta * kl_t (the KL term only when the penalty is in the reward), beta the
        row's (``betas``, (batch,)); with a sequence-level divergence R_t = (r_RM - beta f'(u)) * 1[t = T], u the
        response's probability ratio to the reference (``Regulariser.divergence_terms``). A non-finite reward, KL or penalty on
        any rank is a fault, named in ``Scored.fault``: the penalty beta f'(u) as the reward holds it (float32), so
        a u finite in float64 but past float32's range (chi2: log u > 88 + log(1 / 2 beta)) is not a silent inf."""
        kl, raw_scores, fault = self.regulariser.kl_per_token(rollout), rollout.raw_scores, rollout.reward_fault
        penalty, divergence = self.regulariser.divergence_terms(rollout, kl)
        if penalty is not None:  # beta f'(u) in float64; the reward holds it in kl's dtype, where e^(log u) overflows sooner
            penalty = betas.to(penalty.device, penalty.dtype) * penalty
        if raw_scores is None and fault is None:  # not scored by the sampler ahead
            raw_scores, fault = self.reward(rollout.prompts, rollout.response_texts)
        fault = fault or self.regulariser.nonfinite(kl, penalty, betas)
        if self.networks.any_rank(fault is not None):
            return Scored(kl, raw_scores, fault=fault or "a non-finite reward, KL or penalty on another rank")
        scores = self.reward_model.shape_scores(raw_scores, rollout.ended_with_eos, sum_fn=self._reduce).to(self.device)
        kl_in_reward = kl if self.kl.in_reward and penalty is None else torch.zeros_like(kl)
        row_betas = betas.to(kl.dtype).unsqueeze(-1)  # (batch, 1)
        penalised = scores if penalty is None else scores - penalty.to(scores.device, scores.dtype)
        rewards = pm.token_rewards(penalised, kl_in_reward, rollout.response_mask, row_betas)
        if rollout.episode is not None:  # the environment's rewards, each at the last token of the turn it answered
            rewards += rollout.episode.turn_rewards.to(rewards.dtype)
        return Scored(kl, raw_scores, scores, rewards, divergence=divergence)

    def reward(self, prompts: list[str], responses: list[str]) -> tuple[Optional[Tensor], Optional[str]]:
        """``(raw_scores, fault)``: the reward backend's checked scores, or why they are not finite (then None)."""
        try:
            with gpu.no_autocast(self.device):
                return self.reward_model.checked_scores(prompts, responses), None
        except FloatingPointError as err:
            return None, str(err)

    def skip_iteration(self, rollout: Trajectory, scored: Scored) -> IterationOutputs:
        """Count a faulty iteration (weights untouched) and log it as skipped, without stale metrics."""
        self.iteration += 1
        self._record_fault(scored.fault, iteration_skipped=True)
        return {"rollout": rollout, "kl": scored.kl, "scores": scored.raw_scores, "metrics": {}, "skipped": True, "prompts": None}

    def update_controllers(self, metrics: dict[str, float], prompt_stats: Optional[PromptStats] = None) -> None:
        """The beta controller sees the global mean divergence (``objective/divergence``: the KL under the reverse
        KL, the default) or, with unit ``token_mean``, the KL per token (a per-prompt controller also each prompt's
        KL, ``prompt_stats``); an entropy controller, if any, the entropy (``metrics.entropy_controller_input``)."""
        n_samples = int(metrics["response/count"])
        unit = self.beta_controller.unit  # sequence_sum: the divergence's value (the KL's, under the reverse KL)
        self.beta_controller.update(
            metrics["objective/divergence" if unit == "sequence_sum" else "objective/kl_per_token"], n_samples=n_samples
        )
        if prompt_stats is not None:
            self.beta_controller.update_prompts(prompt_stats.ids, prompt_stats.kl, prompt_stats.responses)
        if (controller := self.entropy_controller) is not None:
            metrics["objective/entropy_coef"] = controller.beta
            controller.update(entropy_controller_input(metrics, controller.unit, getattr(controller, "target", None)), n_samples=n_samples)

    def end_iteration(
        self, rollout: Trajectory, scored: Scored, metrics: dict, skipped: int, timer: Timer, prompt_stats=None
    ) -> IterationOutputs:
        """Count the iteration and its faults; log its metrics (docs/metrics.md)."""
        self.iteration += 1
        if skipped:
            rewards = f"rewards up to {float(scored.raw_scores.abs().max()):.3g} from model.reward_model {type(self.reward_model).__name__}"
            cause = f"non-finite PPO loss: {skipped} optimizer step(s) skipped (not finite: {self.update.nonfinite_terms}; beta {metrics['objective/beta']}; {rewards})"
            self._record_fault(cause, iteration_skipped=False, steps=skipped)
        else:
            self.faults.consecutive = 0
        metrics.update(self.faults.metrics(iteration_skipped=False))
        metrics.update(update_means(self.update_stats))
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

    def compute_advantages(self, rewards: Tensor, rollout: Trajectory) -> tuple[Tensor, Optional[Tensor]]:
        """The advantage estimator on the rewards (V_old with a critic), checked, whitened when ``whiten_advantages``."""
        advantages, returns = self.advantage_estimator.checked(
            rewards, rollout.response_mask, rollout.old_values, self.sampling.num_generations, self._reduce
        )
        if self.ppo.whiten_advantages:
            advantages = pm.masked_whiten(advantages, rollout.response_mask, sum_fn=self._reduce)
        return advantages, returns

    # ------------------------------------------------------------------ the networks and the sampler
    def configure_model(self) -> None:
        """Build the networks (``networks.build_networks``; under FSDP2 no rank holds a full copy), register them on
        the module (Lightning's checkpoints, devices and strategies see them there), and the sampler that draws with
        them (sampler.py; with ``model.off_policy.max_staleness`` > 0 the one that runs ahead, async_rollout.py)."""
        if self.policy is not None:
            return
        hp, staleness = self.hparams, self.off_policy.max_staleness
        networks = build_networks(
            self.load_policy,
            self.load_reference if hp.reference is not None else None,
            critic=hp.critic,
            sampling=self.sampling,
            prompts=self.prompts,
            lora=self.lora,
            reference_moves=self.reference_update.moves,
            shared_prompts=self.runtime.shared_prompts,
            eos_token_id=self.tokenizer.eos_token_id,
            reduce=self._reduce,
            device_mesh=self.device_mesh,  # ModelParallelStrategy: FSDP2 over the data-parallel mesh
            longest_prompt=self.longest_prompt,
            keep_skeleton=bool(staleness),
        )
        for name in ("critic", "policy", "ref_model", "initial_model"):  # registered here: Lightning's checkpoints, devices, strategies
            setattr(self, name, getattr(networks, name))
        self.networks = networks
        self.update = PPOUpdate(networks, self.policy_loss, self.loss_aggregation, self.regulariser, self.entropy_controller, self.ppo)
        self.update_stats = self.update.stats  # registered: its means follow the module's device and are reduced over the ranks
        trainer = self._trainer
        self.sampler = Sampler(
            tokenizer=self.tokenizer,
            engine=self.rollout_engine,
            networks=networks,
            sampling=self.sampling,
            prompts=self.prompts,
            off_policy=self.off_policy,
            runtime=self.runtime,
            reward=self.reward,
            needs_logits=self.kl_estimator.needs_logits,
            reference_signal=self.kl_estimator.reference_signal,
            seed_base=self.generation_seed_base,
            global_rank=self.global_rank,
            local_rank=self.local_rank,
            environment=self.environment,
            longest_prompt=self.longest_prompt,
            teacher_prompts=self.prompt_table.teacher_prompts if self.prompts.teacher_template else None,
        )
        if staleness:
            step_context = trainer.precision_plugin.train_step_context if trainer is not None else contextlib.nullcontext
            self.async_rollouts = AsyncRollouts(
                self.sampler, self.off_policy, self.reference_update.moves, step_context, skeleton=networks.skeleton
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
        """Before any model loads: a foreign ``model.reference`` exists and shares the policy's tokenizer (models.py)."""
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
        """``Networks.optimizer``: one AdamW over the policy's and the critic's parameter groups. Fused, one kernel per
        step, but not under 16-mixed/bf16-mixed, whose gradients a fused AdamW would unscale after they are clipped."""
        fused = not (self._trainer is not None and isinstance(self.trainer.precision_plugin, MixedPrecision))
        return self.networks.optimizer(self.optim, fused)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Clip the gradients here, where Lightning calls this hook: after the precision plugin has unscaled them
        (16-mixed: ``scaler.unscale_``) and before the step (``Networks.clip_gradients``). DeepSpeed clips inside its
        own step, from its config (``gpu.configure_deepspeed``). Without a trainer too (``exact.expected_train``)."""
        if not (self._trainer is not None and gpu.is_deepspeed(self.trainer.strategy)):
            Networks.clip_gradients(optimizer, self.optim)

    @property
    def _critic_apart(self) -> bool:
        """A separate critic's value loss in a pass of its own (``Networks.critic_apart``); not without a trainer."""
        ddp = isinstance(getattr(self._trainer, "model", None), DistributedDataParallel)
        return self._trainer is not None and self.networks.critic_apart(ddp)

    @property
    def old_values_in_update(self) -> bool:
        """A separate critic's V_old from the update's first forward of it (``Networks.old_values_in_update``)."""
        return Networks.old_values_in_update(self._critic_apart, self.ppo.num_minibatches, self.ppo.gradient_accumulation_steps)

    def _first_critic_values(self, rollout: Trajectory) -> Optional[Tensor]:
        """With ``old_values_in_update``: the separate critic's forward of the first minibatch (the whole batch), its
        graph kept for that minibatch's value loss; V_old is its detached values (``Networks.first_critic_values``)."""
        if rollout.old_values is not None or not self.old_values_in_update:
            return None
        values, rollout.old_values = self.networks.first_critic_values(rollout.input_ids, rollout.attention_mask, rollout.response_mask)
        return values

    # ------------------------------------------------------------------ pieces
    def setup(self, stage: str) -> None:
        """At start-up, before any model loads: the checks that need the tokenizer or the data
        module's prompts (``checks.check_setup``); the CPU and GPU settings (cpu.py, gpu.py)."""
        if self._trainer is not None:
            gpu.setup(self.trainer, self)
            if self.off_policy.max_staleness:
                check_strategy(self.trainer, self.off_policy.max_staleness)
        self.rollout_engine.setup(self)
        self.check_reference()
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if stage == "fit" or self.prompts.teacher_template:  # validation scores the reference under the teacher's prompts too
            self.prompt_table = self.training_prompt_table(datamodule)
            checks.check_prompt_table(self.prompt_table, self.beta_controller, self.prompts.teacher_template, datamodule)
            if self.beta_controller.keyed_by_prompt:
                self.beta_controller.set_budgets(self.prompt_table.budgets)
        self.longest_prompt = checks.check_setup(self, datamodule, stage, check_prompts, prompt_place)
        if stage == "fit":  # this run's memory against the machine's, before any model loads (memory.py)
            check_memory(self, datamodule, self.longest_prompt)

    def training_prompt_table(self, datamodule) -> Optional[PromptTable]:
        """The training prompts' ids, KL budgets and teacher prompts (``data.PromptTable``), read before any model
        loads; None: batches from elsewhere (the lab's tasks give their own)."""
        if not hasattr(datamodule, "prompt_table"):
            return None
        return datamodule.prompt_table(getattr(self.beta_controller, "budget_column", None), self.prompts.teacher_template)

    @property
    def step(self) -> int:
        """The TensorBoard step of the latest iteration, for every record of it: its 0-based index (read it once counted)."""
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

    def update_context(self) -> dict[str, Any]:
        """What ``PPOUpdate.run`` takes from the trainer: the optimizer, Lightning's backward, DDP's no_sync, the ranks."""
        world_size = self.trainer.world_size if self._trainer is not None else 1
        return dict(
            optimizer=self.optimizers(),
            backward=self.manual_backward,
            no_sync=self._no_grad_sync,
            reduce=self._reduce,
            world_size=world_size,
            critic_apart=self._critic_apart,
            guard=self.weight_guard,
        )

    def _no_grad_sync(self, last: bool):
        """Skip DDP's gradient all-reduce on all but the last micro-batch of a minibatch."""
        if last or self._trainer is None or not hasattr(self.trainer.strategy, "block_backward_sync"):
            return contextlib.nullcontext()
        return self.trainer.strategy.block_backward_sync()

    # ------------------------------------------------------------------ metrics (metrics.py)
    def rollout_metrics(self, rollout: Trajectory, scored: Scored, betas: Tensor) -> dict[str, float]:
        """``metrics.rollout_metrics`` of the iteration, with what only the module holds: the KL to the starting
        policy (a moving or foreign reference), the gold reward, the controller's target and the off-policy settings."""
        kl_to_initial = None if rollout.initial_logprobs is None else self.regulariser.kl_per_token(rollout, to_initial=True)
        gold_scores = None
        if self.gold_reward_model is not None:
            with gpu.no_autocast(self.device):
                gold_scores = self.gold_reward_model.checked_scores(rollout.prompts, rollout.response_texts, "model.gold_reward_model")
        stale = bool(self.off_policy.max_staleness)
        return rollout_metrics(
            rollout,
            scored,
            betas,
            self._reduce,
            per_token_divergence=self.divergence.per_token,
            kl_to_initial=kl_to_initial,
            gold_scores=gold_scores,
            kl_target=getattr(self.beta_controller, "target", None),
            reference_updates=self.reference_updates,
            exploration=self.exploration if self.sampling.explore else None,
            iteration=self.iteration if stale else None,
            off_policy_weights=self.off_policy.weights(self.sampling) if stale else None,
        )

    def prompt_stats(self, rollout: Trajectory, scored: Scored, betas: Tensor) -> Optional[PromptStats]:
        """``metrics.prompt_stats`` over ``prompt_table`` in the beta controller's unit, each prompt's budget the
        controller's (``BetaController.budgets_of``); None without a prompt table."""
        if self.prompt_table is None:
            return None
        controller = self.beta_controller
        per_response = controller.unit == "sequence_sum"
        return prompt_stats(
            rollout, scored, betas, self.prompt_table, self._reduce, per_response=per_response, budgets_of=controller.budgets_of
        )

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
        kl_tokens = self.regulariser.kl_per_token(rollout)
        kl, divergence = kl_tokens.sum(-1).mean().item(), self.regulariser.divergence_terms(rollout, kl_tokens)[1].mean().item()
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
