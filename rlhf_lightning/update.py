"""The update phase: ``ppo.epochs`` passes over ``ppo.num_minibatches`` minibatches of the rollout, each in
``ppo.gradient_accumulation_steps`` micro-batches, one optimizer step per minibatch. A micro-batch's loss is
the policy-loss plugin's per-token term (weighed by the rollout correction), + ``vf_coef`` x the clipped value
loss with a critic, + kl_coef x the KL's loss term (``Regulariser.loss_term``, where the KL is in the loss),
- the entropy bonus, each per-token term summed with the loss-aggregation plugin's weights."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from rlhf_lightning import ppo_math as pm
from rlhf_lightning import sampling
from rlhf_lightning.args import PPOArgs
from rlhf_lightning.checks import ConfigError, nonfinite_terms
from rlhf_lightning.interfaces import BetaController, LossAggregation, PolicyLoss
from rlhf_lightning.networks import Networks
from rlhf_lightning.regulariser import Regulariser
from rlhf_lightning.trajectory import Trajectory
from rlhf_lightning.weight_guard import WeightGuard

Reduce = Callable[..., Tensor]
UPDATE_STATS = ("policy/loss", "policy/clipfrac", "policy/approxkl", "value/loss", "value/clipfrac", "policy/kl_loss", "policy/entropy")


class PPOUpdate:
    """The update of one iteration on the ``networks``, with explicit inputs: the policy loss and the loss
    aggregation plugins, the regulariser (the KL's loss term and settings), the entropy controller (its coefficient read
    at each micro-batch; None: no bonus) and the PPO settings. ``stats``: the iteration's logged means by name (``/``
    as ``__``), which the module registers (``update_stats``).

    ``run`` takes what belongs to the trainer: the optimizer, ``backward`` (Lightning's ``manual_backward``),
    ``no_sync(last)`` (DDP's gradient all-reduce skipped on all but a minibatch's last micro-batch), ``reduce``
    over the ranks, the world size that DDP divides gradients by, and ``critic_apart``: a separate critic's value
    loss in a forward and backward pass of its own (``Networks.critic_apart``)."""

    def __init__(
        self,
        networks: Networks,
        policy_loss: PolicyLoss,
        loss_aggregation: LossAggregation,
        regulariser: Regulariser,
        entropy_controller: Optional[BetaController],
        ppo: PPOArgs,
    ) -> None:
        self.networks, self.policy_loss, self.loss_aggregation = networks, policy_loss, loss_aggregation
        self.regulariser, self.entropy_controller, self.ppo, self.kl = regulariser, entropy_controller, ppo, regulariser.kl
        self.max_new_tokens = networks.sampling.max_new_tokens  # a constant aggregation's denominator
        self.stats = nn.ModuleDict({name.replace("/", "__"): MeanMetric() for name in UPDATE_STATS})
        self.terms: dict[str, Tensor] = {}  # a micro-batch's logged terms, named in the fault when a loss is not finite
        self.nonfinite_terms = ""  # which terms were not finite, at the last skipped step

    def run(
        self,
        rollout: Trajectory,
        advantages: Tensor,
        returns: Optional[Tensor],
        kl_coef: Tensor,
        values: Optional[Tensor],
        *,
        optimizer,
        backward: Callable[[Tensor], Any],
        no_sync: Callable[[bool], Any],
        reduce: Reduce,
        world_size: int = 1,
        critic_apart: bool = False,
        guard: Optional[WeightGuard] = None,
    ) -> int:
        """All PPO epochs over the rollout, one optimizer step per minibatch; ``kl_coef`` (batch,) is beta times the
        advantage estimator's gradient scale of each response (a KL in the loss is weighed against the reward as
        configured); ``values``: the first minibatch's critic forward (``Networks.first_critic_values``). Returns how
        many steps were skipped because a loss was not finite on some rank (gradients dropped, weights untouched).
        ``guard``: the rollout's correction weights checked first, a batch whose weights are (almost) all zero warned
        of or refused (``weight_guard``): never a silent update on a zero loss."""
        if guard is not None:
            guard.check(rollout.is_weights, rollout.response_mask, reduce)
        skipped = 0
        for _ in range(self.ppo.epochs):
            order = torch.randperm(rollout.input_ids.shape[0], device=rollout.input_ids.device)
            for minibatch in order.chunk(self.ppo.num_minibatches):
                # The loss of the minibatch is sum w * loss_t over all its tokens on all ranks, with the
                # aggregation's weights w (global denominators), times the world size that DDP divides by.
                weights = self.loss_aggregation.weights(rollout.response_mask[minibatch], self.max_new_tokens, reduce) * world_size
                micro = (rollout, advantages, returns, minibatch, weights, kl_coef, values)
                if self.accumulate(*micro, backward=backward, no_sync=no_sync, critic_apart=critic_apart):
                    optimizer.step()
                else:
                    skipped += 1
                optimizer.zero_grad(set_to_none=True)
                values = None
        bad = self.networks.nonfinite_weights(trained_only=True)
        if bad:  # stopped here, before the sampler draws from them (and before any checkpoint holds them)
            lr = ", ".join(f"{group.get('name', 'params')} {group['lr']:g}" for group in optimizer.param_groups)
            raise ConfigError(
                f"the weights are not finite after this iteration's update: {bad}, though every loss was finite: a gradient or "
                f"an optimizer step overflowed them; lower model.optim.lr ({lr}) or set model.optim.max_grad_norm. Stopped before "
                "the sampler draws from them; the last checkpoint holds the weights before"
            )
        return skipped

    def accumulate(
        self,
        rollout: Trajectory,
        advantages: Tensor,
        returns: Optional[Tensor],
        minibatch: Tensor,
        weights: Tensor,
        kl_coef: Tensor,
        values: Optional[Tensor],
        *,
        backward: Callable[[Tensor], Any],
        no_sync: Callable[[bool], Any],
        critic_apart: bool,
    ) -> bool:
        """Backward over the minibatch's micro-batches; False (and stop) at a non-finite loss. Given the
        critic's ``values`` of every row, the value loss goes first, freeing their graph."""
        size = len(minibatch) // self.ppo.gradient_accumulation_steps
        micro_batches = list(zip(minibatch.split(size), weights.split(size), strict=True))
        for i, (idx, micro_weights) in enumerate(micro_batches):
            self.terms = {}
            with no_sync(i == len(micro_batches) - 1):
                losses = [partial(self.loss, rollout, advantages, returns, idx, kl_coef, micro_weights, critic=not critic_apart)]
                if values is not None:
                    losses.insert(0, partial(self.value_loss, rollout, returns, idx, micro_weights, values[idx]))
                elif critic_apart:
                    losses.append(partial(self.value_loss, rollout, returns, idx, micro_weights))
                for loss_of in losses:  # the policy's forward and backward, a separate critic's after or before
                    loss = loss_of()
                    if self.networks.any_rank(not torch.isfinite(loss)):
                        self.nonfinite_terms = nonfinite_terms(self.terms, loss)
                        return False
                    backward(loss)
        return True

    def loss(
        self,
        rollout: Trajectory,
        advantages: Tensor,
        returns: Optional[Tensor],
        idx: Tensor,
        kl_coef: Tensor,
        weights: Tensor,
        critic: bool = True,
    ) -> Tensor:
        """On the rows ``idx``: the policy loss (+ ``value_loss`` with a critic in the policy's pass, ``critic``) (+
        kl_coef x the KL's loss term) (- the entropy bonus), each per-token term summed with ``weights``. The critic
        (gae) learns the returns of the reward alone when the KL is in the loss: the KL's future is carried by the
        loss's sequence term, not by the values."""
        input_ids, attention_mask, mask = rollout.input_ids[idx], rollout.attention_mask[idx], rollout.response_mask[idx]
        logits, values = self.networks.policy_outputs(input_ids, attention_mask, rollout.responses.shape[1], critic=critic)
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
            kl_loss, kl_mask = self.regulariser.loss_term(rollout, idx, logprobs, logits)
            # The advantage estimator's gradient scale (a group std, a mean baseline's (n - 1) / n) on
            # the KL as on the reward, so that beta weighs one against the other as configured.
            loss = loss + (weights * kl_coef[idx, None] * is_weights * kl_loss).sum()
            stats["policy/kl_loss"] = pm.masked_mean(kl_loss, kl_mask)
        if self.entropy_controller is not None and self.entropy_controller.beta:
            entropy = pm.masked_select(pm.entropy_of(logits), mask)
            loss = loss - self.entropy_controller.beta * (weights * entropy).sum()
            stats["policy/entropy"] = pm.masked_mean(entropy, mask)
        self.record(stats)
        return loss

    def value_loss(self, rollout: Trajectory, returns: Tensor, idx: Tensor, weights: Tensor, values: Optional[Tensor] = None) -> Tensor:
        """On the rows ``idx``: vf_coef x the clipped value loss, each per-token term summed with ``weights``, of
        ``values`` (a shared critic's, from the policy's forward) or of a forward of the separate critic."""
        mask, response_len = rollout.response_mask[idx], rollout.responses.shape[1]
        if values is None:
            values = self.networks.critic_values(rollout.input_ids[idx], rollout.attention_mask[idx], response_len)
        vf = pm.value_loss_terms(values, rollout.old_values[idx], returns[idx], mask, self.ppo.cliprange_value)
        self.record({"value/loss": pm.masked_mean(vf.loss, mask), "value/clipfrac": pm.masked_mean(vf.clipped, mask)})
        return self.ppo.vf_coef * (weights * vf.loss).sum()

    def record(self, terms: dict[str, Tensor]) -> None:
        """A loss's logged terms: into the iteration's update statistics, and kept for a fault's message."""
        self.terms.update(terms)
        for name, value in terms.items():
            self.stats[name.replace("/", "__")].update(value.detach().float())
