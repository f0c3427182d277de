"""The KL theory in code: which recipe (estimator, placement, weighting, scope, loss aggregation) reaches
which optimum, and which correction of stale samples is exact (docs/kl-estimators.md, "Which recipe reaches
which optimum" and "Stale samples"). One table each, read from the plugins' declared properties: the start-up
warnings (:func:`kl_recipe_warning`, :func:`off_policy_warning`, raised by ``args.check_across_groups``),
``tools/studies/optimum_check.py``'s expected classes and the docs' matrices (``tests/test_args.py``) are
checked against them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from rlhf_lightning.interfaces import KLEstimator, LossAggregation

if TYPE_CHECKING:
    from rlhf_lightning.args import KLArgs, PPOArgs

LENGTH_WEIGHTED_AGGREGATIONS = ("seq_mean_token_mean",)  # weigh each response by 1 / its length


def aggregation_name(aggregation: LossAggregation) -> str:
    """The name :func:`kl_recipe` reads for a loss aggregation: its ``ppo_math.aggregation_weights`` mode, else its class's name."""
    return getattr(aggregation, "mode", type(aggregation).__name__)


def kl_recipe(
    estimator: KLEstimator, placement: str, weighting: str, scope: str = "sequence", aggregation: str = "token_mean"
) -> tuple[str, str]:
    """The class of a KL recipe (docs/kl-estimators.md, "Which recipe reaches which optimum"), with
    why, read from the estimator's properties (``KLEstimator``): the one table the start-up warning,
    ``tools/studies/optimum_check.py``'s expected classes and the docs' matrix (``tests/test_kl_loss_scope.py``)
    are checked against. With s = grad log pi:

    ``unbiased``: the whole response's KL gradient at every minibatch of every epoch (converges to pi*).
    ``per_token``: grad KL(pi(.|s) || pi_ref(.|s)) at each visited state, without the KL still to come
    after the token (converges to ``exact.closed_form.backward_induction(soft=False)``).
    ``drift``: right on a rollout's first minibatch only (an unweighted token-dependent term
    evaluated at pi_theta on pi_old's tokens).
    ``biased``: wrong even on-policy.
    ``high_variance``: ``both`` with an estimator that reads the sampled token (k1, k3): the expected gradient is
    the KL's (``exact.training.expected_train`` reaches pi*), but the loss carries k's pathwise gradient at the sampled token
    (k3: (1 - pi_ref / pi) grad log pi; k1: grad log pi, zero in expectation) with no baseline, and its noise moves
    the policy where a batch is small against the policy's distance from the reference (docs/kl-estimators.md,
    "Responses of different lengths"). ``full`` in ``both`` has no sampled value.
    ``length_weighted``: a KL in the loss (or ``both``) aggregated with a weight per response that depends on its
    length (``seq_mean_token_mean``: 1 / |y|): on responses of different lengths a short response's tokens weigh
    more, and the policy settles at ``exact.closed_form.weighted_fixed_point`` instead (the KL in the reward has pi* at
    every aggregation: there the whole return is the same for every response at pi*, so every token's
    advantage is 0 whatever weighs it; docs/kl-estimators.md, "Responses of different lengths").

    reward: PPO follows E[s_t sum_{t'>=t} k_t']: the KL's gradient for an estimator whose score-function
    gradient is the KL's (k1). loss, none: E_old[grad k]: right per token where the pathwise gradient is
    the KL's (k2, k3+, k1+, full). importance (and both): E_old[w (k s + grad k)] = grad E_theta[k]: right
    for an unbiased value whose gradient is its derivative (k1, k3, full). An estimator that ignores the
    sampled token (full) takes no ratio and is right either way."""
    if estimator.truncation is not None:  # a top k of a forward or reverse KL: not the gradient that reaches pi*
        return "biased", truncation_recipe(estimator)[1]
    if placement == "reward":
        if estimator.unbiased_as_reward:
            return "unbiased", ""
        return (
            "biased",
            "as a per-token reward only a score-function gradient reaches the policy, and this estimator's is not the KL's (k1's is)",
        )
    if not estimator.reads_sampled_token():
        token, reason = "unbiased", ""
    elif (placement, weighting) == ("loss", "none"):
        token = "drift" if estimator.pathwise_gradient_unbiased() else "biased"
        reason = "unweighted in the loss its pathwise gradient is not the KL's (k1's is zero in expectation, k3's the forward KL's)"
    elif not estimator.gradient_follows_value():
        token, reason = "biased", "its gradient is not the derivative of its value (a straight-through estimator such as k3+ already "
        reason += "carries the score-function term k * grad log pi that the importance ratio's gradient or the reward adds: counted twice)"
    elif not estimator.unbiased_value:
        token, reason = "biased", "its value is not an unbiased per-token KL, and the weighted term follows the gradient of its expectation"
    else:
        token, reason = ("drift" if weighting == "none" else "unbiased"), ""
    if placement == "loss" and scope == "per_token" and token == "unbiased":
        token = "per_token"
    if token in ("unbiased", "per_token") and aggregation in LENGTH_WEIGHTED_AGGREGATIONS:
        return "length_weighted", (
            f"the loss aggregation {aggregation} divides each response's loss by its length, the KL's with it: on responses of "
            "different lengths a short response's tokens weigh more than a long one's"
        )
    if token == "unbiased" and placement == "both" and estimator.reads_sampled_token():
        return "high_variance", (
            "its expected gradient is the KL's, but the loss carries its pathwise gradient at each sampled token (k3's is "
            "(1 - pi_ref / pi) grad log pi, k1's grad log pi) with no baseline, and that noise moves the policy"
        )
    return token, reason if token == "biased" else ""


def kl_recipe_warning(estimator: KLEstimator, kl: KLArgs, ppo: PPOArgs, aggregation: str, max_new_tokens: int) -> Optional[str]:
    """The start-up warning of a KL recipe (:func:`kl_recipe`) that does not reach the KL-regularised optimum,
    naming the settings and what to use instead; None for the others, and for ``drift`` where every rollout
    makes one step (always on-policy) and ``length_weighted`` where every response has one token."""
    if estimator.truncation is not None:
        return truncation_warning(estimator)
    recipe, reason = kl_recipe(estimator, kl.placement, kl.loss_weighting, kl.loss_scope, aggregation)
    name = type(estimator).__name__
    if recipe == "length_weighted" and max_new_tokens > 1:
        return (
            f"model.loss_aggregation {aggregation} with model.kl.placement {kl.placement}: {reason}, so where responses end at "
            "EOS the policy converges away from the KL-regularised optimum (to exact.closed_form.weighted_fixed_point; docs/kl-estimators.md, "
            "'Responses of different lengths'). Use model.loss_aggregation token_mean, seq_mean_token_sum or constant, or the KL in the reward."
        )
    if recipe == "high_variance":
        return (
            f"model.kl_estimator {name} with model.kl.placement both: {reason}; with a batch that is small "
            "against how far the policy moves from the reference it lands away from the KL-regularised optimum (docs/kl-estimators.md, "
            "'Responses of different lengths'). Use full in both, k1 in the reward, or k3 in the loss."
        )
    if recipe == "biased":
        weighting = f", model.kl.loss_weighting {kl.loss_weighting}" if kl.placement != "reward" and estimator.reads_sampled_token() else ""
        return (
            f"model.kl_estimator {name} with model.kl.placement {kl.placement}{weighting} gives a biased gradient "
            f"of the KL: {reason}; the policy converges away from the KL-regularised optimum (docs/kl-estimators.md, 'Which recipe "
            "reaches which optimum'). Use k1 in the reward, or k3 (or full) in the loss with model.kl.loss_weighting: importance."
        )
    if recipe == "drift" and ppo.epochs * ppo.num_minibatches > 1:
        return (
            f"model.kl_estimator {name} in the loss with model.kl.loss_weighting none is right only on a "
            f"rollout's first minibatch: with model.ppo.epochs {ppo.epochs} x model.ppo.num_minibatches {ppo.num_minibatches} the later "
            "steps take its gradient at pi_theta on pi_old's tokens and drift from the KL's. Use model.kl.loss_weighting: importance."
        )
    return None


def direction_of(estimator: KLEstimator) -> str:
    """``forward`` (KL(pi_ref || pi)) for an estimator over the teacher's top k, ``reverse`` (KL(pi || pi_ref)) for every other."""
    truncation = estimator.truncation
    return "forward" if truncation is not None and truncation.of == "teacher" else "reverse"


def truncation_recipe(estimator: KLEstimator) -> tuple[str, str]:
    """The class of a truncated-support estimator (``KLEstimator.truncation``; docs/divergences.md, "Truncated
    support: top-k") against the full-vocabulary KL of its direction (:func:`direction_of`), with why; the one table
    the start-up warning, the lab's rows (``tests/test_topk.py``) and the docs' table are checked against.

    ``exact``: k >= V - 1 with the tail, k >= V otherwise (V is not known at start-up: a top k is classed as if k < V).
    ``approximate``: a divergence of two distributions derived from both (the (k+1)-symbol coarsenings with the tail,
    the restrictions to S renormalised, the generalised KL of the unnormalised masses on S): >= 0, 0 at the teacher,
    so with a reward of 0 the teacher is a minimum; but the mass outside S is not pulled toward the teacher's, so
    training lands where the start left it, and with a reward pi* is not a fixed point.
    ``biased``: the plain truncated sum is negative wherever the other distribution has more mass on S: the teacher
    renormalised on its top k is the forward sum's minimum (every other token's mass driven to 0), the student's
    sum falls by moving its mass out of its own top k (the entropy rises); clamped at 0 it has no gradient wherever
    that happens; renormalised at k = 1 it is identically 0."""
    t = estimator.truncation
    if t is None:
        return "exact", ""
    if t.renormalise and t.k == 1:
        return "biased", "renormalised on one token both distributions are 1 there: the value and its gradient are identically 0"
    if t.tail or t.renormalise or t.generalised:
        what = "the (k+1)-symbol coarsenings (the tail as one symbol)" if t.tail else "the restrictions to the top k, renormalised"
        what = "the unnormalised masses on the top k (the generalised KL)" if t.generalised else what
        return "approximate", (
            f"a KL of {what}: 0 at the teacher, but the mass outside the top k is not pulled toward the teacher's, so training "
            "lands away from the optimum where the start puts it elsewhere, and with a reward pi* is not a fixed point"
        )
    sign = (
        "the teacher's top-k sum is negative where the student has more mass there, its minimum the teacher renormalised on its top k"
        if t.of == "teacher"
        else "the student's top-k sum is negative where the teacher has more mass there, and falls as the student moves mass out of its top k"
    )
    return "biased", sign + ("; clamped at 0 it gives no gradient wherever that happens" if t.clamp else "")


def truncation_warning(estimator: KLEstimator) -> Optional[str]:
    """The start-up warning of a truncated-support estimator that is not exact (:func:`truncation_recipe`), None for the others."""
    recipe, reason = truncation_recipe(estimator)
    if recipe == "exact" or estimator.truncation is None:
        return None
    t = estimator.truncation
    objective = "KL(pi_ref || pi), the forward KL" if t.of == "teacher" else "KL(pi || pi_ref), the reverse KL"
    return (
        f"model.kl_estimator {type(estimator).__name__} (top {t.k} of the {t.of}) is {recipe} against {objective} over the whole "
        f"vocabulary: {reason} (docs/divergences.md, 'Truncated support: top-k'). Use full for the exact reverse KL, "
        "topk_forward_tail with k >= V - 1 for the exact forward KL, or k3+ in the loss (the sampled token's)."
    )


def off_policy_recipe(correction: str, max_staleness: int) -> tuple[str, str]:
    """The class of a correction for stale samples (docs/kl-estimators.md, "Stale samples"), with why: the one table
    the start-up warning, ``tools/studies/optimum_check.py --max-staleness`` and the docs' table are checked against.
    Samples y ~ mu (the weights of up to ``max_staleness`` updates ago), the PPO ratio's anchor and the KL's values
    pi_prox (the current weights at consumption); every recipe's on-policy class (:func:`kl_recipe`) is that of
    expectations under pi_prox, so what a correction must do is turn E_mu into E_prox:

    ``on_policy``: ``max_staleness`` 0, mu = pi_prox (nothing to correct).
    ``exact``: ``sequence``: every term of the response (policy loss, KL in the loss with its sequence term, the
    returns that carry k1 or a divergence's f'(u)) weighed by W = pi_prox(y|x) / mu(y|x), and E_mu[W f(y)] = E_prox[f(y)]
    for any f: the expected gradient is the synchronous loop's, for every placement, estimator and scope (the exact
    lab's stale path equals the synchronous one, ``tests/test_off_policy.py``). Truncated at the cap, E_mu[min(W, c) f]
    = E_prox[min(1, c / W) f]: exact where no response's W exceeds c; ``off_policy/clipped_fraction`` reads how often.
    ``approximate``: ``token``, and the sampler-side trust regions (``icepop``, ``ipo``, ``m2po``: ``trust_regions``, the
    token's weight inside the region, 0 outside; at the fixed point mu = pi_prox every token is inside). ``token``: w_t = pi_prox(y_t|s_t) / mu(y_t|s_t) turns the token drawn at each visited state into
    pi_prox's, but the states are mu's (the prefix's ratio is dropped) and so is the continuation after the token (the
    return, the KL still to come): a bias of the order of how far pi moved in k updates. The fixed point is pi* all the
    same (where pi stops moving mu = pi_prox).
    ``biased``: ``none``: the expectation is mu's with pi_prox's scores and ratios; each step's gradient is neither grad
    J at pi_prox nor at mu. pi* is still the only fixed point (there mu = pi_prox), but stale steps can overshoot and
    oscillate (k3 in the loss at staleness 4 on random:3: 0.90 from J* after 60 exact iterations, 0.0007 with a correction)."""
    if max_staleness == 0:
        return "on_policy", ""
    if correction == "sequence":
        return "exact", ""
    if correction in ("icepop", "ipo", "m2po"):
        return "approximate", (
            f"the {correction} trust region weighs each token by pi_prox / mu inside it and drops the tokens outside it: the "
            "states and the continuation stay mu's, and a dropped token's gradient is lost while mu is far from pi_prox; "
            "a sampler whose numerics stay off keeps dropping them and lands off pi* (docs/async.md, 'Sampler-side trust regions')"
        )
    if correction == "token":
        return "approximate", (
            "the per-token weight pi_prox / mu corrects the token drawn at each state, not which states mu visits nor the "
            "continuation after the token (the return, the KL still to come)"
        )
    return "biased", (
        "without a weight every expectation is over the stale policy mu's responses while the scores, the PPO ratio and the "
        "KL's values are pi_prox's: each step's gradient is neither that of J at the current weights nor at mu's"
    )


def off_policy_warning(correction: str, max_staleness: int) -> Optional[str]:
    """The start-up warning of a stale recipe that is not exact (:func:`off_policy_recipe`), None for the others."""
    recipe, reason = off_policy_recipe(correction, max_staleness)
    if recipe not in ("approximate", "biased"):
        return None
    return (
        f"model.off_policy.correction {correction} with model.off_policy.max_staleness {max_staleness} is {recipe}: {reason}; "
        "pi* stays the fixed point, but each step follows another gradient and stale steps can overshoot (docs/kl-estimators.md, "
        "'Stale samples'). Use model.off_policy.correction: sequence (exact, truncated at model.off_policy.correction_cap)."
    )
