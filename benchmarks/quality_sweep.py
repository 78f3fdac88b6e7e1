"""Quality per minute: train + evaluate one variant of the pipeline's training params, on the pipeline's data and split.

    python benchmarks/quality_sweep.py NAME train.epochs=1.4 train.lora.r=16 ...     # one variant
    python benchmarks/quality_sweep.py --table                                         # all variants run so far

Each variant trains exactly as `dvc repro train` would (the same `stages.train.run`, plan-free resolution: the
precision and attention this machine measured) with the overrides applied to params.yaml's values, writes its
adapter to models/sweep/NAME and its reports to reports/sweep/, then evaluates on the test split like the pipeline.
One line per variant goes to reports/sweep/quality_sweep.jsonl: training wall seconds, useful tokens/s, test
macro-F1 and accuracy, and the CPU it ran on. Needs the pipeline's data (`dvc repro tokenize`).

Two variants may run at once with `train.threads=1` each (2 cores): their wall times then describe that setting,
so the chosen one is re-timed alone by the pipeline itself (`dvc repro`) before its time is quoted.
"""

from __future__ import annotations

if __name__ == "__main__":
    from frugaltune import allocator as _allocator

    _allocator.reexec_early()

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # stages/ when run as a script from the root

from frugaltune import paths  # noqa: E402
from frugaltune.config import load_params  # noqa: E402

OUT = Path("reports/sweep")
TABLE = OUT / "quality_sweep.jsonl"


def with_overrides(params, overrides: list[str]):
    """params with `a.b.c=value` applied (value parsed as YAML), validated again by the params model."""
    data = params.model_dump()
    for item in overrides:
        key, _, raw = item.partition("=")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            if part not in node:
                raise SystemExit(f"quality_sweep: {key}: no section {part!r} in params.yaml")
            node = node[part]
        if leaf not in node:
            raise SystemExit(f"quality_sweep: {key}: no key {leaf!r} in params.yaml")
        node[leaf] = yaml.safe_load(raw)
    return type(params).model_validate(data)


def outputs(name: str) -> paths.RunOutputs:
    return paths.RunOutputs(paths.MODELS / "sweep" / name, OUT / f"{name}_train.json", OUT / f"{name}_loss.csv",
                            OUT / f"{name}_telemetry.csv", OUT / f"{name}_evaluate.json", OUT / f"{name}_confusion.csv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", nargs="?")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    if args.table or not args.name:
        rows = [json.loads(line) for line in TABLE.read_text().splitlines()] if TABLE.exists() else []
        print(f"{'variant':22s} {'overrides':55s} {'train s':>8s} {'tok/s':>7s} {'macro-F1':>9s} {'acc':>7s}")
        for r in rows:
            print(f"{r['name']:22s} {' '.join(r['overrides']):55s} {r['train_seconds']:8.1f} {r['tokens_per_s']:7.1f} "
                  f"{r['macro_f1']:9.4f} {r['accuracy']:7.4f}")
        return
    from stages import evaluate, train

    params = with_overrides(load_params(), args.overrides)
    OUT.mkdir(parents=True, exist_ok=True)
    out = outputs(args.name)
    trained = train.run(params, out, use_plan=False)
    evaluated = evaluate.run(params, out)
    finetuned = evaluated.get("finetuned", evaluated)
    hardware = json.loads(paths.HARDWARE.read_text()) if paths.HARDWARE.exists() else {}
    row = {"name": args.name, "overrides": args.overrides, "train_seconds": trained["wall_seconds"],
           "tokens_per_s": trained["tokens_per_s"], "steps": trained["steps"], "threads": trained["threads"],
           "macro_f1": finetuned["macro_f1"], "accuracy": finetuned["accuracy"],
           "cpu": hardware.get("cpu", {}).get("model"), "peak_rss_mb": trained["peak_rss_mb"]}
    with TABLE.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
