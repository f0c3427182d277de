"""One run per task, sampling seed and divergence, with the command line's settings.

Every ``--every`` iterations it prints the exact objective J(pi), the relative gap
(J* - J(pi)) / |J*|, KL(pi || pi*), the exact KL(pi || pi_ref) and the mean logged estimate
of it (objective/kl over the iterations since the previous row). The last line reads

    OPTIMUM task=<task> seed=<seed> gap=<gap> kl_to_opt=<KL(pi||pi*)> kl_ref_exact=<KL(pi||pi_ref)> kl_ref_logged=<objective/kl> logprob_diff_max=<d>

(d: the largest ``rollout/logprob_diff_max`` of the run, the sampler's log-probs against the trainer's)

beta is fixed (controller ``fixed``). With the penalty in the reward only k1 reaches the
optimum: k3 and full in the reward drop part of the KL's gradient and collapse towards the
reward maximiser; ``--kl-penalty both --no-whiten`` restores the missing term for them.

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
import statistics
import time

from rlhf_lightning.exact.closed_form import prompt_betas, prompt_kls
from rlhf_lightning.exact.f_divergence import divergence_named
from rlhf_lightning.exact.tasks import per_token_fixed_point_gap, task_named
from rlhf_lightning.exact.training import OptimumTracker, train
from tools.studies.optimum_check.recipes import (
    advantage_settings,
    budget_settings,
    divergence_settings,
    iterations_of,
    recipe_settings,
    recipe_value,
    reference_settings,
    sampling_settings,
    task_settings,
)


def main(args: argparse.Namespace) -> None:
    """Each task's runs: one per sampling seed and divergence, and a SEEDS line over several seeds."""
    for name in args.task:
        task, settings = task_named(name), task_settings(args, name)
        print(
            f"task={name} estimator={args.estimator} kl_penalty={args.kl_penalty} kl_loss_scope={args.kl_loss_scope} "
            f"advantage={args.advantage[0]} num_generations={advantage_settings(args, args.advantage[0], settings)['num_generations']} "
            f"beta={settings['beta']} iterations={iterations_of(settings, args.advantage[0], args.kl_penalty, args.kl_loss_scope)} batch_size={recipe_value(settings, 'batch_size', args.advantage[0], args.kl_penalty, args.kl_loss_scope)} seeds={args.seed} "
            f"temperature={args.temperature} top_p={args.top_p} top_k={args.top_k} engine={args.engine} correction={args.rollout_correction}"
        )
        for divergence in args.divergence:
            gaps = [run(args, name, task, seed, divergence) for seed in args.seed]
            if len(gaps) > 1:
                print(
                    f"SEEDS task={name} divergence={divergence} n={len(gaps)} gap_mean={statistics.mean(gaps):.4f} "
                    f"gap_std={statistics.stdev(gaps):.4f} gap_min={min(gaps):.4f} gap_max={max(gaps):.4f}"
                )


def run(args: argparse.Namespace, name: str, task, seed: int, divergence: str = "reverse_kl") -> float:
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
