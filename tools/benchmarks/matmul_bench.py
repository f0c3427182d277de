"""PyTorch's CPU linear kernel (MKL) against oneDNN's (``cpu.linear``), on SmolLM2's shapes.

    python -m tools.benchmarks.matmul_bench                  # all threads
    python -m tools.benchmarks.matmul_bench --threads 1
    python -m tools.benchmarks.matmul_bench --threads 1 --decode-rows 1 8 32   # and a whole decode step's products

For each linear layer shape of SmolLM2-135M (q/o 576x576, k/v 192x576, gate/up 1536x576, down
576x1536, the LM head 49152x576) and each way an iteration uses it (a batch-8 decode step, a
forward over 8 sequences of 77 tokens, and that forward's two backward products dx = dy W and
dW = dy^T x), the median seconds of ``F.linear``/``torch.mm`` (MKL) and of ``cpu.OneDNNLinear``'s
products, their GFLOP/s and the ratio, each pair measured back to back in this one run. The last line reads ``MATMUL onednn_vs_aten=<r>``: the summed oneDNN time of one
forward+backward of every layer over the summed aten time.

``--decode-rows`` adds what a decode step meets and the table above does not: the step's 211 products
(30 blocks of 7, and the LM head) each with a weight of its own, read from memory once per step rather
than hot in cache from the previous round, for each given number of rows. It prints, per kernel, the
step's milliseconds, its GFLOP/s and the rate at which it gets through the weights (GB/s), beside the
read bandwidth (``roofline.machine_peaks``: a 512 MB sum), and ``DECODE rows=<n> aten_weights_gbps=<..> read_gbps=<..>`` lines: a
step's floor is its weights' read, so weights_gbps / read_gbps is how near the products come to it.
"""

from __future__ import annotations

import functools
import statistics
import time

from tools._cli_args import option_number, tool_parser

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
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("--threads", type=option_number(integer=True, at_least=0), default=0)
    parser.add_argument("--rounds", type=option_number(integer=True, at_least=1), default=20)
    parser.add_argument(
        "--tokens", type=option_number(integer=True, at_least=1), default=8 * 77, help="rows of a forward (batch x sequence)"
    )
    parser.add_argument(
        "--decode-rows",
        type=option_number(integer=True, at_least=1),
        nargs="*",
        default=[],
        help="rows of a decode step's products (cold weights)",
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
    if args.decode_rows:
        decode_report(args.decode_rows, max(3, args.rounds // 4))


def decode_products(product, inputs: dict, weights: list) -> None:
    """One decode step's products: each weight times the rows of its input width."""
    for weight in weights:
        product(inputs[weight.shape[1]], weight)


def decode_report(row_counts: list[int], rounds: int) -> None:
    """A decode step's products, each weight its own (cold), per kernel and row count (module docstring)."""
    import torch
    import torch.nn.functional as F

    from rlhf_lightning import cpu
    from tools.benchmarks import roofline

    block = [SHAPES[name] for name in ("q_proj/o_proj", "k_proj/v_proj", "k_proj/v_proj", "q_proj/o_proj")]
    block += [SHAPES["gate/up_proj"]] * 2 + [SHAPES["down_proj"]]
    weights = [torch.randn(shape) for _ in range(30) for shape in block] + [torch.randn(SHAPES["lm_head"])]
    weight_gb = sum(w.numel() * w.element_size() for w in weights) / 1e9
    read_gbps = roofline.machine_peaks()["bytes_per_s"] / 1e9
    print(f"\ndecode step: {len(weights)} products, {weight_gb:.2f} GB of weights; read bandwidth {read_gbps:.1f} GB/s")
    print("| rows | kernel | ms / step | GFLOP/s | weights GB/s |")
    print("|---:|---|---:|---:|---:|")
    for rows in row_counts:
        inputs = {576: torch.randn(rows, 576), 1536: torch.randn(rows, 1536)}
        flops = sum(2 * rows * w.numel() for w in weights)
        rates = {}
        for kernel, product in (("aten", F.linear), ("onednn", cpu.linear)):
            seconds = median_seconds(functools.partial(decode_products, product, inputs, weights), rounds)
            rates[kernel] = weight_gb / seconds
            print(f"| {rows} | {kernel} | {seconds * 1e3:.1f} | {flops / seconds / 1e9:.1f} | {rates[kernel]:.1f} |")
        print(
            f"DECODE rows={rows} aten_weights_gbps={rates['aten']:.2f} onednn_weights_gbps={rates['onednn']:.2f} read_gbps={read_gbps:.2f}"
        )


if __name__ == "__main__":
    main()
