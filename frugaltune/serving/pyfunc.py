"""The MLflow pyfunc models (`SequenceClassifierModel`, `GenerativeModel`) and `log_model`, which logs one.

Library code, not run directly: the register stages log through `frugaltune.registry`, which calls `log_model`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pandas as pd

# The only project imports outside this package: all three are pickled by value with it (see log_model), so a
# function here that calls `generation.generate` or `classify.classify` carries it along, and nothing imports
# `frugaltune` when the model loads.
from frugaltune import classify, generation, input_template
from frugaltune.serving.base import _LOCAL_BASE_ENV, BASE_ARTIFACT, log_base_model, resolve_base
from frugaltune.serving.classifier import DEFAULT_BATCH_SIZE, TEXT_COLUMN, load_classifier, texts_from
from frugaltune.serving.files import (
    CAUSAL_LM,
    CLASSIFICATION,
    MODEL_FILES_KEY,
    MODEL_HASH_KEY,
    dir_sha256,
    model_files,
    verify_model_files,
)
from frugaltune.serving.generator import (
    CANDIDATES_COLUMN,
    DEFAULT_MAX_NEW_TOKENS,
    PROMPT_COLUMN,
    _generation_settings,
    load_generator,
    prompts_from,
)

ADAPTER_ARTIFACT = "adapter"
# What the logged model needs at load time, pinned to the versions it was logged with.
RUNTIME_PACKAGES = ("mlflow", "cloudpickle", "torch", "transformers", "peft", "tokenizers", "safetensors", "pandas")


class SequenceClassifierModel(mlflow.pyfunc.PythonModel):
    """MLflow pyfunc: DataFrame with a `text` column -> list of label names.

    Artifact: `adapter` (PEFT dir + tokenizer + labels.json). `model_config`: `base_model_sha256` and
    `base_model_uri` (the base stored once, see `resolve_base`), optional `max_length` and `batch_size`.
    Versions logged before carry the base as the artifact `base_model`.
    """

    def load_context(self, context: Any) -> None:
        config = dict(context.model_config or {})
        if BASE_ARTIFACT in context.artifacts:
            base = context.artifacts[BASE_ARTIFACT]
        else:
            base = resolve_base(config["base_model_sha256"], config["base_model_uri"])
        verify_model_files(base, context.artifacts[ADAPTER_ARTIFACT], config)
        self._classifier = load_classifier(
            base,
            context.artifacts[ADAPTER_ARTIFACT],
            max_length=config.get("max_length"),
            batch_size=int(config.get("batch_size") or DEFAULT_BATCH_SIZE),
        )

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        return self._classifier.predict(texts_from(model_input))


class GenerativeModel(mlflow.pyfunc.PythonModel):
    """MLflow pyfunc: DataFrame with a `prompt` column (and optionally `candidates`) -> list of responses.

    Artifact: `adapter` (PEFT dir or trainable.safetensors + tokenizer + labels.json with its "generation"
    settings). `model_config`: `base_model_sha256` and `base_model_uri` as for `SequenceClassifierModel`.
    `params` may override `max_new_tokens` and `temperature` per call.
    """

    def load_context(self, context: Any) -> None:
        config = dict(context.model_config or {})
        base = resolve_base(config["base_model_sha256"], config["base_model_uri"])
        verify_model_files(base, context.artifacts[ADAPTER_ARTIFACT], config)
        self._generator = load_generator(base, context.artifacts[ADAPTER_ARTIFACT])

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> list[str]:
        prompts, candidates = prompts_from(model_input)
        params = params or {}
        return self._generator.predict(prompts, candidates, max_new_tokens=params.get("max_new_tokens"),
                                       temperature=params.get("temperature"))


def generative_signature(max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0) -> Any:
    """`prompt` (string) and optional `candidates` (list of strings) in, the response (string) out; the params
    `max_new_tokens` and `temperature` default to the trained settings."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import Array

    inputs = Schema([ColSpec("string", PROMPT_COLUMN), ColSpec(Array("string"), CANDIDATES_COLUMN, required=False)])
    params = ParamSchema([ParamSpec("max_new_tokens", "long", int(max_new_tokens)),
                          ParamSpec("temperature", "double", float(temperature))])
    return ModelSignature(inputs=inputs, outputs=Schema([ColSpec("string")]), params=params)


def signature() -> Any:
    """`text` (string) in, label name (string) out."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    return ModelSignature(inputs=Schema([ColSpec("string", TEXT_COLUMN)]), outputs=Schema([ColSpec("string")]))


def _not_the_cloudpickle_notice(record: logging.LogRecord) -> bool:
    """False for MLflow's notice that a `python_model` object is serialized with CloudPickle, true for anything else.

    The notice is harmless here: what is pickled is this module's own model class (with `generation`, `classify`
    and `input_template`), by value on purpose so that a version loads without frugaltune installed, and it is unpickled
    only from this project's own tracking store, which holds the adapter weights loaded with the same trust. The
    "models from code" it suggests would need this project's source beside every load.
    """
    return not record.getMessage().startswith("Passing a Python object as `python_model` causes it to be serialized")


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
    task: str = CLASSIFICATION,
) -> Any:
    """Log the adapter as a pyfunc into the active MLflow run, the base by reference; return MLflow's `ModelInfo`.

    `task` "classification" logs a `SequenceClassifierModel` (`text` in), "causal_lm" a `GenerativeModel`
    (`prompt` in, `example_texts` as the example prompts). The base model is stored once per sha256
    (`log_base_model`), not per version. The model carries its own copy of this package, of
    `frugaltune.generation`, `frugaltune.classify` and `frugaltune.input_template` (pickled by value), so loading it
    never imports `frugaltune`. MLflow loads it once after saving to check that the input example predicts: that load reads the
    local base dir.
    """
    import os

    import cloudpickle

    if task not in (CLASSIFICATION, CAUSAL_LM):
        raise ValueError(f"task = {task!r}: expected {CLASSIFICATION!r} or {CAUSAL_LM!r}.")
    # the whole package: cloudpickle pickles its submodules by value with it
    modules = (sys.modules[__package__], generation, classify, input_template)
    sha256 = dir_sha256(base_dir)
    content_hash, files = model_files(base_dir, adapter_dir)
    config = {"batch_size": DEFAULT_BATCH_SIZE, "base_model_sha256": sha256,
              "base_model_uri": log_base_model(base_dir, sha256), MODEL_HASH_KEY: content_hash,
              MODEL_FILES_KEY: files}
    if max_length:
        config["max_length"] = max_length
    hint = _LOCAL_BASE_ENV + sha256[:16]
    os.environ[hint] = str(Path(base_dir).resolve())
    if task == CAUSAL_LM:
        settings = _generation_settings(Path(adapter_dir))
        python_model: mlflow.pyfunc.PythonModel = GenerativeModel()
        model_signature = generative_signature(settings.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS,
                                               settings.get("temperature") or 0.0)
        input_example = pd.DataFrame({PROMPT_COLUMN: list(example_texts)})
    else:
        python_model, model_signature = SequenceClassifierModel(), signature()
        input_example = pd.DataFrame({TEXT_COLUMN: list(example_texts)})
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    mlflow_pyfunc_logger = logging.getLogger("mlflow.pyfunc")  # where MLflow logs it (mlflow/pyfunc/__init__.py)
    mlflow_pyfunc_logger.addFilter(_not_the_cloudpickle_notice)
    try:
        return mlflow.pyfunc.log_model(
            name=name,
            python_model=python_model,
            artifacts={ADAPTER_ARTIFACT: str(Path(adapter_dir).resolve())},
            signature=model_signature,
            input_example=input_example,
            pip_requirements=pip_requirements(),
            model_config=config,
            tags=tags,
        )
    finally:
        mlflow_pyfunc_logger.removeFilter(_not_the_cloudpickle_notice)
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)
        os.environ.pop(hint, None)
