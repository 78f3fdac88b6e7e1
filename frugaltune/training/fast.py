"""Speed switches for CPU training, each one measured (benchmarks/train_throughput.py, step_anatomy.py) and chosen
per machine.

Library code: `prepare_model` applies `fast_lora_dropout`; the training loop applies `short_sequence_attention`
with the crossover length the kernels stage measured on this machine (plan `run.eager_attention_max_len`), and
enters `fused_int8_lora(model, cfg.speed.fused_int8_lora)` around its steps (tests/unit/test_fast_training.py,
tests/unit/test_int8_lora.py, `benchmarks/step_anatomy.py --ab int8lora`).

- `short_sequence_attention(model, max_len)`: transformers' "sdpa" runs PyTorch's CPU flash-attention kernel,
  whose backward pass on short sequences costs several times the plain matmul-softmax-matmul ("eager") path's
  (docs/DECISIONS.md has the figures). Flash attention wins back its tiling only on long sequences, at a crossover
  the kernels stage measures on each machine. Length-grouped batches have one padded length each, so the
  attention and its mask are chosen per batch: eager up to `max_len`, SDPA above. Same math, same results up to
  rounding. Under autocast the eager path's additive mask comes in the autocast dtype, as the scores do (0 and the
  dtype's minimum: the same sums, bit for bit, without an fp32 copy of every layer's scores). The eager path's
  softmax backward is computed as `p * (g - sum(g * p))` with one row sum per row: aten's CPU kernel sums a row
  whose length is not a multiple of the vector width in an order that depends on how the rows are split among the
  threads, so a run that dropped a thread on a busy machine (training.sharing) or ran on another core count
  trained other weights from the same seed. With it, a run trains the same weights on any thread count
  (tests/unit/test_fast_training.py; SDPA's backward and the rest of the step were already thread-invariant).
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
- `fused_int8_lora(model)`: LoRA over int8 frozen products (frugaltune/int8.py) as one autograd node per sibling
  group. With int8 products, what is left of a LoRA step beside its products is small ops: peft's vanilla LoRA
  layer computes `base(x) + lora_B(lora_A(dropout(x))) * scaling` as five modules; under bf16 autocast each of q,
  k and v casts the (shared) dropout output and both of its fp32 adapter matrices to bf16 again, multiplies and
  adds over its whole [tokens, out] output, and autograd records about a dozen nodes per layer whose backward
  passes cast, multiply and sum input gradients one by one. Here the members of a sibling group (q/k/v, gate/up;
  or one layer alone: o_proj, down_proj) run as one `torch.autograd.Function`:

    forward:  one int8 product for every member's base output (as int8.Int8Siblings), the dropout of x and its
              cast in one compiled pass (int8.dropout_cast), one product of the dropped x with the members' A
              matrices stacked ([tokens, members x r]), and per member B's product added into its base output in
              one `addmm_` (scaled on the rank-r side);
    backward: each member's rank-r gradient, A's gradients in one product, B's in one each, the LoRA input
              gradient in one product through the stacked A; then the int8 input gradient of every member and
              LoRA's, through the dropout mask, summed in fp32 and cast in one compiled pass
              (int8.rescale_sum_plus).

  The math is peft's: the same dropout mask (SharedDropout's random draws, in the same order), the same bf16
  operands. What differs is rounding: B's product is added to the base output before one rounding to bf16
  instead of two, and the input gradient is summed in fp32 before one cast instead of each part rounded to bf16
  first, so results differ from peft's by bf16 rounding, not in math. Anything but a plain training forward of a
  vanilla LoRA layer (extra arguments, adapters disabled or merged, several active adapters, DoRA, a bias on B or
  a trained bias on the base) goes to peft's own forward. A frozen base bias (Qwen2's q/k/v) is added to the base
  output in the node.
Switches measured not to win by default (fused siblings, packed frozen weights, bf16 projection inputs, LoRA in
addmm, compiled norms) were deleted: their measurements are in docs/DECISIONS.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator

import torch

from frugaltune import int8, methods

SHORT_ATTENTION = "frugaltune_short"
_BITS = 15  # random bits per element used: the low 15 of each 16-bit lane (the top lane of an int64 has only 15)


def keep_mask(x: torch.Tensor, threshold: int) -> torch.Tensor:
    """SharedDropout's mask for `x` (True: kept), dropping with probability threshold / SharedDropout.LEVELS: 16
    random bits per element from 64-bit words, the low 15 used. fused_int8_lora draws its masks here too, so
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


class _RowSoftmax(torch.autograd.Function):
    """`torch.softmax(scores, -1, dtype=torch.float32)`, as transformers' eager attention computes it, with a
    backward whose result does not depend on the thread count (module docstring)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        ctx.save_for_backward(probs)
        ctx.input_dtype = scores.dtype
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (probs,) = ctx.saved_tensors
        weighted = grad * probs
        return (weighted - probs * weighted.sum(-1, keepdim=True)).to(ctx.input_dtype)


def eager_attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0, **kwargs):
    """transformers' eager attention (`modeling_llama.eager_attention_forward`, op for op, so the same forward bit
    for bit), its softmax `_RowSoftmax`."""
    from transformers.models.llama.modeling_llama import repeat_kv

    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = _RowSoftmax.apply(weights).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value_states).transpose(1, 2).contiguous(), weights


def _register(max_len: int) -> str:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    def attention(module, query, key, value, attention_mask, **kwargs):
        if key.shape[2] <= max_len:
            return eager_attention(module, query, key, value, attention_mask, **kwargs)
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


class _Base:
    """The int8 products of a group's members: Int8Siblings' stacked ones, or one Int8FrozenLinear's own."""

    def __init__(self, linear: int8.Int8FrozenLinear):
        group = linear.group
        self.members = group.members if group is not None else [linear]
        self.sizes = [m.out_features for m in self.members]
        self.w_rows = group.w_rows if group is not None else linear.w_rows
        self.s_rows = group.s_rows if group is not None else linear.s_rows
        # the frozen biases (Qwen2's q/k/v), stacked as the members' outputs are, zeros for a member without one;
        # None where no member has one
        biases = [m.bias for m in self.members]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(m.out_features) for b, m in zip(biases, self.members)])


class _Int8LoraProduct(torch.autograd.Function):
    """Every member's `base(x) + scaling * B A dropout(x)`, one output each (module docstring)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, fused, keep, *weights):
        n = len(fused.layers)
        a_weights, b_weights = weights[:n], weights[n:]
        base, scaling = fused.base, fused.scaling
        lead, k = x.shape[:-1], x.shape[-1]
        flat = x.detach().reshape(-1, k)
        dtype = int8._output_dtype(x)
        steps = int8.steps()
        xq, sx = steps["quantize"](flat)
        y = steps["rescale"](torch._int_mm(xq, base.w_rows.t()), sx, base.s_rows, dtype)
        if base.bias is not None:
            y += base.bias.to(dtype)
        keep_scale = 1.0
        if keep is not None:  # SharedDropout's arithmetic: x * mask * 1 / (1 - p), in x's dtype, then one cast
            keep = keep.reshape(-1, k)
            keep_scale = 1.0 / (1.0 - fused.dropout.p)
            dropped = steps["dropout_cast"](flat, keep, keep_scale, dtype)
        else:
            dropped = flat.to(dtype)
        a = torch.cat(a_weights).to(dtype)  # [members x r, k]
        h = (dropped @ a.t()) * scaling  # the rank-r activations, scaled (r values a token, not out_features)
        b = [w.to(dtype) for w in b_weights]
        ranks = [w.shape[0] for w in a_weights]
        parts = zip(y.split(base.sizes, dim=-1), h.split(ranks, dim=-1), b)
        # B's product added into y's own columns: y is this node's alone, and addmm's out-of-place form copied each
        # member's strided slice of it first
        outs = [part.addmm_(hs, bw.t()) for part, hs, bw in parts]
        ctx.save_for_backward(dropped, keep, h, a, *b)
        ctx.fused, ctx.ranks, ctx.keep_scale, ctx.input_dtype = fused, ranks, keep_scale, x.dtype
        ctx.weight_dtypes = [w.dtype for w in weights]
        return tuple(out.reshape(*lead, out.shape[-1]) for out in outs)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, *grads):
        dropped, keep, h, a, *b = ctx.saved_tensors
        fused, ranks, scaling = ctx.fused, ctx.ranks, ctx.fused.scaling
        members = fused.base.members
        lead = grads[0].shape[:-1]
        steps = int8.steps()
        flats = [g.reshape(-1, g.shape[-1]).to(h.dtype) for g in grads]
        quantized = [steps["quantize"](g) for g in flats]
        accs = [torch._int_mm(gq, m.w_cols) for (gq, _), m in zip(quantized, members)]
        # d loss / d h (scaled activations): each member's output gradient through its B, then the scaling
        grad_h = torch.cat([g @ bw for g, bw in zip(flats, b)], dim=-1) * scaling
        grad_b = [g.t() @ hs for g, hs in zip(flats, h.split(ranks, -1))]
        grad_a = (grad_h.t() @ dropped).split(ranks)
        grad_dropped = grad_h @ a
        # the int8 input gradients and LoRA's (through the dropout mask) summed in fp32, one cast, one pass
        grad_x = steps["rescale_sum_plus"](accs, [sg for _, sg in quantized], [m.s_cols for m in members],
                                           grad_dropped, keep, ctx.keep_scale, ctx.input_dtype)
        grad_x = grad_x.reshape(*lead, grad_x.shape[-1])
        weight_grads = [g.to(dt) for g, dt in zip([*grad_a, *grad_b], ctx.weight_dtypes)]
        return (grad_x, None, None, *weight_grads)


class _Fused:
    """The LoRA layers over one int8 product (a sibling group, or one layer): whichever member is called first
    computes every member's output, the others take theirs (int8.shared_output)."""

    def __init__(self, layers: list[torch.nn.Module], adapter: str):
        self.layers, self.adapter = layers, adapter
        self.base = _Base(layers[0].base_layer)
        self.scaling = layers[0].scaling[adapter]
        self.dropout = layers[0].lora_dropout[adapter]
        self.pending: dict = {}

    def keep(self, x: torch.Tensor) -> torch.Tensor | None:
        """The dropout mask of `x`, None without dropout: one per input tensor in the SharedDropout's cache, which
        q, k and v (and o, of another input) share as peft's layers do, so that lone layers reading one tensor (an
        ungrouped q/k/v) drop the same elements, as SharedDropout's one output for them would."""
        dropout = self.dropout
        if not isinstance(dropout, SharedDropout) or not dropout.training or dropout.threshold == 0:
            return None
        cache = dropout.shared
        if (cache.get("mask_input") is x and cache.get("mask_version") == x._version
                and cache.get("mask_p") == dropout.p):
            return cache["mask"]
        mask = keep_mask(x, dropout.threshold)
        cache.update(mask_input=x, mask_version=x._version, mask_p=dropout.p, mask=mask)
        return mask

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        return int8.shared_output(self.pending, index, x, lambda: self.compute(x))

    def compute(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights = [layer.lora_A[self.adapter].weight for layer in self.layers]
        weights += [layer.lora_B[self.adapter].weight for layer in self.layers]
        return _Int8LoraProduct.apply(x, self, self.keep(x), *weights)


def _eligible(layer: torch.nn.Module) -> str | None:
    """The adapter of a vanilla peft LoRA Linear over an Int8FrozenLinear that this module can take, else None."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    if type(layer) is not LoraLinear or getattr(layer, "lora_variant", {}) or "forward" in vars(layer):
        return None
    base = layer.base_layer
    if not isinstance(base, int8.Int8FrozenLinear) or (base.bias is not None and base.bias.requires_grad):
        return None
    if len(layer.lora_A) != 1:
        return None
    adapter = next(iter(layer.lora_A))
    dropout = layer.lora_dropout[adapter]
    if layer.lora_B[adapter].bias is not None or layer.lora_A[adapter].bias is not None:
        return None
    if not isinstance(dropout, (SharedDropout, torch.nn.Identity)):
        return None
    return adapter


def _fused_groups(model: torch.nn.Module) -> list[_Fused]:
    """One _Fused per int8 product that LoRA layers sit on: all members of an Int8Siblings group eligible (the same
    adapter, scaling and shared dropout), or one eligible layer alone."""
    by_base: dict[int, list[tuple[int, torch.nn.Module, str]]] = {}
    for layer in model.modules():
        adapter = _eligible(layer)
        if adapter is None:
            continue
        base = layer.base_layer
        key = id(base.group) if base.group is not None else id(base)
        by_base.setdefault(key, []).append((base.group_index, layer, adapter))
    fused = []
    for entries in by_base.values():
        entries.sort(key=lambda entry: entry[0])
        layers = [layer for _, layer, _ in entries]
        base = layers[0].base_layer
        expected = len(base.group.members) if base.group is not None else 1
        adapters = {adapter for _, _, adapter in entries}
        same_dropout = share_one_dropout([layer.lora_dropout[entries[0][2]] for layer in layers])
        if (len(layers) != expected or len(adapters) != 1 or not same_dropout
                or len({layer.scaling[entries[0][2]] for layer in layers}) != 1):
            continue  # a group with a plain member, two adapters or two dropouts: peft's forward, as it was
        fused.append(_Fused(layers, entries[0][2]))
    return fused


def _forward(fused: _Fused, index: int, layer: torch.nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if (args or kwargs or layer.disable_adapters or layer.merged or list(layer.active_adapters) != [fused.adapter]
            or not torch.is_grad_enabled()):
        return type(layer).forward(layer, x, *args, **kwargs)
    return fused.output(index, x)


@contextlib.contextmanager
def fused_int8_lora(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block, LoRA layers over int8 products run as one autograd node per product (module docstring);
    yields how many nodes (groups and lone layers). Each layer gets an instance `forward`, removed on exit: what is
    saved, evaluated or served afterwards is peft's model as it was."""
    groups = _fused_groups(model) if enabled else []
    with instance_forwards({layer: functools.partial(_forward, group, index, layer)
                            for group in groups for index, layer in enumerate(group.layers)}):
        yield len(groups)
