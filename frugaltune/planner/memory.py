"""The planner's memory and time model: a model's exact shapes, the bytes a training run holds, the run's batches.

Library code, no entry point (the planner's rooms: docs/ARCHITECTURE.md). The plan (frugaltune.planner.assembly)
prices every method with it; the calibration (frugaltune.planner.calibration) replaces its constants.

Memory model (bytes; per device: CPU RAM, or each GPU's memory):


    peak = runtime + weights + gradients + optimizer states + activations(micro-batch x sequence length) + logits

- Parameter shapes come from the model's config built on the `meta` device (no weights are read), with the
  method applied (peft on meta), so trainable counts are exact.
- weights: 4 bytes/param (fp32 master weights; bf16 autocast keeps them fp32). QLoRA: the decoder's linear weights
  in NF4, 0.5 byte/param plus the quantization constants: one absmax per 64-weight block, stored as 1 byte with
  double quantization (+ one fp32 per 256 blocks), else 4 bytes. Embeddings, norms and the head stay fp32.
- gradients: 4 bytes per trainable param; AdamW: 8 bytes per trainable param. A part alone in its optimizer step
  (no accumulation) starts backward with no gradients and frees each layer's saved tensors as it allocates that
  layer's weight gradients: its peak holds the larger of gradients and activations + logits, not their sum (full
  fine-tuning's 4 bytes per weight; an adapter's gradients are small either way), where the allocator gives the
  freed pages to the gradients; the calibration measures whether it does (`Constants.gradients_overlap`).
- activations, saved for backward, per token per decoder layer (llama-style block, RMSNorm + GQA + gated MLP):
  `16 h + 5 i` values (h hidden, i intermediate), plus `h + r` per LoRA-adapted module (dropout output + A
  output), plus `h` per DoRA module; 2 bytes each under bf16 autocast, 4 in fp32. Gradient checkpointing keeps
  one `h` per layer and recomputes one layer at a time. The peak comes from the largest micro-batch of the run
  (its sequences x its longest length), which is known before training: the batch order is fixed by the seed.
- runtime: the interpreter, torch and transformers (0.55 GiB on CPU before calibration; + 0.5 GiB CUDA context
  on a GPU).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from frugaltune import methods
from frugaltune.methods import MethodKnobs

GiB = 2**30
MiB = 2**20
CPU_RUNTIME_BYTES = int(0.55 * GiB)  # python + torch + transformers + peft imported, before calibration
CUDA_CONTEXT_BYTES = int(0.5 * GiB)
NF4_BLOCK = 64


def training_flops_per_token(shape: ModelShape, method: str, mean_length: float) -> float:
    """A padded token's training FLOPs: its matmuls (the method's `flops_factor` x the matmul parameters) and its
    attention over the batch's `mean_length` positions (scores and weighted sum, forward and, when it trains, the
    two backward products)."""
    spec = methods.get(method)
    attention = 4 * shape.layers * shape.hidden * mean_length * (3 if spec.trained else 1)
    return spec.flops_factor * shape.matmul_params + attention


# ---------------------------------------------------------------------------------------------- model shapes
@dataclass(frozen=True)
class ModelShape:
    total_params: int
    trainable_params: int
    quantizable_params: int  # decoder linear weights (what bitsandbytes turns into NF4 for QLoRA)
    matmul_params: int  # parameters that take part in a matmul per token (embeddings and tied heads excluded)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    num_labels: int
    adapted_modules_per_layer: int
    adapter_rank: int
    dora: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _config(model_dir_or_config, num_labels: int):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_dir_or_config, PretrainedConfig):
        config = model_dir_or_config
        config.num_labels = num_labels
        return config
    return AutoConfig.from_pretrained(str(model_dir_or_config), num_labels=num_labels)


def model_shape(model_dir_or_config, num_labels: int, method: str, knobs: MethodKnobs = MethodKnobs(),
                task: str = "classification") -> ModelShape:
    """Exact parameter counts for `method`, from the config alone: the model is built on the meta device.

    `task` causal_lm: the model with its LM head, whose logits span the vocabulary (`num_labels` is ignored).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from frugaltune.training.methods import apply_lora, freeze_for, is_head

    spec = methods.get(method)
    config = _config(model_dir_or_config, num_labels)
    if task == "causal_lm":
        num_labels = config.vocab_size  # every position scores the whole vocabulary
    with torch.device("meta"):
        model = (AutoModelForCausalLM if task == "causal_lm" else AutoModelForSequenceClassification).from_config(config)
        linear = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        quantizable = sum(m.weight.numel() for n, m in linear if not is_head(n) and not n.startswith("lm_head"))
        matmul = sum(m.weight.numel() for n, m in linear)
        total = sum(p.numel() for p in model.parameters())
        adapted = sum(1 for n, _ in linear if n.rsplit(".", 1)[-1] in knobs.target_modules)
        if spec.adapters:
            model = apply_lora(model, knobs.r, 2 * knobs.r, 0.0, list(knobs.target_modules), use_dora=spec.dora,
                               task=task, last_layers=knobs.last_layers)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
        else:
            trainable = sum(p.numel() for p in freeze_for(spec, model).parameters() if p.requires_grad)
    layers = config.num_hidden_layers
    return ModelShape(
        total_params=total, trainable_params=trainable, quantizable_params=quantizable, matmul_params=matmul,
        layers=layers, hidden=config.hidden_size,
        intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size),
        heads=config.num_attention_heads, kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
        num_labels=num_labels, adapted_modules_per_layer=adapted // max(layers, 1) if spec.adapters else 0,
        adapter_rank=knobs.r if spec.adapters else 0, dora=spec.dora,
    )


# ---------------------------------------------------------------------------------------------- memory model
@dataclass(frozen=True)
class Constants:
    """The memory and time model's machine-specific constants; `calibrate` replaces the defaults."""

    runtime_bytes: int = CPU_RUNTIME_BYTES
    activation_scale: float = 1.0
    step_overhead_s: float | None = None  # per optimizer step (optimizer, clipping, Python)
    seconds_per_token: float | None = None  # per padded token through forward + backward
    # once per run: the first step at the peak shape faults in the memory the run keeps (and picks kernels)
    startup_s: float = 0.0
    # the kernels stage's measured FLOP/s through a decoder layer (machine.layer_flops_per_s): the analytic ETA, a
    # run's training FLOPs at that speed, where there is no calibration
    flops_per_s: float | None = None
    calibrated_method: str | None = None
    # Each other method's step time relative to the calibrated one's, timed on the same micro-batch in the same
    # process (calibrate's `others`); a method missing here is scaled by its training FLOPs per token instead.
    method_cost: dict[str, float] = field(default_factory=dict)
    # why a method the calibration was asked to time has no cost: its budget was spent, or it could not be built
    not_timed: dict[str, str] = field(default_factory=dict)
    # Each other method's activations and logits relative to the calibrated method's: the bytes autograd saved for
    # backward in one step on the same rows, in the same process (calibrate's `others`). Which tensors a method
    # saves depends on which weights it trains (a frozen linear layer keeps no input for a weight gradient; a
    # LoRA dropout keeps a copy), which the analytic per-token constant does not know.
    activation_ratio: dict[str, float] = field(default_factory=dict)
    # Each other method's weight casts saved for backward beyond the calibrated method's, in bytes: under bf16
    # autocast a trained or frozen linear layer whose input needs a gradient keeps its weight's bf16 copy, a fixed
    # cost (not per token) that lora's fused layers do not pay (_SavedBytes.casts)
    extra_cast_bytes: dict[str, int] = field(default_factory=dict)
    # the calibrated method's analytic activations + logits per token, and its checkpointing: what a ratio scales
    calibrated_per_token: float = 0.0
    calibrated_checkpointing: bool = False
    # whether backward's gradients take the pages its freed activations leave, in a part alone in its step
    # (memory_estimate's gradients_overlap): the calibration reads it from its peaks (_fit_peaks)
    gradients_overlap: bool = True
    source: str = "analytic defaults (not calibrated)"

    def measured_ratio(self, method: str, gradient_checkpointing: bool) -> float | None:
        """`method`'s measured activation ratio where it applies: a trained method other than the calibrated one,
        planned with the calibration's checkpointing (None: its analytic bytes at the calibrated scale)."""
        if (method == self.calibrated_method or not methods.get(method).trained or self.calibrated_per_token <= 0
                or gradient_checkpointing != self.calibrated_checkpointing):
            return None
        return self.activation_ratio.get(method)


def weight_bytes(shape: ModelShape, method: str, knobs: MethodKnobs = MethodKnobs(), bf16: bool = False) -> int:
    """The model's weights as its training holds them: fp32; QLoRA's decoder projections in 4 bit; LoRA's frozen
    decoder projections in bf16 when it trains in bf16 (frugaltune.training.fast.frozen_weights_in)."""
    from frugaltune.training.fast import frozen_projections_in_bf16

    spec = methods.get(method)
    if frozen_projections_in_bf16(spec, bf16):
        return 2 * shape.quantizable_params + 4 * (shape.total_params - shape.quantizable_params)
    if not spec.quantized_base:
        return 4 * shape.total_params
    blocks = shape.quantizable_params / NF4_BLOCK
    constants = blocks * 1 + (blocks / 256) * 4 if knobs.double_quant else blocks * 4
    rest = shape.total_params - shape.quantizable_params
    return int(shape.quantizable_params * 0.5 + constants + 4 * rest)


def activation_bytes_per_token(shape: ModelShape, bf16: bool, gradient_checkpointing: bool) -> float:
    """Bytes saved for backward per token of a micro-batch (the analytic constant, before calibration)."""
    per_value = 2 if bf16 else 4
    h, i = shape.hidden, shape.intermediate
    per_layer = 16 * h + 5 * i + shape.adapted_modules_per_layer * (h + shape.adapter_rank + (h if shape.dora else 0))
    if gradient_checkpointing:  # layer inputs kept, one layer recomputed at a time during backward
        values = shape.layers * h + per_layer
    else:
        values = shape.layers * per_layer
    return float(values * per_value + 2 * h * 4)  # + embeddings output and final norm, fp32


def logits_bytes_per_token(shape: ModelShape, trains: bool = True) -> float:
    """Bytes of logits per token: fp32, kept with their gradient and the loss's softmax when training. A
    classifier's few labels cost nothing; a causal LM's vocabulary (49,152 for SmolLM2) costs as much as a third of
    its activations, and grows with the micro-batch as they do."""
    return float(shape.num_labels * 4 * (3 if trains else 1))


def memory_estimate(shape: ModelShape, method: str, *, bf16: bool, micro_batch: int, seq_len: int,
                    gradient_checkpointing: bool, constants: Constants = Constants(), device: str = "cpu",
                    knobs: MethodKnobs = MethodKnobs(), gradients_overlap: bool = False) -> dict[str, int]:
    """Peak bytes by component for one device, for a part of `micro_batch` sequences x `seq_len` tokens.

    `gradients_overlap`: that part is the only one of its optimizer step (no accumulation over parts or steps, one
    rank), so its backward starts with no gradients and frees each layer's saved tensors as it allocates that
    layer's weight gradients: the peak holds the larger of the two, not their sum, and `gradients` counts only what
    they add beyond the activations and logits (full fine-tuning's 4 bytes per weight; an adapter's are small).
    Otherwise a later part's backward runs with the whole step's gradients already allocated."""
    trains = methods.get(method).trained
    tokens = micro_batch * seq_len
    ratio = constants.measured_ratio(method, gradient_checkpointing)
    parts = {
        "runtime": constants.runtime_bytes + (CUDA_CONTEXT_BYTES if device != "cpu" else 0),
        "weights": weight_bytes(shape, method, knobs, bf16),
        "gradients": 4 * shape.trainable_params if trains else 0,
        "optimizer": 8 * shape.trainable_params if trains else 0,
        "activations": int(constants.activation_scale * tokens
                           * activation_bytes_per_token(shape, bf16, gradient_checkpointing)) if trains
        else int(tokens * shape.hidden * 4 * 4),  # inference: a few live hidden states
        # scaled as the activations are: calibration fits their sum's growth per token (calibrate)
        "logits": int((constants.activation_scale if trains else 1.0) * tokens
                      * logits_bytes_per_token(shape, trains)),
    }
    if ratio is not None:  # measured against the calibrated method: what it saves per token, times the ratio
        saved = constants.activation_scale * tokens * ratio * constants.calibrated_per_token
        parts["activations"] = max(0, int(saved) - parts["logits"] + constants.extra_cast_bytes.get(method, 0))
    if gradients_overlap and trains:
        parts["gradients"] = max(0, parts["gradients"] - parts["activations"] - parts["logits"])
    parts["peak"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------------------------- the run's batches
def planned_order(lengths: list[int], batch_size: int, grad_accum: int, epochs: float, max_steps: int | None,
                  seed: int, group_by_length: bool = True) -> tuple[int, list[list[int]]]:
    """(optimizer steps, every micro-batch of the run as example indices) in the training loop's own order
    (frugaltune.training.batching.run_batches), so the largest part and the padded tokens are exact."""
    from frugaltune.training.batching import run_batches

    per_epoch = math.ceil(len(lengths) / batch_size)
    steps = max_steps or max(1, math.ceil(epochs * math.ceil(per_epoch / grad_accum)))
    return steps, run_batches(lengths, batch_size, seed, steps * grad_accum, group_by_length)


def planned_batches(lengths: list[int], batch_size: int, grad_accum: int, epochs: float, max_steps: int | None,
                    seed: int, group_by_length: bool = True) -> tuple[int, list[tuple[int, int]]]:
    """(optimizer steps, [(sequences, longest length)] of every micro-batch the training loop will run)."""
    steps, order = planned_order(lengths, batch_size, grad_accum, epochs, max_steps, seed, group_by_length)
    return steps, [(len(batch), max(lengths[i] for i in batch)) for batch in order]

