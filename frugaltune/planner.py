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
- gradients: 4 bytes per trainable param; AdamW: 8 bytes per trainable param.
- activations, saved for backward, per token per decoder layer (llama-style block, RMSNorm + GQA + gated MLP):
  `16 h + 5 i` values (h hidden, i intermediate), plus `h + r` per LoRA-adapted module (dropout output + A
  output), plus `h` per DoRA module; 2 bytes each under bf16 autocast, 4 in fp32. Gradient checkpointing keeps
  one `h` per layer and recomputes one layer at a time. The peak comes from the largest micro-batch of the run
  (its sequences x its longest length), which is known before training: the batch order is fixed by the seed.
- runtime: the interpreter, torch and transformers (0.55 GiB on CPU before calibration; + 0.5 GiB CUDA context
  on a GPU).

Calibration (`calibrate`) runs a few real training steps of the configured method at two micro-batch sizes, each
in a fresh subprocess (a clean peak RSS), and fits `peak = static + per_sequence x batch` and
`step_time = overhead + per_token x tokens`. The memory fit rescales the activation constant and replaces the
runtime constant; the time fit turns the run's exact padded-token count into an ETA, plus a one-time startup: what
the first step at the peak shape costs beyond a warm one (page faults for the memory the run keeps; on a 20-step
run it is a fifth of the time, on the default 178-step run ~3%). Calibration runs on the training process's malloc
(`train.allocator`, see frugaltune/allocator.py). Methods other than the
calibrated one reuse its constants, their time scaled by the training FLOPs per token (6N full, 4N adapters).
"""

from __future__ import annotations

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
    source: str = "analytic defaults (not calibrated)"


def weight_bytes(shape: ModelShape, method: str, knobs: MethodKnobs = MethodKnobs()) -> int:
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


def memory_estimate(shape: ModelShape, method: str, *, bf16: bool, micro_batch: int, seq_len: int,
                    gradient_checkpointing: bool, constants: Constants = Constants(), device: str = "cpu",
                    knobs: MethodKnobs = MethodKnobs()) -> dict[str, int]:
    """Peak bytes by component for one device; `peak_tokens` = the largest micro-batch's sequences x length."""
    trains = method != "none"
    tokens = micro_batch * seq_len
    parts = {
        "runtime": constants.runtime_bytes + (CUDA_CONTEXT_BYTES if device != "cpu" else 0),
        "weights": weight_bytes(shape, method, knobs),
        "gradients": 4 * shape.trainable_params if trains else 0,
        "optimizer": 8 * shape.trainable_params if trains else 0,
        "activations": int(constants.activation_scale * tokens
                           * activation_bytes_per_token(shape, bf16, gradient_checkpointing)) if trains
        else int(tokens * shape.hidden * 4 * 4),  # inference: a few live hidden states
        "logits": tokens * shape.num_labels * 4 * (3 if trains else 1),
    }
    parts["peak"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------------------------- the run's batches
def planned_batches(lengths: list[int], batch_size: int, grad_accum: int, epochs: float, max_steps: int | None,
                    seed: int, group_by_length: bool = True) -> tuple[int, list[tuple[int, int]]]:
    """(optimizer steps, [(sequences, longest length)] of every micro-batch the training loop will run).

    The same order as `frugaltune.training.loop` (seeded, length-grouped), so the largest batch and the padded
    token count are exact, not averages.
    """
    import torch

    from frugaltune.training.batching import length_grouped_batches

    per_epoch = math.ceil(len(lengths) / batch_size)
    steps = max_steps or max(1, math.ceil(epochs * math.ceil(per_epoch / grad_accum)))
    micro = steps * grad_accum
    batches: list[tuple[int, int]] = []
    epoch = 0
    while len(batches) < micro:
        generator = torch.Generator().manual_seed(seed * 1000 + epoch)
        for batch in length_grouped_batches(lengths, batch_size, generator, group_by_length):
            batches.append((len(batch), max(lengths[i] for i in batch)))
        epoch += 1
    return steps, batches[:micro]


# ---------------------------------------------------------------------------------------------- calibration
def _calibration_point(spec: dict) -> dict:
    """Run in a fresh process: load the model for `spec['method']`, time a few training steps, report peak RSS."""
    import resource

    import torch

    from frugaltune.training.batching import IGNORE_INDEX
    from frugaltune.training.loop import autocast, model_loss
    from frugaltune.training.methods import prepare_model

    torch.set_num_threads(spec["threads"])
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
    causal = spec.get("task") == "causal_lm"
    model = prepare_model(spec["model_dir"], spec["labels"], spec["pad_token_id"], spec["seed"], spec["method"],
                          spec["knobs"], spec["bf16"], spec["gradient_checkpointing"], task=spec.get("task",
                                                                                                  "classification"))
    loaded_rss = rss()
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(spec["seed"])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    model.train()

    def timed_step(rows: int, length: int) -> float:
        """One training step (forward, backward, clipping, AdamW) on a random batch of this shape; its seconds."""
        ids = torch.randint(3, spec["vocab_size"], (rows, length), generator=generator).to(device)
        if causal:  # the run's targets: each row's last `response_tokens` (its response), the rest masked
            labels = ids.clone()
            labels[:, :max(0, length - (spec.get("response_tokens") or length))] = IGNORE_INDEX
        else:
            labels = torch.randint(0, len(spec["labels"]), (rows,), generator=generator).to(device)
        start = time.perf_counter()
        with autocast(spec["bf16"], device):
            loss = model_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    from frugaltune.training.fast import use_short_sequence_attention

    # the attention the run will use (measured crossover), so that what is timed is what trains
    use_short_sequence_attention(model, spec.get("eager_attention_max_len", 0))
    batch, length = spec["micro_batch"], spec["seq_len"]
    first = timed_step(batch, length)  # warm-up: page faults for the peak memory, kernel selection
    times = sorted(timed_step(batch, length) for _ in range(spec["steps"]))
    from frugaltune import allocator

    result = {"micro_batch": batch, "seq_len": length, "loaded_rss_bytes": loaded_rss, "peak_rss_bytes": rss(),
              "step_seconds": times[len(times) // 2], "first_step_seconds": first, "timed": [],
              "allocator": allocator.active()}
    if device.type == "cuda":
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    # Time: batches shaped like the run's own (smaller than the memory point, so the peak above stands). Each
    # shape runs once, as in training, where a new shape costs fresh allocations and page faults.
    result["timed"] = [[rows * length, timed_step(rows, length)] for rows, length in spec.get("time_shapes", [])]
    return result


def _run_point(spec: dict, timeout_s: float) -> dict:
    from frugaltune import allocator

    # The training process's malloc (train.allocator): RSS depends on it as much as on the tensors.
    proc = subprocess.run([sys.executable, "-m", "frugaltune.planner", "--calibration-point", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**allocator.child_env(spec.get("allocator", "auto")), "TQDM_DISABLE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"calibration step failed (micro-batch {spec['micro_batch']}, length {spec['seq_len']}):"
                           f"\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _time_shapes(batches: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """`count` of the run's micro-batches at evenly spaced quantiles of their size (tokens incl. padding)."""
    if not batches:
        return []
    ranked = sorted(set(batches), key=lambda b: b[0] * b[1])
    picks = {ranked[min(len(ranked) - 1, round(q * (len(ranked) - 1) / max(count - 1, 1)))] for q in range(count)}
    return sorted(picks, key=lambda b: b[0] * b[1])


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


def calibrate(model_dir: Path | str, labels: list[str], pad_token_id: int, method: str, knobs: MethodKnobs,
              shape: ModelShape, *, bf16: bool, gradient_checkpointing: bool, micro_batches: tuple[int, int],
              seq_len: int, threads: int, seed: int = 0, steps: int = 2, timeout_s: float = 900,
              batches: list[tuple[int, int]] | None = None, time_samples: int = 6,
              allocator: str = "auto", task: str = "classification",
              response_tokens: int | None = None, eager_attention_max_len: int = 0) -> tuple[Constants, dict]:
    """Measure real training steps of `method` on this machine and fit its memory and time constants.

    Memory: `steps` steps (after one warm-up) at two micro-batch sizes of length `seq_len`, each in a fresh process;
    the peak RSS after them includes what the allocator keeps across steps. Time: `time_samples` of the run's own
    micro-batch shapes (`batches`, from `planned_batches`), each once, fitted by least squares. The steps run on
    `allocator` (`train.allocator`), the malloc the training process will have. causal_lm: the last
    `response_tokens` tokens of each row are the targets, as the run's responses are (None: every token).
    """
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    spec = {"model_dir": str(model_dir), "labels": labels, "pad_token_id": pad_token_id, "seed": seed,
            "method": method, "knobs": asdict(knobs), "bf16": bf16, "gradient_checkpointing": gradient_checkpointing,
            "seq_len": seq_len, "threads": threads, "steps": steps, "vocab_size": vocab, "allocator": allocator,
            "task": task, "response_tokens": response_tokens, "eager_attention_max_len": eager_attention_max_len}
    small, large = sorted(set(micro_batches))[:2] if len(set(micro_batches)) > 1 else (micro_batches[0],
                                                                                     micro_batches[0] + 1)
    shapes_to_time = _time_shapes(batches or [(large, seq_len), (small, seq_len)], time_samples)
    points = [_run_point({**spec, "micro_batch": small}, timeout_s),
              _run_point({**spec, "micro_batch": large, "time_shapes": shapes_to_time}, timeout_s)]
    per_token = activation_bytes_per_token(shape, bf16, gradient_checkpointing)
    static = sum(v for k, v in memory_estimate(shape, method, bf16=bf16, micro_batch=0, seq_len=seq_len,
                                               gradient_checkpointing=gradient_checkpointing, knobs=knobs,
                                               constants=Constants(runtime_bytes=0)).items() if k != "peak")
    p1, p2 = points
    tokens1, tokens2 = p1["micro_batch"] * seq_len, p2["micro_batch"] * seq_len
    slope = (p2["peak_rss_bytes"] - p1["peak_rss_bytes"]) / (tokens2 - tokens1)
    # A non-positive slope means RSS noise swamped the activations (tiny models): keep the analytic constant.
    scale = slope / per_token if slope > 0 else 1.0
    runtime = p1["peak_rss_bytes"] - scale * per_token * tokens1 - static
    timed = p2["timed"] or [[tokens1, p1["step_seconds"]], [tokens2, p2["step_seconds"]]]
    overhead, per_token_s = _fit_line([(x, y) for x, y in timed])
    # What the first step at the peak shape costs beyond a warm one: paid once by the run (a fresh process too).
    startup = max(0.0, p2.get("first_step_seconds", p2["step_seconds"]) - p2["step_seconds"])
    constants = Constants(runtime_bytes=max(0, int(runtime)), activation_scale=round(scale, 4),
                          step_overhead_s=overhead, seconds_per_token=per_token_s, startup_s=round(startup, 3),
                          calibrated_method=method,
                          source=f"calibrated: {steps} {method} steps at micro-batch {small} and {large}, length "
                                 f"{seq_len} (memory), {len(timed)} of the run's batch shapes (time), {threads} threads, "
                                 f"malloc {p2['allocator']}")
    return constants, {"points": points, "method": method, "seq_len": seq_len, "bf16": bf16,
                       "allocator": p2["allocator"],
                       "gradient_checkpointing": gradient_checkpointing}


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
    decides: the same flag (avx512_bf16) has measured 0.7x fp32 on one Xeon and 2.3x on a Zen 4, so a flag, a
    vendor or a number from another machine would be a guess. A CUDA GPU that torch can drive decides by its
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

    Measured on an H100 (torch 2.11.0+cu130, LoRA, length-grouped batches of 16 tweets; torch.profiler): SDPA chose
    cuDNN, whose attention took 4.2 ms of host time per call forward and 4.4 ms backward for ~15 us on the GPU,
    44% of the step's host time. Most likely a plan built per shape: dynamic padding gives a new length almost every
    batch, and the Trainer recipe padded to a fixed 128 ran faster despite 74% padding. Without cuDNN, 160 steps
    took 31.5 s instead of 47.5 s (1.51x) to the same final loss (5 digits). Process-wide, so evaluation in the same
    process gets it too."""
    import torch

    if not torch.cuda.is_available():
        return False
    torch.backends.cuda.enable_cudnn_sdp(False)
    return True


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
    # The largest micro-batch, in tokens, decides the peak; a batch of sequences at the cap bounds it.
    worst = max(batches, key=lambda b: b[0] * b[1]) if batches else (run.batch_size, run.seq_len)
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
            # each rank computes its share of a batch (every ranks-th sequence), in `split` parts
            worst_rows = math.ceil(math.ceil(worst[0] / run.ranks) / split)
            est = memory_estimate(shape, method, bf16=bf16, micro_batch=worst_rows, seq_len=worst[1],
                                  gradient_checkpointing=ckpt, constants=constants, device=devices[0]["kind"],
                                  knobs=knobs)
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
        factor = 1.0
        if constants.calibrated_method and constants.calibrated_method != method:
            factor = FLOPS_FACTOR[method] / FLOPS_FACTOR[constants.calibrated_method]
        recompute = 4 / 3 if ckpt else 1.0  # checkpointing reruns the forward pass: +1 forward per 3 passes
        eta = (constants.startup_s + steps * constants.step_overhead_s
               + padded * constants.seconds_per_token * factor * recompute)
        eta_note = ("measured on this machine" if factor == 1.0 else
                    f"from the {constants.calibrated_method} calibration x {factor:.2f} (training FLOPs per token)")
    elif method == "none":
        eta, eta_note = 0.0, "nothing to train"
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
        "largest_batch": {"sequences": math.ceil(math.ceil(worst[0] / run.ranks) / split), "length": worst[1]},
        "steps": steps,
        "padded_tokens": padded,  # the tokens the model computes: padding counted, shared prefixes once per part
        "shared_prefix": run.shared_prefix if not ckpt else 0,
        "eta_seconds": None if eta is None else round(eta, 1 if eta >= 10 else 4),  # tiny test runs take ms
        "eta_note": eta_note,
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
              measured_precision: dict | None = None) -> dict:
    """The plan for every method in `shapes`; `run.method` is the configured one.

    `measured_precision`: the `cpu` section of reports/kernels.json (see `recommend_precision`). The plan's `run`
    section is what the configured run resolves to; the train stage depends on exactly those keys, so a
    recalibration that changes only the ETA or the predicted peak retrains nothing.
    """
    limit, limit_source = memory_limit(hardware, limit_gb)
    bf16, precision_why = recommend_precision(hardware, run.precision, measured_precision)
    gpus = hardware.get("gpus") or []
    devices = [{"kind": "cuda", "name": g["name"], "memory_bytes": g["memory_total_bytes"]} for g in gpus] or [
        {"kind": "cpu", "name": hardware.get("cpu", {}).get("model", "CPU"), "memory_bytes": limit}]
    if gpus:  # weights and activations live on the first GPU; its memory is the limit that matters
        limit, limit_source = int(gpus[0]["memory_total_bytes"]), f"{gpus[0]['name']} memory"
    cores = hardware.get("cpu", {}).get("physical_cores") or os.cpu_count() or 1
    threads = run.threads or max(1, cores // run.ranks)  # per process: ranks on one CPU split its cores
    schedule = planned_batches(list(run.lengths), run.batch_size, run.grad_accum, run.epochs, run.max_steps,
                               run.seed, run.group_by_length)
    methods = {m: plan_method(m, run, hardware, s, constants, limit, bf16, devices, schedule)
               for m, s in shapes.items()}
    configured = methods.get(run.method)
    fitting = [m for m, p in methods.items() if p["fits"] and m != "none"]
    return {
        "configured_method": run.method,
        "fits": bool(configured and configured["fits"]),
        # What the configured run resolves to: the train and evaluate stages depend on these keys alone.
        "run": {"method": run.method, "precision": "bf16" if bf16 else "fp32",
                "micro_batch_size": configured["micro_batch_size"] if configured else run.batch_size,
                "gradient_checkpointing": bool(configured["gradient_checkpointing"]) if configured else False,
                "eager_attention_max_len": eager_attention_max_len(measured_precision, bf16, bool(gpus))},
        "device": devices[0],
        "memory_limit_bytes": limit,
        "memory_limit_source": limit_source,
        "budget_bytes": int(limit * HEADROOM),
        "threads": threads,
        "threads_why": ("physical cores: a second hyperthread adds contention, not FLOPs, to these matmuls" +
                        (f"; {run.ranks} processes share them" if run.ranks > 1 and not run.threads else "")),
        "ranks": run.ranks,
        "precision": "bf16" if bf16 else "fp32",
        "precision_why": precision_why,
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
        ranks=tp.distributed.nproc_per_node,
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
               methods: tuple[str, ...] | None = None, log=print) -> dict[str, Any]:
    """The plan for this project's model, data and params on `hardware` (the `plan` stage and `frugaltune plan`).

    Run from the project root. `measured_precision` is the `cpu` section of reports/kernels.json; the
    calibration steps run in the precision the plan chose, so the constants describe the run that will train.
    """
    from datasets import load_from_disk

    from frugaltune import paths
    from frugaltune.training.batching import target_counts

    for needed, stage in ((paths.BASE_MODEL, "import_model"), (paths.TOKENIZED_DIR, "tokenize"),
                          (paths.LABELS, "ingest")):
        if not needed.exists():
            raise FileNotFoundError(f"{needed} is missing: run `dvc repro {stage}` first (the plan needs it).")
    labels = json.loads(paths.LABELS.read_text())["labels"]
    train_split = load_from_disk(str(paths.TOKENIZED_DIR))["train"]
    lengths = [len(ids) for ids in train_split["input_ids"]]
    spec = run_spec(params, lengths)
    if params.task.type == "causal_lm":
        spec = replace(spec, shared_prefix=common_prompt_prefix(train_split["input_ids"], train_split["labels"]))
    # causal_lm: the loss (and so the LM head) runs on the response tokens only; the calibration steps do the same
    response_tokens = (math.ceil(sum(target_counts(train_split["labels"])) / max(len(lengths), 1))
                       if params.task.type == "causal_lm" else None)
    knobs = spec.knobs
    methods = methods or ("none", *TRAINED_METHODS)
    task = params.task.type
    shapes = {m: model_shape(paths.BASE_MODEL, max(len(labels), 1), m, knobs.get(m, MethodKnobs()), task)
              for m in methods}
    limit_gb = memory_limit_gb if memory_limit_gb is not None else params.probe.memory_limit_gb
    draft = make_plan(spec, hardware, shapes, Constants(), limit_gb, measured_precision=measured_precision)
    run_calibration = params.probe.calibrate if run_calibration is None else run_calibration
    method = spec.method
    if not run_calibration or method == "none" or not draft["methods"][method]["fits"]:
        if run_calibration and method != "none":
            log(f"plan: not calibrating: {method} does not fit by the analytic model")
        return draft
    entry = draft["methods"][method]
    from frugaltune.models import load_tokenizer

    large = entry["largest_batch"]["sequences"]
    split = math.ceil(spec.batch_size / entry["micro_batch_size"])  # the plan's parts of each batch
    log(f"plan: calibrating {method} in {entry['precision']}: {params.probe.calibration_steps} steps at micro-batch "
        f"{max(1, large // 2)} and {large}, length {entry['largest_batch']['length']} ...")
    constants, calibration = calibrate(
        paths.BASE_MODEL, labels, load_tokenizer(paths.BASE_MODEL).pad_token_id, method,
        knobs.get(method, MethodKnobs()), shapes[method], bf16=entry["precision"] == "bf16",
        gradient_checkpointing=entry["gradient_checkpointing"],
        micro_batches=(max(1, large // 2), large) if large > 1 else (1, 2),
        seq_len=entry["largest_batch"]["length"], threads=draft["threads"], seed=params.common.seed,
        steps=params.probe.calibration_steps, allocator=params.train.allocator, task=task,
        response_tokens=response_tokens, eager_attention_max_len=draft["run"]["eager_attention_max_len"], batches=[
            (math.ceil(rows / split), length) for rows, length in planned_batches(
                lengths, spec.batch_size, spec.grad_accum, spec.epochs, spec.max_steps, spec.seed,
                spec.group_by_length)[1]])
    return make_plan(spec, hardware, shapes, constants, limit_gb, calibration, measured_precision=measured_precision)


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
    for method, p in plan["methods"].items():
        eta = "-" if p["eta_seconds"] is None else _duration(p["eta_seconds"])
        mark = "*" if method == plan["configured_method"] else " "
        lines.append(f"{method + mark:9s} {'yes' if p['fits'] else 'NO':5s} {p['predicted_peak_bytes'] / GiB:8.2f} "
                     f"{p['micro_batch_size']:5d} {p['grad_accum']:5d} {'on' if p['gradient_checkpointing'] else 'off':>4s} "
                     f"{eta:>9s}  {p['why']}")
    lines.append("* configured (train.method). ETA: training wall time; " + next(
        (p["eta_note"] for m, p in plan["methods"].items() if m == plan["configured_method"]), ""))
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--calibration-point":
        spec = json.loads(argv[1])
        spec["knobs"] = MethodKnobs(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["knobs"].items()})
        print(json.dumps(_calibration_point(spec)))
        return
    sys.exit("usage: frugaltune plan   (this module's own entry point is internal: --calibration-point SPEC)")


if __name__ == "__main__":
    main()
