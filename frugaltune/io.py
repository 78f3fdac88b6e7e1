"""Atomic file writes: a crash never leaves a half-written artifact that looks valid.

Library code, used by every stage: `write_json(path, obj)`, `write_text`, `atomic_dir(path)`, `save_figure`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from frugaltune import faults


def write_text(path: Path | str, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            faults.inject("write", path.name)  # tests/faults: a disk that fills up mid-write
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the artifact should not be
        faults.inject("commit", path.name)  # tests/faults: killed just before the rename
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path | str, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_metrics(path: Path | str, metrics: dict[str, Any]) -> None:
    """A DVC metrics file: a flat mapping of names to numbers, nothing else.

    `dvc exp show` / `dvc metrics diff` make a column of every leaf of every metrics file, so a string, a hash or a
    nested report there turns the table into hundreds of collapsed columns (prose and ids belong in the stage's
    report, `reports/<stage>.json`). Refuses anything else, naming the key, before writing.
    """
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"{path}: metric {key!r} is {type(value).__name__} {value!r}; a metrics file holds "
                            "numbers only (put text, ids and nested reports in the stage's report instead)")
    write_json(path, metrics)


def save_figure(fig, path: Path | str, dpi: int = 110) -> None:
    """A matplotlib figure as a PNG, written under a temp name and renamed; the figure is closed."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    os.replace(tmp, path)


def read_json(path: Path | str) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


@contextmanager
def atomic_dir(path: Path | str) -> Iterator[Path]:
    """Yield a temp dir beside `path`; on success it replaces `path` whole, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the artifact should not be
    try:
        yield tmp
        # Writers inside make private files too (safetensors writes model.safetensors 0600): the artifact is
        # readable as any file the user writes, so another account (a server, a colleague) can load it.
        for inner in tmp.rglob("*"):
            if not inner.is_symlink():
                inner.chmod(0o755 if inner.is_dir() else 0o644)
        faults.inject("commit", path.name)  # tests/faults: killed (or the disk full) with the output complete
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: Path | str) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
