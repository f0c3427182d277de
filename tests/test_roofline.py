"""tools/benchmarks/roofline.py: the FLOP and byte counts of each pass against hand-derived values on the tiny model, each
phase's passes counted once (prompts shared, a common beginning, LoRA, a shared or separate critic), and the floor."""

from __future__ import annotations

import pytest

from tools.benchmarks import roofline


@pytest.fixture(scope="module")
def tiny_shape():
    from rlhf_lightning.models import load_causal_lm

    return roofline.ModelShape.of(load_causal_lm("tiny", vocab_size=100))


def test_model_shape_of_the_tiny_llama(tiny_shape):
    # TINY_CONFIG: hidden 64, MLP 128, 2 layers, 4 heads of 16 (as many KV heads).
    # One block's matmul weights: q, k, v, o 4 * 64 * 64 = 16384, gate, up, down 3 * 64 * 128 = 24576.
    assert tiny_shape == roofline.ModelShape(layers=2, hidden=64, attn_dim=64, kv_dim=64, vocab=100, layer_matmul_params=40960)
    assert tiny_shape.matmul_params == 81920


def test_forward_cost_prefill_and_decode_step_by_hand(tiny_shape):
    # Prefill of 2 rows x 3 positions, logits at the last: matmuls 2 * 81920 * 6 = 983040; causal
    # pairs 2 * (1 + 2 + 3) = 12, attention 4 * 2 layers * 64 * 12 = 6144; LM head 2 * 64 * 100 * 2 = 25600.
    # Bytes: 4 * (81920 + 64 * 100) = 353280, no cache yet.
    assert roofline.forward_cost(tiny_shape, rows=2, new=3, past=0, logits=1) == (1014784.0, 353280.0)
    # A decode step after 5 cached positions: matmuls 2 * 81920 * 2 = 327680; pairs 2 * 6 = 12, 6144;
    # LM head 25600. Bytes: the weights, plus the KV cache 4 * 2 (K, V) * 2 layers * 64 * 2 rows * 5 = 10240.
    assert roofline.forward_cost(tiny_shape, rows=2, new=1, past=5, logits=1) == (359424.0, 363520.0)
    # A trunk without LM head (a separate critic): no vocab term in either.
    assert roofline.forward_cost(tiny_shape, rows=2, new=3) == (983040.0 + 6144.0, 4.0 * 81920)


def test_backward_cost_full_and_lora_by_hand(tiny_shape):
    # Full: input grads (forward minus attention: 1008640) + weight grads (the same) + 2 * 6144 attention;
    # bytes: the weights read again (353280) and their gradients written (353280).
    assert roofline.backward_cost(tiny_shape, rows=2, seq=3, logits=1, trains_base=True) == (2029568.0, 706560.0)
    # LoRA with 1000 adapter weights: the forward gains 2 * 1000 * 6 = 12000 FLOPs (1026784), input
    # grads 1020640, weight grads only the adapter's 12000, attention 12288; bytes 4 * (81920 + 1000 + 6400)
    # read and 4 * 1000 written.
    assert roofline.backward_cost(tiny_shape, rows=2, seq=3, logits=1, trains_base=False, lora_params=1000) == (1044928.0, 361280.0)
    assert roofline.adamw_cost(1000) == (12000.0, 28000.0)


def test_iteration_costs_count_each_pass_once(tiny_shape):
    common = dict(batch=4, prompt_len=3, response_len=2, ppo_epochs=2, num_minibatches=2, policy_trainable=500)
    full = roofline.iteration_costs(tiny_shape, **common, critic_trainable=400)
    # Trajectory: the prefill and response_len - 1 = 1 decode step.
    assert full["rollout"] == [roofline.forward_cost(tiny_shape, 4, 3, 0, 1), roofline.forward_cost(tiny_shape, 4, 1, 3, 1)]
    # Score: log pi_old, log pi_ref (3 logits each: response_len + 1) and the critic's trunk.
    assert full["score"] == [roofline.forward_cost(tiny_shape, 4, 5, 0, 3)] * 2 + [roofline.forward_cost(tiny_shape, 4, 5)]
    # Update: 2 epochs x 2 minibatches of 2 rows, each: policy fwd + bwd, critic fwd + bwd + AdamW, policy AdamW.
    minibatch = [
        roofline.forward_cost(tiny_shape, 2, 5, 0, 3),
        roofline.backward_cost(tiny_shape, 2, 5, 3, True),
        roofline.forward_cost(tiny_shape, 2, 5),
        roofline.backward_cost(tiny_shape, 2, 5, 0, True),
        roofline.adamw_cost(400),
        roofline.adamw_cost(500),
    ]
    assert full["update"] == minibatch * 4
    # LoRA, shared critic, old log-probs from the sampler: the score phase is the reference alone,
    # the policy's passes run the adapter unmerged, and one AdamW step per minibatch.
    lora = roofline.iteration_costs(tiny_shape, **common, lora_params=300, critic="shared", old_logprobs="sampler")
    assert lora["rollout"] == full["rollout"]
    assert lora["score"] == [roofline.forward_cost(tiny_shape, 4, 5, 0, 3)]
    assert (
        lora["update"]
        == [
            roofline.forward_cost(tiny_shape, 2, 5, 0, 3, 300),
            roofline.backward_cost(tiny_shape, 2, 5, 3, False, 300),
            roofline.adamw_cost(500),
        ]
        * 4
    )

    # Shared prompts (2 distinct in the batch of 4, one minibatch: rlhf_lightning/prefix.py): every policy and
    # reference pass is one over the distinct prompts (3 tokens, the last one's logits) and one over each row's
    # response_len - 1 = 1 response token after them (its logits); the prefill runs the prompts but their last
    # token, each row then decodes from it (2 steps); the critic's trunk as before, but none while scoring:
    # with one minibatch the update's first critic forward gives V_old.
    one = dict(common, ppo_epochs=1, num_minibatches=1)
    shared = roofline.iteration_costs(tiny_shape, **one, critic_trainable=400, prompts=2)
    assert shared["rollout"] == [
        roofline.forward_cost(tiny_shape, 2, 2, 0, 1),
        roofline.forward_cost(tiny_shape, 4, 1, 2, 1),
        roofline.forward_cost(tiny_shape, 4, 1, 3, 1),
    ]
    by_rows = [roofline.forward_cost(tiny_shape, 2, 3, 0, 1), roofline.forward_cost(tiny_shape, 4, 1, 3, 1)]
    assert shared["score"] == by_rows * 2
    assert shared["update"] == [
        *by_rows,
        roofline.backward_cost(tiny_shape, 2, 3, 1, True),
        roofline.backward_cost(tiny_shape, 4, 1, 1, True, past=3),
        roofline.forward_cost(tiny_shape, 4, 5),
        roofline.backward_cost(tiny_shape, 4, 5, 0, True),
        roofline.adamw_cost(400),
        roofline.adamw_cost(500),
    ]
    assert roofline.iteration_costs(tiny_shape, **one, critic_trainable=400, prompts=4) == roofline.iteration_costs(
        tiny_shape, **one, critic_trainable=400
    )
    # Both (GRPO's groups of a chat template: 2 distinct prompts that share their first token): every pass over the
    # distinct prompts, the prefill's included, runs that token once for one row, then each prompt's rest on it.
    two_level = roofline.iteration_costs(tiny_shape, **one, critic_trainable=400, prompts=2, common_prefix=1)
    assert two_level["rollout"] == [
        roofline.forward_cost(tiny_shape, 1, 1, 0, 1),
        roofline.forward_cost(tiny_shape, 2, 1, 1, 1),
        *shared["rollout"][1:],
    ]
    prompts_once = [roofline.forward_cost(tiny_shape, 1, 1, 0, 1), roofline.forward_cost(tiny_shape, 2, 2, 1, 1)]
    assert two_level["score"] == [*prompts_once, by_rows[1]] * 2
    assert two_level["update"][:6] == [
        *prompts_once,
        by_rows[1],
        roofline.backward_cost(tiny_shape, 1, 1, 1, True),
        roofline.backward_cost(tiny_shape, 2, 2, 1, True, past=1),
        roofline.backward_cost(tiny_shape, 4, 1, 1, True, past=3),
    ]
    # A common prefix (2 of the 3 prompt tokens, every prompt distinct): each policy, reference and critic pass is
    # one over those tokens for one row (a causal LM's last logits) and one over every row's 3 other positions.
    prefixed = roofline.iteration_costs(tiny_shape, **common, critic_trainable=400, common_prefix=2)
    assert prefixed["rollout"] == full["rollout"]  # the prefill shares a beginning short of the prompt's last 2 tokens
    assert roofline.iteration_costs(tiny_shape, **common, critic_trainable=400, common_prefix=1)["rollout"] == [
        roofline.forward_cost(tiny_shape, 1, 1, 0, 1),
        roofline.forward_cost(tiny_shape, 4, 1, 1, 1),
        roofline.forward_cost(tiny_shape, 4, 1, 2, 1),
        roofline.forward_cost(tiny_shape, 4, 1, 3, 1),
    ]
    policy = [roofline.forward_cost(tiny_shape, 1, 2, 0, 1), roofline.forward_cost(tiny_shape, 2, 3, 2, 3)]
    assert prefixed["score"] == [roofline.forward_cost(tiny_shape, 1, 2, 0, 1), roofline.forward_cost(tiny_shape, 4, 3, 2, 3)] * 2 + [
        roofline.forward_cost(tiny_shape, 1, 2),
        roofline.forward_cost(tiny_shape, 4, 3, 2),
    ]
    assert (
        prefixed["update"]
        == [
            *policy,
            roofline.backward_cost(tiny_shape, 1, 2, 1, True),
            roofline.backward_cost(tiny_shape, 2, 3, 3, True, past=2),
            roofline.forward_cost(tiny_shape, 1, 2),
            roofline.forward_cost(tiny_shape, 2, 3, 2),
            roofline.backward_cost(tiny_shape, 1, 2, 0, True),
            roofline.backward_cost(tiny_shape, 2, 3, 0, True, past=2),
            roofline.adamw_cost(400),
            roofline.adamw_cost(500),
        ]
        * 4
    )
    assert sum(f for f, _ in prefixed["update"]) < sum(f for f, _ in full["update"])
    flops = [sum(f for f, _ in passes) for passes in (shared["score"], full["score"])]
    assert flops[0] < flops[1]
    # A backward on cached keys and values: the matmuls of its forward twice over, attention's twice its forward.
    forward, _ = roofline.forward_cost(tiny_shape, 2, 1, 3, 1)
    attention = 4 * tiny_shape.layers * tiny_shape.attn_dim * 2 * (1 * 3 + 1)
    assert roofline.backward_cost(tiny_shape, 2, 1, 1, True, past=3)[0] == 2 * (forward - attention) + 2 * attention


def test_floor_seconds_takes_the_slower_of_compute_and_traffic_per_pass():
    # 2 FLOP/s, 4 B/s: (10 FLOPs, 4 B) is compute-bound at 5 s, (1 FLOP, 8 B) memory-bound at 2 s.
    assert roofline.floor_seconds([(10.0, 4.0), (1.0, 8.0)], flops_per_s=2.0, bytes_per_s=4.0) == 7.0
