"""The closed-form lab: toy tasks small enough to enumerate every response, where the KL-regularised
optimum is known exactly and PPO can be measured against it.

One idea per file, each importing only the files above it in this list:

- :mod:`~rlhf_lightning.exact.tabular`: tabular policies (one logit vector per prefix) and sums over response trees
  (fixed-length, or ending at EOS: the tree over K + 1 symbols);
- :mod:`~rlhf_lightning.exact.f_divergence`: the optimum of every f-divergence (``model.divergence``), its J*_f and
  the exact D_f of a policy;
- :mod:`~rlhf_lightning.exact.closed_form`: pi*, J*, the per-token fixed point, where a length-weighted loss settles,
  where a controller's unit rests, and the distances to them;
- :mod:`~rlhf_lightning.exact.frontier`: the reward-KL plane, best-of-N, and the distance to pi* from samples;
- :mod:`~rlhf_lightning.exact.meter`: :class:`KLToOptimum`, that distance measured during a real run;
- :mod:`~rlhf_lightning.exact.tasks`: the enumerable tasks and the tiny network PPORLHF trains on them;
- :mod:`~rlhf_lightning.exact.training`: the sampled loop, its exact expectation and PPO on a table.

The framework never imports this package; the command does (``class_path: KLToOptimum``).
"""

from rlhf_lightning.exact.closed_form import (
    OptimumReport,
    backward_induction,
    controller_beta,
    ema_reference_logprobs,
    expected_reward,
    iterated_optimal_logprobs,
    kl_divergence,
    length_report,
    log_partition,
    objective,
    optimal_logprobs,
    optimal_objective,
    optimum_report,
    per_token_residuals,
    prompt_betas,
    prompt_kls,
    weighted_fixed_point,
)
from rlhf_lightning.exact.f_divergence import (
    divergence_label,
    divergence_named,
    divergence_objective,
    divergence_optimal_logprobs,
    divergence_optimal_objective,
    divergence_value,
)
from rlhf_lightning.exact.meter import KLToOptimum
from rlhf_lightning.exact.tabular import enumerate_responses
from rlhf_lightning.exact.tasks import (
    BANNED_LOGIT,
    EXACT_TINY_CONFIG,
    SPECIAL_TOKENS,
    TASKS,
    ExactPPORLHF,
    ExactTask,
    MaskedHead,
    PositionEmbedding,
    order_reward,
    per_token_fixed_point_gap,
    reference_logprobs,
    target_count,
    task_named,
    toy_tokenizer,
)
from rlhf_lightning.exact.training import (
    LinearLRDecay,
    OptimumTracker,
    documented_optimum,
    expected_train,
    lr_factor,
    sampled_ppo,
    train,
)

__all__ = [
    "BANNED_LOGIT",
    "EXACT_TINY_CONFIG",
    "SPECIAL_TOKENS",
    "TASKS",
    "ExactPPORLHF",
    "ExactTask",
    "KLToOptimum",
    "LinearLRDecay",
    "MaskedHead",
    "OptimumReport",
    "OptimumTracker",
    "PositionEmbedding",
    "backward_induction",
    "controller_beta",
    "divergence_label",
    "divergence_named",
    "divergence_objective",
    "divergence_optimal_logprobs",
    "divergence_optimal_objective",
    "divergence_value",
    "documented_optimum",
    "ema_reference_logprobs",
    "enumerate_responses",
    "expected_reward",
    "expected_train",
    "iterated_optimal_logprobs",
    "kl_divergence",
    "length_report",
    "log_partition",
    "lr_factor",
    "objective",
    "optimal_logprobs",
    "optimal_objective",
    "optimum_report",
    "order_reward",
    "per_token_fixed_point_gap",
    "per_token_residuals",
    "prompt_betas",
    "prompt_kls",
    "reference_logprobs",
    "sampled_ppo",
    "target_count",
    "task_named",
    "toy_tokenizer",
    "train",
    "weighted_fixed_point",
]
