"""The federation's rows: the tokenized splits written as the clients' and the server's parquet files (wrapped in
`train.input_template` as the train stage wraps its own), and fingerprints of the rows a federation trains on.

Library code, used by the federated stage (stages/federated.py) and its keys (frugaltune/federated/keys.py);
never run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from frugaltune.config import Params
from frugaltune.federated import local
from frugaltune.input_template import InputTemplate, wrapped
from frugaltune.io import read_json
from frugaltune.training import checkpoint


def classifier_template(params: Params, tokenizer) -> InputTemplate | None:
    """`train.input_template`, built for this tokenizer: the federation trains the train stage's classifier, so its
    clients, its server and its centralized reference see the rows the train stage sees (wrapped), and its adapters
    record the template for serving. None without one (and for causal_lm, which the federation does not train)."""
    template = params.train.input_template
    if template is None or params.task.type != "classification":
        return None
    return InputTemplate.build(template, tokenizer)


def write_split(split, out: Path, template: InputTemplate | None = None, max_length: int = 0) -> None:
    """A tokenized split as the federation's rows (parquet): wrapped in `template` (cut to `max_length`) if any."""
    out.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"input_ids": wrapped(split["input_ids"], template, max_length), "labels": split["labels"]})
    pq.write_table(table, out)


def client_file(parts: Path, client: int) -> Path:
    return parts / f"client_{client}.parquet"


def client_lengths(parts: Path, client: int) -> tuple[int, ...]:
    """Token counts of a client's rows: the plan pads and batches them as its training loop will."""
    table = pq.read_table(str(client_file(parts, client)), columns=["input_ids"])
    return tuple(len(ids) for ids in table.column("input_ids").to_pylist())


def rows_fingerprint(files: list[Path]) -> str:
    """sha256 over the files' names and rows (token ids and labels, checkpoint.data_fingerprint), in this order."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + checkpoint.data_fingerprint(*local.read_examples(path)).encode())
    return digest.hexdigest()


def data_fingerprint(parts: Path, test: Path) -> str:
    """The rows a federation trains and is judged on: each client's partition that `parts/partitions.json` lists (in
    its order) and the server's test split, as token ids and labels (checkpoint.data_fingerprint, the train stage's),
    not file bytes."""
    clients = [client_file(parts, entry["client"]) for entry in read_json(parts / "partitions.json")["clients"]]
    return rows_fingerprint(clients + [test])[:16]
