import os

# One OpenMP thread per process unless the caller says otherwise, set before torch loads: the suite
# runs in two pytest-xdist workers (the README's -n 2), each starting CLI runs of tiny models, and
# more threads than cores only spin on each other (the tests that need threads set them).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer (extracted from the packaged GGUF once, then cached)."""
    from rlhf_lightning.models import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory):
    """A 2-layer, 16-wide LlamaForSequenceClassification on the character tokenizer, saved to a
    folder: ``(path, model, tokenizer)``."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlhf_lightning.models import char_tokenizer

    # A 16-wide model: intra-op threads only add synchronisation cost (10-50x on a busy 2-core box).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForSequenceClassification(config).eval()
    path = tmp_path_factory.mktemp("tiny_rm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    yield path, model, tokenizer
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``vllm`` skip where vLLM is not importable (the default install has no vLLM)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        skip = pytest.mark.skip(reason="vLLM is not installed (tools/setup.sh --vllm)")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(skip)
