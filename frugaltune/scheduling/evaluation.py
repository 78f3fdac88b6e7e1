"""The evaluation protocol: every policy on the same N-job sequences from the held-out part of a trace.

Library code: `evaluate(workload, HEURISTICS.values())` then `summary_table(...)`. The benchmark
`python benchmarks/scheduling_heuristics.py` runs it on the Lublin trace and prints the table.

Protocol (RLScheduler's `reset_for_test` idea, with an explicit held-out split so a learned policy can be trained on
the rest): the last `held_out_fraction` of the trace's jobs (in submit order) are the held-out part; `n_sequences`
start indices are drawn there with a seeded numpy Generator; each sequence is the `sequence_length` consecutive
jobs from its start, simulated on an empty machine; every policy, with and without EASY backfilling, runs on the
very same sequences. A sequence never crosses into the training part.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from frugaltune.scheduling.metrics import sequence_metrics
from frugaltune.scheduling.simulator import DEFAULT_WINDOW, Policy, SimulationResult, simulate
from frugaltune.scheduling.swf import Job, Workload


@dataclass(frozen=True)
class Protocol:
    """Where the test sequences come from. The defaults are the ones docs/SCHEDULING.md reports."""

    sequence_length: int = 256
    """Jobs per sequence (RLScheduler's JOB_SEQUENCE_SIZE)."""
    n_sequences: int = 20
    held_out_fraction: float = 0.3
    """The last fraction of the trace (by submit order) that sequences are drawn from."""
    seed: int = 0
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if not 0 < self.held_out_fraction <= 1:
            raise ValueError(f"held_out_fraction={self.held_out_fraction}: give a fraction in (0, 1].")
        if self.sequence_length < 1 or self.n_sequences < 1:
            raise ValueError(f"sequence_length={self.sequence_length}, n_sequences={self.n_sequences}: "
                             f"both must be >= 1.")


def held_out_start(workload: Workload, protocol: Protocol) -> int:
    """Index of the first held-out job; jobs before it are the training part."""
    return int(len(workload.jobs) * (1.0 - protocol.held_out_fraction))


def sequence_starts(workload: Workload, protocol: Protocol) -> np.ndarray:
    """The seeded start indices (into workload.jobs) of the test sequences, all inside the held-out part."""
    first = held_out_start(workload, protocol)
    room = len(workload.jobs) - first - protocol.sequence_length
    if room < 0:
        raise ValueError(f"{workload.source}: the held-out part has {len(workload.jobs) - first} jobs, fewer than "
                         f"sequence_length={protocol.sequence_length}. Raise held_out_fraction or shorten the "
                         f"sequences.")
    rng = np.random.default_rng(protocol.seed)
    return first + rng.integers(0, room + 1, size=protocol.n_sequences)


def sequences(workload: Workload, protocol: Protocol) -> list[list[Job]]:
    return [workload.jobs[s:s + protocol.sequence_length] for s in sequence_starts(workload, protocol)]


def evaluate(workload: Workload, policies: Iterable[Policy], protocol: Protocol = Protocol(),
             backfill_modes: Iterable[bool] = (False, True),
             keep_results: bool = False) -> tuple[pd.DataFrame, list[SimulationResult]]:
    """Simulate every (policy, backfill) on every sequence.

    Returns one row per (policy, backfill, sequence) with the `SequenceMetrics` columns plus `jobs`, `seconds`
    (wall time of that simulation) and `start_index`; and the raw results when `keep_results` (for plots).
    """
    starts = sequence_starts(workload, protocol)
    rows, results = [], []
    for policy in policies:
        for backfill in backfill_modes:
            for number, start in enumerate(starts):
                jobs = workload.jobs[start:start + protocol.sequence_length]
                began = time.perf_counter()
                result = simulate(jobs, workload.max_procs, policy, backfill=backfill, window=protocol.window)
                seconds = time.perf_counter() - began
                rows.append({"policy": policy.name, "backfill": backfill, "sequence": number,
                             "start_index": int(start), "jobs": len(jobs), "seconds": seconds,
                             **sequence_metrics(result).as_dict()})
                if keep_results:
                    results.append(result)
    return pd.DataFrame(rows), results


def summary_table(frame: pd.DataFrame, metric: str = "avg_bsld") -> pd.DataFrame:
    """Mean and std over sequences of `metric`, one row per policy (in the order first seen), one column pair per
    backfilling mode: `<metric> mean`/`std` without and `... +EASY` with."""
    order = list(dict.fromkeys(frame["policy"]))
    table = pd.DataFrame(index=pd.Index(order, name="policy"))
    for backfill, label in ((False, ""), (True, " +EASY")):
        part = frame[frame["backfill"] == backfill]
        if part.empty:
            continue
        stats = part.groupby("policy", sort=False)[metric].agg(["mean", "std"])
        table[f"{metric} mean{label}"] = stats["mean"]
        table[f"{metric} std{label}"] = stats["std"]
    return table


def markdown_table(table: pd.DataFrame, digits: int = 2) -> str:
    """The summary table as a GitHub markdown table (no `tabulate` dependency)."""
    header = [table.index.name or ""] + list(table.columns)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * len(table.columns)) + "|"]
    for name, row in table.iterrows():
        lines.append("| " + " | ".join([str(name)] + [f"{v:.{digits}f}" for v in row]) + " |")
    return "\n".join(lines)
