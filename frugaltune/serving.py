"""Serve a fine-tuned classifier: load base model + PEFT adapter, predict label names; the MLflow pyfunc wrapper.

Not run directly. The register stage logs `SequenceClassifierModel` with one artifact, the adapter dir (which also
holds the tokenizer and `labels.json`), and a reference to the base model: its sha256 and the MLflow URI where
`log_base_model` stored it once, in the experiment `[internal] frugaltune base models`, whatever the number of
versions trained on it (a version that copied the 538 MB base would grow the store by that much per retraining). Loading
resolves the base from a local cache (`~/.cache/frugaltune/bases/<sha256>`, or `FRUGALTUNE_BASE_CACHE`), else
downloads it from the tracking store once and checks its hash. The model also carries the sha256 of the adapter's
files and of the base's config.json (`model_files`); loading hashes them again and refuses a damaged file in one line
(`verify_model_files`). Anyone can then predict with

    mlflow.pyfunc.load_model("models:/frugaltune-sentiment@champion").predict(pd.DataFrame({"text": [...]}))

or from the shell with `frugaltune predict "some text"`.

A prompt -> response model (train task `causal_lm`; labels.json says so) is logged as `GenerativeModel` instead:

    model.predict(pd.DataFrame({"prompt": ["What is 2+2?"]}))                              # -> ["4"]
    model.predict(pd.DataFrame({"prompt": ["2+2?"], "candidates": [["4", "5"]]}))          # the likeliest candidate
    model.predict(df, params={"max_new_tokens": 16, "temperature": 0.7})

This module must import nothing from the rest of the project but `frugaltune.generation` and
`frugaltune.input_template` (which import nothing from it either): `log_model` pickles them by value into the logged
model, so a registered version loads with MLflow, torch, transformers and peft alone, and keeps working after these
files change.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pandas as pd

# The only project imports: both are pickled by value with this module (see log_model), so a function here that
# calls `generation.generate` carries it along, and nothing imports `frugaltune` when the model loads.
from frugaltune import generation, input_template
from frugaltune.input_template import InputTemplate

LABELS_FILE = "labels.json"  # {"labels": [names in class-id order], "max_length": optional int}
TEXT_COLUMN = "text"
DEFAULT_MAX_LENGTH = 128
DEFAULT_BATCH_SIZE = 32
BASE_ARTIFACT = "base_model"  # versions logged before the base was stored once carry it as an artifact
ADAPTER_ARTIFACT = "adapter"
# One run per distinct base model, tagged with its sha256. Named as what it is: it sits in the UI's experiment list
# beside the tasks' experiments, and holds no training run (its note says so too).
BASE_EXPERIMENT = "[internal] frugaltune base models"
OLD_BASE_EXPERIMENTS = ("frugaltune-base-models",)  # its name before: renamed in place, so no base is uploaded twice
BASE_EXPERIMENT_NOTE = ("Internal to frugaltune, not a task: the base model's weights, stored once and referenced by "
                        "every registered version trained on them (serving.log_base_model). Deleting it breaks loading "
                        "those versions where the base is not in the local cache.")
BASE_SHA_TAG = "frugaltune.base_sha256"
BASE_COMPLETE_TAG = "frugaltune.base_complete"  # set only after every file is uploaded
BASE_CACHE_ENV = "FRUGALTUNE_BASE_CACHE"
# model_config keys log_model writes: the combined sha256 (the version's frugaltune.model_hash) and each file's
MODEL_HASH_KEY, MODEL_FILES_KEY = "model_hash", "model_files"
# log_model points this at the local base dir for the load MLflow does right after logging (input example check).
_LOCAL_BASE_ENV = "FRUGALTUNE_LOCAL_BASE_"
HEAD_MODULES = ("score", "classifier")  # the classification head of *ForSequenceClassification models
# What the logged model needs at load time, pinned to the versions it was logged with.
TENSORS_FILE = "trainable.safetensors"  # frugaltune.training.methods.TENSORS_FILE (this module imports no project code)
RUNTIME_PACKAGES = ("mlflow", "cloudpickle", "torch", "transformers", "peft", "tokenizers", "safetensors", "pandas")
CLASSIFICATION, CAUSAL_LM = "classification", "causal_lm"  # labels.json "task"; absent means classification
PROMPT_COLUMN, CANDIDATES_COLUMN = "prompt", "candidates"
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_GENERATION_BATCH_SIZE = 8


def read_labels(adapter_dir: str | Path) -> list[str]:
    """Label names in class-id order, from `<adapter_dir>/labels.json`."""
    path = Path(adapter_dir) / LABELS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found. The train stage writes it next to the adapter; rerun it.")
    labels = json.loads(path.read_text(encoding="utf-8")).get("labels")
    if not labels or not all(isinstance(label, str) for label in labels):
        raise ValueError(f"{path}: expected {{\"labels\": [names in class-id order]}}, got labels={labels!r}.")
    return labels


def read_task(adapter_dir: str | Path) -> str:
    """The task the adapter was trained for, from `<adapter_dir>/labels.json`: "classification" or "causal_lm"."""
    path = Path(adapter_dir) / LABELS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found. The train stage writes it next to the adapter; rerun it.")
    task = json.loads(path.read_text(encoding="utf-8")).get("task", CLASSIFICATION)
    if task not in (CLASSIFICATION, CAUSAL_LM):
        raise ValueError(f"{path}: task = {task!r}, expected {CLASSIFICATION!r} or {CAUSAL_LM!r}.")
    return task


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
                if self.template is None:
                    encoded = self.tokenizer(
                        [texts[i] for i in batch],
                        truncation=True,
                        max_length=self.max_length,
                        padding=True,
                        return_tensors="pt",
                    )
                else:  # the ids the tokenize stage gives a text, then wrapped exactly as the training rows were
                    ids = self.tokenizer([texts[i] for i in batch], truncation=True, max_length=self.max_length)
                    encoded = self.tokenizer.pad(
                        {"input_ids": self.template.wrap_all(ids["input_ids"], self.max_length)},
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
    # bitsandbytes' offline notice (peft imports it): a loaded model runs these functions, pickled by value,
    # and never imports `frugaltune`, whose __init__ installs the filter elsewhere
    generation.quiet_bitsandbytes_hub_notice()
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
    for directory in (adapter_dir, base_dir):
        check_tensor_files(directory)
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


def _generation_settings(adapter_dir: Path) -> dict[str, Any]:
    """labels.json's "generation" block (max_new_tokens, temperature, system, templated), for a causal_lm adapter."""
    path = adapter_dir / LABELS_FILE
    stored = json.loads(path.read_text(encoding="utf-8"))
    if stored.get("task", CLASSIFICATION) != CAUSAL_LM:
        raise ValueError(f"{path}: task = {stored.get('task', CLASSIFICATION)!r}, not {CAUSAL_LM!r}: this adapter "
                         "classifies; load it with load_classifier.")
    settings = stored.get("generation") or {}
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: \"generation\" is {type(settings).__name__}, expected an object with "
                         "max_new_tokens (int), temperature (float), system (str or null), templated (bool).")
    return settings


class Generator:
    """A loaded base model + adapter + tokenizer that answers prompts, freely or by choosing among candidates.

    `config`: max_new_tokens, temperature, system (None: the chat template's default), templated (whether prompts
    go through the chat template, as in training), labels (the task's answers when it had a fixed set: a labelled
    dataset through task.prompt_template; a prompt given no candidates then chooses among them, as evaluation
    scored it).
    """

    def __init__(self, model: Any, tokenizer: Any, config: dict[str, Any],
                 batch_size: int = DEFAULT_GENERATION_BATCH_SIZE):
        self.model = model
        self.tokenizer = tokenizer
        self.config = dict(config)
        self.batch_size = batch_size

    def prompt_ids(self, prompts: Sequence[str]) -> list[list[int]]:
        ids = []
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise TypeError(f"prompt #{i} is {type(prompt).__name__} ({prompt!r}), expected a string.")
            ids.append(generation.prompt_ids(self.tokenizer, prompt, self.config.get("system"),
                                             bool(self.config["templated"])))
        return ids

    def predict(
        self,
        prompts: Sequence[str],
        candidates: Sequence[Sequence[str] | None] | None = None,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
    ) -> list[str]:
        """The response per prompt, in input order. With `candidates` (one list per prompt, None for a prompt that
        has none), the likeliest candidate for those prompts; the others are generated, or, when the model was
        trained on a fixed label set (`config["labels"]`), choose among its labels."""
        ids = self.prompt_ids(list(prompts))
        if candidates is None:
            candidates = [None] * len(ids)
        labels = list(self.config.get("labels") or [])
        if labels:
            candidates = [labels if options is None else options for options in candidates]
        if len(candidates) != len(ids):
            raise ValueError(f"{len(ids)} prompts but {len(candidates)} candidate lists: give one per prompt.")
        responses: list[str] = [""] * len(ids)
        constrained = [i for i, options in enumerate(candidates) if options is not None]
        if constrained:
            options = [list(candidates[i]) for i in constrained]
            best, _ = generation.choose(self.model, self.tokenizer, [ids[i] for i in constrained], options,
                                        batch_size=2 * self.batch_size)
            for i, choices, chosen in zip(constrained, options, best):
                responses[i] = choices[chosen]
        free = [i for i, options in enumerate(candidates) if options is None]
        if free:
            if temperature is None:
                temperature = self.config.get("temperature") or 0.0
            generated = generation.generate(
                self.model,
                self.tokenizer,
                [ids[i] for i in free],
                max_new_tokens=int(max_new_tokens or self.config.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
                temperature=float(temperature),
                batch_size=self.batch_size,
            )
            for i, text in zip(free, generated):
                responses[i] = text
        return responses


def load_causal_lm(base_dir: str | Path, adapter_dir: str | Path) -> tuple[Any, Any]:
    """The base causal LM (float32, local files only) with the adapter applied, and the tokenizer (pad = EOS when
    missing). The adapter is a PEFT dir (adapter_config.json) or the tensors a method trained (trainable.safetensors),
    loaded by name. Returns the model unmerged: a `PeftModel` for PEFT adapters."""
    # bitsandbytes' offline notice (peft imports it): a loaded model runs these functions, pickled by value,
    # and never imports `frugaltune`, whose __init__ installs the filter elsewhere
    generation.quiet_bitsandbytes_hub_notice()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
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
    for directory in (adapter_dir, base_dir):
        check_tensor_files(directory)
    tokenizer_dir = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else base_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
    if peft_adapter:
        from peft import PeftModel

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecation chatter between peft and transformers
            model = PeftModel.from_pretrained(model, adapter_dir, local_files_only=True)
    else:  # the tensors the method trained (frugaltune.training.methods.save_trained), by name
        from safetensors.torch import load_file

        # Tied weights (lm_head = embed_tokens) are listed under both names, whichever one the file uses.
        params = dict(model.named_parameters(remove_duplicate=False))
        tensors = load_file(str(adapter_dir / TENSORS_FILE))
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise ValueError(f"{adapter_dir / TENSORS_FILE}: tensors {unknown[:5]} are not parameters of "
                             f"{type(model).__name__} from {base_dir}: it was trained on another base model.")
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(tensor)
    model.eval()
    return model, tokenizer


def load_generator(
    base_dir: str | Path,
    adapter_dir: str | Path,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
) -> Generator:
    """Load a causal_lm adapter for `Generator.predict`; the generation settings default to labels.json's."""
    settings = _generation_settings(Path(adapter_dir))
    settings["labels"] = json.loads((Path(adapter_dir) / LABELS_FILE).read_text(encoding="utf-8")).get("labels") or []
    model, tokenizer = load_causal_lm(base_dir, adapter_dir)
    if settings.get("templated") is None:  # trained before the flag was stored: what training's "auto" chose
        settings["templated"] = generation.uses_chat_template(tokenizer, "auto")
    settings["max_new_tokens"] = int(max_new_tokens or settings.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)
    settings["temperature"] = float(settings.get("temperature") or 0.0) if temperature is None else float(temperature)
    return Generator(model, tokenizer, settings)


def prompts_from(model_input: Any) -> tuple[list[str], list[list[str]] | None]:
    """The prompts (and candidates, when given) in a pyfunc input: a DataFrame with `prompt` (or its only column)
    and an optional `candidates` column (a list of strings per row), a Series, a list, a str."""
    if isinstance(model_input, pd.DataFrame):
        if CANDIDATES_COLUMN in model_input.columns:
            rest = [c for c in model_input.columns if c != CANDIDATES_COLUMN]
            prompts, _ = prompts_from(model_input[rest])
            candidates = [_candidate_list(value, i) for i, value in enumerate(model_input[CANDIDATES_COLUMN])]
            return prompts, (None if all(c is None for c in candidates) else candidates)
        if PROMPT_COLUMN in model_input.columns:
            return model_input[PROMPT_COLUMN].tolist(), None
        if len(model_input.columns) == 1:
            return model_input.iloc[:, 0].tolist(), None
        raise ValueError(
            f"Expected a DataFrame with a `{PROMPT_COLUMN}` column (and optionally `{CANDIDATES_COLUMN}`), "
            f"got columns {list(model_input.columns)}."
        )
    if isinstance(model_input, dict) and PROMPT_COLUMN in model_input:
        return prompts_from(pd.DataFrame({k: v for k, v in model_input.items()
                                          if k in (PROMPT_COLUMN, CANDIDATES_COLUMN)}))
    return texts_from(model_input), None


def _candidate_list(value: Any, row: int) -> list[str] | None:
    if value is None or (isinstance(value, float) and value != value):  # a row without candidates: NaN / None
        return None
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(f"candidates of row {row} = {value!r}: expected a list of strings.")
    return [str(option) for option in value]


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


def dir_sha256(directory: str | Path) -> str:
    """sha256 over a directory's files (relative names + bytes), in name order: the identity of a base model."""
    import hashlib

    directory = Path(directory)
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def model_files(base_dir: str | Path, adapter_dir: str | Path) -> tuple[str, dict[str, str]]:
    """What makes a model this one: the adapter's files and the base model's config.json. Returns their combined
    sha256 (names + bytes, in name order: the registry's `frugaltune.model_hash` tag) and each file's own sha256
    (`adapter/<path>`, `base/config.json`), which `log_model` stores in the model so that loading names a damaged
    file."""
    import hashlib

    adapter_dir = Path(adapter_dir)
    files = [(f"adapter/{p.relative_to(adapter_dir).as_posix()}", p) for p in sorted(adapter_dir.rglob("*"))]
    files.append(("base/config.json", Path(base_dir) / "config.json"))
    combined, each = hashlib.sha256(), {}
    for name, path in files:
        if path.is_file():
            data = path.read_bytes()
            combined.update(name.encode() + b"\0" + data)
            each[name] = hashlib.sha256(data).hexdigest()
    return combined.hexdigest(), each


def verify_model_files(base_dir: str | Path, adapter_dir: str | Path, config: dict[str, Any]) -> None:
    """Refuse, in one line, a model whose files are not those it was logged with (`model_config`'s `model_hash`
    and `model_files`, stored by `log_model`); a model logged without them is not checked."""
    expected, files = config.get(MODEL_HASH_KEY), config.get(MODEL_FILES_KEY) or {}
    if not expected:
        return
    found, found_files = model_files(base_dir, adapter_dir)
    if found == expected:
        return
    fix = ("Put the logged file back in the model's artifacts (the train stage's output, at the commit the version "
           "records as git_commit), or register a retrained model (`dvc repro -f train register`).")
    for name in sorted(set(files) | set(found_files)):
        if files.get(name) != found_files.get(name):
            state = (f"sha256 {found_files[name]}, logged as {files[name]}" if name in files and name in found_files
                     else "missing" if name in files else "not among the files the model was logged with")
            raise ValueError(f"{name} of the model: {state}: the model's files are damaged, refusing to load it. "
                             f"{fix}")
    raise ValueError(f"the model's files hash to {found}, logged as {expected}: they are damaged, refusing to load "
                     f"them. {fix}")


def check_tensor_files(directory: str | Path) -> None:
    """Read the header of every safetensors file in `directory` (not the tensors: cheap): a damaged one is one
    line naming it, not the safetensors library's traceback."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt"):
                pass
        except SafetensorError as exc:
            raise ValueError(f"{path}: its safetensors header cannot be read ({exc}): the file is damaged or cut "
                             "short. Put an intact copy back (for models/: `rm` it, then `dvc checkout`), or "
                             "retrain.") from None


def base_cache_root() -> Path:
    import os

    return Path(os.environ.get(BASE_CACHE_ENV) or Path.home() / ".cache" / "frugaltune" / "bases")


def resolve_base(sha256: str, uri: str) -> Path:
    """A local directory holding the base model whose hash is `sha256`: the cache, else downloaded from `uri`.

    The download goes to a temporary directory beside the cache entry, is hashed, and is renamed into place only
    when the hash matches, so a cache entry is always complete.
    """
    import os
    import shutil
    import tempfile

    hint = os.environ.get(_LOCAL_BASE_ENV + sha256[:16])
    if hint and Path(hint).is_dir():
        return Path(hint)
    cached = base_cache_root() / sha256
    if (cached / ".sha256").is_file() and (cached / ".sha256").read_text().strip() == sha256:
        return cached
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{sha256[:12]}-", dir=cached.parent))
    except OSError as exc:  # read-only, not ours, a file in the way: one line, with the variable that moves it
        where = (f"{BASE_CACHE_ENV}={os.environ[BASE_CACHE_ENV]}" if os.environ.get(BASE_CACHE_ENV)
                 else f"the default base model cache {cached.parent}")
        raise OSError(
            f"{where}: cannot write the base model there ({exc.strerror}: {exc.filename}). Set {BASE_CACHE_ENV} "
            f"to a directory you can write (it holds one copy of each base model, {sha256[:12]}... here)."
        ) from None
    try:
        try:
            local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(staging)))
        except Exception as exc:  # MlflowException, OSError: the message names what to do either way
            raise FileNotFoundError(
                f"base model sha256 {sha256} is not in the local cache ({cached}) and could not be downloaded "
                f"from {uri} (tracking store {mlflow.get_tracking_uri()}): {exc}. Load from the store that "
                f"registered the model (MLFLOW_TRACKING_URI), or put the base model's files in {cached}."
            ) from None
        found = dir_sha256(local)
        if found != sha256:
            raise ValueError(f"{uri}: the downloaded base model hashes to {found}, not {sha256}: refusing to use it.")
        (local / ".sha256").write_text(sha256)
        try:
            os.replace(local, cached)
        except OSError:  # another process put it in place first
            if not (cached / ".sha256").is_file():
                raise
        return cached
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def log_base_model(base_dir: str | Path, sha256: str | None = None) -> str:
    """Store the base model once in the tracking store; return its artifact URI (`runs:/<run>/base_model`).

    Idempotent: a base with the same sha256 already uploaded completely is reused. Leaves the active run and
    experiment as they were.
    """
    from mlflow import MlflowClient

    sha256 = sha256 or dir_sha256(base_dir)
    client = MlflowClient()
    experiment = client.get_experiment_by_name(BASE_EXPERIMENT)
    for name in OLD_BASE_EXPERIMENTS if experiment is None else ():
        old = client.get_experiment_by_name(name)
        if old is not None and old.lifecycle_stage == "active":
            # a store from before the rename: its bases stay where the versions point (runs:/<run id>/...)
            client.rename_experiment(old.experiment_id, BASE_EXPERIMENT)
            experiment = client.get_experiment(old.experiment_id)
            break
    if experiment is None:
        from mlflow.exceptions import MlflowException

        try:
            experiment_id = client.create_experiment(BASE_EXPERIMENT, **_artifact_location())
        except MlflowException:  # created meanwhile by another process
            experiment_id = client.get_experiment_by_name(BASE_EXPERIMENT).experiment_id
    else:
        experiment_id = experiment.experiment_id
    if experiment is None or experiment.tags.get("mlflow.note.content") != BASE_EXPERIMENT_NOTE:
        client.set_experiment_tag(experiment_id, "mlflow.note.content", BASE_EXPERIMENT_NOTE)  # the UI's description
    found = client.search_runs([experiment_id], filter_string=(
        f"tags.`{BASE_SHA_TAG}` = '{sha256}' AND tags.`{BASE_COMPLETE_TAG}` = '1'"), max_results=1)
    if found:
        return f"runs:/{found[0].info.run_id}/{BASE_ARTIFACT}"
    run = client.create_run(experiment_id, run_name=f"base-{sha256[:12]}", tags={BASE_SHA_TAG: sha256})
    try:
        client.log_artifacts(run.info.run_id, str(base_dir), BASE_ARTIFACT)
    except BaseException:
        client.set_terminated(run.info.run_id, "FAILED")
        raise
    client.set_tag(run.info.run_id, BASE_COMPLETE_TAG, "1")
    client.set_terminated(run.info.run_id)
    return f"runs:/{run.info.run_id}/{BASE_ARTIFACT}"


def _artifact_location() -> dict[str, str]:
    """With the default sqlite store, artifacts go to ./mlartifacts beside it (as frugaltune.tracking does)."""
    uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:///"):
        return {"artifact_location": (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()}
    return {}


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

    The notice is harmless here: what is pickled is this module's own model class (with `generation` and
    `input_template`), by value on purpose so that a version loads without frugaltune installed, and it is unpickled
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
    (`log_base_model`), not per version. The model carries its own copy of this module, of
    `frugaltune.generation` and of `frugaltune.input_template` (pickled by value), so loading it never imports
    `frugaltune`. MLflow loads it once after saving to check that the input example predicts: that load reads the
    local base dir.
    """
    import os

    import cloudpickle

    if task not in (CLASSIFICATION, CAUSAL_LM):
        raise ValueError(f"task = {task!r}: expected {CLASSIFICATION!r} or {CAUSAL_LM!r}.")
    modules = (sys.modules[__name__], generation, input_template)
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
