"""What one PPO iteration learns from: the rollout's tensors (``Sampler.trajectory`` builds them), what
scoring makes of them (``PPORLHF.score``) and what the iteration hands its callbacks.

Every distribution in it is the declared one of ``rlhf_lightning.sampling``: tempered, restricted to
the sampler's kept set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, TypedDict

from torch import Tensor

from rlhf_lightning.episodes import EpisodeLayout


@dataclass
class Trajectory:
    """Everything one iteration learns from. Per-token tensors are (batch, response_len)."""

    prompts: list[str]
    response_texts: list[str]  # decoded, special tokens left out
    input_ids: Tensor  # (batch, prompt_len + response_len): prompt then response
    attention_mask: Tensor  # same shape: the tokenizer's prompt mask, then the response mask
    responses: Tensor  # (batch, response_len) response token ids, pad after EOS
    response_mask: Tensor  # 1 on real response tokens, up to and including the first EOS; an episode's: the policy's tokens
    ended_with_eos: Tensor  # (batch,) bool
    old_logprobs: Tensor  # log pi_old of the sampled tokens in the PPO ratio: the sampler's or the trainer's (old_logprobs)
    trainer_logprobs: Tensor  # log pi_old from the trainer's model (the KL's); the sampler's own: sampler_logprobs
    sampler_logprobs: Tensor  # the behaviour policy mu's: the sampler's weights (of policy_version, or each token's token_versions)
    ref_logprobs: Tensor
    old_values: Optional[Tensor]  # V_old(s_t), the critic's values at sampling time; None without a critic
    entropy: Tensor  # of pi_old at each response position
    ref_logits: Optional[Tensor] = None  # (batch, response_len, vocab), only when the estimator needs it
    old_logits: Optional[Tensor] = None  # pi_old's, like ref_logits
    initial_logprobs: Optional[Tensor] = None  # log pi_0, only when the reference moves or is another model
    initial_logits: Optional[Tensor] = None
    kept: Optional[Tensor] = None  # (batch, response_len, vocab) bool: the sampler's kept set, replayed; None: every token
    is_weights: Optional[Tensor] = None  # the rollout correction's weights (sampling.correction_weights); None: none
    policy_version: Optional[Tensor] = (
        None  # (batch,) long: the version (PPO iterations done) of the weights that sampled each row (its first token's)
    )
    token_versions: Optional[Tensor] = None  # (batch, response_len) long: each token's version, with in-flight updates (else None)
    raw_scores: Optional[Tensor] = None  # r_RM as the backend returned it, when the sampler scored the batch ahead (else: None)
    reward_fault: Optional[str] = None  # why the sampler found r_RM not finite, when it scored the batch ahead
    episode: Optional[EpisodeLayout] = None  # with an environment: the policy's and the environment's tokens, turns, rewards


@dataclass
class Scored:
    """The score phase's results. Per-token tensors are (batch, response_len); per-response (batch,)."""

    kl: Tensor  # the penalised per-token KL estimate, zero off the KL mask
    raw_scores: Optional[Tensor]  # r_RM as the backend returned it (None when the backend faulted)
    scores: Optional[Tensor] = None  # r_RM shaped for training (missing-EOS penalty, normalisation, clip)
    rewards: Optional[Tensor] = None  # R_t = r_RM * 1[t = T] - beta * kl_t (the KL only when it is in the reward)
    divergence: Optional[Tensor] = None  # (batch,) each response's f(u) / u (module.divergence_terms)
    fault: Optional[str] = None  # why the iteration is skipped: a non-finite reward or KL on some rank


@dataclass
class PromptStats:
    """Each training prompt of one iteration, over all ranks (``PPORLHF.prompt_stats``): (prompts,) float64 on
    the CPU, one entry per prompt id sampled in the iteration."""

    ids: list[str]  # the prompts' ids (data.PromptTable)
    kl: Tensor  # the mean KL of the prompt's responses, in the beta controller's unit
    responses: Tensor  # how many responses it had
    betas: Tensor  # the beta its rows were penalised with
    budgets: Optional[Tensor]  # its KL budget (a per-prompt controller's; another controller's target); None: none

    def metrics(self) -> dict[str, float]:
        """The spread of the per-prompt KL and beta (docs/metrics.md): ``prompts/{kl,beta}_{min,max,std}`` and
        ``prompts/count``; with budgets, ``prompts/budget_max_abs_rel_error`` and ``budget_mean_abs_rel_error``
        (|KL_x / budget_x - 1|) and ``prompts/over_budget_share`` (the share of prompts whose KL exceeds their budget)."""
        out = {"prompts/count": float(len(self.ids))}
        for name, values in (("kl", self.kl), ("beta", self.betas)):
            spread = values.std().item() if len(values) > 1 else 0.0
            out.update(
                {f"prompts/{name}_min": values.min().item(), f"prompts/{name}_max": values.max().item(), f"prompts/{name}_std": spread}
            )
        if self.budgets is not None:
            error = (self.kl / self.budgets - 1.0).abs()
            out["prompts/budget_max_abs_rel_error"] = error.max().item()
            out["prompts/budget_mean_abs_rel_error"] = error.mean().item()
            out["prompts/over_budget_share"] = (self.kl > self.budgets).double().mean().item()
        return out


class IterationOutputs(TypedDict):
    """What ``training_step`` returns: callbacks receive it as ``outputs`` in ``on_train_batch_end``."""

    rollout: Trajectory
    kl: Tensor  # (batch, response_len), as in Scored
    scores: Optional[Tensor]  # r_RM per response, as the backend returned it
    metrics: dict[str, float]  # the iteration's logged metrics; empty for a skipped iteration
    skipped: bool  # skipped for a fault (non-finite reward or KL): no update, no metrics
    prompts: Optional[PromptStats]  # each prompt's KL and beta (with a prompt table); None when skipped
