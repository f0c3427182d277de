"""The rollout's decode: ``generate`` against its alternatives on the same workload.

    python -m tools.benchmarks.decode_bench                   # SmolLM2, 8 chat prompts, 32 new tokens, 4 rounds
    python -m tools.benchmarks.decode_bench --threads 1 --rounds 6
    python -m tools.benchmarks.decode_bench --compile         # also a torch.compile'd decode step (minutes to compile)
    python -m tools.benchmarks.decode_bench --engine vllm     # the rollout engines: hf's generate against vLLM (docs/rollout-engines.md)
    python -m tools.benchmarks.decode_bench --isa avx2        # as on an AVX2-only CPU (the first line names the kernels' ISA)

The rows: ``generate`` with PyTorch's own CPU linear kernel (MKL) and with oneDNN's
(``cpu.linear``, what the module uses on a CPU), ``generate`` with a preallocated (static)
KV cache, a hand-written KV-cached sampling loop over the model's forward, and with
``--compile`` the static-cache ``generate`` with the model's forward compiled by ``torch.compile``
(inductor; its first call, the compilation, is reported on its own and left out of the median),
and ``generate`` with every product left out (each ``nn.Linear``, the output layer's included,
returns zeros of its output's shape) drawing as the module's ``hf`` engine does (``DeclaredDraw``: one
uniform per row, where the other rows' ``multinomial`` takes one exponential per row and token): what
the module's decode costs beyond its products (attention, the KV cache, norms, the draw, the calls'
overhead).
All draw from the untruncated distribution (top_k = 0, top_p = 1, temperature 1) with the same
seed, so under one kernel they must draw the very same tokens as that kernel's ``generate``: a
difference is reported (under the other kernel the logits differ by rounding, and a token may
too). Rounds alternate the rows so a drifting load hits all alike; the table gives each one's
median seconds, its ratio to ``generate`` with the default kernel, and the decode floor of the
roofline (``tools/benchmarks/roofline.py``: prefill compute, then each step's weights and KV cache read, at
this machine's measured rates).

The last line, ``DECODE rest_s=<s> floor_s=<s> products_allowed=<r>``: the row without products,
the floor, and what the products may take at most, in floors, for ``generate`` to stay within 1.6x of
the floor (issue 30's bar): 1.6 - rest_s / floor_s. The products' own floor is most of the floor
(attention's share is small), so a value near 1 asks of the products the matmul rate and the read
bandwidth at once.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from collections.abc import Sequence
from typing import Optional

from tools._cli_args import open_speed_tool, option_number, tool_parser
from tools.benchmarks import isa, roofline
from tools.benchmarks.bench.measure import builtin_prompts, quiet


@__import__("torch").no_grad()
def sample_loop(model, input_ids, attention_mask, max_new_tokens: int, eos_token_id: int):
    """Sampled tokens (batch, max_new_tokens): prefill with the LM head on the last position,
    then one cached forward per token, drawing each from softmax(logits) with ``multinomial``
    (``generate``'s draw). Every row samples ``max_new_tokens`` tokens, EOS banned as
    min_new_tokens = max_new_tokens bans it in ``generate`` (its logit set to -inf)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1
    )
    tokens = []
    for step in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        logits[:, eos_token_id] = -math.inf
        token = torch.multinomial(logits.softmax(-1), num_samples=1)
        tokens.append(token)
        if step + 1 == max_new_tokens:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=token, attention_mask=attention_mask, position_ids=positions, past_key_values=cache, use_cache=True)
    return torch.cat(tokens, dim=1)


@contextlib.contextmanager
def products_left_out(model):
    """Every ``nn.Linear`` of ``model`` returns zeros of its output's shape while inside: a decode
    step without its products (instance attributes, removed on leaving)."""
    import torch

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        m.forward = lambda x, out=m.out_features: x.new_zeros(*x.shape[:-1], out)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("--rounds", type=option_number(integer=True, at_least=1), default=4)
    parser.add_argument("--batch-size", type=option_number(integer=True, at_least=1), default=8)
    parser.add_argument("--max-new-tokens", type=option_number(integer=True, at_least=1), default=32)
    parser.add_argument("--threads", type=option_number(integer=True, at_least=0), default=0)
    parser.add_argument("--compile", action="store_true", help="also time generate with a torch.compile'd forward")
    parser.add_argument("--engine", choices=("vllm",), help="compare the rollout engines hf and ENGINE instead of the decode loops")
    parser.add_argument("--num-generations", type=int, nargs="+", default=[1, 4], help="--engine: responses per prompt, one workload each")
    isa.add_argument(parser)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = open_speed_tool(parse_args, __spec__.name, argv)
    if args.engine:
        compare_engines(args)
        return
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    from rlhf_lightning import cpu
    from rlhf_lightning.models import load_causal_lm, load_tokenizer
    from rlhf_lightning_plugins.rollout_engines import DeclaredDraw

    if args.threads:
        torch.set_num_threads(args.threads)
    quiet()
    cpu.tune_malloc()  # as the module does
    tokenizer = load_tokenizer("smollm2")
    tokenizer.padding_side = "left"
    model = load_causal_lm("smollm2", vocab_size=len(tokenizer)).eval()
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in builtin_prompts(args.batch_size)
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    config = GenerationConfig(
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    static = GenerationConfig(**{**config.to_dict(), "cache_implementation": "static"})
    prompt_len = enc["input_ids"].shape[1]
    default_kernel = cpu.resolve_cpu_linear("auto")
    kernels = {"aten": contextlib.nullcontext, "onednn": cpu.onednn_linear}
    compiled = torch.compile(model.forward, dynamic=False) if args.compile else None

    def generate(generation_config, forward=None):
        def run():
            if forward is not None:
                model.forward = forward  # an instance attribute: generate calls it
            try:
                return model.generate(**enc, generation_config=generation_config)[:, prompt_len:]
            finally:
                model.__dict__.pop("forward", None)

        return run

    runs = {("generate", kernel): (kernel, generate(config)) for kernel in kernels if kernel == "aten" or cpu.onednn_available()}
    runs[("generate, static cache", default_kernel)] = (default_kernel, generate(static))
    runs[("loop", default_kernel)] = (
        default_kernel,
        lambda: sample_loop(model, enc["input_ids"], enc["attention_mask"], args.max_new_tokens, tokenizer.eos_token_id),
    )
    if compiled is not None:
        runs[("generate, static cache, torch.compile", "aten")] = ("aten", generate(static, compiled))
    rest = ("generate, products left out, the module's draw", default_kernel)
    greedy = GenerationConfig(
        **{**config.to_dict(), "do_sample": False, "temperature": None, "top_k": None, "top_p": None, "min_new_tokens": None}
    )
    draw = DeclaredDraw(1.0, 0, 1.0, tokenizer.eos_token_id, args.max_new_tokens, prompt_len)

    def without_products():
        with products_left_out(model):
            return model.generate(**enc, generation_config=greedy, logits_processor=LogitsProcessorList([draw]))[:, prompt_len:]

    runs[rest] = (default_kernel, without_products)
    seconds, tokens, compile_s = {name: [] for name in runs}, {}, None
    for round_ in range(args.rounds + 1):  # round 0 warms up (and compiles)
        for name, (kernel, run) in runs.items():
            torch.manual_seed(round_)
            start = time.perf_counter()
            with torch.no_grad(), kernels[kernel]():
                tokens[name] = run()
            elapsed = time.perf_counter() - start
            if round_:
                seconds[name].append(elapsed)
            elif "torch.compile" in name[0]:
                compile_s = elapsed
        same = {
            f"{n[0]} [{n[1]}]": torch.equal(tokens[n], tokens[("generate", runs[n][0])]) for n in runs if n[0] != "generate" and n != rest
        }
        print(
            f"round {round_}: "
            + ", ".join(f"{n[0]} [{n[1]}] {s[-1]:.3f} s" for n, s in seconds.items() if round_)
            + f"; same tokens as generate under the same kernel: {same}",
            flush=True,
        )
    peaks = roofline.machine_peaks()
    shape = roofline.ModelShape.of(model)
    passes = roofline.iteration_costs(shape, args.batch_size, prompt_len, args.max_new_tokens, 1, 1, 0)["rollout"]
    floor = roofline.floor_seconds(passes, peaks["flops_per_s"], peaks["bytes_per_s"])
    print(
        f"\n{torch.get_num_threads()} thread(s), {peaks['flops_per_s'] / 1e9:.1f} GFLOP/s, {peaks['bytes_per_s'] / 1e9:.1f} GB/s; "
        f"batch {args.batch_size}, prompt {prompt_len} tokens padded, {args.max_new_tokens} new tokens; medians of {args.rounds}"
    )
    if compile_s is not None:
        print(f"torch.compile: first call (compilation) {compile_s:.1f} s")
    print(f"| decode [linear kernel] | s (median) | vs generate [{default_kernel}] | vs roofline floor |\n|---|---:|---:|---:|")
    base = statistics.median(seconds[("generate", default_kernel)])
    for (name, kernel), values in seconds.items():
        median = statistics.median(values)
        print(f"| {name} [{kernel}] | {median:.3f} | {median / base:.3f} | {median / floor:.2f} ({floor:.3f} s) |")
    rest_s = statistics.median(seconds[rest])
    print(f"DECODE rest_s={rest_s:.3f} floor_s={floor:.3f} products_allowed={1.6 - rest_s / floor:.3f}")


def compare_engines(args: argparse.Namespace) -> None:
    """The module's own rollout engines on SmolLM2 (the module's chat-rendered prompts, temperature 1,
    every response ``--max-new-tokens`` long): ``hf`` and ``--engine`` sample the same batch in
    alternating rounds after one warm-up round each; the engine's start-up (once per run) is reported
    apart. Prints one ``DECODE workload=PxGxT hf_s= vllm_s= vllm_vs_hf=`` line per workload (the ratio:
    hf's median seconds over the engine's, > 1 where the engine is faster), then ``DECODE
    vllm_vs_hf=<ratio>`` of the first workload."""
    import os

    import torch

    from rlhf_lightning.module import PPORLHF
    from rlhf_lightning_plugins.rollout_engines import HFGenerate

    quiet()
    n = args.max_new_tokens
    module = PPORLHF(
        policy="smollm2", rollout_engine=args.engine, sampling=dict(max_new_tokens=n, min_new_tokens=n, old_logprobs="forward")
    )
    module.configure_model()
    hf, engine, ratios = HFGenerate(), module.rollout_engine, []
    start = time.perf_counter()
    engine.sample(module.sampler, module.sampler.encode(builtin_prompts(1)), seed=0)  # starts the engine
    print(f"{args.engine} start-up (weights written, engine built): {time.perf_counter() - start:.1f} s", flush=True)
    for generations in args.num_generations:
        prompts = [p for p in builtin_prompts(args.batch_size) for _ in range(generations)]
        enc = module.sampler.encode(prompts)
        seconds = {"hf": [], args.engine: []}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for name, sampler in (("hf", hf), (args.engine, engine)):
                start = time.perf_counter()
                samples = sampler.sample(module, enc, seed=round_)
                if round_:
                    seconds[name].append(time.perf_counter() - start)
            assert samples.sequences.shape[1] == enc["input_ids"].shape[1] + n, "every response is max_new_tokens long"
        t_hf, t_engine = statistics.median(seconds["hf"]), statistics.median(seconds[args.engine])
        ratios.append(t_hf / t_engine)
        print(
            f"DECODE workload={args.batch_size}x{generations}x{n} hf_s={t_hf:.3f} {args.engine}_s={t_engine:.3f} "
            f"{args.engine}_vs_hf={ratios[-1]:.3f} threads={torch.get_num_threads()} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
            f"load={os.getloadavg()[0]:.2f}",
            flush=True,
        )
    print(f"DECODE {args.engine}_vs_hf={ratios[0]:.3f}")


if __name__ == "__main__":
    main()
