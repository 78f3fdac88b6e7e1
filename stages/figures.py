"""Render the training run as pictures: memory and throughput over time, plan vs measurement.  Run by DVC as:
python -m stages.figures

Reads `reports/plots/train_telemetry.csv` (1 s samples), `reports/plots/train_loss.csv` (loss and tokens/s every
`train.log_every` steps), `reports/train.json` and `reports/plan.json`. Writes `reports/figures/train.png`: process
RSS and CPU over time with the planner's predicted peak as a line, and useful tokens/s and loss over time. The same
data stays in CSV for `dvc plots` (interactive, diffable across commits); the PNG is for the README and for people
who would rather look than read. Matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import sys

import pandas as pd

from frugaltune.faults import stage_errors
from frugaltune.io import read_json
from frugaltune import paths
from frugaltune.config import load_params

FIGURES = paths.REPORTS / "figures"


def run(params=None) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    telemetry = pd.read_csv(paths.PLOTS / "train_telemetry.csv")
    loss = pd.read_csv(paths.PLOTS / "train_loss.csv")
    train = read_json(paths.report("train"))
    plan = read_json(paths.PLAN) if paths.PLAN.exists() else {}
    predicted = train.get("plan", {}).get("predicted_peak_mb")
    start = train.get("wall_seconds", 0) and telemetry["elapsed_s"].iloc[-1] - train["wall_seconds"]

    fig, (mem, speed) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    mem.plot(telemetry["elapsed_s"], telemetry["process_rss_mb"], label="process RSS (MB)", color="tab:blue")
    if predicted:
        mem.axhline(predicted, color="tab:red", linestyle="--", label=f"planner's predicted peak ({predicted:.0f} MB)")
    mem.set_ylabel("MB")
    cpu = mem.twinx()
    cpu.plot(telemetry["elapsed_s"], telemetry["process_cpu_percent"], color="tab:gray", alpha=0.4, linewidth=0.8)
    cpu.set_ylabel("process CPU %", color="tab:gray")
    mem.legend(loc="lower right")
    mem.set_title(f"train: {plan.get('configured_method', '')} on {plan.get('device', {}).get('name', 'this machine')}"
                  f" — peak RSS {train.get('peak_rss_mb', 0):.0f} MB, {train.get('tokens_per_s', 0):.0f} useful tokens/s")
    if len(loss):
        # Log records are per step; place them on the telemetry clock by their share of the training wall time.
        at = start + loss["step"] / max(loss["step"].max(), 1) * train.get("wall_seconds", 0)
        speed.plot(at, loss["tokens_per_s"], marker="o", color="tab:green", label="useful tokens/s")
        speed.set_ylabel("useful tokens/s", color="tab:green")
        lossax = speed.twinx()
        lossax.plot(at, loss["loss"], color="tab:orange", label="loss")
        lossax.set_ylabel("loss", color="tab:orange")
    speed.set_xlabel("seconds since the train stage started")
    fig.tight_layout()
    FIGURES.mkdir(parents=True, exist_ok=True)
    out = FIGURES / "train.png"
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(out)  # atomic: a half-written PNG never looks complete
    print(f"figures: wrote {out}")
    return {"figures": [str(out)]}


def main() -> None:
    with stage_errors("figures"):  # a full disk: one clear line, not a traceback
        try:
            run(load_params())
        except FileNotFoundError as exc:
            sys.exit(f"figures: {exc}: run `dvc repro train` first.")


if __name__ == "__main__":
    main()
