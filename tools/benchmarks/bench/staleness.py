"""``--max-staleness K``: the plain loop's seconds per iteration with the sampler K updates ahead against the
synchronous loop, in this process, runs alternating K, 0, K, 0 per mode; last line ``STALENESS ...``."""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tools.benchmarks.bench.measure import quiet


def run(args: argparse.Namespace, mode: str, k: int, inflight_every: int = 0) -> tuple[list[float], list[dict[str, float]]]:
    """Seconds of each timed iteration (after ``--warmup``) of the plain loop in ``mode`` with max_staleness ``k``
    (and ``inflight_every``):
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
        sampling=dict(max_new_tokens=args.max_new_tokens, min_new_tokens=0 if args.eos else args.max_new_tokens, old_logprobs="forward"),
        prompts=dict(chat_template=not args.no_chat_template),
        ppo=dict(epochs=args.ppo_epochs[0], num_minibatches=args.num_minibatches),
        critic=args.critic or ("shared" if lora else "separate"),
        lora=dict(rank=args.lora_rank if lora else 0, alpha=2.0 * args.lora_rank),
        runtime=dict(log_samples_every_n_steps=0),
        off_policy=dict(max_staleness=k, inflight_every=inflight_every),
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


def main(args: argparse.Namespace, modes: Sequence[str]) -> list[dict]:
    """``--max-staleness K``: per mode, runs alternating K, 0, K, 0 in this process (with ``--inflight-every N``:
    (K, N), K, 0 twice); the median iteration seconds of each arm and their ratios to the synchronous one, one line per
    mode, then ``STALENESS k=K <mode>_ratio=<r> ... load=<before>-<after>``."""
    quiet()
    load_before, results, k, every = os.getloadavg()[0], [], args.max_staleness, args.inflight_every or 0
    arms = {"inflight": (k, every), "k": (k, 0), "sync": (0, 0)} if every else {"k": (k, 0), "sync": (0, 0)}
    for mode in modes:
        seconds: dict[str, list[float]] = {arm: [] for arm in arms}
        phases: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
        for _ in range(2):
            for arm, (staleness, inflight) in arms.items():
                run_seconds, run_phases = run(args, mode, staleness, inflight)
                seconds[arm] += run_seconds
                phases[arm] += run_phases
        median = {arm: statistics.median(seconds[arm]) for arm in arms}
        phase = {arm: {name: statistics.median(p.get(name, 0.0) for p in phases[arm]) for name in phases[arm][0]} for arm in arms}
        ratio = median["k"] / median["sync"]
        result = dict(mode=mode, k=k, iter_s=median["k"], iter_s_synchronous=median["sync"], ratio=ratio, seconds=seconds, phases=phase)
        if every:
            result.update(inflight_every=every, iter_s_inflight=median["inflight"], inflight_ratio=median["inflight"] / median["sync"])
        results.append(result)
        medians = "; ".join(f"{arm}: " + ", ".join(f"{name} {v:.2f}" for name, v in phase[arm].items()) for arm in arms)
        inflight = f", {median['inflight']:.2f} with in-flight updates every {every} tokens" if every else ""
        print(
            f"{mode}: {median['k']:.2f} s per iteration with max_staleness {k}{inflight}, {median['sync']:.2f} without: ratio {ratio:.3f} "
            f"(iterations: {', '.join(f'{arm} {len(v)}' for arm, v in seconds.items())}); median phase seconds, {medians}",
            flush=True,
        )
    if args.save:
        Path(args.save).write_text(json.dumps(results, indent=1))
    cells = " ".join(
        f"{r['mode']}_ratio={r['ratio']:.3f} {r['mode']}_iter_s={r['iter_s']:.3f}"
        + (f" {r['mode']}_inflight_ratio={r['inflight_ratio']:.3f}" if every else "")
        for r in results
    )
    print(f"STALENESS k={k} {cells} load={load_before:.2f}-{os.getloadavg()[0]:.2f}", flush=True)
    return results
