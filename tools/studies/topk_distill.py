"""What the teacher's top k costs in quality: ``configs/distillation_topk.yaml`` run once per KL estimator, same seed,
and the exact full-vocabulary KL to the teacher each reaches after the same number of iterations.

    python -m tools.studies.topk_distill                                  # the variants below, 40 iterations each
    python -m tools.studies.topk_distill --variants full tail_8 clamped_8 --iterations 20
    python -m tools.studies.topk_distill --config configs/privileged_teacher.yaml --variants full tail_64 tail_8 clamped_8 \
        --iterations 8 --smollm2                  # SmolLM2 (V = 49152) learning the teacher that sees the answer

Each run is ``rlhf-lightning fit --config <config>`` in a fresh process with its ``model.kl_estimator`` replaced and
``KLHealth`` probing every iteration (its ``estimate_vs_exact`` check alone): ``system/kl_health/kl_exact`` is the
exact KL(pi_old || pi_ref) of each iteration's responses (nats per response, summed over the vocabulary at each
position), the yardstick whatever the estimator trains. Per variant the table gives that KL at the first iteration
and its mean over the last ``--last``, its ratio to the ``full`` run's, the estimator's own value beside it
(``system/kl_health/kl_estimate``: what ``objective/kl`` shows), the gold reward (the "e"s, never trained on) and the
run's wall seconds. The config's reward is 0, so the KL is the whole objective. ``--smollm2`` turns a SmolLM2 config
(``configs/privileged_teacher.yaml``: the starting policy reading each question with its answer as the teacher) into
the same distillation: a reward of 0, the KL per token in the loss with beta 1, REINFORCE, one answer per question,
16 questions an iteration, no validation. The numbers: docs/performance.md, "The teacher's top k".
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from tools._cli_args import REPO, fit_with_overlay, option_number, tool_parser

# name -> model.kl_estimator: the exact reverse KL, the teacher's top k with its tail (k = 77 = V - 1: the exact
# forward KL on the 78-character vocabulary), without it, clamped (verl's), and two of the student's top k. Every
# argument written: jsonargparse merges a class_path's init_args into the config's own (its tail: true).
VARIANTS = {
    "full": "full",
    "tail_77": (77, "teacher", {"tail": True}),
    "tail_64": (64, "teacher", {"tail": True}),
    "tail_8": (8, "teacher", {"tail": True}),
    "tail_1": (1, "teacher", {"tail": True}),
    "plain_8": (8, "teacher", {}),
    "clamped_8": (8, "teacher", {"clamp": True}),
    "reverse_8": (8, "student", {"renormalise": True}),
    "generalised_8": (8, "student", {"generalised": True}),
}


def estimator(variant: str):
    """``model.kl_estimator`` of ``variant``: a name, or TopKKL with every argument."""
    if isinstance(VARIANTS[variant], str):
        return VARIANTS[variant]
    k, of, flags = VARIANTS[variant]
    flags = {name: flags.get(name, False) for name in ("tail", "renormalise", "clamp", "generalised")}
    return {"class_path": "TopKKL", "init_args": {"k": k, "of": of, **flags}}


PRESET = {
    "full": "full",
    "tail_77": "topk_forward_tail k=77",
    "tail_64": "topk_forward_tail k=64",
    "tail_8": "topk_forward_tail k=8",
    "tail_1": "topk_forward_tail k=1",
    "plain_8": "topk_forward k=8",
    "clamped_8": "topk_forward_clamped k=8",
    "reverse_8": "topk_reverse k=8",
    "generalised_8": "topk_generalised k=8",
}


# --smollm2: a SmolLM2 config made pure distillation (module docstring).
SMOLLM2_DISTILLATION = {
    "reward_model": {
        "class_path": "callable",
        "init_args": {"function": "rlhf_lightning_plugins.rewards.toy:constant", "kwargs": {"value": 0.0}},
    },
    "kl": {"placement": "loss", "loss_scope": "per_token"},
    "beta_controller": {"class_path": "fixed", "init_args": {"init_beta": 1.0}},
    "advantage_estimator": "reinforce",
    "sampling": {"num_generations": 1},
}


def run(config: str, variant: str, iterations: int, work: Path, smollm2: bool = False) -> dict[str, dict[int, float]]:
    """One run of ``config`` with ``variant``'s estimator: its scalars and wall seconds."""
    from tools.summarize_run import read_scalars

    out = work / variant
    out.mkdir(parents=True)
    health = {"class_path": "KLHealth", "init_args": {"every_n_iterations": 1, "checks": ["estimate_vs_exact"]}}
    epochs = math.ceil(iterations / 20)  # the 360 built-in prompts make 22 batches of 16 an epoch
    trainer = {
        "max_epochs": epochs,
        "limit_train_batches": iterations // epochs,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(out),
        "callbacks": [health],
    }
    model, data = {"kl_estimator": estimator(variant)}, {}
    if smollm2:
        trainer["limit_val_batches"] = 0
        model, data = {**SMOLLM2_DISTILLATION, **model}, {"batch_size": 16}
    start = time.perf_counter()
    settings = {"trainer": trainer, "model": model} | ({"data": data} if data else {})
    fit_with_overlay(config, settings, out, variant, {**os.environ, "PYTHONWARNINGS": "ignore"})
    seconds = time.perf_counter() - start
    (log_dir,) = out.glob("lightning_logs/*/version_0")
    return read_scalars(str(log_dir)) | {"wall_s": {0: seconds}}


def main() -> None:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("--config", default=str(REPO / "configs" / "distillation_topk.yaml"))
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    parser.add_argument(
        "--iterations", type=option_number(integer=True, at_least=1), default=40, help="a multiple of its epochs (20 an epoch at most)"
    )
    parser.add_argument("--last", type=option_number(integer=True, at_least=1), default=5, help="iterations averaged at the end")
    parser.add_argument("--smollm2", action="store_true", help="make a SmolLM2 config pure distillation (module docstring)")
    args = parser.parse_args()
    variants = ["full", *(v for v in args.variants if v != "full")]  # the yardstick first
    print(f"{Path(args.config).name}, {args.iterations} iterations, 1-minute load {os.getloadavg()[0]:.2f} at the start", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="topk_distill_") as work:
        for variant in variants:
            scalars = run(args.config, variant, args.iterations, Path(work), args.smollm2)
            exact, estimate = scalars["system/kl_health/kl_exact"], scalars["system/kl_health/kl_estimate"]
            gold = scalars.get("objective/gold_reward", {0: math.nan})  # a config with a gold reward model
            last = sorted(exact)[-args.last :]
            row = {
                "variant": variant,
                "first": exact[min(exact)],
                "last": statistics.mean(exact[s] for s in last),
                "estimate": statistics.mean(estimate[s] for s in last),
                "gold": statistics.mean(list(gold.values())[-args.last :]),
                "wall_s": scalars["wall_s"][0],
                "load": os.getloadavg()[0],
            }
            rows.append(row)
            print(f"TOPK_DISTILL {' '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}' for k, v in row.items())}", flush=True)
    full = rows[0]["last"]
    print(f"\nKL(pi || pi_ref) exact, nats per response: at the first iteration and the mean of the last {args.last} of {args.iterations}")
    print("| estimator | exact KL, first | exact KL, last | / full's | its own value, last | gold reward, last | wall s | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| `{PRESET[row['variant']]}` | {row['first']:.2f} | {row['last']:.2f} | {row['last'] / full:.2f} | {row['estimate']:.2f} "
            f"| {row['gold']:.2f} | {row['wall_s']:.0f} | {row['load']:.1f} |"
        )


if __name__ == "__main__":
    main()
