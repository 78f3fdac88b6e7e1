"""Plug the verified CUDA attention into transformers as `attn_implementation="frugaltune"`.

Evaluation and inference call `register_if_used()`: it registers the kernel only when reports/kernels.json says it
built, verified and beat SDPA at the model's shapes on this machine, and returns the name to pass to
`from_pretrained(..., attn_implementation=...)`, or None (keep "sdpa"). Calls the kernel cannot serve (a padding
mask, dropout, decoding with a KV cache, other dtypes or head sizes, a CPU tensor) go to transformers' own SDPA
path, so registering never changes results, only speed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

NAME = "frugaltune"
# flash(q, k, v, causal, softmax_scale or None) -> (out, lse); q, k, v: [batch, heads, seqlen, head_dim]
FlashFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float | None], tuple[torch.Tensor, torch.Tensor]]


def make_attention(flash: FlashFn, device_types: tuple[str, ...] = ("cuda",)) -> Callable[..., Any]:
    """A transformers attention function that runs `flash` where it can and SDPA everywhere else."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        served = (
            attention_mask is None
            and dropout == 0.0
            and query.device.type in device_types
            and query.dtype in (torch.float16, torch.bfloat16)
            and query.shape[-1] in (64, 128)
            and query.shape[2] == key.shape[2]  # no KV cache longer than the queries (decoding)
            and kwargs.get("position_bias") is None
            and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False)
        )
        if not served:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                **kwargs,
            )
        groups = getattr(module, "num_key_value_groups", 1)
        if groups > 1:  # the kernel has one KV head per query head
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        out, _ = flash(query.contiguous(), key.contiguous(), value.contiguous(), bool(causal), scaling)
        return out.transpose(1, 2).contiguous(), None

    return attention


def register(flash: FlashFn, device_types: tuple[str, ...] = ("cuda",)) -> str:
    """Register under NAME, with SDPA's mask construction (no mask at all when there is no padding)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, make_attention(flash, device_types))
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def register_if_used(report: Path, build_root: Path) -> str | None:
    """NAME when reports/kernels.json marks flash_attn_fwd as used and the extension loads here; else None."""
    if not report.is_file() or not torch.cuda.is_available():
        return None
    record = json.loads(report.read_text(encoding="utf-8")).get("kernels", {}).get("flash_attn_fwd", {})
    if not record.get("used"):
        return None
    from frugaltune.kernels.build import load_extension

    ext, _ = load_extension(record["build"]["arch"], build_root)
    return register(lambda q, k, v, causal, scale: ext.flash_attn_fwd(q, k, v, causal, scale or 0.0))
