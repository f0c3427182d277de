"""Side-by-side iteration time against TRL on one workload: TRL 1.12's PPOTrainer against this
project's CLI, or (``--grpo``) TRL 1.16's GRPOTrainer against ``configs/grpo.yaml``'s setup.

    pip install "rlhf-lightning[bench]"            # TRL 1.12, in a separate environment is best
    python -m tools.benchmarks.compare_trl                    # 2 rounds of 1 warm-up + 3 timed iterations per run
    python -m tools.benchmarks.compare_trl --quick            # 1 round of 1 warm-up + 2 timed iterations
    python -m tools.benchmarks.compare_trl --trl-python ~/venv-trl112/bin/python --threads 1
    python -m tools.benchmarks.compare_trl --grpo --trl-python ~/venv-trl116/bin/python --threads 1 --isa avx2
    python -m tools.benchmarks.compare_trl --grpo --max-staleness 1 --trl-python ~/venv-trl116/bin/python --threads 1

``--grpo``: SmolLM2-135M-Instruct fp32 full fine-tuning, the first ``--batch-size`` (8) built-in
prompts x ``--num-generations`` (4) responses of exactly ``--max-new-tokens`` (32) tokens, the
same seeded SmolLM2-trunk reward model on both sides reading the same text, the conversation in
the chat template (TRL: as its reward function; ours: ``hf_classifier`` with ``chat_template``),
k3 as a loss term with the same fixed ``--beta`` (0.04, TRL's default), one optimizer step per update
over all 32 responses, ``--ppo-epochs`` (default 1 2) updates per batch (TRL's ``num_iterations``).
``trl_grpo``: ``GRPOTrainer`` (``per_device_train_batch_size`` 32,
``steps_per_generation`` 1, ``bf16=False``, ``generation_kwargs={"min_new_tokens": 32}``); its
time per batch is the wall clock over its ``num_iterations`` optimizer steps. ``grpo``:
``configs/grpo.yaml``'s model section (GRPO advantages, ``critic: none``, k3 in the loss) with
``lora_rank: 0``, a fixed beta and the workload's sizes, through the CLI. The last line reads
``COMPARE_GRPO ratio_1=<ours/TRL> ratio_2=<..> cpu_ratio_1=<..> cpu_ratio_2=<..>``: time per
batch, and CPU seconds of the process per batch (with one thread the work itself, whatever else
the machine runs). ``--max-staleness K`` adds ``grpo_async``: ``grpo`` with the sampler K updates ahead
(``model.off_policy.max_staleness``, ``old_logprobs: forward``; sampling, the reward and the reference in the
sampler's thread), and ``async_ratio_<updates>=<ours/TRL>`` to the last line. Every run also reports its passes per batch over each model's trunk
(``bench.measure.PassCounter``: policy, reference, reward model) and its peak RSS.

The first line says which instruction set the kernels run (``tools/benchmarks/isa.py``); ``--isa avx2``
runs both sides as on an AVX2-only CPU.

The workload (the issue's): SmolLM2-135M-Instruct in fp32, the first 8 built-in prompts rendered
with the chat template at every iteration, exactly ``--max-new-tokens`` (32) sampled tokens per
response, a reward model on the SmolLM2 trunk (``LlamaForSequenceClassification``, one output;
its head is freshly initialised from a fixed seed: what it scores does not change what an
iteration costs), one minibatch, 1 and 4 PPO epochs.

- ``trl``: ``trl.experimental.ppo.PPOTrainer`` (TRL 1.12, the last release with PPO): a policy, a
  frozen reference copy, a value model with its own SmolLM2 trunk, the reward model; no stop
  token, so every response is ``response_length`` tokens; ``num_sample_generations=0`` (no extra
  sampling for logs). Iteration time: wall clock between consecutive ``on_step_end`` callbacks.
- ``full``: ``rlhf-lightning fit`` with full fine-tuning, a separate reference copy and a separate
  critic trunk (the defaults), ``min_new_tokens = max_new_tokens``, the ``hf_classifier`` reward
  on the same reward-model folder with ``chat_template`` (TRL scores the chat-templated prompt's and
  the response's tokens; ours their text in the template, two tokens more: the closing ``<|im_end|>\n``;
  before 2026-11-28 ours scored ``prompt\nresponse``, about 45 tokens a row against TRL's 77);
  ``--full-critic shared`` puts the value head on the policy's trunk instead.
- ``lora``: the quickstart's setup through the same CLI: a rank-16 LoRA adapter, the
  adapter-disabled policy as the reference, the value head on the policy trunk (``critic: shared``).

Our side runs as a user runs it: ``rlhf_lightning.cli.main(["fit", "--config", <yaml>, ...])`` in
a fresh process, with the ``IterationTimer`` callback logging ``timing/iteration_s`` to a CSV
logger, with the module's defaults (log pi_old from the sampler, oneDNN linear layers on a CPU,
the tuned malloc) unless ``--old-logprobs``, ``--cpu-linear`` or ``--cpu-malloc`` say otherwise
(``--cpu-linear aten --cpu-malloc default`` runs PyTorch as TRL does); each of our runs also
prints its phases' median seconds (``timing/<phase>_s``). Every (framework, setup, epochs) run is its own process (so its peak RSS is its own),
and the runs alternate within each round (trl, full, lora for 1 epoch, then for 4 epochs; the
next round again), so a drifting machine load hits every framework alike. The table gives each
run's median seconds per iteration over the timed iterations of all rounds, its peak RSS and its
ratio to TRL's median with the same number of epochs; the last line reads
``COMPARE full_1=<r> full_4=<r> lora_1=<r> lora_4=<r>`` (ratios to TRL).

TRL is an optional benchmark extra (``[project.optional-dependencies] bench``), never a runtime
dependency: ``--trl-python`` names a Python that has it (default: this one).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from tools._cli_args import open_speed_tool, option_number, tool_parser
from tools.benchmarks import isa
from tools.benchmarks.bench.measure import PassCounter, builtin_prompts

REPO = Path(__file__).resolve().parents[2]
RESULT_PREFIX = "COMPARE_RESULT "
SETUPS = ("trl", "full", "lora")
GRPO_SETUPS = ("trl_grpo", "grpo", "grpo_async")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = tool_parser(__spec__.name, __doc__)
    parser.add_argument(
        "--setups", nargs="+", choices=SETUPS + GRPO_SETUPS, help="what to run (ratios need trl; default: all of the mode's)"
    )
    parser.add_argument("--grpo", action="store_true", help="TRL 1.16's GRPOTrainer against configs/grpo.yaml's setup instead of PPO")
    parser.add_argument(
        "--ppo-epochs",
        type=option_number(integer=True, at_least=1),
        nargs="+",
        help="PPO epochs (--grpo: updates per batch, TRL's num_iterations); default 1 4 (--grpo: 1 2)",
    )
    parser.add_argument("--num-generations", type=option_number(integer=True, at_least=1), default=4, help="--grpo: responses per prompt")
    parser.add_argument(
        "--max-staleness",
        type=option_number(integer=True, at_least=1),
        help="--grpo: also run grpo_async, ours with the sampler K updates ahead (model.off_policy.max_staleness)",
    )
    parser.add_argument(
        "--beta", type=option_number(at_least=0), default=0.04, help="--grpo: the KL coefficient of k3 in the loss, both sides"
    )
    parser.add_argument("--rounds", type=option_number(integer=True, at_least=1), help="rounds of alternating runs (default 2; --quick: 1)")
    parser.add_argument("--iters", type=option_number(integer=True, at_least=1), help="timed iterations per run (default 3; --quick: 2)")
    parser.add_argument("--warmup", type=option_number(integer=True, at_least=0), default=1, help="untimed iterations first")
    parser.add_argument("--quick", action="store_true", help="1 round of 1 warm-up + 2 timed iterations")
    parser.add_argument("--batch-size", type=option_number(integer=True, at_least=1), default=8)
    parser.add_argument("--max-new-tokens", type=option_number(integer=True, at_least=1), default=32)
    parser.add_argument("--full-critic", choices=("separate", "shared"), default="separate", help="the full setup's critic trunk")
    parser.add_argument(
        "--old-logprobs", choices=("forward", "sampler"), help="model.sampling.old_logprobs of our runs (default: the module's)"
    )
    parser.add_argument("--cpu-linear", choices=("auto", "onednn", "aten"), help="cpu.linear of our runs (default: the module's)")
    parser.add_argument("--cpu-malloc", choices=("tuned", "default"), help="cpu.malloc of our runs (default: the module's)")
    parser.add_argument(
        "--shared-prompts",
        choices=("on", "off"),
        help="model.runtime.shared_prompts of our runs (default: the module's, on; --grpo shares them)",
    )
    parser.add_argument(
        "--threads",
        type=option_number(integer=True, at_least=0),
        default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
        help="torch threads (0: default)",
    )
    parser.add_argument("--trl-python", default=sys.executable, help="a Python with trl==1.12 installed (--grpo: trl==1.16)")
    parser.add_argument("--save", metavar="PATH", help="also write the results as JSON")
    isa.add_argument(parser)
    parser.add_argument("--worker", choices=SETUPS + GRPO_SETUPS, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=option_number(integer=True, at_least=1), help=argparse.SUPPRESS)
    parser.add_argument("--reward-path", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.setups = args.setups or list(GRPO_SETUPS[: 3 if args.max_staleness else 2] if args.grpo else SETUPS)
    if "grpo_async" in args.setups and not args.max_staleness:
        parser.error("--setups grpo_async: give --max-staleness K")
    args.ppo_epochs = args.ppo_epochs or ([1, 2] if args.grpo else [1, 4])
    if set(args.setups) - set(GRPO_SETUPS if args.grpo else SETUPS):
        parser.error(f"--setups: {'with' if args.grpo else 'without'} --grpo choose from {GRPO_SETUPS if args.grpo else SETUPS}")
    args.rounds = (1 if args.quick else 2) if args.rounds is None else args.rounds
    args.iters = (2 if args.quick else 3) if args.iters is None else args.iters
    return args


def build_reward_model(target: Path) -> Path:
    """SmolLM2's trunk with a one-output classification head (seeded), saved with its tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_lightning.models import smollm2_checkpoint

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(smollm2_checkpoint(), num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# ---------------------------------------------------------------------------------- workers
def run_trl(args: argparse.Namespace) -> tuple[list[float], dict]:
    """TRL's PPOTrainer for warmup + iters iterations; seconds of each iteration (no phases)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from rlhf_lightning.models import smollm2_checkpoint

    path = smollm2_checkpoint()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in builtin_prompts(args.batch_size)
    ]
    dataset = Dataset.from_dict({"input_ids": [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]})
    iterations = args.warmup + args.iters
    config = PPOConfig(
        output_dir=str(Path(args.workdir) / "trl"),
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=args.epochs,
        response_length=args.max_new_tokens,
        stop_token=None,
        total_episodes=args.batch_size * iterations,
        local_rollout_forward_batch_size=args.batch_size,
        num_sample_generations=0,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        logging_steps=1,
        disable_tqdm=True,
    )
    models = [AutoModelForCausalLM.from_pretrained(path) for _ in range(2)]
    value_model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward_path)
    for model in (value_model, reward_model):
        model.config.pad_token_id = tokenizer.pad_token_id

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends = [time.perf_counter()]

        def on_step_end(self, *_, **__):
            self.ends.append(time.perf_counter())

    clock = StepClock()
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=models[0],
        ref_model=models[1],
        reward_model=reward_model,
        train_dataset=dataset,
        value_model=value_model,
        callbacks=[clock],
    )
    clock.ends = [time.perf_counter()]
    trainer.train()
    return [b - a for a, b in itertools.pairwise(clock.ends)], {}, {}


def run_trl_grpo(args: argparse.Namespace) -> tuple[list[float], dict, dict]:
    """TRL's GRPOTrainer for warmup + iters batches of ``batch_size`` prompts x ``num_generations``;
    seconds of each batch (its ``num_iterations`` optimizer steps) and the passes of the last one."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_lightning.models import smollm2_checkpoint

    path = smollm2_checkpoint()
    batches, updates = args.warmup + args.iters, args.epochs
    rows = args.batch_size * args.num_generations
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in builtin_prompts(args.batch_size)] * batches})
    config = GRPOConfig(
        output_dir=str(Path(args.workdir) / "trl"),
        per_device_train_batch_size=rows,  # one optimizer step per generation batch, as ours with 1 minibatch
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.num_generations,
        num_iterations=updates,
        max_completion_length=args.max_new_tokens,
        generation_kwargs={"min_new_tokens": args.max_new_tokens},  # exactly max_new_tokens: EOS banned until then
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=args.beta,  # k3 in the loss, TRL's GRPO
        max_steps=batches * updates,
        shuffle_dataset=False,
        bf16=False,  # fp32 as ours (TRL's GRPO defaults to bf16)
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        seed=0,
        logging_steps=1,
        disable_tqdm=True,
        log_completions=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward_path)
    reward_model.config.pad_token_id = tokenizer.pad_token_id
    counter, per_batch, cpu_ends = PassCounter(), [], []
    phases, in_phase = defaultdict(list), defaultdict(float)

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends = [time.perf_counter()]

        def on_step_end(self, _args, state, *__, **___):
            if state.global_step % updates == 0:  # a batch is num_iterations optimizer steps on one generation
                self.ends.append(time.perf_counter())
                cpu_ends.append(time.process_time())
                per_batch.append(counter.take())
                for name in ("rollout", "forward", "score"):
                    phases[name].append(in_phase.pop(name, 0.0))
                phases["update"].append(self.ends[-1] - self.ends[-2] - sum(phases[name][-1] for name in ("rollout", "forward", "score")))

    clock = StepClock()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path),
        reward_funcs=reward_model,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        reward_processing_classes=AutoTokenizer.from_pretrained(args.reward_path),
        callbacks=[clock],
    )
    for name, model in (("policy", trainer.model), ("reference", trainer.ref_model), ("reward", reward_model)):
        if model is not None:
            counter.watch(name, model)

    def timed(name: str, method, no_grad_only: bool = False):
        """The trainer's method, its seconds added to phase ``name`` (forwards: the no-grad ones)."""

        def run(*args, **kwargs):
            if no_grad_only and torch.is_grad_enabled():
                return method(*args, **kwargs)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                in_phase[name] += time.perf_counter() - start

        return run

    # Our phase names: sampling, the no-grad log-prob forwards (log pi_old, log pi_ref), the reward;
    # the rest of a batch (the loss forwards, backward, optimizer steps) is the update.
    trainer._generate = timed("rollout", trainer._generate)
    trainer._get_per_token_logps_and_entropies = timed("forward", trainer._get_per_token_logps_and_entropies, no_grad_only=True)
    trainer._calculate_rewards = timed("score", trainer._calculate_rewards)
    clock.ends, cpu_ends[:] = [time.perf_counter()], [time.process_time()]
    trainer.train()
    phases["cpu"] = [b - a for a, b in itertools.pairwise(cpu_ends)]
    return [b - a for a, b in itertools.pairwise(clock.ends)], dict(phases), per_batch[-1]


def count_our_passes(counter, per_batch: list) -> None:
    """Count the passes of each of our training steps (policy, reference, critic trunk, reward
    model), one dict per step appended to ``per_batch``: the module's step wrapped, in this worker."""
    from rlhf_lightning.module import PPORLHF

    step = PPORLHF.training_step

    def counted(self, *args, **kwargs):
        if not getattr(self, "_passes_watched", False):  # the reward model loads at fit start
            critic, reward = getattr(self.critic, "trunk", None), getattr(self.reward_model, "model", None)
            for name, model in (("policy", self.policy), ("reference", self.ref_model), ("critic", critic), ("reward", reward)):
                if model is not None:
                    counter.watch(name, model)
            self._passes_watched = True
        counter.take()
        start = time.process_time()
        outputs = step(self, *args, **kwargs)
        per_batch.append({**counter.take(), "cpu_s": time.process_time() - start})
        return outputs

    PPORLHF.training_step = counted


def our_config(args: argparse.Namespace) -> dict:
    """The run's YAML config (what a user would write); LoRA as in configs/quickstart.yaml."""
    work = Path(args.workdir)
    prompt_file = work / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in builtin_prompts(args.batch_size) * (args.warmup + args.iters)))
    data = {"train_path": str(prompt_file), "batch_size": args.batch_size, "shuffle": False}
    if args.worker in ("grpo", "grpo_async"):
        return grpo_config(args, trainer_config(args), data)
    lora = args.worker == "lora"
    model = {
        "policy": "smollm2",
        "sampling": {"max_new_tokens": args.max_new_tokens, "min_new_tokens": args.max_new_tokens},
        "ppo": {"epochs": args.epochs, "num_minibatches": 1},
        "runtime": {"log_samples_every_n_steps": 0},
        "reward_model": {
            "class_path": "rlhf_lightning_plugins.rewards.classifier.HFClassifierReward",
            "init_args": {"path": args.reward_path, "chat_template": True},  # the conversation, as TRL scores it
        },
        "lora": {"rank": 16 if lora else 0, "alpha": 32.0},
        "critic": "shared" if lora else args.full_critic,
    }
    return with_options(args, {"seed_everything": 0, "trainer": trainer_config(args), "model": model, "data": data})


def with_options(args: argparse.Namespace, config: dict) -> dict:
    """``config`` with the options chosen on the command line: the old log-probs' source, the shared
    prompts (the module's groups) and the CPU kernel and malloc (the command's ``cpu`` section)."""
    model = config["model"]
    if args.old_logprobs:
        model.setdefault("sampling", {})["old_logprobs"] = args.old_logprobs
    if args.shared_prompts:
        model.setdefault("runtime", {})["shared_prompts"] = args.shared_prompts == "on"
    cpu = {name: getattr(args, f"cpu_{name}") for name in ("linear", "malloc") if getattr(args, f"cpu_{name}")}
    return {**config, "cpu": cpu} if cpu else config


def grpo_config(args: argparse.Namespace, trainer: dict, data: dict) -> dict:
    """configs/grpo.yaml's model section on the comparison's workload: full fine-tuning (TRL's
    GRPOTrainer without PEFT), a fixed beta, the shared reward model, one minibatch, exactly
    ``max_new_tokens`` tokens, ``ppo_epochs`` updates per batch; its trainer section replaced."""
    import yaml

    model = yaml.safe_load((REPO / "configs" / "grpo.yaml").read_text())["model"]
    model.update(
        beta_controller={"class_path": "fixed", "init_args": {"init_beta": args.beta}},
        reward_model={
            "class_path": "rlhf_lightning_plugins.rewards.classifier.HFClassifierReward",
            "init_args": {"path": args.reward_path, "chat_template": True},  # the conversation, as TRL scores it
        },
    )
    model["lora"] = {**model.get("lora", {}), "rank": 0}
    model["sampling"] = {
        **model.get("sampling", {}),
        "num_generations": args.num_generations,
        "max_new_tokens": args.max_new_tokens,
        "min_new_tokens": args.max_new_tokens,
    }
    model["ppo"] = {**model.get("ppo", {}), "epochs": args.epochs, "num_minibatches": 1}
    model["runtime"] = {**model.get("runtime", {}), "log_samples_every_n_steps": 0}
    if args.worker == "grpo_async":  # the sampler K updates ahead, the PPO ratio at the current weights
        model["off_policy"] = {"max_staleness": args.max_staleness}
        model["sampling"]["old_logprobs"] = "forward"
    return with_options(args, {"seed_everything": 0, "trainer": trainer, "model": model, "data": data})


def trainer_config(args: argparse.Namespace) -> dict:
    work = Path(args.workdir)
    return {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "limit_val_batches": 0,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(work),
        "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(work), "name": "csv"}},
        "callbacks": [{"class_path": "rlhf_lightning.callbacks.IterationTimer"}],
    }


def run_ours(args: argparse.Namespace) -> tuple[list[float], dict[str, list[float]], dict]:
    """``rlhf-lightning fit`` on the run's config; seconds of each iteration (timing/iteration_s),
    of each of the module's phases per iteration (its ``timing/<phase>_s`` metrics), and the
    passes of the last iteration."""
    import csv

    from rlhf_lightning.cli import main as cli_main

    config = Path(args.workdir) / "config.yaml"
    config.write_text(json.dumps(our_config(args)))  # JSON is YAML
    per_batch = []
    count_our_passes(PassCounter(), per_batch)
    cli_main(["fit", "--config", str(config)])
    (metrics,) = Path(args.workdir).glob("csv/version_*/metrics.csv")
    with metrics.open() as f:
        rows = list(csv.DictReader(f))
    phases = defaultdict(list)
    for row in rows:
        for key, value in row.items():
            if key.startswith("timing/") and key != "timing/iteration_s" and value:
                phases[key[len("timing/") : -len("_s")]].append(float(value))
    phases["cpu"] = [passes.pop("cpu_s") for passes in per_batch]
    return [float(row["timing/iteration_s"]) for row in rows if row.get("timing/iteration_s")], dict(phases), per_batch[-1]


def worker_main(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    run = {"trl": run_trl, "trl_grpo": run_trl_grpo}.get(args.worker, run_ours)
    seconds, phases, passes = run(args)
    if len(seconds) != args.warmup + args.iters:
        raise SystemExit(f"{args.worker}: expected {args.warmup + args.iters} iterations, timed {len(seconds)}")
    result = {
        "setup": args.worker,
        "ppo_epochs": args.epochs,
        "seconds": seconds[args.warmup :],
        "warmup_s": seconds[: args.warmup],
        "phases": {name: values[args.warmup :] for name, values in phases.items()},
        "peak_rss_mb": peak_rss_mb(),
        "passes": passes,
        "threads": torch.get_num_threads(),
        "load": [load_before, os.getloadavg()[0]],
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------- driver
def run_worker(args: argparse.Namespace, setup: str, epochs: int, reward_path: Path, root: Path) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"{setup}{epochs}_", dir=root))
    python = args.trl_python if setup.startswith("trl") else sys.executable
    settings = {
        "--epochs": epochs,
        "--reward-path": reward_path,
        "--workdir": workdir,
        "--warmup": args.warmup,
        "--iters": args.iters,
        "--batch-size": args.batch_size,
        "--max-new-tokens": args.max_new_tokens,
        "--full-critic": args.full_critic,
        "--num-generations": args.num_generations,
        "--beta": args.beta,
        "--threads": args.threads,
        **({"--max-staleness": args.max_staleness} if args.max_staleness else {}),
    }
    argv = [python, "-m", "tools.benchmarks.compare_trl", "--worker", setup, *(["--grpo"] if args.grpo else [])]
    argv += [word for flag, value in settings.items() for word in (flag, str(value))]
    for option in ("old_logprobs", "cpu_linear", "cpu_malloc", "shared_prompts"):
        if getattr(args, option):
            argv += ["--" + option.replace("_", "-"), getattr(args, option)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / ".pp"), str(REPO), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        raise SystemExit(f"{setup} ({epochs} epochs) failed, exit code {proc.returncode}:\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    phases = ", ".join(f"{name} {statistics.median(values):.2f}" for name, values in result["phases"].items())
    print(
        f"{setup}, {epochs} epoch(s): {', '.join(f'{s:.2f}' for s in result['seconds'])} s per iteration "
        f"(warm-up {result['warmup_s']}){f'; phases (median s): {phases}' if phases else ''}; passes of the last: "
        f"{format_passes(result['passes'])}; peak RSS "
        f"{result['peak_rss_mb']:.0f} MB, load {result['load']}, process {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return result


def format_passes(passes: dict) -> str:
    """The passes of one iteration (one phase, "all"): what over which trunk, how often."""
    return ", ".join(f"{what} {n}" for counts in passes.values() for what, n in sorted(counts.items())) or "not counted"


def summarise(results: Sequence[dict]) -> list[dict]:
    """One row per (setup, epochs): median seconds over all its timed iterations, ratio to TRL's
    (``trl`` for the PPO setups, ``trl_grpo`` for ``grpo``), peak RSS, the last run's passes."""
    rows = []
    for epochs in sorted({r["ppo_epochs"] for r in results}):
        for setup in SETUPS + GRPO_SETUPS:
            runs = [r for r in results if r["setup"] == setup and r["ppo_epochs"] == epochs]
            if runs:
                seconds = [s for r in runs for s in r["seconds"]]
                rows.append(
                    {
                        "setup": setup,
                        "ppo_epochs": epochs,
                        "median_s": statistics.median(seconds),
                        "n": len(seconds),
                        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
                        "passes": runs[-1].get("passes", {}),
                        # CPU seconds of the process per iteration: with one thread, the work, whatever the load
                        "cpu_s": statistics.median(c for r in runs for c in r.get("phases", {}).get("cpu", [math.nan])),
                    }
                )
    trl = {(row["setup"], row["ppo_epochs"]): row["median_s"] for row in rows if row["setup"].startswith("trl")}
    trl_cpu = {(row["setup"], row["ppo_epochs"]): row["cpu_s"] for row in rows if row["setup"].startswith("trl")}
    for row in rows:
        peer = ("trl_grpo" if row["setup"] in GRPO_SETUPS else "trl", row["ppo_epochs"])
        row["vs_trl"] = row["median_s"] / trl[peer] if peer in trl else math.nan
        row["cpu_vs_trl"] = row["cpu_s"] / trl_cpu[peer] if peer in trl else math.nan
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """The table, then ``COMPARE <setup>_<epochs>=<ratio> ...`` for the PPO setups and
    ``COMPARE_GRPO ratio_<updates>=<ratio> ...`` for GRPO's (ours over TRL's time per batch)."""
    lines = [
        "| setup | PPO epochs (GRPO: updates) | s / iteration (median) | iterations | vs TRL | CPU s / iteration | vs TRL "
        "| peak RSS MB | passes per iteration |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += [
        f"| {r['setup']} | {r['ppo_epochs']} | {r['median_s']:.2f} | {r['n']} | {r['vs_trl']:.2f}x | {r['cpu_s']:.2f} "
        f"| {r['cpu_vs_trl']:.2f}x | {r['peak_rss_mb']:.0f} "
        f"| {format_passes(r.get('passes', {}))} |"
        for r in rows
    ]
    ppo = " ".join(f"{r['setup']}_{r['ppo_epochs']}={r['vs_trl']:.3f}" for r in rows if r["setup"] in SETUPS[1:])
    grpo_rows = [r for r in rows if r["setup"] == "grpo"]
    async_rows = [r for r in rows if r["setup"] == "grpo_async"]
    grpo = " ".join(
        [f"ratio_{r['ppo_epochs']}={r['vs_trl']:.3f}" for r in grpo_rows]
        + [f"cpu_ratio_{r['ppo_epochs']}={r['cpu_vs_trl']:.3f}" for r in grpo_rows]
        + [f"async_ratio_{r['ppo_epochs']}={r['vs_trl']:.3f}" for r in async_rows]
    )
    return "\n".join([*lines, "", *([f"COMPARE {ppo}"] if ppo else []), *([f"COMPARE_GRPO {grpo}"] if grpo else [])])


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    args = open_speed_tool(parse_args, __spec__.name, argv, worker_main)
    if args is None:
        return []
    print(
        f"threads {args.threads or 'default'}, {args.rounds} round(s) of {args.warmup} warm-up + {args.iters} timed iterations, "
        f"load {os.getloadavg()}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory(prefix="compare_trl_") as root:
        reward_path = build_reward_model(Path(root) / "reward_model")
        for _ in range(args.rounds):
            for epochs in args.ppo_epochs:
                for setup in args.setups:
                    results.append(run_worker(args, setup, epochs, reward_path, Path(root)))
                    if args.save:
                        Path(args.save).write_text(json.dumps(results, indent=1))
    rows = summarise(results)
    print(format_table(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
