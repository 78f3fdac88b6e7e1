"""Figures and `dvc plots` tables of a policy comparison: average bounded slowdown per policy, queue-length CDFs.

Library code, called by the scheduling pipeline's `simulate_baselines` and `evaluate_policy` stages. Matplotlib
writes files only (Agg backend); every file is written under a temp name and renamed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from frugaltune.io import save_figure
from frugaltune.scheduling.metrics import queue_length_cdf
from frugaltune.scheduling.simulator import SimulationResult


def cdf_on_grid(results: list[SimulationResult], grid: np.ndarray) -> np.ndarray:
    """P(queue length <= q) for each q of `grid`, time-weighted and pooled over `results`."""
    values, fractions = queue_length_cdf(results)
    index = np.searchsorted(values, grid, side="right") - 1
    return np.where(index >= 0, fractions[np.clip(index, 0, None)], 0.0)


def queue_cdf_table(by_policy: dict[str, list[SimulationResult]]) -> str:
    """CSV: `queue_length` then one CDF column per policy, on the lengths 0..max seen (for `dvc plots`)."""
    longest = max(int(r.queue_lengths.max()) for runs in by_policy.values() for r in runs)
    grid = np.arange(longest + 1)
    columns = {name: cdf_on_grid(runs, grid) for name, runs in by_policy.items()}
    lines = [",".join(["queue_length", *columns])]
    for i, q in enumerate(grid):
        lines.append(",".join([str(q), *(f"{columns[name][i]:.6f}" for name in columns)]))
    return "\n".join(lines) + "\n"


def plot_queue_cdf(by_policy: dict[str, list[SimulationResult]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in by_policy.items():
        values, fractions = queue_length_cdf(runs)
        ax.step(values, fractions, where="post", label=name, linewidth=2 if name in ("finetuned", "base") else 1)
    ax.set_xscale("symlog")
    ax.set_xlabel("waiting jobs")
    ax.set_ylabel("fraction of time the queue is at most this long")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    save_figure(fig, path)


def plot_bsld(means: dict[str, float], stds: dict[str, float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(means)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, [means[n] for n in names], yerr=[stds[n] for n in names], capsize=3)
    ax.set_yscale("log")
    ax.set_ylabel("average bounded slowdown (log scale)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
