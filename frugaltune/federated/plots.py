"""Figures of a federated run: the global metric against rounds and against the bytes sent; each client's measured
time and memory against its plan.

Library code, called by the `federated` stage (python -m stages.federated). Matplotlib writes files only (Agg
backend), through frugaltune.io.save_figure (temp name + rename), as the scheduling figures do.
"""

from __future__ import annotations

from pathlib import Path

from frugaltune.io import save_figure


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_rounds(rows: list[dict], path: Path, metric: str = "macro_f1") -> None:
    """`metric` of the global adapter on the server's test split per round (left) and against the cumulative bytes
    up + down (right), one line per run: the same accuracy for fewer bytes is what bf16 or FFA buy."""
    plt = _pyplot()
    fig, (by_round, by_bytes) = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for run in dict.fromkeys(row["run"] for row in rows):
        mine = [row for row in rows if row["run"] == run]
        by_round.plot([r["round"] for r in mine], [r[metric] for r in mine], marker="o", label=run)
        by_bytes.plot([r["bytes_total"] / 2 ** 20 for r in mine], [r[metric] for r in mine], marker="o", label=run)
    by_round.set_xlabel("round (0 = the seeded start)")
    by_round.set_ylabel(f"test {metric}")
    sampled = sorted({r["evaluation_rows"] for r in rows if r.get("evaluation_rows")})
    if len(sampled) > 1:  # rounds before the last on a sample (federated.round_eval_rows): say so
        by_round.set_title(f"rounds before the last: {sampled[0]} test rows; the last: {sampled[-1]}", fontsize=8)
    by_bytes.set_xlabel("MiB sent, up + down, all clients (cumulative)")
    for ax in (by_round, by_bytes):
        ax.grid(alpha=0.3)
    by_bytes.legend(loc="lower right")
    fig.suptitle("Federated: global adapter on the server's test split")
    fig.tight_layout()
    save_figure(fig, path)


def plot_clients(rows: list[dict], path: Path) -> None:
    """Per client (x: run/client), peak memory measured vs the plan's prediction (left) and seconds per round
    measured vs the plan's estimate for this host, where a simulation runs every client (right; absent when the plan
    had no calibration of this CPU to estimate from)."""
    plt = _pyplot()
    fig, (memory, seconds) = plt.subplots(1, 2, figsize=(max(8, 0.6 * len(rows) + 4), 4))
    names = [f"{row['run']}\nclient {row['client']}" for row in rows]
    xs = list(range(len(rows)))
    width = 0.4
    memory.bar([x - width / 2 for x in xs], [row["peak_rss_mb"] for row in rows], width, label="measured peak RSS")
    memory.bar([x + width / 2 for x in xs], [row["predicted_peak_mb"] or 0 for row in rows], width,
               label="plan: predicted peak")
    seconds.bar([x - width / 2 for x in xs], [row["seconds"] for row in rows], width, label="measured (mean/round)")
    seconds.bar([x + width / 2 for x in xs], [row.get("predicted_seconds_here") or 0 for row in rows], width,
                label="plan: estimate on this host (0 = none)")
    memory.set_ylabel("MiB")
    seconds.set_ylabel("seconds per round on the client")
    for ax in (memory, seconds):
        ax.set_xticks(xs, names, rotation=90, fontsize=7)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Federated clients: measured against each one's plan")
    fig.tight_layout()
    save_figure(fig, path)
