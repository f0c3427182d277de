"""``--memory``: the states a process holds (weights, gradients, AdamW's moments) and each process's peak RSS
decomposed, one process against the ranks of ``--strategy ddp|fsdp2``, and the last line ``MEMORY ...``."""

from __future__ import annotations

from collections.abc import Sequence

from tools.benchmarks.bench.report import rank_label

# --memory: glibc mmaps every block from 64 KiB up and unmaps it when freed, so an RSS counts the
# tensors held, not the heap's high-water mark (a shard is half its tensor: FSDP2 moves many of
# SmolLM2's matrices under glibc's usual thresholds, into a heap that keeps what it once held).
MEMORY_MMAP_THRESHOLD = 65536


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
