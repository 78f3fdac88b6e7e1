"""Split a training set into per-client partitions with flwr-datasets' partitioners; write each client's rows and
the per-client label histograms.

Run (in the Flower venv, by the `federated` stage or by hand):
    .venv-flower/bin/python -m frugaltune.federated.partition --train data/federated/train.parquet \
        --out data/federated/partitions --scheme dirichlet --num-clients 10 --alpha 0.5 --seed 42

Schemes: `iid` (IidPartitioner on the seeded shuffle: IidPartitioner itself shards contiguously, which on a file
sorted by label would be anything but IID), `dirichlet` (DirichletPartitioner over the label column, concentration
alpha: small alpha = each client sees few labels), `column` (NaturalIdPartitioner: one client per distinct value
of a column, e.g. an owner id). The partitioners work on a local `datasets.Dataset` built from the parquet file:
nothing is downloaded.

Writes `<out>/client_<i>.parquet` (that client's rows, all columns) and `<out>/partitions.json`
({"scheme", "seed", "clients": [{"client", "examples", "label_histogram": {label: count}, "natural_id"?}]}),
the whole directory atomically (built beside it, then renamed).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections import Counter
from pathlib import Path

import datasets

datasets.disable_progress_bars()  # partition runs inside the stage: no bars in its log
import pyarrow.parquet as pq
from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, NaturalIdPartitioner

SCHEMES = ("iid", "dirichlet", "column")


def make_partitioner(scheme: str, num_clients: int, label_column: str, alpha: float, by: str | None, seed: int,
                     min_partition_size: int):
    if scheme == "iid":
        return IidPartitioner(num_partitions=num_clients)
    if scheme == "dirichlet":
        return DirichletPartitioner(num_partitions=num_clients, partition_by=label_column, alpha=alpha,
                                    min_partition_size=min_partition_size, self_balancing=False, seed=seed)
    if scheme == "column":
        if not by:
            raise ValueError("federated.partition.scheme 'column' needs federated.partition.by: the column whose "
                             "values name the owners (e.g. user_id).")
        return NaturalIdPartitioner(partition_by=by)
    raise ValueError(f"federated.partition.scheme: {scheme!r} is not one of {SCHEMES}.")


def partition(dataset: datasets.Dataset, scheme: str, num_clients: int, label_column: str = "labels",
              alpha: float = 0.5, by: str | None = None, seed: int = 42,
              min_partition_size: int = 2) -> tuple[list[datasets.Dataset], list[dict]]:
    """The clients' datasets and a summary per client (examples, label histogram); deterministic for a seed."""
    if label_column not in dataset.column_names:
        raise ValueError(f"federated: the training set has no column {label_column!r} (columns: "
                         f"{dataset.column_names}).")
    if by and by not in dataset.column_names:
        raise ValueError(f"federated.partition.by: no column {by!r} in the training set (columns: "
                         f"{dataset.column_names}).")
    # A seeded shuffle first: the same seed gives the same clients, and IID shards are then random
    dataset = dataset.shuffle(seed=seed).flatten_indices()
    partitioner = make_partitioner(scheme, num_clients, label_column, alpha, by, seed, min_partition_size)
    partitioner.dataset = dataset
    count = partitioner.num_partitions
    parts, summary = [], []
    for client in range(count):
        part = partitioner.load_partition(client)
        histogram = Counter(int(v) for v in part[label_column])
        entry = {"client": client, "examples": len(part),
                 "label_histogram": {str(k): histogram[k] for k in sorted(histogram)}}
        if scheme == "column":
            entry["natural_id"] = str(partitioner.partition_id_to_natural_id[client])
        parts.append(part)
        summary.append(entry)
    return parts, summary


def write_partitions(parts: list[datasets.Dataset], summary: list[dict], out: Path, scheme: str, seed: int) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for entry, part in zip(summary, parts):
        # flatten_indices: a partitioner's `select` keeps the whole table behind an indices mapping, and
        # `part.data.table` alone is every row (what each Dirichlet client was given before this was caught)
        table = part.flatten_indices(keep_in_memory=True).data.table
        if table.num_rows != entry["examples"]:
            raise RuntimeError(f"partition: client {entry['client']} has {entry['examples']} rows but "
                               f"{table.num_rows} would be written")
        pq.write_table(table, tmp / f"client_{entry['client']}.parquet")
    (tmp / "partitions.json").write_text(json.dumps({"scheme": scheme, "seed": seed, "clients": summary}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=Path, required=True, help="parquet file of the training split")
    parser.add_argument("--out", type=Path, required=True, help="directory for client_<i>.parquet + partitions.json")
    parser.add_argument("--scheme", choices=SCHEMES, default="dirichlet")
    parser.add_argument("--num-clients", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--by", default=None, help="column naming each row's owner (scheme column)")
    parser.add_argument("--label-column", default="labels")
    parser.add_argument("--min-partition-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    if not args.train.is_file():
        raise SystemExit(f"{args.train}: no such file. Write the training split first (the federated stage does).")
    dataset = datasets.Dataset(pq.read_table(args.train))
    parts, summary = partition(dataset, args.scheme, args.num_clients, args.label_column, args.alpha, args.by,
                               args.seed, args.min_partition_size)
    write_partitions(parts, summary, args.out, args.scheme, args.seed)
    sizes = [entry["examples"] for entry in summary]
    print(f"partition: {args.scheme} -> {len(parts)} clients, {sum(sizes)} examples (min {min(sizes)}, "
          f"max {max(sizes)}) in {args.out}")


if __name__ == "__main__":
    main()
