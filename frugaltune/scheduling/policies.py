"""Heuristic scheduling policies as score functions: the visible job with the lowest score runs first.

Library code: pass `FCFS`, `SJF`, `WFP3`, `UNICEF` or `F1` (or `HEURISTICS[name]`) to `simulator.simulate`;
`SJF_PRED` and `F1_PRED` score on predictions instead (`BASELINES` holds all seven).

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

On predictions (Tsafrir, Etsion & Feitelson, IEEE TPDS 2007): `SJF-pred` and `F1-pred` put the user's predicted
run time in place of r (`simulator.predicted_time`: the mean of the user's last two finished run times, capped by
the estimate; the estimate without history), and EASY, when on, reserves and backfills on the predictions too
(the policy's `runtime = "prediction"`; see simulator.py, which also kills a backfilled job at its estimate).

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

from frugaltune.scheduling.simulator import JobView, Runtime, SchedulerState

ScoreFn = Callable[..., float]
"""score(job, clock[, r]) -> float; lower runs first. r: the run time assumed (default: the job's requested time)."""

_EPS = 1e-15  # RLScheduler's uni_score epsilon (see the module docstring)


def fcfs_score(job: JobView, clock: float, r: float | None = None) -> float:
    return job.submit_time


def sjf_score(job: JobView, clock: float, r: float | None = None) -> float:
    return job.requested_time if r is None else r


def wfp3_score(job: JobView, clock: float, r: float | None = None) -> float:
    wait = clock - job.submit_time
    r = job.requested_time if r is None else r
    return -((wait / max(r, 1.0)) ** 3) * job.requested_procs


def unicef_score(job: JobView, clock: float, r: float | None = None) -> float:
    wait = clock - job.submit_time
    r = job.requested_time if r is None else r
    return -(wait + _EPS) / (math.log2(job.requested_procs + _EPS) * max(r, 1.0))


def f1_score(job: JobView, clock: float, r: float | None = None) -> float:
    r = job.requested_time if r is None else r
    r = r if r > 0 else 0.1
    s = job.submit_time if job.submit_time > 0 else 0.1
    return math.log10(r) * job.requested_procs + 870.0 * math.log10(s)


@dataclass(frozen=True)
class ScorePolicy:
    """A policy that runs the visible job with the lowest `score(job, clock, r)` (ties: submit time, then job id),
    r being the job's requested time, or its predicted run time when `runtime` is "prediction"."""

    name: str
    score: ScoreFn
    runtime: Runtime = "estimate"

    def choose(self, state: SchedulerState) -> JobView:
        clock, score, runtime = state.clock, self.score, self.runtime
        if runtime == "estimate":
            return min(state.queue, key=lambda job: (score(job, clock), job.submit_time, job.job_id))
        return min(state.queue, key=lambda job: (score(job, clock, state.runtime(job, runtime)), job.submit_time,
                                                 job.job_id))


FCFS = ScorePolicy("FCFS", fcfs_score)
SJF = ScorePolicy("SJF", sjf_score)
WFP3 = ScorePolicy("WFP3", wfp3_score)
UNICEF = ScorePolicy("UNICEF", unicef_score)
F1 = ScorePolicy("F1", f1_score)

HEURISTICS: dict[str, ScorePolicy] = {p.name: p for p in (FCFS, SJF, WFP3, UNICEF, F1)}
"""The five heuristic baselines by name, in the order the tables list them."""

SJF_PRED = ScorePolicy("SJF-pred", sjf_score, "prediction")
F1_PRED = ScorePolicy("F1-pred", f1_score, "prediction")

BASELINES: dict[str, ScorePolicy] = HEURISTICS | {p.name: p for p in (SJF_PRED, F1_PRED)}
"""The heuristics on estimates, then SJF and F1 on Tsafrir's predictions: every baseline the tables list."""
