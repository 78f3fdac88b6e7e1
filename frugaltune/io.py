"""Atomic file writes: a crash never leaves a half-written artifact that looks valid.

Library code, used by every stage: `write_json(path, obj)`, `write_text`, `atomic_dir(path)`, `save_figure`, and
`csv_text` (every CSV the project writes, its cells safe to open in a spreadsheet).
A JSON report is rewritten only when its content changed (`write_json`), so a rerun that finds nothing new leaves
the reports kept in git as they were.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from frugaltune import faults


# Keys whose values differ on every run that measures the same thing: how long it took (or a rate per second), or
# when. A report that differs from the one on disk in these only says nothing new.
VOLATILE_KEY_ENDINGS = ("seconds", "_s", "_ms", "elapsed", "timestamp")


def write_text(path: Path | str, text: str, keep_old: Callable[[str], bool] | None = None) -> None:
    """Write `text` to `path` under a temp name beside it, then rename it in: never a half-written `path`.

    With `keep_old`, a file already at `path` whose text `keep_old` accepts stays as it is (bytes and mtime): the
    new text is still written and checked as ever (a full disk still fails), then dropped instead of renamed in.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            faults.inject("write", path.name)  # tests/faults: a disk that fills up mid-write
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the artifact should not be
        faults.inject("commit", path.name)  # tests/faults: killed just before the rename
        if keep_old is not None and path.is_file() and keep_old(path.read_text(encoding="utf-8")):
            Path(tmp).unlink()
            return
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def is_volatile(key: str) -> bool:
    """A key `ms` or ending in `seconds`, `_s`, `_ms`, `elapsed` or `timestamp` (`wall_seconds`, `duration_s`,
    `tokens_per_s`, `step_time_mean_ms`): a duration, a rate per second or a time of day."""
    return key == "ms" or key.endswith(VOLATILE_KEY_ENDINGS)


def without_volatile(obj: Any) -> Any:
    """`obj` with every volatile key (`is_volatile`) removed, at any depth."""
    if isinstance(obj, dict):
        return {key: without_volatile(value) for key, value in obj.items() if not is_volatile(str(key))}
    if isinstance(obj, list):
        return [without_volatile(value) for value in obj]
    return obj


def write_json(path: Path | str, obj: Any) -> None:
    """`obj` as indented JSON, atomically; a file already there is kept when only volatile keys differ.

    The rule: the old file stays, bytes and mtime, when it parses as JSON and equals the new content once every key
    `is_volatile` (durations, rates per second, timestamps) is removed at any depth from both. Any other difference
    (a metric, a count, a key added or removed) rewrites the file. Reports are committed, so a rerun that finds
    nothing new (`dvc repro --force`, an upstream stage that rebuilt the same data) would otherwise dirty them only
    for their timings; the timings kept are those of the run that produced the content. DVC is content-addressed:
    an output left as it was is an output it finds up to date.
    """
    text = json.dumps(obj, indent=2, sort_keys=False) + "\n"
    new = without_volatile(json.loads(text))  # as read back: tuples are lists, keys are strings

    def same_content(old_text: str) -> bool:
        try:
            return without_volatile(json.loads(old_text)) == new
        except ValueError:  # not JSON (a hand edit, a file of another kind): replace it
            return False

    write_text(path, text, keep_old=same_content)


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


# A spreadsheet runs a cell that starts with one of these as a formula (OWASP, "CSV Injection"); the CSVs hold labels
# and texts from the user's data, and some are committed to git, where anyone may open them.
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def csv_cell(value: Any) -> Any:
    """`value` as a CSV cell that a spreadsheet shows and never runs: a string starting with `FORMULA_START` gets a
    leading `'`, as OWASP recommends. A string that is a plain number (`-1` as a label) is left as it is: a number
    runs nothing, and integer labels stay readable. Anything not a string (a count, a loss) passes unchanged.

    A carriage return inside a string becomes a line feed: the csv module quotes a cell holding a line feed, but
    writes a lone CR bare, and readers (DVC's, a spreadsheet's) end the row there."""
    if not isinstance(value, str):
        return value
    if value.startswith(FORMULA_START) and not _NUMBER.fullmatch(value):
        value = "'" + value
    return value.replace("\r\n", "\n").replace("\r", "\n")


def csv_text(rows: Iterable[Mapping[str, Any]], fields: Sequence[str]) -> str:
    """CSV text (`\n` line ends) of `rows` under the header `fields`, every header and cell through `csv_cell`; a
    row's keys outside `fields` are left out, a missing one is an empty cell. Every CSV the project writes goes
    through here."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([csv_cell(field) for field in fields])
    writer.writerows([csv_cell(row.get(field, "")) for field in fields] for row in rows)
    return buffer.getvalue()


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
    with Path(path).open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()
