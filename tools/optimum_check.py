"""Train PPORLHF on a task small enough to enumerate and measure how far it lands from the
closed-form optimum of the KL-regularised objective (see rlhf_lightning/exact.py).

    python tools/optimum_check.py --estimator k1 --beta 0.5 --iterations 100
    python tools/optimum_check.py --advantage rloo --num-generations 4     # critic-free
    python tools/optimum_check.py --beta 1.5 --reference reset --resets 3  # 3 phases, reset after each

Every ``--every`` iterations it prints the exact objective J(pi), the relative gap
(J* - J(pi)) / |J*|, KL(pi || pi*), the exact KL(pi || pi_ref) and the mean logged estimate
of it (objective/kl over the iterations since the previous row). The last line reads

    OPTIMUM gap=<gap> kl_to_opt=<KL(pi||pi*)> kl_ref_exact=<KL(pi||pi_ref)> kl_ref_logged=<objective/kl>

beta is fixed (controller ``fixed``). With the penalty in the reward only k1 reaches the
optimum: k3 and full in the reward drop part of the KL's gradient and collapse towards the
reward maximiser; ``--kl-penalty both --no-whiten`` restores the missing term for them.
About 15 s on a 2-core CPU for the defaults.

``--reference sync|reset|ema --resets k`` trains k phases of ``--iterations`` iterations (the learning
rate decays within each phase) and moves the reference after each phase, the last at the very end.
Converged phases make the reference pi_j ∝ pi_0 exp(j r / beta) after j resets, so the final policy
is compared with pi_k (EMA: pi_{1 + (k - 1) alpha}); a further line reads

    ITERATED k=<k> gap=<gap of J at beta / k, reference pi_0> kl_to_opt=<KL(pi||pi_k)>
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

from rlhf_lightning.exact import TASKS, train
from rlhf_lightning_plugins.advantage_estimators import GAE
from rlhf_lightning_plugins.beta_controllers import FixedBeta
from rlhf_lightning_plugins.reference_updates import EMA, Reset, Sync


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--estimator", default="k1", help="KL estimator: k1, k3, full or any registered name (default k1)")
    parser.add_argument("--beta", type=float, default=0.5, help="fixed KL coefficient (default 0.5)")
    parser.add_argument("--iterations", type=int, default=100, help="PPO iterations (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny model's initialisation and of sampling")
    parser.add_argument("--task", choices=sorted(TASKS), default="terminal",
                        help="terminal: 3 prompts, 3-token responses over 3 tokens, reward = count of the prompt's "
                             "letter; bandit: the same with 1-token responses (default terminal)")  # fmt: skip
    parser.add_argument("--kl-penalty", choices=("reward", "loss", "both"), default="reward", help="where beta * KL goes")
    parser.add_argument("--no-whiten", action="store_true", help="do not whiten advantages (gae)")
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


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")  # eval-mode reference (on purpose), no val loop, deprecations
    print(f"task={args.task} estimator={args.estimator} kl_penalty={args.kl_penalty} beta={args.beta} "
          f"advantage={args.advantage} num_generations={args.num_generations} iterations={args.iterations} seed={args.seed}")  # fmt: skip
    print(f"{'iter':>5} {'J':>8} {'J*':>8} {'gap':>8} {'kl_to_opt':>10} {'kl_ref_exact':>13} {'kl_ref_logged':>14}")
    start = time.perf_counter()
    critic = {"critic_lr": args.lr, "vf_coef": 0.5} if args.advantage == "gae" else {}
    _, tracker = train(
        TASKS[args.task], **reference_settings(args), batch_size=args.batch_size, every=args.every, seed=args.seed,
        lr_final=args.lr_final, kl_estimator=args.estimator, beta_controller=FixedBeta(args.beta),
        kl_penalty=args.kl_penalty, whiten_advantages=False if args.no_whiten else None, lr=args.lr,
        advantage_estimator=GAE(lam=args.lam) if args.advantage == "gae" else args.advantage,
        num_generations=args.num_generations, ppo_epochs=args.ppo_epochs, num_minibatches=2,
        log_samples_every_n_steps=0, **critic,
    )  # fmt: skip
    for row in tracker.rows:
        print(f"{row['iteration']:5d} {row['objective']:8.4f} {row['optimum']:8.4f} {row['gap']:8.4f} "
              f"{row['kl_to_optimum']:10.4f} {row['kl_to_ref']:13.4f} {row['kl_logged']:14.4f}")  # fmt: skip
    last = tracker.last
    print(f"KL(pi*||pi_ref)={last['optimum_kl_to_ref']:.4f}  {time.perf_counter() - start:.1f} s")
    print(f"OPTIMUM gap={last['gap']:.4f} kl_to_opt={last['kl_to_optimum']:.4f} "
          f"kl_ref_exact={last['kl_to_ref']:.4f} kl_ref_logged={last['kl_logged']:.4f}")  # fmt: skip
    if args.reference != "none":
        print_iterated(tracker.rows)


if __name__ == "__main__":
    main()
