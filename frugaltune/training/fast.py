"""Speed switches for CPU training, each one measured (benchmarks/train_throughput.py, step_anatomy.py) and chosen
per machine.

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
- `frozen_weights_in(model, dtype)`: under bf16 autocast every frozen fp32 weight is cast to bf16 at each use
  (autocast caches casts only of weights that require grad), ~106 M values per step for SmolLM2-135M. LoRA in
  bf16 stores the frozen projections in bf16 once, as GPU LoRA recipes do: the matmuls get the same bf16 operands
  (the same rounding, so the same results), the casts and their temporaries go, and the base weights take half
  the memory. `prepare_model` applies it for LoRA when the plan chose bf16 (by measurement on the machine).
- `fused_siblings(model)`: the projections that read one input (q/k/v; gate/up) each make their own matmul, and
  under bf16 autocast each casts that fp32 input to bf16 again (autocast caches casts of weights that require grad,
  never of activations), and in backward each casts its input gradient back to fp32 before autograd sums them.
  LoRA's A matrices of q/k/v read one (shared-dropout) input too. Inside the block, each such group runs as one
  matmul on the concatenated weights and its siblings take their columns: one cast, one product, one gradient
  cast; the frozen weights become views of the concatenation (no second copy) and are made separate again on
  exit, so nothing saved afterwards shares storage. Same products per output element, so the same results up to
  the matmul's summation order. `LoopConfig.fused_siblings` turns it on; it is off by default because it did not
  win where measured: 0.95x with LoRA's A fused too, 0.99x with the base projections alone, on a 2-core Zen 5 in
  bf16 (`benchmarks/step_anatomy.py --ab fused`, 4 alternated rounds): the casts it saves are ~5 % of a step
  and the split products' strided slices cost about as much downstream.
- `packed_frozen_weights(model)`: a bf16 `torch.matmul` hands oneDNN a plain row-major weight, which it reorders
  into its blocked (VNNI) layout at every call, forward and backward. Inside the block each frozen bf16
  `nn.Linear` keeps its weight pre-reordered once for the forward product and once, transposed, for the input
  gradient (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing uses for inference), and runs
  both through `_linear_pointwise`; the dense weights are dropped meanwhile and rebuilt exactly from the packed
  ones on exit (so memory is the dense bf16 weights' twice, in that layout). Same kernel, same sums: bit-identical
  products. On a 2-core Zen 4: the forward product alone 1.10-1.23x, forward + input gradient 1.0-1.1x (within
  the spread of repeated timings), a whole LoRA step 1.07x at batch 8 and 0.97-1.00x at batch 16
  (`benchmarks/step_anatomy.py --ab packed`), for +170 MB of peak RSS. `LoopConfig.packed_weights`, off.
- `bf16_projection_inputs(model)`: the residual stream stays fp32 under autocast, so every projection that reads
  a norm's output casts it to bf16 itself (q, k, v, and LoRA's A of each, gate, up: up to 8 casts of one tensor
  per norm), and peft casts a bf16 input up to its fp32 A weight before autocast casts it down again (o_proj's
  adapter: 2 copies for nothing). Inside the block each decoder layer's two norms return their output in bf16
  when bf16 autocast is on (one cast, the same values: both round to nearest), and peft's cast is off for vanilla
  LoRA layers, so the projections read bf16 as is. The layout of every product stays the same (unlike
  `fused_siblings`). What changes: the consumers' gradients meet in bf16 before the one cast back to fp32, and the
  shared dropout multiplies in bf16, so results differ from autocast's in rounding, not in math.
  `LoopConfig.bf16_inputs`, off: on a 2-core Zen 4 (`benchmarks/step_anatomy.py --ab inputs`, 4 alternated rounds
  after a warm-up) 1.085x at batch 16 on q/k/v/o, 0.984x at batch 8, 0.989x at batch 16 on all seven linear layers:
  inside the machine's round-to-round spread (±15% that day), so not a measured win.
- `lora_addmm(model)`: peft's vanilla LoRA computes `result + lora_B(lora_A(dropout(x))) * scaling`: B's
  product, then a multiply and an add over the whole [tokens, out_features] output, and in backward a multiply
  of the output gradient again, seven times per decoder layer with all linear layers adapted. Inside the block
  each such layer scales the rank-r activations instead (r = 8 values a token, not out_features) and adds B's
  product to the base output in the product itself (`torch.addmm`): two elementwise passes and their
  temporaries fewer in forward, one in backward. The same sums: scaling is linear, and alpha / r = 2 is a power
  of two (exact in any float); the sum is rounded once (to bf16 under autocast) instead of twice, so outputs
  differ from peft's by rounding (~2e-3 relative in bf16), gradients not at all on bare layers.
  `LoopConfig.lora_addmm`, off: 1.10-1.20x a bare adapted layer at K = 576 but 0.92-1.22x at K = 1536, and 1.029x
  a step in `benchmarks/step_anatomy.py --ab addmm --int8` (4 alternated rounds, 2-core Zen 5): inside the spread
  (DECISIONS, "Issue 12 on the Zen 5, third day").
- `compiled_norms(model)`: a Llama-family RMSNorm is six eager ops in forward (cast, pow, mean, add, rsqrt, two
  multiplies) and about as many in backward, each a pass over the fp32 residual stream, twice per decoder layer:
  ~0.9 ms forward + backward at 16 x 35 x 576 on a 2-core Zen 5, where the same function compiled by inductor
  (dynamic shapes) is one loop each way, ~0.2 ms, to 6e-8 relative. Inside the block every RMSNorm runs its
  class's forward through one `torch.compile`d function; a machine where inductor cannot compile keeps eager
  norms (`norm_status()` says why). `LoopConfig.compiled_norms`, off: a whole step measured 0.963x in
  `benchmarks/step_anatomy.py --ab norms --int8` (4 alternated rounds, 2-core Zen 5; DECISIONS, "Issue 12 on the
  Zen 5, third day").
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterator

import torch

SHORT_ATTENTION = "frugaltune_short"
# Children of one parent module that read the same input tensor (Llama-family names: SmolLM2, Llama, Qwen, Mistral)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
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


def frozen_weights_in(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store the weights (and biases) of the frozen plain `nn.Linear` layers in `dtype`; returns how many.

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
            module.weight.data = module.weight.data.to(dtype)
            if module.bias is not None and not module.bias.requires_grad:
                module.bias.data = module.bias.data.to(dtype)
            converted += 1
    return converted


class _Group:
    """Sibling `nn.Linear`s as one product: the first call on an input computes all of them, the others (the same
    tensor object, as `SharedDropout` matches) read their slice. Frozen weights are concatenated once and the
    siblings' weights become views of it; trainable ones (LoRA's A) are concatenated at each call so that their
    gradients reach each parameter."""

    def __init__(self, linears: list[torch.nn.Linear]):
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        self.frozen = not any(linear.weight.requires_grad for linear in linears)
        self.weight = None
        if self.frozen:
            self.weight = torch.cat([linear.weight.detach() for linear in linears])
            for linear, part in zip(linears, self.weight.split(self.sizes)):
                linear.weight.data = part
        self.input = self.outputs = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.input is x:
            return self.outputs
        weight = self.weight if self.frozen else torch.cat([linear.weight for linear in self.linears])
        bias = None
        if self.linears[0].bias is not None:
            bias = torch.cat([linear.bias for linear in self.linears])
        self.input, self.outputs = x, torch.nn.functional.linear(x, weight, bias).split(self.sizes, dim=-1)
        return self.outputs

    def slice(self, index: int, x: torch.Tensor) -> torch.Tensor:
        return self(x)[index]

    def separate(self) -> None:
        """Give each frozen weight its own storage again and drop the cached tensors."""
        if self.frozen:
            for linear in self.linears:
                linear.weight.data = linear.weight.data.clone()
        self.weight = self.input = self.outputs = None


def _is_frozen_linear(module: torch.nn.Module) -> bool:
    return type(module) is torch.nn.Linear and not module.weight.requires_grad


def _plain_lora(module: torch.nn.Module) -> bool:
    """A peft LoRA layer over a frozen nn.Linear, vanilla LoRA (no DoRA or other variant), not merged."""
    return (isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict) and not getattr(module, "merged", True)
            and not getattr(module, "lora_variant", {}) and _is_frozen_linear(getattr(module, "base_layer", None)))


def share_one_dropout(dropouts: list[torch.nn.Module]) -> bool:
    """Sibling LoRA layers' dropouts that give them one input: none at all, or one SharedDropout cache."""
    return (all(isinstance(d, torch.nn.Identity) for d in dropouts)
            or all(isinstance(d, SharedDropout) and d.shared is dropouts[0].shared for d in dropouts))


def _groups(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """The sibling layers `fused_siblings` can fuse: frozen base projections, and LoRA A matrices whose layers
    share one dropout output (SharedDropout) or have none."""
    found: list[list[torch.nn.Linear]] = []
    for parent in model.modules():
        for names in SIBLINGS:
            children = [parent._modules.get(name) for name in names]
            children = [(name, child) for name, child in zip(names, children) if child is not None]
            if len(children) < 2:
                continue
            if all(_is_frozen_linear(child) for _, child in children):  # no adapter on any: the plain layers
                found.append([child for _, child in children])
                continue
            if not all(_plain_lora(child) for _, child in children):
                continue  # a mix of adapted and plain, full fine-tuning, DoRA, QLoRA: left as they are
            found.append([child.base_layer for _, child in children])
            adapters = set.intersection(*(set(child.lora_A) for _, child in children))
            for adapter in sorted(adapters):
                if share_one_dropout([child.lora_dropout[adapter] for _, child in children]):
                    found.append([child.lora_A[adapter] for _, child in children])
    # one product needs one dtype and device, and a bias on all or none; a layer whose forward is already replaced
    # on the instance (accelerate's offload hooks do that) is left to it
    return [linears for linears in found
            if len({(linear.weight.dtype, linear.weight.device, linear.bias is None) for linear in linears}) == 1
            and not any("forward" in vars(linear) for linear in linears)]


@contextlib.contextmanager
def fused_siblings(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block, each group of sibling projections runs as one matmul (see the module docstring); yields
    how many groups were fused. The layers stay where they are (same modules, same parameter names: a checkpoint
    taken meanwhile is the same): each gets an instance `forward` that returns its slice of the group's product,
    removed on exit."""
    groups = [_Group(linears) for linears in _groups(model)] if enabled else []
    for group in groups:
        for index, linear in enumerate(group.linears):
            linear.forward = functools.partial(group.slice, index)
    try:
        yield len(groups)
    finally:
        for group in groups:
            for linear in group.linears:
                del linear.forward  # the class's forward again
            group.separate()


def _addmm_lora(module: torch.nn.Module) -> bool:
    """A peft LoRA Linear (vanilla: no DoRA or other variant; no bias on B) whose forward lora_addmm can take."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    return (type(module) is LoraLinear and not getattr(module, "lora_variant", {})
            and all(b.bias is None for b in module.lora_B.values()) and "forward" not in vars(module))


def _addmm_lora_forward(module: torch.nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's forward of a vanilla LoRA layer with B's product and the add as one addmm (module docstring). Any
    call that is not a plain training forward (extra arguments, adapters disabled or merged) goes to peft's."""
    if args or kwargs or module.disable_adapters or module.merged:
        return type(module).forward(module, x, *args, **kwargs)
    result = module.base_layer(x)
    result_dtype = result.dtype
    for adapter in module.active_adapters:
        if adapter not in module.lora_A:
            continue
        lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
        h = lora_a(module.lora_dropout[adapter](module._cast_input_dtype(x, lora_a.weight.dtype)))
        h = h * module.scaling[adapter]  # r values a token
        shape = result.shape
        if result.dtype != h.dtype and not torch.is_autocast_enabled(result.device.type):
            result = result + lora_b(h)  # mixed dtypes outside autocast: addmm would refuse them
            continue
        result = torch.addmm(result.reshape(-1, shape[-1]), h.reshape(-1, h.shape[-1]), lora_b.weight.t())
        result = result.view(*shape[:-1], shape[-1])
    return result.to(result_dtype)


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


def lora_addmm(model: torch.nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager[int]:
    """Within the block, vanilla LoRA layers add B's product to the base output in one addmm (module docstring);
    yields how many layers. Each gets an instance `forward`, removed on exit: nothing saved or served differs."""
    layers = [m for m in model.modules() if _addmm_lora(m)] if enabled else []
    return instance_forwards({layer: functools.partial(_addmm_lora_forward, layer) for layer in layers})


_COMPILED_NORMS: dict[type, object] = {}  # norm class -> its forward compiled once per process (or eager)
_NORM_STATUS = {"compiled": None, "why": "not used yet"}


def _is_rms_norm(module: torch.nn.Module) -> bool:
    """LlamaRMSNorm and its copies in other architectures (Qwen2RMSNorm, MistralRMSNorm, ...): a leaf with a weight."""
    return type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)


def _compiled_norm_forward(norm: torch.nn.Module):
    """The class forward of `norm` compiled (dynamic shapes), tried once on a small input without grad so that a
    missing compiler shows here, not in a training step; None when it cannot compile."""
    cls = type(norm)
    if cls not in _COMPILED_NORMS:
        compiled = torch.compile(cls.forward, dynamic=True)
        try:
            with torch.no_grad():  # not random: the loop has seeded the generator its dropout masks come from
                compiled(norm, torch.ones(2, 3, norm.weight.shape[-1], dtype=norm.weight.dtype,
                                          device=norm.weight.device))
            _COMPILED_NORMS[cls] = compiled
            _NORM_STATUS.update(compiled=True, why=f"{cls.__name__} compiled by inductor")
        except Exception as exc:  # noqa: BLE001 - any compiler failure: the class's own eager forward
            _COMPILED_NORMS[cls] = None
            first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
            _NORM_STATUS.update(compiled=False, why=f"eager {cls.__name__} (torch.compile failed: "
                                                    f"{type(exc).__name__}: {first_line})")
    return _COMPILED_NORMS[cls]


def norm_status() -> dict:
    return dict(_NORM_STATUS)


def compiled_norms(model: torch.nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager[int]:
    """Within the block, every RMSNorm of `model` runs its class's forward compiled (module docstring); yields how
    many norms. Each gets an instance `forward`, removed on exit: evaluation and serving see the model as it was."""
    norms = [m for m in model.modules() if _is_rms_norm(m) and "forward" not in vars(m)] if enabled else []
    compiled = {norm: _compiled_norm_forward(norm) for norm in norms}
    return instance_forwards({norm: functools.partial(fn, norm) for norm, fn in compiled.items() if fn is not None})


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


class _PackedLinear(torch.autograd.Function):
    """y = x W^T through oneDNN with W pre-reordered; the input gradient through the pre-reordered W^T. W is
    frozen: no weight gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_weight: torch.Tensor, backward_weight: torch.Tensor) -> torch.Tensor:
        ctx.backward_weight = backward_weight
        return torch.ops.mkldnn._linear_pointwise(x, forward_weight, None, "none", [], "")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        grad_input = torch.ops.mkldnn._linear_pointwise(grad.contiguous(), ctx.backward_weight, None, "none", [], "")
        return grad_input, None, None


def packing_available() -> bool:
    """oneDNN's reordered linear weights: a CPU build of torch with mkldnn and bf16 support in it."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _packed_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # what autocast would do: the bf16 product of the bf16 input (the cast's backward returns fp32 gradients)
    return _PackedLinear.apply(x.to(torch.bfloat16), module._packed_forward, module._packed_backward)


@contextlib.contextmanager
def packed_frozen_weights(model: torch.nn.Module, enabled: bool = True, rows: int = 512) -> Iterator[int]:
    """Within the block, every frozen plain bf16 `nn.Linear` without bias runs on oneDNN-reordered weights (module
    docstring); yields how many. `rows`: the typical rows of a product (batch x length), oneDNN's layout hint."""
    linears = []
    if enabled and packing_available():
        linears = [m for m in model.modules() if _is_frozen_linear(m) and m.bias is None
                   and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"]
    for linear in linears:
        weight = linear.weight.data
        linear._packed_forward = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        linear._packed_backward = torch.ops.mkldnn._reorder_linear_weight(weight.t().contiguous(), rows)
        linear.weight.data = torch.empty(0, dtype=weight.dtype)  # the packed pair replaces it meanwhile
        linear.forward = functools.partial(_packed_forward, linear)
    try:
        yield len(linears)
    finally:
        for linear in linears:
            del linear.forward
            linear.weight.data = linear._packed_forward.to_dense()  # the [out, in] weight, value for value
            del linear._packed_forward, linear._packed_backward


_NORMS_BEFORE_PROJECTIONS = ("input_layernorm", "post_attention_layernorm")  # Llama-family decoder layers


def _output_in_bf16(module: torch.nn.Module, args, output):
    device = output.device.type
    if (output.dtype == torch.float32 and torch.is_autocast_enabled(device)
            and torch.get_autocast_dtype(device) == torch.bfloat16):
        return output.to(torch.bfloat16)
    return None  # autocast off or another precision: the output as it is


@contextlib.contextmanager
def bf16_projection_inputs(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block, under bf16 autocast, the norms before the projections hand them bf16 and peft does not
    cast LoRA's input back up to fp32 (module docstring); yields how many norms. Left alone (0): a model with an
    adapter other than vanilla LoRA (DoRA and other variants compute on their input themselves). Hooks and peft's
    flag are removed on exit."""
    lora = [] if not enabled else [m for m in model.modules()
                                   if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict)]
    if not lora or not all(_plain_lora(m) for m in lora):
        yield 0
        return
    norms = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in _NORMS_BEFORE_PROJECTIONS]
    handles = [norm.register_forward_hook(_output_in_bf16) for norm in norms]
    saved = [getattr(m, "cast_input_dtype_enabled", True) for m in lora]  # peft's default: True
    for module in lora:
        module.cast_input_dtype_enabled = False
    try:
        yield len(norms)
    finally:
        for handle in handles:
            handle.remove()
        for module, value in zip(lora, saved):
            module.cast_input_dtype_enabled = value
