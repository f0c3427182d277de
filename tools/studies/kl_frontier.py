"""PPO, best-of-N and the exact KL-regularised frontier on one reward-KL plane.

    python -m tools.studies.kl_frontier --exact                      # terminal task: frontier, BoN 1..64, soft BoN, PPO at 4 betas
    python -m tools.studies.kl_frontier --exact --fast               # seconds: one PPO beta of 20 iterations (the tests)
    python -m tools.studies.kl_frontier --exact --task random:3      # a task with distinct rewards and an order-dependent reward
    python -m tools.studies.kl_frontier --smollm2 --prompts 4 --pool 64 --betas 0.3 0.5 --iterations 15 --batch-size 4 \
        --override=--model.advantage_estimator=rloo --override=--model.sampling.num_generations=4 \
        --override=--model.critic=none --override=--model.optim.critic_lr=null   # PPO with RLOO, no critic
    python -m tools.studies.kl_frontier --meter-table                # bias and spread of the sampled log Z against n
    python -m tools.studies.kl_frontier --exact --task random:1 --divergences reverse_kl forward_kl js chi2 alpha:0.5 alpha:-0.5

``--exact`` (``rlhf_lightning.exact``'s enumerable tasks; every number exact): the frontier
pi_beta ∝ pi_ref exp(r / beta) over a dense beta grid (the most reward any policy gets at each
KL), best-of-N for N = 1..64 enumerated with ties (``frontier.bon_logprobs``), soft best-of-N for
N in ``--soft-n`` over a temperature grid, and PPO trained at each of ``--betas``
(``exact.training.train``, the settings of tools/studies/regulariser_frontier.py: k1 in the reward, lr 2e-3 decayed
to 2e-4, 4 epochs of 2 minibatches; iterations and responses per iteration those of the task's kind
in tools/studies/optimum_check/recipes.py, 100 x 48 hand-made, 150 x 384 random) against the reference of its
seed; ``--anneal-from B`` starts each PPO run at beta B and lowers it to its own beta over the first half of
the run (the ``anneal`` controller), which reaches optima that a run fixed at a small beta stops short of
(docs/results.md). Prints a table and

    FRONTIER ppo_max_gap=<largest (F(KL) - reward) / F(KL) of a PPO point, F the frontier at its own KL>
             bon_kl_bound_max_error=<largest log N - (N - 1) / N - KL(BoN || pi_ref) over N>

``--exact --divergences NAME ...`` (``chi2``, ``alpha:0.5``: ``exact.f_divergence.divergence_named``): no training; the optimum
pi*_f of each divergence (``exact.f_divergence.divergence_optimal_logprobs``) over the beta grid, on the same plane (reward
against the exact KL(pi || pi_ref), so that the divergences are compared on one axis), its point at each of
``--betas`` (default 1, where tools/studies/optimum_check/ trains them) marked, and writes
``frontier_divergences.png`` and ``.csv``. The reverse KL's curve is the frontier; every other lies on or below
it (the most reward at a KL is pi_beta's). Prints a table of the marked points and

    DIVERGENCES max_below_frontier=<largest (F(KL) - reward) of any optimum's point, F the reverse KL's frontier>

``--smollm2`` (``--config``, default configs/quickstart.yaml, its reward): best-of-N for N in
``--bon`` from a pool of ``--pool`` reference samples per meter prompt (reward: the unbiased
U-statistic; KL: the bound and the plug-in estimate ``frontier.bon_kl_from_pool``; 95% basic
bootstrap intervals over each prompt's pool), and one PPO run per ``--betas`` (fixed beta,
``--iterations``) measured on the same prompts by ``KLToOptimum`` (reward and KL(pi || pi_ref) of
``--policy-samples`` responses per prompt, +-1.96 SE; and the distance to the optimum where it can
be trusted). The reference pool is the first run's meter pool (every run starts from the same
reference and seed). ``--override`` adds a LightningCLI argument to every run; ``--train-on-meter-prompts``
trains on the meter's prompts alone (the first ``--prompts`` of the config's training set, all of them in
every iteration), so the objective the meter measures is the one trained. The meter measures the
start (the reference, KL(pi_ref || pi_beta)) and every ``--meter-every`` iterations; each measurement is a
point of the run's path on the plane and of the meter's panel. Prints ``SMOLLM2 ...`` lines per point,
with ``fall=`` the distance's fall since the start and its 95% interval (the same log Z pool: its error
cancels, so the interval is the two sets of policy samples' alone).
Runs made one after another (one beta each) join one figure with ``--replot --pool-from
<run>/reference_pool.pt --append <run>/frontier_smollm2.csv ...`` (no training).

``--meter-table``: on the exact task, the log Z estimate's bias and spread against the number of
reference samples (plug-in and delta-corrected), over ``--replicates`` draws, for ``--betas``.

Writes ``<out>/frontier.png`` (or ``frontier_smollm2.png``) and ``<out>/frontier.csv``.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import time
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

from rlhf_lightning.exact import frontier as fr
from rlhf_lightning.exact.closed_form import log_partition
from rlhf_lightning.exact.tasks import reference_logprobs, task_named
from rlhf_lightning.exact.training import train
from tools._cli_args import option_number, tool_parser

BON_N = tuple(range(1, 65))
FRONTIER_BETAS = np.geomspace(0.02, 100, 300)
SOFT_LAMBDAS = np.geomspace(0.05, 20, 25)


def exact_mode(args: argparse.Namespace) -> str:
    # what each kind of task converges with (iterations, responses per iteration), and the PPO settings that put the
    # KL penalty on the frontier there
    from tools.studies.optimum_check.recipes import TASK_SETTINGS, by_recipe
    from tools.studies.regulariser_frontier import PPO

    kind = TASK_SETTINGS["random" if args.task.startswith("random:") else "hand-made"]
    # PPO's cells: k1 in the reward with a critic
    iterations, batch_size = (
        args.iterations or by_recipe(kind["iterations"], "gae"),
        args.batch_size or by_recipe(kind["batch_size"], "gae"),
    )
    task = task_named(args.task)
    ref, rewards = reference_logprobs(task, args.seed), task.rewards()
    curve = [fr.tilted_point(ref, rewards, float(b)) for b in FRONTIER_BETAS]
    bon = {n: fr.plane_point(fr.bon_logprobs(ref, rewards, n), ref, rewards) for n in BON_N}
    bound_error = {n: fr.bon_kl_bound(n) - p.kl for n, p in bon.items()}
    soft = {
        n: [fr.plane_point(fr.soft_bon_logprobs(ref, rewards, n, float(lam)), ref, rewards) for lam in SOFT_LAMBDAS] for n in args.soft_n
    }
    ppo = []
    for beta in args.betas:
        start = time.perf_counter()
        _, tracker = train(
            task,
            iterations,
            every=iterations,
            seed=args.seed,
            kl_estimator="k1",
            beta_controller=beta_ctl(beta, args.anneal_from, iterations),
            **{**PPO, "batch_size": batch_size},
        )
        point = fr.PlanePoint(kl=tracker.last["kl_to_ref"], reward=tracker.last["reward"])
        ppo.append((beta, point, fr.frontier_gap(point, ref, rewards), tracker.last["kl_to_optimum"], time.perf_counter() - start))
    rows = [("frontier", f"{b:.4g}", p) for b, p in zip(FRONTIER_BETAS, curve, strict=True)]
    rows += [("bon", n, p) for n, p in bon.items()]
    rows += [("soft_bon", f"{n}@{lam:.3g}", p) for n, points in soft.items() for lam, p in zip(SOFT_LAMBDAS, points, strict=True)]
    rows += [("ppo", f"{beta:g}", p) for beta, p, *_ in ppo]
    write_csv(args.out / "frontier.csv", ["family", "setting", "kl", "reward"], [(f, s, p.kl, p.reward) for f, s, p in rows])

    print(
        f"task={args.task} seed={args.seed} prompts={len(task.prompts)} responses={ref.shape[1]} iterations={iterations} "
        f"batch_size={batch_size}"
    )
    print("| N | KL(BoN) exact | log N - (N-1)/N | reward | frontier at that KL | gap |\n|---:|---:|---:|---:|---:|---:|")
    for n in (1, 2, 4, 8, 16, 32, 64):
        best = fr.frontier_reward(ref, rewards, bon[n].kl)
        print(f"| {n} | {bon[n].kl:.4f} | {fr.bon_kl_bound(n):.4f} | {bon[n].reward:.4f} | {best:.4f} | {best - bon[n].reward:+.4f} |")
    print(
        "\n| PPO beta | KL exact | reward | frontier at that KL | relative gap | KL(pi‖pi*) | seconds |\n|---:|---:|---:|---:|---:|---:|---:|"
    )
    for beta, point, gap, kl_opt, seconds in ppo:
        best = fr.frontier_reward(ref, rewards, point.kl)
        print(f"| {beta:g} | {point.kl:.4f} | {point.reward:.4f} | {best:.4f} | {gap:+.4f} | {kl_opt:.4f} | {seconds:.0f} |")

    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot([p.kl for p in curve], [p.reward for p in curve], color="black", lw=1.5, label="frontier: pi_beta ∝ pi_ref exp(r/beta)")
    ax.plot(
        [p.kl for p in bon.values()], [p.reward for p in bon.values()], "o", ms=3, color="tab:orange", label="best-of-N, N=1..64 (exact KL)"
    )
    ax.plot(
        [fr.bon_kl_bound(n) for n in bon],
        [p.reward for p in bon.values()],
        "x",
        ms=3,
        color="tab:orange",
        alpha=0.5,
        label="best-of-N at the bound log N - (N-1)/N",
    )
    for n, points in soft.items():
        ax.plot([p.kl for p in points], [p.reward for p in points], "--", lw=1, label=f"soft best-of-{n} (temperature 0.05..20)")
    ax.plot(
        [p.kl for _, p, *_ in ppo], [p.reward for _, p, *_ in ppo], "s", color="tab:blue", ms=6, label="PPO (k1 in the reward), fixed beta"
    )
    for beta, p, *_ in ppo:
        ax.annotate(f"beta={beta:g}", (p.kl, p.reward), textcoords="offset points", xytext=(5, -10), fontsize=7)
    for n in (2, 4, 16, 64):
        ax.annotate(f"N={n}", (bon[n].kl, bon[n].reward), textcoords="offset points", xytext=(-4, 6), fontsize=7, ha="right")
    ax.set_xlim(0, max(fr.bon_kl_bound(64), max(p.kl for _, p, *_ in ppo)) * 1.05)
    line = f"FRONTIER ppo_max_gap={max((g for _, _, g, *_ in ppo), default=math.nan):.4f} bon_kl_bound_max_error={max(bound_error.values()):.4f}"
    title = f"{args.task} task (seed {args.seed}): the reward-KL plane, every point exact"
    return finish_exact_plane(fig, ax, title, args.out / "frontier.png", line)


def beta_ctl(beta: float, anneal_from: Optional[float] = None, iterations: int = 1):
    """PPO's controller at ``beta``: fixed, or (``--anneal-from``) the ``anneal`` schedule from ``anneal_from``
    down to ``beta`` over the first half of the ``iterations``, then ``beta``: the run ends on beta's objective."""
    from rlhf_lightning_plugins.beta_controllers import AnnealedBeta, FixedBeta

    if anneal_from is None:
        return FixedBeta(beta)
    return AnnealedBeta(init_beta=anneal_from, final_beta=beta, iterations=max(iterations // 2, 1))


def meter_table(args: argparse.Namespace) -> list[dict]:
    """Bias and spread of log Z from n reference samples on the exact task, against the exact value."""
    task = task_named(args.task)
    ref, rewards = reference_logprobs(task, args.seed), task.rewards()
    generator = torch.Generator().manual_seed(args.seed)
    out = []
    print(f"min_ess={args.min_ess:g} max_tail={args.max_tail:g} reward_max={float(rewards.max()):g} replicates={args.replicates}")
    print(
        "| beta | n | exact E_x log Z | bias plug-in | bias corrected | sd | mean delta-method se | min ESS (median) | refused: ESS | ESS or tail |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for beta in args.betas:
        exact = float(log_partition(ref, rewards, beta).mean())
        for n in args.samples:
            plug, corr, se, ess, refused, refused_tail = [], [], [], [], 0, 0
            for _ in range(args.replicates):
                idx = torch.multinomial(ref.exp(), n, replacement=True, generator=generator)  # (prompts, n)
                est = fr.log_partition_estimate(rewards.gather(1, idx), beta)
                plug.append(float(est.plug_in.mean()))
                corr.append(float(est.corrected.mean()))
                se.append(float(est.se.pow(2).sum().sqrt()) / len(task.prompts))
                ess.append(float(est.ess.min()))
                refused += est.untrusted(args.min_ess) is not None
                refused_tail += est.untrusted(args.min_ess, reward_max=float(rewards.max()), max_tail=args.max_tail) is not None
            row = dict(
                beta=beta, n=n, exact=exact, bias_plug_in=statistics.mean(plug) - exact, bias_corrected=statistics.mean(corr) - exact
            )
            row.update(sd=statistics.stdev(plug), se=statistics.mean(se), ess=statistics.median(ess))
            row.update(refused=refused / args.replicates, refused_tail=refused_tail / args.replicates)
            out.append(row)
            print(
                f"| {beta:g} | {n} | {exact:.4f} | {row['bias_plug_in']:+.4f} | {row['bias_corrected']:+.4f} | {row['sd']:.4f} | "
                f"{row['se']:.4f} | {row['ess']:.1f} | {row['refused']:.0%} | {row['refused_tail']:.0%} |"
            )
    return out


SMOLLM2_COLUMNS = ["family", "setting", "iteration", "kl", "kl_ci", "reward", "reward_ci", "kl_bound", "kl_to_optimum", "kl_to_optimum_ci"]


def meter_prompt_file(args: argparse.Namespace) -> Path:
    """The first ``--prompts`` prompts of ``--config``'s training set, written to ``<out>/meter_prompts.jsonl``."""
    import json

    import yaml

    from rlhf_lightning.data import BUILTIN_TRAIN, load_prompts

    data = yaml.safe_load(Path(args.config).read_text()).get("data") or {}
    prompts = load_prompts(data.get("train_path") or BUILTIN_TRAIN, data.get("prompt_column", "prompt"))[: args.prompts]
    path = args.out / "meter_prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in prompts))
    return path


def smollm2_mode(args: argparse.Namespace) -> None:
    from rlhf_lightning.exact.meter import KLToOptimum
    from tools.studies.sweep_beta import fixed_beta, prepare
    from tools.studies.sweep_beta import train as train_config

    prepare(args.threads, str(args.out))
    pool_state = torch.load(args.pool_from) if args.pool_from else None
    points = [row for path in args.append for row in read_ppo_rows(path)]
    if pool_state is not None:
        points += bon_points(pool_state["reference_scores"], args)
    overrides = [f"--data.batch_size={args.batch_size or 8}", "--model.runtime.log_samples_every_n_steps=0", *args.override]
    if args.train_on_meter_prompts:  # every iteration trains on the meter's prompts: the meter measures the objective trained
        overrides += [f"--data.train_path={meter_prompt_file(args)}", f"--data.batch_size={args.prompts}"]
    for beta in args.betas:
        start, cpu = time.perf_counter(), time.process_time()
        meter = KLToOptimum(
            every=args.meter_every,
            beta=beta,
            num_prompts=args.prompts,
            reference_samples=args.pool,
            policy_samples=args.policy_samples,
            reward_max=args.reward_max,
            max_tail=args.max_tail,
        )
        if pool_state is not None:  # the same reference, prompts and seed: the first run's pool, not a second one
            meter.load_state_dict(pool_state)
        train_config(args.config, [*fixed_beta(beta), *overrides], args.iterations, args.out / f"beta_{beta:g}", callbacks=[meter])
        if pool_state is None:
            pool_state = meter.state_dict()
            torch.save(pool_state, args.out / "reference_pool.pt")  # prompts and training scores of the pool
            points += bon_points(pool_state["reference_scores"], args)
        for row in meter.rows:
            s, d = row["sampled"], row.get("distance")
            kl_opt = f"kl_to_optimum=refused ({row.get('reason')})"
            if d is not None:
                fall, fall_se = row.get("fall", (math.nan, math.nan))
                kl_opt = (
                    f"kl_to_optimum={d.kl_to_optimum:.3f}+-{1.96 * d.se:.3f} fall={fall:.3f}+-{1.96 * fall_se:.3f} "
                    f"log_z_bias={d.log_z_bias:.4f} ess={row['ess']:.1f}"
                )
            print(
                f"SMOLLM2 ppo beta={beta:g} iteration={row['iteration']} reward={s.reward:.3f}+-{1.96 * s.reward_se:.3f} "
                f"kl={s.kl_to_ref:.3f}+-{1.96 * s.kl_to_ref_se:.3f} {kl_opt}",
                flush=True,
            )
            distance = (d.kl_to_optimum, 1.96 * d.se) if d is not None else (math.nan, math.nan)
            points.append(
                (
                    "ppo",
                    f"{beta:g}",
                    row["iteration"],
                    s.kl_to_ref,
                    1.96 * s.kl_to_ref_se,
                    s.reward,
                    1.96 * s.reward_se,
                    math.nan,
                    *distance,
                )
            )
        print(f"(beta {beta:g}: {time.perf_counter() - start:.0f} s wall, {time.process_time() - cpu:.0f} s CPU)", flush=True)
        plot_smollm2(points, args)  # after every run: a cut-short sweep still leaves its figure
    if args.replot:
        plot_smollm2(points, args)


def read_ppo_rows(path: str) -> list[tuple]:
    """The PPO rows of an earlier --smollm2 run's CSV (--append): one figure from runs made one after another."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["family"] == "ppo"]
    return [(r["family"], r["setting"], int(r["iteration"]), *(float(r[c]) for c in SMOLLM2_COLUMNS[3:])) for r in rows]


def bon_points(pool: torch.Tensor, args: argparse.Namespace) -> list[tuple]:
    """Best-of-N rows (:data:`SMOLLM2_COLUMNS`: KL and its half-interval, reward and its, the KL bound) from the pool."""
    generator, points = torch.Generator().manual_seed(0), []
    for n in args.bon:
        reward, kl = float(fr.bon_reward_from_pool(pool, n).mean()), float(fr.bon_kl_from_pool(pool, n).mean())
        boot_r, boot_k = [], []
        for _ in range(args.bootstrap):
            idx = torch.randint(0, pool.shape[1], pool.shape, generator=generator)
            sample = pool.gather(1, idx)
            boot_r.append(float(fr.bon_reward_from_pool(sample, n).mean()))
            boot_k.append(float(fr.bon_kl_from_pool(sample, n).mean()))
        # basic (pivotal) bootstrap, 2 * estimate - quantiles: a resampled pool holds duplicates, extra ties
        # that pull the plug-in KL down, and the pivot carries that shift back instead of reporting it
        r_lo, r_hi = 2 * reward - np.percentile(boot_r, [97.5, 2.5])
        k_lo, k_hi = 2 * kl - np.percentile(boot_k, [97.5, 2.5])
        points.append(("bon", str(n), math.nan, kl, (k_hi - k_lo) / 2, reward, (r_hi - r_lo) / 2, fr.bon_kl_bound(n), math.nan, math.nan))
        print(
            f"SMOLLM2 bon N={n} reward={reward:.3f} [{r_lo:.3f}, {r_hi:.3f}] kl_estimate={kl:.3f} [{k_lo:.3f}, {k_hi:.3f}] "
            f"kl_bound={fr.bon_kl_bound(n):.3f}",
            flush=True,
        )
    return points


def save_figure(fig, ax, path: Path) -> None:
    """The legend and grid both figures share, then the file (closed: a tool's figures do not pile up)."""
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish_exact_plane(fig, ax, title: str, path: Path, line: str) -> str:
    """The exact reward-KL plane's axes and ``title``, the figure saved at ``path`` (:func:`save_figure`); then the
    mode's last ``line``, printed and returned."""
    ax.set_xlabel("exact KL(pi || pi_ref) (nats per response)")
    ax.set_ylabel("exact expected reward")
    ax.set_title(title, fontsize=10)
    save_figure(fig, ax, path)
    print(line)
    return line


def plot_smollm2(points: list[tuple], args: argparse.Namespace) -> None:
    """Left: the plane (best-of-N from the pool; each PPO beta's path from the reference, its last point with
    intervals). Right: the meter, KL(pi || pi_beta) against the iteration, +-1.96 SE (trusted measurements)."""
    write_csv(args.out / "frontier_smollm2.csv", SMOLLM2_COLUMNS, points)
    fig, (ax, meter) = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [3, 2]})
    col = {name: i for i, name in enumerate(SMOLLM2_COLUMNS)}

    def errorbar(axis, rows: list[tuple], x: str, y: str, **style) -> None:  # x's interval where it has one (not the iteration)
        xerr = [p[col[x + "_ci"]] for p in rows] if x + "_ci" in col else None
        axis.errorbar([p[col[x]] for p in rows], [p[col[y]] for p in rows], [p[col[y + "_ci"]] for p in rows], xerr, capsize=3, **style)

    bon = [p for p in points if p[0] == "bon"]
    errorbar(ax, bon, "kl", "reward", fmt="o-", color="tab:orange", label="best-of-N, KL plug-in estimate (95% bootstrap)")
    ax.plot(
        [p[col["kl_bound"]] for p in bon],
        [p[col["reward"]] for p in bon],
        "x--",
        color="tab:orange",
        alpha=0.6,
        label="best-of-N at the bound log N - (N-1)/N",
    )
    for p in bon:
        ax.annotate(f"N={p[1]}", (p[col["kl"]], p[col["reward"]]), textcoords="offset points", xytext=(-4, 6), fontsize=7, ha="right")
    betas = list(dict.fromkeys(p[1] for p in points if p[0] == "ppo"))
    for beta, color in zip(betas, plt.cm.winter(np.linspace(0, 0.9, len(betas))), strict=True):
        rows = [p for p in points if p[0] == "ppo" and p[1] == beta]
        ax.plot([p[col["kl"]] for p in rows], [p[col["reward"]] for p in rows], ".:", color=color, alpha=0.6)
        errorbar(
            ax,
            rows[-1:],
            "kl",
            "reward",
            fmt="s",
            color=color,
            label=f"PPO beta={beta}, after {rows[-1][col['iteration']]} iterations (+-1.96 SE)",
        )
        trusted = [p for p in rows if math.isfinite(p[col["kl_to_optimum"]])]
        if trusted:
            errorbar(meter, trusted, "iteration", "kl_to_optimum", fmt="s-", color=color, label=f"beta={beta}")
    ax.set_xlabel("KL(pi || pi_ref) (nats per response)")
    ax.set_ylabel("mean VADER score on the meter prompts")
    ax.set_title(f"SmolLM2-135M, {Path(args.config).name}: {args.prompts} prompts, pool {args.pool}/prompt", fontsize=10)
    meter.axhline(0, color="black", lw=0.8)
    meter.set_xlabel("PPO iteration (0: the reference)")
    meter.set_ylabel("objective/kl_to_optimum = KL(pi || pi_beta) (nats)")
    meter.set_title("the meter (+-1.96 SE; refused measurements left out)", fontsize=10)
    if meter.has_data():
        meter.legend(fontsize=7)
    meter.grid(alpha=0.3)
    save_figure(fig, ax, args.out / "frontier_smollm2.png")


def write_csv(path: Path, header: list[str], rows) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def parse_args(argv=None) -> argparse.Namespace:
    parser = tool_parser(__spec__.name, __doc__, first_paragraph=True)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--exact", action="store_true", help="the enumerable task: every point exact")
    mode.add_argument("--smollm2", action="store_true", help="SmolLM2 with --config's reward: sampled points with intervals")
    mode.add_argument("--meter-table", action="store_true", help="bias and spread of the sampled log Z against n (exact task)")
    parser.add_argument("--task", default="terminal", help="exact task: terminal, bandit or random:SEED (default terminal)")
    parser.add_argument("--seed", type=option_number(integer=True), default=0, help="sampling seed (and a hand-made task's reference)")
    parser.add_argument(
        "--betas", type=option_number(above=0), nargs="+", help="PPO betas (default: 0.25 0.5 1 2 exact; 0.1 0.3 1 smollm2)"
    )
    parser.add_argument(
        "--iterations",
        type=option_number(integer=True, at_least=1),
        help="PPO iterations per beta (default exact: 100 hand-made, 150 random tasks; smollm2 20)",
    )
    parser.add_argument(
        "--soft-n", type=option_number(integer=True, at_least=1), nargs="+", default=[4, 16], help="soft best-of-N sizes (default 4 16)"
    )
    parser.add_argument(
        "--anneal-from",
        type=option_number(above=0),
        help="exact: PPO's beta moves geometrically from this value to each of --betas over the first half of the "
        "iterations (beta_controller anneal), then stays (default: fixed at each beta)",
    )
    parser.add_argument("--fast", action="store_true", help="exact: one PPO beta (0.5), 20 iterations, one soft N")
    parser.add_argument(
        "--divergences",
        nargs="+",
        help="exact: no training; each divergence's closed-form optimum over beta on the plane (reverse_kl, forward_kl, js, chi2, "
        "alpha:VALUE), its points at --betas (default 1) marked",
    )
    parser.add_argument("--config", default="configs/quickstart.yaml", help="smollm2: the run's YAML (default the quickstart)")
    parser.add_argument("--prompts", type=option_number(integer=True, at_least=1), default=4, help="smollm2: meter prompts (default 4)")
    parser.add_argument(
        "--pool", type=option_number(integer=True, at_least=1), default=64, help="smollm2: reference samples per prompt (default 64)"
    )
    parser.add_argument(
        "--policy-samples",
        type=option_number(integer=True, at_least=1),
        default=16,
        help="smollm2: policy samples per prompt per measurement (default 16)",
    )
    parser.add_argument(
        "--meter-every",
        type=option_number(integer=True, at_least=1),
        default=5,
        help="smollm2: iterations between measurements (default 5)",
    )
    parser.add_argument(
        "--batch-size",
        type=option_number(integer=True, at_least=1),
        help="responses per PPO iteration (exact, default 48 hand-made, 384 random) or prompts per iteration (smollm2, default 8)",
    )
    parser.add_argument(
        "--bon", type=option_number(integer=True, at_least=1), nargs="+", default=[1, 2, 4, 8, 16], help="smollm2: best-of-N sizes"
    )
    parser.add_argument(
        "--bootstrap",
        type=option_number(integer=True, at_least=1),
        default=200,
        help="smollm2: bootstrap replicates for best-of-N's intervals",
    )
    parser.add_argument(
        "--reward-max", type=option_number(), default=1.0, help="smollm2: upper bound of the reward (VADER: 1), for the meter's tail check"
    )
    parser.add_argument("--max-tail", type=option_number(above=0), default=0.25, help="the meter's max_tail (nats of log Z, default 0.25)")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="smollm2: a LightningCLI argument for every PPO run, e.g. --override=--model.optim.lr=1e-3",
    )
    parser.add_argument(
        "--replot", action="store_true", help="smollm2: no training; the figure of --pool-from's best-of-N and --append's PPO rows"
    )
    parser.add_argument(
        "--train-on-meter-prompts",
        action="store_true",
        help="smollm2: train on the meter's prompts only (the first --prompts of the config's set, all in every iteration)",
    )
    parser.add_argument("--pool-from", help="smollm2: an earlier run's reference_pool.pt (its prompts and pool) instead of sampling one")
    parser.add_argument(
        "--append", action="append", default=[], help="smollm2: an earlier run's frontier_smollm2.csv whose PPO rows join the figure"
    )
    parser.add_argument("--threads", type=option_number(integer=True, at_least=0), default=1, help="smollm2: torch threads")
    parser.add_argument(
        "--samples",
        type=option_number(integer=True, at_least=1),
        nargs="+",
        default=[16, 64, 256, 1024],
        help="meter table: reference samples n",
    )
    parser.add_argument("--replicates", type=option_number(integer=True, at_least=1), default=400, help="meter table: draws per n")
    parser.add_argument(
        "--min-ess", type=option_number(above=0), default=8.0, help="meter table: KLToOptimum's min_ess, for the refused share"
    )
    parser.add_argument("--out", default="runs/frontier", help="output folder")
    args = parser.parse_args(argv)
    # exact: None leaves the iterations to the task's kind (tools/studies/optimum_check/recipes.py's TASK_SETTINGS)
    default_betas, default_iterations = ([0.25, 0.5, 1.0, 2.0], None) if not args.smollm2 else ([0.1, 0.3, 1.0], 20)
    if args.meter_table:
        default_betas = [0.25, 1.0, 4.0]
    if args.fast:
        default_betas, default_iterations, args.soft_n = [0.5], 20, [4]
    if args.divergences:
        if not args.exact:
            parser.error("--divergences: only with --exact (the closed-form optima of the enumerable tasks)")
        from rlhf_lightning.exact.f_divergence import divergence_named

        for spec in args.divergences:
            try:
                divergence_named(spec)
            except Exception as err:
                parser.error(f"--divergences: {err}")
        default_betas = [1.0]
    args.betas = default_betas if args.betas is None else args.betas
    args.iterations = default_iterations if args.iterations is None else args.iterations
    if args.replot:
        if not (args.smollm2 and args.pool_from and args.append):
            parser.error("--replot needs --smollm2, --pool-from and --append")
        args.betas = []
    if args.smollm2 and max(args.bon) > args.pool:
        parser.error(f"--bon sizes must be <= --pool ({args.pool})")
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main(argv=None):
    import logging
    import warnings

    args = parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")
    torch.set_num_threads(args.threads)
    if args.meter_table:
        return meter_table(args)
    if args.smollm2:
        return smollm2_mode(args)
    if args.divergences:
        return divergence_plane(args)
    return exact_mode(args)


def divergence_plane(args: argparse.Namespace) -> str:
    """Each divergence's closed-form optimum over the beta grid on the reward-KL plane (``--exact --divergences``)."""
    from rlhf_lightning.exact.f_divergence import (
        divergence_label,
        divergence_named,
        divergence_optimal_logprobs,
        divergence_optimal_objective,
    )

    task = task_named(args.task)
    ref, rewards = reference_logprobs(task, args.seed), task.rewards()
    marked = args.betas
    fig, ax = plt.subplots(figsize=(8, 5.5))
    rows, table, below = [], [], 0.0
    for spec in args.divergences:
        divergence = divergence_named(spec)
        label = divergence_label(divergence)
        points = [fr.plane_point(divergence_optimal_logprobs(ref, rewards, float(b), divergence), ref, rewards) for b in FRONTIER_BETAS]
        rows += [(label, f"{b:.4g}", p.kl, p.reward) for b, p in zip(FRONTIER_BETAS, points, strict=True)]
        below = max(below, *(fr.frontier_reward(ref, rewards, p.kl) - p.reward for p in points))
        (line,) = ax.plot([p.kl for p in points], [p.reward for p in points], lw=1.5, label=f"{label}: pi*_f over beta 0.02..100")
        for beta in marked:
            point = fr.plane_point(divergence_optimal_logprobs(ref, rewards, beta, divergence), ref, rewards)
            j_star = divergence_optimal_objective(ref, rewards, beta, divergence)
            table.append((label, beta, j_star, point, fr.frontier_reward(ref, rewards, point.kl)))
            ax.plot([point.kl], [point.reward], "o", ms=5, color=line.get_color())
            ax.annotate(f"beta={beta:g}", (point.kl, point.reward), textcoords="offset points", xytext=(5, -10), fontsize=7)
    write_csv(args.out / "frontier_divergences.csv", ["divergence", "beta", "kl", "reward"], rows)
    print(f"task={args.task} seed={args.seed} prompts={len(task.prompts)} responses={ref.shape[1]}")
    print("| divergence | beta | J*_f | KL(pi*_f ‖ pi_ref) | reward of pi*_f | frontier at that KL |\n|---|---:|---:|---:|---:|---:|")
    for label, beta, j_star, point, best in table:
        print(f"| {label} | {beta:g} | {j_star:.4f} | {point.kl:.4f} | {point.reward:.4f} | {best:.4f} |")
    ax.set_xlim(0, max(p.kl for *_, p, _ in table) * 1.6)
    title = f"{args.task} task: each divergence's optimum pi*_f over beta, every point exact"
    return finish_exact_plane(fig, ax, title, args.out / "frontier_divergences.png", f"DIVERGENCES max_below_frontier={below:.4f}")


if __name__ == "__main__":
    main()
