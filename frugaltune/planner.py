"""Will it fit, and how long will it take? Memory and time estimates for a training run, before it starts.

Library code. The `plan` stage (`python -m stages.plan`) writes the plan to `reports/plan.json`; `frugaltune plan`
prints it; the `train` stage takes its `auto` values from it and refuses a configuration that cannot fit.

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
  fine-tuning's 4 bytes per weight; an adapter's gradients are small either way).
- activations, saved for backward, per token per decoder layer (llama-style block, RMSNorm + GQA + gated MLP):
  `16 h + 5 i` values (h hidden, i intermediate), plus `h + r` per LoRA-adapted module (dropout output + A
  output), plus `h` per DoRA module; 2 bytes each under bf16 autocast, 4 in fp32. Gradient checkpointing keeps
  one `h` per layer and recomputes one layer at a time. The peak comes from the largest micro-batch of the run
  (its sequences x its longest length), which is known before training: the batch order is fixed by the seed.
- runtime: the interpreter, torch and transformers (0.55 GiB on CPU before calibration; + 0.5 GiB CUDA context
  on a GPU).

Calibration (`calibrate`) runs a few of the run's own micro-batches through the train stage's loop with the
configured method, in a fresh process started early (a clean peak RSS; its imports overlap the planner's own work),
and fits `peak = static + per_token x part tokens` and `step_time = overhead + per_token x tokens`. The memory fit rescales the activation constant and replaces the
runtime constant; the time fit turns the run's exact padded-token count into an ETA, plus a one-time startup: what
the first step at the peak shape costs beyond a warm one (page faults for the memory the run keeps; on a 20-step
run it is a fifth of the time, on the default 178-step run ~3%). Calibration runs on the training process's malloc
(`train.allocator`, see frugaltune/allocator.py). Methods other than the
calibrated one reuse its memory constants; their time is the calibrated step's times each one's own step time
against it, both timed on the same micro-batch in the calibration's process (`Constants.method_cost`): adapters
alike in FLOPs differ in what their kernels cost (NF4 dequantization, DoRA's norms, PreLayer's missing adapter
matmuls). A method not timed falls back to its training FLOPs per token (6N full, 4N adapters).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from frugaltune.config import Params

GiB = 2**30
MiB = 2**20
CPU_RUNTIME_BYTES = int(0.55 * GiB)  # python + torch + transformers + peft imported, before calibration
CUDA_CONTEXT_BYTES = int(0.5 * GiB)
NF4_BLOCK = 64
HEADROOM = 0.9  # plan to use at most this share of the memory limit: the OS and page cache need the rest
TRAINED_METHODS = ("full", "lora", "qlora", "prelayer", "dora")
# The order the calibration times the methods it was not configured with, while its budget lasts: those whose
# training FLOPs (the fallback) are furthest from their measured cost first (docs/DECISIONS.md, "A calibration
# under a tenth of the run").
TIMING_ORDER = ("full", "prelayer", "qlora", "dora", "lora")
ADAPTER_METHODS = ("lora", "qlora", "dora")
# Training FLOPs per token relative to the matmul parameter count N: forward 2N, backward 2N for the input
# gradients, +2N for weight gradients when every weight trains.
FLOPS_FACTOR = {"full": 6.0, "lora": 4.0, "qlora": 4.0, "dora": 4.0, "prelayer": 4.0, "none": 2.0}


class PlanError(ValueError):
    """The configured run cannot fit; the message names the limit and a configuration that fits."""


# ---------------------------------------------------------------------------------------------- model shapes
@dataclass(frozen=True)
class MethodKnobs:
    """What the planner needs of `train.<method>`: adapter rank and targets (ignored by full/prelayer/none)."""

    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    quant_type: str = "nf4"
    double_quant: bool = True
    last_layers: int | None = None


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
        if method in ADAPTER_METHODS:
            model = apply_lora(model, knobs.r, 2 * knobs.r, 0.0, list(knobs.target_modules), use_dora=method == "dora",
                               task=task, last_layers=knobs.last_layers)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
        elif method in ("full", "prelayer", "none"):
            trainable = sum(p.numel() for p in freeze_for(method, model).parameters() if p.requires_grad)
        else:
            raise ValueError(f"unknown method {method!r}; methods: none, {', '.join(TRAINED_METHODS)}")
    layers = config.num_hidden_layers
    return ModelShape(
        total_params=total, trainable_params=trainable, quantizable_params=quantizable, matmul_params=matmul,
        layers=layers, hidden=config.hidden_size,
        intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size),
        heads=config.num_attention_heads, kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
        num_labels=num_labels, adapted_modules_per_layer=adapted // max(layers, 1) if method in ADAPTER_METHODS else 0,
        adapter_rank=knobs.r if method in ADAPTER_METHODS else 0, dora=method == "dora",
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
    source: str = "analytic defaults (not calibrated)"

    def measured_ratio(self, method: str, gradient_checkpointing: bool) -> float | None:
        """`method`'s measured activation ratio where it applies: a trained method other than the calibrated one,
        planned with the calibration's checkpointing (None: its analytic bytes at the calibrated scale)."""
        if (method in (self.calibrated_method, "none") or self.calibrated_per_token <= 0
                or gradient_checkpointing != self.calibrated_checkpointing):
            return None
        return self.activation_ratio.get(method)


def weight_bytes(shape: ModelShape, method: str, knobs: MethodKnobs = MethodKnobs(), bf16: bool = False) -> int:
    """The model's weights as its training holds them: fp32; QLoRA's decoder projections in 4 bit; LoRA's frozen
    decoder projections in bf16 when it trains in bf16 (frugaltune.training.fast.frozen_weights_in)."""
    from frugaltune.training.fast import frozen_projections_in_bf16

    if frozen_projections_in_bf16(method, bf16):
        return 2 * shape.quantizable_params + 4 * (shape.total_params - shape.quantizable_params)
    if method != "qlora":
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
    trains = method != "none"
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


# ---------------------------------------------------------------------------------------------- calibration
class _SavedBytes:
    """The bytes autograd saves for backward in one training step: each storage once, the model's parameters and
    buffers left out (a frozen weight kept for the input's gradient is not activation memory), a parameter's copy
    in another dtype (bf16 autocast's weight casts: a fixed cost, not per token) counted apart in `casts`.
    `last_step_of(n)` counts only the last of a train_classifier call's n steps, the hooks pushed from its on_log
    between two steps, so that the steps timed before it run without them."""

    def __init__(self, model):
        import torch

        parameters = [*model.parameters(), *model.buffers()]
        self.excluded = {t.untyped_storage().data_ptr() for t in parameters}
        self.floating = [t for t in parameters if t.is_floating_point() and t.numel() >= self.FIRST]
        self.weights: dict = {}  # per dtype: each parameter's (bytes, first values) cast to it
        self.storages: dict[int, int] = {}
        self.casts: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda packed: packed)
        self.steps, self.pushed = 0, False

    FIRST = 8  # values compared: an activation with a weight's size and first 8 values is not met

    def _is_cast(self, tensor, storage) -> bool:
        """Whether `storage` holds a parameter's copy in `tensor`'s dtype: its size and first values are one's."""
        import torch

        dtype = tensor.dtype
        if not tensor.is_floating_point() or storage.nbytes() < self.FIRST * tensor.element_size():
            return False
        if dtype not in self.weights:
            self.weights[dtype] = {(t.numel() * tensor.element_size(),
                                    tuple(t.detach().reshape(-1)[:self.FIRST].to(dtype).tolist()))
                                   for t in self.floating if t.dtype != dtype}
        first = torch.empty(0, dtype=dtype).set_(storage, 0, (self.FIRST,), (1,))
        return (storage.nbytes(), tuple(first.tolist())) in self.weights[dtype]

    def _pack(self, tensor):
        try:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer and pointer not in self.excluded and pointer not in self.storages and pointer not in self.casts:
                (self.casts if self._is_cast(tensor, storage) else self.storages)[pointer] = storage.nbytes()
        except NotImplementedError:  # a sparse tensor has no storage to count
            pass
        return tensor.detach()  # not the tensor itself: a saved output would hold its own grad_fn in a cycle

    def last_step_of(self, steps: int):
        def on_log(_record: dict) -> None:
            self.steps += 1
            if self.steps == steps - 1:
                self.hooks.__enter__()
                self.pushed = True
        return on_log

    def total(self) -> int:
        """The bytes saved but for the weight casts (the hooks popped, if `last_step_of` pushed them)."""
        if self.pushed:
            self.hooks.__exit__(None, None, None)
            self.pushed = False
        return sum(self.storages.values())

    def cast_total(self) -> int:
        return sum(self.casts.values())


def _calibration_point(spec: dict) -> dict:
    """Run in a fresh process (a clean peak RSS): the train stage's own loop (frugaltune.training.loop, the plan's
    LoopConfig and int8 decision) over the run's own micro-batches that `spec` names; per step its seconds and the
    peak RSS so far."""
    import resource

    began = time.perf_counter()
    import psutil
    import torch
    from torch._dynamo.utils import counters

    from frugaltune import allocator, faults
    from frugaltune.training.loop import LoopConfig, train_classifier
    from frugaltune.training.methods import prepare_model
    from frugaltune.training.setup import apply_int8

    torch.set_num_threads(spec["threads"])
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
    data = json.loads(Path(spec["rows_file"]).read_text())
    rows, targets, batches = data["rows"], data["targets"], data["batches"][:spec.get("batches") or None]
    def build(which: dict = spec):
        return prepare_model(spec["model_dir"], spec["labels"], spec["pad_token_id"], spec["seed"], which["method"],
                             MethodKnobs(**{k: tuple(v) if isinstance(v, list) else v
                                            for k, v in which["knobs"].items()}),
                             spec["loop"]["bf16"], spec["gradient_checkpointing"], task=spec["task"])

    model = build()
    # the model as loaded: what the process holds now, not its high-water mark (converting weights, to bf16 or
    # 4 bit, briefly holds both copies)
    loaded_rss = psutil.Process().memory_info().rss
    phases = {"build_s": time.perf_counter() - began}
    int8 = apply_int8(model, spec["int8"], spec["method"])
    # What the planner keeps of a calibration it stops early (CalibrationWorker.run): this line, then one per step
    _report({"built": {"loaded_rss_bytes": loaded_rss, "int8_products": bool(int8["on"]),
                       "allocator": allocator.active(), "build_s": round(phases["build_s"], 2)}})
    cfg = LoopConfig(**{**spec["loop"], "checkpoint_dir": None, "resume": False, "max_steps": None, "grad_accum": 1,
                        "log_every": 1, "warmup_ratio": 0.0})
    # Graphs inductor compiles afresh here (not found in its on-disk cache) are found there by every later process
    # on this machine, the run's among them: counted per step so that the plan can tell a cold start from a warm one.
    compiled = lambda: counters["inductor"].get("fxgraph_cache_miss", 0)  # noqa: E731
    marks: list[tuple[float, int, int, float, float]] = []
    # with other methods to compare: what this one saves for backward in its last step (their rows, see calibrate)
    saved = _SavedBytes(model) if spec.get("others") and not spec.get("batches") else None
    count = saved.last_step_of(len(batches)) if saved else lambda record: None

    def on_log(record: dict) -> None:
        marks.append((record["elapsed_s"], peak(), compiled(), time.process_time(), time.perf_counter()))
        count(record)
        elapsed, rss, graphs, cpu, wall = marks[-1]
        _report({"mark": [elapsed, rss, graphs, cpu - cpu_start, wall - wall_start]})
        faults.inject("calibration", f"step-{len(marks)}")

    cpu_start, wall_start = time.process_time(), time.perf_counter()
    optimizer_state: dict = {}  # AdamW's, kept for the steps taken in turn with the other methods'
    try:
        train_classifier(model, rows, targets, cfg, spec["pad_token_id"], progress=False, batches=batches,
                         on_log=on_log, optimizer_state=optimizer_state)
    finally:  # the hooks off before anything else runs in this process (the other methods' steps)
        saved_bytes = saved.total() if saved else None
        cast_bytes = saved.cast_total() if saved else None
    busy = _cpu_share(marks, cpu_start, wall_start, spec["threads"])
    phases["steps_s"] = time.perf_counter() - wall_start
    inference = []
    if data.get("inference") and not spec.get("batches"):  # forward passes, as evaluation runs them
        from frugaltune.training.loop import predict

        # evaluation runs the plain model (int8 products are training's): a model as loaded, when they were on
        evaluated = build() if int8["on"] else model
        for batch in data["inference"]["batches"]:  # each batch: its rows' token ids
            begin = time.perf_counter()
            predict(evaluated, batch, spec["pad_token_id"], batch_size=len(batch), bf16=spec["loop"]["bf16"],
                    progress=False)
            inference.append(time.perf_counter() - begin)
    steps = _marked_steps(marks)
    others = {}
    if spec.get("others") and not spec.get("batches"):
        evaluated = None  # noqa: F841 (the model stays: its steps on the others' rows are taken in turn with theirs)
        # the ETA as calibrate will make it: the line under the peak over the run's steps, and the start-up (what
        # the first pass paid beyond that line)
        timed = [(float(t), s["seconds"]) for t, s in zip(spec["runs_tokens"], steps)]
        overhead, per_token, excess = _step_line(timed[:spec["first_pass"]], timed[spec["first_pass"]:])
        budget = None
        if spec.get("others_share") is not None:  # the calibration as a whole may cost this share of the run
            run_s = sum(excess) + spec["run_steps"] * overhead + spec["run_tokens"] * per_token
            budget = spec["others_share"] * run_s - (time.time() - spec["sent_at"])  # since the planner's wait began
        mark = time.perf_counter()
        others = _time_other_methods(spec, build, rows, targets, cfg, overhead + per_token * spec["others_tokens"],
                                     budget, calibrated=(model, optimizer_state))
        model = None
        phases["others_s"] = time.perf_counter() - mark
    phases["total_s"] = time.perf_counter() - began
    phases = {k: round(v, 2) for k, v in phases.items()}
    return {"phases": phases, "loaded_rss_bytes": loaded_rss, "steps": steps, "int8_products": bool(int8["on"]),
            "cpu_share": round(busy, 3), "allocator": allocator.active(), "inference_seconds": inference,
            "others": others, "saved_bytes": saved_bytes, "cast_bytes": cast_bytes}


def _report(line: dict) -> None:
    """One line of the calibration's progress to the planner, as it happens (the worker's stdout is its pipe)."""
    print(json.dumps(line), flush=True)


def _marked_steps(marks: list) -> list[dict]:
    """The loop's cumulative marks (elapsed, peak RSS, compiled graphs, ...) -> each step's own seconds and graphs."""
    steps, previous = [], (0.0, 0)
    for elapsed, rss, graphs, *_ in marks:
        steps.append({"seconds": elapsed - previous[0], "peak_rss_bytes": rss, "compiled_graphs": graphs - previous[1]})
        previous = (elapsed, graphs)
    return steps


def _cpu_share(marks: list[tuple], cpu_start: float, wall_start: float, threads: int) -> float:
    """The share of `threads` cores this process kept busy over the calibration's steps (marks: per step its
    cumulative (elapsed, peak, compiled graphs, process time, wall clock)), counting only the steps that compiled
    nothing: inductor compiles in worker processes whose CPU this process's clock does not see, so a cold first
    step would read as a busy machine on an idle one. All steps when every one compiled."""
    spans, previous = [], (cpu_start, wall_start, 0)
    for _, _, graphs, cpu, wall in marks:
        spans.append((cpu - previous[0], wall - previous[1], graphs - previous[2]))
        previous = (cpu, wall, graphs)
    warm = [(cpu, wall) for cpu, wall, compiled in spans if compiled == 0] or [(c, w) for c, w, _ in spans]
    return sum(c for c, _ in warm) / max(sum(w for _, w in warm) * threads, 1e-9)


def _time_other_methods(spec: dict, build, rows: list, targets: list, cfg, step_s: float,
                        budget_s: float | None, calibrated: tuple) -> dict:
    """Each method in `spec["others"]`, in that order, built as its training builds it (its knobs, its int8
    decision) and timed on rows of one of the run's micro-batches (`spec["others_batch"]`, about `step_s` seconds a
    step for the calibrated method), its steps taken in turn with those of the `calibrated` (model, optimizer
    state from the calibration's loop) on the same rows: its cost is the ratio of the two, measured seconds apart.
    A method that cannot be built for this task is reported with its error, not timed; one that the calibration's
    budget (`budget_s` seconds left, None: no bound) cannot pay for, as much as the dearest method timed so far
    (before the first: six steps), is reported skipped."""
    import contextlib
    import gc

    from frugaltune.training.loop import train_classifier
    from frugaltune.training.setup import apply_int8

    timed: dict[str, dict] = {}
    batch = spec["others_batch"]
    costs: list[float] = []  # what each method timed so far cost, its build included

    def step(model, rows_of_step: list[int], optimizer_state: dict) -> float:
        """One step of the train stage's loop: a call of its own, whose optimizer starts from (and leaves) the
        model's state, so that the step is a steady one (AdamW's state made once, outside the step's time)."""
        seconds: list[float] = []
        train_classifier(model, rows, targets, cfg, spec["pad_token_id"], progress=False, batches=[rows_of_step],
                         optimizer_state=optimizer_state, on_log=lambda record: seconds.append(record["elapsed_s"]))
        return seconds[0]

    # Each method's warm-up step runs two of the rows: it allocates the method's gradients and optimizer state and
    # touches its kernels at a fraction of a full step's price. Then the rows twice, the faster kept: one step
    # alone read the machine's noise, and a new model's first step into pages the process does not have yet can
    # take twice its second. The calibrated method's steps alternate with the method's (A B A B): on a shared
    # machine whose speed drifts over seconds, a reference timed half a minute earlier read the drift, not the
    # method. In this thread, as the run's steps are: the two loops in threads of their own, taking turns, ran
    # their steps slower than here (docs/DECISIONS.md, "Each method its own ETA", "A method's cost timed in turn
    # with the calibrated one's").
    calibrated, calibrated_state = calibrated
    for other in spec["others"]:
        began = time.perf_counter()
        # what this method may cost, before it is built: as much as the dearest timed so far (a bound, not a guess:
        # the mean let the calibration overrun its share), before the first six of the calibrated method's steps
        expected = max(costs) if costs else 6 * step_s
        if budget_s is not None and budget_s < expected:
            timed[other["method"]] = {"skipped": f"the calibration's budget ({spec['others_share']:.0%} of the run) "
                                                 "is spent"}
            continue
        try:
            model = build({"method": other["method"], "knobs": other["knobs"]})
            apply_int8(model, other["int8"], other["method"])
            state: dict = {}
            step(model, batch[:2], state)
            steps_s, calibrated_s = [], []
            saved = _SavedBytes(model)
            for last in (False, True):
                calibrated_s.append(round(step(calibrated, batch, calibrated_state), 4))
                with saved.hooks if last else contextlib.nullcontext():  # what it saves for backward: its last step
                    steps_s.append(round(step(model, batch, state), 4))
            timed[other["method"]] = {"seconds": min(steps_s), "steps_s": steps_s, "saved_bytes": saved.total(),
                                      "cast_bytes": saved.cast_total(),
                                      "calibrated_seconds": min(calibrated_s), "calibrated_steps_s": calibrated_s,
                                      "total_s": round(time.perf_counter() - began, 2)}
            costs.append(time.perf_counter() - began)
        except Exception as error:  # noqa: BLE001 -- e.g. a method this task does not support: no figure for it
            timed[other["method"]] = {"error": f"{type(error).__name__}: {error}"[:300]}
        model = state = None
        gc.collect()
        if budget_s is not None:
            budget_s -= time.perf_counter() - began
    return timed


# The calibration's watch (CalibrationWorker.run), over its last WATCH_S seconds: a process that got under
# STALLED_CORE of one core is stopped (SIGSTOP, a debugger) or starved, and would wait out its timeout; one that got
# under BUSY_SHARE of its threads' cores while other processes kept OTHERS_BUSY of the machine's cores busy is
# sharing them: it runs past 1/BUSY_SHARE of its time on a free machine (more where OpenMP threads spin-wait for
# a descheduled sibling), and it measures the load as much as the run.
WATCH_S = 30.0
STALLED_CORE = 0.1
BUSY_SHARE = 0.8
OTHERS_BUSY = 0.25


class CalibrationStopped(RuntimeError):
    """The calibration's process ended before its result: `why` (a clause), and what it had reported by then:
    `built` (the model as loaded; None before), `marks` (the loop's, one per step). `busy`: the machine was."""

    def __init__(self, why: str, built: dict | None = None, marks: list | None = None, busy: bool = False):
        super().__init__(f"the calibration stopped early: {why}")
        self.why, self.built, self.marks, self.busy = why, built, marks or [], busy


class _Watch:
    """CPU seconds of a process and its descendants (inductor compiles in worker processes) and of the whole
    machine, sampled over time: whether the process is stalled, or losing its cores to other processes."""

    def __init__(self, pid: int, threads: int, window_s: float):
        import psutil

        self.process, self.threads, self.window_s = psutil.Process(pid), threads, window_s
        self.cores = psutil.cpu_count() or 1
        self.samples: list[tuple[float, float, float]] = []

    def _own(self) -> float:
        import psutil

        total = 0.0
        for process in [self.process, *self.process.children(recursive=True)]:
            try:
                t = process.cpu_times()  # children_*: descendants it has reaped
            except psutil.Error:
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total

    def verdict(self, stop_when_busy: bool, steps: int) -> tuple[str | None, bool]:
        """(why to stop, whether the machine was busy), or (None, False) to go on. A process that got under
        STALLED_CORE of a core over the window stops in any case: stopped, starved by a busy machine, or stuck.
        With `stop_when_busy`, one losing its cores to other processes stops once it has two steps to fit, or after
        twice the window without them."""
        import psutil

        now = time.monotonic()
        try:
            own = self._own()
        except psutil.Error:  # gone: its exit status says how
            return None, False
        machine = psutil.cpu_times()
        busy_all = (sum(machine) - machine.idle - getattr(machine, "iowait", 0.0) - getattr(machine, "guest", 0.0)
                    - getattr(machine, "guest_nice", 0.0))  # guest time is counted in user time already
        self.samples.append((now, own, busy_all))
        old = [sample for sample in self.samples if sample[0] <= now - self.window_s]
        if not old:
            return None, False
        then, own_then, busy_then = old[-1]
        wall, used = now - then, own - own_then
        others = max(0.0, busy_all - busy_then - used)
        crowded = others >= OTHERS_BUSY * self.cores * wall
        share = used / (wall * self.threads)
        with contextlib.suppress(psutil.Error):
            if used < STALLED_CORE * wall and self.process.status() == psutil.STATUS_STOPPED:
                return f"its process was stopped (SIGSTOP, or a debugger) for {wall:.0f} s", False
        # starved (it would take ten times its time), or sharing its cores with a plan that asked to stop then
        if crowded and (used < STALLED_CORE * wall or (
                stop_when_busy and share < BUSY_SHARE and (steps >= 2 or now - self.samples[0][0] >= 2 * self.window_s))):
            return (f"the machine was busy: over {wall:.0f} s it got {share:.0%} of its {self.threads} threads' "
                    f"cores while other processes kept {others / wall:.1f} of the {self.cores} cores busy"), True
        if used < STALLED_CORE * wall:
            return f"its process got {used / wall:.0%} of a core for {wall:.0f} s (stuck)", False
        return None, False


class CalibrationWorker:
    """The fresh process the calibration's steps run in: a clean peak RSS, on the training process's malloc
    (`train.allocator`: RSS depends on it as much as on the tensors). Started before the plan needs it, it imports
    torch, transformers and peft (seconds of one core) while the planner reads the data and builds its shapes on
    the other, then reads its spec from stdin; `run` hands it the spec and returns what it measured."""

    def __init__(self, allocator_choice: str = "auto"):
        from frugaltune import allocator, processes

        self.process = subprocess.Popen(
            [sys.executable, "-m", "frugaltune.planner", "--calibration-worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=processes.worker_env({**allocator.child_env(allocator_choice), "TQDM_DISABLE": "1"}))

    def run(self, spec: dict, timeout_s: float, watch_s: float = WATCH_S, stop_when_busy: bool = False) -> dict:
        """Hand the worker `spec` and read its progress as it comes; return what it measured (its last line).
        CalibrationStopped, with what it reported by then, when it runs past `timeout_s`, is killed, or (watched
        over its last `watch_s` seconds) gets no CPU, or, `stop_when_busy`, loses its cores to other processes."""
        import select
        import signal

        process, built, marks, result, why, busy = self.process, None, [], None, None, False
        out, err = process.stdout.fileno(), process.stderr.fileno()
        received = {out: bytearray(), err: bytearray()}
        began = time.monotonic()
        try:
            watch = _Watch(process.pid, spec["threads"], watch_s)
            with contextlib.suppress(BrokenPipeError):  # it died before reading: its exit status says how
                process.stdin.write(json.dumps(spec))
                process.stdin.close()
            pending = set(received)
            while pending:
                for fd in select.select(list(pending), [], [], 1.0)[0]:
                    chunk = os.read(fd, 1 << 16)
                    received[fd] += chunk
                    if not chunk:
                        pending.discard(fd)
                *lines, rest = received[out].split(b"\n")
                received[out] = bytearray(rest)
                for line in lines:
                    with contextlib.suppress(ValueError):  # not one of its JSON lines (a loop event)
                        item = json.loads(line)
                        if isinstance(item, dict):
                            built = item.get("built", built)
                            marks += [item["mark"]] if "mark" in item else []
                            result = item if "steps" in item else result
                if time.monotonic() - began > timeout_s:
                    why = f"it ran past its timeout of {timeout_s:.0f} s"
                elif pending:
                    why, busy = watch.verdict(stop_when_busy, len(marks))
                if why:
                    break
            if not why:  # its pipes are closed: it is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=watch_s)
        finally:  # its stdin is closed already: communicate (close) would refuse to flush it
            if process.poll() is None:
                process.kill()
                process.wait()
            for stream in (process.stdin, process.stdout, process.stderr):
                with contextlib.suppress(OSError, ValueError):  # a pipe it closed first, or closed here already
                    stream.close()
        if result is not None and not why:
            return result
        code = process.returncode
        if why or (code is not None and code < 0):
            why = why or f"its process was killed by {signal.Signals(-code).name}" + (
                " (out of memory?)" if code == -signal.SIGKILL else "")
            raise CalibrationStopped(why, built, marks, busy)
        raise RuntimeError(f"calibration of {spec['method']} failed:\n{received[err].decode()[-2000:]}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def _worker_main() -> None:
    """`python -m frugaltune.planner --calibration-worker`: import first, then wait for the spec on stdin."""
    began = time.perf_counter()
    from frugaltune import processes

    processes.die_with_parent(processes.parent_from_env())  # a killed plan stage leaves no calibration running
    import torch  # noqa: F401 -- what the steps need, imported before the spec arrives

    from frugaltune.training import loop, methods, setup  # noqa: F401
    imported = time.perf_counter()
    spec = json.loads(sys.stdin.read())
    point = _calibration_point(spec)
    # imports_s: paid before the spec arrived, beside the planner's own work; waited_s: how long the worker then
    # waited for it (0: the planner waited for the imports instead)
    point["phases"].update(imports_s=round(imported - began, 2), waited_s=round(time.perf_counter() - imported
                                                                               - point["phases"]["total_s"], 2))
    print(json.dumps(point))


def calibration_batches(order: list[list[int]], lengths: list[int], part_tokens, time_samples: int) -> list[int]:
    """Positions in `order` (the run's micro-batches) that the calibration runs, `time_samples` sizes in all: the
    smallest batch first (its first step also pays the one-time warm-up: page faults, oneDNN and compiled kernels,
    at the lowest price), then batches at evenly spaced quantiles of their padded tokens, and last the batch with
    the largest part, which sets the run's peak memory (`part_tokens(batch)`: its part's padded tokens as the loop
    splits it) and stands for the top of the range."""
    if not order:
        return []
    by_size = sorted(range(len(order)), key=lambda i: len(order[i]) * max(lengths[j] for j in order[i]))
    worst = max(range(len(order)), key=lambda i: part_tokens(order[i]))
    count = max(2, time_samples)
    picks = []
    for q in range(count - 1):
        position = by_size[round(q * (len(by_size) - 1) / (count - 1))]
        if position not in picks and position != worst:
            picks.append(position)
    return picks + [worst]


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares `seconds = overhead + per_token x tokens`; (overhead, per_token), both >= 0."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if n < 2 or var == 0:
        return 0.0, mean_y / mean_x
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    if slope <= 0:  # noise swamped the size effect: the whole step per token
        return 0.0, mean_y / mean_x
    overhead = mean_y - slope * mean_x
    if overhead < 0:  # a line through the origin instead
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return overhead, slope


def _step_line(first_pass: list[tuple[float, float]], again: list[tuple[float, float]]
               ) -> tuple[float, float, list[float]]:
    """The calibration's time line from its (padded tokens, seconds) steps: `step = overhead + per_token x tokens`
    fitted under the peak (`again`; the first pass after its warm-up step when there is none), and what each
    first-pass step paid beyond it (its warm-up, its growth into new pages). Shared by `calibrate` and its worker,
    which budgets the other methods against the same ETA."""
    overhead, per_token = _fit_line(again or first_pass[1:])
    return overhead, per_token, [max(0.0, s - overhead - per_token * t) for t, s in first_pass]


def fit_memory(points: list[tuple[int, int]], static: float, per_token: float,
               loaded_rss: int) -> tuple[float, float]:
    """(activation scale, runtime bytes) from the calibration's (part tokens, peak RSS) points, smallest first:
    `peak = static + runtime + scale x per_token x tokens`, through the largest part's measured peak."""
    _, slope = _fit_line(points) if len(points) > 1 else (0.0, 0.0)
    # A slope of zero means RSS noise swamped the activations (tiny models): keep the analytic constant.
    scale = slope / per_token if slope > 0 and len(points) > 1 else 1.0
    largest_tokens, largest_rss = points[-1]
    runtime = largest_rss - scale * per_token * largest_tokens - static
    if runtime + static < 0.9 * loaded_rss:  # the slope read RSS noise (tiny models): analytic
        scale, runtime = 1.0, largest_rss - per_token * largest_tokens - static
    if runtime < 0:
        # The high-water mark also grew between steps for what is not activations (the allocator's growth, full
        # fine-tuning's optimizer state), so the slope overshoots; a runtime clamped at 0 would then put the largest
        # part above its own measured peak. The run's largest part is the one measured: keep its peak.
        scale = max(0.0, (largest_rss - static) / (per_token * largest_tokens))
        runtime = largest_rss - static - scale * per_token * largest_tokens
    return scale, runtime


def calibrate(model_dir: Path | str, labels: list[str], pad_token_id: int, method: str, knobs: MethodKnobs,
              shape: ModelShape, *, rows: list[list[int]], targets: list, order: list[list[int]], loop: dict,
              int8: dict, gradient_checkpointing: bool, threads: int, seed: int = 0, time_samples: int = 6,
              timeout_s: float = 900, allocator: str = "auto", task: str = "classification",
              inference_rows: list[list[int]] | None = None, inference_batch: int = 32,
              others: list[dict] | None = None, others_share: float | None = 0.1,
              worker: CalibrationWorker | None = None,
              planned: tuple[int, int] | None = None, watch_s: float = WATCH_S,
              stop_when_busy: bool = False) -> tuple[Constants, dict]:
    """Time the train stage's own loop on this machine over a few of the run's own micro-batches and fit the
    memory and time constants.

    `order` is the run's micro-batches (planned_order), `loop` the run's LoopConfig fields
    (frugaltune.training.setup.loop_config) and `int8` the plan's int8 decision, so the steps timed are the steps
    that train: the same int8 products and fused LoRA, micro-batch and token cap, attention crossover and malloc
    (`allocator`). One fresh process runs them (calibration_batches): its first step is the run's one-time
    warm-up (timed again in a second process when it compiled graphs afresh: the run finds them in inductor's
    cache); the sampled sizes, smallest first, give the peak RSS after each step, which fits
    `peak = static + per_token x part tokens`; run a second time under that peak (all but the largest, when two or
    more are left) they fit `step = overhead + per_token x padded tokens`, and what the first pass paid beyond that
    is the run's start-up. The peak the plan keeps is the process's over both passes. The process is `worker`
    when given (a CalibrationWorker started early, its imports done beside the caller's work), else a new one.

    With `inference_rows` (an evaluation split) the same process then times the model's forward passes, as
    evaluation runs them (without int8 products), over a few of that split's evaluation batches (loop.predict,
    `inference_batch` rows each): a warm-up, the smallest, the median and the largest, which fit
    `batch = overhead + per_token x padded tokens` in `calibration["inference"]` (the federated budget's
    evaluation rounds).

    `others` (each {"method", "knobs": MethodKnobs, "int8": its decision}): the same process then builds each of
    those methods and times it on half the rows of the sampled micro-batch nearest the run's mean step, after a
    two-row warm-up step, twice (the faster kept); its time over the calibrated method's on the same rows (the
    faster of two, their steps taken in turn with its own) is its `Constants.method_cost`, so that
    every method the plan lists gets an ETA measured here, not copied. The calibration as a whole, the configured
    method's steps included, may cost `others_share` of the run the plan plans (None: no bound): the methods are
    timed in `others`' order while that budget lasts, and one it cannot pay for keeps the FLOPs estimate, saying
    so (`Constants.not_timed`). `planned`: the run's (steps, padded tokens) as the plan counts them for its ETA
    (default: the micro-batches of `order` and all their padded tokens).

    A calibration that cannot finish ends here, never in a traceback (CalibrationWorker.run's watch): a process
    that gets no CPU for `watch_s` seconds, is killed, or runs past `timeout_s`, and, with `stop_when_busy` (the
    plan), one that loses its cores to other processes, is stopped there. After two steps or more, the constants
    are fitted from those steps and the other methods keep their FLOPs estimate; before, they are the analytic
    defaults (no ETA). `calibration["stopped"]` says why and `calibration["busy_note"]` what that means for the plan.
    With `inference_rows`, whose passes come after the steps, a stopped calibration is CalibrationStopped.
    """
    import tempfile

    from frugaltune.training.batching import parts

    lengths = [len(r) for r in rows]
    split = math.ceil(loop["batch_size"] / (loop.get("micro_batch_size") or loop["batch_size"]))

    def tokens(batch: list[int]) -> dict[str, int]:
        """A micro-batch's padded tokens, and its largest part's (rows x the batch's longest), as the loop splits it."""
        pieces = parts(batch, lengths, split, loop.get("micro_batch_tokens"))
        return {"padded_tokens": sum(len(p) * max(lengths[i] for i in p) for p in pieces),
                "part_tokens": len(pieces[0]) * max(lengths[i] for i in batch)}

    picks = calibration_batches(order, lengths, lambda batch: tokens(batch)["part_tokens"], time_samples)
    # The sampled sizes run twice: first smallest to largest, each raising the high-water mark (the memory fit's
    # points; each such step also pays for the pages it grows into), then again under the peak, as the run's steps
    # mostly are: those second timings fit the per-token time. The largest, the calibration's dearest step, runs
    # again only when fewer than two other sizes are left to draw the line (docs/DECISIONS.md, "A calibration
    # under a tenth of the run").
    again = [p for p in picks if p != picks[-1]] if len(picks) > 2 else picks
    runs = [order[p] for p in picks + again]  # each step's micro-batch (example indices of the run)
    # The other methods are timed on the sampled micro-batch nearest the run's mean step: a method's cost against
    # another's depends on the batch (full fine-tuning's optimizer step is fixed, its weight gradients grow with the
    # tokens), and the ETA is the sum of the run's steps, which the mean step stands for. Half of its rows: a
    # method's cost against the calibrated one's is a ratio of two steps on the same rows, and half the rows cost
    # half. The calibrated method runs those rows twice too, at the end of its second pass: two more points of the
    # time fit, and the bytes it saves for backward on them, which the others' are measured against (their time,
    # against its steps on those rows taken in turn with theirs).
    typical_tokens = None  # the timed rows' tokens (calibrate's `tokens`), when others are timed
    if others:
        run_tokens = [tokens(batch)["padded_tokens"] for batch in order]
        typical = min(picks, key=lambda p: abs(run_tokens[p] - sum(run_tokens) / len(order)))
        timed_rows = order[typical][:max(2, math.ceil(len(order[typical]) / 2))]
        typical_tokens = tokens(timed_rows)
        runs += [timed_rows, timed_rows]
    runs_tokens = [tokens(batch) for batch in runs]
    used = sorted({i for batch in runs for i in batch})
    index = {old: new for new, old in enumerate(used)}
    inference = None
    if inference_rows:
        from frugaltune.training.batching import sorted_batches

        widths = [len(r) for r in inference_rows]
        batches = sorted_batches(widths, inference_batch)[::-1]  # shortest first
        chosen = [batches[len(batches) // 2], batches[0], batches[len(batches) // 2], batches[-1]]
        inference = {"batches": [[list(inference_rows[i]) for i in b] for b in chosen],
                     "padded_tokens": [len(b) * max(widths[i] for i in b) for b in chosen]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"rows": [list(rows[i]) for i in used], "targets": [targets[i] for i in used],
                   "batches": [[index[i] for i in batch] for batch in runs], "inference": inference}, handle)
    spec = {"model_dir": str(model_dir), "labels": labels, "pad_token_id": pad_token_id, "seed": seed,
            "method": method, "knobs": asdict(knobs), "gradient_checkpointing": gradient_checkpointing,
            "threads": threads, "allocator": allocator, "task": task, "int8": int8, "rows_file": handle.name,
            "loop": {k: v for k, v in loop.items() if k != "checkpoint_dir"}}
    if others:
        spec["others"] = [{"method": o["method"], "knobs": asdict(o["knobs"]), "int8": o["int8"]} for o in others]
        spec["others_batch"] = [index[i] for i in timed_rows]
        spec.update(others_share=others_share, others_tokens=typical_tokens["padded_tokens"], first_pass=len(picks),
                    runs_tokens=[t["padded_tokens"] for t in runs_tokens],
                    # the steps and padded tokens the plan's ETA counts (a causal LM's shared prefix once per part)
                    run_steps=planned[0] if planned else len(order),
                    run_tokens=planned[1] if planned else sum(run_tokens))
    started = time.perf_counter()
    stopped: CalibrationStopped | None = None
    startup_from = "the first step"
    try:
        try:
            # sent_at: the wall clock (shared by both processes) when this process starts to wait, from which the
            # worker counts what the calibration has cost
            point = (worker or CalibrationWorker(allocator)).run({**spec, "sent_at": time.time()}, timeout_s,
                                                                 watch_s, stop_when_busy)
        except CalibrationStopped as exc:
            # What it measured before it stopped is the plan's, when there are two steps to fit; the evaluation's
            # forward passes (a caller's inference_rows) come after the steps: without them, the caller's error.
            if inference_rows or exc.built is None or len(exc.marks) < 2:
                if inference_rows:
                    raise
                return _not_calibrated(exc, method, len(runs), time.perf_counter() - started)
            stopped, point = exc, _stopped_point(exc, spec)
        steps = [{**step, **counted, "under_peak": n >= len(picks)}
                 for n, (step, counted) in enumerate(zip(point["steps"], runs_tokens))]
        growing = steps[:len(picks)]
        warm = growing[0]
        timed = [(s["padded_tokens"], s["seconds"]) for s in steps]
        overhead, per_token_s, excess = _step_line(timed[:len(picks)], timed[len(picks):])
        steady = lambda step: overhead + per_token_s * step["padded_tokens"]  # noqa: E731
        # What the first pass paid beyond a step under the peak is paid once per run: the warm-up (page faults,
        # oneDNN's kernels for new shapes) and the growth to the peak. When the first step compiled graphs afresh,
        # the run will load them from inductor's cache instead: a second process runs the first step alone and
        # measures the start-up the run will pay.
        growth = sum(excess[1:])
        startup_cold = excess[0] + growth
        first = warm["seconds"]
        if warm.get("compiled_graphs") and not stopped:
            try:
                first = CalibrationWorker(allocator).run({**spec, "batches": 1}, timeout_s, watch_s,
                                                         stop_when_busy)["steps"][0]["seconds"]
                startup_from = "a second process: the first step compiled graphs that the run will find in inductor's cache"
            except CalibrationStopped as exc:  # the cold first step's start-up, an overestimate, and why
                startup_from = f"the first step, compiling graphs (its second process stopped early: {exc.why})"
    finally:
        Path(handle.name).unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    startup = max(0.0, first - steady(warm)) + growth
    # Memory: the peak after the warm-up step, then after each larger part (the first pass runs smallest first).
    points, top = [], 0
    for s in growing:
        if s["part_tokens"] > top:
            points.append((s["part_tokens"], s["peak_rss_bytes"]))
            top = s["part_tokens"]
    points[-1] = (top, max(s["peak_rss_bytes"] for s in steps))  # the largest part again, after smaller ones
    # what grows with a part's tokens: the activations saved for backward and the logits (a causal LM's are large)
    per_token = (activation_bytes_per_token(shape, bool(loop["bf16"]), gradient_checkpointing)
                 + logits_bytes_per_token(shape))
    fixed = memory_estimate(shape, method, bf16=bool(loop["bf16"]), micro_batch=0, seq_len=1,
                            gradient_checkpointing=gradient_checkpointing, knobs=knobs,
                            constants=Constants(runtime_bytes=0))
    # Each calibration step is one part (no accumulation): its gradients overlap the activations backward frees
    # (memory_estimate's gradients_overlap), so the peaks grow from weights + optimizer state alone, unless the
    # gradients are the larger (full fine-tuning on short parts), when the peaks stand on them.
    static = fixed["peak"] - fixed["gradients"]
    scale, runtime = fit_memory(points, static, per_token, point["loaded_rss_bytes"])
    if scale * per_token * points[-1][0] < fixed["gradients"]:
        scale, runtime = fit_memory(points, fixed["peak"], per_token, point["loaded_rss_bytes"])
    reference = min(s["seconds"] for s in steps[-2:]) if typical_tokens and not stopped else 0.0
    # each method against the calibrated one's steps on the same rows, taken in turn with its own
    method_cost = {m: round(t["seconds"] / t["calibrated_seconds"], 3) for m, t in point["others"].items()
                   if "seconds" in t and t["calibrated_seconds"] > 0}
    not_timed = {m: t.get("skipped") or t.get("error") or "no calibrated step to compare with"
                 for m, t in point["others"].items() if m not in method_cost}
    own_saved = point.get("saved_bytes") or 0
    activation_ratio = {m: round(t["saved_bytes"] / own_saved, 3) for m, t in point["others"].items()
                        if t.get("saved_bytes") and own_saved > 0}
    own_casts = point.get("cast_bytes") or 0
    extra_cast_bytes = {m: t["cast_bytes"] - own_casts for m, t in point["others"].items()
                        if m in activation_ratio and t.get("cast_bytes", 0) != own_casts}
    constants = Constants(runtime_bytes=max(0, int(runtime)), activation_scale=round(scale, 4),
                          step_overhead_s=overhead, seconds_per_token=per_token_s, startup_s=round(startup, 3),
                          calibrated_method=method, method_cost=method_cost, not_timed=not_timed,
                          activation_ratio=activation_ratio, extra_cast_bytes=extra_cast_bytes,
                          calibrated_per_token=per_token,
                          calibrated_checkpointing=gradient_checkpointing,
                          source=f"calibrated: the run's own loop over {len(steps)} of its micro-batches ({method}, "
                                 f"int8 products {'on' if point['int8_products'] else 'off'}, {threads} threads, "
                                 f"malloc {point['allocator']}) in {seconds:.0f} s"
                                 + (f", stopped early ({stopped.why})" if stopped else ""))
    busy = point["cpu_share"] < BUSY_SHARE or bool(stopped and stopped.busy)
    busy_note = (f"the machine was busy: calibration got {point['cpu_share']:.0%} of {threads} cores; the ETA assumes "
                 "the same load" if busy else None)
    if stopped:
        busy_note = (f"the calibration stopped after {len(steps)} of its {len(runs)} steps: {stopped.why}; the ETA "
                     f"and peak come from those steps{', under that load' if busy else ''}"
                     f"{', the other methods from training FLOPs' if others else ''}. "
                     f"{RECALIBRATE} when the machine is free calibrates it fully")
    timed_inference = None
    if inference:
        pairs = list(zip(inference["padded_tokens"], point["inference_seconds"]))[1:]  # after the warm-up
        fixed, per_token_inference = _fit_line([(float(t), s) for t, s in pairs])
        timed_inference = {"overhead_s": fixed, "seconds_per_token": per_token_inference, "threads": threads,
                           "batches": [{"padded_tokens": t, "seconds": round(s, 4)} for t, s in pairs]}
    return constants, {"method": method, "phases": point["phases"], "steps": steps, "inference": timed_inference,
                       "memory_points": points,
                       "others": {"padded_tokens": typical_tokens["padded_tokens"],
                                  "calibrated_step_s": round(reference, 4), "calibrated_saved_bytes": own_saved,
                                  "calibrated_cast_bytes": own_casts,
                                  "methods": point["others"]}
                       if others else None,
                       "seconds": round(seconds, 1),
                       "loaded_rss_bytes": point["loaded_rss_bytes"], "bf16": bool(loop["bf16"]),
                       "allocator": point["allocator"], "gradient_checkpointing": gradient_checkpointing,
                       "int8_products": point["int8_products"], "cpu_share": point["cpu_share"],
                       "startup_s": round(startup, 2), "startup_cold_s": round(startup_cold, 2),
                       "startup_from": startup_from,
                       "machine_busy": busy, "stopped": stopped.why if stopped else None, "busy_note": busy_note}


RECALIBRATE = "`dvc repro --force --single-item plan`"


def _stopped_point(stopped: CalibrationStopped, spec: dict) -> dict:
    """A worker's result (`_calibration_point`) from what a calibration stopped after its second step had reported:
    those steps; no other method timed, nothing saved for backward counted."""
    marks, built = stopped.marks, stopped.built
    return {"phases": {"build_s": built["build_s"], "steps_s": round(marks[-1][4], 2)},
            "loaded_rss_bytes": built["loaded_rss_bytes"], "steps": _marked_steps(marks),
            "int8_products": built["int8_products"], "allocator": built["allocator"],
            "cpu_share": round(_cpu_share([tuple(m) for m in marks], 0.0, 0.0, spec["threads"]), 3),
            "inference_seconds": [], "saved_bytes": None, "cast_bytes": None,
            "others": {o["method"]: {"skipped": f"the calibration stopped early ({stopped.why})"}
                       for o in spec.get("others") or []}}


def _not_calibrated(stopped: CalibrationStopped, method: str, planned_steps: int,
                    seconds: float) -> tuple[Constants, dict]:
    """calibrate's answer when its process stopped before two steps: the analytic constants, and why."""
    note = (f"the calibration stopped before its second step ({stopped.why}): the plan is analytic, without an ETA. "
            f"{RECALIBRATE} when the machine is free calibrates it")
    return Constants(source=f"analytic defaults: {note}"), {
        "method": method, "steps": [], "planned_steps": planned_steps, "seconds": round(seconds, 1),
        "cpu_share": None, "int8_products": (stopped.built or {}).get("int8_products"),
        "machine_busy": stopped.busy, "stopped": stopped.why, "busy_note": note}


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class RunSpec:
    """The configured training run, as the planner needs it."""

    method: str
    batch_size: int
    grad_accum: int
    epochs: float
    max_steps: int | None
    seq_len: int  # tokenize.max_length: the longest a sequence can be
    lengths: tuple[int, ...]  # token counts of the training split
    seed: int
    group_by_length: bool = True
    precision: str = "auto"  # auto | bf16 | fp32
    micro_batch_size: int | str = "auto"
    gradient_checkpointing: bool | str = "auto"
    threads: int | None = None
    knobs: dict[str, MethodKnobs] = field(default_factory=dict)
    ranks: int = 1  # train.distributed.nproc_per_node: data-parallel processes on this host
    micro_batch_tokens: int | None = None  # train.micro_batch_tokens: the loop splits wider batches (part_rows)
    # causal_lm: leading tokens every training row has in common (its prompt template), read once per micro-batch
    # part by the training loop (LoopConfig.shared_prefix_min): the ETA does not count them per row
    shared_prefix: int = 0


def measured_on(hardware: dict, kernels_report: dict | None) -> dict | None:
    """The `cpu` section of reports/kernels.json if it was measured on this CPU (`hardware`), else None.

    A measurement from another machine would be a guess: reports in git describe the last machine that ran.
    """
    measured = (kernels_report or {}).get("cpu")
    if measured and measured.get("cpu_model") == hardware.get("cpu", {}).get("model"):
        return measured
    return None


def recommend_precision(hardware: dict, requested: str, measured: dict | None = None) -> tuple[bool, str]:
    """(bf16?, why) for this machine: what the plan calibrates and training uses.

    `measured` is the `cpu` section of reports/kernels.json: the kernels stage times one decoder layer in fp32 and
    bf16 on this machine and prefers bf16 only when it verified and won by its margin. On a CPU nothing else
    decides: the same flag (avx512_bf16) has measured slower than fp32 on one CPU and twice as fast on another, so a
    flag, a vendor or a number from another machine would be a guess. A CUDA GPU that torch can drive decides by its
    compute capability (bf16 tensor cores from 8.0 on, a property of the architecture).
    """
    if requested != "auto":
        return requested == "bf16", f"{requested} as configured (train.precision)"
    gpus = hardware.get("gpus") or []
    if gpus and hardware.get("torch", {}).get("cuda_available"):
        gpu = gpus[0]
        major, _, minor = str(gpu.get("compute_capability", "0.0")).partition(".")
        if (int(major), int(minor or 0)) >= (8, 0):
            return True, f"bf16: {gpu['name']} (compute capability {gpu['compute_capability']}) has bf16 tensor cores"
        return False, f"fp32: {gpu['name']} has no bf16 tensor cores (compute capability < 8.0)"
    preferred = (measured or {}).get("preferred_precision")
    if preferred in ("bf16", "fp32"):
        return preferred == "bf16", f"{preferred}, measured on this machine by the kernels stage: {measured['reason']}"
    return False, ("fp32: bf16 was not measured on this machine (reports/kernels.json has no `cpu` section; "
                   "`dvc repro kernels` measures it)")


def eager_attention_max_len(measured: dict | None, bf16: bool, gpu: bool = False) -> int:
    """Batches padded to at most this many tokens train with eager attention, longer ones with SDPA (0: SDPA only).

    From the kernels stage's timing of attention forward + backward on this CPU in the chosen precision
    (`training_attention`); nothing measured, or a GPU (its SDPA kernels are another matter): 0.
    """
    if gpu:
        return 0
    timed = (measured or {}).get("training_attention", {}).get("eager_max_len", {})
    return int(timed.get("bf16" if bf16 else "fp32", 0))


def keep_sdpa_off_cudnn() -> bool:
    """On a CUDA device, take cuDNN out of SDPA's backends for this process (flash and memory-efficient attention
    remain); returns whether it did. Nothing changes on a CPU.

    Why (torch.profiler on a lent GPU, docs/DECISIONS.md "On a lent GPU"): SDPA chose cuDNN, whose attention cost
    milliseconds of host time per call for microseconds on the GPU, most likely a plan built per shape, and dynamic
    padding gives a new length almost every batch. Without cuDNN the same steps reach the same loss faster.
    Process-wide, so evaluation in the same process gets it too."""
    import torch

    if not torch.cuda.is_available():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


def decide_machine(hardware: dict, measured: dict | None, precision_setting: str = "auto",
                   int8_setting: str | bool = "auto", methods: tuple[str, ...] = TRAINED_METHODS,
                   dims: tuple[int, int] | None = None, threads: int | None = None, ranks: int = 1) -> dict:
    """Every machine-dependent setting of a run, decided here and only here (the plan stage writes the result to
    reports/plan.json's `machine` section; frugaltune.resolve reads it for every consumer).

    - precision: `recommend_precision` (the kernels stage's measurement, a GPU's compute capability, or as set);
    - the attention crossover: `eager_attention_max_len`, measured by the kernels stage in that precision;
    - threads: physical cores, split between the ranks on one host (`cores`: how many this machine has, on which
      the federated stage lays out its clients' workers and its server's evaluation);
    - int8 products, per method in `methods`: `frugaltune.int8.decide`, which times int8 products against the
      precision's on this machine now (`dims`: the model's hidden and intermediate sizes; None: no int8).
    """
    import torch

    bf16, precision_why = recommend_precision(hardware, precision_setting, measured)
    gpus = hardware.get("gpus") or []
    cores = hardware.get("cpu", {}).get("physical_cores") or os.cpu_count() or 1
    decided = {
        "bf16": bf16, "precision": "bf16" if bf16 else "fp32", "precision_why": precision_why,
        "precision_setting": precision_setting, "cores": cores,
        "eager_attention_max_len": eager_attention_max_len(measured, bf16, bool(gpus)),
        "threads": threads or max(1, cores // ranks),
        "threads_why": ("as configured (train.threads)" if threads else
                        "physical cores: a second hyperthread adds contention, not FLOPs, to these matmuls"
                        + (f"; {ranks} processes share them" if ranks > 1 else "")),
        "int8": {}, "int8_setting": int8_setting_name(int8_setting),
    }
    if dims and methods:
        from frugaltune import int8

        ratio: dict = {}  # one timing serves every method: it depends on the precision and shapes alone
        for method in methods:
            if method == "none":
                decided["int8"][method] = {"on": False, "why": "nothing trains"}
                continue
            decided["int8"][method] = int8.decide(int8_setting, method, bf16, dims[0], dims[1],
                                                  bool(gpus) and torch.cuda.is_available(), ratio)
    return decided


def int8_setting_name(setting: str | bool) -> str:
    """`train.int8_products` as the plan records it: "auto", "true" or "false" (params may hold a YAML bool)."""
    return ("true" if setting else "false") if isinstance(setting, bool) else str(setting)


def memory_limit(hardware: dict, limit_gb: float | None) -> tuple[int, str]:
    if limit_gb:
        return int(limit_gb * GiB), f"probe.memory_limit_gb = {limit_gb:g}"
    memory = hardware.get("memory", {})
    cgroup = memory.get("cgroup_limit_bytes")
    if cgroup:
        return int(cgroup), "the cgroup memory limit"
    return int(memory.get("total_bytes", 0)), "the machine's RAM"


def _candidates(batch_size: int) -> list[int]:
    sizes, size = [], batch_size
    while size >= 1:
        sizes.append(size)
        if size == 1:
            break
        size = math.ceil(size / 2)
    return sizes


def plan_method(method: str, run: RunSpec, hardware: dict, shape: ModelShape, constants: Constants,
                limit_bytes: int, bf16: bool, devices: list[dict],
                schedule: tuple[int, list[tuple[int, int]]] | None = None) -> dict:
    """Fits or not, the recommended micro-batch / accumulation / checkpointing, predicted peak and ETA."""
    knobs = run.knobs.get(method, MethodKnobs())
    steps, batches = schedule or planned_batches(list(run.lengths), run.batch_size, run.grad_accum, run.epochs,
                                                 run.max_steps, run.seed, run.group_by_length)
    if method == "none":
        steps, batches = 0, []
    from frugaltune.training.batching import part_rows

    # The largest part the loop runs, in tokens, decides the peak; a batch of sequences at the cap bounds it.
    batches_or_cap = batches or [(run.batch_size, run.seq_len)]
    budget = int(limit_bytes * HEADROOM)
    # On CPU the ranks share the host's RAM, each with its own copy of the weights; a GPU rank has its own memory
    host_ranks = run.ranks if devices[0]["kind"] == "cpu" else 1
    if run.micro_batch_size != "auto":
        micro_options = [int(run.micro_batch_size)]
    else:
        micro_options = _candidates(run.batch_size)
    if run.gradient_checkpointing == "auto":
        ckpt_options = [False, True]
    else:
        ckpt_options = [bool(run.gradient_checkpointing)]
    # Fastest first: the largest micro-batch without checkpointing; checkpointing only when memory requires it.
    tried = []
    chosen = None
    for ckpt in ckpt_options:
        for micro in micro_options:
            split = math.ceil(run.batch_size / micro)
            # Every distinct part the loop runs: (rows, length, alone in its optimizer step), each rank computing its
            # share of a batch (every ranks-th sequence) in parts as the loop splits it. A part alone in its
            # step has backward's gradients replace the activations it frees (memory_estimate), so the peak is the
            # largest estimate over them, not always the largest part's.
            kinds = set()
            for rows, longest in batches_or_cap:
                mine = math.ceil(rows / run.ranks)
                part = part_rows(mine, longest, split, run.micro_batch_tokens)
                kinds.add((part, longest, run.grad_accum == 1 and run.ranks == 1 and part >= mine))
            estimates = {kind: memory_estimate(shape, method, bf16=bf16, micro_batch=kind[0], seq_len=kind[1],
                                               gradient_checkpointing=ckpt, constants=constants,
                                               device=devices[0]["kind"], knobs=knobs, gradients_overlap=kind[2])
                         for kind in kinds}
            worst = max(estimates, key=lambda kind: (estimates[kind]["peak"], kind[0] * kind[1]))
            est = estimates[worst]
            tried.append((micro, ckpt, est["peak"] * host_ranks))
            if est["peak"] * host_ranks <= budget:
                chosen = (micro, ckpt, est)
                break
        if chosen:
            break
    fits = chosen is not None
    micro, ckpt, est = chosen or (micro_options[-1], ckpt_options[-1], memory_estimate(
        shape, method, bf16=bf16, micro_batch=1, seq_len=worst[1], gradient_checkpointing=ckpt_options[-1],
        constants=constants, device=devices[0]["kind"], knobs=knobs))
    split = math.ceil(run.batch_size / micro)
    padded = sum(rows * length for rows, length in batches)
    if run.shared_prefix and not ckpt:  # each part computes the shared prefix once, not once per row
        parts = split * run.ranks
        padded -= sum(max(rows - parts, 0) * run.shared_prefix for rows, _ in batches)
    eta, eta_note = None, "no calibration: run `frugaltune plan` with calibration for an ETA"
    if constants.seconds_per_token is not None and method != "none":
        factor, calibrated = 1.0, constants.calibrated_method
        if calibrated and calibrated != method:
            factor = constants.method_cost.get(method) or FLOPS_FACTOR[method] / FLOPS_FACTOR[calibrated]
        recompute = 4 / 3 if ckpt else 1.0  # checkpointing reruns the forward pass: +1 forward per 3 passes
        eta = (constants.startup_s + (steps * constants.step_overhead_s
                                      + padded * constants.seconds_per_token * recompute) * factor)
        if not calibrated or calibrated == method:
            eta_note = "measured on this machine"
        elif method in constants.method_cost:
            eta_note = (f"the {calibrated} calibration x {factor:.2f}: a step of {method} timed here against one of "
                        f"{calibrated} on the same micro-batch")
        else:
            why = constants.not_timed.get(method, "not asked for")
            eta_note = (f"the {calibrated} calibration x {factor:.2f} (training FLOPs per token: {method} not timed: "
                        f"{why})")
    elif method == "none":
        eta, eta_note = 0.0, "nothing to train"
    calibrated, ratio = constants.calibrated_method, constants.measured_ratio(method, ckpt)
    peak_note = None
    if ratio is not None:
        peak_note = (f"activations: {calibrated}'s x {ratio:.2f}, the bytes {method} saved for backward against "
                     f"{calibrated}'s on the same rows here")
    elif calibrated and method not in (calibrated, "none"):
        peak_note = f"activations: {method}'s analytic bytes per token at {calibrated}'s measured scale"
    grad_accum = run.grad_accum * split
    reasons = []
    if method == "none":
        reasons.append("inference only: weights and one batch of hidden states")
    elif fits:
        if split > 1:
            reasons.append(f"micro-batch {run.batch_size} does not fit; {micro} x {grad_accum} accumulation keeps the "
                           f"effective batch {run.batch_size * run.grad_accum}")
        if ckpt and run.gradient_checkpointing == "auto":
            reasons.append("gradient checkpointing on: without it even micro-batch 1 exceeds the budget")
        if not reasons:
            reasons.append("fits as configured: no gradient checkpointing (it would cost ~33% time)")
    return {
        "fits": fits,
        "predicted_peak_bytes": est["peak"],
        "predicted_peak_mb": round(est["peak"] / MiB),
        "ranks": run.ranks,
        "predicted_peak_all_ranks_mb": round(est["peak"] * host_ranks / MiB),
        "components_mb": {k: round(v / MiB, 1) for k, v in est.items() if k != "peak"},
        "micro_batch_size": micro,
        "grad_accum": grad_accum,
        "effective_batch": run.batch_size * run.grad_accum,
        "gradient_checkpointing": ckpt,
        "precision": "bf16" if bf16 else "fp32",
        "seq_len": run.seq_len,
        "largest_batch": {"sequences": worst[0], "length": worst[1]},  # the largest part the loop runs
        "steps": steps,
        "padded_tokens": padded,  # the tokens the model computes: padding counted, shared prefixes once per part
        "shared_prefix": run.shared_prefix if not ckpt else 0,
        "eta_seconds": None if eta is None else round(eta, 1 if eta >= 10 else 4),  # tiny test runs take ms
        "eta_note": eta_note,
        "peak_note": peak_note,
        "trainable_params": shape.trainable_params,
        "total_params": shape.total_params,
        "why": "; ".join(reasons) if fits else _does_not_fit(method, tried, budget, limit_bytes),
    }


def _does_not_fit(method: str, tried: list, budget: int, limit: int) -> str:
    smallest = min(peak for _, _, peak in tried)
    return (f"{method}: even the smallest option tried (micro-batch {tried[-1][0]}, gradient checkpointing "
            f"{'on' if tried[-1][1] else 'off'}) needs {smallest / GiB:.2f} GiB, over the budget of "
            f"{budget / GiB:.2f} GiB ({HEADROOM:.0%} of the {limit / GiB:.2f} GiB limit)")


def make_plan(run: RunSpec, hardware: dict, shapes: dict[str, ModelShape], constants: Constants,
              limit_gb: float | None = None, calibration: dict | None = None,
              measured_precision: dict | None = None, decided: dict | None = None) -> dict:
    """The plan for every method in `shapes`; `run.method` is the configured one.

    `decided`: the machine decisions (`decide_machine`; decided here without int8 products when None).
    `measured_precision`: the `cpu` section of reports/kernels.json (see `recommend_precision`). The plan's `run`
    section is what the configured run resolves to; the train stage depends on exactly those keys, so a
    recalibration that changes only the ETA or the predicted peak retrains nothing.
    """
    decided = decided or decide_machine(hardware, measured_precision, run.precision, "false", (),
                                        threads=run.threads, ranks=run.ranks)
    limit, limit_source = memory_limit(hardware, limit_gb)
    bf16 = decided["bf16"]
    gpus = hardware.get("gpus") or []
    devices = [{"kind": "cuda", "name": g["name"], "memory_bytes": g["memory_total_bytes"]} for g in gpus] or [
        {"kind": "cpu", "name": hardware.get("cpu", {}).get("model", "CPU"), "memory_bytes": limit}]
    if gpus:  # weights and activations live on the first GPU; its memory is the limit that matters
        limit, limit_source = int(gpus[0]["memory_total_bytes"]), f"{gpus[0]['name']} memory"
    schedule = planned_batches(list(run.lengths), run.batch_size, run.grad_accum, run.epochs, run.max_steps,
                               run.seed, run.group_by_length)
    methods = {m: plan_method(m, run, hardware, s, constants, limit, bf16, devices, schedule)
               for m, s in shapes.items()}
    for method, entry in methods.items():
        entry["int8_products"] = bool(decided["int8"].get(method, {}).get("on", False))
    configured = methods.get(run.method)
    fitting = [m for m, p in methods.items() if p["fits"] and m != "none"]
    return {
        "configured_method": run.method,
        "fits": bool(configured and configured["fits"]),
        # What the configured run resolves to: the train and evaluate stages depend on these keys alone.
        "run": {"method": run.method, "precision": decided["precision"],
                "micro_batch_size": configured["micro_batch_size"] if configured else run.batch_size,
                "gradient_checkpointing": bool(configured["gradient_checkpointing"]) if configured else False,
                "eager_attention_max_len": decided["eager_attention_max_len"],
                "int8_products": bool(configured and configured["int8_products"])},
        # Every machine decision, made once (decide_machine): frugaltune.resolve reads them for every consumer
        "machine": decided,
        "device": devices[0],
        "memory_limit_bytes": limit,
        "memory_limit_source": limit_source,
        "budget_bytes": int(limit * HEADROOM),
        "threads": decided["threads"],
        "threads_why": decided["threads_why"],
        "ranks": run.ranks,
        "precision": decided["precision"],
        "precision_why": decided["precision_why"],
        "constants": asdict(constants),
        "calibration": calibration,
        "methods": methods,
        "methods_that_fit": fitting,
        "gpus_note": None if gpus else (hardware.get("gpu_note") or "no NVIDIA GPU: planning for CPU RAM"),
    }


def check_fits(plan: dict, method: str | None = None) -> dict:
    """The plan of `method` (default: the configured one), or PlanError saying what to change."""
    method = method or plan["configured_method"]
    entry = plan["methods"].get(method)
    if entry is None:
        raise PlanError(f"reports/plan.json has no plan for train.method = {method}: run `dvc repro plan`.")
    if entry["fits"] or method == "none":
        return entry
    # The fastest fitting method first: the largest micro-batch, then the fewest training FLOPs, then the least memory.
    others = sorted((-p["micro_batch_size"], FLOPS_FACTOR[m], p["predicted_peak_bytes"], m)
                    for m, p in plan["methods"].items() if p["fits"] and m != "none")
    if others:
        best = plan["methods"][others[0][3]]
        suggestion = (f"train.method: {others[0][3]} fits (predicted peak {best['predicted_peak_bytes'] / GiB:.2f} GiB "
                      f"at micro-batch {best['micro_batch_size']})")
    else:
        suggestion = "no method fits: lower tokenize.max_length or train.batch_size, or use a machine with more memory"
    raise PlanError(
        f"train.method = {method} cannot fit: predicted peak {entry['predicted_peak_bytes'] / GiB:.2f} GiB with "
        f"micro-batch {entry['micro_batch_size']}, gradient checkpointing "
        f"{'on' if entry['gradient_checkpointing'] else 'off'}; the limit is {plan['memory_limit_bytes'] / GiB:.2f} GiB "
        f"({plan['memory_limit_source']}, {HEADROOM:.0%} usable). Change: {suggestion}; or raise probe.memory_limit_gb "
        "if the machine has more memory than that."
    )


def method_knobs(params: "Params") -> dict[str, MethodKnobs]:
    """`train.<method>` as the planner sees it (adapter rank, targets, quantization)."""
    knobs = {}
    for method in ADAPTER_METHODS:
        k = getattr(params.train, method)
        extra = {"quant_type": k.quant_type, "double_quant": k.double_quant} if method == "qlora" else {}
        knobs[method] = MethodKnobs(r=k.r, alpha=k.alpha, dropout=k.dropout,
                                    target_modules=tuple(k.target_modules), last_layers=k.last_layers, **extra)
    return knobs


def run_spec(params: "Params", lengths: list[int]) -> RunSpec:
    tp = params.train
    return RunSpec(
        method=tp.method, batch_size=tp.batch_size, grad_accum=tp.grad_accum, epochs=tp.epochs,
        max_steps=tp.max_steps, seq_len=params.tokenize.max_length, lengths=tuple(lengths), seed=params.common.seed,
        group_by_length=tp.group_by_length, precision=tp.precision, micro_batch_size=tp.micro_batch_size,
        gradient_checkpointing=tp.gradient_checkpointing, threads=tp.threads, knobs=method_knobs(params),
        ranks=tp.distributed.nproc_per_node, micro_batch_tokens=tp.micro_batch_tokens,
    )


def common_prompt_prefix(input_ids: list[list[int]], labels: list[list[int]]) -> int:
    """How many leading tokens every causal_lm example has in common before its first scored prediction (the
    training loop reads them once per batch: `frugaltune.training.loop.shared_prefix_length`); 0 when fewer than
    the loop's minimum. Every batch shares at least these; the ETA still comes out low, because a token read once
    for the batch saves less than a row's token costs (docs/DECISIONS.md)."""
    from frugaltune.generation import _common_prefix_length
    from frugaltune.training.batching import IGNORE_INDEX
    from frugaltune.training.loop import LoopConfig

    if len(input_ids) < 2:
        return 0
    length = min(_common_prefix_length(input_ids), min(len(ids) for ids in input_ids) - 1)
    for targets in labels:  # the logit before a row's first target token is its own
        scored = next((i for i, t in enumerate(targets) if t != IGNORE_INDEX), len(targets))
        length = min(length, max(scored - 1, 0))
    return length if length >= LoopConfig.shared_prefix_min else 0


def build_plan(params: "Params", hardware: dict[str, Any], measured_precision: dict | None = None,
               run_calibration: bool | None = None, memory_limit_gb: float | None = None,
               methods: tuple[str, ...] | None = None, log=print, model=None) -> dict[str, Any]:
    """The plan for this project's model, data and params on `hardware` (the `plan` stage and `frugaltune plan`).

    Run from the project root. `measured_precision` is the `cpu` section of reports/kernels.json; the
    calibration steps run in the precision the plan chose, so the constants describe the run that will train.
    `model` (a `frugaltune.shapes.PlannedModel`, `frugaltune plan --model`): plan that model instead of
    models/base, its shape from its config, its calibration on its `weights_dir()` (random weights of its shape
    when it has none); the rows stay the project's, tokenized by models/base's tokenizer.
    """
    from frugaltune import paths

    for needed, stage in ((paths.BASE_MODEL, "import_model"), (paths.TOKENIZED_DIR, "tokenize"),
                          (paths.LABELS, "ingest")):
        if not needed.exists():
            raise FileNotFoundError(f"{needed} is missing: run `dvc repro {stage}` first (the plan needs it).")
    run_calibration = params.probe.calibrate if run_calibration is None else run_calibration
    # The calibration's process starts now: its imports run beside this function's own work (the data, the shapes,
    # the machine's decisions) instead of after it. Closed unused when the run is not calibrated.
    worker = CalibrationWorker(params.train.allocator) if run_calibration and params.train.method != "none" else None
    try:
        return _build_plan(params, hardware, measured_precision, run_calibration, memory_limit_gb, methods, log, worker,
                           model)
    finally:
        if worker:
            worker.close()


def _build_plan(params: "Params", hardware: dict[str, Any], measured_precision: dict | None, run_calibration: bool,
                memory_limit_gb: float | None, methods: tuple[str, ...] | None, log,
                worker: CalibrationWorker | None, model=None) -> dict[str, Any]:
    from datasets import load_from_disk

    from frugaltune import paths
    from frugaltune.models import load_tokenizer
    from frugaltune.training import setup

    labels = json.loads(paths.LABELS.read_text())["labels"]
    train_split = load_from_disk(str(paths.TOKENIZED_DIR))["train"]
    tokenizer = load_tokenizer(paths.BASE_MODEL)
    rows = setup.training_rows(params, train_split["input_ids"], tokenizer)  # as the model sees them (template)
    lengths = [len(ids) for ids in rows]
    spec = run_spec(params, lengths)
    if params.task.type == "causal_lm":
        spec = replace(spec, shared_prefix=common_prompt_prefix(train_split["input_ids"], train_split["labels"]))
    knobs = spec.knobs
    methods = methods or ("none", *TRAINED_METHODS)
    task = params.task.type
    config_dir = model.config_dir if model else paths.BASE_MODEL  # --model: its config, weights or not
    shapes = {m: model_shape(config_dir, max(len(labels), 1), m, knobs.get(m, MethodKnobs()), task)
              for m in methods}
    limit_gb = memory_limit_gb if memory_limit_gb is not None else params.probe.memory_limit_gb
    some_shape = next(iter(shapes.values()))
    decided = decide_machine(hardware, measured_precision, spec.precision, params.train.int8_products, methods,
                             (some_shape.hidden, some_shape.intermediate), spec.threads, spec.ranks)
    draft = make_plan(spec, hardware, shapes, Constants(), limit_gb, measured_precision=measured_precision,
                      decided=decided)
    method = spec.method
    if not run_calibration or method == "none" or not draft["methods"][method]["fits"]:
        if run_calibration and method != "none":
            log(f"plan: not calibrating: {method} does not fit by the analytic model")
        return draft
    entry = draft["methods"][method]
    loop = setup.loop_config(params, method=method, bf16=decided["bf16"], micro_batch_size=entry["micro_batch_size"],
                             eager_attention_max_len=decided["eager_attention_max_len"])
    log(f"plan: calibrating {method} in {entry['precision']}: the run's own loop over "
        f"{2 * params.probe.calibration_steps - 1} of its micro-batches at most ...")
    _, order = planned_order(lengths, spec.batch_size, spec.grad_accum, spec.epochs, spec.max_steps, spec.seed,
                             spec.group_by_length)
    # --model without weights: random weights of its shape, written only now that the calibration runs
    weights = model.weights_dir() if model else paths.BASE_MODEL
    constants, calibration = calibrate(
        weights, labels, tokenizer.pad_token_id, method, knobs.get(method, MethodKnobs()), shapes[method],
        rows=rows, targets=list(train_split["labels"]), order=order, loop=asdict(loop),
        int8=decided["int8"].get(method, {"on": False, "why": "not decided"}),
        gradient_checkpointing=entry["gradient_checkpointing"], threads=decided["threads"], seed=params.common.seed,
        time_samples=params.probe.calibration_steps, allocator=params.train.allocator, task=task,
        # every other method the plan lists and memory allows, timed on one micro-batch: each gets its own ETA
        others=[{"method": m, "knobs": knobs.get(m, MethodKnobs()),
                 "int8": decided["int8"].get(m, {"on": False, "why": "not decided"})}
                for m in sorted(methods, key=lambda m: TIMING_ORDER.index(m) if m in TIMING_ORDER else 0)
                if m not in ("none", method) and draft["methods"][m]["fits"]],
        worker=worker, planned=(entry["steps"], entry["padded_tokens"]), stop_when_busy=True)
    if calibration["busy_note"]:
        log(f"plan: {calibration['busy_note']}")
    plan = make_plan(spec, hardware, shapes, constants, limit_gb, calibration, measured_precision=measured_precision,
                     decided=decided)
    eta = plan["methods"][method]["eta_seconds"]
    # What planning cost against what it plans (the calibration should stay a small share of the run)
    calibration["share_of_run"] = round(calibration["seconds"] / eta, 3) if eta else None
    return plan


def render(plan: dict) -> str:
    """The plan as a table a person reads, each choice explained."""
    dev = plan["device"]
    lines = [
        f"Plan for {dev['name']} ({dev['kind']}): memory limit {plan['memory_limit_bytes'] / GiB:.1f} GiB "
        f"({plan['memory_limit_source']}), budget {plan['budget_bytes'] / GiB:.1f} GiB; {plan['threads']} threads; "
        f"precision {plan['precision']} ({plan['precision_why']}).",
        f"Constants: {plan['constants']['source']}.",
    ]
    if plan.get("gpus_note"):
        lines.append(plan["gpus_note"])
    header = f"{'method':9s} {'fits':5s} {'peak GiB':>8s} {'micro':>5s} {'accum':>5s} {'ckpt':>4s} {'ETA':>9s}  why"
    lines += ["", header, "-" * len(header)]
    # a method the calibration did not time (its budget spent, or not buildable here): its ETA is the calibrated
    # method's scaled by training FLOPs, marked so that it does not read as measured
    not_timed = (plan.get("constants") or {}).get("not_timed") or {}
    for method, p in plan["methods"].items():
        eta = "-" if p["eta_seconds"] is None else ("~" if method in not_timed else "") + _duration(p["eta_seconds"])
        mark = "*" if method == plan["configured_method"] else " "
        lines.append(f"{method + mark:9s} {'yes' if p['fits'] else 'NO':5s} {p['predicted_peak_bytes'] / GiB:8.2f} "
                     f"{p['micro_batch_size']:5d} {p['grad_accum']:5d} {'on' if p['gradient_checkpointing'] else 'off':>4s} "
                     f"{eta:>9s}  {p['why']}")
    lines.append("* configured (train.method). ETA: training wall time; " + next(
        (p["eta_note"] for m, p in plan["methods"].items() if m == plan["configured_method"]), ""))
    shown = [m for m in plan["methods"] if m in not_timed and plan["methods"][m]["eta_seconds"]]
    if shown:
        reasons = sorted({not_timed[m] for m in shown})
        lines.append(f"~ not timed here ({', '.join(shown)}: {'; '.join(reasons)}): the "
                     f"{plan['constants'].get('calibrated_method')} calibration scaled by training FLOPs per token")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--calibration-worker"]:
        _worker_main()
        return
    sys.exit("usage: frugaltune plan   (this module's own entry point is internal: --calibration-worker)")


if __name__ == "__main__":
    main()
