"""Params sections of training and what measures it: `probe`, `kernels`, `train` (each method's knobs,
`train.distributed`), `compare` and `evaluate`.

Library code, no entry point: imported through `frugaltune.config`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from frugaltune.config.base import AUTO, Section, check_name
from frugaltune.methods import NAMES as METHOD_NAMES, Method, MethodKnobs

MethodName = Literal[METHOD_NAMES]  # the registry's methods (frugaltune/methods.py)


class ProbeParams(Section):
    nvml: bool = Field(True, description="Look for NVIDIA GPUs through NVML (nvidia-ml-py).")
    memory_limit_gb: float | None = Field(
        None, gt=0, description="Memory the plan may use (GiB); null = the cgroup limit or the machine's RAM "
        "(a GPU's own memory when training runs on one). The plan keeps 10% of it free."
    )
    calibrate: bool | Literal["auto"] = Field(
        "auto", description="Run the train stage's own loop over a few of the run's own micro-batches to fit this "
        "machine's memory and time constants (an ETA within 10 %); false = analytic estimates only; auto = calibrate "
        "unless the run is too short for it (calibration_max_share)."
    )
    calibration_max_share: float = Field(
        0.05, gt=0, le=1, description="With calibrate: auto, a run is calibrated only when the micro-batches the "
        "calibration times (5 at calibration_steps 3) are at most this share of the run's: with the model's load, "
        "the warm-up and the other methods' steps a calibration costs a few times that share of the run's time."
    )
    calibration_by_shape_s: float | None = Field(
        100, gt=0, description="`frugaltune plan --model` of a model without weights, with calibrate: auto: the "
        "seconds its answer may take, the random weights' writing included. The calibration times only the method "
        "planned (the others keep their FLOPs estimate) and stops at that time, fitting the steps it timed (two or "
        "more; else the plan stays analytic, and says so); --calibrate has no limit. null = no limit."
    )
    calibration_steps: int = Field(
        3, ge=2, le=20, description="Micro-batches of the run the calibration times: the smallest (its first step "
        "is the warm-up), evenly spaced sizes and the run's largest part, smallest first (the memory fit); then again "
        "under the peak (the time fit), all but the largest when two or more are left."
    )


class KernelsParams(Section):
    enabled: bool = Field(
        True, description="Build and verify the CUDA kernels; false records them as skipped (the CPU checks still run)."
    )
    archs: list[str] = Field(
        ["sm_80", "sm_90"],
        min_length=1,
        description="CUDA architectures (`sm_<major><minor>`) to compile for when no CUDA device is usable; on a "
        "CUDA machine the kernels are built for the device's own architecture instead.",
    )
    bench_batch: int = Field(8, ge=1, description="Batch size of the CPU fp32-vs-bf16 timing and the GPU 'used' check.")
    bench_seq_len: int = Field(128, ge=1, description="Sequence length of those timings (tokenize.max_length or less).")
    model_hidden: int = Field(576, ge=1, description="Hidden size of the timed layer (default: SmolLM2-135M).")
    model_heads: int = Field(9, ge=1, description="Attention heads of the timed layer; hidden / heads = head dim.")
    model_intermediate: int = Field(1536, ge=1, description="MLP intermediate size of the timed layer.")
    timing_repeats: int = Field(10, ge=3, description="Timed runs per op and precision on the CPU (the median is kept).")
    bf16_min_speedup: float = Field(
        1.1, ge=1.0, description="The CPU prefers bf16 only when a layer runs at least this many times faster in bf16 "
        "than in fp32: a margin so that timing noise does not flip the choice."
    )
    cuda_min_speedup: float = Field(
        1.1, ge=1.0, description="On a CUDA device, evaluation uses the project's attention kernel only when it runs "
        "at least this many times faster than SDPA at the model's shape, in every dtype (the same kind of margin)."
    )

    @model_validator(mode="after")
    def _check_kernels(self) -> "KernelsParams":
        import re

        bad = [arch for arch in self.archs if not re.fullmatch(r"sm_\d{2,3}[a-z]?", arch)]
        if bad:
            raise ValueError(f"kernels.archs: {bad} are not CUDA architectures; write them like `sm_80`, `sm_90`")
        if self.model_hidden % self.model_heads:
            raise ValueError(
                f"kernels.model_hidden ({self.model_hidden}) must be a multiple of kernels.model_heads "
                f"({self.model_heads})"
            )
        return self


class LoraParams(Section):
    r: int = Field(8, ge=1, description="LoRA rank: higher increases capacity and memory.")
    alpha: int = Field(16, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], description="Names of the linear layers that get adapters."
    )
    last_layers: int | None = Field(
        None, ge=1, description="Adapt only the last N decoder layers; null = all. The layers below get no "
        "backward pass (nothing under them trains), so a step costs about forward + N/L of the backward.")

    def knobs(self) -> MethodKnobs:
        """These settings in the shape the code passes around (QLoRA's quantization included)."""
        return MethodKnobs(**(self.model_dump() | {"target_modules": tuple(self.target_modules)}))


class QloraParams(LoraParams):
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type of the frozen base weights.")
    double_quant: bool = Field(True, description="Quantize the quantization constants too (saves ~0.4 bit/param).")


class FullParams(Section):
    lr: float = Field(5e-5, gt=0, description="Learning rate for full fine-tuning (replaces train.lr).")


class NoneParams(Section):
    """`none` has no knobs; the section exists so that dvc.yaml's compare matrix can name `train.none`."""


class PrelayerParams(Section):
    lr: float | None = Field(None, gt=0, description="Learning rate of the embeddings; null = train.lr.")


class DistributedParams(Section):
    nproc_per_node: int = Field(
        1, ge=1, description="Training processes on this host (data parallel, torchrun): 1 = one process; N > 1 = "
        "the train stage re-launches itself under `torchrun --standalone`, one rank per GPU, or per share of the "
        "CPU cores (train.threads is then per process).")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend: auto = nccl on CUDA GPUs, gloo on CPU.")


class TrainParams(Section):
    method: MethodName = Field(
        "lora",
        description="none: evaluate the base model; full: every weight; lora/dora: adapters (peft); qlora: LoRA on "
        "a 4-bit NF4 base (bitsandbytes); prelayer: only the embeddings and the head.",
    )
    lora: LoraParams = Field(default_factory=LoraParams, description="LoRA knobs.")
    dora: LoraParams = Field(default_factory=LoraParams, description="DoRA knobs (LoRA with weight decomposition).")
    qlora: QloraParams = Field(default_factory=QloraParams, description="QLoRA knobs.")
    full: FullParams = Field(default_factory=FullParams, description="Full fine-tuning knobs.")
    prelayer: PrelayerParams = Field(default_factory=PrelayerParams, description="PreLayer knobs.")
    none: NoneParams = Field(default_factory=NoneParams, description="No knobs: the untrained baseline.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate of AdamW.")
    head_lr: float | None = Field(
        None, gt=0, description="Learning rate of the new classification head; null = `lr`."
    )
    lora_plus_ratio: float = Field(
        1.0, ge=1, description="LoRA+: the adapters' B matrices learn at this multiple of `lr` (A at `lr`); "
        "1 = plain LoRA. Applies to lora, qlora and dora.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    scheduler: Literal["linear", "cosine", "constant"] = Field("linear", description="Learning-rate schedule after warmup.")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="Share of the optimizer steps spent warming up.")
    epochs: float = Field(1.0, gt=0, description="Passes over the training split (ignored when max_steps is set).")
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps; null = use epochs.")
    batch_size: int = Field(16, ge=1, description="Sequences per micro-batch as configured (the data order).")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step (effective batch = product).")
    micro_batch_size: Literal["auto"] | int = Field(
        "auto", description="Sequences per forward pass: `auto` = the plan's (the largest part of batch_size that fits "
        "in memory); a smaller value splits each batch and accumulates, keeping the effective batch and data order."
    )
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="Padded tokens per forward pass at most (rows x the batch's longest row): a wider "
        "batch runs in as few equal parts as keep under it and accumulates (the same gradient up to rounding); "
        "null = no cap. Length-grouped batches are mostly short: this bounds the peak memory the few long ones set "
        "and splits only those."
    )
    gradient_checkpointing: Literal["auto"] | bool = Field(
        "auto", description="Recompute activations in backward: `auto` = the plan's (on only when memory requires it; "
        "it costs ~1/3 more compute)."
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="`auto`: bf16 autocast when the CPU has avx512_bf16/AMX or the GPU supports bf16."
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads; null = the plan's (physical cores).")
    allocator: Literal["auto", "mimalloc", "system"] = Field(
        "auto", description="malloc of the training process: `auto` = mimalloc where installed (Linux): the same "
        "speed as glibc, RSS near live memory instead of a fragmented heap (frugaltune/allocator.py)."
    )
    group_by_length: bool = Field(True, description="Batch sequences of similar length together (less padding).")
    int8_products: Literal["auto"] | bool = Field(
        False, description="Products with the frozen base weights in int8 (frugaltune/int8.py; the adapters, head "
        "and optimizer unchanged): `auto` = on for LoRA on a CPU that trains in bf16 where int8 multiplies >= 1.5x "
        "faster than bf16, measured by the plan (off in fp32 training: it lost quality there, docs/DECISIONS.md); "
        "evaluation and serving stay on the bf16/fp32 base. The federated clients and their reference follow it.")
    input_template: str | None = Field(
        None, description="classification: the text around every input, `{text}` where the input goes (e.g. "
        "\"{text}\\nSentiment:\"); null = the bare input; `auto` = `{text}\\n<data.label_column>:` (\"{text}\\n"
        "Sentiment:\" for the tweets' `sentiment`, \"{text}\\nCategory:\" for a `category` column). Wrapped on token ids, the input cut so that the whole fits "
        "tokenize.max_length; recorded in the adapter's labels.json, from where evaluation and serving wrap their "
        "inputs the same way (frugaltune/input_template.py). causal_lm ignores it: its prompts are the rows' own, "
        "or task.prompt_template's.")
    log_every: int = Field(10, ge=1, description="Log loss and tokens/s every this many optimizer steps.")
    checkpoint_every: int = Field(
        50, ge=1, description="Write a resumable checkpoint (under checkpoints/, outside DVC outputs) every N steps."
    )
    keep_checkpoints: int = Field(2, ge=1, description="Keep the newest N checkpoints of a run.")
    resume: Literal["auto", "never"] = Field(
        "auto", description="`auto`: continue from the newest complete checkpoint of the same configuration."
    )
    experiment: str | None = Field(
        None, description="MLflow experiment name (the rule of `register.model_name`); null = `register.model_name`: "
        "one experiment per task, so the runs table compares runs measured on the same data.")
    telemetry_interval_s: float = Field(
        1.0, gt=0, description="Seconds between telemetry samples (CPU, RAM, swap, IO, GPU) sent to MLflow and CSV."
    )
    distributed: DistributedParams = Field(
        default_factory=DistributedParams, description="Data-parallel training over several processes (torchrun)."
    )

    def knobs(self, method: Method) -> MethodKnobs:
        """`train.<method>`'s LoRA settings; a method without adapters reads none (the defaults)."""
        return getattr(self, method.name).knobs() if method.adapters else MethodKnobs()

    @field_validator("experiment")
    @classmethod
    def _experiment_is_a_name(cls, experiment: str | None) -> str | None:
        return experiment if experiment is None else check_name(experiment)

    @field_validator("input_template")
    @classmethod
    def _template_has_text(cls, template: str | None) -> str | None:
        if template is not None and template != AUTO:  # auto: resolved by Params from data.label_column
            from frugaltune.input_template import sides

            sides(template)
        return template

    @field_validator("micro_batch_size")
    @classmethod
    def _micro_batch_within_batch(cls, micro, info):
        batch = info.data.get("batch_size", 1)
        if micro != "auto" and not 1 <= micro <= batch:
            raise ValueError(f"must be between 1 and train.batch_size ({batch}), or `auto`")
        return micro


class CompareParams(Section):
    methods: list[MethodName] = Field(
        list(METHOD_NAMES),
        description="Methods in the comparison table (keep in step with the matrix in dvc.yaml).",
    )
    max_steps: int | None = Field(
        None, gt=0, description="Optimizer steps per method (the same budget for all); null = train.epochs."
    )


class EvaluateParams(Section):
    batch_size: int = Field(32, ge=1, description="Sequences per forward pass.")
    split: Literal["val", "test"] = Field("test", description="Split to evaluate on.")
