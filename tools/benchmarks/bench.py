"""Phase-by-phase benchmark of one PPO-RLHF iteration, against the floors of the same work.

    python tools/benchmarks/bench.py                                  # SmolLM2, full, LoRA and GRPO, 1 and 4 PPO epochs
    python tools/benchmarks/bench.py --mode lora --ppo-epochs 4 --iters 3 --threads 1
    python tools/benchmarks/bench.py --profile                        # plus torch.profiler's top ops of one iteration
    python tools/benchmarks/bench.py --device cuda --bf16             # GPU, bf16 autocast
    python tools/benchmarks/bench.py --tiny                           # the tiny random model, 2 iterations (the tests)
    python tools/benchmarks/bench.py --isa avx2 --threads 1           # as on an AVX2-only CPU (oneDNN, MKL and ATen capped)
    python tools/benchmarks/bench.py --mode full --ppo-epochs 1 --strategy fsdp2 --devices 2 --threads 1   # per rank
    OMP_NUM_THREADS=1 python tools/benchmarks/bench.py --max-staleness 1 --mode both   # asynchronous rollouts against the loop
    python tools/benchmarks/bench.py --mode full --ppo-epochs 1 --warmup 1 --iters 1 --strategy fsdp2 --devices 2 --threads 1 --memory

The workload is fixed: SmolLM2-135M-Instruct (``--policy``), the first ``--batch-size`` (8)
built-in prompts every iteration, rendered with the chat template (SmolLM2's adds a system
prompt, so a prompt is about 40 tokens; ``--no-chat-template`` gives about 12), and exactly
``--max-new-tokens`` (32) sampled tokens per response (``min_new_tokens`` = ``max_new_tokens``),
the VADER ``sentiment`` reward. The two modes are the two standard setups: ``full`` fine-tunes
the policy with a separate reference copy and a separate critic trunk; ``lora`` trains a LoRA
adapter (rank 16), uses the adapter-disabled policy as the reference and a value head on the
policy's trunk (``critic: shared``), as ``configs/quickstart.yaml`` does. ``--critic`` sets one
critic for both modes. ``grpo`` is the critic-free setup of ``configs/grpo.yaml``: LoRA as in
``lora``, no critic (``critic: none``), GRPO's group advantages over ``--num-generations`` (4)
responses to each of ``--batch-size / --num-generations`` prompts, so a rollout holds as many
responses as in the other modes.

Each mode runs in its own subprocess, so the peak resident memory of full fine-tuning and
LoRA are comparable (a row's peak RSS is its process's peak so far: its own run and the
mode's runs with fewer epochs before it). For every ``--ppo-epochs`` value the subprocess
builds a fresh module, drives its own ``training_step`` under a real Lightning Trainer and
times its phases (exclusive wall-clock seconds, medians
over ``--iters`` iterations after ``--warmup``):

- rollout:    ``encode_prompts`` + the rollout engine's sample (hf: the shared prompts' prefill, ``generate``);
- score:      the rest of ``rollout()`` (old log-probs + values forward, reference forward,
              decoding, log-prob gathers, entropy), the KL estimate and the reward;
- advantages: ``compute_advantages``;
- update:     ``ppo_update`` (all epochs: forward, backward, gradient clipping, optimizer steps);
- other:      the rest of the training step (per-token rewards, metrics, logging, beta update).

Right after every iteration, on its prompts and sequences, the floors: a bare ``generate`` with
the same inputs and generation config (LoRA: with the adapter merged, so no LoRA branch runs),
one no-grad forward of each extra model (reference; critic when it has its own trunk), and one
forward+backward of the policy and critic on a minibatch. Sum of floors = generate + one
forward per extra model + ppo_epochs * num_minibatches * fwd+bwd: old log-probs can come from
the sampler's own logits, and the optimizer step is not a floor. The ratios are medians of
each iteration's ratio to the floors measured right after it, so a machine load that drifts
during the run hits both sides alike.

The floors above are what the software stack does at best, not what the machine can do. The
roofline is the machine's: before the runs this process measures the sustained matmul rate
(2048 x 2048 products) and read bandwidth (a 512 MB sum) once, with the workers' threads; each
run counts its passes over the weights from the model's shape (``roofline.iteration_costs``: the prefill
and each decode step of the rollout, each scoring forward, each forward, backward and AdamW step
of the update; FLOPs of matmuls and attention, bytes of weights, KV cache and gradients), and a
pass's floor is the longer of its FLOPs at the matmul rate and its bytes at the bandwidth. The
roofline table gives each phase's GFLOPs, GB, floor and measured seconds; the score phase's
floor leaves out the reward backend (VADER: no model) and the text decoding.

Prints the tables, and last a line ``BENCH rollout_vs_generate=<r> iteration_vs_floors=<r>
lora_vs_full_rss=<r> iter_s=<s> tokens_per_s=<t> iteration_vs_roofline=<r>``: the ratios are the worst over the
full and LoRA runs, iter_s and tokens_per_s those of the slowest of them, lora_vs_full_rss the
peak RSS of the LoRA runs over that of the full runs (nan unless both modes ran); the line reads
only the ``full`` and ``lora`` runs (the ``grpo`` rows are in the tables), so it means what it did
before that mode existed, and with ``--mode grpo`` alone it reads the grpo runs.

``--strategy ddp|fsdp2 --devices N`` runs each (mode, epochs) on N processes (gloo on CPU, NCCL
on GPUs; ``--batch-size`` prompts per rank): one table row per rank, with that rank's peak RSS
and iteration time. Under ``fsdp2`` the rollout gathers the policy once (the module's way), and
one more floor is measured: ``generate`` on the sharded policy as FSDP2's hooks run it, every
block all-gathered again at each decode step (``sharded gen``; full fine-tuning only).

``--memory`` (with ``--strategy ddp|fsdp2``) runs the same work in one process first, then on
``--devices`` processes, both with ``cpu.malloc: default`` and glibc's
``MALLOC_MMAP_THRESHOLD_=65536`` (blocks from 64 KiB up are mmapped and returned when freed, so an
RSS counts what is held, not what the heap once held; ``--cpu-malloc tuned`` measures the
module's default instead). Each process's peak RSS is read per phase (VmHWM, started again at
every phase boundary): the training iterations' peak apart from the floors' passes, which are the
benchmark's own. It prints each process's decomposition (MB): the baseline before the models are
built (python, torch and the libraries, the process group, tokenizer), the weights, AdamW's
moments and the rest held at the last iteration's start, each phase's peak above that start, the
gradients (held from a backward to the optimizer step), the peaks; a line with the floor,
(a rank's baseline + one process's states / N) / (one process's baseline + states), the ratio left
if each process held nothing but its baseline and its share of the states; and last
``MEMORY rank_peak_vs_single=<r>``: the largest rank's training peak over the one process's
(per-rank batch the same: activations do not shrink). Use ``--warmup 1 --iters 1`` or more: the
first iteration runs its forwards before AdamW's moments exist.

``--engine vllm`` runs every (mode, epochs) twice in one invocation, with vLLM and then with ``hf``
(with ``--strategy ddp|fsdp2 --devices N``: one vLLM engine per rank), and after the tables prints one
line per run and rank,

    ENGINE engine=<e> mode=<m> ppo_epochs=<n> <rank> rollout_s=<s> weight_sync_s=<s> sync_mb=<MB> lora_sync=<full|merged|adapter> iter_s=<s> peak_rss_mb=<MB> peak_gpu_mb=<MB> load=<a>-<b>

(medians over the timed iterations; rollout_s includes vLLM's weight sync; weight_sync_s and sync_mb
are the median sync's seconds and bytes pushed, the adapter alone with LoRA where vLLM serves it; nan
for ``hf``), then ``ENGINES vllm_vs_hf_rollout <mode>/<epochs>/rank<r>=<vLLM's rollout seconds over hf's>``.

The first line says which instruction set oneDNN, MKL and ATen run (``tools/benchmarks/isa.py``); ``--isa
avx2`` caps them at AVX2 on a CPU with more, for the figures of an AVX2-only machine. After the
tables, each run's passes over a model's trunk in its last timed iteration, per phase
(``PassCounter``: ``generate`` calls, decode steps, forwards, forwards with backward): what the
tests check instead of a time.

``--max-staleness K`` measures something else: the seconds per iteration of the real loop (the plain module, no
phase clock, no floors) with the sampler running K updates ahead (``model.off_policy.max_staleness``, its own
thread; ``--engine``'s engine) against the synchronous loop, in one process, runs alternating K, 0, K, 0 per mode (``full``, ``lora``)
so that a load that drifts hits both alike; both with ``model.sampling.old_logprobs: forward`` (required with
K > 0), the prompts of the built-in file in order (``PromptDataModule``, whose loader the sampler reads ahead),
``--max-new-tokens`` tokens per response and ``--ppo-epochs``' first value with ``--num-minibatches``. It prints
one line per mode and last ``STALENESS k=<K> full_ratio=<r> lora_ratio=<r> ...``, each ratio the median
iteration seconds with K over those without. Run it with ``OMP_NUM_THREADS=1``: one thread trains, and with K > 0
one more samples.

On a CPU shared with other jobs use ``--threads 1``: spinning OpenMP threads on a busy
2-core machine make a forward pass several times slower and the timings erratic.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: the argument types every tool shares
import isa
import roofline
from _cli_args import option_number

REPO = Path(__file__).resolve().parents[2]
RESULT_PREFIX = "BENCH_RESULT "
# --memory: glibc mmaps every block from 64 KiB up and unmaps it when freed, so an RSS counts the
# tensors held, not the heap's high-water mark (a shard is half its tensor: FSDP2 moves many of
# SmolLM2's matrices under glibc's usual thresholds, into a heap that keeps what it once held).
MEMORY_MMAP_THRESHOLD = 65536
PHASES = ("rollout", "score", "score_policy", "score_ref", "advantages", "update", "other")


# ---------------------------------------------------------------------------------- arguments
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--mode",
        choices=("full", "lora", "grpo", "both", "all"),
        default="all",
        help="full fine-tuning, LoRA (with a shared critic), critic-free GRPO on LoRA; both: full and lora; all (default): the three",
    )
    parser.add_argument(
        "--ppo-epochs",
        type=option_number(integer=True, at_least=1),
        nargs="+",
        default=[1, 4],
        help="PPO epochs per iteration (one run each)",
    )
    parser.add_argument("--iters", type=option_number(integer=True, at_least=1), help="timed iterations per run (default 5; --tiny: 2)")
    parser.add_argument("--warmup", type=option_number(integer=True, at_least=0), help="untimed iterations first (default 1)")
    parser.add_argument("--policy", help="model spec (default smollm2; --tiny: tiny)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random policy, 2 iterations (for tests)")
    parser.add_argument("--batch-size", type=option_number(integer=True, at_least=1), default=8, help="prompts per iteration")
    parser.add_argument(
        "--max-new-tokens", type=option_number(integer=True, at_least=1), default=32, help="response length (min_new_tokens is the same)"
    )
    parser.add_argument("--no-chat-template", action="store_true", help="feed the raw prompts, without the chat template")
    parser.add_argument(
        "--num-minibatches", type=option_number(integer=True, at_least=1), default=1, help="minibatches (optimizer steps) per PPO epoch"
    )
    parser.add_argument(
        "--num-generations", type=option_number(integer=True, at_least=1), default=4, help="--mode grpo: responses per prompt"
    )
    parser.add_argument(
        "--old-logprobs",
        choices=("forward", "sampler"),
        default="sampler",
        help="model.sampling.old_logprobs (the module's default: sampler): reuse the sampler's logits, or recompute log pi_old with a forward",
    )
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="model.rollout_engine; vllm also prints DECODE vllm_vs_hf= (bare generate's seconds over the rollout's, a sync included)",
    )
    parser.add_argument("--cpu-linear", choices=("auto", "onednn", "aten"), default="auto", help="cpu.linear: CPU linear kernel")
    parser.add_argument(
        "--cpu-malloc",
        choices=("tuned", "default"),
        help="cpu.malloc (default: tuned, the module's; with --memory: default, so glibc returns freed blocks)",
    )
    parser.add_argument("--critic", choices=("separate", "shared"), help="critic trunk (default: full separate, lora shared)")
    parser.add_argument(
        "--lora-rank", type=option_number(integer=True, at_least=1), default=16, help="LoRA rank of --mode lora (alpha = 2 * rank)"
    )
    parser.add_argument("--reward", default="sentiment", help="reward backend name")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (Trainer precision bf16-mixed) for run and floors")
    parser.add_argument(
        "--threads", type=option_number(integer=True, at_least=0), default=0, help="torch intra-op threads (0: torch's default)"
    )
    parser.add_argument(
        "--strategy",
        choices=("single", "ddp", "fsdp2"),
        default="single",
        help="one process, or --devices processes with DDP or FSDP2 (ModelParallelStrategy)",
    )
    parser.add_argument("--devices", type=option_number(integer=True, at_least=1), default=1, help="processes of --strategy ddp/fsdp2")
    parser.add_argument("--memory", action="store_true", help="peak RSS per rank against one process; last line MEMORY ...")
    parser.add_argument("--results-dir", help=argparse.SUPPRESS)  # where ranks > 0 leave their results
    parser.add_argument("--profile", action="store_true", help="profile one extra iteration per run with torch.profiler")
    parser.add_argument("--profile-rows", type=option_number(integer=True, at_least=1), default=25, help="ops shown by --profile")
    parser.add_argument("--profile-shapes", action="store_true", help="--profile: one row per (op, input shapes)")
    parser.add_argument("--save", metavar="PATH", help="also write every run's results as JSON (after each run)")
    isa.add_argument(parser)
    parser.add_argument(
        "--max-staleness",
        type=option_number(integer=True, at_least=1),
        help="iteration seconds with the sampler K updates ahead against the synchronous loop (last line STALENESS ...)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one mode's runs
    args = parser.parse_args(argv)
    args.policy = args.policy or ("tiny" if args.tiny else "smollm2")
    args.iters = (2 if args.tiny else 5) if args.iters is None else args.iters
    args.warmup = 1 if args.warmup is None else args.warmup
    args.cpu_malloc = args.cpu_malloc or ("default" if args.memory else "tuned")
    if (args.strategy == "single") != (args.devices == 1):
        parser.error("--strategy ddp/fsdp2 needs --devices >= 2, --devices >= 2 needs --strategy ddp or fsdp2")
    if args.memory and args.devices == 1 and not args.worker:
        parser.error("--memory compares --devices >= 2 processes of --strategy ddp/fsdp2 with one process")
    if args.batch_size % args.num_minibatches or args.batch_size % args.num_generations:
        parser.error("--batch-size must be divisible by --num-minibatches and by --num-generations")
    return args


# The settings a worker is given on its command line when set (--name-with-dashes VALUE).
WORKER_SETTINGS = [
    "iters",
    "warmup",
    "policy",
    "batch_size",
    "max_new_tokens",
    "num_minibatches",
    "num_generations",
    "critic",
    "old_logprobs",
    "engine",
    "cpu_linear",
    "cpu_malloc",
    "lora_rank",
    "reward",
    "device",
    "threads",
    "profile_rows",
    "strategy",
    "devices",
    "results_dir",
]


def worker_argv(args: argparse.Namespace, mode: str) -> list[str]:
    """The command line of one mode's runs: this script with every setting spelled out."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--mode", mode, "--ppo-epochs"]
    argv += [str(epochs) for epochs in args.ppo_epochs]
    for name in WORKER_SETTINGS:
        if getattr(args, name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for flag in ("no_chat_template", "bf16", "profile", "profile_shapes", "memory"):
        if getattr(args, flag):
            argv.append(f"--{flag.replace('_', '-')}")
    return argv


# ---------------------------------------------------------------------------------- one run
class PhaseClock:
    """Exclusive wall-clock seconds per named phase: time spent in a nested phase counts for it
    alone. CUDA is synchronised at every boundary so GPU work lands in the phase that queued it.
    With ``memory``, also each phase's peak RSS (MB): at every boundary the peak since the last
    one (VmHWM) goes to the phase that was running, and the peak starts again from the current RSS."""

    def __init__(self, device, memory: bool = False) -> None:
        self.device = device
        self.memory = memory
        self.seconds: dict[str, float] = defaultdict(float)
        self.peaks: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        self._since = 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _switch(self) -> None:
        now = self._now()
        if self._stack:
            self.seconds[self._stack[-1]] += now - self._since
            if self.memory:
                self.peaks[self._stack[-1]] = max(self.peaks[self._stack[-1]], peak_rss_mb())
        if self.memory:
            reset_peak_rss()
        self._since = now

    @contextlib.contextmanager
    def __call__(self, name: str, within: Optional[str] = None):
        """Time ``name``; with ``within``, only when called directly inside that phase."""
        if within is not None and (not self._stack or self._stack[-1] != within):
            yield
            return
        import torch

        self._switch()
        self._stack.append(name)
        try:
            with torch.profiler.record_function(f"bench/{name}"):
                yield
        finally:
            self._switch()
            self._stack.pop()

    def wrap(self, name: str, fn, within: Optional[str] = None):
        def timed(*args, **kwargs):
            with self(name, within):
                return fn(*args, **kwargs)

        return timed

    def take(self) -> dict[str, float]:
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds

    def take_peaks(self) -> dict[str, float]:
        peaks, self.peaks = dict(self.peaks), defaultdict(float)
        return peaks

    @property
    def current(self) -> Optional[str]:
        """The innermost phase running now (None between phases)."""
        return self._stack[-1] if self._stack else None


class PassCounter:
    """Counts the passes over each watched model's trunk, per phase: ``generate`` calls (their
    prefill), decode steps (the other forwards ``generate`` makes, a KV cache in hand), no-grad
    forwards (``fwd``) and forwards with autograd on (``fwd+bwd``: the loop backpropagates every
    one). A forward is one call of the trunk (the decoder stack), or two with ``shared_prompts``
    (rlhf_lightning/prefix.py: the distinct prompts, then the responses on their keys and values,
    counted once), so a LoRA reference (the policy with its adapter off) counts as the policy's
    trunk, told apart by its phase. ``phase()`` names
    the phase a pass lands in; None leaves it uncounted (the floors between iterations)."""

    def __init__(self, phase=lambda: "all") -> None:
        self.phase = phase
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    @staticmethod
    def trunk(model):
        """The decoder stack inside a causal LM, a classifier, a PEFT wrapper or a critic."""
        import torch

        return next(m for m in model.modules() if isinstance(getattr(m, "layers", None), torch.nn.ModuleList))

    def watch(self, name: str, model) -> None:
        import torch

        def count(module, args, kwargs) -> None:
            phase = self.phase()
            if phase is None:
                return
            cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5 names it cache
            if getattr(cache, "shared_prompts", False):
                return  # responses on their shared prompts' keys and values: the rest of the pass counted at its prompts
            if cache is not None:
                kind = "decode step" if cache.get_seq_length() else "generate"
            else:
                kind = "fwd+bwd" if torch.is_grad_enabled() else "fwd"
            self.counts[phase][f"{name} {kind}"] += 1

        self.trunk(model).register_forward_pre_hook(count, with_kwargs=True)

    def take(self) -> dict[str, dict[str, int]]:
        counts, self.counts = {p: dict(c) for p, c in self.counts.items()}, defaultdict(lambda: defaultdict(int))
        return counts


def bench_module_class(memory: bool = False):
    """PPORLHF with its phases timed (with ``memory``: and their peak RSS, and the RSS before the
    models are built, ``baseline_rss_mb``); the module's own code runs unchanged in between."""
    from rlhf_lightning.module import PPORLHF

    class TimedPPORLHF(PPORLHF):
        def configure_model(self) -> None:
            first = self.policy is None
            if first:
                self.baseline_rss_mb = rss_mb()  # python, torch and the libraries, the process group, the tokenizer
            super().configure_model()
            if not first:
                return
            self.clock = PhaseClock(self.device, memory)
            self.passes = PassCounter(lambda: self.clock.current)
            for name, model in (("policy", self.policy), ("reference", self.ref_model), ("critic", getattr(self.critic, "trunk", None))):
                if model is not None:
                    self.passes.watch(name, model)
            # the engine's whole sample: hf's prefill of shared prompts before generate, another engine's weight sync
            self.rollout_engine.sample = self.clock.wrap("rollout", self.rollout_engine.sample)
            self.rollout_engine.sync = self.clock.wrap("rollout", self.rollout_engine.sync)  # module.rollout calls it apart
            for name in ("checked_scores", "shape_scores"):
                setattr(self.reward_model, name, self.clock.wrap("score", getattr(self.reward_model, name)))
            # the networks' scoring passes: the policy's (not the update's forwards), pi_old's (the sampler's
            # logits, or a forward: policy_outputs, not timed twice) and the reference's
            networks = self.networks
            for name in ("policy_outputs", "old_policy"):
                setattr(networks, name, self.clock.wrap("score_policy", getattr(networks, name), within="score"))
            reference = networks.reference

            @contextlib.contextmanager
            def timed_reference():
                with self.clock("score_ref", within="score"), reference() as ref:
                    yield ref

            networks.reference = timed_reference

        # Arguments pass through untouched: the benchmark must not depend on the signatures.
        def encode_prompts(self, *args, **kwargs):
            with self.clock("rollout"):
                self.last_encoding = super().encode_prompts(*args, **kwargs)
                return self.last_encoding

        def rollout(self, *args, **kwargs):
            with self.clock("score"):  # whatever rollout() does besides generating is scoring
                self.last_rollout = super().rollout(*args, **kwargs)
                return self.last_rollout

        def kl_per_token(self, *args, **kwargs):
            with self.clock("score"):
                return super().kl_per_token(*args, **kwargs)

        def compute_advantages(self, *args, **kwargs):
            with self.clock("advantages"):
                return super().compute_advantages(*args, **kwargs)

        def _first_critic_values(self, *args, **kwargs):  # the update's first critic forward, V_old read from it
            with self.clock("update"):
                return super()._first_critic_values(*args, **kwargs)

        def ppo_update(self, *args, **kwargs):
            with self.clock("update"):
                return super().ppo_update(*args, **kwargs)

    return TimedPPORLHF


def iteration_recorder(args: argparse.Namespace):
    """A callback that opens the clock's ``other`` phase around each batch, measures the floors
    right after every batch (on its sequences), keeps the timed iterations' phase and floor
    seconds, and profiles the batch after them when asked."""
    import torch
    from lightning.pytorch.callbacks import Callback

    warmup, iters = args.warmup, args.iters

    class IterationRecorder(Callback):
        def __init__(self) -> None:
            self.iterations: list[dict[str, float]] = []
            self.floors: list[dict[str, float]] = []
            self.tokens: list[float] = []
            self.passes: list[dict[str, dict[str, int]]] = []
            self.profile_table: Optional[str] = None
            self._phase = self._profiler = None
            # --memory: MB of RSS at each iteration's start, each phase's peak (the last iteration's),
            # the peaks of the training iterations, of the floors, and before the first iteration.
            self.memory: dict = {"iteration_start": [], "phase_peaks": {}, "train_peak": 0.0, "floors_peak": 0.0}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if args.profile and batch_idx == warmup + iters:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if pl_module.device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self._profiler = torch.profiler.profile(activities=activities, record_shapes=args.profile_shapes)
                self._profiler.__enter__()
            pl_module.clock.take()
            pl_module.passes.take()
            if args.memory:
                self.memory.setdefault("startup_peak", peak_rss_mb())  # the build included
                self.memory["iteration_start"].append(rss_mb())
                pl_module.clock.take_peaks()
            self._phase = pl_module.clock("other")
            self._phase.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self._phase.__exit__(None, None, None)
            seconds, passes = pl_module.clock.take(), pl_module.passes.take()
            if self._profiler is not None:
                self._profiler.__exit__(None, None, None)
                self.profile_table = self._profiler.key_averages(group_by_input_shape=args.profile_shapes).table(
                    sort_by="self_cpu_time_total", row_limit=args.profile_rows
                )
                self._profiler = None
                return
            if args.memory:
                self.memory["phase_peaks"] = pl_module.clock.take_peaks()
                self.memory["train_peak"] = max(self.memory["train_peak"], *self.memory["phase_peaks"].values())
                reset_peak_rss()
            floors = measure_floors(pl_module, args)  # the warm-up iterations warm the floors up too
            if args.memory:
                self.memory["floors_peak"] = max(self.memory["floors_peak"], peak_rss_mb())
            if batch_idx >= warmup:
                self.iterations.append(seconds)
                self.floors.append(floors)
                self.tokens.append(float(pl_module.last_rollout.response_mask.sum()))
                self.passes.append(passes)

    return IterationRecorder()


def quiet() -> None:
    """Keep the output a table: no Lightning banners, progress bars or expected warnings."""
    import transformers

    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")  # dataloader workers, eval-mode reference, generation flags


def builtin_prompts(n: int) -> list[str]:
    from rlhf_lightning.data import BUILTIN_TRAIN

    with BUILTIN_TRAIN.open() as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:n]


def trainable_numel(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad) if model is not None else 0


def peak_rss_mb() -> float:
    """This process's peak resident memory: Linux's VmHWM (getrusage's ru_maxrss would carry over
    the peak of the parent that forked it: this script's own, or rank 0's for the ranks it starts),
    since the process started or since the last ``reset_peak_rss``."""
    return _proc_status_mb("VmHWM:") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: KiB (macOS: bytes)


def rss_mb() -> float:
    """This process's resident memory now (Linux; nan elsewhere)."""
    return _proc_status_mb("VmRSS:") or math.nan


def _proc_status_mb(field: str) -> Optional[float]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) / 1024  # kB
    return None


def reset_peak_rss() -> bool:
    """Start this process's peak RSS (VmHWM) again from its current RSS (Linux's ``clear_refs``
    5), so that ``peak_rss_mb`` reads the peak of what runs from now on. False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def run_one(args: argparse.Namespace, ppo_epochs: int) -> dict:
    """One (mode, ppo_epochs) run in this process: timed iterations, then the floors."""
    import torch
    from lightning import Trainer, seed_everything
    from torch.utils.data import DataLoader

    from rlhf_lightning import cpu
    from rlhf_lightning.fsdp2 import FSDP2Strategy
    from rlhf_lightning.prefix import prompts_beginning, trim_left_padding
    from rlhf_lightning.trainer_settings import QUIET_TRAINER

    quiet()
    load_before = os.getloadavg()[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(0, verbose=False)
    lora, grpo = args.mode in ("lora", "grpo"), args.mode == "grpo"
    critic = "none" if grpo else args.critic or ("shared" if lora else "separate")
    module = bench_module_class(args.memory)(
        policy=args.policy,
        reward_model=args.reward,
        sampling=dict(
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens,
            old_logprobs=args.old_logprobs,
            num_generations=args.num_generations if grpo else 1,
        ),
        prompts=dict(chat_template=not args.no_chat_template),
        ppo=dict(epochs=ppo_epochs, num_minibatches=args.num_minibatches),
        critic=critic,
        rollout_engine=args.engine,
        lora=dict(rank=args.lora_rank if lora else 0, alpha=2.0 * args.lora_rank),
        runtime=dict(log_samples_every_n_steps=0),
        **(dict(advantage_estimator="grpo") if grpo else {}),
    )
    cpu_settings = cpu.CPUSettings(linear=args.cpu_linear, malloc=args.cpu_malloc)
    prompts_per_batch = args.batch_size // module.sampling.num_generations  # the same number of responses in every mode
    prompts = builtin_prompts(prompts_per_batch)
    batches = args.warmup + args.iters + int(args.profile)
    # Each rank draws its share of the loader: batches of the same prompts on every rank.
    loader = DataLoader(prompts * batches * args.devices, batch_size=prompts_per_batch, shuffle=False)
    recorder = iteration_recorder(args)
    with tempfile.TemporaryDirectory(prefix="rlhf_bench_") as root:
        trainer = Trainer(
            **{**QUIET_TRAINER, "accelerator": "gpu" if args.device == "cuda" else "cpu", "devices": args.devices},
            max_epochs=1,
            strategy={"single": "auto", "ddp": "ddp", "fsdp2": FSDP2Strategy()}[args.strategy],
            limit_train_batches=batches,
            precision="bf16-mixed" if args.bf16 else "32-true",
            callbacks=[recorder],
            default_root_dir=root,
        )
        cpu.apply_cpu_settings(trainer, cpu_settings)  # what the command's cpu section does
        trainer.fit(module, train_dataloaders=loader)
    gpu_mb = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else 0.0
    updates = ppo_epochs * args.num_minibatches
    floor_sums = [f["generate"] + f["ref_forward"] + f["critic_forward"] + updates * f["fwd_bwd"] for f in recorder.floors]
    totals = [sum(it.values()) for it in recorder.iterations]
    median = statistics.median
    enc, last = module.last_encoding, module.last_rollout
    ids, mask = trim_left_padding(last.input_ids, last.attention_mask)
    shared, common, _ = module.networks.shared_prompt_tokens(ids, mask, last.responses.shape[1])
    if shared is not None:  # the distinct prompts' common beginning, run once in their pass (prefix._prompts_once)
        common = prompts_beginning(ids, mask, last.responses.shape[1], shared[0])
    costs = roofline.iteration_costs(
        roofline.ModelShape.of(module.policy),
        batch=int(enc["input_ids"].shape[0]),
        prompt_len=int(enc["input_ids"].shape[1]),
        response_len=int(module.last_rollout.responses.shape[1]),
        ppo_epochs=ppo_epochs,
        num_minibatches=args.num_minibatches,
        policy_trainable=trainable_numel(module.policy) + (trainable_numel(module.critic) if module.networks.shared_critic else 0),
        critic_trainable=trainable_numel(module.critic) if critic == "separate" else 0,
        lora_params=trainable_numel(module.policy) if lora else 0,
        critic=critic,
        old_logprobs=args.old_logprobs,
        prompts=len(set(module.last_rollout.prompts)) if module.runtime.shared_prompts else 0,
        common_prefix=common,
    )
    return {
        "mode": args.mode,
        "ppo_epochs": ppo_epochs,
        "num_minibatches": args.num_minibatches,
        "strategy": args.strategy,
        "devices": args.devices,
        "rank": trainer.global_rank,
        "param_numel_local": module.param_numel_local,
        "critic": critic,
        "old_logprobs": args.old_logprobs,
        "engine": args.engine,
        "cpu_linear": args.cpu_linear,
        "policy": args.policy,
        "threads": torch.get_num_threads(),
        "batch": int(enc["input_ids"].shape[0]),
        "prompt_len": int(enc["input_ids"].shape[1]),
        "prompt_len_mean": float(enc["attention_mask"].sum(-1).float().mean()),
        "response_len": int(module.last_rollout.responses.shape[1]),
        "iter_s": median(totals),
        "tokens_per_s": median(t / s for t, s in zip(recorder.tokens, totals, strict=True)),
        "phases": {p: median(it.get(p, 0.0) for it in recorder.iterations) for p in PHASES},
        "floors": {name: median(f[name] for f in recorder.floors) for name in recorder.floors[0]},
        "floor_sum": median(floor_sums),
        # Each iteration against the floors measured right after it: a changing load hits both alike.
        "rollout_vs_generate": median(it["rollout"] / f["generate"] for it, f in zip(recorder.iterations, recorder.floors, strict=True)),
        "iteration_vs_floors": median(t / f for t, f in zip(totals, floor_sums, strict=True)),
        "peak_rss_mb": peak_rss_mb(),
        "memory": {**recorder.memory, "baseline": module.baseline_rss_mb, **held_mb(module, trainer.optimizers[0])}
        if args.memory
        else None,
        "peak_gpu_mb": gpu_mb,
        # an engine with its own copy of the weights: each sync's seconds and bytes pushed (the run's, warm-up included)
        "weight_sync_s": median(getattr(module.rollout_engine, "sync_seconds", None) or [math.nan]),
        "sync_mb": median(getattr(module.rollout_engine, "sync_bytes", None) or [math.nan]) / 2**20,
        "lora_sync": (
            ("adapter" if module.rollout_engine.adapter else "merged" if lora else "full")
            if hasattr(module.rollout_engine, "adapter")
            else "-"
        ),
        "iterations": recorder.iterations,
        "passes": recorder.passes[-1],  # the last timed iteration's (the first skips the reference: it equals the policy)
        "load": [load_before, os.getloadavg()[0]],
        "profile": recorder.profile_table,
        "roofline_costs": costs,
    }


def held_mb(module, optimizer) -> dict[str, float]:
    """MB of the states this process holds: the weights of policy, critic and reference (and a
    moving reference's starting policy), the gradients of the trainable ones (from a backward to
    the optimizer step), AdamW's moments. Under FSDP2 a rank's local shards, and ``roots``: the
    full size of the trainable models' root units (embeddings, final norm, LM or value head: the
    weights outside the blocks), which FSDP2 holds gathered from a forward to the end of the
    backward, with their full gradient until then."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from rlhf_lightning import fsdp2

    def mb(tensors) -> float:
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return sum(t.numel() * t.element_size() for t in local) / 2**20

    models = [module.policy, module.critic, module.ref_model, module.initial_model]
    fsdp2.reshard(*models)  # a root still gathered after a forward would show its full weights
    params = list({id(p): p for model in filter(None, models) for p in model.parameters()}.values())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    roots = []
    for root in (r for model in filter(None, (module.policy, module.critic)) for r in fsdp2.fsdp_roots(model)):
        blocks = [name + "." for name, m in root.named_modules() if m is not root and isinstance(m, FSDPModule)]
        roots += [p for name, p in root.named_parameters() if p.requires_grad and not name.startswith(tuple(blocks))]
    full_mb = sum(p.numel() * p.element_size() for p in {id(p): p for p in roots}.values()) / 2**20  # a DTensor's numel: the whole
    return {"weights": mb(params), "gradients": mb(p for p in params if p.requires_grad), "adamw": mb(state), "roots": full_mb}


def measure_floors(module, args: argparse.Namespace) -> dict[str, float]:
    """Seconds of one round of bare passes on the module's last prompts and sequences.

    The models are the module's own. LoRA: generate and the reference forward run with the
    adapter merged into the base weights (what a plain model computes, no LoRA branch; merging
    and unmerging leaves the weights bit-identical but for rare last-bit rounding), and the
    forward+backward trains the adapter as the update does. Gradients are dropped afterwards.
    """
    import torch

    from rlhf_lightning import cpu, fsdp2
    from rlhf_lightning.prefix import position_ids

    device = module.device
    sharded = fsdp2.is_sharded(module.policy)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.bf16 else contextlib.nullcontext
    lora = module.lora.rank > 0
    plain = module.policy.get_base_model() if lora else module.policy
    reference = plain if lora else module.ref_model
    separate_critic = module.critic is not None and module.critic.trunk is not None
    enc, rollout = module.last_encoding, module.last_rollout
    response_len = rollout.responses.shape[1]
    rows = slice(0, rollout.input_ids.shape[0] // args.num_minibatches)
    ids, attn = rollout.input_ids, rollout.attention_mask
    positions = position_ids(attn)

    @contextlib.contextmanager
    def merged():  # FSDP2: on the policy's gathered weights, as the module samples
        with fsdp2.gathered(plain) if sharded else contextlib.nullcontext():
            if lora:
                module.policy.merge_adapter()
            try:
                yield
            finally:
                if lora:
                    module.policy.unmerge_adapter()

    def generate():
        with torch.no_grad(), autocast():
            plain.generate(**enc)

    def reference_forward():
        with torch.no_grad(), autocast():
            reference(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False, logits_to_keep=response_len + 1)

    def critic_forward():
        with torch.no_grad(), autocast():
            module.critic(ids, attn, positions)

    def forward_backward():
        with autocast():
            out = module.policy(
                input_ids=ids[rows],
                attention_mask=attn[rows],
                position_ids=positions[rows],
                use_cache=False,
                logits_to_keep=response_len + 1,
                output_hidden_states=module.critic is not None and not separate_critic,
            )
            logprobs = out.logits[:, :-1].float().log_softmax(-1).gather(-1, rollout.responses[rows, :, None])
            if module.critic is None:
                values = torch.zeros(())
            elif separate_critic:
                values = module.critic(ids[rows], attn[rows], positions[rows])
            else:
                values = module.critic(hidden=out.hidden_states[-1][:, -response_len - 1 : -1])
            loss = logprobs.mean() + values.mean()
        loss.backward()
        for model in filter(None, (module.policy, module.critic)):
            model.zero_grad(set_to_none=True)

    def clocked(run) -> float:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(module.iteration)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - start

    with cpu.onednn_linear(cpu.uses_onednn(device, args.cpu_linear)):  # the run's linear kernel, as in its iteration
        seconds = {"critic_forward": clocked(critic_forward) if separate_critic and not module.old_values_in_update else 0.0}
        with merged():  # merging is not part of the floor
            seconds["generate"], seconds["ref_forward"] = clocked(generate), clocked(reference_forward)
        seconds["fwd_bwd"] = clocked(forward_backward)  # with the adapter unmerged: it trains the adapter
        if sharded:  # FSDP2's own way: every block all-gathered at each decode step (LoRA: unmerged)
            seconds["generate_sharded"] = clocked(generate)
            fsdp2.reshard(plain)  # the root stays gathered after a forward: the next iteration starts as the module left it
    return seconds


def measure_peaks(args: argparse.Namespace) -> dict[str, float]:
    """``roofline.machine_peaks`` once, in this process, with the workers' threads and dtype."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    peaks = roofline.machine_peaks(args.device, "bfloat16" if args.bf16 else "float32", seconds=0.2 if args.tiny else 1.0)
    print(
        f"machine: {peaks['flops_per_s'] / 1e9:.1f} GFLOP/s sustained matmul, {peaks['bytes_per_s'] / 1e9:.1f} GB/s read "
        f"({torch.get_num_threads()} thread(s))",
        flush=True,
    )
    return peaks


def worker_main(args: argparse.Namespace) -> None:
    for ppo_epochs in args.ppo_epochs:
        result = run_one(args, ppo_epochs)
        gc.collect()  # the previous run's module and optimizer states go before the next is built
        if result["rank"]:  # a file, not the shared stdout, where rank 0's lines could cut it in two
            Path(args.results_dir, f"{args.mode}-{ppo_epochs}-rank{result['rank']}.json").write_text(json.dumps(result))
            continue
        if result["profile"]:
            print(f"\n== profile: {args.mode}, ppo_epochs={ppo_epochs}: top ops by self CPU time (one iteration)")
            print(result["profile"], flush=True)
        print(RESULT_PREFIX + json.dumps({k: v for k, v in result.items() if k != "profile"}), flush=True)


# ---------------------------------------------------------------------------------- report
def derived(r: dict) -> dict[str, float]:
    """The score phase in all and what each phase spends beyond its floors (medians)."""
    f, p = r["floors"], r["phases"]
    updates = r["ppo_epochs"] * r["num_minibatches"]
    score = p["score"] + p["score_policy"] + p["score_ref"]
    return {
        "score": score,
        "beyond_rollout": p["rollout"] - f["generate"],
        "beyond_score": score - f["ref_forward"] - f["critic_forward"],
        "beyond_update": p["update"] - updates * f["fwd_bwd"],
    }


def phase_cells(r: dict) -> list[str]:
    """One run's row of the phase table: seconds per phase, throughput, memory, load."""
    p, d = r["phases"], derived(r)
    seconds = [r["iter_s"], p["rollout"], d["score"], p["score_policy"], p["score_ref"], p["score"]]
    return [
        r["mode"],
        r["critic"],
        str(r["ppo_epochs"]),
        *(f"{x:.3f}" for x in seconds),
        f"{p['advantages']:.4f}",
        f"{p['update']:.3f}",
        f"{p['other']:.4f}",
        f"{r['tokens_per_s']:.1f}",
        f"{r['peak_rss_mb']:.0f}",
        f"{r['load'][0]:.1f} -> {r['load'][1]:.1f}",
        rank_label(r),
        f"{r.get('param_numel_local', 0) / 1e6:.1f}M",
    ]


def floor_cells(r: dict) -> list[str]:
    """One run's row of the floor table: each pass alone, and what the loop adds beyond them."""
    f, d = r["floors"], derived(r)
    seconds = [f["generate"], f["ref_forward"], f["critic_forward"], f["fwd_bwd"], r["floor_sum"], r["rollout_vs_generate"]]
    beyond = [d["beyond_rollout"], d["beyond_score"], d["beyond_update"]]
    return [r["mode"], str(r["ppo_epochs"]), *(f"{x:.3f}" for x in [*seconds, r["iteration_vs_floors"]]), *(f"{x:+.3f}" for x in beyond)]


def format_passes(passes: dict[str, dict[str, int]]) -> str:
    return "; ".join(f"{phase}: " + ", ".join(f"{what} {n}" for what, n in sorted(c.items())) for phase, c in passes.items())


def markdown_rows(results: Sequence[dict], cells) -> list[str]:
    return ["| " + " | ".join(cells(r)) + " |" for r in results]


def format_table(results: Sequence[dict]) -> str:
    r0 = results[0]
    lines = [
        f"policy {r0['policy']}, batch {r0['batch']}, prompt {r0['prompt_len']} tokens padded "
        f"({r0['prompt_len_mean']:.1f} real on average), {r0['response_len']} new tokens, "
        f"{r0['num_minibatches']} minibatch(es), old log-probs from {r0['old_logprobs']}, CPU linear kernel {r0['cpu_linear']}, {r0['threads']} thread(s); seconds are medians over "
        f"{len(r0['iterations'])} iterations, floors measured after each (medians need not add up)",
        "",
        "| mode | critic | epochs | iter s | rollout | score | (old+V fwd | ref fwd | reward, KL, rest) | advantages | update | other "
        "| tokens/s | peak RSS MB | load | strategy, rank | param numel |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|",
        *markdown_rows(results, phase_cells),
        "",
        "| mode | epochs | generate | ref fwd | critic fwd | fwd+bwd | sum of floors | rollout / generate "
        "| iteration / floors | beyond: rollout | score | update |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *markdown_rows(results, floor_cells),
        "",
        "passes over a model's trunk in the last timed iteration, per phase (generate: its prefill; fwd+bwd: a forward with autograd on):",
        *(f"- {r['mode']}, {r['ppo_epochs']} epoch(s): {format_passes(r['passes'])}" for r in results),
    ]
    sharded = [r for r in results if "generate_sharded" in r["floors"]]
    if sharded:
        seconds = (f"{r['floors']['generate_sharded']:.3f} s vs {r['floors']['generate']:.3f} s" for r in sharded)
        labels = (f"{r['mode']}/{r['ppo_epochs']}/{rank_label(r)}" for r in sharded)
        lines.append(
            "generate on the sharded policy, each block gathered at every decode step (sharded gen) vs gathered "
            "once (the generate floor): " + ", ".join(f"{label}: {s}" for label, s in zip(labels, seconds, strict=True))
        )
    if any(r["peak_gpu_mb"] for r in results):
        lines.append("peak GPU MB: " + ", ".join(f"{r['mode']}/{r['ppo_epochs']}: {r['peak_gpu_mb']:.0f}" for r in results))
    return "\n".join(lines)


ROOFLINE_PHASES = ("rollout", "score", "update")


def phase_roofline(r: dict, peaks: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per phase and for the iteration: GFLOPs, GB of weight traffic, the floor (s), the measured
    seconds and their ratio. The iteration's floor is the sum of the three phases' (advantages
    and bookkeeping have none)."""
    measured = {"rollout": r["phases"]["rollout"], "score": derived(r)["score"], "update": r["phases"]["update"]}
    rows = {}
    for phase in ROOFLINE_PHASES:
        passes = r["roofline_costs"][phase]
        floor = roofline.floor_seconds(passes, peaks["flops_per_s"], peaks["bytes_per_s"])
        rows[phase] = {
            "gflop": sum(f for f, _ in passes) / 1e9,
            "gb": sum(b for _, b in passes) / 1e9,
            "floor_s": floor,
            "measured_s": measured[phase],
        }
    rows["iteration"] = {key: sum(rows[p][key] for p in ROOFLINE_PHASES) for key in ("gflop", "gb", "floor_s")}
    rows["iteration"]["measured_s"] = r["iter_s"]
    for row in rows.values():
        row["ratio"] = row["measured_s"] / row["floor_s"]
    return rows


def format_roofline(results: Sequence[dict], peaks: dict[str, float]) -> str:
    lines = [
        f"roofline: sustained matmul {peaks['flops_per_s'] / 1e9:.1f} GFLOP/s, read bandwidth {peaks['bytes_per_s'] / 1e9:.1f} GB/s "
        "(measured once, same threads); a pass's floor is max(FLOPs / matmul rate, bytes / bandwidth), a phase's the sum "
        "over its passes (rollout: prefill + each decode step; score: each forward; update: each forward, backward, AdamW step)",
        "",
        "| mode | epochs | phase | GFLOP | GB moved | floor s | measured s | measured / floor |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        for phase, row in phase_roofline(r, peaks).items():
            lines.append(
                f"| {r['mode']} | {r['ppo_epochs']} | {phase} | {row['gflop']:.1f} | {row['gb']:.2f} | {row['floor_s']:.3f} "
                f"| {row['measured_s']:.3f} | {row['ratio']:.2f} |"
            )
    return "\n".join(lines)


def rank_label(r: dict) -> str:
    return "single" if r.get("devices", 1) == 1 else f"{r['strategy']} x{r['devices']}, rank {r['rank']}"


def bench_line(results: Sequence[dict], peaks: dict[str, float]) -> str:
    """Worst ratios over the full and LoRA runs (any runs when there are none), the slowest run's
    seconds and throughput, LoRA/full peak RSS."""
    results = [r for r in results if r["mode"] in ("full", "lora")] or results
    slowest = max(results, key=lambda r: r["iter_s"])
    rss = {mode: max((r["peak_rss_mb"] for r in results if r["mode"] == mode), default=math.nan) for mode in ("full", "lora")}
    return (
        f"BENCH rollout_vs_generate={max(r['rollout_vs_generate'] for r in results):.3f} "
        f"iteration_vs_floors={max(r['iteration_vs_floors'] for r in results):.3f} "
        f"lora_vs_full_rss={rss['lora'] / rss['full']:.3f} "
        f"iter_s={slowest['iter_s']:.4g} tokens_per_s={slowest['tokens_per_s']:.4g} "
        f"iteration_vs_roofline={max(phase_roofline(r, peaks)['iteration']['ratio'] for r in results):.3f}"
    )


def run_subprocess(argv: list[str], env: Optional[dict] = None) -> list[dict]:
    """Run one worker, echoing its output and a line per finished run; return its results."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    results, start = [], time.perf_counter()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env) as proc:
        for line in proc.stdout:
            if not line.startswith(RESULT_PREFIX):
                print(line, end="", flush=True)
                continue
            r = json.loads(line[len(RESULT_PREFIX) :])
            results.append(r)
            print(
                f"{r['mode']}, ppo_epochs={r['ppo_epochs']}: {r['iter_s']:.3f} s per iteration, "
                f"{r['tokens_per_s']:.1f} tokens/s (done after {time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    if proc.returncode:
        raise SystemExit(f"benchmark run failed (exit code {proc.returncode}): {' '.join(argv)}")
    return results


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return []
    isa.apply(args.isa, __file__, sys.argv[1:] if argv is None else argv)
    print(isa.describe(), flush=True)
    modes = {"both": ("full", "lora"), "all": ("full", "lora", "grpo")}.get(args.mode, (args.mode,))
    if args.max_staleness:
        return staleness_main(args, [mode for mode in modes if mode != "grpo"])
    peaks = measure_peaks(args)
    env = {"MALLOC_MMAP_THRESHOLD_": str(MEMORY_MMAP_THRESHOLD)} if args.memory else {}
    single = [argparse.Namespace(**{**vars(args), "strategy": "single", "devices": 1})] if args.memory else []
    results = []
    # --engine vllm: the hf engine's runs follow in the same invocation, for the ENGINE lines side by side
    engines = [
        argparse.Namespace(**{**vars(one), "engine": engine}) for one in [*single, args] for engine in dict.fromkeys((args.engine, "hf"))
    ]
    for mode in modes:
        for one in engines:
            if one.devices == 1:
                results += run_subprocess(worker_argv(one, mode), env)
            # Several processes: one worker per run (a second Trainer in a worker would launch its ranks again).
            for ppo_epochs in one.ppo_epochs if one.devices > 1 else ():
                with tempfile.TemporaryDirectory(prefix="rlhf_bench_ranks_") as results_dir:
                    run = argparse.Namespace(**{**vars(one), "ppo_epochs": [ppo_epochs], "results_dir": results_dir})
                    results += run_subprocess(worker_argv(run, mode), env)
                    results += [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))]
        if args.save:
            Path(args.save).write_text(json.dumps(results, indent=1))
    print(format_table(results))
    print(format_roofline(results, peaks))
    print(bench_line(results, peaks), flush=True)
    for r in results:
        if r.get("engine", "hf") != "hf":  # the rollout against a bare generate of the same prompts, measured right after it
            print(
                f"DECODE {r['engine']}_vs_hf={1 / r['rollout_vs_generate']:.3f} mode={r['mode']} ppo_epochs={r['ppo_epochs']} "
                f"batch={r['batch']} response_len={r['response_len']} load={r['load'][0]:.2f}-{r['load'][1]:.2f}",
                flush=True,
            )
    if args.engine != "hf":
        for line in engine_lines(results):
            print(line, flush=True)
    if args.memory:
        print(memory_line(results), flush=True)
    return results


def staleness_run(args: argparse.Namespace, mode: str, k: int) -> tuple[list[float], list[dict[str, float]]]:
    """Seconds of each timed iteration (after ``--warmup``) of the plain loop in ``mode`` with max_staleness ``k``:
    from one end of an iteration to the next (the first timed one from the end of the warm-up); and each one's
    logged phase seconds (``timing/*``: with k > 0 ``rollout_s`` is the sampler thread's draw, ``sampler_wait_s``
    the trainer's wait for it)."""
    import torch
    from lightning import Trainer, seed_everything
    from lightning.pytorch.callbacks import Callback

    from rlhf_lightning import cpu
    from rlhf_lightning.data import PromptDataModule
    from rlhf_lightning.module import PPORLHF
    from rlhf_lightning.trainer_settings import QUIET_TRAINER

    class Ends(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.phases: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.ends.append(time.perf_counter())
            self.phases.append({k.removeprefix("timing/"): v for k, v in outputs["metrics"].items() if k.startswith("timing/")})

    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(0, verbose=False)
    lora = mode == "lora"
    module = PPORLHF(
        policy=args.policy,
        reward_model=args.reward,
        sampling=dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, old_logprobs="forward"),
        prompts=dict(chat_template=not args.no_chat_template),
        ppo=dict(epochs=args.ppo_epochs[0], num_minibatches=args.num_minibatches),
        critic=args.critic or ("shared" if lora else "separate"),
        lora=dict(rank=args.lora_rank if lora else 0, alpha=2.0 * args.lora_rank),
        runtime=dict(log_samples_every_n_steps=0),
        off_policy=dict(max_staleness=k),
        rollout_engine=args.engine,
    )
    ends = Ends()
    with tempfile.TemporaryDirectory(prefix="rlhf_bench_stale_") as root:
        trainer = Trainer(
            **{**QUIET_TRAINER, "accelerator": "gpu" if args.device == "cuda" else "cpu"},
            max_epochs=1,
            limit_train_batches=args.warmup + args.iters,
            precision="bf16-mixed" if args.bf16 else "32-true",
            callbacks=[ends],
            default_root_dir=root,
        )
        cpu.apply_cpu_settings(trainer, cpu.CPUSettings(linear=args.cpu_linear, malloc=args.cpu_malloc))
        trainer.fit(module, datamodule=PromptDataModule(batch_size=args.batch_size, shuffle=False))
    del trainer, module
    gc.collect()  # the module and its trainer refer to each other: free this run's models before the next loads
    start = max(args.warmup - 1, 0)
    seconds = [b - a for a, b in zip(ends.ends[start:], ends.ends[start + 1 :], strict=False)][-args.iters :]
    return seconds, ends.phases[-len(seconds) :]


def staleness_main(args: argparse.Namespace, modes: Sequence[str]) -> list[dict]:
    """``--max-staleness K``: per mode, runs alternating K, 0, K, 0 in this process; the median iteration seconds of
    each K and their ratio, one line per mode, then ``STALENESS k=K <mode>_ratio=<r> ... load=<before>-<after>``."""
    quiet()
    load_before, results, k = os.getloadavg()[0], [], args.max_staleness
    for mode in modes:
        seconds: dict[int, list[float]] = {k: [], 0: []}
        phases: dict[int, list[dict[str, float]]] = {k: [], 0: []}
        for staleness in (k, 0, k, 0):
            run_seconds, run_phases = staleness_run(args, mode, staleness)
            seconds[staleness] += run_seconds
            phases[staleness] += run_phases
        with_k, without = statistics.median(seconds[k]), statistics.median(seconds[0])
        phase = {s: {name: statistics.median(p.get(name, 0.0) for p in phases[s]) for name in phases[s][0]} for s in (k, 0)}
        ratio = with_k / without
        results.append(dict(mode=mode, k=k, iter_s=with_k, iter_s_synchronous=without, ratio=ratio, seconds=seconds, phases=phase))
        medians = {s: ", ".join(f"{name} {v:.2f}" for name, v in phase[s].items()) for s in (k, 0)}
        print(
            f"{mode}: {with_k:.2f} s per iteration with max_staleness {k}, {without:.2f} s without: ratio {ratio:.3f} (iterations: "
            f"{len(seconds[k])} and {len(seconds[0])}); median seconds with {k}: {medians[k]}; without: {medians[0]}",
            flush=True,
        )
    if args.save:
        Path(args.save).write_text(json.dumps(results, indent=1))
    cells = " ".join(f"{r['mode']}_ratio={r['ratio']:.3f} {r['mode']}_iter_s={r['iter_s']:.3f}" for r in results)
    print(f"STALENESS k={k} {cells} load={load_before:.2f}-{os.getloadavg()[0]:.2f}", flush=True)
    return results


def engine_lines(results: Sequence[dict]) -> list[str]:
    """One ``ENGINE`` line per run and rank: the engine, its rollout seconds (an engine's weight sync
    included), its weight sync's seconds and MB (the adapter alone or the whole model: ``lora_sync``),
    the rank's peak RSS and GPU memory; then ``ENGINES`` with each (mode, epochs, rank)'s rollout of
    the first engine over ``hf``'s."""
    lines, by_key = [], {}
    for r in results:
        by_key[(r["mode"], r["ppo_epochs"], r["devices"], r["rank"], r["engine"])] = r
        lines.append(
            f"ENGINE engine={r['engine']} mode={r['mode']} ppo_epochs={r['ppo_epochs']} {rank_label(r).replace(', ', ' ').replace(' ', '_')} "
            f"rollout_s={r['phases']['rollout']:.3f} weight_sync_s={r.get('weight_sync_s', math.nan):.3f} "
            f"sync_mb={r.get('sync_mb', math.nan):.2f} lora_sync={r.get('lora_sync', '-')} iter_s={r['iter_s']:.3f} "
            f"peak_rss_mb={r['peak_rss_mb']:.0f} peak_gpu_mb={r['peak_gpu_mb']:.0f} load={r['load'][0]:.2f}-{r['load'][1]:.2f}"
        )
    ratios = [
        f"{key[0]}/{key[1]}/rank{key[3]}={r['phases']['rollout'] / by_key[(*key[:4], 'hf')]['phases']['rollout']:.3f}"
        for key, r in by_key.items()
        if key[4] != "hf" and (*key[:4], "hf") in by_key
    ]
    if ratios:
        lines.append(f"ENGINES {results[0]['engine']}_vs_hf_rollout " + " ".join(ratios))
    return lines


def memory_line(results: Sequence[dict]) -> str:
    """Each process's memory, decomposed (``memory_decomposition``), the floor that the per-process
    baseline and the states leave to the ratio, and last the largest rank's training peak over the
    one process's (the worst mode)."""
    ratios = []
    for mode in dict.fromkeys(r["mode"] for r in results):
        single = next(r for r in results if r["mode"] == mode and r["devices"] == 1)
        ranks = sorted((r for r in results if r["mode"] == mode and r["devices"] > 1), key=lambda r: r["rank"])
        for r in [single, *ranks]:
            print(f"memory, {mode}, {rank_label(r)}: {memory_decomposition(r['memory'])}")
        worst = max(ranks, key=lambda r: r["memory"]["train_peak"])
        ratios.append(worst["memory"]["train_peak"] / single["memory"]["train_peak"])
        floor = memory_floor(single["memory"], worst["memory"]["baseline"], worst["devices"])
        print(
            f"memory, {mode}: floor = (baseline {worst['memory']['baseline']:.0f} MB + one process's states "
            f"{states_mb(single['memory']):.0f} MB / {worst['devices']}) / (its baseline + states) = {floor:.3f}; "
            f"measured {ratios[-1]:.3f}, the rest above each process's baseline + states at its peak: "
            f"{worst['memory']['train_peak'] - worst['memory']['baseline'] - states_mb(worst['memory']):.0f} MB per rank, "
            f"{single['memory']['train_peak'] - single['memory']['baseline'] - states_mb(single['memory']):.0f} MB in one process"
        )
    return f"MEMORY rank_peak_vs_single={max(ratios):.3f}"


def states_mb(memory: dict) -> float:
    """Weights, gradients and AdamW's moments: what sharding divides among the ranks."""
    return memory["weights"] + memory["gradients"] + memory["adamw"]


def memory_floor(single: dict, rank_baseline: float, ranks: int) -> float:
    """The ratio left if every process held its baseline and its share of the states at its peak,
    nothing else: (rank baseline + states / ranks) / (baseline + states) of one process."""
    return (rank_baseline + states_mb(single) / ranks) / (single["baseline"] + states_mb(single))


def memory_decomposition(m: dict) -> str:
    """One process's RSS (MB): the baseline before the models, the states it holds, the rest at the
    last iteration's start; each phase's peak above that start; the peaks."""
    start = m["iteration_start"][-1]
    held = m["baseline"] + m["weights"] + m["adamw"]
    groups = {"rollout": ("rollout",), "score": ("score", "score_policy", "score_ref"), "update": ("advantages", "update")}
    peaks = {g: max((m["phase_peaks"].get(p, 0.0) for p in names), default=0.0) for g, names in groups.items()}
    phases = ", ".join(f"{g} +{peak - start:.0f}" for g, peak in peaks.items())
    return (
        f"baseline {m['baseline']:.0f} + weights {m['weights']:.0f} + AdamW {m['adamw']:.0f} + other {start - held:.0f} "
        f"= {start:.0f} MB at the last iteration's start; peaks above it: {phases} (gradients {m['gradients']:.0f} MB "
        f"held to the optimizer step); peak in training {m['train_peak']:.0f} MB, in the floors' passes {m['floors_peak']:.0f}, "
        f"before the first iteration {m['startup_peak']:.0f}"
        + (f"; FSDP2 root units {m['roots']:.0f} MB whole (x2 with their gradient in the backward)" if m.get("roots") else "")
    )


if __name__ == "__main__":
    main()
