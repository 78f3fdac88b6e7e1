"""Serve a fine-tuned classifier: load the base model + adapter, predict label names (`load_classifier`).

Library code, not run directly: the pyfunc `SequenceClassifierModel` and `frugaltune predict` load it.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from frugaltune import generation, input_template
from frugaltune.classify import classify
from frugaltune.input_template import InputTemplate
from frugaltune.serving.files import LABELS_FILE, TENSORS_FILE, check_model_dirs, read_labels

TEXT_COLUMN = "text"
DEFAULT_MAX_LENGTH = 128
DEFAULT_BATCH_SIZE = 32
HEAD_MODULES = ("score", "classifier")  # the classification head of *ForSequenceClassification models


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

    def __init__(self, model: Any, tokenizer: Any, labels: list[str], max_length: int, batch_size: int,
                 template: InputTemplate | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.labels = labels
        self.max_length = max_length
        self.batch_size = batch_size
        self.template = template  # labels.json's input_template: the inputs wrapped as in training

    def predict(self, texts: Sequence[str]) -> list[str]:
        """Label name per text, in input order."""
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"text #{i} is {type(text).__name__} ({text!r}), expected a string.")
        # the ids the tokenize stage gives a text, wrapped exactly as the training rows were where they were, then
        # scored by the evaluate stage's evaluator (its length-sorted, right-padded batches)
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"] if texts else []
        if self.template is not None:
            ids = self.template.wrap_all(ids, self.max_length)
        scores = classify(self.model, ids, self.tokenizer.pad_token_id, self.batch_size)
        return [self.labels[class_id] for class_id in scores.predictions]


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
    # bitsandbytes' offline notice (peft imports it): a loaded model runs these functions, pickled by value,
    # and never imports `frugaltune`, whose __init__ installs the filter elsewhere
    generation.quiet_bitsandbytes_hub_notice()
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep `frugaltune predict` output to the predictions
    base_dir, adapter_dir = Path(base_dir), Path(adapter_dir)
    peft_adapter = check_model_dirs(base_dir, adapter_dir)
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
    manifest = json.loads((adapter_dir / LABELS_FILE).read_text(encoding="utf-8"))
    return Classifier(
        model,
        tokenizer,
        labels,
        max_length=max_length or _stored_max_length(adapter_dir) or DEFAULT_MAX_LENGTH,
        batch_size=batch_size,
        template=input_template.from_manifest(manifest, tokenizer),
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
