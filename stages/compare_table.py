"""The method comparison table.  Run by DVC as:  python -m stages.compare_table

Reads `reports/compare/<method>_{train,evaluate}.json` for every method in `compare.methods` and writes
`reports/compare.csv`, `reports/compare.md` and `reports/plots/compare_methods.csv` (macro-F1 per method for
`dvc plots`). Every number comes from those runs: accuracy and macro-F1 on the evaluation split, trainable
parameters as the method counts them and their share of all parameters, training wall time, useful (non-pad)
tokens per second, and peak memory (RSS on CPU).
"""

from __future__ import annotations

import sys

import pandas as pd

from frugaltune.io import read_json, write_text
from stages import paths
from stages.config import Params, ParamsError, load_params

COLUMNS = {
    "method": "method",
    "accuracy": "accuracy",
    "macro_f1": "macro-F1",
    "trainable_params": "trainable params",
    "trainable_percent": "trainable %",
    "wall_seconds": "train wall s",
    "tokens_per_s": "tokens/s",
    "peak_rss_mb": "peak RSS MB",
}


def table(methods: list[str]) -> pd.DataFrame:
    rows = []
    for method in methods:
        out = paths.compare_run(method)
        trained, evaluated = read_json(out.train_report), read_json(out.evaluate_report)
        rows.append({
            "method": method,
            "accuracy": evaluated["finetuned"]["accuracy"],
            "macro_f1": evaluated["finetuned"]["macro_f1"],
            "trainable_params": trained["trainable_params"],
            "trainable_percent": trained["trainable_percent"],
            "wall_seconds": trained["wall_seconds"],
            "tokens_per_s": trained["tokens_per_s"],
            "peak_rss_mb": trained["peak_rss_mb"],
        })
    return pd.DataFrame(rows, columns=list(COLUMNS))


def markdown(frame: pd.DataFrame) -> str:
    header = "| " + " | ".join(COLUMNS.values()) + " |\n| " + " | ".join("---" for _ in COLUMNS) + " |\n"
    lines = []
    for row in frame.itertuples(index=False):
        lines.append(f"| {row.method} | {row.accuracy:.4f} | {row.macro_f1:.4f} | {row.trainable_params:,} | "
                     f"{row.trainable_percent:.4f} | {row.wall_seconds:.1f} | {row.tokens_per_s:.1f} | "
                     f"{row.peak_rss_mb:.0f} |")
    return ("# Fine-tuning methods compared\n\nSame data, seed and step budget for every method; regenerate with "
            "`dvc repro compare_table`.\n\n" + header + "\n".join(lines) + "\n")


def run(params: Params) -> dict:
    frame = table(list(params.compare.methods))
    write_text(paths.COMPARE_TABLE_CSV, frame.to_csv(index=False))
    write_text(paths.COMPARE_TABLE_MD, markdown(frame))
    write_text(paths.plot("compare", "methods"), frame[["method", "macro_f1"]].to_csv(index=False))
    print(markdown(frame))
    return {row["method"]: {k: row[k] for k in COLUMNS if k != "method"} for row in frame.to_dict("records")}


def main() -> None:
    try:
        run(load_params())
    except (ParamsError, FileNotFoundError) as exc:
        sys.exit(f"compare_table: {exc}")


if __name__ == "__main__":
    main()
