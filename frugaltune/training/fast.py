"""Speed switches for CPU training, each one measured (benchmarks/train_switches.py) and chosen per machine.

Library code: `prepare_model` applies `fast_lora_dropout`; the training loop applies `short_sequence_attention`
with the crossover length the kernels stage measured on this machine (plan `run.eager_attention_max_len`).

- `short_sequence_attention(model, max_len)`: transformers' "sdpa" runs PyTorch's CPU flash-attention kernel,
  whose backward pass costs ~10 ms per layer at 16 x 34 tokens on a 2-core Zen 4 (a fifth of a LoRA step), where
  the plain matmul-softmax-matmul ("eager") path takes ~2 ms. Flash attention wins back its tiling only on long
  sequences (crossover measured at ~200 tokens there). Length-grouped batches have one padded length each, so the
  attention and its mask are chosen per batch: eager up to `max_len`, SDPA above. Same math, same results up to
  rounding.
- `fast_lora_dropout(model)`: peft applies `nn.Dropout` to the input of every adapted projection, and torch's CPU
  Bernoulli sampling draws one 32-bit number per element: 2.6 ms for a 16 x 34 x 576 input, four times per layer
  (q, k and v each drop out the same hidden states separately), 13 % of a LoRA step. The replacement draws 16
  random bits per element from 64-bit words (4x fewer draws) and computes the dropout of one input once for all the
  projections that read it (q/k/v, gate/up), as a fused QKV LoRA would: the same mask for the three adapters.
  The drop probability is rounded to a multiple of 2^-15 (0.05 -> 0.04999) and the kept values are scaled by
  1/(1 - that probability), so the expectation is exact.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator

import torch

SHORT_ATTENTION = "frugaltune_short"
_BITS = 15  # random bits per element used: the low 15 of each 16-bit lane (the top lane of an int64 has only 15)


class SharedDropout(torch.nn.Module):
    """Dropout that reuses its result when called again on the same tensor (the sibling projections' input).

    `shared` is one dict per decoder layer (or per adapted parent module): the q, k and v projections receive the
    very same `hidden_states` tensor object, so the first computes the dropout and the others reuse it. The cache
    holds the last input and output only, and an identity check (`is`) cannot match a tensor of another forward.
    Gradient checkpointing recomputes with the RNG state restored (torch's default CPU generator), so the
    recomputed mask equals the first one, as with `nn.Dropout`.
    """

    def __init__(self, p: float, shared: dict):
        super().__init__()
        self.threshold = round(p * (1 << _BITS))
        self.p = self.threshold / (1 << _BITS)  # the probability actually used
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.threshold == 0:
            return x
        if self.shared.get("input") is x and self.shared.get("p") == self.p:
            return self.shared["output"]
        n = x.numel()
        words = torch.empty(math.ceil(n / 4), dtype=torch.int64, device=x.device).random_()
        lanes = words.view(torch.int16)[:n].view(x.shape) & ((1 << _BITS) - 1)
        out = x * (lanes >= self.threshold) * (1.0 / (1.0 - self.p))
        self.shared.update(input=x, output=out, p=self.p)
        return out

    def extra_repr(self) -> str:
        return f"p={self.p:.5f}, shared"


def fast_lora_dropout(model: torch.nn.Module) -> int:
    """Replace the `nn.Dropout` of every peft LoRA layer by `SharedDropout` (one cache per parent module).

    Returns how many were replaced. Layers with dropout 0 keep peft's `nn.Identity` (no copy at all).
    """
    replaced = 0
    caches: dict[str, dict] = {}
    for name, module in model.named_modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, torch.nn.ModuleDict):
            continue
        parent = name.rsplit(".", 1)[0]  # ...layers.3.self_attn: q/k/v share; ...layers.3.mlp: gate/up share
        for adapter, dropout in list(dropouts.items()):
            if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
                dropouts[adapter] = SharedDropout(dropout.p, caches.setdefault(f"{parent}/{adapter}", {}))
                replaced += 1
    return replaced


def _register(max_len: int) -> str:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        if key.shape[2] <= max_len:
            return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def mask(*args, kv_length: int, **kwargs):
        # eager needs an explicit additive mask (it has no is_causal); SDPA may skip the mask altogether
        if kv_length <= max_len:
            kwargs.pop("allow_is_causal_skip", None)
            return eager_mask(*args, kv_length=kv_length, **kwargs)
        return sdpa_mask(*args, kv_length=kv_length, **kwargs)

    name = f"{SHORT_ATTENTION}_{max_len}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    return name


def _set_attention(model: torch.nn.Module, name: str) -> None:
    with warnings.catch_warnings():  # transformers 5.23 calls its own deprecated is_gradient_checkpointing here
        warnings.simplefilter("ignore", FutureWarning)
        model.set_attn_implementation(name)


def use_short_sequence_attention(model: torch.nn.Module, max_len: int) -> str | None:
    """Batches of at most `max_len` tokens use eager attention, longer ones SDPA; returns the implementation it
    replaced (None: left alone). A model whose attention is not sdpa/eager (a registered CUDA kernel,
    flash-attention) or `max_len` 0 is left alone."""
    previous = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if max_len <= 0 or previous not in ("sdpa", "eager"):
        return None
    _set_attention(model, _register(max_len))
    return previous


@contextlib.contextmanager
def short_sequence_attention(model: torch.nn.Module, max_len: int) -> Iterator[None]:
    """`use_short_sequence_attention` within the block; the model's own implementation comes back on exit, so
    nothing saved or served afterwards names ours."""
    previous = use_short_sequence_attention(model, max_len)
    try:
        yield
    finally:
        if previous is not None:
            _set_attention(model, previous)
