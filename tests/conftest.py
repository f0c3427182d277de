import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer (extracted from the packaged GGUF once, then cached)."""
    from rlhf_lightning.models import load_tokenizer

    return load_tokenizer("smollm2")
