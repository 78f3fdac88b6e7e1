"""A model's files: labels.json read, the files hashed, and a damaged one refused in one line before loading.

Library code, not run directly: the loaders (`classifier`, `generator`), the pyfunc models' loading and
`frugaltune predict` call it; `log_model` records the hashes that `verify_model_files` checks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LABELS_FILE = "labels.json"  # {"labels": [names in class-id order], "max_length": optional int}
# model_config keys log_model writes: the combined sha256 (the version's frugaltune.model_hash) and each file's
MODEL_HASH_KEY, MODEL_FILES_KEY = "model_hash", "model_files"
TENSORS_FILE = "trainable.safetensors"  # frugaltune.training.methods.TENSORS_FILE (serving imports no project code)
CLASSIFICATION, CAUSAL_LM = "classification", "causal_lm"  # labels.json "task"; absent means classification


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


def check_model_dirs(base_dir: Path, adapter_dir: Path) -> bool:
    """That the base model and the adapter a loader needs are there and their safetensors headers intact, each a
    one-line error naming the path and the stage that makes it. Whether the adapter is a PEFT dir."""
    peft_adapter = (adapter_dir / "adapter_config.json").is_file()
    for what, path, fix in (
        ("base model", base_dir, "the import_model stage"),
        ("adapter", adapter_dir / ("adapter_config.json" if peft_adapter else TENSORS_FILE), "the train stage"),
    ):
        if not path.exists():
            raise FileNotFoundError(f"{path}: {what} not found. Run {fix} first.")
    for directory in (adapter_dir, base_dir):
        check_tensor_files(directory)
    return peft_adapter
