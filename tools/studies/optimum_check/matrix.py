"""``--matrix``: every cell of a matrix of KL recipes, trained one after another or in parallel processes.

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
advantage with the reward's KL values in the return, the module's own loss, PPOUpdate.loss): no sampling noise, so its gaps are where each cell's expected
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
(``model.off_policy.correction``: sequence, token, none, icepop, ipo, m2po; default sequence none) at ``--correction-cap`` (default the
setting's, 5). Their lines carry ``staleness= correction= off_policy=<the correction's class, recipes.off_policy_recipe>``
(and, exact, the last iteration's ``ess=`` and ``clipped_fraction=``), and a summary per staleness and class follows
MATRIX (whose classes are the synchronous cells')::

    STALE staleness=<K> correction_class=<exact|approximate|biased> n=<cells> max_gap=<largest gap> min_gap=<smallest>

"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from rlhf_lightning.args import OffPolicyArgs
from rlhf_lightning.checks import require
from rlhf_lightning.exact.closed_form import optimum_report
from rlhf_lightning.exact.tasks import per_token_fixed_point_gap, reference_logprobs, task_named
from rlhf_lightning.exact.training import expected_train, sampled_ppo, train
from rlhf_lightning.recipes import kl_recipe, off_policy_recipe
from rlhf_lightning.registry import registry
from tools.studies.optimum_check.recipes import (
    final_lr,
    is_random_task,
    iterations_of,
    num_minibatches,
    quiet,
    recipe_settings,
    recipe_value,
    task_settings,
)

CLASSES = ("unbiased", "per_token", "length_weighted", "high_variance", "drift", "biased")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")


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
    inflight_every: int = 0  # model.off_policy.inflight_every, with staleness >= 2 (in-flight weight updates)

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
    return not is_random_task(task) and task_named(task).response_length == 1


def run_cell(args: argparse.Namespace, cell: Cell) -> dict:
    """Train one cell with the task's settings; its last exact row, the seconds it took and the cell.
    The task is built in the worker (a random task builds its reference model), from its name."""
    quiet()
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
            inflight_every=cell.inflight_every,
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
    """train() arguments of a stale cell: ``model.off_policy`` (max_staleness, correction, its cap, inflight_every) and the PPO ratio
    anchored at the current weights (``old_logprobs: forward``); none for a synchronous cell."""
    if not cell.staleness:
        return {}
    off_policy = {"max_staleness": cell.staleness, "correction": cell.correction, "correction_cap": correction_cap(args)}
    if cell.inflight_every:
        off_policy["inflight_every"] = cell.inflight_every
    return {"off_policy": off_policy, "old_logprobs": "forward"}


def run(args: argparse.Namespace) -> None:
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
    own_distances = []  # the length_weighted cells' beta KL(pi || exact.weighted_fixed_point) / |J*|
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
