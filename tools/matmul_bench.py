"""PyTorch's CPU linear kernel (MKL) against oneDNN's (``model.cpu_linear``), on SmolLM2's shapes.

    python tools/matmul_bench.py                  # all threads
    python tools/matmul_bench.py --threads 1

For each linear layer shape of SmolLM2-135M (q/o 576x576, k/v 192x576, gate/up 1536x576, down
576x1536, the LM head 49152x576) and each way an iteration uses it (a batch-8 decode step, a
forward over 8 sequences of 77 tokens, and that forward's two backward products dx = dy W and
dW = dy^T x), the median seconds of ``F.linear``/``torch.mm`` (MKL) and of ``cpu.OneDNNLinear``'s
products, their GFLOP/s and the ratio, each pair measured back to back in this one run. The last line reads ``MATMUL onednn_vs_aten=<r>``: the summed oneDNN time of one
forward+backward of every layer over the summed aten time.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

from rlhf_lightning.checks import option_number

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "q_proj/o_proj": (576, 576),
    "k_proj/v_proj": (192, 576),
    "gate/up_proj": (1536, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}
LAYERS_PER_MODEL = {"q_proj/o_proj": 60, "k_proj/v_proj": 60, "gate/up_proj": 60, "down_proj": 30, "lm_head": 1}


def median_seconds(run, rounds: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=option_number(integer=True, at_least=0), default=0)
    parser.add_argument("--rounds", type=option_number(integer=True, at_least=1), default=20)
    parser.add_argument(
        "--tokens", type=option_number(integer=True, at_least=1), default=8 * 77, help="rows of a forward (batch x sequence)"
    )
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    from rlhf_lightning import cpu

    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu.onednn_available():
        raise SystemExit("this torch build has no oneDNN")
    print(f"{torch.get_num_threads()} thread(s), torch {torch.__version__}; median of {args.rounds} rounds each")
    print("| layer (out x in) | use | rows | aten ms | oneDNN ms | aten GFLOP/s | oneDNN GFLOP/s | oneDNN / aten |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    totals = {"aten": 0.0, "onednn": 0.0}
    # Per use: (MKL, oneDNN) as functions of (x, grad, weight).
    kernels = {
        "decode step": (lambda x, g, w: F.linear(x, w), lambda x, g, w: cpu.linear(x, w)),
        "forward": (lambda x, g, w: F.linear(x, w), lambda x, g, w: cpu.linear(x, w)),
        "backward dx": (lambda x, g, w: torch.mm(g, w), lambda x, g, w: cpu.linear(g, w.t())),
        "backward dW": (lambda x, g, w: torch.mm(g.t(), x), lambda x, g, w: cpu.linear(g.t(), x.t())),
    }
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features)
        for use, rows in (("decode step", 8), ("forward", args.tokens), ("backward dx", args.tokens), ("backward dW", args.tokens)):
            x, grad = torch.randn(rows, in_features), torch.randn(rows, out_features)
            aten, onednn = (median_seconds(functools.partial(run, x, grad, weight), args.rounds) for run in kernels[use])
            flops = 2 * rows * out_features * in_features
            if use != "decode step":
                totals["aten"] += aten * LAYERS_PER_MODEL[name]
                totals["onednn"] += onednn * LAYERS_PER_MODEL[name]
            print(
                f"| {name} ({out_features} x {in_features}) | {use} | {rows} | {aten * 1e3:.3f} | {onednn * 1e3:.3f} | "
                f"{flops / aten / 1e9:.0f} | {flops / onednn / 1e9:.0f} | {onednn / aten:.2f} |"
            )
    print(f"\none SmolLM2 forward+backward's linear layers: aten {totals['aten']:.2f} s, oneDNN {totals['onednn']:.2f} s")
    print(f"MATMUL onednn_vs_aten={totals['onednn'] / totals['aten']:.3f}")


if __name__ == "__main__":
    main()
