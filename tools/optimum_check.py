"""Train PPORLHF on a task small enough to enumerate and measure how far it lands from the
closed-form optimum of the KL-regularised objective (see rlhf_lightning/exact.py).

    python tools/optimum_check.py --estimator k1 --beta 0.5 --iterations 100
    python tools/optimum_check.py --advantage rloo --num-generations 4     # critic-free
    python tools/optimum_check.py --beta 1.5 --reference reset --resets 3  # 3 phases, reset after each
    python tools/optimum_check.py --task random:1 --beta 1 --kl-penalty loss --estimator k3 --seed 0 1 2

``--task`` names a hand-made task (terminal, bandit) or ``random:SEED``, ``ExactTask.random(SEED)``: 2 prompts,
4 tokens, responses of 4, a reward that depends on token order and a reference initialised from SEED.
Several tasks, and several sampling ``--seed`` values (the task's reference stays the same), train one
after another; with more than one seed a ``SEEDS task=... gap_mean= gap_std=`` line follows each task.
Every run first prints

    PER_TOKEN fixed_point_gap=<gap> task=<task> seed=<seed>

the exact gap of the fixed point of a per-token KL loss (``exact.backward_induction(soft=False)``): where a
KL in the loss without the sequence term converges. Random tasks where it is >= 0.05 at beta 1: seeds 1
(0.210), 4 (0.072), 5 (0.095), 6 (0.080), 7 (0.057), 8 (0.156), 9 (0.152), 10 (0.141).

Every ``--every`` iterations it prints the exact objective J(pi), the relative gap
(J* - J(pi)) / |J*|, KL(pi || pi*), the exact KL(pi || pi_ref) and the mean logged estimate
of it (objective/kl over the iterations since the previous row). The last line reads

    OPTIMUM task=<task> seed=<seed> gap=<gap> kl_to_opt=<KL(pi||pi*)> kl_ref_exact=<KL(pi||pi_ref)> kl_ref_logged=<objective/kl>

beta is fixed (controller ``fixed``). With the penalty in the reward only k1 reaches the
optimum: k3 and full in the reward drop part of the KL's gradient and collapse towards the
reward maximiser; ``--kl-penalty both --no-whiten`` restores the missing term for them.
About 15 s on a 2-core CPU for the defaults.

``--matrix`` trains every cell of task x estimator x placement x kl_loss_weighting x ppo_epochs x seed
(``--task``, ``--estimators``, ``--placements``, ``--weightings``, ``--epochs``, ``--seed`` narrow it; ``--jobs``
runs cells in parallel processes; ``--advantage`` and ``--num-generations`` as for a single run) and prints
the PER_TOKEN line of each task (of each seed, for a hand-made task), one line per cell, then a summary:

    OPTIMUM task=terminal seed=0 estimator=k3 placement=loss weighting=importance epochs=4 gap=... kl_ref_exact=... kl_opt=... expected=unbiased
    MATRIX unbiased_max_gap=<largest gap of the cells called unbiased> biased_min_gap=<smallest of those called biased> drift_max_gap=...
           per_token_min_fixed_point_gap=<smallest PER_TOKEN gap over the tasks>

kl_opt is KL(pi* || pi_ref), where kl_ref_exact should land. ``expected`` is what the theory
(:func:`expected_class`, README "KL in the loss over several PPO epochs") says of the cell.
Advantages are whitened where the KL is only in the reward and not whitened where it is in the
loss (PPORLHF refuses that combination). About 9 CPU minutes (270 s with --jobs 2) for the whole
terminal-task matrix.

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
import statistics
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

from rlhf_lightning.exact import TASKS, per_token_fixed_point_gap, task_named, train
from rlhf_lightning_plugins.advantage_estimators import GAE
from rlhf_lightning_plugins.beta_controllers import FixedBeta
from rlhf_lightning_plugins.reference_updates import EMA, Reset, Sync


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_matrix_args(parser)
    parser.add_argument("--estimator", default="k1", help="KL estimator: k1, k3, full or any registered name (default k1)")
    parser.add_argument("--beta", type=float, default=0.5, help="fixed KL coefficient (default 0.5)")
    parser.add_argument("--iterations", type=int, default=100, help="PPO iterations (default 100)")
    parser.add_argument("--seed", type=int, nargs="+", default=[0],
                        help="sampling seeds, one run each (default 0); a hand-made task's initialisation too")  # fmt: skip
    parser.add_argument("--task", type=_task, nargs="+", default=["terminal"],
                        help="terminal: 3 prompts, 3-token responses over 3 tokens, reward = count of the prompt's letter; "
                             "bandit: the same with 1-token responses; random:SEED: ExactTask.random(SEED) (default terminal)")  # fmt: skip
    parser.add_argument("--kl-penalty", choices=("reward", "loss", "both"), default="reward", help="where beta * KL goes")
    parser.add_argument("--no-whiten", action="store_true", help="do not whiten advantages (gae)")
    parser.add_argument("--kl-loss-weighting", choices=("importance", "none"), default="importance",
                        help="model.kl_loss_weighting of a KL in the loss (default importance)")  # fmt: skip
    parser.add_argument("--advantage", default="gae",
                        help="advantage estimator: gae (critic), grpo, dr_grpo, rloo, reinforce_pp (no critic)")  # fmt: skip
    parser.add_argument("--num-generations", type=int, default=1, help="responses per prompt (>= 2 for group baselines)")
    parser.add_argument("--batch-size", type=int, default=48,
                        help="responses per iteration, a multiple of the prompts times --num-generations")  # fmt: skip
    parser.add_argument("--lr", type=float, default=2e-3, help="policy and critic learning rate")
    parser.add_argument("--lr-final", type=float, default=0.1, help="linear decay of the learning rate to this fraction")
    parser.add_argument("--ppo-epochs", type=int, default=4)
    parser.add_argument("--lam", type=float, default=1.0, help="GAE lambda (1: Monte Carlo returns minus the critic)")
    parser.add_argument("--every", type=int, default=10, help="print the exact quantities every N iterations")
    add_reference_args(parser)
    return parser.parse_args(argv)


def add_reference_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("a reference that moves")
    group.add_argument("--reference", choices=("none", "sync", "reset", "ema"), default="none",
                       help="reference update after each phase of --iterations iterations (default none)")  # fmt: skip
    group.add_argument("--resets", type=int, default=1, help="phases, each followed by a reference update (default 1)")
    group.add_argument("--alpha", type=float, default=0.5, help="EMA weight of the policy in each update (default 0.5)")


def reference_settings(args: argparse.Namespace) -> dict:
    """train() arguments for --reference/--resets: total iterations, the update plugin, per-phase lr decay."""
    if args.reference == "none":
        return {"iterations": args.iterations}
    if args.reference == "ema":
        update = EMA(args.alpha, every_n_iterations=args.iterations)
    else:
        update = {"sync": Sync, "reset": Reset}[args.reference](args.iterations)
    return {"iterations": args.iterations * args.resets, "reference_update": update, "lr_period": args.iterations}


def print_iterated(rows: list[dict]) -> None:
    """The iterated optimum's columns of every row, then the ITERATED line of the last."""
    print(f"{'iter':>5} {'k':>5} {'gap_to_pi_k':>12} {'kl_to_pi_k':>11} {'kl_to_pi_0':>11}")
    for row in rows:
        print(f"{row['iteration']:5d} {row['k']:5.2f} {row['iterated_gap']:12.4f} {row['iterated_kl_to_optimum']:11.4f} "
              f"{row['kl_to_initial']:11.4f}")  # fmt: skip
    last = rows[-1]
    print(f"ITERATED k={last['k']:.2f} gap={last['iterated_gap']:.4f} kl_to_opt={last['iterated_kl_to_optimum']:.4f}")


def _task(name: str) -> str:
    """argparse type of ``--task``: the name itself, checked."""
    try:
        if not name.startswith("random:"):  # random tasks are built (a model each) when used
            task_named(name)
        elif not name.split(":", 1)[1].isdigit():
            raise ValueError
    except Exception:
        raise argparse.ArgumentTypeError(f"{name!r} is not one of {sorted(TASKS)} or random:SEED") from None
    return name


def advantage_settings(args: argparse.Namespace) -> dict:
    """train() arguments for --advantage: the estimator, its critic (gae) or its group size."""
    if args.advantage == "gae":
        return {"advantage_estimator": GAE(lam=args.lam), "critic_lr": args.lr, "vf_coef": 0.5}
    return {"advantage_estimator": args.advantage, "num_generations": args.num_generations}


def main(argv=None) -> None:
    args = parse_args(argv)
    _quiet()
    if args.matrix:
        run_matrix(args)
        return
    for name in args.task:
        task = task_named(name)
        print(f"task={name} estimator={args.estimator} kl_penalty={args.kl_penalty} beta={args.beta} advantage={args.advantage} "
              f"num_generations={args.num_generations} iterations={args.iterations} seeds={args.seed}")  # fmt: skip
        gaps = [run_single(args, name, task, seed) for seed in args.seed]
        if len(gaps) > 1:
            print(f"SEEDS task={name} n={len(gaps)} gap_mean={statistics.mean(gaps):.4f} gap_std={statistics.stdev(gaps):.4f} "
                  f"gap_min={min(gaps):.4f} gap_max={max(gaps):.4f}")  # fmt: skip


def run_single(args: argparse.Namespace, name: str, task, seed: int) -> float:
    """Train one run with the command line's settings and sampling ``seed``; print its rows; its final gap."""
    print(f"PER_TOKEN fixed_point_gap={per_token_fixed_point_gap(task, args.beta, seed):.4f} task={name} seed={seed}", flush=True)
    print(f"{'iter':>5} {'J':>8} {'J*':>8} {'gap':>8} {'kl_to_opt':>10} {'kl_ref_exact':>13} {'kl_ref_logged':>14}")
    start = time.perf_counter()
    _, tracker = train(
        task, **reference_settings(args), batch_size=args.batch_size, every=args.every, seed=seed,
        lr_final=args.lr_final, kl_estimator=args.estimator, beta_controller=FixedBeta(args.beta),
        kl_penalty=args.kl_penalty, kl_loss_weighting=args.kl_loss_weighting,
        whiten_advantages=False if args.no_whiten else None, lr=args.lr, ppo_epochs=args.ppo_epochs, num_minibatches=2,
        log_samples_every_n_steps=0, **advantage_settings(args),
    )  # fmt: skip
    for row in tracker.rows:
        print(f"{row['iteration']:5d} {row['objective']:8.4f} {row['optimum']:8.4f} {row['gap']:8.4f} "
              f"{row['kl_to_optimum']:10.4f} {row['kl_to_ref']:13.4f} {row['kl_logged']:14.4f}")  # fmt: skip
    last = tracker.last
    print(f"KL(pi*||pi_ref)={last['optimum_kl_to_ref']:.4f}  {time.perf_counter() - start:.1f} s")
    print(f"OPTIMUM task={name} seed={seed} gap={last['gap']:.4f} kl_to_opt={last['kl_to_optimum']:.4f} "
          f"kl_ref_exact={last['kl_to_ref']:.4f} kl_ref_logged={last['kl_logged']:.4f}", flush=True)  # fmt: skip
    if args.reference != "none":
        print_iterated(tracker.rows)
    return last["gap"]


# ---------------------------------------------------------------------- --matrix
MATRIX_ESTIMATORS = ("k1", "k2", "k3", "k3+", "full")
PLACEMENTS = ("reward", "loss", "both")
WEIGHTINGS = ("none", "importance")
VALUE_UNBIASED = {"k1", "k3", "full"}  # E_pi[k] = KL(pi || pi_ref) at each position
GRADIENT_UNBIASED = {"k2", "k3+", "full"}  # on-policy E_pi[grad k] = grad KL(pi || pi_ref) at each position
TOKEN_FREE = {"full"}  # the same value whichever token was sampled: exact at pi_theta on pi_old's states


def add_matrix_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("matrix (--matrix)")
    group.add_argument("--matrix", action="store_true", help="train every estimator x placement x weighting x epochs cell")
    group.add_argument("--estimators", nargs="+", default=list(MATRIX_ESTIMATORS), help="default: k1 k2 k3 k3+ full")
    group.add_argument("--placements", nargs="+", choices=PLACEMENTS, default=list(PLACEMENTS))
    group.add_argument("--weightings", nargs="+", choices=WEIGHTINGS, default=list(WEIGHTINGS))
    group.add_argument("--epochs", nargs="+", type=int, default=[1, 4], help="ppo_epochs values (default 1 4)")
    group.add_argument("--jobs", type=int, default=1, help="cells trained in parallel processes (default 1)")


def expected_class(estimator: str, placement: str, weighting: str) -> str:
    """What the theory (README, "KL in the loss over several PPO epochs") says of a cell's expected
    gradient against that of J = E r - beta KL(pi || pi_ref), per token (s = grad log pi):

    ``unbiased``: right at every minibatch of every epoch. ``biased``: wrong even on-policy.
    ``drift``: right on the rollout's first minibatch only: an unweighted token-dependent loss term
    evaluated at pi_theta on tokens drawn from pi_old (off by O(how far pi_theta moved)).

    reward: PPO follows E[s_t sum_{t'>=t} k_t'] (importance weighted by its own ratio): the KL's gradient only for k1.
    loss, none: E_old[grad k]: the KL's for k2, k3+ (on-policy, then drift) and full (its value is every token's).
    loss, importance: E_old[w (k s + grad k)] = grad E_theta[k]: the KL's for value-unbiased k (k1, k3, full).
    both: reward k s + loss grad k: the KL's for value-unbiased k; unweighted, k1 and k3 drift.
    Estimators outside the five built-in ones are classified by membership of the sets above.
    """
    if placement == "reward":
        return "unbiased" if estimator == "k1" else "biased"
    if estimator in TOKEN_FREE:
        return "unbiased"
    right = GRADIENT_UNBIASED if (placement, weighting) == ("loss", "none") else VALUE_UNBIASED
    if estimator not in right:
        return "biased"
    return "drift" if weighting == "none" else "unbiased"


Cell = tuple[str, str, str, str, int, int]  # (task, estimator, placement, weighting, epochs, sampling seed)


def matrix_cells(args: argparse.Namespace) -> list[Cell]:
    """Every (task, estimator, placement, weighting, epochs, seed); the weighting only applies where the KL is in the loss."""
    cells = []
    for task, estimator, placement, epochs, seed in itertools.product(args.task, args.estimators, args.placements, args.epochs, args.seed):
        for weighting in ("n/a",) if placement == "reward" else args.weightings:
            cells.append((task, estimator, placement, weighting, epochs, seed))
    return cells


def run_cell(args: argparse.Namespace, cell: Cell) -> dict:
    """Train one cell with the single run's settings; its last exact row, the seconds it took and the cell.
    The task is built in the worker (a random task builds its reference model), from its name."""
    _quiet()
    task, estimator, placement, weighting, epochs, seed = cell
    start = time.perf_counter()
    _, tracker = train(
        task_named(task), args.iterations, batch_size=args.batch_size, every=args.iterations, seed=seed,
        lr_final=args.lr_final, kl_estimator=estimator, beta_controller=FixedBeta(args.beta), kl_penalty=placement,
        kl_loss_weighting="none" if weighting == "n/a" else weighting, whiten_advantages=placement == "reward",
        lr=args.lr, ppo_epochs=epochs, num_minibatches=2, log_samples_every_n_steps=0, **advantage_settings(args),
    )  # fmt: skip
    return {**tracker.last, "seconds": time.perf_counter() - start, "cell": cell}


def run_matrix(args: argparse.Namespace) -> None:
    cells = matrix_cells(args)
    print(f"tasks={args.task} beta={args.beta} iterations={args.iterations} seeds={args.seed} advantage={args.advantage} "
          f"cells={len(cells)} jobs={args.jobs}")  # fmt: skip
    per_token = {}
    for name in args.task:
        task = task_named(name)
        for seed in args.seed if task.model_seed is None else args.seed[:1]:  # a hand-made task's reference is the seed's
            per_token[name, seed] = per_token_fixed_point_gap(task, args.beta, seed)
            print(f"PER_TOKEN fixed_point_gap={per_token[name, seed]:.4f} task={name} seed={seed}", flush=True)
    start = time.perf_counter()
    gaps: dict[str, list[float]] = {"unbiased": [], "biased": [], "drift": []}
    with ProcessPoolExecutor(args.jobs) if args.jobs > 1 else _InProcess() as pool:
        for row in pool.map(run_cell, itertools.repeat(args), cells):
            task, estimator, placement, weighting, epochs, seed = row["cell"]
            expected = expected_class(estimator, placement, weighting)
            gaps[expected].append(row["gap"])
            print(f"OPTIMUM task={task} seed={seed} estimator={estimator} placement={placement} weighting={weighting} "
                  f"epochs={epochs} gap={row['gap']:.4f} kl_ref_exact={row['kl_to_ref']:.4f} kl_opt={row['optimum_kl_to_ref']:.4f} "
                  f"kl_to_opt={row['kl_to_optimum']:.4f} expected={expected} "
                  f"seconds={row['seconds']:.1f}", flush=True)  # fmt: skip
    nan = float("nan")
    print(
        f"MATRIX unbiased_max_gap={max(gaps['unbiased'], default=nan):.4f} biased_min_gap={min(gaps['biased'], default=nan):.4f} "
        f"drift_max_gap={max(gaps['drift'], default=nan):.4f} per_token_min_fixed_point_gap={min(per_token.values()):.4f} "
        f"wall_s={time.perf_counter() - start:.0f}"
    )


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
