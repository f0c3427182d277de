"""What each kind of task trains with where the command line gives none (:data:`TASK_SETTINGS`, and the
divergences' and the per-prompt budgets' recipes), and the ``train()`` arguments of a run or a matrix cell built
from them and from the command line."""

from __future__ import annotations

import argparse
import logging
import warnings

from rlhf_lightning.exact.f_divergence import divergence_label, divergence_named
from rlhf_lightning.exact.tasks import RANDOM_KINDS
from rlhf_lightning.exact.training import OptimumTracker
from rlhf_lightning_plugins.advantage_estimators import GAE
from rlhf_lightning_plugins.beta_controllers import FixedBeta, PromptBudgetBeta
from rlhf_lightning_plugins.reference_updates import EMA, Reset, Sync

MATRIX_ESTIMATORS = ("k1", "k2", "k3", "k3+", "full")
PLACEMENTS = ("reward", "loss", "both")
WEIGHTINGS = ("none", "importance")
SCOPES = ("sequence", "per_token")


# What each kind of task was tuned with. A random task at beta 1 (where seeds 1-5 have a per-token
# fixed-point gap >= 0.05) needs more responses per iteration to settle within 0.02 of pi* (the KL in the
# loss is a score-function estimate: 384 responses, where 192 left k1 in the loss at 0.028-0.043); its matrix
# keeps the cells that separate the three classes (the full one: --estimators/--placements/--weightings).
# Its critic-free cells sample 8 responses per prompt (``num_generations``; gae: 1): with 4, rloo on random:4
# at one epoch stopped at 0.0222 (sampling seeds 1, 2: 0.0212, 0.0168) and was still falling; with 8 the
# whole critic-free matrix is within 0.0196 (docs/results.md).
TASK_SETTINGS = {
    "hand-made": {
        "beta": 0.5,
        "iterations": 100,
        "batch_size": 48,
        "estimators": list(MATRIX_ESTIMATORS),
        "placements": list(PLACEMENTS),
        "weightings": list(WEIGHTINGS),
        "updates": None,
        "num_generations": 4,
        "lr_final": 0.1,
        "lr_hold": 0.0,
        "end_batch_size": None,
        "end_iterations": 0,
        "explore": 0.0,
        "explore_iterations": 0,
    },
    "random": {
        "beta": 1.0,
        # 150 for every cell: with a critic, 100 left k1 in the reward on random:3 at one epoch 0.0224 from pi* on
        # sampling seed 0 and 0.0265 on seed 2 (with and without the position embedding; 0.0011 and 0.0148 after
        # 150); critic-free cells settled within 0.0191 only after 150 (docs/results.md, "Fifth round" and
        # "Eleventh round").
        "iterations": 150,
        # A per-token cell's gap moves at first order with where it ends: with 384 responses single sampling seeds
        # ended up to 0.028 (gae) and 0.042 (critic-free) from the fixed point's gap. gae's cells end on 30
        # iterations of 1536 (random:3: -0.006 at one and four epochs; 1536 throughout stops 0.014-0.021 short);
        # the critic-free ones, whose noise is a sequence-level baseline's, sample 1536 throughout (random:3,
        # rloo and dr_grpo, two seeds each: within 0.019; an end of 1536 left rloo at +0.056): docs/results.md,
        # "Eleventh round".
        "batch_size": {"gae": 384, "critic-free": 384, "per_token": {"gae": 384, "critic-free": 1536}},
        "end_batch_size": {"gae": None, "critic-free": None, "per_token": {"gae": 1536, "critic-free": None}},
        "end_iterations": {"gae": 0, "critic-free": 0, "per_token": {"gae": 30, "critic-free": 0}},
        "estimators": ["k1", "k3"],
        "placements": ["reward", "loss"],
        "weightings": ["importance"],
        "updates": 8,
        "num_generations": 8,
        # The lr ends at 1/10 with a critic, at 1/50 without: at the per-token fixed point J is not stationary,
        # so where a cell ends moves at first order with the noise it ends with, and without a critic (a
        # sequence-level baseline) that noise is larger. rloo per-token on random:5 at four epochs: 0.032 past
        # the fixed point ending at 1/10, 0.005 at 1/50; random:2 at one epoch 0.029, 0.004 with 4x the batch.
        # gae's cells are quieter but, ending at 1/50, stop short of the fixed point (random:3 k3, four
        # epochs: 0.048 short, 0.001-0.007 at 1/10). Neither end puts every critic-free per-token cell within
        # 0.02 of it (random:3 at one epoch ends 0.07 short at 1/50: docs/results.md, "Second round"). Shorter
        # runs with a held lr (120 iterations, held for half, then to 1/50) cost 14% less CPU and left the
        # per-token cells of random:3 0.05 short and the critic-free cells 0.019 from pi* ("Fourth round").
        "lr_final": {"gae": 0.1, "critic-free": 0.02},
        "lr_hold": 0.0,
        "explore": 0.0,
        "explore_iterations": 0,
    },
}


# Responses that end at EOS: a random-eos task's optimum can put much of a prompt's mass on a response its
# reference gives 1% (random-eos:1, prompt A: "aba" cut, 1.2% -> 41%). With 384 responses per iteration the
# critic-free cells, whose noise is a sequence-level baseline's, stalled short of it on some sampling seeds
# (rloo, k3 in the loss: 0.0704 on seed 2; with seq_mean_token_sum 0.17-0.25 on seed 1; gae never, seeds 0-2);
# with 1536 the same cells landed at 0.003-0.004 (docs/results.md, "Responses that end at EOS"). gae too: on
# random-eos:3 at 384 full in both ended 0.0254 from J* on sampling seed 2 (0.0150-0.0185 on 0 and 1), and the
# sampling noise alone (--expected-gradient --expected-noise: the exact advantage) put k3 in the loss at 0.0218 on
# seed 1; at 1536 every recommended gae cell there lands within 0.011 over seeds 0-2.
TASK_SETTINGS["random-eos"] = {
    **TASK_SETTINGS["random"],
    "batch_size": {**TASK_SETTINGS["random"]["batch_size"], "gae": 1536, "critic-free": 1536},
}
# A mode the reference rarely samples (where the claim stops): measured with gae at 384, as first found.
TASK_SETTINGS["rare-eos"] = {**TASK_SETTINGS["random-eos"], "batch_size": {**TASK_SETTINGS["random-eos"]["batch_size"], "gae": 384}}


# Each divergence's recommended recipe where it differs from the reverse KL's (k1 in the reward, gae), for what the
# command line leaves out. forward_kl's penalty beta / u is heavy-tailed where the policy gives a response far less
# than the reference does: with 384 responses per iteration random:1 stopped 0.0201 from its J*_f (0.0372 after 300
# iterations, 0.0325 unwhitened: noise, not bias), with 1536 at 0.0127. chi2's optimum drops responses (u = 0), which a
# softmax policy approaches at a rate that falls with their probability: random:3 stopped 0.0347 short after 150
# iterations of 384, 0.0155 with 1536, 0.0081 after 300 iterations of 384; on responses that end at EOS 384 is too
# noisy (random-eos:1: 0.1757 after 300 iterations, 0.0147 after 600 with J swinging 0.34-0.71 on the way) and 300
# iterations of 1536 land at 0.0096 (docs/divergences.md). chi2 charges the policy's excess mass on a kept response by
# 1 / pi_ref, and the last iterate's mass on one the reference gives 4e-10 cost random-eos:3 0.134 of a 0.1496 gap at the
# lr decayed to 1/10 (0.023 ten iterations earlier); decayed to 1/50 its sampling seeds 0-2 end 0.0078-0.0171, and
# random:1-3 and random-eos:1-2 0.0021-0.0174.
#
# The divergences whose f' is bounded above (forward_kl, js, alpha > 0) can put their optimum on responses the reference
# almost never samples (random-eos:3: 83-100% of a prompt's mass on responses pi_ref gives 6.5e-6 and 1.2e-9), which
# on-policy PPO never met (0.22, 0.41, 0.74 short). They explore: each token drawn from (1 - eps) pi + eps U with eps 0.5
# falling to 0 over the first 100 of 200 iterations of 1536 responses, then on-policy (random-eos:3: 0.0061, 0.0009,
# 0.0045; eps 0.3 over 60 of 150 found one prompt's mode only, 0.18 short; docs/divergences.md, "Exploring").
EXPLORING = {"iterations": 200, "batch_size": 1536, "explore": 0.5, "explore_iterations": 100}
DIVERGENCE_SETTINGS = {
    "forward_kl": EXPLORING,
    "js": EXPLORING,
    "alpha": EXPLORING,
    "chi2": {"iterations": 300, "batch_size": 1536, "lr_final": 0.02},
}


# The per_prompt controller's recipe on a random or random-eos task (--kl-budgets), where the command line gives
# none: every beta starts at 4, 250 iterations, the lr held for the first 60% and then decayed to 1/50 (with
# --budget-decay-after 30: 1/k steps for the betas from their 30th update). The 5% asked of each prompt's exact KL at the end needs both the
# betas and the final iterate quiet: with the random task's 150 iterations and the lr decayed to 1/10 from the start,
# 4 of the 8 documented runs held every prompt within 5%; decayed to 1/50 from the start, 6 of 8; held for the first
# half or 2/3 of 150, the betas, settled while the policy was still loud, ended 1-3% high (7 of 8, worst 0.055 and
# 0.063); 250 iterations held for 60%: 8 of 8, worst 0.030 and 0.031 on two machines. The start of 4 (the random
# task's beta of 1 before) is what random:3 needs on sampling seeds 1 and 2: from 1, prompt A's policy drops the
# high-reward responses its optimum at the budget holds (beta 0.584) in its first iterations, its KL lags below the
# budget and the integrator lowers its beta to 0.08 (gap 0.44); from 2 seed 1 found them only at beta 0.08, at
# iterations 130-140, and the 1/k steps could not bring the beta back (KL 5.8 against 1). From 4 the betas take 30-40
# iterations at the controller's capped rate to come down, with the policy near the reference while the critic
# learns, and then follow the tilted optimum down as an anneal (``anneal``'s argument): random:1-3 on seeds 0-2,
# random:1-2 on 3-5 and random:3 on 3-7 within 4.2%, gaps <= 0.0095 (docs/results.md, "Per-prompt KL budgets against the closed form"; the
# random-eos tasks: EOS_BUDGET_SETTINGS below).
BUDGET_SETTINGS = {"beta": 4.0, "iterations": 250, "lr_hold": 0.6, "lr_final": 0.02}
# The per_prompt controller's horizon at 384 responses an iteration (192 a prompt of two: a beta moves by at most
# 0.2 * 192 / 800 = 4.8% an iteration), scaled with the batch where --budget-horizon is not given: the horizon counts
# responses, and random-eos's 1536 at 800 stepped the betas by 19% an iteration, faster than the policy follows
# (random-eos:3 seed 0: prompt B's beta from 4 to 0.05 in 20 iterations, its KL at 0.013; at 3200 random-eos:1 and 2
# land within 1.3% of their budgets, docs/history/results-log.md, "Per-prompt KL budgets").
BUDGET_HORIZON = 800
# On responses that end at EOS a prompt's optimum at its budget can sit on responses its reference almost never samples
# (random-eos:3's prompt B: one response 0.986 under the reference, its optimum at the budget needing beta 0.374): on-policy
# its beta wound down to 0.13 before the policy met them (KL 9.8 against 2, gap 0.146). The budget recipe there explores
# as the bounded-f' divergences do (epsilon 0.5 falling to 0 over the first 100 iterations) for 350 iterations, its exact
# KL swinging late (prompt B's lives on responses pi_ref gives ~1e-9): random-eos:1-2 seeds 0-2 and random-eos:3 seeds
# 0-4 within 1.4% of their budgets, gaps <= 0.0052; with 250 random-eos:3 seed 2 ended 7.4% under (docs/results.md).
EOS_BUDGET_SETTINGS = {**BUDGET_SETTINGS, "iterations": 350, "explore": 0.5, "explore_iterations": 100}


def divergence_settings(args: argparse.Namespace, settings: dict, divergence: str) -> dict:
    """``settings`` with the divergence's own recipe (:data:`DIVERGENCE_SETTINGS`) where the command line gives none."""
    name = divergence_label(divergence_named(divergence)).split(":")[0]
    return {**settings, **{key: value for key, value in DIVERGENCE_SETTINGS.get(name, {}).items() if getattr(args, key) is None}}


def task_settings(args: argparse.Namespace, name: str) -> dict:
    """beta, iterations, batch size, the lr schedule and the matrix's estimators, placements and weightings
    for task ``name``: the command line's where given, else the task kind's (with ``--kl-budgets``, on a random task
    :data:`BUDGET_SETTINGS` over them, on a random-eos task :data:`EOS_BUDGET_SETTINGS`)."""
    kind = name.split(":")[0] if name.startswith(("random-eos:", "rare-eos:")) else "random" if is_random_task(name) else "hand-made"
    defaults = TASK_SETTINGS[kind]
    if args.kl_budgets is not None and kind in ("random", "random-eos"):
        defaults = {**defaults, **(BUDGET_SETTINGS if kind == "random" else EOS_BUDGET_SETTINGS)}
    return {key: default if getattr(args, key) is None else getattr(args, key) for key, default in defaults.items()}


def by_recipe(setting, advantage: str, scope: str = "n/a"):
    """A task setting that may depend on the recipe (TASK_SETTINGS says why): a plain value (the command
    line's, a hand-made task's), or one per kind of cell: ``per_token`` for a KL in the loss per token where
    the setting names it (itself a plain value or one per kind), else ``gae`` (a critic) or ``critic-free``."""
    if isinstance(setting, dict) and scope == "per_token" and "per_token" in setting:
        setting = setting["per_token"]
    if not isinstance(setting, dict):
        return setting
    return setting["gae" if advantage == "gae" else "critic-free"]


def final_lr(settings: dict, advantage: str) -> float:
    """The fraction of the lr a cell ends at: the command line's or the task kind's, which on random tasks
    depends on whether the advantage has a critic (``gae``) or not."""
    return by_recipe(settings["lr_final"], advantage)


def recipe_value(settings: dict, key: str, advantage: str, placement: str, scope: str):
    """A run's ``key`` setting (iterations, batch_size, end_batch_size, end_iterations): the command line's or
    the task kind's, which on random tasks depends on the advantage and, with the KL in the loss, its scope."""
    return by_recipe(settings[key], advantage, scope if placement == "loss" else "n/a")


def iterations_of(settings: dict, advantage: str, placement: str, scope: str) -> int:
    """A run's iterations: the command line's or the task kind's (:func:`recipe_value`)."""
    return recipe_value(settings, "iterations", advantage, placement, scope)


def num_minibatches(settings: dict, epochs: int) -> int:
    """Minibatches per PPO epoch: ``updates // epochs`` where the task's settings fix the optimizer steps per
    iteration (random tasks: 8, so 2 minibatches at 4 epochs and 8 at one: a one-epoch cell reuses no
    response and still takes as many AdamW steps; with 2 it took a quarter of them and was still moving after
    150 iterations, reinforce_pp on random:3 at 0.035 and falling, 0.013 with 8), else 2 at any epochs."""
    return 2 if settings["updates"] is None else settings["updates"] // epochs


def is_random_task(name: str) -> bool:
    """Whether ``name`` is a random task: ``random:SEED`` (fixed length), ``random-eos:SEED`` or ``rare-eos:SEED`` (ending at
    EOS), ``teacher:SEED`` or ``random-teacher:SEED`` (a teacher as the reference)."""
    return name.startswith(tuple(f"{kind}:" for kind in RANDOM_KINDS))


def recipe_settings(
    args: argparse.Namespace, settings: dict, advantage: str, estimator: str, placement: str, weighting: str, scope: str, epochs: int
) -> dict:
    """train() arguments of one KL recipe (a single run's or a matrix cell's) with the task's settings:
    batch, fixed beta, lr and its schedule, epochs and minibatches, the advantage's (:func:`advantage_settings`)."""
    return {
        **{key: recipe_value(settings, key, advantage, placement, scope) for key in ("batch_size", "end_batch_size", "end_iterations")},
        "kl_estimator": estimator,
        "beta_controller": FixedBeta(settings["beta"]),
        "kl_penalty": placement,
        "kl_loss_weighting": weighting,
        "kl_loss_scope": scope,
        "lr": args.lr,
        "max_grad_norm": args.max_grad_norm,
        "ppo_epochs": epochs,
        "num_minibatches": num_minibatches(settings, epochs),
        "log_samples_every_n_steps": 0,
        "logged": OptimumTracker.READS,
        "explore": settings["explore"],
        "explore_iterations": settings["explore_iterations"],
        **advantage_settings(args, advantage, settings),
    }


def advantage_settings(args: argparse.Namespace, advantage: str, settings: dict) -> dict:
    """train() arguments for an advantage estimator: its critic (gae) or its group size (the task's
    ``num_generations`` unless the command line gives one), and its lr schedule (where it ends: :func:`final_lr`)."""
    schedule = {"lr_final": final_lr(settings, advantage), "lr_hold": settings["lr_hold"]}
    if advantage == "gae":
        return {
            "advantage_estimator": GAE(lam=args.lam),
            "critic_lr": args.lr,
            "vf_coef": 0.5,
            "num_generations": 1 if args.num_generations is None else args.num_generations,
            **schedule,
        }
    return {"advantage_estimator": advantage, "num_generations": settings["num_generations"], **schedule}


def budget_settings(args: argparse.Namespace, settings: dict) -> dict:
    """train() arguments for --kl-budgets: the per_prompt controller from ``--beta`` and the task's budgets."""
    if args.kl_budgets is None:
        return {}
    batch_size = recipe_value(settings, "batch_size", args.advantage[0], args.kl_penalty, args.kl_loss_scope)
    controller = PromptBudgetBeta(
        settings["beta"],
        horizon=BUDGET_HORIZON * batch_size / 384 if args.budget_horizon is None else args.budget_horizon,
        decay_after=args.budget_decay_after,
        beta_min=args.budget_beta_min,
        beta_max=args.budget_beta_max,
    )
    return {"beta_controller": controller, "kl_budgets": args.kl_budgets}


def sampling_settings(args: argparse.Namespace) -> dict:
    """train() arguments for the sampling flags. vLLM's CPU attention has no kernel for the task
    model's heads of 16 dimensions: with ``--engine vllm`` its 32 dimensions are one head (the same
    parameter shapes, so the same initialisation; ``--heads 1`` gives ``hf`` that model)."""
    settings = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, rollout_engine=args.engine)
    settings.update(rollout_correction=args.rollout_correction, old_logprobs=args.old_logprobs or "sampler")
    if args.rollout_correction != "none" and args.old_logprobs is None:
        settings["old_logprobs"] = "forward"
    heads = args.heads or (1 if args.engine == "vllm" else None)
    return {**settings, "tiny_config": {"num_attention_heads": heads, "num_key_value_heads": heads}} if heads else settings


def reference_settings(args: argparse.Namespace, iterations: int) -> dict:
    """train() arguments for --reference/--resets: total iterations, the update plugin, per-phase lr decay."""
    if args.reference == "none":
        return {"iterations": iterations}
    if args.reference == "ema":
        update = EMA(args.alpha, every_n_iterations=iterations)
    else:
        update = {"sync": Sync, "reset": Reset}[args.reference](iterations)
    return {"iterations": iterations * args.resets, "reference_update": update, "lr_period": iterations}


def quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")  # eval-mode reference (on purpose), no val loop, deprecations
