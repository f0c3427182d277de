"""Train PPORLHF on a task small enough to enumerate and measure how far it lands from the
closed-form optimum of the KL-regularised objective (see rlhf_lightning/exact/).

    python tools/studies/optimum_check.py --estimator k1 --beta 0.5 --iterations 100
    python tools/studies/optimum_check.py --advantage rloo --num-generations 4     # critic-free
    python tools/studies/optimum_check.py --beta 1.5 --reference reset --resets 3  # 3 phases, reset after each
    python tools/studies/optimum_check.py --task random:3 --kl-penalty loss --estimator k3 --kl-loss-scope per_token --seed 0 1 2

``--task`` names a hand-made task (terminal, bandit) or ``random:SEED``, ``ExactTask.random(SEED)``: 2 prompts,
4 tokens, responses of 3, a reward that depends on token order and a reference initialised from SEED.
``teacher:SEED`` and ``random-teacher:SEED`` put a teacher in the reference's place (``model.reference``): the
same network initialised from SEED + 1000, while the policy starts from SEED's; a reward of 0 (on-policy
distillation: the optimum is pi_teacher, the gap NaN and KL(pi || pi_teacher) the distance) or random:SEED's
reward centred under the teacher (the optimum pi* ∝ pi_teacher exp(r / beta)). Their last line reads

    TEACHER task=<task> seed=<seed> kl_to_teacher_start=<KL(pi_0||T)> kl_to_teacher=<KL(pi||T)> kl_to_opt=<KL(pi||pi*)> gap=<gap> ...

(``teacher:SEED``'s NaN gap keeps it out of ``--matrix``, and both out of ``--tabular``, whose table starts at pi_ref.)

Each kind of task has its own defaults for what the command line leaves out (:data:`TASK_SETTINGS`:
beta 0.5, 100 iterations of 48 responses in 2 minibatches per epoch, 4 per prompt without a critic, the lr
decayed to 1/10, hand-made; beta 1, 384 responses per iteration and 8 optimizer steps each (8 minibatches
at one epoch, 2 at four; ``--updates``), 8 per prompt and the lr decayed to 1/50 without a critic, to 1/10 with
one, 150 iterations, and with the KL in the loss per token 1536 responses (critic-free) or an end of 30
iterations of 1536 (``gae``), random; ``--lr-hold`` holds
the lr for a fraction of the run before the decay; ``--end-batch-size B --end-iterations N`` sample B responses
in each of the last N iterations, a quieter end at the same lr: docs/results.md, "Eighth round"; ``--max-grad-norm``
is the module's gradient clip, 1.0, 0 for none: "Ninth round").
Several tasks, and several sampling ``--seed`` values (the task's reference stays the same), train one
after another; with more than one seed a ``SEEDS task=... gap_mean= gap_std=`` line follows each task.
Every run first prints

    PER_TOKEN fixed_point_gap=<gap> task=<task> seed=<seed>

the exact gap of the fixed point of a per-token KL loss (``exact.closed_form.backward_induction(soft=False)``): where a
KL in the loss with ``--kl-loss-scope per_token`` converges. At beta 1 it is >= 0.05 on random tasks 1-7
(their values: ``ExactTask.random``'s docstring).

Every ``--every`` iterations it prints the exact objective J(pi), the relative gap
(J* - J(pi)) / |J*|, KL(pi || pi*), the exact KL(pi || pi_ref) and the mean logged estimate
of it (objective/kl over the iterations since the previous row). The last line reads

    OPTIMUM task=<task> seed=<seed> gap=<gap> kl_to_opt=<KL(pi||pi*)> kl_ref_exact=<KL(pi||pi_ref)> kl_ref_logged=<objective/kl> logprob_diff_max=<d>

(d: the largest ``rollout/logprob_diff_max`` of the run, the sampler's log-probs against the trainer's)

beta is fixed (controller ``fixed``). With the penalty in the reward only k1 reaches the
optimum: k3 and full in the reward drop part of the KL's gradient and collapse towards the
reward maximiser; ``--kl-penalty both --no-whiten`` restores the missing term for them.

``--matrix`` trains every cell of task x advantage x estimator x placement x kl_loss_weighting x
kl_loss_scope x ppo_epochs x seed (``--task``, ``--advantage``, ``--estimators``, ``--placements``,
``--weightings``, ``--scopes``, ``--epochs``, ``--seed`` narrow it; the estimators, placements and
weightings default to the task kind's, the full product on hand-made tasks and k1 k3 x reward loss x
importance on random ones; ``--jobs`` runs cells in parallel processes) and prints the PER_TOKEN line
of each task (of each seed, for a hand-made task), one line per cell, then a summary:

    OPTIMUM task=random:1 seed=0 advantage=gae estimator=k3 placement=loss weighting=importance scope=sequence epochs=4 gap=... expected=unbiased iterations=100
    OPTIMUM ... scope=per_token epochs=4 gap=... expected=per_token fixed_point_gap=<that task's PER_TOKEN gap> fixed_point_distance=<d> iterations=150
    MATRIX unbiased_max_gap=<largest gap of the cells called unbiased> biased_min_gap=<smallest of those called biased>
           per_token_min_fixed_point_gap=<smallest PER_TOKEN gap over the tasks>
           per_token_max_deviation=<largest |gap - fixed_point_gap| of the per_token cells>
           per_token_max_mean_deviation=<largest |mean over the seeds of gap - fixed_point_gap|>
           per_token_max_fixed_point_distance=<largest d> length_weighted_max_own_distance=...
           high_variance_max_gap=... drift_max_gap=...
           wall_s=<seconds> cpu_s=<user CPU seconds of the whole run, its --jobs workers included>

d = beta KL(pi || the per-token fixed point) / |J*|: the gap is beta KL(pi || pi*) / |J*|, a distance from pi*
that moves at second order near it; d is the same distance from the fixed point, where a per-token cell's gap
moves at first order (docs/results.md, "Tenth round").

With several ``--seed`` values each per_token cell also gets a line after the cells' lines, before MATRIX,
``SEEDS task= advantage= estimator= scope= epochs= n= deviation_mean= deviation_std=`` (gap - fixed_point_gap
over its sampling seeds: where the cell sits, and how far one seed strays from it).

``--expected-gradient`` trains the same cells with every rollout replaced by its exact expectation
(:func:`rlhf_lightning.exact.training.expected_train`: all responses enumerated, weighted by pi_old, the exact
advantage with the reward's KL values in the return, the module's own ppo_loss): no sampling noise, so its gaps are where each cell's expected
gradient leads (the sequence cells to pi*, the per-token ones to their fixed point), and what a sampled
cell adds to them is noise. Every cell trains the task kind's iterations (150 on a random task).
``--tabular`` trains the same KL-in-the-loss cells on a tabular policy (:func:`rlhf_lightning.exact.training.sampled_ppo`:
one logit vector per prompt and prefix, sampled responses, the module's loss pieces, the exact advantage for
``gae`` or the critic-free estimator's own, Adam at ``--tabular-lr``, one batch size: the cell's, without an end batch), about a second a cell: where the loss
settles when no network couples the states. ``--expected-noise`` puts the noise back and nothing else: each step weighs the responses by a draw of
``--batch-size`` from pi_old (the ``--seed``'s) instead of by pi_old, the advantage and loss still exact; with
several seeds the SEEDS lines give where a per-token cell sits under that noise and how far one seed strays.

kl_opt is KL(pi* || pi_ref), where kl_ref_exact should land. ``expected`` is what the theory
(:func:`expected_class`, docs/kl-estimators.md "Which recipe reaches which optimum") says of the cell.
The scope only varies where the KL is in the loss (with ``both`` the reward carries the sequence
term) and on responses of more than one token; k2 (a biased value) is refused with the sequence scope.
Advantages are whitened by the estimator's default where the KL is only in the reward and never
where it is in the loss (PPORLHF refuses that combination). Measured matrices, with their time:
docs/kl-estimators.md and docs/results.md.

``--max-staleness K [K ...]`` adds stale cells to the matrix (0: the synchronous cell): each batch sampled from the
weights of K iterations ago (``model.off_policy.max_staleness``, the asynchronous loop; with ``--expected-gradient``
``exact.training.expected_train(staleness=K)``, the responses weighted by that policy), once per ``--corrections`` value
(``model.off_policy.correction``: sequence, token, none; default sequence none) at ``--correction-cap`` (default the
setting's, 5). Their lines carry ``staleness= correction= off_policy=<the correction's class, recipes.off_policy_recipe>``
(and, exact, the last iteration's ``ess=`` and ``clipped_fraction=``), and a summary per staleness and class follows
MATRIX (whose classes are the synchronous cells')::

    STALE staleness=<K> correction_class=<exact|approximate|biased> n=<cells> max_gap=<largest gap> min_gap=<smallest>

``--temperature T --top-p P --top-k K`` sample the declared distribution of rlhf_lightning/sampling.py
(tempered, on the sampler's kept set, replayed for the policy and the reference); the gap is then that of
the declared objective's closed-form optimum at the kept sets the final policy samples with
(docs/rollout-engines.md), and a last line tells a real optimum from a point mass on the kept sets:

    KEPT responses=<kept responses per prompt>/<all> optimum_top_prob=<max_y pi*(y|x)> best_kept_reward=<max r kept> J*=<J*> kl_opt=<KL(pi*||ref)>

``--engine vllm`` samples with vLLM (the task's model with one attention head of 32: vLLM's CPU
attention has no kernel for heads of 16; ``--heads 1`` gives ``hf`` the same model); ``--rollout-correction tis|mis`` weighs each token by
pi_old / pi_sampler.

``--kl-budgets B1 B2 ...`` (one per task prompt, nats per response) trains with the ``per_prompt`` controller
(one beta per prompt, each held to its own budget; it starts at ``--beta``, steps with ``--budget-horizon`` (default
800 per 384 responses an iteration, :data:`BUDGET_HORIZON`) and ``--budget-decay-after``, clamped to
``--budget-beta-min`` / ``--budget-beta-max``) instead of a fixed beta; on a random task its recipe (:data:`BUDGET_SETTINGS`, where the command line gives none) is every beta starting at 4 and 250
iterations with the lr held for the first 60% and then decayed to 1/50 (random-eos, :data:`EOS_BUDGET_SETTINGS`: 350,
exploring over the first 100); every distance is then to the per-prompt optimum, each
prompt's pi*(.|x) ∝ pi_ref exp(r / beta_x) at its current beta_x, and a last line reads

    BUDGET task=<task> seed=<seed> gap=<gap to that optimum> kl_max_rel_error=<max_x |KL_x(pi) / budget_x - 1|>
           beta_max_rel_error=<max_x |beta_x / beta_x^rest - 1|> kls=<KL_x> betas=<beta_x> rest_betas=<beta_x^rest>

(beta_x^rest: where the budget puts pi*'s KL, ``exact.closed_form.prompt_betas``; KL_x exact).

``--reference sync|reset|ema --resets k`` trains k phases of ``--iterations`` iterations (the learning
rate decays within each phase) and moves the reference after each phase, the last at the very end.
Converged phases make the reference pi_j ∝ pi_0 exp(j r / beta) after j resets, so the final policy
is compared with pi_k (EMA: pi_{1 + (k - 1) alpha}); a further line reads

    ITERATED k=<k> gap=<gap of J at beta / k, reference pi_0> kl_to_opt=<KL(pi||pi_k)>
"""

from __future__ import annotations

import argparse
import itertools
import logging
import multiprocessing
import os
import statistics
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from rlhf_lightning.args import OFF_POLICY_WEIGHTS, OffPolicyArgs
from rlhf_lightning.checks import require
from rlhf_lightning.exact.closed_form import optimum_report, prompt_betas, prompt_kls
from rlhf_lightning.exact.f_divergence import divergence_label, divergence_named
from rlhf_lightning.exact.tasks import RANDOM_KINDS, TASK_CHOICES, per_token_fixed_point_gap, reference_logprobs, task_named
from rlhf_lightning.exact.training import OptimumTracker, expected_train, sampled_ppo, train
from rlhf_lightning.recipes import kl_recipe, off_policy_recipe
from rlhf_lightning.registry import registry
from rlhf_lightning_plugins.advantage_estimators import GAE
from rlhf_lightning_plugins.beta_controllers import FixedBeta, PromptBudgetBeta
from rlhf_lightning_plugins.reference_updates import EMA, Reset, Sync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: the argument types every tool shares
from _cli_args import option_number


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    matrix_actions = add_matrix_args(parser)
    parser.add_argument(
        "--divergence",
        type=_divergence,
        nargs="+",
        default=["reverse_kl"],
        help="model.divergence: reverse_kl (default), forward_kl, js, chi2, alpha:VALUE or any registered name; several: "
        "one run each, every other setting the same, each measured against its own optimum (exact.f_divergence.divergence_optimal_logprobs)",
    )
    parser.add_argument("--estimator", default="k1", help="KL estimator: k1, k3, full or any registered name (default k1)")
    parser.add_argument(
        "--beta",
        type=option_number(above=0),
        help="fixed KL coefficient (default: the task's, 0.5 hand-made, 1 random; with --kl-budgets on a random task the betas' start, 4)",
    )
    parser.add_argument(
        "--iterations",
        type=option_number(integer=True, at_least=1),
        help="PPO iterations (default: 100 hand-made; random 150)",
    )
    parser.add_argument(
        "--seed",
        type=option_number(integer=True),
        nargs="+",
        default=[0],
        help="sampling seeds, one run each (default 0); a hand-made task's initialisation too",
    )
    parser.add_argument(
        "--task",
        type=_task,
        nargs="+",
        default=["terminal"],
        help="terminal: 3 prompts, 3-token responses over 3 tokens, reward = count of the prompt's letter; "
        "bandit: the same with 1-token responses; random:SEED: ExactTask.random(SEED); teacher:SEED: random:SEED's network "
        "learns a teacher (another seed's) with a reward of 0, random-teacher:SEED with random:SEED's reward (default terminal)",
    )
    parser.add_argument("--kl-penalty", choices=("reward", "loss", "both"), default="reward", help="where beta * KL goes")
    parser.add_argument("--no-whiten", action="store_true", help="do not whiten advantages (gae)")
    parser.add_argument(
        "--kl-loss-weighting",
        choices=("importance", "none"),
        default="importance",
        help="model.kl.loss_weighting of a KL in the loss (default importance)",
    )
    parser.add_argument(
        "--kl-loss-scope", choices=SCOPES, default="sequence", help="model.kl.loss_scope of a KL in the loss (default sequence)"
    )
    parser.add_argument(
        "--advantage",
        nargs="+",
        default=["gae"],
        help="advantage estimator: gae (critic), grpo, dr_grpo, rloo, reinforce_pp (no critic); "
        "several: one matrix dimension (a single run takes the first)",
    )
    parser.add_argument(
        "--num-generations",
        type=option_number(integer=True, at_least=1),
        help="responses per prompt (default 1 with gae; without a critic the task's: 4 hand-made, 8 random)",
    )
    parser.add_argument(
        "--batch-size",
        type=option_number(integer=True, at_least=1),
        help="responses per iteration, a multiple of the prompts times --num-generations (default: the task's, 48 hand-made, "
        "384 random, 1536 for a random task's critic-free cells with the KL in the loss per token)",
    )
    parser.add_argument(
        "--end-batch-size",
        type=option_number(integer=True, at_least=1),
        help="responses per iteration in the last --end-iterations iterations (with --end-iterations)",
    )
    parser.add_argument(
        "--end-iterations",
        type=option_number(integer=True, at_least=0),
        help="how many of the last iterations sample --end-batch-size responses (default: the task's, 0 but on random "
        "tasks 30 of 1536 for gae's cells with the KL in the loss per token)",
    )
    parser.add_argument("--lr", type=option_number(above=0), default=2e-3, help="policy and critic learning rate")
    parser.add_argument(
        "--lr-final",
        type=option_number(at_least=0, at_most=1),
        help="linear decay of the learning rate to this fraction (default: the task's, 0.1 hand-made, on random tasks 0.1 "
        "with a critic and 0.02 without)",
    )
    parser.add_argument(
        "--lr-hold",
        type=option_number(at_least=0, below=1),
        help="fraction of the run at the full learning rate before the decay (default 0)",
    )
    parser.add_argument("--ppo-epochs", type=option_number(integer=True, at_least=1), default=4)
    parser.add_argument(
        "--updates",
        type=option_number(integer=True, at_least=1),
        help="optimizer steps per iteration, ppo_epochs x minibatches (default: the task's, 8 random; hand-made: 2 minibatches per epoch)",
    )
    parser.add_argument(
        "--lam", type=option_number(at_least=0, at_most=1), default=1.0, help="GAE lambda (1: Monte Carlo returns minus the critic)"
    )
    parser.add_argument(
        "--max-grad-norm",
        type=option_number(at_least=0),
        default=1.0,
        help="model.optim.max_grad_norm: each step's gradients clipped to this norm, 0 for none (default 1.0, the module's)",
    )
    parser.add_argument(
        "--every", type=option_number(integer=True, at_least=1), default=10, help="print the exact quantities every N iterations"
    )
    add_reference_args(parser)
    add_sampling_args(parser)
    add_budget_args(parser)
    args = parser.parse_args(argv)
    if args.kl_budgets is not None and args.matrix:
        parser.error("--kl-budgets: not with --matrix (a single run's controller; the matrix's cells hold beta fixed)")
    for name in args.task if args.kl_budgets is not None else ():
        prompts = task_named(name).prompts
        if len(prompts) != len(args.kl_budgets):
            parser.error(f"--kl-budgets: {len(args.kl_budgets)} given, task {name} has {len(prompts)} prompts (one budget each)")
    args.max_grad_norm = args.max_grad_norm or None  # 0: no clip (the module takes null)
    if args.expected_noise and not (args.matrix and args.expected_gradient):
        parser.error("--expected-noise: only with --matrix --expected-gradient (it adds the sampling noise to the exact path)")
    if (args.end_batch_size is None) != (args.end_iterations is None):
        parser.error("--end-batch-size and --end-iterations: give both or neither (one alone changes nothing)")
    if args.tabular and (not args.matrix or args.expected_gradient):
        parser.error("--tabular: only with --matrix, and not with --expected-gradient (it samples its responses)")
    if args.end_iterations and args.expected_gradient:
        parser.error("--end-batch-size / --end-iterations: not with --expected-gradient (the exact path samples no batch)")
    if args.end_iterations and args.tabular:
        parser.error("--end-batch-size / --end-iterations: not with --tabular (exact.training.sampled_ppo samples one batch size)")
    sequence_level = [name for name in args.divergence if not divergence_named(name).per_token]
    if sequence_level and (args.matrix or args.reference != "none" or args.kl_penalty != "reward"):
        parser.error(
            f"--divergence {' '.join(sequence_level)}: a single run's, with --kl-penalty reward and --reference none (its penalty is "
            "the sequence-level f'(u) in the reward; the iterated optimum of a moving reference is the reverse KL's)"
        )
    if args.tabular_lr is not None and not args.tabular:
        parser.error("--tabular-lr: only with --tabular (the tiny Llama's lr is --lr)")
    if not args.matrix:  # one run reads none of the matrix group's options: refuse them rather than ignore them
        given = [action.option_strings[0] for action in matrix_actions if getattr(args, action.dest) != action.default]
        if given:
            parser.error(f"{', '.join(given)}: only with --matrix (one run without it reads none of them)")
    args.tabular_lr = args.tabular_lr or 0.05
    distillation = [name for name in args.task if name.startswith("teacher:")]
    if args.matrix and distillation:
        parser.error(
            f"--matrix: not with {distillation[0]} (a reward of 0: J* = 0 and the gap the matrix compares is NaN; its distance is "
            "KL(pi || pi_teacher): run its cells one at a time, or random-teacher:SEED in the matrix)"
        )
    if args.tabular and any(name.startswith(("teacher:", "random-teacher:")) for name in args.task):
        parser.error(
            "--tabular: not with a teacher task (exact.training.sampled_ppo starts the table at pi_ref, and a teacher task's policy starts elsewhere)"
        )
    for name, epochs in itertools.product(args.task, args.epochs if args.matrix else [args.ppo_epochs]):
        updates = task_settings(args, name)["updates"]
        if updates is not None and updates % epochs:
            parser.error(f"--updates: {updates} optimizer steps per iteration of task {name} are not a multiple of {epochs} PPO epochs")
    return args


def add_reference_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("a reference that moves")
    group.add_argument(
        "--reference",
        choices=("none", "sync", "reset", "ema"),
        default="none",
        help="reference update after each phase of --iterations iterations (default none)",
    )
    group.add_argument(
        "--resets", type=option_number(integer=True, at_least=1), default=1, help="phases, each followed by a reference update (default 1)"
    )
    group.add_argument(
        "--alpha", type=option_number(above=0, at_most=1), default=0.5, help="EMA weight of the policy in each update (default 0.5)"
    )


def add_budget_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("per-prompt KL budgets (docs/plugins.md)")
    group.add_argument(
        "--kl-budgets",
        type=option_number(above=0),
        nargs="+",
        help="each task prompt's KL budget (nats per response): the per_prompt controller instead of a fixed beta",
    )
    group.add_argument(
        "--budget-horizon",
        type=option_number(above=0),
        help="the per_prompt controller's horizon, in one prompt's responses (default 800 per 384 responses an iteration: "
        "a beta moves by at most 4.8%% an iteration at any batch; 3200 at random-eos's 1536)",
    )
    group.add_argument(
        "--budget-decay-after",
        type=option_number(integer=True, at_least=1),
        default=30,
        help="the per_prompt controller's decay_after: a prompt's steps shrink as 1/k after its first N updates (default 30)",
    )
    group.add_argument(
        "--budget-beta-min", type=option_number(above=0), help="the per_prompt controller's beta_min, its anti-windup clamp (default none)"
    )
    group.add_argument("--budget-beta-max", type=option_number(above=0), help="the per_prompt controller's beta_max (default none)")


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


def budget_line(name: str, seed: int, module, last: dict) -> str:
    """The BUDGET line of a --kl-budgets run: the per-prompt optimum's gap and each prompt's KL and beta against
    its budget and its closed-form resting beta."""
    ref, task = module.exact_ref_logprobs(), module.task
    rest = prompt_betas(ref, task.rewards(), module.beta_controller.budgets_of(module.prompt_table.ids), "sequence_sum", task.lengths)
    kls = prompt_kls(module.exact_logprobs(), ref, "sequence_sum", task.lengths)

    def listed(values) -> str:
        return ",".join(f"{v:.4f}" for v in values.tolist())

    return (
        f"BUDGET task={name} seed={seed} gap={last['gap']:.4f} kl_max_rel_error={last['budget_max_rel_error']:.4f} "
        f"beta_max_rel_error={last['beta_max_rel_error']:.4f} kls={listed(kls)} betas={listed(module.exact_beta())} rest_betas={listed(rest)}"
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (docs/rollout-engines.md)")
    group.add_argument("--temperature", type=option_number(above=0), default=1.0, help="model.sampling.temperature (default 1)")
    group.add_argument(
        "--top-p", type=option_number(above=0, at_most=1), default=1.0, help="model.sampling.top_p (default 1: no truncation)"
    )
    group.add_argument(
        "--top-k", type=option_number(integer=True, at_least=0), default=0, help="model.sampling.top_k (default 0: no truncation)"
    )
    group.add_argument("--engine", default="hf", help="model.rollout_engine: hf (default), vllm, or any registered name")
    group.add_argument(
        "--rollout-correction",
        choices=("none", "tis", "mis", "seq_tis", "seq_mis"),
        default="none",
        help="model.sampling.rollout_correction",
    )
    group.add_argument(
        "--old-logprobs", choices=("sampler", "forward"), help="model.sampling.old_logprobs (default: forward with a correction)"
    )
    group.add_argument(
        "--explore",
        type=option_number(at_least=0, below=1),
        help="model.sampling.explore: epsilon of the exploring mixture (default: the divergence's recipe, else 0)",
    )
    group.add_argument(
        "--explore-iterations",
        type=option_number(integer=True, at_least=1),
        help="model.sampling.explore_iterations (default: the divergence's recipe)",
    )
    group.add_argument(
        "--heads",
        type=option_number(integer=True, at_least=1),
        help="attention heads of the task model (32 wide; default 2, 1 with --engine vllm: heads of 32)",
    )


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


def print_iterated(rows: list[dict]) -> None:
    """The iterated optimum's columns of every row, then the ITERATED line of the last."""
    print(f"{'iter':>5} {'k':>5} {'gap_to_pi_k':>12} {'kl_to_pi_k':>11} {'kl_to_pi_0':>11}")
    for row in rows:
        print(
            f"{row['iteration']:5d} {row['k']:5.2f} {row['iterated_gap']:12.4f} {row['iterated_kl_to_optimum']:11.4f} "
            f"{row['kl_to_initial']:11.4f}"
        )
    last = rows[-1]
    print(f"ITERATED k={last['k']:.2f} gap={last['iterated_gap']:.4f} kl_to_opt={last['iterated_kl_to_optimum']:.4f}")


def _task(name: str) -> str:
    """argparse type of ``--task``: the name itself, checked."""
    try:
        if not _random(name):  # random tasks are built (a model each) when used
            task_named(name)
        elif not name.split(":", 1)[1].isdigit():
            raise ValueError
    except Exception:
        raise argparse.ArgumentTypeError(f"{name!r} is not {TASK_CHOICES}") from None
    return name


def _divergence(spec: str) -> str:
    """argparse type of ``--divergence``: the spec itself (``chi2``, ``alpha:0.5``), checked."""
    try:
        divergence_named(spec)
    except Exception as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return spec


def _random(name: str) -> bool:
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


def main(argv=None) -> None:
    args = parse_args(argv)
    _quiet()
    if args.matrix:
        run_matrix(args)
        return
    for name in args.task:
        task, settings = task_named(name), task_settings(args, name)
        print(
            f"task={name} estimator={args.estimator} kl_penalty={args.kl_penalty} kl_loss_scope={args.kl_loss_scope} "
            f"advantage={args.advantage[0]} num_generations={advantage_settings(args, args.advantage[0], settings)['num_generations']} "
            f"beta={settings['beta']} iterations={iterations_of(settings, args.advantage[0], args.kl_penalty, args.kl_loss_scope)} batch_size={recipe_value(settings, 'batch_size', args.advantage[0], args.kl_penalty, args.kl_loss_scope)} seeds={args.seed} "
            f"temperature={args.temperature} top_p={args.top_p} top_k={args.top_k} engine={args.engine} correction={args.rollout_correction}"
        )
        for divergence in args.divergence:
            gaps = [run_single(args, name, task, seed, divergence) for seed in args.seed]
            if len(gaps) > 1:
                print(
                    f"SEEDS task={name} divergence={divergence} n={len(gaps)} gap_mean={statistics.mean(gaps):.4f} "
                    f"gap_std={statistics.stdev(gaps):.4f} gap_min={min(gaps):.4f} gap_max={max(gaps):.4f}"
                )


def run_single(args: argparse.Namespace, name: str, task, seed: int, divergence: str = "reverse_kl") -> float:
    """Train one run with the command line's settings, sampling ``seed`` and ``divergence``; print its rows; its
    final gap, to the divergence's own optimum (J*_f)."""
    settings, sequence_level = divergence_settings(args, task_settings(args, name), divergence), not divergence_named(divergence).per_token
    if sequence_level:
        batch_size = recipe_value(settings, "batch_size", args.advantage[0], args.kl_penalty, args.kl_loss_scope)
        iterations = iterations_of(settings, args.advantage[0], args.kl_penalty, args.kl_loss_scope)
        print(
            f"RECIPE divergence={divergence} batch_size={batch_size} iterations={iterations} explore={settings['explore']} "
            f"explore_iterations={settings['explore_iterations']}",
            flush=True,
        )
    if not sequence_level and args.kl_budgets is None:  # the per-token fixed point is the reverse KL's, of one beta
        print(
            f"PER_TOKEN fixed_point_gap={per_token_fixed_point_gap(task, settings['beta'], seed):.4f} task={name} seed={seed}", flush=True
        )
    print(f"{'iter':>5} {'J':>8} {'J*':>8} {'gap':>8} {'kl_to_opt':>10} {'kl_ref_exact':>13} {'kl_ref_logged':>14}")
    start = time.perf_counter()
    module, tracker = train(
        task,
        **reference_settings(args, iterations_of(settings, args.advantage[0], args.kl_penalty, args.kl_loss_scope)),
        every=args.every,
        seed=seed,
        divergence=divergence_named(divergence),
        whiten_advantages=False if args.no_whiten else None,
        **{
            **recipe_settings(
                args,
                settings,
                args.advantage[0],
                args.estimator,
                args.kl_penalty,
                args.kl_loss_weighting,
                args.kl_loss_scope,
                args.ppo_epochs,
            ),
            **budget_settings(args, settings),  # the per_prompt controller in place of the fixed beta
        },
        **sampling_settings(args),
    )
    for row in tracker.rows:
        print(
            f"{row['iteration']:5d} {row['objective']:8.4f} {row['optimum']:8.4f} {row['gap']:8.4f} "
            f"{row['kl_to_optimum']:10.4f} {row['kl_to_ref']:13.4f} {row['kl_logged']:14.4f}"
        )
    last = tracker.last
    print(f"KL(pi*||pi_ref)={last['optimum_kl_to_ref']:.4f}  {time.perf_counter() - start:.1f} s")
    print(
        f"OPTIMUM task={name} divergence={divergence} seed={seed} J*={last['optimum']:.4f} gap={last['gap']:.4f} kl_to_opt={last['kl_to_optimum']:.4f} "
        f"kl_ref_exact={last['kl_to_ref']:.4f} kl_ref_logged={last['kl_logged']:.4f} logprob_diff_max={last['logprob_diff_max']:.1e} "
        f"fixed_point_distance={last['fixed_point_distance']:.4f}",
        flush=True,
    )
    if module.task.eos:
        print(
            f"LENGTH mean_length={last['mean_length']:.3f} optimum_mean_length={last['optimum_mean_length']:.3f} "
            f"truncated={last['truncated']:.3f} optimum_truncated={last['optimum_truncated']:.3f} "
            f"own_gap={last['own_gap']:.4f} own_distance={last['own_distance']:.4f}",
            flush=True,
        )
    if module.truncates:
        print(kept_line(module, last), flush=True)
    if task.teacher_seed is not None:
        print(teacher_line(name, seed, tracker), flush=True)
    if args.reference != "none":
        print_iterated(tracker.rows)
    if args.kl_budgets is not None:
        print(budget_line(name, seed, module, last), flush=True)
    return last["gap"]


def teacher_line(name: str, seed: int, tracker: OptimumTracker) -> str:
    """The TEACHER line of a task whose reference is a teacher (``teacher:SEED``, ``random-teacher:SEED``): the exact
    KL(pi || pi_teacher) at the start and at the end, and KL(pi || pi*), pi* ∝ pi_teacher exp(r / beta) (pi_teacher
    itself with a reward of 0, where the gap is NaN and this KL, in nats, is the distance)."""
    first, last = tracker.rows[0], tracker.last
    return (
        f"TEACHER task={name} seed={seed} kl_to_teacher_start={first['kl_to_ref']:.4f} kl_to_teacher={last['kl_to_ref']:.4f} "
        f"kl_to_opt={last['kl_to_optimum']:.4f} gap={last['gap']:.4f} optimum_kl_to_teacher={last['optimum_kl_to_ref']:.4f} "
        f"kl_to_initial={last['kl_to_initial']:.4f}"
    )


def kept_line(module, last: dict) -> str:
    """The KEPT line: what the final policy's kept sets leave of the task (``ExactPPORLHF.kept_report``),
    to tell a real optimum from a point mass on them."""
    kept = module.kept_report()
    return (
        f"KEPT responses={kept['responses']:.2f}/{len(module.task.responses)} optimum_top_prob={kept['optimum_top_prob']:.4f} "
        f"best_kept_reward={kept['best_kept_reward']:.4f} J*={last['optimum']:.4f} kl_opt={last['optimum_kl_to_ref']:.4f}"
    )


# ---------------------------------------------------------------------- --matrix
MATRIX_ESTIMATORS = ("k1", "k2", "k3", "k3+", "full")
PLACEMENTS = ("reward", "loss", "both")
WEIGHTINGS = ("none", "importance")
SCOPES = ("sequence", "per_token")
CLASSES = ("unbiased", "per_token", "length_weighted", "high_variance", "drift", "biased")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")

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
# random:1-2 on 3-5 and random:3 on 3-7 within 4.2%, gaps <= 0.0095 (docs/plugins.md, "Per-prompt KL budgets"; the
# random-eos tasks: EOS_BUDGET_SETTINGS below).
BUDGET_SETTINGS = {"beta": 4.0, "iterations": 250, "lr_hold": 0.6, "lr_final": 0.02}
# The per_prompt controller's horizon at 384 responses an iteration (192 a prompt of two: a beta moves by at most
# 0.2 * 192 / 800 = 4.8% an iteration), scaled with the batch where --budget-horizon is not given: the horizon counts
# responses, and random-eos's 1536 at 800 stepped the betas by 19% an iteration, faster than the policy follows
# (random-eos:3 seed 0: prompt B's beta from 4 to 0.05 in 20 iterations, its KL at 0.013; at 3200 random-eos:1 and 2
# land within 1.3% of their budgets, docs/plugins.md, "Per-prompt KL budgets").
BUDGET_HORIZON = 800
# On responses that end at EOS a prompt's optimum at its budget can sit on responses its reference almost never samples
# (random-eos:3's prompt B: one response 0.986 under the reference, its optimum at the budget needing beta 0.374): on-policy
# its beta wound down to 0.13 before the policy met them (KL 9.8 against 2, gap 0.146). The budget recipe there explores
# as the bounded-f' divergences do (epsilon 0.5 falling to 0 over the first 100 iterations) for 350 iterations, its exact
# KL swinging late (prompt B's lives on responses pi_ref gives ~1e-9): random-eos:1-2 seeds 0-2 and random-eos:3 seeds
# 0-4 within 1.4% of their budgets, gaps <= 0.0052; with 250 random-eos:3 seed 2 ended 7.4% under (docs/plugins.md).
EOS_BUDGET_SETTINGS = {**BUDGET_SETTINGS, "iterations": 350, "explore": 0.5, "explore_iterations": 100}


def divergence_settings(args: argparse.Namespace, settings: dict, divergence: str) -> dict:
    """``settings`` with the divergence's own recipe (:data:`DIVERGENCE_SETTINGS`) where the command line gives none."""
    name = divergence_label(divergence_named(divergence)).split(":")[0]
    return {**settings, **{key: value for key, value in DIVERGENCE_SETTINGS.get(name, {}).items() if getattr(args, key) is None}}


def task_settings(args: argparse.Namespace, name: str) -> dict:
    """beta, iterations, batch size, the lr schedule and the matrix's estimators, placements and weightings
    for task ``name``: the command line's where given, else the task kind's (with ``--kl-budgets``, on a random task
    :data:`BUDGET_SETTINGS` over them, on a random-eos task :data:`EOS_BUDGET_SETTINGS`)."""
    kind = name.split(":")[0] if name.startswith(("random-eos:", "rare-eos:")) else "random" if _random(name) else "hand-made"
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


def add_matrix_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The matrix group's options on ``parser``; returns their actions (what one run without --matrix refuses)."""
    group = parser.add_argument_group("matrix (--matrix)")
    actions: list[argparse.Action] = []

    def add(*names, **options) -> None:
        actions.append(group.add_argument(*names, **options))

    add("--matrix", action="store_true", help="train every advantage x estimator x placement x weighting x scope x epochs cell")
    add("--estimators", nargs="+", help="default: the task's (k1 k2 k3 k3+ full hand-made, k1 k3 random)")
    add("--placements", nargs="+", choices=PLACEMENTS, help="default: the task's (reward loss both hand-made, reward loss random)")
    add("--weightings", nargs="+", choices=WEIGHTINGS, help="default: the task's (none importance hand-made, importance random)")
    add(
        "--scopes",
        nargs="+",
        choices=SCOPES,
        default=list(SCOPES),
        help="model.kl.loss_scope of the 'loss' cells (default both; one-token tasks: sequence only)",
    )
    add("--epochs", nargs="+", type=option_number(integer=True, at_least=1), default=[1, 4], help="ppo_epochs values (default 1 4)")
    add(
        "--aggregations",
        nargs="+",
        choices=AGGREGATIONS,
        help="model.loss_aggregation values, one matrix dimension (default: each advantage estimator's own, token_mean "
        "but constant for dr_grpo); on responses of different lengths seq_mean_token_mean with the KL in the loss is "
        "length_weighted (docs/kl-estimators.md)",
    )
    add("--jobs", type=option_number(integer=True, at_least=1), default=1, help="cells trained in parallel processes (default 1)")
    add(
        "--max-staleness",
        nargs="+",
        type=option_number(integer=True, at_least=0),
        default=[0],
        help="model.off_policy.max_staleness values, one matrix dimension (default 0, synchronous): each batch sampled from "
        "the weights of k iterations ago (docs/kl-estimators.md, 'Stale samples')",
    )
    add(
        "--corrections",
        nargs="+",
        choices=tuple(OFF_POLICY_WEIGHTS),
        default=["sequence", "none"],
        help="model.off_policy.correction values of the stale cells (default sequence none)",
    )
    add(
        "--correction-cap",
        type=option_number(at_least=1),
        help="model.off_policy.correction_cap of the stale cells (default the setting's, 5)",
    )
    add(
        "--expected-gradient",
        action="store_true",
        help="replace every rollout by its exact expectation (exact.training.expected_train): where each cell's expected gradient "
        "leads, without sampling noise; the advantage exact (a perfect critic's: --advantage ignored), the KL in the reward "
        "in the exact return",
    )
    add(
        "--tabular",
        action="store_true",
        help="a tabular policy (one logit vector per prompt and prefix, exact.training.sampled_ppo) in place of the tiny Llama: "
        "sampled responses (the task's --batch-size), the module's loss pieces, the exact advantage for gae (a perfect "
        "critic's) or the critic-free --advantage's own, Adam at --tabular-lr; KL in the loss only. Where the sampled loss settles when no shared network "
        'couples the states (docs/results.md, "Tenth round")',
    )
    add("--tabular-lr", type=option_number(above=0), help="with --tabular: Adam's lr on the logits (default 0.05)")
    add(
        "--expected-noise",
        action="store_true",
        help="with --expected-gradient: each step weighs the responses by a draw of the iteration's --batch-size from "
        "pi_old (sampling --seed) instead of by pi_old: the sampled loop's noise, with the exact advantage and loss",
    )
    return actions


def expected_class(
    estimator: str, placement: str, weighting: str, scope: str = "sequence", advantage: str = "gae", aggregation: str = "token_mean"
) -> str:
    """What the theory (docs/kl-estimators.md, "Which recipe reaches which optimum") says of a cell:
    ``unbiased``, ``per_token``, ``drift`` or ``biased``, from the one table the module's start-up
    warning reads (``rlhf_lightning.recipes.kl_recipe``, where the classes are defined). ``grpo`` with
    any KL outside the reward is biased whatever the recipe: its division by each group's reward std
    weighs each prompt's reward against its KL differently (the objective is sum_x (E r - beta std_x
    KL), not J); in the reward the std divides both alike."""
    if advantage == "grpo" and placement != "reward":
        return "biased"
    return kl_recipe(registry("kl_estimator").create(estimator), placement, weighting, scope, aggregation)[0]


def default_aggregation(advantage: str) -> str:
    """The loss aggregation PPORLHF picks for ``advantage`` when none is given (``args._loss_aggregation``)."""
    return registry("advantage_estimator").get(advantage).loss_aggregation or "token_mean"


@dataclass(frozen=True)
class Cell:
    task: str
    advantage: str
    estimator: str
    placement: str
    weighting: str  # n/a: the KL is in the reward, or the estimator does not read the sampled token (full)
    scope: str  # n/a: no KL in the loss, or the reward carries the sequence term ('both')
    epochs: int
    seed: int
    aggregation: str = "token_mean"
    staleness: int = 0  # model.off_policy.max_staleness
    correction: str = "n/a"  # model.off_policy.correction, with staleness > 0

    @property
    def expected(self) -> str:
        return expected_class(self.estimator, self.placement, self.weighting, self.scope, self.advantage, self.aggregation)


def matrix_cells(args: argparse.Namespace) -> list[Cell]:
    """Every (task, advantage, estimator, placement, weighting, scope, epochs, seed) that differs from the
    others: the weighting only where the KL is in the loss and the estimator reads the sampled token, the
    scope only with ``loss``, on responses of more than one token (one token has no KL to come), and an
    estimator with a biased value (k2) only per token (PPORLHF refuses it with the sequence scope)."""
    cells = []
    for task in args.task:
        cells += _task_cells(args, task)
    return cells


def _task_cells(args: argparse.Namespace, task: str) -> list[Cell]:
    settings, cells = task_settings(args, task), []
    for advantage, estimator, placement, epochs, seed, aggregation in itertools.product(
        args.advantage, settings["estimators"], settings["placements"], args.epochs, args.seed, args.aggregations or [None]
    ):
        aggregation = aggregation or default_aggregation(advantage)
        token_free = not registry("kl_estimator").create(estimator).reads_sampled_token()  # full: no ratio to weigh by
        weightings = ("n/a",) if placement == "reward" or token_free else settings["weightings"]
        scopes = ("n/a",) if placement != "loss" else ("sequence",) if _one_token(task) else args.scopes
        for weighting, scope in itertools.product(weightings, scopes):
            if scope == "sequence" and not registry("kl_estimator").create(estimator).unbiased_value:
                continue
            cell = Cell(task, advantage, estimator, placement, weighting, scope, epochs, seed, aggregation)
            stale = [replace(cell, staleness=k, correction=c) for k in args.max_staleness if k for c in args.corrections]
            cells += ([cell] if 0 in args.max_staleness else []) + stale
    return cells


def _one_token(task: str) -> bool:
    return not _random(task) and task_named(task).response_length == 1


def run_cell(args: argparse.Namespace, cell: Cell) -> dict:
    """Train one cell with the task's settings; its last exact row, the seconds it took and the cell.
    The task is built in the worker (a random task builds its reference model), from its name."""
    _quiet()
    settings = task_settings(args, cell.task)
    weighting = "importance" if cell.weighting == "importance" else "none"
    scope = "per_token" if cell.scope == "per_token" else "sequence"
    iterations = iterations_of(settings, cell.advantage, cell.placement, cell.scope)
    start = time.perf_counter()
    aggregation = {"loss_aggregation": cell.aggregation} if args.aggregations else {}
    if args.tabular:
        task = task_named(cell.task)
        require(not task.eos, "--tabular", "a task of fixed-length responses (exact.training.sampled_ppo's table has no EOS)", cell.task)
        ref, rewards = reference_logprobs(task, cell.seed), task.rewards()
        logprobs = sampled_ppo(
            ref,
            rewards,
            settings["beta"],
            len(task.content_tokens),
            cell.estimator,
            scope,
            iterations=iterations,
            responses=recipe_value(settings, "batch_size", cell.advantage, cell.placement, cell.scope),  # no end batch
            epochs=cell.epochs,
            updates=num_minibatches(settings, cell.epochs) * cell.epochs,
            lr=args.tabular_lr,
            lr_final=final_lr(settings, cell.advantage),
            seed=cell.seed,
            advantage=None if cell.advantage == "gae" else cell.advantage,  # gae: the exact advantage, a perfect critic's
            group_size=settings["num_generations"],
        )
        report = optimum_report(logprobs, ref, rewards, settings["beta"], len(task.content_tokens))
        return {**vars(report), "iteration": iterations, "seconds": time.perf_counter() - start, "cell": cell}
    if args.expected_gradient:
        rows = expected_train(
            task_named(cell.task),
            iterations,
            settings["beta"],
            lr=args.lr,
            lr_final=final_lr(settings, "gae"),  # the exact advantage: a perfect critic's
            lr_hold=settings["lr_hold"],
            every=iterations,
            kl_estimator=cell.estimator,
            kl_penalty=cell.placement,
            kl_loss_weighting=weighting,
            kl_loss_scope=scope,
            ppo_epochs=cell.epochs,
            num_minibatches=num_minibatches(settings, cell.epochs),
            responses=recipe_value(settings, "batch_size", cell.advantage, cell.placement, cell.scope) if args.expected_noise else None,
            seed=cell.seed,
            max_grad_norm=args.max_grad_norm,
            log_samples_every_n_steps=0,
            staleness=cell.staleness,
            correction=cell.correction if cell.staleness else "none",
            correction_cap=correction_cap(args),
            **aggregation,
        )
        return {**rows[-1], "seconds": time.perf_counter() - start, "cell": cell}
    _, tracker = train(
        task_named(cell.task),
        iterations,
        every=iterations,
        seed=cell.seed,
        **recipe_settings(args, settings, cell.advantage, cell.estimator, cell.placement, weighting, scope, cell.epochs),
        **aggregation,
        **stale_settings(args, cell),
    )
    return {**tracker.last, "seconds": time.perf_counter() - start, "cell": cell}


def correction_cap(args: argparse.Namespace) -> float:
    """The stale cells' ``model.off_policy.correction_cap``: the command line's, else the setting's default."""
    return args.correction_cap or OffPolicyArgs.correction_cap


def stale_settings(args: argparse.Namespace, cell: Cell) -> dict:
    """train() arguments of a stale cell: ``model.off_policy`` (max_staleness, correction, its cap) and the PPO ratio
    anchored at the current weights (``old_logprobs: forward``); none for a synchronous cell."""
    if not cell.staleness:
        return {}
    off_policy = {"max_staleness": cell.staleness, "correction": cell.correction, "correction_cap": correction_cap(args)}
    return {"off_policy": off_policy, "old_logprobs": "forward"}


def run_matrix(args: argparse.Namespace) -> None:
    if args.expected_gradient:  # the exact advantage: one advantage dimension
        args.advantage = args.advantage[:1]
    if args.tabular:  # only the loss carries the KL
        args.placements = ["loss"]
    cells = matrix_cells(args)
    print(
        f"tasks={args.task} advantages={args.advantage} seeds={args.seed} cells={len(cells)} jobs={args.jobs} expected_gradient={args.expected_gradient} expected_noise={args.expected_noise} tabular={args.tabular}"
    )
    for name in args.task:
        print(f"SETTINGS task={name} " + " ".join(f"{key}={value}" for key, value in task_settings(args, name).items()))
    per_token = {}
    for name in args.task:
        task = task_named(name)
        for seed in args.seed if task.model_seed is None else args.seed[:1]:  # a hand-made task's reference is the seed's
            per_token[name, seed] = per_token_fixed_point_gap(task, task_settings(args, name)["beta"], seed)
            print(f"PER_TOKEN fixed_point_gap={per_token[name, seed]:.4f} task={name} seed={seed}", flush=True)
    start = time.perf_counter()
    gaps: dict[str, list[float]] = {name: [] for name in CLASSES}
    deviations = []  # |gap - the per-token fixed point's gap| of the per_token cells
    distances = []  # their fixed_point_distance: beta KL(pi || fixed point) / |J*|, the gap's unit
    over_seeds: dict[Cell, list[float]] = {}  # gap - the fixed point's gap of each per_token cell, by sampling seed
    own_distances = []  # the length_weighted cells' beta KL(pi || exact.closed_form.weighted_fixed_point) / |J*|
    stale_gaps: dict[tuple[int, str], list[float]] = {}  # (staleness, the correction's class) -> gaps
    # spawn, not fork: a process forked after torch started its OpenMP threads can deadlock in them.
    pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) if args.jobs > 1 else _InProcess()
    with pool:
        for row in pool.map(run_cell, itertools.repeat(args), cells):
            cell = row["cell"]
            if cell.staleness:  # the stale cells: a summary line of their own, by staleness and the correction's class
                stale_gaps.setdefault((cell.staleness, off_policy_recipe(cell.correction, cell.staleness)[0]), []).append(row["gap"])
            else:
                gaps[cell.expected].append(row["gap"])
            fixed_point = per_token.get((cell.task, cell.seed), per_token.get((cell.task, args.seed[0])))
            extra = ""
            if "mean_length" in row:  # the sampled loop's tracker: lengths, and the recipe's own optimum
                extra += (
                    f" mean_length={row['mean_length']:.3f} optimum_mean_length={row['optimum_mean_length']:.3f} "
                    f"truncated={row['truncated']:.3f} optimum_truncated={row['optimum_truncated']:.3f}"
                )
            if cell.expected == "length_weighted" and "own_distance" in row:
                own_distances += [row["own_distance"]] if row["own_distance"] == row["own_distance"] else []  # NaN: none computed
                extra += f" own_gap={row['own_gap']:.4f} own_distance={row['own_distance']:.4f}"
            if cell.expected == "per_token":
                deviations.append(abs(row["gap"] - fixed_point))
                distances.append(row["fixed_point_distance"])
                over_seeds.setdefault(replace(cell, seed=-1), []).append(row["gap"] - fixed_point)
                extra += f" fixed_point_gap={fixed_point:.4f} fixed_point_distance={row['fixed_point_distance']:.4f}"
            print(
                f"OPTIMUM task={cell.task} seed={cell.seed} advantage={cell.advantage} estimator={cell.estimator} "
                f"placement={cell.placement} weighting={cell.weighting} scope={cell.scope} epochs={cell.epochs} "
                f"aggregation={cell.aggregation} {stale_fields(cell, row)}"
                f"gap={row['gap']:.4f} kl_ref_exact={row['kl_to_ref']:.4f} kl_opt={row['optimum_kl_to_ref']:.4f} "
                f"kl_to_opt={row['kl_to_optimum']:.4f} expected={cell.expected}{extra} "
                f"iterations={row['iteration']} seconds={row['seconds']:.1f}",
                flush=True,
            )
    nan, mean_deviations = float("nan"), []
    for cell, signed in over_seeds.items() if len(args.seed) > 1 else ():
        mean = statistics.mean(signed)
        mean_deviations.append(abs(mean))
        print(
            f"SEEDS task={cell.task} advantage={cell.advantage} estimator={cell.estimator} scope={cell.scope} epochs={cell.epochs} "
            f"n={len(signed)} deviation_mean={mean:+.4f} deviation_std={statistics.stdev(signed):.4f}"
        )
    print(
        f"MATRIX unbiased_max_gap={max(gaps['unbiased'], default=nan):.4f} biased_min_gap={min(gaps['biased'], default=nan):.4f} "
        f"per_token_min_fixed_point_gap={min(per_token.values()):.4f} per_token_max_deviation={max(deviations, default=nan):.4f} "
        f"per_token_max_mean_deviation={max(mean_deviations, default=nan):.4f} "
        f"per_token_max_fixed_point_distance={max(distances, default=nan):.4f} "
        f"length_weighted_max_own_distance={max(own_distances, default=nan):.4f} "
        f"high_variance_max_gap={max(gaps['high_variance'], default=nan):.4f} "
        f"drift_max_gap={max(gaps['drift'], default=nan):.4f} wall_s={time.perf_counter() - start:.0f} cpu_s={user_cpu_seconds():.0f}"
    )
    for (staleness, recipe), values in sorted(stale_gaps.items()):
        print(f"STALE staleness={staleness} correction_class={recipe} n={len(values)} max_gap={max(values):.4f} min_gap={min(values):.4f}")


def stale_fields(cell: Cell, row: dict) -> str:
    """A stale cell's fields of its OPTIMUM line: staleness, correction and its class (``recipes.off_policy_recipe``),
    and the last iteration's ``off_policy/ess`` and ``off_policy/clipped_fraction`` where the row has them."""
    if not cell.staleness:
        return ""
    fields = f"staleness={cell.staleness} correction={cell.correction} off_policy={off_policy_recipe(cell.correction, cell.staleness)[0]} "
    for name in ("ess", "clipped_fraction"):
        if f"off_policy/{name}" in row:
            fields += f"{name}={row[f'off_policy/{name}']:.3f} "
    return fields


def user_cpu_seconds() -> float:
    """User CPU time of this process and of its children that have ended (the ``--jobs`` workers once their
    pool has shut down): the matrix's budget, in the unit of ``/usr/bin/time``'s "User time"."""
    times = os.times()
    return times.user + times.children_user


class _InProcess:
    """``ProcessPoolExecutor``'s map, in this process (``--jobs 1``)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    map = staticmethod(map)


def _quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")  # eval-mode reference (on purpose), no val loop, deprecations


if __name__ == "__main__":
    main()
