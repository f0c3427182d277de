"""Memory per process, estimated at start-up before any model loads (docs/performance.md, "Peak memory").

The estimate adds what a run holds at its peak, from the model's configuration (built on the meta device: no
weights read) and the settings, every tensor in float32 (the trainer's dtype), ``b`` = 4 bytes:

- weights: the policy (P parameters); the reference (full fine-tuning: a frozen copy; LoRA: none, the adapter is
  switched off; a foreign ``model.reference``: its own); the starting policy beside a moving or foreign reference
  (full fine-tuning); a separate critic's trunk; b x each.
- optimizer: the gradients and AdamW's two moments of what is trained (the LoRA adapter or P; the critic): 3 b x it.
- logits kept: a rollout's pi_old and pi_ref logits, rows x new x V each, when the KL estimator needs logits (and
  pi_0's beside a moving or foreign reference), held through the update.
- update: one micro-batch's activations kept for the backward, layers x tokens x (8 h + 4 I) values (a Llama-shaped
  layer: its norms, projections and MLP; attention by SDPA stores no score matrix), and its logits three times
  (logits, log-softmax, their gradient): micro-rows x (new + 1) x V.
- the rollout engine's own (``RolloutEngine.memory_bytes``): ``hf``'s KV cache and the logits generate returns; vLLM's
  KV cache and its copy of the weights.
- the sampler running ahead (``model.off_policy.max_staleness`` k > 0): its copy of the policy, at most min(k + 1,
  iterations) published versions of the trained weights, and min(k, batches per epoch - 1) batches drawn ahead
  (their logits).
- the process: what it holds at the check (the interpreter, torch, the tokenizer, the prompts): its RSS.

Counted as held at once (the engine's generation buffers are freed before the update: an over-estimate by them).
Not counted: the reward model (a classifier's weights), allocator slack, Lightning's loggers. It is compared with
the memory available to each process (``MemAvailable`` shared by the processes on this machine; a GPU's free
memory); more than that is a ConfigError naming the largest terms and the settings that lower them, before any
model loads. ``RLHF_LIGHTNING_MEMORY_CHECK=warn`` makes it a warning (the estimate is rough: the measured peaks
beside it are in docs/performance.md), ``off`` skips it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from rlhf_lightning.checks import ConfigError
from rlhf_lightning.episodes import most_tokens

B = 4  # bytes per value: float32
GIB = 2**30
MEMORY_CHECK_ENV = "RLHF_LIGHTNING_MEMORY_CHECK"
MEMORY_CHECK_CHOICES = ("error", "warn", "off")


@dataclass(frozen=True)
class ModelSize:
    """What the estimate reads of a causal LM: parameters, the LoRA adapter's (for ``model.lora``), the
    trunk's (a separate critic copies it), vocabulary, hidden and MLP widths, layers, the KV width per layer."""

    params: int
    adapter: int
    trunk: int
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    kv_width: int


@dataclass(frozen=True)
class Term:
    """One line of the estimate: what it is, its bytes, and how to make it smaller (the settings to change)."""

    name: str
    bytes: int
    fix: str


def model_size(model: torch.nn.Module, lora_rank: int = 0, target_modules: Optional[list[str]] = None) -> ModelSize:
    """:class:`ModelSize` of ``model`` (on the meta device will do): a LoRA adapter of rank r on a linear layer
    (in, out) has r (in + out) parameters, on every linear layer but the output head when ``target_modules`` is
    None (peft's ``all-linear``), else on those whose name ends with one of them."""
    config = model.config
    head = model.get_output_embeddings()
    adapter = 0
    if lora_rank:
        for name, module in model.named_modules():
            targeted = target_modules is None or name.split(".")[-1] in target_modules
            if isinstance(module, torch.nn.Linear) and module is not head and targeted:
                adapter += lora_rank * (module.in_features + module.out_features)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelSize(
        params=sum(p.numel() for p in model.parameters()),
        adapter=adapter,
        trunk=sum(p.numel() for p in getattr(model, model.base_model_prefix).parameters()),
        vocab=config.vocab_size,
        hidden=config.hidden_size,
        intermediate=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
        layers=config.num_hidden_layers,
        kv_width=(getattr(config, "num_key_value_heads", None) or heads) * head_dim,
    )


def estimate(
    policy: ModelSize,
    *,
    rows: int,
    prompt_tokens: int,
    new_tokens: int,
    micro_rows: int,
    lora: bool,
    critic: str,
    reference: Optional[ModelSize] = None,
    reference_moves: bool = False,
    needs_logits: bool = False,
    staleness: int = 0,
    iterations: Optional[int] = None,
    batches_per_epoch: Optional[int] = None,
    engine: Optional[dict[str, tuple[int, str]]] = None,
    process: int = 0,
) -> list[Term]:
    """The terms of the estimate (the module's docstring), for ``rows`` responses per iteration per process of
    ``prompt_tokens`` + ``new_tokens`` tokens, ``micro_rows`` of them per backward; ``reference``: a foreign one's
    size; ``engine``: the rollout engine's own terms (``RolloutEngine.memory_bytes``); ``process``: the RSS so far."""
    P, V = policy.params, policy.vocab
    trained = policy.adapter * (2 if reference_moves else 1) if lora else P  # a moving LoRA reference: a frozen adapter
    critic_params = {"separate": policy.trunk + policy.hidden + 1, "shared": policy.hidden + 1}.get(critic, 0)
    weights = P + (reference.params if reference is not None else 0 if lora else P)
    weights += P if not lora and (reference_moves or reference is not None) else 0  # pi_0 beside them
    weights += (critic_params if critic == "separate" else 0) + (trained if lora else 0)
    response_logits = rows * new_tokens * V * B
    kept_logits = (2 + (reference_moves or reference is not None)) if needs_logits else 0
    tokens = micro_rows * (prompt_tokens + new_tokens)
    activations = policy.layers * tokens * (8 * policy.hidden + 4 * policy.intermediate) * B
    update = activations + 3 * micro_rows * (new_tokens + 1) * V * B
    samples = "lower data.batch_size, model.sampling.num_generations or model.sampling.max_new_tokens"
    terms = [
        Term("the process so far (torch, the tokenizer, the prompts)", process, ""),
        Term("weights", weights * B, "set model.lora.rank (LoRA: no reference copy) or model.critic shared or none"),
        Term("gradients and AdamW's moments", 3 * (trained + critic_params) * B, "set model.lora.rank, or model.critic shared or none"),
        Term("logits kept for the KL", kept_logits * response_logits, f"{samples}, or a model.kl_estimator that needs no logits"),
        Term(
            "one micro-batch's activations and logits",
            update,
            "raise model.ppo.num_minibatches or model.ppo.gradient_accumulation_steps, or " + samples,
        ),
    ]
    terms += [Term(name, size, lower) for name, (size, lower) in (engine or {}).items()]
    if staleness:
        versions = staleness + 1 if iterations is None else min(staleness + 1, iterations)
        ahead = staleness if batches_per_epoch is None else min(staleness, max(batches_per_epoch - 1, 0))
        size = (P + (policy.adapter if lora else 0)) * B + versions * trained * B + ahead * response_logits * (1 + needs_logits)
        terms.append(
            Term(f"the sampler running ahead ({versions} versions, {ahead} drawn ahead)", size, "lower model.off_policy.max_staleness")
        )
    return terms


def available_bytes(device: torch.device, processes: int = 1) -> tuple[int, str]:
    """The memory one of ``processes`` processes on this machine may use, and what it is: a GPU's free memory
    (``torch.cuda.mem_get_info``), else ``MemAvailable`` (psutil, or /proc/meminfo) shared among them."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {torch.cuda.get_device_name(device)}"
    try:
        import psutil

        available = psutil.virtual_memory().available
    except ImportError:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    share = f" / {processes} processes on this machine" if processes > 1 else ""
    return available // processes, f"available (MemAvailable{share})"


def check(terms: list[Term], available: int, what: str, mode: str = "error") -> str:
    """The one line of the estimate, logged at start; past ``available`` bytes a ConfigError (``mode`` error) naming
    the largest terms and the settings that lower them, or (``warn``) the line says so and is returned for a warning."""
    total = sum(term.bytes for term in terms)
    parts = ", ".join(f"{term.name} {term.bytes / GIB:.2f}" for term in terms if term.bytes)
    line = f"memory: about {total / GIB:.2f} GiB per process at its peak ({parts}) of {available / GIB:.2f} GiB {what}"
    if total <= available:
        return line
    largest = sorted((term for term in terms if term.fix and term.bytes >= total / 20), key=lambda term: -term.bytes)[:3]
    lower = "; ".join(f"{term.name} {term.bytes / GIB:.2f} GiB ({term.fix})" for term in largest)
    message = (
        f"memory: this run needs about {total / GIB:.1f} GiB per process, more than the {available / GIB:.1f} GiB {what}. "
        f"The largest terms: {lower}. ({MEMORY_CHECK_ENV}=warn runs it anyway: the estimate is rough, docs/performance.md)"
    )
    if mode == "error":
        raise ConfigError(message)
    return message


def check_mode() -> str:
    """``$RLHF_LIGHTNING_MEMORY_CHECK``: error (the default), warn or off."""
    mode = os.environ.get(MEMORY_CHECK_ENV, "error").strip().lower() or "error"
    if mode not in MEMORY_CHECK_CHOICES:
        raise ConfigError(f"{MEMORY_CHECK_ENV} must be one of {', '.join(MEMORY_CHECK_CHOICES)}, got {mode!r}")
    return mode


def meta_model(spec: str, vocab_size: int, trust_remote_code: bool = False, tiny_config: Optional[dict] = None) -> torch.nn.Module:
    """The causal LM of ``spec`` (``model.policy`` or ``model.reference``) on the meta device, from its configuration
    alone: no weights read, nothing converted (``smollm2`` not yet in the cache: the packaged GGUF's header)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from rlhf_lightning import models

    if spec == "tiny":
        config = LlamaConfig(vocab_size=vocab_size, **{**models.TINY_CONFIG, **(tiny_config or {})})
    else:
        cached = models.cache_dir() / "smollm2-135m-instruct"
        if spec == "smollm2" and not (cached / "config.json").is_file():
            gguf = models.smollm2_gguf_path()
            location, kwargs = str(gguf.parent), {"gguf_file": gguf.name}
        else:
            location, kwargs = models._pretrained_location(spec)
        config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code, **kwargs)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    model.tie_weights()
    return model


def batches_per_epoch(trainer, datamodule) -> Optional[int]:
    """The training batches of an epoch on each process: the prompts dealt over the processes in whole batches,
    within ``trainer.limit_train_batches``; None without a prompt list."""
    prompts, batch_size = getattr(datamodule, "train_prompts", None), getattr(datamodule, "batch_size", None)
    if not prompts or not batch_size:
        return None
    batches = len(prompts) // trainer.world_size // batch_size
    limit = trainer.limit_train_batches
    return min(batches, limit) if isinstance(limit, int) else int(batches * limit)


def check_memory(module, datamodule, longest_prompt: Optional[int]) -> None:
    """At start-up of a fit, before any model loads: the estimate of this run's peak memory per process against
    what is available, logged in one line; past it a ConfigError naming the largest terms and the settings that
    lower them (:func:`check`; ``$RLHF_LIGHTNING_MEMORY_CHECK``). A ``model.off_policy.max_staleness`` beyond the
    run's iterations is said (every batch is then drawn from the starting weights)."""
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    trainer, batch_size = module._trainer, getattr(datamodule, "batch_size", None)
    mode = check_mode()
    if mode == "off" or trainer is None or not batch_size:
        return
    hp, loading, sampling, ppo = module.hparams, module.loading, module.sampling, module.ppo
    policy_model = meta_model(hp.policy, len(module.tokenizer), loading.trust_remote_code, loading.tiny_config)
    policy = model_size(policy_model, module.lora.rank, module.lora.target_modules)
    reference = None
    if hp.reference is not None:
        reference = model_size(meta_model(hp.reference, len(module.tokenizer), loading.trust_remote_code))
    device = trainer.strategy.root_device
    rows = batch_size * sampling.num_generations
    prompt_tokens = longest_prompt or module.prompts.max_length
    per_epoch = batches_per_epoch(trainer, datamodule)
    epochs = trainer.max_epochs if isinstance(trainer.max_epochs, int) and trainer.max_epochs >= 0 else None
    iterations = None if per_epoch is None or epochs is None else per_epoch * epochs
    staleness = module.off_policy.max_staleness
    new_tokens = most_tokens(module.environment, sampling.max_new_tokens)  # an episode's turns, the environment's included
    if staleness and iterations is not None and staleness >= iterations:
        rank_zero_warn(
            f"model.off_policy.max_staleness {staleness} is more than this run's {iterations} iterations can show: every batch "
            f"is drawn from the starting weights, and the sampler keeps up to {iterations} versions of the trained weights"
        )
    engine = module.rollout_engine.memory_bytes(
        rows=rows,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        vocab=policy.vocab,
        layers=policy.layers,
        kv_width=policy.kv_width,
        weight_bytes=policy.params * B,
        device=device,
    )
    process = 0
    if device.type == "cpu":
        import psutil

        process = psutil.Process().memory_info().rss
    terms = estimate(
        policy,
        rows=rows,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        micro_rows=max(rows // (ppo.num_minibatches * ppo.gradient_accumulation_steps), 1),
        lora=module.lora.rank > 0,
        critic=hp.critic,
        reference=reference,
        reference_moves=module.reference_update.moves,
        needs_logits=module.kl_estimator.needs_logits,
        staleness=staleness,
        iterations=iterations,
        batches_per_epoch=per_epoch,
        engine=engine,
        process=process,
    )
    available, what = available_bytes(device, trainer.num_devices if device.type == "cpu" else 1)
    line = check(terms, available, what, mode)
    (rank_zero_warn if line.startswith("memory: this run needs") else rank_zero_info)(line)
