"""The tests' base model: a random tiny llama (or Qwen2) saved as a Hugging Face directory (`build_tiny_model`).
Imported by tests/conftest.py's `tiny_model_dir` and the tests that build a project's models/base; not run on its own."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase


def build_tiny_model(out_dir: Path, tokenizer: PreTrainedTokenizerBase, seed: int = 0, architecture: str = "llama",
                     **overrides) -> Path:
    """A random tiny llama (2 layers, hidden 64) with `tokenizer`, saved as an HF dir: for the tests.
    `architecture="qwen2"`: the same sizes as a Qwen2 (biases on q, k and v), the second architecture's tests.

    No dimension below 64 and the k/v projections 32 wide: on avx512_bf16 CPUs bitsandbytes repacks a 4-bit weight
    for inference in blocks of 32 outputs by 64 inputs, and QLoRA evaluation fails on a narrower model.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[architecture]
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        **overrides,
    )
    torch.manual_seed(seed)
    model = model_class(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
