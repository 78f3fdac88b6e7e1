"""Atomic training checkpoints: trainable weights, optimizer, scheduler, RNG states and the data position.

Library code used by `frugaltune.training.loop`. A checkpoint is written to a temp directory, closed with a
manifest of sha256 sums, then renamed to `step-<N>`: a directory that exists under its final name is complete,
and one whose files do not match the manifest (truncated, edited) is skipped with a warning, never loaded.
They live under `checkpoints/<run key>/`, outside every DVC output, because `dvc repro` deletes a stage's outputs
before running it. Beside them, `run.json` names the MLflow run they belong to (`remember_run`): a resumed training
logs into that same run (`run_to_resume`), so its loss history is whole and no failed twin is left.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from frugaltune import faults
from frugaltune.io import sha256_file, write_json

MANIFEST = "manifest.json"
RUN_FILE = "run.json"
STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass
class Checkpoint:
    step: int
    path: Path


class CheckpointRefused(RuntimeError):
    """A checkpoint file that `weights_only=True` loading refuses; the message names it and the fix."""


def run_key(*parts: Any) -> str:
    """A short hash of everything that must match for a checkpoint to be resumable (config, data, model)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(json.dumps(part, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def data_fingerprint(input_ids: list[list[int]], labels: list[int] | list[list[int]]) -> str:
    digest = hashlib.sha256()
    for ids in input_ids:
        digest.update(np.asarray(ids, dtype=np.int64).tobytes())
        digest.update(b"|")
    if labels and isinstance(labels[0], list | tuple):  # causal_lm: one target per token
        for target in labels:
            digest.update(np.asarray(target, dtype=np.int64).tobytes())
            digest.update(b"|")
    else:
        digest.update(np.asarray(labels, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def copy_named_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Copy saved tensors into the model's parameters of the same names; refuse names the model lacks."""
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise ValueError(f"{source}: holds tensors this model does not have: {unknown[:3]}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().contiguous().clone() for name, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(
    directory: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
    state: dict[str, Any], keep: int = 2,
) -> Path:
    """Write `directory/step-<step>` atomically; keep the newest `keep` checkpoints."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".step-{step}-", dir=directory))
    try:
        save_file(trainable_state(model), str(tmp / "trainable.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optim.pt")
        faults.inject("checkpoint", f"step-{step}")  # tests/faults: killed or out of disk mid-checkpoint
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2))
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "sha256": {f: sha256_file(tmp / f) for f in files}}))
        with open(tmp / MANIFEST, "rb") as fh:
            os.fsync(fh.fileno())
        final = directory / f"step-{step}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(directory)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    return final


def remember_run(directory: Path, mlflow_run_id: str) -> None:
    """Record the MLflow run the checkpoints of `directory` belong to (written atomically, before any of them)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_json(directory / RUN_FILE, {"mlflow_run_id": mlflow_run_id})


def run_to_resume(directory: Path) -> str | None:
    """The MLflow run to continue: the one `remember_run` recorded, when there is a checkpoint to resume from."""
    if not list_checkpoints(directory):
        return None
    try:
        return json.loads((directory / RUN_FILE).read_text())["mlflow_run_id"]
    except (OSError, ValueError, KeyError, TypeError):  # checkpoints written before run.json existed
        return None


def list_checkpoints(directory: Path) -> list[Checkpoint]:
    """Final-named checkpoint dirs, oldest first (temp dirs of interrupted writes are not listed)."""
    if not directory.is_dir():
        return []
    found = [Checkpoint(int(m.group(1)), p) for p in directory.iterdir() if (m := STEP_DIR.match(p.name))]
    return sorted(found, key=lambda c: c.step)


def is_complete(checkpoint: Checkpoint) -> tuple[bool, str]:
    manifest = checkpoint.path / MANIFEST
    if not manifest.is_file():
        return False, "no manifest"
    try:
        expected = json.loads(manifest.read_text())["sha256"]
    except (ValueError, KeyError) as exc:
        return False, f"unreadable manifest ({exc})"
    for name, digest in expected.items():
        path = checkpoint.path / name
        if not path.is_file():
            return False, f"{name} is missing"
        if sha256_file(path) != digest:
            return False, f"{name} does not match its checksum (truncated or modified)"
    return True, ""


def latest_complete(directory: Path) -> Checkpoint | None:
    """The newest checkpoint whose files match its manifest; broken ones are skipped with a warning."""
    for checkpoint in reversed(list_checkpoints(directory)):
        ok, why = is_complete(checkpoint)
        if ok:
            return checkpoint
        warnings.warn(f"skipping checkpoint {checkpoint.path}: {why}", stacklevel=2)
    return None


def rng_state() -> dict[str, Any]:
    """torch, numpy and Python RNG states as tensors and plain numbers: loadable with `weights_only=True`."""
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached_gaussian)},
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}}


def set_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    numpy_state = rng["numpy"]
    np.random.set_state(("MT19937", numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
    python_state = rng["python"]
    random.setstate((python_state["version"], tuple(int(x) for x in python_state["state"].tolist()),
                     python_state["gauss"]))


def _load_tensors_only(path: Path) -> Any:
    """torch.load with `weights_only=True`: a checkpoint directory is data, and data must not run code on load
    (a pickle can). Tensors, numbers, strings and containers only; anything else is refused, naming the file."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointRefused(
            f"{path}: holds objects other than tensors and plain values, so it is not loaded (it could run code): "
            f"{str(exc).splitlines()[0]}. Delete {path.parent} (training restarts from the previous checkpoint or "
            "from step 0), or set train.resume: never.") from None


def load_checkpoint(checkpoint: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG states; return the saved loop state."""
    weights_file = checkpoint.path / "trainable.safetensors"
    copy_named_tensors(model, load_file(str(weights_file)), weights_file)
    optim = _load_tensors_only(checkpoint.path / "optim.pt")
    optimizer.load_state_dict(optim["optimizer"])
    scheduler.load_state_dict(optim["scheduler"])
    set_rng_state(_load_tensors_only(checkpoint.path / "rng.pt"))
    return json.loads((checkpoint.path / "state.json").read_text())
