"""Phase-by-phase benchmark of one PPO-RLHF iteration, against the floors of the same work.

    python -m tools.benchmarks.bench                                  # SmolLM2, full, LoRA and GRPO, 1 and 4 PPO epochs
    python -m tools.benchmarks.bench --mode lora --ppo-epochs 4 --iters 3 --threads 1
    python -m tools.benchmarks.bench --profile                        # plus torch.profiler's top ops of one iteration
    python -m tools.benchmarks.bench --device cuda --bf16             # GPU, bf16 autocast
    python -m tools.benchmarks.bench --tiny                           # the tiny random model, 2 iterations (the tests)
    python -m tools.benchmarks.bench --isa avx2 --threads 1           # as on an AVX2-only CPU (oneDNN, MKL and ATen capped)
    python -m tools.benchmarks.bench --mode full --ppo-epochs 1 --strategy fsdp2 --devices 2 --threads 1   # per rank
    OMP_NUM_THREADS=1 python -m tools.benchmarks.bench --max-staleness 1 --mode both   # asynchronous rollouts against the loop
    python -m tools.benchmarks.bench --mode full --ppo-epochs 1 --warmup 1 --iters 1 --strategy fsdp2 --devices 2 --threads 1 --memory

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

- rollout:    ``Sampler.encode`` + the rollout engine's sample (hf: the shared prompts' prefill, ``generate``);
- score:      the rest of ``rollout()`` (old log-probs + values forward, reference forward,
              decoding, log-prob gathers, entropy), the KL estimate and the reward;
- advantages: ``compute_advantages``;
- update:     ``PPOUpdate.run`` (all epochs: forward, backward, gradient clipping, optimizer steps);
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
``--max-new-tokens`` tokens per response (``--eos``: up to that many, ending at EOS: long-tailed lengths) and
``--ppo-epochs``' first value with ``--num-minibatches``. It prints one line per mode and last ``STALENESS k=<K>
full_ratio=<r> lora_ratio=<r> ...``, each ratio the median iteration seconds with K over those without.
``--inflight-every N`` adds a third arm, K with in-flight weight updates every N tokens
(``model.off_policy.inflight_every``), the runs alternating (K, N), K, 0 twice, and ``<mode>_inflight_ratio``. Run it with ``OMP_NUM_THREADS=1``: one thread trains, and with K > 0
one more samples.

On a CPU shared with other jobs use ``--threads 1``: spinning OpenMP threads on a busy
2-core machine make a forward pass several times slower and the timings erratic.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Optional

from tools._cli_args import open_speed_tool, option_number, tool_parser
from tools.benchmarks import isa
from tools.benchmarks.bench import phases, staleness
from tools.benchmarks.bench.worker import worker_main


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = tool_parser(__spec__.name, __doc__)
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
    parser.add_argument(
        "--inflight-every",
        type=option_number(integer=True, at_least=1),
        help="--max-staleness K >= 2: a third arm with in-flight weight updates every N tokens (last line STALENESS ... inflight_ratio)",
    )
    parser.add_argument(
        "--eos", action="store_true", help="--max-staleness: responses may end at EOS (long-tailed lengths; min_new_tokens 0)"
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
    if args.inflight_every and (args.max_staleness or 0) < 2:
        parser.error("--inflight-every needs --max-staleness >= 2 (model.off_policy.inflight_every's own rule)")
    if args.batch_size % args.num_minibatches or args.batch_size % args.num_generations:
        parser.error("--batch-size must be divisible by --num-minibatches and by --num-generations")
    return args


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    """The worker's runs (``--worker``), ``--max-staleness``'s loops, or the phase benchmark of every mode."""
    args = open_speed_tool(parse_args, __spec__.name, argv, worker_main)
    if args is None:
        return []
    modes = {"both": ("full", "lora"), "all": ("full", "lora", "grpo")}.get(args.mode, (args.mode,))
    if args.max_staleness:
        return staleness.main(args, [mode for mode in modes if mode != "grpo"])
    return phases.main(args, modes)
