"""Schedule quality: bounded slowdown, waiting time, utilisation, queue length over time.

Library code: `sequence_metrics(simulate(...))`. Not run on its own.

Bounded slowdown (Feitelson et al., "Theory and Practice in Parallel Job Scheduling", 1997), the metric
RLScheduler optimises (HPCSimPickJobs.py job_score, score type 0) with the same tau of 10 s:

    bsld = max((wait + run) / max(run, tau), 1)

tau keeps a one-second job that waited a minute from weighing 60x more than an hour-long job that waited an hour.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from frugaltune.scheduling.simulator import SimulationResult

BSLD_TAU = 10.0
"""Seconds; runs shorter than this count as this long in the bounded slowdown."""


def bounded_slowdown(wait: np.ndarray | float, run: np.ndarray | float, tau: float = BSLD_TAU) -> np.ndarray:
    """Per-job bounded slowdown max((wait + run) / max(run, tau), 1)."""
    wait, run = np.asarray(wait, dtype=float), np.asarray(run, dtype=float)
    return np.maximum((wait + run) / np.maximum(run, tau), 1.0)


def utilisation(result: SimulationResult) -> float:
    """Busy processor-seconds / available processor-seconds, from the first submit to the last end.

    The span starts at the first submit (when the simulated machine starts, empty), so a sequence that begins on an
    idle machine counts that idleness; every policy is measured over the same jobs, so the comparison is fair.
    """
    span = float(result.end.max() - result.submit.min())
    if span <= 0:
        return 1.0
    return float((result.run * result.procs).sum() / (result.total_procs * span))


def queue_length_durations(result: SimulationResult) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, seconds): how long the queue held each number of waiting jobs, over the whole schedule."""
    times = np.append(result.queue_times, result.end.max())
    return result.queue_lengths, np.diff(times)


def mean_queue_length(result: SimulationResult) -> float:
    """Time-weighted mean number of waiting jobs."""
    lengths, seconds = queue_length_durations(result)
    total = seconds.sum()
    return float((lengths * seconds).sum() / total) if total > 0 else 0.0


def queue_length_cdf(results: list[SimulationResult]) -> tuple[np.ndarray, np.ndarray]:
    """(q, P[queue length <= q]) with time as the weight, pooled over several schedules (e.g. all sequences).

    Returns the distinct queue lengths seen, ascending, and the fraction of simulated time the queue was at most
    that long. Pooling sums seconds, so a long schedule weighs more than a short one.
    """
    lengths = np.concatenate([queue_length_durations(r)[0] for r in results])
    seconds = np.concatenate([queue_length_durations(r)[1] for r in results])
    values = np.unique(lengths)
    per_value = np.array([seconds[lengths == v].sum() for v in values])
    total = per_value.sum()
    return values, (np.cumsum(per_value) / total if total > 0 else np.ones(len(values)))


@dataclass(frozen=True)
class SequenceMetrics:
    """The numbers the evaluation tables report for one simulated job sequence."""

    avg_bsld: float
    max_bsld: float
    mean_wait: float
    utilisation: float
    mean_queue_length: float
    makespan: float
    backfilled: int

    def as_dict(self) -> dict:
        return asdict(self)


def sequence_metrics(result: SimulationResult, tau: float = BSLD_TAU) -> SequenceMetrics:
    bsld = bounded_slowdown(result.wait, result.run, tau)
    return SequenceMetrics(
        avg_bsld=float(bsld.mean()), max_bsld=float(bsld.max()), mean_wait=float(result.wait.mean()),
        utilisation=utilisation(result), mean_queue_length=mean_queue_length(result),
        makespan=float(result.end.max() - result.submit.min()), backfilled=result.backfilled,
    )
