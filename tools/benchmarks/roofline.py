"""The roofline of a PPO-RLHF iteration: what each phase must compute and move at least, from the
model's shape, and this machine's rates to turn that into seconds (``tools/benchmarks/bench/report.py``'s roofline
table, ``tools/benchmarks/decode_bench.py``'s floor).

``iteration_costs`` lists each phase's passes over the weights as (FLOPs, bytes) pairs (a decode
step, a forward, a backward, an AdamW step), ``machine_peaks`` measures the sustained matmul rate
and read bandwidth, and ``floor_seconds`` gives each pass the longer of its FLOPs at that rate and
its bytes at that bandwidth.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a decoder-only transformer's cost depends on. ``layer_matmul_params``: the weights of
    one block's matrix multiplies (attention q, k, v, o and the MLP); ``kv_dim``: key/value heads x
    head dim; ``attn_dim``: query heads x head dim. Norms, biases and the embedding lookup are left
    out: O(hidden) per token against O(hidden^2)."""

    layers: int
    hidden: int
    attn_dim: int
    kv_dim: int
    vocab: int
    layer_matmul_params: int

    @classmethod
    def of(cls, model) -> ModelShape:
        """From a Hugging Face causal LM (or its PEFT wrapper): the config's sizes and the
        ``nn.Linear`` weights of its first block (LoRA factors excluded: see ``lora_params``)."""
        from torch import nn

        config = model.config
        layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        matmul = sum(m.weight.numel() for name, m in layer.named_modules() if isinstance(m, nn.Linear) and "lora_" not in name)
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            attn_dim=config.num_attention_heads * head_dim,
            kv_dim=config.num_key_value_heads * head_dim,
            vocab=config.vocab_size,
            layer_matmul_params=matmul,
        )

    @property
    def matmul_params(self) -> int:
        """Weights read by one trunk forward (all blocks), without the LM head."""
        return self.layers * self.layer_matmul_params


def forward_cost(
    shape: ModelShape, rows: int, new: int, past: int = 0, logits: int = 0, extra_params: int = 0, word_bytes: int = 4
) -> tuple[float, float]:
    """(FLOPs, bytes read) of one forward of ``rows`` sequences over ``new`` positions after ``past``
    cached ones, with the LM head on the last ``logits`` positions of each row:

        FLOPs = 2 (P + p) rows new + 4 L a rows (new past + new (new + 1) / 2) + 2 h V rows logits
        bytes = w (P + p + [logits > 0] h V) + w 2 L k rows past

    with P = ``layers * layer_matmul_params``, p = ``extra_params`` (LoRA factors run unmerged),
    a = ``attn_dim``, k = ``kv_dim``, w = ``word_bytes``: a multiply-add is 2 FLOPs; causal
    attention costs 2 a FLOPs per (query, key) pair for the scores and 2 a for the weighted sum
    (keys of a position: itself and those before); weights are read once per forward and the KV
    cache of the ``past`` positions once (activations stay in cache: a floor, not an estimate).
    Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Table 1, counts the same terms."""
    tokens = rows * new
    pairs = rows * (new * past + new * (new + 1) // 2)
    flops = 2 * (shape.matmul_params + extra_params) * tokens + 4 * shape.layers * shape.attn_dim * pairs
    flops += 2 * shape.hidden * shape.vocab * rows * logits
    weights = shape.matmul_params + extra_params + (shape.hidden * shape.vocab if logits else 0)
    return float(flops), float(word_bytes * (weights + 2 * shape.layers * shape.kv_dim * rows * past))


def backward_cost(
    shape: ModelShape, rows: int, seq: int, logits: int, trains_base: bool, lora_params: int = 0, word_bytes: int = 4, past: int = 0
) -> tuple[float, float]:
    """(FLOPs, bytes) of the backward of ``forward_cost(shape, rows, seq, past, logits, lora_params)``:
    every matmul's input gradient (the forward's matmul FLOPs once more), its weight gradient where
    the weight trains (the base weights with ``trains_base``, the LoRA factors always: the same
    count again), and attention's four products (twice its forward). Bytes: the weights (and the
    ``past`` keys and values) read again and the trained weights' gradients written."""
    flops, weight_bytes = forward_cost(shape, rows, seq, past, logits, lora_params, word_bytes)
    attention = 4 * shape.layers * shape.attn_dim * rows * (seq * past + seq * (seq + 1) // 2)
    matmuls = flops - attention
    if trains_base:
        weight_grads, grad_words = matmuls, weight_bytes / word_bytes
    else:
        weight_grads, grad_words = 2 * lora_params * rows * seq, lora_params
    return matmuls + weight_grads + 2.0 * attention, weight_bytes + word_bytes * grad_words


def adamw_cost(trainable: int, word_bytes: int = 4) -> tuple[float, float]:
    """AdamW's step: parameter, gradient and two moments read, parameter and moments written (7
    words per trainable weight); about a dozen FLOPs per weight, memory-bound everywhere."""
    return 12.0 * trainable, 7.0 * word_bytes * trainable


def iteration_costs(
    shape: ModelShape,
    batch: int,
    prompt_len: int,
    response_len: int,
    ppo_epochs: int,
    num_minibatches: int,
    policy_trainable: int,
    critic_trainable: int = 0,
    lora_params: int = 0,
    critic: str = "separate",
    old_logprobs: str = "forward",
    word_bytes: int = 4,
    prompts: int = 0,
    common_prefix: int = 0,
) -> dict[str, list[tuple[float, float]]]:
    """Each phase's passes as (FLOPs, bytes) pairs, one per pass over the weights (a decode step,
    a forward, a backward, an optimizer step): what one PPO iteration must compute at least.

    - rollout: the prefill (logits for the last prompt position only, as ``generate`` asks) and
      ``response_len - 1`` decode steps, LoRA merged (no adapter work);
    - score: log pi_old (+ V_old with a shared critic) unless it comes from the sampler, the
      reference (LoRA: the adapter-disabled base), a separate critic's trunk unless one minibatch
      takes the whole batch (its first forward in the update gives V_old: ``old_values_in_update``);
    - update: per minibatch and epoch the policy's forward and backward, a separate critic's,
      and one AdamW step per optimizer.
    ``lora_params``: the adapter's weights (0: full fine-tuning), run unmerged in the policy's
    forwards; ``policy_trainable`` / ``critic_trainable``: the weights each AdamW steps (LoRA: the
    adapter's; a shared critic's head counts with the policy). ``prompts``: the batch's distinct
    prompts where rows share them (``model.runtime.shared_prompts``, rlhf_lightning/prefix.py; 0: none do):
    the prefill is then one pass over them but their last token, whose position every row runs as
    its first decode step, and each policy and reference pass one over the prompts (where fewer than
    its rows) and one over every row's responses on their keys and values (a separate critic's trunk
    runs whole rows). ``common_prefix``: the first tokens all prompts share (``prefix.common_prefix``).
    Where no prompt repeats, each policy, reference and separate-critic pass is then one over them for
    one row and one over every row's rest, and the prefill one over them, one over every row's prompt after
    them but its last token, then that token for every row (``prefix.prompt_cache``); where prompts repeat,
    each pass over the distinct prompts (the prefill's included) is one over them for one row and one over
    each distinct prompt's rest (``prefix._prompts_once``)."""
    w, seq, rows = word_bytes, prompt_len + response_len, batch // num_minibatches

    def forwards(n: int, lora: int, logits: int = response_len + 1) -> list[tuple[float, float]]:
        """A policy or reference forward over ``n`` rows, its logits at the response positions (a
        critic's trunk: ``logits`` 0)."""
        if common_prefix and (not prompts or prompts >= n):
            return [
                forward_cost(shape, 1, common_prefix, 0, min(logits, 1), lora, w),
                forward_cost(shape, n, seq - common_prefix, common_prefix, logits, lora, w),
            ]
        if not prompts or prompts >= n or not logits:
            return [forward_cost(shape, n, seq, 0, logits, lora, w)]
        return [*prompt_forwards(prompt_len, lora), forward_cost(shape, n, response_len - 1, prompt_len, response_len - 1, lora, w)]

    def prompt_forwards(length: int, lora: int) -> list[tuple[float, float]]:
        """The pass over the distinct prompts' first ``length`` tokens, the last one's logits: their common
        beginning once where they share one (``prefix._prompts_once``)."""
        if not 0 < common_prefix < length:
            return [forward_cost(shape, prompts, length, 0, 1, lora, w)]
        return [
            forward_cost(shape, 1, common_prefix, 0, 1, lora, w),
            forward_cost(shape, prompts, length - common_prefix, common_prefix, 1, lora, w),
        ]

    def backwards(n: int, logits: int = response_len + 1, lora: int = lora_params) -> list[tuple[float, float]]:
        trains = not lora
        if common_prefix and (not prompts or prompts >= n):
            return [
                backward_cost(shape, 1, common_prefix, min(logits, 1), trains, lora, w),
                backward_cost(shape, n, seq - common_prefix, logits, trains, lora, w, past=common_prefix),
            ]
        if not prompts or prompts >= n or not logits:
            return [backward_cost(shape, n, seq, logits, trains, lora, w)]
        if 0 < common_prefix < prompt_len:  # the distinct prompts' common beginning once
            prompt_passes = [
                backward_cost(shape, 1, common_prefix, 1, trains, lora_params, w),
                backward_cost(shape, prompts, prompt_len - common_prefix, 1, trains, lora_params, w, past=common_prefix),
            ]
        else:
            prompt_passes = [backward_cost(shape, prompts, prompt_len, 1, trains, lora_params, w)]
        return [*prompt_passes, backward_cost(shape, n, response_len - 1, response_len - 1, trains, lora_params, w, past=prompt_len)]

    if prompts and prompts < batch:  # the distinct prompts but their last token, then that token for every row
        rollout = prompt_forwards(prompt_len - 1, 0)
        rollout += [forward_cost(shape, batch, 1, prompt_len - 1 + step, 1, 0, w) for step in range(response_len)]
    elif 0 < common_prefix < prompt_len - 1:  # the common beginning once, every row's prompt after it but its last token, then that token
        rollout = [forward_cost(shape, 1, common_prefix, 0, 1, 0, w)]
        rollout.append(forward_cost(shape, batch, prompt_len - 1 - common_prefix, common_prefix, 1, 0, w))
        rollout += [forward_cost(shape, batch, 1, prompt_len - 1 + step, 1, 0, w) for step in range(response_len)]
    else:
        rollout = [forward_cost(shape, batch, prompt_len, 0, 1, 0, w)]
        rollout += [forward_cost(shape, batch, 1, prompt_len + step, 1, 0, w) for step in range(response_len - 1)]
    score = [] if old_logprobs == "sampler" else forwards(batch, lora_params)
    score += forwards(batch, 0)
    if critic == "separate" and num_minibatches > 1:
        score += forwards(batch, 0, logits=0)
    minibatch = [*forwards(rows, lora_params), *backwards(rows)]
    if critic == "separate":  # its own trunk: the policy's without the LM head
        minibatch += [*forwards(rows, 0, logits=0), *backwards(rows, logits=0, lora=0), adamw_cost(critic_trainable, w)]
    minibatch.append(adamw_cost(policy_trainable, w))
    return {"rollout": rollout, "score": score, "update": minibatch * (ppo_epochs * num_minibatches)}


def floor_seconds(passes: Sequence[tuple[float, float]], flops_per_s: float, bytes_per_s: float) -> float:
    """The roofline: each pass takes at least the longer of its compute and its weight traffic."""
    return sum(max(flops / flops_per_s, nbytes / bytes_per_s) for flops, nbytes in passes)


def machine_peaks(device: str = "cpu", dtype_name: str = "float32", seconds: float = 1.0) -> dict[str, float]:
    """This machine's sustained matmul FLOP/s (2048 x 2048 products, best of repeated rounds, with
    the faster of PyTorch's own kernel and, on a CPU, oneDNN's: ``cpu.linear``) and read
    bandwidth (sum over a 512 MB tensor, best of rounds), each over about ``seconds``."""
    import torch

    from rlhf_lightning import cpu

    dtype = getattr(torch, dtype_name)

    def best(run, rounds_for: float) -> float:
        run()  # warm-up
        times, start = [], time.perf_counter()
        while not times or time.perf_counter() - start < rounds_for:
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            run()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return min(times)

    n = 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    flops_per_s = 2 * n**3 / best(lambda: torch.mm(a, b), seconds)
    if device == "cpu" and dtype == torch.float32 and cpu.onednn_available():
        flops_per_s = max(flops_per_s, 2 * n**3 / best(lambda: cpu.linear(a, b), seconds))
    big = torch.ones(2**27, device=device, dtype=torch.float32)  # 512 MB: far beyond any cache
    bytes_per_s = big.numel() * 4 / best(lambda: big.sum(), seconds)
    return {"flops_per_s": flops_per_s, "bytes_per_s": bytes_per_s}
