"""Where the sampler-side trust regions land against J*, beside the plain corrections (docs/async.md, "Sampler-side
trust regions").

    python -m tools.studies.trust_regions                                   # the docs' table (21 cells, ~1 min each)
    python -m tools.studies.trust_regions --staleness 1 --drift --corrections sequence icepop   # some cells

Each cell is ``exact.training.expected_train`` on random:3 (beta 1, k3 in the loss with its sequence term, one epoch
of 2 AdamW steps, 60 iterations at lr 2e-3 decayed to 1/10): every rollout replaced by its exact expectation, so the
gap is the correction's bias and nothing else. The sampler is off by a declared amount: stale by k (the asynchronous
loop, ``--staleness``), or its logit of the first symbol d too high at every state (``--drift``, another engine's
numerics); the first cell (k = 0, d = 0) is the synchronous loop, where every correction is the same. Prints one
``TRUST`` line per cell (``gap``: (J* - J) over the task's scale, ``exact.closed_form.optimum_report``; the last
iteration's ``off_policy/ess``, ``weight_mass`` and ``clipped_fraction``, the trust region's masked share; the smallest
ESS and largest masked share of the run, read every 5 iterations) and the markdown table.
"""

from __future__ import annotations

import argparse
import time
import warnings

from rlhf_lightning.exact.tasks import task_named
from rlhf_lightning.exact.training import expected_train
from rlhf_lightning.recipes import off_policy_recipe

CORRECTIONS = ("sequence", "token", "icepop", "ipo", "m2po")
RECIPE = dict(kl_estimator="k3", kl_penalty="loss", ppo_epochs=1)


def cell(correction: str, staleness: int, drift: float, iterations: int = 60, task: str = "random:3") -> dict[str, float]:
    """The last row of one cell's ``expected_train`` run (gap, objective, the weights' metrics), with ``masked_max``, the
    largest masked share of any iteration (read every 5), and ``ess_min``, the smallest ESS."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = expected_train(
            task_named(task), iterations, 1.0, every=5, staleness=staleness, correction=correction, sampler_drift=drift, **RECIPE
        )
    masked = [row.get("off_policy/trust_masked_fraction", 0.0) for row in rows]
    return {**rows[-1], "masked_max": max(masked), "ess_min": min(row.get("off_policy/ess", 1.0) for row in rows)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=CORRECTIONS)
    parser.add_argument("--staleness", nargs="*", type=int, default=[1, 2], help="stale-by-k cells (drift 0)")
    parser.add_argument("--drift", nargs="*", type=float, default=[1.0, 2.0], help="sampler-logit drift cells (staleness 0)")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--no-synchronous", action="store_true", help="skip the k = 0, d = 0 cell")
    args = parser.parse_args(argv)
    conditions = [] if args.no_synchronous else [(0, 0.0, ("sequence",))]
    conditions += [(k, 0.0, args.corrections) for k in args.staleness] + [(0, d, args.corrections) for d in args.drift]
    table = []
    for staleness, drift, corrections in conditions:
        for correction in corrections:
            start = time.time()
            row = cell(correction, staleness, drift, args.iterations)
            recipe = off_policy_recipe(correction, max(staleness, int(bool(drift))))[0]
            fields = dict(
                correction=correction,
                staleness=staleness,
                drift=drift,
                recipe=recipe if staleness or drift else "on_policy",
                gap=row["gap"],
                ess=row.get("off_policy/ess", 1.0),
                mass=row.get("off_policy/weight_mass", 1.0),
                clipped=row.get("off_policy/clipped_fraction", 0.0),
                masked=row.get("off_policy/trust_masked_fraction", float("nan")),
                masked_max=row["masked_max"] if correction in ("icepop", "ipo", "m2po") else float("nan"),
                ess_min=row["ess_min"],
                seconds=time.time() - start,
            )
            table.append(fields)
            print("TRUST " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()), flush=True)
    print(
        "\n| correction | class | sampler | gap to J* | off_policy/ess (min) | weight_mass | masked share (max) |\n|---|---|---|---:|---:|---:|---:|"
    )
    for f in table:
        sampler = (
            "synchronous"
            if not (f["staleness"] or f["drift"])
            else (f"stale k={f['staleness']}" if f["staleness"] else f"drift d={f['drift']:g}")
        )
        masked = "" if f["masked"] != f["masked"] else f"{f['masked']:.3f} ({f['masked_max']:.3f})"
        ess = f"{f['ess']:.3f} ({f['ess_min']:.3f})"
        print(f"| `{f['correction']}` | {f['recipe']} | {sampler} | {f['gap']:.4f} | {ess} | {f['mass']:.3f} | {masked} |")


if __name__ == "__main__":
    main()
