"""tools/bench.py: in --tiny mode (full, LoRA and GRPO) every run finishes and the BENCH line carries finite, positive numbers; the
roofline's FLOP and byte counts against hand-derived values on the tiny model."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

import bench
from helpers import REPO

BENCH_LINE = re.compile(
    r"BENCH rollout_vs_generate=(\S+) iteration_vs_floors=(\S+) lora_vs_full_rss=(\S+) iter_s=(\S+) tokens_per_s=(\S+) iteration_vs_roofline=(\S+)"
)


@pytest.mark.convergence
def test_bench_tiny_prints_a_parsable_last_line_of_finite_positive_numbers_and_counts_each_phases_passes(tmp_path):
    # One thread: on a busy 2-core CPU spinning OpenMP threads only add noise (and minutes).
    saved = tmp_path / "results.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench.py"), "--tiny", "--threads", "1", "--save", str(saved)],
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
    counter = bench.PassCounter(lambda: phase[0])
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


# ------------------------------------------------------------------ the roofline's counting


@pytest.fixture(scope="module")
def tiny_shape():
    from rlhf_lightning.models import load_causal_lm

    return bench.ModelShape.of(load_causal_lm("tiny", vocab_size=100))


def test_model_shape_of_the_tiny_llama(tiny_shape):
    # TINY_CONFIG: hidden 64, MLP 128, 2 layers, 4 heads of 16 (as many KV heads).
    # One block's matmul weights: q, k, v, o 4 * 64 * 64 = 16384, gate, up, down 3 * 64 * 128 = 24576.
    assert tiny_shape == bench.ModelShape(layers=2, hidden=64, attn_dim=64, kv_dim=64, vocab=100, layer_matmul_params=40960)
    assert tiny_shape.matmul_params == 81920


def test_forward_cost_prefill_and_decode_step_by_hand(tiny_shape):
    # Prefill of 2 rows x 3 positions, logits at the last: matmuls 2 * 81920 * 6 = 983040; causal
    # pairs 2 * (1 + 2 + 3) = 12, attention 4 * 2 layers * 64 * 12 = 6144; LM head 2 * 64 * 100 * 2 = 25600.
    # Bytes: 4 * (81920 + 64 * 100) = 353280, no cache yet.
    assert bench.forward_cost(tiny_shape, rows=2, new=3, past=0, logits=1) == (1014784.0, 353280.0)
    # A decode step after 5 cached positions: matmuls 2 * 81920 * 2 = 327680; pairs 2 * 6 = 12, 6144;
    # LM head 25600. Bytes: the weights, plus the KV cache 4 * 2 (K, V) * 2 layers * 64 * 2 rows * 5 = 10240.
    assert bench.forward_cost(tiny_shape, rows=2, new=1, past=5, logits=1) == (359424.0, 363520.0)
    # A trunk without LM head (a separate critic): no vocab term in either.
    assert bench.forward_cost(tiny_shape, rows=2, new=3) == (983040.0 + 6144.0, 4.0 * 81920)


def test_backward_cost_full_and_lora_by_hand(tiny_shape):
    # Full: input grads (forward minus attention: 1008640) + weight grads (the same) + 2 * 6144 attention;
    # bytes: the weights read again (353280) and their gradients written (353280).
    assert bench.backward_cost(tiny_shape, rows=2, seq=3, logits=1, trains_base=True) == (2029568.0, 706560.0)
    # LoRA with 1000 adapter weights: the forward gains 2 * 1000 * 6 = 12000 FLOPs (1026784), input
    # grads 1020640, weight grads only the adapter's 12000, attention 12288; bytes 4 * (81920 + 1000 + 6400)
    # read and 4 * 1000 written.
    assert bench.backward_cost(tiny_shape, rows=2, seq=3, logits=1, trains_base=False, lora_params=1000) == (1044928.0, 361280.0)
    assert bench.adamw_cost(1000) == (12000.0, 28000.0)


def test_iteration_costs_count_each_pass_once(tiny_shape):
    common = dict(batch=4, prompt_len=3, response_len=2, ppo_epochs=2, num_minibatches=2, policy_trainable=500)
    full = bench.iteration_costs(tiny_shape, **common, critic_trainable=400)
    # Rollout: the prefill and response_len - 1 = 1 decode step.
    assert full["rollout"] == [bench.forward_cost(tiny_shape, 4, 3, 0, 1), bench.forward_cost(tiny_shape, 4, 1, 3, 1)]
    # Score: log pi_old, log pi_ref (3 logits each: response_len + 1) and the critic's trunk.
    assert full["score"] == [bench.forward_cost(tiny_shape, 4, 5, 0, 3)] * 2 + [bench.forward_cost(tiny_shape, 4, 5)]
    # Update: 2 epochs x 2 minibatches of 2 rows, each: policy fwd + bwd, critic fwd + bwd + AdamW, policy AdamW.
    minibatch = [
        bench.forward_cost(tiny_shape, 2, 5, 0, 3),
        bench.backward_cost(tiny_shape, 2, 5, 3, True),
        bench.forward_cost(tiny_shape, 2, 5),
        bench.backward_cost(tiny_shape, 2, 5, 0, True),
        bench.adamw_cost(400),
        bench.adamw_cost(500),
    ]
    assert full["update"] == minibatch * 4
    # LoRA, shared critic, old log-probs from the sampler: the score phase is the reference alone,
    # the policy's passes run the adapter unmerged, and one AdamW step per minibatch.
    lora = bench.iteration_costs(tiny_shape, **common, lora_params=300, critic="shared", old_logprobs="sampler")
    assert lora["rollout"] == full["rollout"]
    assert lora["score"] == [bench.forward_cost(tiny_shape, 4, 5, 0, 3)]
    assert (
        lora["update"]
        == [bench.forward_cost(tiny_shape, 2, 5, 0, 3, 300), bench.backward_cost(tiny_shape, 2, 5, 3, False, 300), bench.adamw_cost(500)]
        * 4
    )

    # Shared prompts (2 distinct in the batch of 4, one minibatch: rlhf_lightning/prefix.py): every policy and
    # reference pass is one over the distinct prompts (3 tokens, the last one's logits) and one over each row's
    # response_len - 1 = 1 response token after them (its logits); the prefill runs the prompts but their last
    # token, each row then decodes from it (2 steps); the critic's trunk as before, but none while scoring:
    # with one minibatch the update's first critic forward gives V_old.
    one = dict(common, ppo_epochs=1, num_minibatches=1)
    shared = bench.iteration_costs(tiny_shape, **one, critic_trainable=400, prompts=2)
    assert shared["rollout"] == [
        bench.forward_cost(tiny_shape, 2, 2, 0, 1),
        bench.forward_cost(tiny_shape, 4, 1, 2, 1),
        bench.forward_cost(tiny_shape, 4, 1, 3, 1),
    ]
    by_rows = [bench.forward_cost(tiny_shape, 2, 3, 0, 1), bench.forward_cost(tiny_shape, 4, 1, 3, 1)]
    assert shared["score"] == by_rows * 2
    assert shared["update"] == [
        *by_rows,
        bench.backward_cost(tiny_shape, 2, 3, 1, True),
        bench.backward_cost(tiny_shape, 4, 1, 1, True, past=3),
        bench.forward_cost(tiny_shape, 4, 5),
        bench.backward_cost(tiny_shape, 4, 5, 0, True),
        bench.adamw_cost(400),
        bench.adamw_cost(500),
    ]
    assert bench.iteration_costs(tiny_shape, **one, critic_trainable=400, prompts=4) == bench.iteration_costs(
        tiny_shape, **one, critic_trainable=400
    )
    # Both (GRPO's groups of a chat template: 2 distinct prompts that share their first token): every pass over the
    # distinct prompts, the prefill's included, runs that token once for one row, then each prompt's rest on it.
    two_level = bench.iteration_costs(tiny_shape, **one, critic_trainable=400, prompts=2, common_prefix=1)
    assert two_level["rollout"] == [
        bench.forward_cost(tiny_shape, 1, 1, 0, 1),
        bench.forward_cost(tiny_shape, 2, 1, 1, 1),
        *shared["rollout"][1:],
    ]
    prompts_once = [bench.forward_cost(tiny_shape, 1, 1, 0, 1), bench.forward_cost(tiny_shape, 2, 2, 1, 1)]
    assert two_level["score"] == [*prompts_once, by_rows[1]] * 2
    assert two_level["update"][:6] == [
        *prompts_once,
        by_rows[1],
        bench.backward_cost(tiny_shape, 1, 1, 1, True),
        bench.backward_cost(tiny_shape, 2, 2, 1, True, past=1),
        bench.backward_cost(tiny_shape, 4, 1, 1, True, past=3),
    ]
    # A common prefix (2 of the 3 prompt tokens, every prompt distinct): each policy, reference and critic pass is
    # one over those tokens for one row (a causal LM's last logits) and one over every row's 3 other positions.
    prefixed = bench.iteration_costs(tiny_shape, **common, critic_trainable=400, common_prefix=2)
    assert prefixed["rollout"] == full["rollout"]  # the prefill shares a beginning short of the prompt's last 2 tokens
    assert bench.iteration_costs(tiny_shape, **common, critic_trainable=400, common_prefix=1)["rollout"] == [
        bench.forward_cost(tiny_shape, 1, 1, 0, 1),
        bench.forward_cost(tiny_shape, 4, 1, 1, 1),
        bench.forward_cost(tiny_shape, 4, 1, 2, 1),
        bench.forward_cost(tiny_shape, 4, 1, 3, 1),
    ]
    policy = [bench.forward_cost(tiny_shape, 1, 2, 0, 1), bench.forward_cost(tiny_shape, 2, 3, 2, 3)]
    assert prefixed["score"] == [bench.forward_cost(tiny_shape, 1, 2, 0, 1), bench.forward_cost(tiny_shape, 4, 3, 2, 3)] * 2 + [
        bench.forward_cost(tiny_shape, 1, 2),
        bench.forward_cost(tiny_shape, 4, 3, 2),
    ]
    assert (
        prefixed["update"]
        == [
            *policy,
            bench.backward_cost(tiny_shape, 1, 2, 1, True),
            bench.backward_cost(tiny_shape, 2, 3, 3, True, past=2),
            bench.forward_cost(tiny_shape, 1, 2),
            bench.forward_cost(tiny_shape, 2, 3, 2),
            bench.backward_cost(tiny_shape, 1, 2, 0, True),
            bench.backward_cost(tiny_shape, 2, 3, 0, True, past=2),
            bench.adamw_cost(400),
            bench.adamw_cost(500),
        ]
        * 4
    )
    assert sum(f for f, _ in prefixed["update"]) < sum(f for f, _ in full["update"])
    flops = [sum(f for f, _ in passes) for passes in (shared["score"], full["score"])]
    assert flops[0] < flops[1]
    # A backward on cached keys and values: the matmuls of its forward twice over, attention's twice its forward.
    forward, _ = bench.forward_cost(tiny_shape, 2, 1, 3, 1)
    attention = 4 * tiny_shape.layers * tiny_shape.attn_dim * 2 * (1 * 3 + 1)
    assert bench.backward_cost(tiny_shape, 2, 1, 1, True, past=3)[0] == 2 * (forward - attention) + 2 * attention


def test_floor_seconds_takes_the_slower_of_compute_and_traffic_per_pass():
    # 2 FLOP/s, 4 B/s: (10 FLOPs, 4 B) is compute-bound at 5 s, (1 FLOP, 8 B) memory-bound at 2 s.
    assert bench.floor_seconds([(10.0, 4.0), (1.0, 8.0)], flops_per_s=2.0, bytes_per_s=4.0) == 7.0


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
    assert bench.memory_line(results) == "MEMORY rank_peak_vs_single=0.625"
    printed = capsys.readouterr().out
    # One process: 400 + 1500 + 2000 held, 100 other at 4000; score's peak is its nested phases' largest (+100).
    assert "single: baseline 400 + weights 1500 + AdamW 2000 + other 100 = 4000 MB" in printed
    assert "rollout +500, score +100, update +1200 (gradients 1000 MB" in printed
    # Floor: (420 + (1500 + 1000 + 2000) / 2) / (400 + 4500) = 2670 / 4900; the rest above baseline + states
    # at the peak: 3250 - 420 - 2250 = 580 per rank, 5200 - 400 - 4500 = 300 in one process.
    assert "= 0.545; measured 0.625" in printed
    assert "580 MB per rank, 300 MB in one process" in printed
    assert bench.memory_floor(results[0]["memory"], 420.0, 2) == pytest.approx(2670 / 4900)


def test_reset_peak_rss_starts_the_peak_again_from_the_current_rss():
    import mmap

    if not bench.reset_peak_rss():
        pytest.skip("no /proc/self/clear_refs")
    # 200 MB mapped and written here, unmapped when closed, whatever malloc settings an earlier test left.
    block = mmap.mmap(-1, 200 * 2**20)
    block.write(b"\1" * len(block))
    held = bench.rss_mb()
    block.close()
    high = bench.peak_rss_mb()  # the kernel's high-water mark kept the freed block
    assert high >= held - 1 and high - bench.rss_mb() > 150
    assert bench.reset_peak_rss()
    assert bench.peak_rss_mb() < high - 150


def test_decode_bench_leaves_every_product_out_and_puts_each_back():
    """``decode_bench.products_left_out``: inside, every linear (the output layer's included) returns zeros
    of its output's shape, so the logits are all zero; on leaving, the model computes what it did before."""
    import decode_bench
    import torch

    from rlhf_lightning.models import load_causal_lm

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
