"""The module's arguments: its plugins built from their names, and every check of a setting,
all before any model loads. ``PPORLHF.__init__`` calls :func:`build_plugins` then
:func:`check_arguments`; each refusal is a ConfigError naming the field (``model.lr``) and what
it must be. The arguments themselves are documented on ``PPORLHF``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Optional

from lightning.pytorch.utilities import rank_zero_warn

from rlhf_lightning import cpu
from rlhf_lightning.checks import finite_number, require, require_number
from rlhf_lightning.interfaces import KLEstimator, LossAggregation
from rlhf_lightning.registry import registry

# Arguments that name plugins: built here, kept out of the saved hyperparameters (the config
# file has them as written; checkpoints store each plugin's class path and state instead).
PLUGIN_ARGUMENTS = {
    "reward_model": "reward_model",
    "kl_estimator": "kl_estimator",
    "beta_controller": "beta_controller",
    "advantage_estimator": "advantage_estimator",
    "policy_loss": "policy_loss",
    "loss_aggregation": "loss_aggregation",
    "entropy_controller": "beta_controller",
    "gold_reward_model": "reward_model",
    "reference_update": "reference_update",
    "rollout_engine": "rollout_engine",
}
FINITE = (
    "temperature",
    "top_p",
    "rollout_correction_cap",
    "cliprange_value",
    "vf_coef",
    "lr",
    "critic_lr",
    "weight_decay",
    "max_grad_norm",
    "lora_alpha",
    "entropy_coef",
)
AT_LEAST_ONE = ("ppo_epochs", "num_minibatches", "gradient_accumulation_steps", "max_prompt_length", "max_consecutive_faults")
AT_LEAST_ZERO = ("log_samples_every_n_steps", "num_logged_samples")  # 0: no sample table
# Below this temperature a group's responses are mostly one and the same (the sampler all but argmax).
GREEDY_TEMPERATURE = 0.1
CHOICES = {
    "kl_penalty": ("reward", "loss", "both"),
    "kl_loss_weighting": ("none", "importance"),
    "kl_loss_scope": ("sequence", "per_token"),
    "old_logprobs": ("sampler", "forward"),
    "cpu_malloc": ("tuned", "default"),
    "special_tokens_in_prompts": ("refuse", "allow"),
    "optimizers": ("separate", "shared"),
    "rollout_correction": ("none", "tis", "mis", "seq_tis", "seq_mis"),
}


def build_plugins(args: dict[str, Any]) -> dict[str, Any]:
    """Every plugin argument as an instance (unknown names fail here, naming the field and the
    registered choices): ``entropy_coef`` becomes a fixed entropy controller, and a null
    ``loss_aggregation`` the one the policy loss or advantage estimator is defined with."""

    def build(name: str):
        return registry(PLUGIN_ARGUMENTS[name]).build(args[name], f"model.{name}")

    plugins = {name: build(name) for name in ("reward_model", "kl_estimator", "beta_controller", "advantage_estimator", "policy_loss")}
    plugins["loss_aggregation"] = _loss_aggregation(args["loss_aggregation"], plugins)
    coef = args["entropy_coef"]
    require_number("model.entropy_coef", coef, at_least=0)
    require(not (coef and args["entropy_controller"] is not None), "model.entropy_coef", "0 when model.entropy_controller is set", coef)
    if args["entropy_controller"] is not None:
        plugins["entropy_controller"] = build("entropy_controller")
    else:
        plugins["entropy_controller"] = registry("beta_controller").get("fixed")(init_beta=coef, unit="token_mean") if coef else None
    plugins["gold_reward_model"] = None if args["gold_reward_model"] is None else build("gold_reward_model")
    plugins["reference_update"] = build("reference_update")
    plugins["rollout_engine"] = build("rollout_engine")
    return plugins


def _loss_aggregation(spec: Optional[LossAggregation | str], plugins: dict[str, Any]) -> LossAggregation:
    """``model.loss_aggregation``, or (null) the one the policy loss or the advantage estimator
    is defined with, else token_mean; two different such preferences must be settled by the user."""
    policy_loss, estimator = plugins["policy_loss"], plugins["advantage_estimator"]
    if spec is None:
        preferred = {p for p in (policy_loss.loss_aggregation, estimator.loss_aggregation) if p}
        require(
            len(preferred) <= 1,
            "model.loss_aggregation",
            f"set when model.policy_loss {type(policy_loss).__name__} and model.advantage_estimator "
            f"{type(estimator).__name__} are defined with different aggregations",
            sorted(preferred),
        )
        spec = preferred.pop() if preferred else "token_mean"
    return registry("loss_aggregation").build(spec, "model.loss_aggregation")


def check_arguments(args: dict[str, Any], plugins: dict[str, Any]) -> dict[str, Any]:
    """Refuse impossible settings and combinations; warn of biased KL recipes. Returns the settings
    resolved from the plugins (``critic``, ``whiten_advantages``), stored resolved so that
    checkpoints and the resume check see what was built."""
    a = SimpleNamespace(**args)
    advantage, kl_estimator = plugins["advantage_estimator"], plugins["kl_estimator"]
    for name, choices in CHOICES.items():
        requirement = f"'{choices[0]}' or '{choices[1]}'" if len(choices) == 2 else "one of " + ", ".join(choices)
        require(args[name] in choices, f"model.{name}", requirement, args[name])
    # Whitening divides the advantages (the reward's gradient, and with 'both' the reward's part
    # of the KL's) by their std; a KL loss term is not divided, so beta would no longer weigh the
    # KL against the reward as configured (docs/kl-estimators.md).
    require(
        a.kl_penalty == "reward" or not a.whiten_advantages,
        "model.whiten_advantages",
        "false when the KL is in the loss (kl_penalty: loss or both): whitening rescales the advantages but not the KL loss term",
        a.whiten_advantages,
    )
    require(
        a.kl_penalty != "loss" or a.kl_loss_scope == "per_token" or kl_estimator.unbiased_value,
        "model.kl_loss_scope",
        f"'per_token' with model.kl_estimator {type(kl_estimator).__name__}, whose value is not an unbiased per-token KL "
        "(the KL still to come in the response cannot be estimated from it); or use k1, k3 or full",
        a.kl_loss_scope,
    )
    require(a.max_new_tokens >= 1, "model.max_new_tokens", ">= 1", a.max_new_tokens)
    require(0 <= a.min_new_tokens <= a.max_new_tokens, "model.min_new_tokens", "in [0, max_new_tokens]", a.min_new_tokens)
    for name in FINITE:  # YAML's .inf and .nan parse as floats: refuse them here, before any model loads
        require(args[name] is None or finite_number(args[name]), f"model.{name}", "a finite number", args[name])
    require(
        a.vf_coef >= 0 and a.weight_decay >= 0 and a.lora_alpha > 0,
        "model.vf_coef, weight_decay and lora_alpha",
        ">= 0, >= 0 and > 0",
        (a.vf_coef, a.weight_decay, a.lora_alpha),
    )
    require(a.max_grad_norm is None or a.max_grad_norm > 0, "model.max_grad_norm", "> 0 or null", a.max_grad_norm)
    require(
        a.matmul_precision in (None, "highest", "high", "medium"),
        "model.matmul_precision",
        "highest, high, medium or null",
        a.matmul_precision,
    )
    require(a.temperature > 0, "model.temperature", "> 0", a.temperature)
    require(0 < a.top_p <= 1, "model.top_p", "in (0, 1] (1: no nucleus truncation)", a.top_p)
    require(isinstance(a.top_k, int) and a.top_k >= 0, "model.top_k", "an integer >= 0 (0: no top-k truncation)", a.top_k)
    require(a.rollout_correction_cap >= 1, "model.rollout_correction_cap", ">= 1", a.rollout_correction_cap)
    require(
        a.rollout_correction == "none" or a.old_logprobs == "forward",
        "model.rollout_correction",
        "'none' unless model.old_logprobs is 'forward' (the correction weighs each token by pi_old / pi_sampler, pi_old from the trainer)",
        a.rollout_correction,
    )
    require(
        a.cpu_linear in ("auto", "aten") or (a.cpu_linear == "onednn" and cpu.onednn_available()),
        "model.cpu_linear",
        "'auto', 'aten', or 'onednn' where this torch build has oneDNN",
        a.cpu_linear,
    )
    for name in (*AT_LEAST_ONE, "num_generations"):
        require(args[name] >= 1, f"model.{name}", "an integer >= 1", args[name])
    require(a.cliprange_value > 0, "model.cliprange_value", "> 0", a.cliprange_value)
    require(a.lr > 0 and (a.critic_lr is None or a.critic_lr > 0), "model.lr and critic_lr", "> 0", (a.lr, a.critic_lr))
    estimator = type(advantage).__name__
    critic = a.critic or ("separate" if advantage.needs_critic else "none")
    require(critic in ("separate", "shared", "none"), "model.critic", "'separate', 'shared', 'none' or null", critic)
    require(
        (critic != "none") == advantage.needs_critic,
        "model.critic",
        f"{'separate or shared' if advantage.needs_critic else 'none'} with model.advantage_estimator {estimator}",
        critic,
    )
    require(
        critic != "none" or (a.critic_lr is None and a.optimizers == "separate"),
        "model.critic_lr and optimizers",
        "unset without a critic (model.critic: none)",
        (a.critic_lr, a.optimizers),
    )
    require(
        a.num_generations >= advantage.min_group_size,
        "model.num_generations",
        f">= {advantage.min_group_size} with model.advantage_estimator {estimator} (its baseline is taken over each prompt's responses)",
        a.num_generations,
    )
    require(a.lora_rank >= 0, "model.lora_rank", ">= 0", a.lora_rank)
    for name in AT_LEAST_ZERO:
        require(args[name] >= 0, f"model.{name}", "an integer >= 0", args[name])
    # A group baseline subtracts the mean of a prompt's responses: identical responses, identical
    # rewards, every advantage 0 and nothing learnt.
    require(
        a.do_sample or advantage.min_group_size < 2,
        "model.do_sample",
        f"true with model.advantage_estimator {estimator} (greedy decoding gives every response of a group the same text: "
        "every advantage is 0 and the policy never changes)",
        a.do_sample,
    )
    if advantage.min_group_size >= 2 and a.temperature < GREEDY_TEMPERATURE:
        rank_zero_warn(
            f"model.temperature {a.temperature} with model.advantage_estimator {estimator}: below {GREEDY_TEMPERATURE} the responses "
            "of a group are mostly identical, so are their rewards, and their advantages are 0 (nothing is learnt from them)"
        )
    recipe, reason = kl_recipe(kl_estimator, a.kl_penalty, a.kl_loss_weighting, a.kl_loss_scope)
    if recipe == "biased":
        weighting = (
            f", model.kl_loss_weighting {a.kl_loss_weighting}" if a.kl_penalty != "reward" and kl_estimator.reads_sampled_token() else ""
        )
        rank_zero_warn(
            f"model.kl_estimator {type(kl_estimator).__name__} with model.kl_penalty {a.kl_penalty}{weighting} gives a biased gradient "
            f"of the KL: {reason}; the policy converges away from the KL-regularised optimum (docs/kl-estimators.md, 'Which recipe "
            "reaches which optimum'). Use k1 in the reward, or k3 (or full) in the loss with kl_loss_weighting: importance."
        )
    if recipe == "drift" and a.ppo_epochs * a.num_minibatches > 1:
        rank_zero_warn(
            f"model.kl_estimator {type(kl_estimator).__name__} in the loss with model.kl_loss_weighting none is right only on a "
            f"rollout's first minibatch: with model.ppo_epochs {a.ppo_epochs} x model.num_minibatches {a.num_minibatches} the later "
            "steps take its gradient at pi_theta on pi_old's tokens and drift from the KL's. Use kl_loss_weighting: importance."
        )
    if a.kl_penalty != "reward" and getattr(advantage, "scale", False):
        rank_zero_warn(
            f"model.advantage_estimator {type(advantage).__name__} divides each prompt's advantages by its group's reward std "
            "and the KL loss term is not divided: beta weighs the KL against the reward differently for every prompt, so the "
            "policy converges away from the KL-regularised optimum. Use dr_grpo or rloo with the KL in the loss, or the KL in the reward."
        )
    whiten = a.whiten_advantages
    if whiten is None:  # the estimator's default, off whenever the KL is in the loss (see above)
        whiten = advantage.whiten and a.kl_penalty == "reward"
    return {"critic": critic, "whiten_advantages": whiten}


def kl_recipe(estimator: KLEstimator, placement: str, weighting: str, scope: str = "sequence") -> tuple[str, str]:
    """The class of a KL recipe (docs/kl-estimators.md, "Which recipe reaches which optimum"), with
    why, read from the estimator's properties (``KLEstimator``): the one table the start-up warning,
    ``tools/optimum_check.py``'s expected classes and the docs' matrix (``tests/test_kl_loss_scope.py``)
    are checked against. With s = grad log pi:

    ``unbiased``: the whole response's KL gradient at every minibatch of every epoch (converges to pi*).
    ``per_token``: grad KL(pi(.|s) || pi_ref(.|s)) at each visited state, without the KL still to come
    after the token (converges to ``exact.backward_induction(soft=False)``).
    ``drift``: right on a rollout's first minibatch only (an unweighted token-dependent term
    evaluated at pi_theta on pi_old's tokens).
    ``biased``: wrong even on-policy.

    reward: PPO follows E[s_t sum_{t'>=t} k_t']: the KL's gradient for an estimator whose score-function
    gradient is the KL's (k1). loss, none: E_old[grad k]: right per token where the pathwise gradient is
    the KL's (k2, k3+, k1+, full). importance (and both): E_old[w (k s + grad k)] = grad E_theta[k]: right
    for an unbiased value whose gradient is its derivative (k1, k3, full). An estimator that ignores the
    sampled token (full) takes no ratio and is right either way."""
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
        return "per_token", ""
    return token, reason if token == "biased" else ""


def check_setup(module, datamodule, stage: str) -> None:
    """At start-up, once the tokenizer is loaded and before any model is: the batch split; every
    prompt of the data module's files (special-token strings, rendered length, and each reward
    backend's own check: ``RewardModel.check_prompts``); an entropy target the policy can reach."""
    if stage == "fit" and getattr(datamodule, "batch_size", None):
        check_batch_split(datamodule.batch_size, module.hparams)
    for name in ("train_prompts", "val_prompts"):
        prompts, field = getattr(datamodule, name, None), f"data.{name.split('_')[0]}_path"
        if prompts:
            module.encode_prompts(prompts, field)
            for role in ("reward_model", "gold_reward_model"):
                if getattr(module, role) is not None:
                    getattr(module, role).check_prompts(prompts, field, f"model.{role}")
    controller, vocab = module.entropy_controller, len(module.tokenizer)
    if controller is not None and getattr(controller, "target", None) is not None:
        # The entropy of a distribution over V tokens is at most log V (uniform).
        per_response = controller.unit == "sequence_sum"
        most = math.log(vocab) * (module.hparams.max_new_tokens if per_response else 1)
        require(
            controller.target < most,
            "model.entropy_controller.init_args.target",
            f"< {most:.4g} nats per {'response (max_new_tokens x log V)' if per_response else 'token (log V)'} with the tokenizer's "
            f"V = {vocab} tokens (no policy's entropy is higher: the coefficient would only grow)",
            controller.target,
        )


def check_batch_split(batch_size: int, hparams) -> None:
    """Each rank's rollout (``batch_size`` prompts x ``num_generations``) splits evenly into minibatches and micro-batches."""
    parts = hparams.num_minibatches * hparams.gradient_accumulation_steps
    require(
        batch_size * hparams.num_generations % parts == 0,
        "data.batch_size * model.num_generations",
        f"divisible by model.num_minibatches * model.gradient_accumulation_steps = {hparams.num_minibatches} * "
        f"{hparams.gradient_accumulation_steps}",
        f"{batch_size} * {hparams.num_generations}",
    )
