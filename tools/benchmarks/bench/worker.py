"""One mode's runs in a worker process (``--worker``): for each ``--ppo-epochs`` value a fresh module under a
real Lightning Trainer, its phases timed, the floors measured right after every iteration, and one result line."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

from tools.benchmarks import roofline
from tools.benchmarks.bench.measure import (
    PassCounter,
    PhaseClock,
    builtin_prompts,
    peak_rss_mb,
    quiet,
    reset_peak_rss,
    rss_mb,
    trainable_numel,
)
from tools.benchmarks.bench.memory import held_mb

RESULT_PREFIX = "BENCH_RESULT "
PHASES = ("rollout", "score", "score_policy", "score_ref", "advantages", "update", "other")


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
            self.rollout_engine.sync = self.clock.wrap("rollout", self.rollout_engine.sync)  # the sampler calls it apart
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
            encode = self.sampler.encode

            def timed_encode(*args, **kwargs):
                with self.clock("rollout"):
                    self.last_encoding = encode(*args, **kwargs)
                    return self.last_encoding

            self.sampler.encode = timed_encode
            self.regulariser.kl_per_token = self.clock.wrap("score", self.regulariser.kl_per_token)
            self.update.run = self.clock.wrap("update", self.update.run)

        # Arguments pass through untouched: the benchmark must not depend on the signatures.

        def rollout(self, *args, **kwargs):
            with self.clock("score"):  # whatever rollout() does besides generating is scoring
                self.last_rollout = super().rollout(*args, **kwargs)
                return self.last_rollout

        def compute_advantages(self, *args, **kwargs):
            with self.clock("advantages"):
                return super().compute_advantages(*args, **kwargs)

        def _first_critic_values(self, *args, **kwargs):  # the update's first critic forward, V_old read from it
            with self.clock("update"):
                return super()._first_critic_values(*args, **kwargs)

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
