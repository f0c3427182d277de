"""Side-by-side PPO iteration time: TRL 1.12's PPOTrainer against this project's CLI, same workload.

    pip install "rlhf-lightning[bench]"            # TRL 1.12, in a separate environment is best
    python tools/compare_trl.py                    # 2 rounds of 1 warm-up + 3 timed iterations per run
    python tools/compare_trl.py --quick            # 1 round of 1 warm-up + 2 timed iterations
    python tools/compare_trl.py --trl-python /work/trl-venv/bin/python --threads 1

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
  on the same reward-model folder; ``--full-critic shared`` puts the value head on the policy's
  trunk instead.
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

from rlhf_lightning.checks import option_number

REPO = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "COMPARE_RESULT "
SETUPS = ("trl", "full", "lora")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS), help="what to run (ratios need trl)")
    parser.add_argument("--ppo-epochs", type=option_number(integer=True, at_least=1), nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=option_number(integer=True, at_least=1), help="rounds of alternating runs (default 2; --quick: 1)")
    parser.add_argument("--iters", type=option_number(integer=True, at_least=1), help="timed iterations per run (default 3; --quick: 2)")
    parser.add_argument("--warmup", type=option_number(integer=True, at_least=0), default=1, help="untimed iterations first")
    parser.add_argument("--quick", action="store_true", help="1 round of 1 warm-up + 2 timed iterations")
    parser.add_argument("--batch-size", type=option_number(integer=True, at_least=1), default=8)
    parser.add_argument("--max-new-tokens", type=option_number(integer=True, at_least=1), default=32)
    parser.add_argument("--full-critic", choices=("separate", "shared"), default="separate", help="the full setup's critic trunk")
    parser.add_argument("--old-logprobs", choices=("forward", "sampler"), help="model.old_logprobs of our runs (default: the module's)")
    parser.add_argument("--cpu-linear", choices=("auto", "onednn", "aten"), help="model.cpu_linear of our runs (default: the module's)")
    parser.add_argument("--cpu-malloc", choices=("tuned", "default"), help="model.cpu_malloc of our runs (default: the module's)")
    parser.add_argument(
        "--threads",
        type=option_number(integer=True, at_least=0),
        default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0),
        help="torch threads (0: default)",
    )
    parser.add_argument("--trl-python", default=sys.executable, help="a Python with trl==1.12 installed")
    parser.add_argument("--save", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--worker", choices=SETUPS, help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=option_number(integer=True, at_least=1), help=argparse.SUPPRESS)
    parser.add_argument("--reward-path", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rounds = (1 if args.quick else 2) if args.rounds is None else args.rounds
    args.iters = (2 if args.quick else 3) if args.iters is None else args.iters
    if min(args.rounds, args.iters, args.batch_size, args.max_new_tokens, *args.ppo_epochs) < 1 or args.warmup < 0:
        parser.error("--rounds, --iters, --batch-size, --max-new-tokens and --ppo-epochs must be >= 1, --warmup >= 0")
    return args


def prompts(n: int) -> list[str]:
    from rlhf_lightning.data import BUILTIN_TRAIN

    with BUILTIN_TRAIN.open() as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()][:n]


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
        for p in prompts(args.batch_size)
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
    return [b - a for a, b in itertools.pairwise(clock.ends)], {}


def our_config(args: argparse.Namespace) -> dict:
    """The run's YAML config (what a user would write); LoRA as in configs/quickstart.yaml."""
    work = Path(args.workdir)
    prompt_file = work / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts(args.batch_size) * (args.warmup + args.iters)))
    lora = args.worker == "lora"
    model = {
        "policy": "smollm2",
        "max_new_tokens": args.max_new_tokens,
        "min_new_tokens": args.max_new_tokens,
        "ppo_epochs": args.epochs,
        "num_minibatches": 1,
        "log_samples_every_n_steps": 0,
        "reward_model": {
            "class_path": "rlhf_lightning_plugins.rewards.classifier.HFClassifierReward",
            "init_args": {"path": args.reward_path},
        },
        "lora_rank": 16 if lora else 0,
        "lora_alpha": 32.0,
        "critic": "shared" if lora else args.full_critic,
    }
    for option in ("old_logprobs", "cpu_linear", "cpu_malloc"):
        if getattr(args, option):
            model[option] = getattr(args, option)
    trainer = {
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
    data = {"train_path": str(prompt_file), "batch_size": args.batch_size, "shuffle": False}
    return {"seed_everything": 0, "trainer": trainer, "model": model, "data": data}


def run_ours(args: argparse.Namespace) -> tuple[list[float], dict[str, list[float]]]:
    """``rlhf-lightning fit`` on the run's config; seconds of each iteration (timing/iteration_s),
    and of each of the module's phases per iteration (its ``timing/<phase>_s`` metrics)."""
    import csv

    from rlhf_lightning.cli import main as cli_main

    config = Path(args.workdir) / "config.yaml"
    config.write_text(json.dumps(our_config(args)))  # JSON is YAML
    cli_main(["fit", "--config", str(config)])
    (metrics,) = Path(args.workdir).glob("csv/version_*/metrics.csv")
    with metrics.open() as f:
        rows = list(csv.DictReader(f))
    phases = defaultdict(list)
    for row in rows:
        for key, value in row.items():
            if key.startswith("timing/") and key != "timing/iteration_s" and value:
                phases[key[len("timing/") : -len("_s")]].append(float(value))
    return [float(row["timing/iteration_s"]) for row in rows if row.get("timing/iteration_s")], dict(phases)


def worker_main(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    seconds, phases = run_trl(args) if args.worker == "trl" else run_ours(args)
    if len(seconds) != args.warmup + args.iters:
        raise SystemExit(f"{args.worker}: expected {args.warmup + args.iters} iterations, timed {len(seconds)}")
    result = {
        "setup": args.worker,
        "ppo_epochs": args.epochs,
        "seconds": seconds[args.warmup :],
        "warmup_s": seconds[: args.warmup],
        "phases": {name: values[args.warmup :] for name, values in phases.items()},
        "peak_rss_mb": peak_rss_mb(),
        "threads": torch.get_num_threads(),
        "load": [load_before, os.getloadavg()[0]],
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------- driver
def run_worker(args: argparse.Namespace, setup: str, epochs: int, reward_path: Path, root: Path) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"{setup}{epochs}_", dir=root))
    python = args.trl_python if setup == "trl" else sys.executable
    settings = {
        "--epochs": epochs,
        "--reward-path": reward_path,
        "--workdir": workdir,
        "--warmup": args.warmup,
        "--iters": args.iters,
        "--batch-size": args.batch_size,
        "--max-new-tokens": args.max_new_tokens,
        "--full-critic": args.full_critic,
        "--threads": args.threads,
    }
    argv = [python, str(Path(__file__).resolve()), "--worker", setup]
    argv += [word for flag, value in settings.items() for word in (flag, str(value))]
    for option in ("old_logprobs", "cpu_linear", "cpu_malloc"):
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
        f"(warm-up {result['warmup_s']}){f'; phases (median s): {phases}' if phases else ''}, peak RSS "
        f"{result['peak_rss_mb']:.0f} MB, load {result['load']}, process {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return result


def summarise(results: Sequence[dict]) -> list[dict]:
    """One row per (setup, epochs): median seconds over all its timed iterations, ratio to TRL's."""
    rows = []
    for epochs in sorted({r["ppo_epochs"] for r in results}):
        for setup in SETUPS:
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
                    }
                )
    trl = {row["ppo_epochs"]: row["median_s"] for row in rows if row["setup"] == "trl"}
    for row in rows:
        row["vs_trl"] = row["median_s"] / trl[row["ppo_epochs"]] if row["ppo_epochs"] in trl else float("nan")
    return rows


def format_table(rows: Sequence[dict]) -> str:
    lines = ["| setup | PPO epochs | s / iteration (median) | iterations | vs TRL | peak RSS MB |", "|---|---:|---:|---:|---:|---:|"]
    lines += [
        f"| {r['setup']} | {r['ppo_epochs']} | {r['median_s']:.2f} | {r['n']} | {r['vs_trl']:.2f}x | {r['peak_rss_mb']:.0f} |" for r in rows
    ]
    ratios = " ".join(f"{r['setup']}_{r['ppo_epochs']}={r['vs_trl']:.3f}" for r in rows if r["setup"] != "trl")
    return "\n".join([*lines, "", f"COMPARE {ratios}"])


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
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
