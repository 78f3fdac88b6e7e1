"""Figures and `dvc plots` tables of a policy comparison: average bounded slowdown per policy, queue-length CDFs.

Library code, called by the scheduling pipeline's `simulate_baselines` and `evaluate_policy` stages. Matplotlib
writes files only (Agg backend); every file is written under a temp name and renamed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from frugaltune.io import save_figure


Cdf = Sequence[Sequence[float]]
"""(queue lengths seen, ascending; P[queue length <= each]), as `metrics.queue_length_cdf` gives it for a set of
schedules, or as lists (`judge.judge_workloads`): a report can store it (evaluate_base's, for evaluate_policy to
draw) where it could not store the schedules."""


def cdf_on_grid(cdf: Cdf, grid: np.ndarray) -> np.ndarray:
    """P(queue length <= q) for each q of `grid`, from a `cdf`."""
    values, fractions = np.asarray(cdf[0]), np.asarray(cdf[1], dtype=float)
    index = np.searchsorted(values, grid, side="right") - 1
    return np.where(index >= 0, fractions[np.clip(index, 0, None)], 0.0)


def queue_cdf_table(by_policy: dict[str, Cdf]) -> str:
    """CSV: `queue_length` then one CDF column per policy, on the lengths 0..max seen (for `dvc plots`)."""
    longest = max(int(np.max(values)) for values, _ in by_policy.values())
    grid = np.arange(longest + 1)
    columns = {name: cdf_on_grid(cdf, grid) for name, cdf in by_policy.items()}
    lines = [",".join(["queue_length", *columns])]
    for i, q in enumerate(grid):
        lines.append(",".join([str(q), *(f"{columns[name][i]:.6f}" for name in columns)]))
    return "\n".join(lines) + "\n"


def plot_queue_cdf(by_policy: dict[str, Cdf], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (values, fractions) in by_policy.items():
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
