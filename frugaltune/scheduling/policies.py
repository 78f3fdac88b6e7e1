"""Heuristic scheduling policies as score functions: the visible job with the lowest score runs first.

Library code: pass `FCFS`, `SJF`, `WFP3`, `UNICEF` or `F1` (or `HEURISTICS[name]`) to `simulator.simulate`.

Notation as in Carastan-Santos & de Camargo, "Obtaining Dynamic Scheduling Policies with Simulation and Machine
Learning" (SC'17), and Zhang et al., "RLScheduler" (SC'20), whose code (DIR-LAB/deep-batch-scheduler,
HPCSimPickJobs.py: fcfs_score, sjf_score, wfp_score, uni_score, f1_score) these formulas were checked against:
s = submit time, r = requested time (the user's estimate, never the actual run time), n = requested processors,
w = time waited so far (clock - s).

    FCFS    s
    SJF     r
    WFP3    -(w / r)^3 * n                  (Tang et al. 2009: old and short jobs first, wide ones not starved)
    UNICEF  -w / (log2(n) * r)              (Tang et al. 2009; written UNICEP in some codes: small, short first)
    F1      log10(r) * n + 870 * log10(s)   (Carastan-Santos & de Camargo 2017, learned by regression)

Ties (equal scores) go to the earlier submit time, then the lower job id, so every policy is deterministic.

Edge cases, decided the way RLScheduler's code decides them so the numbers stay comparable:
- UNICEF with n = 1: log2(1) = 0. RLScheduler adds 1e-15 to n and to w, so a one-processor job's score is about
  -w * 7e14 / r: one-processor jobs go first, longest-waiting-per-requested-second first. Kept as is.
- F1 with r or s <= 0: RLScheduler uses 0.1 in the logarithm; so do we. F1 depends on absolute submit times
  (the trace's clock), as in both papers.
- r = 0 (a zero-second job whose request fell back to its run time) would divide by zero in WFP3 and UNICEF; we
  divide by max(r, 1 s) instead. RLScheduler drops zero-run-time jobs at load, so it never meets this case.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from frugaltune.scheduling.simulator import SchedulerState
from frugaltune.scheduling.swf import Job

ScoreFn = Callable[[Job, float], float]
"""score(job, clock) -> float; lower runs first."""

_EPS = 1e-15  # RLScheduler's uni_score epsilon (see the module docstring)


def fcfs_score(job: Job, clock: float) -> float:
    return job.submit_time


def sjf_score(job: Job, clock: float) -> float:
    return job.requested_time


def wfp3_score(job: Job, clock: float) -> float:
    wait = clock - job.submit_time
    return -((wait / max(job.requested_time, 1.0)) ** 3) * job.requested_procs


def unicef_score(job: Job, clock: float) -> float:
    wait = clock - job.submit_time
    return -(wait + _EPS) / (math.log2(job.requested_procs + _EPS) * max(job.requested_time, 1.0))


def f1_score(job: Job, clock: float) -> float:
    r = job.requested_time if job.requested_time > 0 else 0.1
    s = job.submit_time if job.submit_time > 0 else 0.1
    return math.log10(r) * job.requested_procs + 870.0 * math.log10(s)


@dataclass(frozen=True)
class ScorePolicy:
    """A policy that runs the visible job with the lowest `score(job, clock)` (ties: submit time, then job id)."""

    name: str
    score: ScoreFn

    def choose(self, state: SchedulerState) -> Job:
        clock, score = state.clock, self.score
        return min(state.queue, key=lambda job: (score(job, clock), job.submit_time, job.job_id))


FCFS = ScorePolicy("FCFS", fcfs_score)
SJF = ScorePolicy("SJF", sjf_score)
WFP3 = ScorePolicy("WFP3", wfp3_score)
UNICEF = ScorePolicy("UNICEF", unicef_score)
F1 = ScorePolicy("F1", f1_score)

HEURISTICS: dict[str, ScorePolicy] = {p.name: p for p in (FCFS, SJF, WFP3, UNICEF, F1)}
"""The five heuristic baselines by name, in the order the tables list them."""
