"""Serve a fine-tuned classifier: load base model + PEFT adapter, predict label names; the MLflow pyfunc wrapper.

Not run directly. The register stage logs `SequenceClassifierModel` with two artifacts (the base model dir and
the adapter dir, which also holds the tokenizer and `labels.json`); anyone can then predict with

    mlflow.pyfunc.load_model("models:/frugaltune-sentiment@champion").predict(pd.DataFrame({"text": [...]}))

or from the shell with `frugaltune predict "some text"`.

This module must import nothing from the rest of the project: `log_model` pickles it by value into the logged
model, so a registered version loads with MLflow, torch, transformers and peft alone, and keeps working
after this file changes.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pandas as pd

LABELS_FILE = "labels.json"  # {"labels": [names in class-id order], "max_length": optional int}
TEXT_COLUMN = "text"
DEFAULT_MAX_LENGTH = 128
DEFAULT_BATCH_SIZE = 32
BASE_ARTIFACT = "base_model"
ADAPTER_ARTIFACT = "adapter"
HEAD_MODULES = ("score", "classifier")  # the classification head of *ForSequenceClassification models
# What the logged model needs at load time, pinned to the versions it was logged with.
TENSORS_FILE = "trainable.safetensors"  # frugaltune.training.methods.TENSORS_FILE (this module imports no project code)
RUNTIME_PACKAGES = ("mlflow", "cloudpickle", "torch", "transformers", "peft", "tokenizers", "safetensors", "pandas")


def read_labels(adapter_dir: str | Path) -> list[str]:
    """Label names in class-id order, from `<adapter_dir>/labels.json`."""
    path = Path(adapter_dir) / LABELS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found. The train stage writes it next to the adapter; rerun it.")
    labels = json.loads(path.read_text(encoding="utf-8")).get("labels")
    if not labels or not all(isinstance(label, str) for label in labels):
        raise ValueError(f"{path}: expected {{\"labels\": [names in class-id order]}}, got labels={labels!r}.")
    return labels


def _stored_max_length(adapter_dir: Path) -> int | None:
    value = json.loads((adapter_dir / LABELS_FILE).read_text(encoding="utf-8")).get("max_length")
    return int(value) if value else None


def _trained_heads(adapter_dir: Path) -> list[str]:
    """The classification head the adapter saves in full (`score` for llama); without one the head is random."""
    tensors = adapter_dir / TENSORS_FILE
    if tensors.is_file():  # full / prelayer / none save plain tensors, the head among them
        from safetensors import safe_open

        with safe_open(str(tensors), "pt") as fh:
            heads = {key.split(".")[0] for key in fh.keys()} & set(HEAD_MODULES)
        if not heads:
            raise ValueError(f"{tensors}: holds no classification head, so predictions would come from a random one.")
        return sorted(heads)
    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    saved = [name for name in config.get("modules_to_save") or [] if name in HEAD_MODULES]
    if not saved:
        raise ValueError(
            f"{adapter_dir}: the adapter does not save a classification head (modules_to_save = "
            f"{config.get('modules_to_save')}), so predictions would come from a random one. "
            "Train with modules_to_save=['score']."
        )
    return saved  # peft's SEQ_CLS default lists both `classifier` and `score`; the model has one of them


class Classifier:
    """A loaded base model + adapter + tokenizer that maps texts to label names."""

    def __init__(self, model: Any, tokenizer: Any, labels: list[str], max_length: int, batch_size: int):
        self.model = model
        self.tokenizer = tokenizer
        self.labels = labels
        self.max_length = max_length
        self.batch_size = batch_size

    def predict(self, texts: Sequence[str]) -> list[str]:
        """Label name per text, in input order."""
        import torch

        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"text #{i} is {type(text).__name__} ({text!r}), expected a string.")
        # Batches of similar length pad less; the results go back to input order.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        predictions: list[str] = [""] * len(texts)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                encoded = self.tokenizer(
                    [texts[i] for i in batch],
                    truncation=True,
                    max_length=self.max_length,
                    padding=True,
                    return_tensors="pt",
                )
                class_ids = self.model(**encoded).logits.argmax(dim=-1).tolist()
                for i, class_id in zip(batch, class_ids):
                    predictions[i] = self.labels[class_id]
        return predictions


def load_classifier(
    base_dir: str | Path,
    adapter_dir: str | Path,
    *,
    max_length: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> Classifier:
    """Load the base model with a classification head, apply the PEFT adapter, ready for `predict`.

    The tokenizer comes from the adapter dir (train saves it there), else from the base dir. `max_length`
    defaults to the one stored in labels.json, else 128. Everything is read from local files only.
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep `frugaltune predict` output to the predictions
    base_dir, adapter_dir = Path(base_dir), Path(adapter_dir)
    peft_adapter = (adapter_dir / "adapter_config.json").is_file()
    for what, path, fix in (
        ("base model", base_dir, "the import_model stage"),
        ("adapter", adapter_dir / ("adapter_config.json" if peft_adapter else TENSORS_FILE), "the train stage"),
    ):
        if not path.exists():
            raise FileNotFoundError(f"{path}: {what} not found. Run {fix} first.")
    labels = read_labels(adapter_dir)
    tokenizer_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    heads = _trained_heads(adapter_dir)
    # The base checkpoint has no classification head, so transformers reports it MISSING on every load; the
    # adapter supplies it (checked above), so that report is noise here.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            base_dir,
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={label: i for i, label in enumerate(labels)},
            dtype=torch.float32,
            local_files_only=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    if not any(hasattr(model, head) for head in heads):
        raise ValueError(f"{adapter_dir}: saves heads {heads}, none of which {type(model).__name__} has.")
    # The model finds each sequence's last real token by the pad id; without it batches of >1 fail.
    model.config.pad_token_id = tokenizer.pad_token_id
    if peft_adapter:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecation chatter between peft and transformers
            model = PeftModel.from_pretrained(model, adapter_dir, local_files_only=True)
    else:  # the tensors the method trained (frugaltune.training.methods.save_trained), by name
        from safetensors.torch import load_file

        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in load_file(str(adapter_dir / TENSORS_FILE)).items():
                params[name].copy_(tensor)
    model.eval()
    return Classifier(
        model,
        tokenizer,
        labels,
        max_length=max_length or _stored_max_length(adapter_dir) or DEFAULT_MAX_LENGTH,
        batch_size=batch_size,
    )


def texts_from(model_input: Any) -> list[str]:
    """The texts in a pyfunc input: a DataFrame (`text` column, or its only column), a Series, a list, a str."""
    if isinstance(model_input, pd.DataFrame):
        if TEXT_COLUMN in model_input.columns:
            return model_input[TEXT_COLUMN].tolist()
        if len(model_input.columns) == 1:
            return model_input.iloc[:, 0].tolist()
        raise ValueError(
            f"Expected a DataFrame with a `{TEXT_COLUMN}` column, got columns {list(model_input.columns)}."
        )
    if isinstance(model_input, pd.Series):
        return model_input.tolist()
    if isinstance(model_input, str):
        return [model_input]
    if isinstance(model_input, dict) and TEXT_COLUMN in model_input:
        return texts_from(pd.DataFrame({TEXT_COLUMN: model_input[TEXT_COLUMN]}))
    if isinstance(model_input, Iterable):
        return list(model_input)
    raise TypeError(f"Cannot read texts from a {type(model_input).__name__}; pass a DataFrame with `text`.")


class SequenceClassifierModel(mlflow.pyfunc.PythonModel):
    """MLflow pyfunc: DataFrame with a `text` column -> list of label names.

    Artifacts: `base_model` (HF dir) and `adapter` (PEFT dir + tokenizer + labels.json). `model_config` may
    set `max_length` and `batch_size`.
    """

    def load_context(self, context: Any) -> None:
        config = dict(context.model_config or {})
        self._classifier = load_classifier(
            context.artifacts[BASE_ARTIFACT],
            context.artifacts[ADAPTER_ARTIFACT],
            max_length=config.get("max_length"),
            batch_size=int(config.get("batch_size") or DEFAULT_BATCH_SIZE),
        )

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        return self._classifier.predict(texts_from(model_input))


def signature() -> Any:
    """`text` (string) in, label name (string) out."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    return ModelSignature(inputs=Schema([ColSpec("string", TEXT_COLUMN)]), outputs=Schema([ColSpec("string")]))


def pip_requirements() -> list[str]:
    """The runtime packages pinned to the installed versions (local tags such as `+cpu` dropped)."""
    return [f"{name}=={metadata.version(name).split('+')[0]}" for name in RUNTIME_PACKAGES]


def log_model(
    base_dir: str | Path,
    adapter_dir: str | Path,
    *,
    name: str = "model",
    example_texts: Sequence[str] = ("I love this!", "This is terrible."),
    max_length: int | None = None,
    tags: dict[str, str] | None = None,
) -> Any:
    """Log base model + adapter as a pyfunc into the active MLflow run; return MLflow's `ModelInfo`.

    The model carries its own copy of this module (pickled by value), so loading it never imports
    `frugaltune`. MLflow loads it once after saving to check that the input example predicts.
    """
    import cloudpickle

    module = sys.modules[__name__]
    config = {"batch_size": DEFAULT_BATCH_SIZE}
    if max_length:
        config["max_length"] = max_length
    cloudpickle.register_pickle_by_value(module)
    try:
        return mlflow.pyfunc.log_model(
            name=name,
            python_model=SequenceClassifierModel(),
            artifacts={
                BASE_ARTIFACT: str(Path(base_dir).resolve()),
                ADAPTER_ARTIFACT: str(Path(adapter_dir).resolve()),
            },
            signature=signature(),
            input_example=pd.DataFrame({TEXT_COLUMN: list(example_texts)}),
            pip_requirements=pip_requirements(),
            model_config=config,
            tags=tags,
        )
    finally:
        cloudpickle.unregister_pickle_by_value(module)
