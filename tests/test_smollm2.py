"""The built-in SmolLM2-135M-Instruct (slow: converts and loads the real GGUF; run with -m slow)."""

from __future__ import annotations

import pytest
import torch

from rlhf_lightning.models import load_causal_lm, smollm2_checkpoint

pytestmark = pytest.mark.slow


def test_converted_checkpoint_matches_the_gguf_and_loads_in_seconds(smollm2_tokenizer):

    from transformers import AutoModelForCausalLM

    from rlhf_lightning.models import smollm2_gguf_path

    folder = smollm2_checkpoint()
    converted = sorted((path.name, path.stat().st_mtime_ns) for path in folder.iterdir())
    model = load_causal_lm("smollm2", len(smollm2_tokenizer))
    assert sorted((path.name, path.stat().st_mtime_ns) for path in folder.iterdir()) == converted  # the cached conversion, not a new one
    gguf = smollm2_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ids = smollm2_tokenizer(["The capital of France is"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, direct(ids).logits, atol=1e-4)
    assert (folder / "model.safetensors").exists()


def test_quickstart_model_writes_sensible_text(smollm2_tokenizer):
    from helpers import make_module

    module = make_module(policy="smollm2", lora=dict(rank=8), sampling=dict(max_new_tokens=16, do_sample=False), critic="shared")
    rollout = module.rollout(["What is the capital of France? Answer in one word."])
    assert "paris" in rollout.response_texts[0].lower()


def test_a_gguf_file_is_a_model_spec(smollm2_tokenizer):
    from rlhf_lightning.models import load_tokenizer, smollm2_gguf_path

    gguf = str(smollm2_gguf_path())
    model = load_causal_lm(gguf, len(smollm2_tokenizer))
    tokenizer = load_tokenizer(gguf)
    assert tokenizer.eos_token == "<|im_end|>" and model.config.vocab_size == len(tokenizer)
