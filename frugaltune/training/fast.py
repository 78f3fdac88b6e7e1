"""Speed switches for CPU training, each one measured (benchmarks/train_throughput.py, step_anatomy.py) and chosen
per machine.

Library code: `prepare_model` applies `fast_lora_dropout`; the training loop applies `short_sequence_attention`
with the crossover length the kernels stage measured on this machine (plan `run.eager_attention_max_len`).

- `short_sequence_attention(model, max_len)`: transformers' "sdpa" runs PyTorch's CPU flash-attention kernel,
  whose backward pass on short sequences costs several times the plain matmul-softmax-matmul ("eager") path's
  (docs/DECISIONS.md has the figures). Flash attention wins back its tiling only on long sequences, at a crossover
  the kernels stage measures on each machine. Length-grouped batches have one padded length each, so the
  attention and its mask are chosen per batch: eager up to `max_len`, SDPA above. Same math, same results up to
  rounding. Under autocast the eager path's additive mask comes in the autocast dtype, as the scores do (0 and the
  dtype's minimum: the same sums, bit for bit, without an fp32 copy of every layer's scores).
- `fast_lora_dropout(model)`: peft applies `nn.Dropout` to the input of every adapted projection, and torch's CPU
  Bernoulli sampling draws one 32-bit number per element, four times per layer (q, k and v each drop out the same
  hidden states separately): a noticeable share of a LoRA step (docs/DECISIONS.md). The replacement draws 16
  random bits per element from 64-bit words (4x fewer draws) and computes the dropout of one input once for all the
  projections that read it (q/k/v, gate/up), as a fused QKV LoRA would: the same mask for the three adapters.
  The drop probability is rounded to a multiple of 2^-15 (0.05 -> 0.04999) and the kept values are scaled by
  1/(1 - that probability), so the expectation is exact.
- `frozen_weights_in(model, dtype)`: under bf16 autocast every frozen fp32 weight is cast to bf16 at each use
  (autocast caches casts only of weights that require grad), ~106 M values per step for SmolLM2-135M. LoRA in
  bf16 stores the frozen projections in bf16 once, as GPU LoRA recipes do: the matmuls get the same bf16 operands
  (the same rounding, so the same results), the casts and their temporaries go, and the base weights take half
  the memory. `prepare_model` applies it for LoRA when the plan chose bf16 (by measurement on the machine).
Switches measured not to win by default (fused siblings, packed frozen weights, bf16 projection inputs, LoRA in
addmm, compiled norms) were deleted: their measurements are in docs/DECISIONS.md.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator

import torch

from frugaltune import methods

SHORT_ATTENTION = "frugaltune_short"
_BITS = 15  # random bits per element used: the low 15 of each 16-bit lane (the top lane of an int64 has only 15)


def keep_mask(x: torch.Tensor, threshold: int) -> torch.Tensor:
    """SharedDropout's mask for `x` (True: kept), dropping with probability threshold / SharedDropout.LEVELS: 16
    random bits per element from 64-bit words, the low 15 used. training.int8_lora draws its masks here too, so
    that both paths drop the same elements from the same generator state."""
    n = x.numel()
    words = torch.empty(math.ceil(n / 4), dtype=torch.int64, device=x.device).random_()
    return (words.view(torch.int16)[:n].view(x.shape) & ((1 << _BITS) - 1)) >= threshold


class SharedDropout(torch.nn.Module):
    """Dropout that reuses its result when called again on the same tensor (the sibling projections' input).

    `shared` is one dict per decoder layer (or per adapted parent module): the q, k and v projections receive the
    very same `hidden_states` tensor object, so the first computes the dropout and the others reuse it. The cache
    holds the last input and output only, and an identity check (`is`) cannot match a tensor of another forward.
    Gradient checkpointing recomputes with the RNG state restored (torch's default CPU generator), so the
    recomputed mask equals the first one, as with `nn.Dropout`.
    """

    LEVELS = 1 << _BITS  # the drop probability is threshold / LEVELS

    def __init__(self, p: float, shared: dict):
        super().__init__()
        self.threshold = round(p * self.LEVELS)
        self.p = self.threshold / self.LEVELS  # the probability actually used
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.threshold == 0:
            return x
        if self.shared.get("input") is x and self.shared.get("p") == self.p:
            return self.shared["output"]
        out = x * keep_mask(x, self.threshold) * (1.0 / (1.0 - self.p))
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


def frozen_projections_in_bf16(method: methods.Method, bf16: bool) -> bool:
    """Whether `method`'s training stores its frozen projections in bf16 (`frozen_weights_in`): a method whose
    registry entry says so (`Method.frozen_bf16`: LoRA) trained in bf16. The one place this is decided:
    prepare_model applies it, the planner counts the weights' bytes by it."""
    return bf16 and method.frozen_bf16


def frozen_weights_in(model: torch.nn.Module, dtype: torch.dtype,
                      release: Callable[[torch.Tensor], None] | None = None) -> int:
    """Store the weights (and biases) of the frozen plain `nn.Linear` layers in `dtype`; returns how many.
    `release(old)` is called with each weight it replaced, as soon as it is replaced.

    Left alone: trainable layers (LoRA's A and B, the head), quantized layers (subclasses of nn.Linear such as
    bitsandbytes' Linear4bit), and a weight tied to the input embeddings (a causal LM's head): converting it would
    turn the embeddings, and so the whole residual stream, to `dtype`, which autocast never does."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    converted = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module.weight.requires_grad or id(module.weight) in tied:
            continue
        if module.weight.dtype != dtype:
            old = module.weight.data
            module.weight.data = old.to(dtype)
            if release is not None:
                release(old)
            if module.bias is not None and not module.bias.requires_grad:
                module.bias.data = module.bias.data.to(dtype)
            converted += 1
    return converted


def share_one_dropout(dropouts: list[torch.nn.Module]) -> bool:
    """Sibling LoRA layers' dropouts that give them one input: none at all, or one SharedDropout cache."""
    return (all(isinstance(d, torch.nn.Identity) for d in dropouts)
            or all(isinstance(d, SharedDropout) and d.shared is dropouts[0].shared for d in dropouts))


@contextlib.contextmanager
def instance_forwards(forwards: dict[torch.nn.Module, object]) -> Iterator[int]:
    """Each module runs its given forward within the block (an instance attribute, which nn.Module's __call__ reads
    before the class's), removed on exit; yields how many modules."""
    for module, forward in forwards.items():
        module.forward = forward
    try:
        yield len(forwards)
    finally:
        for module in forwards:
            del module.forward


def _autocast_dtype(device: torch.device | str) -> torch.dtype | None:
    kind = torch.device(device).type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


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
            # in the scores' dtype under autocast: 0 and the dtype's minimum, the same sum with no fp32 copy of the
            # scores (softmax computes in fp32 either way)
            kwargs["dtype"] = _autocast_dtype(kwargs.get("device", "cpu")) or kwargs.get("dtype", torch.float32)
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

