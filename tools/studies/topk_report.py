"""Truncated-support (top-k) KL estimators against the exact full-vocabulary KL: the table of docs/divergences.md,
"Truncated support: top-k".

    python -m tools.studies.topk_report                  # V = 16, k in 1, 2, 4, 15, reward 0 and a reward
    python -m tools.studies.topk_report --vocab 8        # k in 1, 2, 4, 7

Every cell is exact (``rlhf_lightning.exact.truncated``: a contextual bandit of 8 prompts, one token from V, the
student a free logit table trained by Adam on the estimator's exact expected loss -E_pi r + beta E[k], beta 1).
Columns: the value's bias and the gradient's cosine against the full KL of the estimator's direction at the start;
whether the gradient is identically 0; where training lands: J* - J of that direction's exact objective, the reverse
KL to the teacher (start -> end), the forward KL, the entropy's drift, the share of (step, prompt) where the clamp was
active; ``ok``: within 0.02 of J*.
"""

from __future__ import annotations

import argparse
import time

import torch

import rlhf_lightning_plugins.kl_estimators  # noqa: F401 (registers the estimators)
from rlhf_lightning.exact.truncated import bandit_task, measure

# (registered name, takes k)
ESTIMATORS = (
    ("full", False),
    ("k3+", False),
    ("topk_forward", True),
    ("topk_forward_clamped", True),
    ("topk_forward_tail", True),
    ("topk_reverse", True),
    ("topk_reverse_clamped", True),
    ("topk_reverse_unnormalised", True),
    ("topk_generalised", True),
)
WITHIN = 0.02


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # (8, 16) tensors only lose time to thread hand-offs
    ks = (1, 2, 4, args.vocab - 1)
    print(
        "| reward | estimator | k | direction | bias | cosine | grad = 0 | J* - J | reverse KL start -> end | forward KL | entropy drift | clamp active | within 0.02 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    for reward in (False, True):
        task = bandit_task(args.vocab, seed=args.seed, reward=reward)
        for name, takes_k in ESTIMATORS:
            for k in ks if takes_k else (0,):
                r = measure(name, task, k)
                print(
                    f"| {'N(0,1)' if reward else '0'} | `{name}` | {k or '-'} | {r.direction} | {r.bias:+.3f} | {r.cosine:+.3f} | "
                    f"{'yes' if r.zero_gradient else 'no'} | {r.gap:.4f} | {r.reverse_kl_start:.3f} -> {r.reverse_kl:.3f} | "
                    f"{r.forward_kl:.3f} | {r.entropy_drift:+.3f} | {r.clamp_active:.2f} | {'yes' if r.gap <= WITHIN else 'no'} |",
                    flush=True,
                )
    print(f"wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
