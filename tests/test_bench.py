"""tools/benchmarks/bench/: in --tiny mode (full, LoRA and GRPO) every run finishes and the BENCH line carries finite, positive numbers;
its pass counter, memory lines and peak RSS; decode_bench's products left out. The roofline's counts: tests/test_roofline.py."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from tools.benchmarks.bench import measure, memory

from helpers import REPO

BENCH_LINE = re.compile(
    r"BENCH rollout_vs_generate=(\S+) iteration_vs_floors=(\S+) lora_vs_full_rss=(\S+) iter_s=(\S+) tokens_per_s=(\S+) iteration_vs_roofline=(\S+)"
)


@pytest.mark.convergence
def test_bench_tiny_prints_a_parsable_last_line_of_finite_positive_numbers_and_counts_each_phases_passes(tmp_path):
    # One thread: on a busy 2-core CPU spinning OpenMP threads only add noise (and minutes).
    saved = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, "-m", "tools.benchmarks.bench", "--tiny", "--threads", "1", "--save", str(saved)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    match = BENCH_LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    values = [float(v) for v in match.groups()]
    assert all(math.isfinite(v) and v > 0 for v in values), lines[-1]
    # Every (mode, epochs) run is in the table: full, LoRA and critic-free GRPO, 1 and 4 PPO epochs.
    for mode, critic in (("full", "separate"), ("lora", "shared"), ("grpo", "none")):
        for epochs in (1, 4):
            assert any(line.startswith((f"| {mode} | {epochs} |", f"| {mode} | {critic} | {epochs} |")) for line in lines), (mode, epochs)
    # The passes of the last timed iteration (32 new tokens, 1 minibatch, log pi_old from the sampler):
    # one generate (its prefill) and 31 decode steps; per epoch one policy fwd+bwd (and the separate
    # critic's, whose first one gives V_old: no critic forward while scoring). The reference runs once where its
    # weights differ from the policy's (the tiny model's VADER reward may leave them equal: then none).
    for r in json.loads(saved.read_text()):
        passes, epochs = r["passes"], r["ppo_epochs"]
        # GRPO (4 responses per prompt) prefills each distinct prompt once (rlhf_lightning/prefix.py): a forward,
        # then generate from its cache, whose first step is the prompt's last token
        rollout = {"policy fwd": 1, "policy decode step": 32} if r["mode"] == "grpo" else {"policy generate": 1, "policy decode step": 31}
        assert passes["rollout"] == rollout, r["mode"]
        update = {"policy fwd+bwd": epochs, **({"critic fwd+bwd": epochs} if r["mode"] == "full" else {})}
        assert passes["update"] == update, r["mode"]
        assert passes.get("score_policy", {}) == {}, r["mode"]
        reference = "reference fwd" if r["mode"] == "full" else "policy fwd"  # LoRA: the policy, adapter off
        assert passes.get("score_ref", {}) in ({}, {reference: 1}), r["mode"]
        assert set(passes) <= {"rollout", "score_policy", "score_ref", "update"}, r["mode"]  # nothing else, e.g. in "other"


def test_pass_counter_counts_generate_decode_steps_and_forwards_with_and_without_grad_per_phase():
    import torch

    from rlhf_lightning import prefix
    from rlhf_lightning.models import load_causal_lm

    model = load_causal_lm("tiny", vocab_size=100)
    phase = ["rollout"]
    counter = measure.PassCounter(lambda: phase[0])
    counter.watch("policy", model)
    ids = torch.ones(2, 3, dtype=torch.long)
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=True, pad_token_id=0)  # prefill + 3 steps
        phase[0] = "score"
        model(input_ids=ids)
    phase[0] = "update"
    model(input_ids=ids).logits.sum().backward()
    model(input_ids=ids).logits.sum().backward()
    phase[0] = "shared"  # rows sharing prompts (rlhf_lightning/prefix.py): two trunk calls, one pass
    rows = torch.cat([ids, torch.tensor([[5, 6], [7, 8]])], 1)
    prefix.shared_prompt_logits(
        model, rows, torch.ones_like(rows), 2, *prefix.distinct_prompts(rows, torch.ones_like(rows), 3)
    ).sum().backward()
    phase[0] = None  # between phases: not counted
    model(input_ids=ids)
    assert counter.take() == {
        "rollout": {"policy generate": 1, "policy decode step": 3},
        "score": {"policy fwd": 1},
        "update": {"policy fwd+bwd": 2},
        "shared": {"policy fwd+bwd": 1},
    }
    assert counter.take() == {}  # take() starts the count afresh


def test_memory_line_decomposes_each_process_and_divides_the_largest_ranks_training_peak_by_one_process(capsys):
    def run(devices, rank, baseline, weights, gradients, adamw, start, train_peak):
        phase_peaks = {"rollout": start + 500, "score_policy": start + 100, "score": start + 50, "update": train_peak}
        memory = dict(baseline=baseline, weights=weights, gradients=gradients, adamw=adamw, iteration_start=[0.0, start])
        memory.update(phase_peaks=phase_peaks, train_peak=train_peak, floors_peak=train_peak + 1, startup_peak=2000.0)
        return {"mode": "full", "devices": devices, "strategy": "single" if devices == 1 else "fsdp2", "rank": rank, "memory": memory}

    results = [
        run(1, 0, 400.0, 1500.0, 1000.0, 2000.0, start=4000.0, train_peak=5200.0),
        run(2, 0, 420.0, 750.0, 500.0, 1000.0, start=2200.0, train_peak=3120.0),
        run(2, 1, 420.0, 750.0, 500.0, 1000.0, start=2210.0, train_peak=3250.0),
    ]
    # The largest rank's training peak over the one process's: 3250 / 5200.
    assert memory.memory_line(results) == "MEMORY rank_peak_vs_single=0.625"
    printed = capsys.readouterr().out
    # One process: 400 + 1500 + 2000 held, 100 other at 4000; score's peak is its nested phases' largest (+100).
    assert "single: baseline 400 + weights 1500 + AdamW 2000 + other 100 = 4000 MB" in printed
    assert "rollout +500, score +100, update +1200 (gradients 1000 MB" in printed
    # Floor: (420 + (1500 + 1000 + 2000) / 2) / (400 + 4500) = 2670 / 4900; the rest above baseline + states
    # at the peak: 3250 - 420 - 2250 = 580 per rank, 5200 - 400 - 4500 = 300 in one process.
    assert "= 0.545; measured 0.625" in printed
    assert "580 MB per rank, 300 MB in one process" in printed
    assert memory.memory_floor(results[0]["memory"], 420.0, 2) == pytest.approx(2670 / 4900)


def test_reset_peak_rss_starts_the_peak_again_from_the_current_rss():
    import mmap

    if not measure.reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs")
    # 200 MB mapped and written here, unmapped when closed, whatever malloc settings an earlier test left.
    block = mmap.mmap(-1, 200 * 2**20)
    block.write(b"\1" * len(block))
    held = measure.rss_mb()
    block.close()
    high = measure.peak_rss_mb()  # the kernel's high-water mark kept the freed block
    assert high >= held - 1 and high - measure.rss_mb() > 150
    assert measure.reset_peak_rss()
    assert measure.peak_rss_mb() < high - 150


def test_decode_bench_leaves_every_product_out_and_puts_each_back():
    """``decode_bench.products_left_out``: inside, every linear (the output layer's included) returns zeros
    of its output's shape, so the logits are all zero; on leaving, the model computes what it did before."""
    import torch

    from rlhf_lightning.models import load_causal_lm
    from tools.benchmarks import decode_bench

    model = load_causal_lm("tiny", vocab_size=40)
    ids = torch.randint(0, 40, (3, 7))
    with torch.no_grad():
        before = model(ids).logits
        with decode_bench.products_left_out(model):
            inside = model(ids).logits
        after = model(ids).logits
    assert before.abs().min() > 0 and torch.equal(inside, torch.zeros(3, 7, 40))
    assert torch.equal(after, before)
    assert not any("forward" in m.__dict__ for m in model.modules())
