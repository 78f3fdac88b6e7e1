"""int8 products with frozen linear weights (LoRA's base) on CPUs whose int8 dot products outrun bf16 (VNNI).

    from frugaltune import int8
    decision = int8.decide(setting, method, bf16, hidden, intermediate, on_gpu)   # {"on": ..., "why": ...}
    decision = int8.apply(model, decision, method)   # when on: every frozen nn.Linear in int8, in place

Run by the train stage (stages/train.py, `train.int8_products`: auto | true | false); measured by
`python benchmarks/int8_products.py` (GEMMs, numerics against fp32, the loop alternated, and the stages' quality).

Under LoRA the base weights never change, so every product with them (q/k/v/o and the MLP's gate/up/down, in
forward and in the input gradient of backward) can run on int8 operands, as SwitchBack does (Wortsman et al. 2023)
without its weight gradient, which LoRA never needs:
- the weight is quantized once per output row (forward, y = x W^T) and once per input column (backward, g W): one
  copy serving both (g diag(s) quantized per row) cost ~0.02 macro-F1 on two seeds (DECISIONS, "int8 products");
- activations and output gradients are quantized per row (token) at every call, each row with its own scale;
- `torch._int_mm` accumulates in int32, and one rescale gives the autocast dtype (bf16) or the input's dtype.
The quantize and rescale steps are `torch.compile`d once each (dynamic shapes): eager, they are ~9 aten calls
apiece and eat most of the gain. Where inductor cannot compile (no C++ compiler), they run eager and `status()`
says so. q/k/v (and gate/up) receive the same input tensor: `apply` groups such siblings (Int8Siblings), so
that their input is quantized once and multiplied once against their stacked int8 weights (k and v alone have
only 192 output columns in SmolLM2, where `_int_mm` is least efficient), and their output gradients come back
through one compiled rescale-and-sum: the same values as product by product (tests/unit/test_int8.py).

Only the products change: the adapters, the head, the optimizer and the saved adapter are what they were, and
evaluation and serving load the adapter onto the bf16 base as before.
"""

from __future__ import annotations

import copy
import math
import time

import torch

from frugaltune import methods

# int8 must multiply at least this much faster than the products it replaces before `auto` turns it on: the rest of
# a step (quantizing, rescaling, everything that is not a product) does not speed up, so a GEMM ratio shrinks to
# much less per step (docs/DECISIONS.md, "int8 products").
MIN_GEMM_RATIO = 1.5
# `auto` covers the methods where it was measured to keep their quality (`Method.int8_auto` in frugaltune/methods.py:
# DECISIONS, "int8 products": the loop and the method table); QLoRA's NF4 values quantized again to int8 lost
# quality there, so QLoRA needs `true`. `true` applies it to any method with frozen nn.Linear (or bitsandbytes
# Linear4bit) weights.
# Children of one parent module that read the same input tensor (Llama-family names: SmolLM2, Llama, Qwen, Mistral)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and fp32 scales [rows, 1] of a 2-D tensor, symmetric per row."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / 127.0
    return (x.float() / scale).round().to(torch.int8), scale



def rescale(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (acc.float() * row_scale * col_scale).to(dtype)


def rescale_sum(accs: list[torch.Tensor], row_scales: list[torch.Tensor], col_scales: list[torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
    """The input gradient of sibling products that read one input: each product's int32 result rescaled with its
    own scales (each output gradient was quantized per row on its own, as each product's backward does alone),
    summed in fp32, one cast. `_int_mm` stays outside the compiled graph: inside it ran slower."""
    total = None
    for acc, row_scale, col_scale in zip(accs, row_scales, col_scales):
        part = acc.float() * row_scale * col_scale
        total = part if total is None else total + part
    return total.to(dtype)


def rescale_sum_plus(accs: list[torch.Tensor], row_scales: list[torch.Tensor], col_scales: list[torch.Tensor],
                     extra: torch.Tensor, keep: torch.Tensor | None, keep_scale: float,
                     dtype: torch.dtype) -> torch.Tensor:
    """rescale_sum plus one more input gradient (LoRA's, training.fast.fused_int8_lora) through its dropout mask `keep` (None:
    no dropout) and 1 / (1 - p), all in fp32 and one cast: one pass where eager takes four (compiled, rescale_sum
    is traced into the same graph)."""
    total = rescale_sum(accs, row_scales, col_scales, torch.float32)
    extra = extra.float()
    if keep is not None:
        extra = extra * keep * keep_scale
    return (total + extra).to(dtype)


def dropout_cast(x: torch.Tensor, keep: torch.Tensor, keep_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x * mask * 1 / (1 - p) (training.fast.SharedDropout's arithmetic) cast to the products' dtype: one pass."""
    return (x * keep * keep_scale).to(dtype)


_STEPS: dict[str, object] = {}
_STATUS = {"compiled": None, "why": "not used yet"}


def _prepare_steps() -> None:
    """Compile quantize and rescale once per process and run them on a small tensor, so that a missing compiler
    shows here (then both run eager) and not in the middle of a training step."""
    if _STEPS:
        return
    try:
        quantize, scale = torch.compile(quantize_rows, dynamic=True), torch.compile(rescale, dynamic=True)
        summed = torch.compile(rescale_sum, dynamic=True)
        plus, dropped = torch.compile(rescale_sum_plus, dynamic=True), torch.compile(dropout_cast, dynamic=True)
        # The grad mode and the scales' layouts _Int8Product calls them with ([rows, 1], and [1, N] with strides
        # (N, 1)): torch.compile guards on both, so these graphs serve fp32 training as they are.
        with torch.no_grad():
            q, s = quantize(torch.randn(3, 8))
            w, sw = quantize(torch.randn(5, 8))
            scale(torch._int_mm(q, w.t()), s, sw.flatten().unsqueeze(0), torch.float32)
            acc = torch._int_mm(q, w.t())
            summed([acc] * 2, [s] * 2, [torch.rand(1, 5)] * 2, torch.float32)  # the scales' layouts of backward
            keep = torch.ones(3, 5, dtype=torch.bool)
            plus([acc], [s], [torch.rand(1, 5)], torch.ones(3, 5), keep, 2.0, torch.float32)
            dropped(torch.ones(3, 5), keep, 2.0, torch.float32)
        _STEPS.update(quantize=quantize, rescale=scale, rescale_sum=summed, rescale_sum_plus=plus,
                      dropout_cast=dropped)
        _STATUS.update(compiled=True, why="quantize and rescale compiled by inductor")
    except Exception as exc:  # noqa: BLE001 - any compiler failure: the same arithmetic, eager
        torch._dynamo.reset()
        _STEPS.update(quantize=quantize_rows, rescale=rescale, rescale_sum=rescale_sum,
                      rescale_sum_plus=rescale_sum_plus, dropout_cast=dropout_cast)
        first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
        _STATUS.update(compiled=False, why=f"eager quantize and rescale (torch.compile failed: {type(exc).__name__}: "
                                           f"{first_line})")


def status() -> dict:
    return dict(_STATUS)


def steps() -> dict[str, object]:
    """The int8 steps (quantize, rescale, rescale_sum, rescale_sum_plus, dropout_cast) as this process runs them:
    compiled, or eager where inductor failed."""
    _prepare_steps()
    return _STEPS


_SHARED: dict[str, object] = {}  # the input quantized last: q/k/v (and gate/up) are called with one tensor


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype


class _Int8Product(torch.autograd.Function):
    # torch.compile guards on grad mode and autocast: autograd runs forward and backward without grad, and backward
    # outside autocast unless told (custom_bwd: the forward's autocast state), which compiled every step once more
    # per state: 10 graphs on the first two steps of a bf16 run, now 5 (tests/unit/test_int8.py counts them). Autocast
    # changes none of these ops (quantize, rescale, _int_mm are not on its lists), so the results are the same.
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, w_rows, s_rows, w_cols, s_cols):
        lead, k = x.shape[:-1], x.shape[-1]
        # The same tensor object, unchanged since (its version): q's input again, for k and v. _SHARED holds it, so
        # its memory cannot be reused by another tensor while the entry stands.
        if _SHARED.get("input") is x and _SHARED.get("version") == x._version:
            xq, sx = _SHARED["value"]
        else:
            xq, sx = _STEPS["quantize"](x.detach().reshape(-1, k))  # detached: one graph, whatever requires grad
            _SHARED.update(input=x, version=x._version, value=(xq, sx))
        y = _STEPS["rescale"](torch._int_mm(xq, w_rows.t()), sx, s_rows, _output_dtype(x))
        ctx.save_for_backward(w_cols, s_cols)
        ctx.input_dtype = x.dtype
        return y.reshape(*lead, w_rows.shape[0])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        w_cols, s_cols = ctx.saved_tensors
        lead, n = grad.shape[:-1], grad.shape[-1]
        gq, sg = _STEPS["quantize"](grad.reshape(-1, n))
        grad_x = _STEPS["rescale"](torch._int_mm(gq, w_cols), sg, s_cols, ctx.input_dtype)
        return grad_x.reshape(*lead, w_cols.shape[1]), None, None, None, None


class _Int8GroupProduct(torch.autograd.Function):
    """The products of sibling projections that read one input (q/k/v; gate/up) as one `_int_mm` against their
    stacked int8 weights, returned as one output each. Forward: the same per-row scales as each product alone, so
    the same values. Backward: each output gradient keeps its own per-row scale (rescale_sum), so the same
    values too, up to the order of an fp32 sum; autograd no longer sums three input gradients itself."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, group):
        lead, k = x.shape[:-1], x.shape[-1]
        xq, sx = _STEPS["quantize"](x.detach().reshape(-1, k))
        y = _STEPS["rescale"](torch._int_mm(xq, group.w_rows.t()), sx, group.s_rows, _output_dtype(x))
        ctx.group, ctx.input_dtype = group, x.dtype
        return tuple(part.reshape(*lead, part.shape[-1]) for part in y.split(group.sizes, dim=-1))

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, *grads):
        members = ctx.group.members
        lead = grads[0].shape[:-1]
        quantized = [_STEPS["quantize"](g.reshape(-1, g.shape[-1])) for g in grads]
        accs = [torch._int_mm(gq, m.w_cols) for (gq, _), m in zip(quantized, members)]
        grad_x = _STEPS["rescale_sum"](accs, [sg for _, sg in quantized], [m.s_cols for m in members],
                                       ctx.input_dtype)
        return grad_x.reshape(*lead, grad_x.shape[-1]), None


def shared_output(pending: dict, index: int, x: torch.Tensor, compute) -> torch.Tensor:
    """Member `index`'s output of a computation that serves every member of a group reading one input: the first
    member called runs `compute()` (one output per member) and `pending` keeps the others' for their own calls with
    the same tensor (identity and version). A member called with another input computes again, so a model that
    does not feed them one tensor stays correct, only slower. Used by Int8Siblings and training.fast.fused_int8_lora."""
    if pending.get("input") is x and pending.get("version") == x._version and index in pending["outputs"]:
        out = pending["outputs"].pop(index)
        if not pending["outputs"]:
            pending.clear()  # every member served: hold no activation past its layer
        return out
    outs = compute()
    pending.clear()
    if len(outs) > 1:
        pending.update(input=x, version=x._version, outputs={i: o for i, o in enumerate(outs) if i != index})
    return outs[index]


class Int8Siblings:
    """Int8FrozenLinear siblings that read one input, computed together (see _Int8GroupProduct): whichever member
    is called first computes every member's output and keeps the others' for their own calls with the same tensor
    (identity and version, as _SHARED). A member called with another input computes the group again, so a model
    that does not feed them one tensor stays correct, only slower. The members' int8 weights become views of the
    stacked ones: no second copy."""

    def __init__(self, members: list["Int8FrozenLinear"]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.w_rows = torch.cat([m.w_rows for m in members])
        self.s_rows = torch.cat([m.s_rows for m in members], dim=1)
        start = 0
        for index, member in enumerate(members):
            member.w_rows = self.w_rows[start:start + member.out_features]
            start += member.out_features
            member.group, member.group_index = self, index
        self.pending: dict = {}

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        return shared_output(self.pending, index, x, lambda: _Int8GroupProduct.apply(x, self))


class Int8FrozenLinear(torch.nn.Module):
    """A frozen nn.Linear whose products run in int8.

    `keep_weight=False` puts a meta tensor of the weight's shape and dtype in place of the weight (peft's LoRA reads
    no more than that in its forward), so the int8 copies replace the bf16 weight in memory instead of adding to it;
    DoRA reads the weight's norm and keeps it. Anything that would compute with the meta weight fails loudly."""

    def __init__(self, linear: torch.nn.Linear, keep_weight: bool = True):
        super().__init__()
        _prepare_steps()  # once per process: a module built on its own computes too
        dense = _dense_weight(linear)
        w = dense.float()
        rows = w.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127.0  # [N, 1]
        cols = w.abs().amax(0, keepdim=True).clamp_min(1e-12) / 127.0  # [1, K]
        self.register_buffer("w_rows", (w / rows).round().to(torch.int8), persistent=False)
        # [1, N] with strides (N, 1), as s_cols has: rows.t().contiguous() would keep (1, 1) (a size-1 dimension's
        # stride does not count for contiguity), and torch.compile guards on strides: one more graph.
        self.register_buffer("s_rows", rows.flatten().unsqueeze(0), persistent=False)
        self.register_buffer("w_cols", (w / cols).round().to(torch.int8), persistent=False)
        self.register_buffer("s_cols", cols, persistent=False)
        # A 4-bit weight is stored packed (two values a byte, [out * in / 2, 1]); its placeholder takes the dense
        # shape and dtype, so that counts of the model's parameters stay what they were.
        self.weight = linear.weight if keep_weight else torch.nn.Parameter(
            torch.empty(dense.shape, dtype=dense.dtype, device="meta"), requires_grad=False)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group: Int8Siblings | None = None  # set by group_siblings
        self.group_index = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            y = self.group.output(self.group_index, x)
        else:
            y = _Int8Product.apply(x, self.w_rows, self.s_rows, self.w_cols, self.s_cols)
        return y if self.bias is None else y + self.bias


def _is_4bit(module: torch.nn.Module) -> bool:
    """A bitsandbytes Linear4bit (QLoRA's NF4 base), recognised without importing bitsandbytes where it is absent."""
    return type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes")


def _dense_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The weight as a dense [out, in] tensor: an nn.Linear's own, or a Linear4bit's NF4 blocks dequantized, so
    QLoRA's int8 copies hold the 4-bit values (to int8's per-row precision), not the original bf16 weights."""
    if _is_4bit(linear):
        import bitsandbytes.functional as bnbf

        data, state = linear.weight.data, linear.weight.quant_state
        if getattr(state, "packing_format_for_cpu", False):
            # A Linear4bit that ran once in eval without grad repacked itself for bitsandbytes' AVX512-BF16 kernel;
            # dequantize_4bit reads the standard layout only (read wrongly, the weights come out garbled). bitsandbytes undoes its
            # own packing this way when it saves. The inverse rewrites the state it is given, so it gets a copy and
            # the module stays consistent.
            data, state = bnbf._convert_weight_packed_for_cpu_inverse(data, copy.deepcopy(state))
        return bnbf.dequantize_4bit(data, state).detach()
    return linear.weight.detach()


def to_int8(model: torch.nn.Module, keep_weights: bool = True) -> int:
    """Every frozen nn.Linear (or QLoRA's bitsandbytes Linear4bit) of `model` replaced in place by an
    Int8FrozenLinear; returns how many. `keep_weights=False` (LoRA and QLoRA, not DoRA) drops their weights: see
    Int8FrozenLinear."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if (type(child) is torch.nn.Linear or _is_4bit(child)) and not child.weight.requires_grad]
    count = len(swaps)
    while swaps:  # each replaced layer let go of at once: its weight is freed before the next one's copies are made
        parent, name, child = swaps.pop()
        setattr(parent, name, Int8FrozenLinear(child, keep_weight=keep_weights))
        del child
    return count


def group_siblings(model: torch.nn.Module) -> int:
    """Int8FrozenLinear siblings that read one input (q/k/v, gate/up: SIBLINGS), bare or as the base layer of an
    adapter, grouped into one product each (Int8Siblings); returns how many groups."""
    def int8_of(module):
        module = getattr(module, "base_layer", module)  # peft's LoRA/DoRA layer: the frozen product under it
        return module if isinstance(module, Int8FrozenLinear) and module.group is None else None

    groups = 0
    for parent in model.modules():
        for names in SIBLINGS:
            members = [int8_of(parent._modules.get(name)) for name in names]
            members = [m for m in members if m is not None]
            if len(members) >= 2 and len({m.in_features for m in members}) == 1:
                Int8Siblings(members)
                groups += 1
    return groups


def apply(model: torch.nn.Module, decision: dict, method: methods.Method, grouped: bool = True) -> dict:
    """`decision` (from `decide`) carried out on `model`: when on, its frozen Linears in int8 (DoRA keeps their
    weights, it reads their norm) and siblings grouped unless `grouped` is False; returns the decision with how
    many modules changed, how many sibling groups and whether it compiled."""
    if not decision["on"]:
        return decision
    modules = to_int8(model, keep_weights=method.dora)
    return {**decision, "modules": modules, "groups": group_siblings(model) if grouped else 0,
            "compiled": status()["compiled"]}


def _seconds(fn, repeats: int) -> float:
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) / repeats


def gemm_ratio(hidden: int, intermediate: int, bf16: bool, rows: int = 512, rounds: int = 7,
               repeats: int = 3) -> float:
    """How many times faster int8 products run the model's two MLP shapes than the precision's own (bf16 or fp32),
    on this machine's threads (~1-2 s on a 2-core CPU). The two are timed alternately, `rounds` times each, and
    each keeps its fastest: on a shared machine a busy moment only ever adds time, so the fastest of several is
    what the machine can do, and alternating exposes both to the same moments (docs/DECISIONS.md: one back-to-back
    pair per shape, the best ratio kept, once turned int8 products on where they were slower)."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    pairs = []
    for k, n in ((hidden, intermediate), (intermediate, hidden)):
        a, b = torch.randn(rows, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        ai = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
        bi = torch.randint(-127, 128, (n, k), dtype=torch.int8).t()
        pairs.append((lambda a=a, b=b: a @ b, lambda ai=ai, bi=bi: torch._int_mm(ai, bi)))
    for products in pairs:  # warm-up: oneDNN builds each shape's kernels on first use
        for product in products:
            product()
    best = [[math.inf, math.inf] for _ in pairs]
    for _ in range(rounds):
        for fastest, products in zip(best, pairs):
            for side, product in enumerate(products):
                fastest[side] = min(fastest[side], _seconds(product, repeats))
    return sum(plain for plain, _ in best) / sum(quantized for _, quantized in best)


def decide(setting: str | bool, method: str, bf16: bool, hidden: int, intermediate: int, on_gpu: bool,
           measured: dict | None = None) -> dict:
    """Whether to train with int8 products: `true`/`false` as set; `auto` on a CPU, for the methods whose registry
    entry allows it (`Method.int8_auto`), under bf16, where int8 multiplies at least MIN_GEMM_RATIO x faster than
    bf16, measured here and now. Not under fp32: their quality was measured against bf16 training, and against fp32
    training they lost it (docs/DECISIONS.md, "The federation on this CPU"). Called by the plan alone
    (planner.machine.decide_machine); `measured`, when given, keeps the timing for the next call."""
    if setting is False or setting == "false":
        return {"on": False, "why": "train.int8_products is false"}
    if on_gpu:
        return {"on": False, "why": "a GPU trains with its own bf16 tensor cores (int8 products are a CPU path)"}
    if not hasattr(torch, "_int_mm"):
        return {"on": False, "why": "this torch has no torch._int_mm"}
    if setting is True or setting == "true":
        return {"on": True, "why": "train.int8_products is true"}
    if not methods.get(method).int8_auto:
        covered = ", ".join(name for name, m in methods.METHODS.items() if m.int8_auto)
        return {"on": False, "why": f"auto covers {covered} (measured there), not {method}"}
    if not bf16:
        return {"on": False, "why": "auto covers bf16 training (measured there); in fp32 training int8 products "
                                    "lost quality (docs/DECISIONS.md)"}
    if measured is None or "ratio" not in measured:
        measured = {} if measured is None else measured
        measured["ratio"] = gemm_ratio(hidden, intermediate, bf16)
    ratio = measured["ratio"]
    precision = "bf16" if bf16 else "fp32"
    return {"on": ratio >= MIN_GEMM_RATIO, "gemm_ratio": round(ratio, 2),
            "why": f"int8 products measured {ratio:.2f}x {precision}'s here "
                   f"({'>=' if ratio >= MIN_GEMM_RATIO else '<'} {MIN_GEMM_RATIO})"}
