"""The method comparison table.  Run by DVC as:  python -m stages.compare_table

Reads `reports/compare/<method>_{train,evaluate}.json` for every method in `compare.methods` and writes
`reports/compare.csv`, `reports/compare.md` and `reports/plots/compare_methods.csv` (macro-F1 per method for
`dvc plots`). Every number comes from those runs: accuracy and macro-F1 on the evaluation split, trainable
parameters as the method counts them and their share of all parameters, training wall time, useful (non-pad)
tokens per second, and peak memory (RSS on CPU; allocated and reserved on CUDA), and `reports/figures/compare.png`.
"""

from __future__ import annotations


import pandas as pd

from frugaltune.entry import stage_main
from frugaltune.io import read_json, write_text
from frugaltune import paths
from frugaltune.config import Params

COLUMNS = {
    "method": "method",
    "accuracy": "accuracy",
    "macro_f1": "macro-F1",
    "trainable_params": "trainable params",
    "trainable_percent": "trainable %",
    "wall_seconds": "train wall s",
    "tokens_per_s": "tokens/s",
    "peak_rss_mb": "peak RSS MB",
    "cuda_peak_allocated_mb": "CUDA allocated MB",
    "cuda_peak_reserved_mb": "CUDA reserved MB",
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
            # on a CUDA device only; empty on a CPU run
            "cuda_peak_allocated_mb": trained.get("cuda_peak_allocated_mb"),
            "cuda_peak_reserved_mb": trained.get("cuda_peak_reserved_mb"),
        })
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _mb(value) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:.0f}"


def figure(frame: pd.DataFrame) -> None:
    """reports/figures/compare.png: quality against cost, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (column, title) in zip(axes, (("macro_f1", "macro-F1 (test)"), ("peak_rss_mb", "peak RSS (MB)"),
                                          ("wall_seconds", "training wall time (s)"))):
        ax.barh(frame["method"], frame[column], color="tab:blue")
        ax.set_title(title)
        ax.invert_yaxis()
        for y, value in enumerate(frame[column]):
            ax.text(value, y, f" {value:.3f}" if column == "macro_f1" else f" {value:.0f}", va="center", fontsize=8)
    fig.tight_layout()
    out = paths.REPORTS / "figures" / "compare.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(out)


def markdown(frame: pd.DataFrame) -> str:
    header = "| " + " | ".join(COLUMNS.values()) + " |\n| " + " | ".join("---" for _ in COLUMNS) + " |\n"
    lines = []
    for row in frame.itertuples(index=False):
        lines.append(f"| {row.method} | {row.accuracy:.4f} | {row.macro_f1:.4f} | {row.trainable_params:,} | "
                     f"{row.trainable_percent:.4f} | {row.wall_seconds:.1f} | {row.tokens_per_s:.1f} | "
                     f"{row.peak_rss_mb:.0f} | {_mb(row.cuda_peak_allocated_mb)} | {_mb(row.cuda_peak_reserved_mb)} |")
    return ("# Fine-tuning methods compared\n\nSame data, seed and step budget for every method; regenerate with "
            "`dvc repro compare_table`.\n\n" + header + "\n".join(lines) + "\n")


def run(params: Params) -> dict:
    frame = table(list(params.compare.methods))
    write_text(paths.COMPARE_TABLE_CSV, frame.to_csv(index=False))
    write_text(paths.COMPARE_TABLE_MD, markdown(frame))
    write_text(paths.plot("compare", "methods"), frame[["method", "macro_f1"]].to_csv(index=False))
    figure(frame)
    print(markdown(frame))
    return {row["method"]: {k: row[k] for k in COLUMNS if k != "method"} for row in frame.to_dict("records")}


def main() -> None:
    stage_main("compare_table", run, FileNotFoundError)


if __name__ == "__main__":
    main()
