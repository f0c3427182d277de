"""Built-in advantage estimators: GAE on a learned critic, and the critic-free group and batch baselines.

Every estimator reads the per-token rewards R_t = r_RM * 1[t = T] - beta * kl_t (the KL term only when
``kl_penalty`` puts it in the reward). The critic-free ones score a response by its return
R = sum_t R_t = r_RM - beta * sum_t kl_t, so with the KL in the reward the baseline is taken on that
KL-penalised return, and every token of the response gets the response's advantage.
"""

from __future__ import annotations

from rlhf_lightning import ppo_math as pm
from rlhf_lightning.interfaces import AdvantageEstimator, require_number
from rlhf_lightning.registry import register


@register("advantage_estimator", "gae", description="GAE(gamma, lambda) on the critic's values (PPO; the default)")
class GAE(AdvantageEstimator):
    """Generalised advantage estimation (Schulman et al. 2016) on the critic's V(s_t):
    delta_t = R_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lambda A_{t+1}; value targets A + V."""

    needs_critic = True
    whiten = True

    def __init__(self, gamma: float = 1.0, lam: float = 0.95) -> None:
        for name, value in (("gamma", gamma), ("lam", lam)):
            require_number(f"advantage_estimator.{name}", value, at_least=0, at_most=1)
        self.gamma, self.lam = gamma, lam

    def __call__(self, rewards, mask, values, group_size, sum_fn=None):
        return pm.gae(rewards, values, mask, self.gamma, self.lam)


class _GroupBaseline(AdvantageEstimator):
    """A response's advantage against its group's baseline (``ppo_math.group_advantages`` with
    ``baseline`` and ``scale``), on its return R = sum_t R_t, the same at every real token."""

    min_group_size = 2
    baseline, scale, eps = "mean", False, 1e-6

    def __call__(self, rewards, mask, values, group_size, sum_fn=None):
        returns = pm.masked_select(rewards, mask).sum(-1)
        advantages = pm.group_advantages(returns, group_size, self.baseline, scale=self.scale, eps=self.eps)
        return advantages.unsqueeze(-1).to(mask.dtype) * mask, None

    def gradient_scale(self, rewards, mask, group_size, sum_fn=None):
        """A group-mean baseline contains R_i itself: E[s_i (R_i - mean_g R)] = (n - 1) / n E[s_i R_i]
        (leave-one-out is unbiased: 1). GRPO's division by the group std is not carried over: a group
        of identical responses (std 0) would weigh its KL a million times beta; with it the fixed
        point is not the KL-regularised optimum, which args.check_across_groups warns of."""
        factor = 1.0 if self.baseline == "leave_one_out" else (group_size - 1) / group_size
        return rewards.new_full((rewards.shape[0],), factor)


@register("advantage_estimator", "grpo", description="group mean and std baseline, no critic (GRPO)")
class GRPO(_GroupBaseline):
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (R_i - mean_g R) / (std_g R + eps) over the
    ``num_generations`` responses to one prompt, the same at every token of response i."""

    scale = True

    def __init__(self, eps: float = 1e-6) -> None:
        require_number("advantage_estimator.eps", eps, above=0)
        self.eps = eps


@register("advantage_estimator", "dr_grpo", description="group mean baseline, constant token normaliser (Dr. GRPO)")
class DrGRPO(_GroupBaseline):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): A_i = R_i - mean_g R, no
    std division, and the policy loss summed over tokens and divided by a constant
    (responses * max_new_tokens) instead of each minibatch's token count, so that a response's
    length does not change its tokens' weight."""

    loss_aggregation = "constant"  # the registered aggregation, with its default normaliser max_new_tokens


@register("advantage_estimator", "rloo", description="leave-one-out group baseline, no critic (RLOO)")
class RLOO(_GroupBaseline):
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024):
    A_i = R_i - 1/(n-1) sum_{j != i} R_j, an unbiased baseline for each response."""

    baseline = "leave_one_out"


@register("advantage_estimator", "reinforce", description="the return-to-go itself: no baseline, no critic (vanilla REINFORCE)")
class Reinforce(AdvantageEstimator):
    """REINFORCE without a baseline (Williams 1992): A_t = G_t = sum_{s >= t} gamma^(s-t) R_s.
    Unbiased and high-variance; the reference point for the baselines above, and the estimator
    under which a loss aggregation's length bias shows plainly (tools/studies/length_bias.py)."""

    def __init__(self, gamma: float = 1.0) -> None:
        require_number("advantage_estimator.gamma", gamma, at_least=0, at_most=1)
        self.gamma = gamma

    def __call__(self, rewards, mask, values, group_size, sum_fn=None):
        return pm.reward_to_go(rewards, mask, self.gamma), None


@register(
    "advantage_estimator",
    "reinforce_pp",
    aliases=("reinforce++",),
    description="return-to-go whitened over the global batch, no critic (REINFORCE++)",
)
class ReinforcePlusPlus(AdvantageEstimator):
    """REINFORCE++ (Hu 2025): G_t = sum_{s >= t} gamma^(s-t) R_s, whitened over every real token of
    the global batch (all ranks): A_t = (G_t - mean G) / std G. Needs no groups."""

    def __init__(self, gamma: float = 1.0) -> None:
        require_number("advantage_estimator.gamma", gamma, at_least=0, at_most=1)
        self.gamma = gamma

    def __call__(self, rewards, mask, values, group_size, sum_fn=None):
        return pm.masked_whiten(pm.reward_to_go(rewards, mask, self.gamma), mask, sum_fn=sum_fn), None

    def gradient_scale(self, rewards, mask, group_size, sum_fn=None):
        """1 / the batch std the whitening divides by (its mean shift is a baseline: unbiased to first order)."""
        return (1 / pm.whitening_divisor(pm.reward_to_go(rewards, mask, self.gamma), mask, sum_fn)).expand(rewards.shape[0])
