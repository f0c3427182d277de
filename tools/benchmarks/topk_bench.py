"""The teacher's top k against its whole distribution, on SmolLM2: the teacher's signal per token in bytes, the KL's peak
tensor memory, and one distillation update's time at k = 1, 8, 64 and the full vocabulary, in one run.

    python -m tools.benchmarks.topk_bench                         # 8 sequences of 24 response tokens, 3 rounds
    python -m tools.benchmarks.topk_bench --ks 1 8 64 --batch-size 4 --response-len 16 --rounds 5
    python -m tools.benchmarks.topk_bench --isa avx2              # as on an AVX2-only CPU (the first line names the kernels' ISA)

The student is SmolLM2-135M-Instruct (a 49152-token vocabulary; every weight trained), the teacher a frozen copy of it
with its weights moved by 2% of each tensor's spread (so the KL is not 0). The sequences: ``--batch-size`` chat prompts
(the built-in ones) followed by ``--response-len`` random tokens, the same in every row. One update is the student's
forward over them, the teacher's forward (no gradient), the teacher's signal, the KL per response token
(``rlhf_lightning_plugins.kl_estimators``: ``topk_forward_tail`` with k from the signal (:class:`TopKSignal`), or
``full``, the exact reverse KL, from the teacher's logits), its mean, and the backward through the student: no
optimizer step. Per row:

- ``wire B/token``: the signal a teacher server sends per response token, counted (``signal_bytes_per_token``:
  k float32 log-probs, k int32 ids and the tail's float32 log-mass; V float32 for the full distribution);
- ``held B/token``: what the trainer holds of it, measured: the bytes of the signal's tensors (torch's ids are int64)
  or of the teacher's (batch, len, V) float32 logits, per token;
- ``KL peak B/token``: the peak bytes of the tensors the KL's forward and backward create, from the student's logits
  and what is held (a ``TorchDispatchMode`` counts each new storage until it is freed), per token; the top-k rows
  also from the teacher's whole logits (the signal taken inside: the same values, docs/performance.md);
- ``update peak MB``: the same count over the whole update (activations, gradients, the teacher's logits, which its
  output layer writes whatever k is, the signal built from them, the logits then freed);
- ``update s``: the update's median seconds over ``--rounds`` rounds (one warm-up; rows alternate within a round, so a
  drifting load hits all alike), and its ratio to the full vocabulary's.

The last line reads ``TOPK k=<k> wire_ratio=<full's bytes / k's> time_ratio=<k's seconds / full's>`` for the largest k.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import weakref
from collections.abc import Sequence
from typing import Optional

from tools._cli_args import open_speed_tool, option_number, tool_parser
from tools.benchmarks import isa
from tools.benchmarks.bench.measure import builtin_prompts, quiet


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument("--ks", type=option_number(integer=True, at_least=1), nargs="+", default=[1, 8, 64])
    parser.add_argument("--batch-size", type=option_number(integer=True, at_least=1), default=8)
    parser.add_argument("--response-len", type=option_number(integer=True, at_least=1), default=24)
    parser.add_argument("--rounds", type=option_number(integer=True, at_least=1), default=3)
    parser.add_argument(
        "--threads",
        type=option_number(integer=True, at_least=0),
        default=0,
        help="0: the command's choice (the cores the load leaves free)",
    )
    isa.add_argument(parser)
    return parser.parse_args(argv)


def tensor_peak():
    """A ``TorchDispatchMode`` that counts the bytes of every storage an op creates while inside until it is freed:
    ``.current`` and ``.peak`` (tensors made before entering are not counted; a view shares its storage's count)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class TensorPeak(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live, self.current, self.peak = {}, 0, 0

        def _freed(self, key: int, nbytes: int) -> None:
            if self.live.pop(key, None) is not None:
                self.current -= nbytes

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    storage = t.untyped_storage()
                    key, nbytes = storage.data_ptr(), storage.nbytes()
                    if nbytes and key not in self.live:
                        self.live[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._freed(key, nbytes))
                        self.current += nbytes
                        self.peak = max(self.peak, self.current)
            return out

    return TensorPeak()


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = open_speed_tool(parse_args, __spec__.name, argv)
    import copy

    from rlhf_lightning import threads

    threads.set_passive_wait()  # as the command does, before torch loads: idle threads sleep on a shared machine
    choice = threads.machine_threads(args.threads or None)
    import torch

    from rlhf_lightning import cpu
    from rlhf_lightning.models import load_causal_lm, load_tokenizer
    from rlhf_lightning.registry import registry
    from rlhf_lightning_plugins.kl_estimators import signal_bytes_per_token, teacher_topk

    torch.set_num_threads(choice.threads)
    print(choice.line(threads.wait_policy() or "default"), flush=True)
    quiet()
    cpu.tune_malloc()  # as the module does
    load_start = os.getloadavg()[0]
    tokenizer = load_tokenizer("smollm2")
    tokenizer.padding_side = "left"
    student = load_causal_lm("smollm2", vocab_size=len(tokenizer)).train()
    teacher = copy.deepcopy(student).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in teacher.parameters():
            weight.add_(0.02 * weight.std().nan_to_num() * torch.randn(weight.shape, generator=generator))
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in builtin_prompts(args.batch_size)
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    vocab = student.config.vocab_size
    length = args.response_len
    response = torch.randint(vocab, (args.batch_size, length), generator=generator)
    input_ids = torch.cat([enc["input_ids"], response], dim=1)
    attention_mask = torch.cat([enc["attention_mask"], torch.ones_like(response)], dim=1)
    tokens = args.batch_size * length
    estimators = {k: registry("kl_estimator").create("topk_forward_tail", k=k) for k in args.ks}
    full = registry("kl_estimator").create("full")
    rows = [*args.ks, None]  # None: the full vocabulary

    def response_logits(model) -> torch.Tensor:
        # The positions that predict the response tokens: (batch, response_len, V).
        return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=length + 1).logits[:, :-1]

    def signal_of(k: Optional[int], ref_logits: torch.Tensor):
        return ref_logits if k is None else teacher_topk(ref_logits, k)

    def kl_loss(k: Optional[int], logits: torch.Tensor, held) -> torch.Tensor:
        estimator = full if k is None else estimators[k]
        return estimator(None, None, logits, held).mean()

    def update(k: Optional[int]) -> None:
        logits = response_logits(student)
        with torch.no_grad():
            held = signal_of(k, response_logits(teacher))  # the teacher's logits freed here for a top k
        kl_loss(k, logits, held).backward()
        student.zero_grad(set_to_none=True)

    def kl_step_peak(k: Optional[int], held) -> int:
        """Peak bytes of the KL's forward and backward from a leaf of the student's logits and ``held``."""
        logits = student_logits.clone().requires_grad_()
        with tensor_peak() as peak:
            kl_loss(k, logits, held).backward()
        return peak.peak

    with torch.no_grad():
        ref_logits, student_logits = response_logits(teacher), response_logits(student)
    table = {}
    for k in rows:
        held = signal_of(k, ref_logits)
        held_bytes = held.numel() * held.element_size() if k is None else held.nbytes()
        with tensor_peak() as peak:
            update(k)
        table[k] = {
            "wire": signal_bytes_per_token(vocab if k is None else k, vocab),
            "held": held_bytes / tokens,
            "kl_peak": kl_step_peak(k, held) / tokens,
            "kl_peak_from_logits": None if k is None else kl_step_peak(k, ref_logits) / tokens,
            "update_peak_mb": peak.peak / 2**20,
            "seconds": [],
        }
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for k in rows:
            start = time.perf_counter()
            update(k)
            if round_:
                table[k]["seconds"].append(time.perf_counter() - start)
        if round_:
            print(f"round {round_}: " + ", ".join(f"{k or 'full'} {table[k]['seconds'][-1]:.2f} s" for k in rows), flush=True)
    load_end = os.getloadavg()[0]
    base = table[None]
    base_s = statistics.median(base["seconds"])
    print(
        f"\nSmolLM2-135M-Instruct, V = {vocab}; {args.batch_size} sequences of {enc['input_ids'].shape[1]} prompt + {length} response "
        f"tokens ({tokens} KL positions); {torch.get_num_threads()} thread(s), {threads.available_cores()} cores, torch {torch.__version__}; "
        f"1-minute load {load_start:.2f} at the start, {load_end:.2f} at the end; medians of {args.rounds} rounds"
    )
    print(
        "| teacher's signal | KL | wire B/token | full / it | held B/token | KL peak B/token (from the signal) "
        "| KL peak B/token (from the logits) | update peak MB | update s | / full's |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in rows:
        row, seconds = table[k], statistics.median(table[k]["seconds"])
        from_logits = "" if row["kl_peak_from_logits"] is None else f"{row['kl_peak_from_logits']:,.0f}"
        print(
            f"| {'full vocabulary' if k is None else f'top {k} + tail'} | {'full' if k is None else 'topk_forward_tail'} "
            f"| {row['wire']:,} | {base['wire'] / row['wire']:,.0f} | {row['held']:,.0f} | {row['kl_peak']:,.0f} | {from_logits} "
            f"| {row['update_peak_mb']:.0f} | {seconds:.2f} | {seconds / base_s:.2f} |"
        )
    k = max(args.ks)
    print(f"TOPK k={k} wire_ratio={base['wire'] / table[k]['wire']:.1f} time_ratio={statistics.median(table[k]['seconds']) / base_s:.3f}")


if __name__ == "__main__":
    main()
