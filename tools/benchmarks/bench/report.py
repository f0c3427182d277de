"""The phase benchmark's report: the phase and floor tables, the roofline table, the ``BENCH`` line and, with
``--engine``, the ``ENGINE`` lines."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tools.benchmarks import roofline


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
