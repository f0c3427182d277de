"""Train PPORLHF on a task small enough to enumerate and measure how far it lands from the
closed-form optimum of the KL-regularised objective (see rlhf_lightning/exact/).

    python -m tools.studies.optimum_check --estimator k1 --beta 0.5 --iterations 100
    python -m tools.studies.optimum_check --advantage rloo --num-generations 4     # critic-free
    python -m tools.studies.optimum_check --beta 1.5 --reference reset --resets 3  # 3 phases, reset after each
    python -m tools.studies.optimum_check --task random:3 --kl-penalty loss --estimator k3 --kl-loss-scope per_token --seed 0 1 2

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

One run per task, sampling seed and divergence prints its rows and its last lines (single.py: the OPTIMUM line and,
with ``--temperature``/``--top-p``/``--top-k``, ``--kl-budgets`` or ``--reference``, the KEPT, BUDGET and ITERATED
lines); ``--matrix`` trains a matrix of KL recipes instead (matrix.py: the cells, ``--expected-gradient``,
``--tabular``, ``--max-staleness``). Each kind of task's recipe, where the command line gives none: recipes.py.
"""

from __future__ import annotations

import argparse
import itertools

from rlhf_lightning.args import OFF_POLICY_WEIGHTS
from rlhf_lightning.exact.f_divergence import divergence_named
from rlhf_lightning.exact.tasks import TASK_CHOICES, task_named
from tools._cli_args import option_number, tool_parser
from tools.studies.optimum_check import matrix, single
from tools.studies.optimum_check.matrix import AGGREGATIONS
from tools.studies.optimum_check.recipes import PLACEMENTS, SCOPES, WEIGHTINGS, is_random_task, quiet, task_settings


def main(argv=None) -> None:
    """One run per task, seed and divergence, or with ``--matrix`` the matrix's cells."""
    args = parse_args(argv)
    quiet()
    if args.matrix:
        matrix.run(args)
    else:
        single.main(args)


def parse_args(argv=None) -> argparse.Namespace:
    parser = tool_parser(__spec__.name, __doc__, first_paragraph=True)
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


def _task(name: str) -> str:
    """argparse type of ``--task``: the name itself, checked."""
    try:
        if not is_random_task(name):  # random tasks are built (a model each) when used
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
