"""The regulariser's terms: the per-token KL estimate on the positions it covers, the divergence's sequence-level
penalty, and the KL as a term of the policy's loss (``model.kl.placement`` loss or both; docs/kl-estimators.md)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rlhf_lightning import ppo_math as pm
from rlhf_lightning.args import KLArgs
from rlhf_lightning.interfaces import Divergence, KLEstimator
from rlhf_lightning.trajectory import Trajectory


class Regulariser:
    """The KL estimator and the divergence with the KL settings: which positions the KL covers (the response mask
    less the tokens of ``kl.ignore_tokens``, whose ids are ``ignore_ids``), its value per token and per response,
    and its loss term. Every tensor of a response is (batch, response_len)."""

    def __init__(self, kl_estimator: KLEstimator, divergence: Divergence, kl: KLArgs, ignore_ids: Tensor) -> None:
        self.kl_estimator, self.divergence, self.kl, self.ignore_ids = kl_estimator, divergence, kl, ignore_ids
        self.reads_sampled_token = kl_estimator.reads_sampled_token()

    def kl_mask(self, response: Tensor, mask: Tensor) -> Tensor:
        """The response mask without the positions of ``kl.ignore_tokens``."""
        if not len(self.ignore_ids):
            return mask
        return mask * ~torch.isin(response, self.ignore_ids.to(response.device))

    def kl_per_token(self, rollout: Trajectory, to_initial: bool = False) -> Tensor:
        """The penalised per-token KL estimate, zero off the KL mask; with ``to_initial`` the same estimate against the
        starting policy (a moving or foreign reference only); of the trainer's pi_old (a rollout correction weighs its
        reward through the policy loss)."""
        ref_logprobs, ref_logits = (
            (rollout.initial_logprobs, rollout.initial_logits) if to_initial else (rollout.ref_logprobs, rollout.ref_logits)
        )
        kl = self.kl_estimator.checked(rollout.trainer_logprobs, ref_logprobs, rollout.old_logits, ref_logits)
        return pm.masked_select(kl, self.kl_mask(rollout.responses, rollout.response_mask))

    def divergence_terms(self, rollout: Trajectory, kl: Tensor) -> tuple[Optional[Tensor], Tensor]:
        """``(penalty, value)`` per response (batch,): the sequence-level penalty f'(u) (None for the reverse KL, whose
        penalty is the per-token ``kl``) and the divergence's value from this sample, f(u) / u (its batch mean
        estimates D_f: ``objective/divergence``; the reverse KL's is the KL estimate's sum, ``objective/kl``), with
        log u = sum_t log pi_old(y_t) - log pi_ref(y_t) over the response, in float64."""
        if self.divergence.per_token:
            return None, kl.sum(-1)
        log_u = pm.masked_select(rollout.trainer_logprobs.double() - rollout.ref_logprobs.double(), rollout.response_mask).sum(-1)
        return self.divergence.f_prime(log_u), self.divergence.value(log_u)

    def nonfinite(self, kl: Tensor, penalty: Optional[Tensor], betas: Tensor) -> Optional[str]:
        """Why the penalty is not finite, naming the responses and their betas (``betas``, (batch,)): the per-token
        ``kl`` estimate, or the sequence-level ``penalty`` beta f'(u) as the reward holds it (``kl``'s dtype), so that a
        u finite in float64 but past float32's range (chi2: log u > 88 + log(1 / 2 beta)) is not a silent inf; None
        when both are finite."""
        if not torch.isfinite(kl).all():
            bad = (~torch.isfinite(kl)).any(-1).nonzero().flatten().tolist()
            fault = f"the {type(self.kl_estimator).__name__} KL estimate is not finite for responses {bad}: {kl.sum(-1)[bad].tolist()}"
        elif penalty is not None and not (finite := torch.isfinite(penalty.to(kl.dtype))).all():
            bad = (~finite).nonzero().flatten().tolist()
            fault = (
                f"the {type(self.divergence).__name__} penalty beta f'(u) is not finite in the reward's {kl.dtype} "
                f"for responses {bad}: {penalty[bad].tolist()}"
            )
        elif penalty is None and not (finite := torch.isfinite(betas.to(kl.device, kl.dtype).unsqueeze(-1) * kl).all(-1)).all():
            bad = (~finite).nonzero().flatten().tolist()  # a beta so large that beta * kl_t overflows the reward's dtype
            fault = f"the penalty beta * kl_t is not finite in the reward's {kl.dtype} for responses {bad}: KL {kl.sum(-1)[bad].tolist()}"
        else:
            return None
        bad_betas = sorted(set(betas[bad].tolist()))  # one beta, or each bad row's prompt's
        return fault + f" (beta {bad_betas[0] if len(bad_betas) == 1 else bad_betas})"

    def loss_term(self, rollout: Trajectory, idx: Tensor, logprobs: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        """The KL's per-token loss term on the rows ``idx`` from the policy's current ``logprobs`` and ``logits``, and
        the KL mask it covers: the estimator (importance-weighted over PPO epochs where it reads the sampled token,
        ``kl.loss_weighting``), plus with the sequence scope the KL still to come after each token
        (``ppo_math.kl_to_go_loss``, a group baseline on its score terms)."""
        old_logprobs, ref_logprobs = rollout.old_logprobs[idx], rollout.ref_logprobs[idx]
        ref_logits = rollout.ref_logits[idx] if rollout.ref_logits is not None else None
        kl_mask = self.kl_mask(rollout.responses[idx], rollout.response_mask[idx])
        kl = pm.masked_select(self.kl_estimator(logprobs, ref_logprobs, logits, ref_logits), kl_mask)
        kl_loss = kl
        # The ratio corrects the sampling of y_t (full sums over the vocabulary: none); its gradient
        # only where no reward carries k's score term.
        if self.kl.loss_weighting == "importance" and self.reads_sampled_token:
            ratio_gradient, baseline = self.kl.placement == "loss", self.kl_estimator.score_baseline
            kl_loss = pm.importance_weighted_kl(kl, logprobs, old_logprobs, kl_mask, ratio_gradient, baseline)
        # The KL still to come after each token from the log-ratio's values (unbiased, light-tailed; full's exact
        # ones), a group baseline on the KL's score terms. 'both': in the returns.
        if self.kl.placement == "loss" and self.kl.loss_scope == "sequence":
            values = pm.masked_select(logprobs - ref_logprobs, kl_mask) if self.reads_sampled_token else kl
            kl_loss = kl_loss + pm.kl_to_go_loss(logprobs, old_logprobs, values, kl_mask, groups=pm.group_ids(rollout.prompts, idx))
        return kl_loss, kl_mask
