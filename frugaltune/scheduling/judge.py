"""Judging policies on test sequences in both modes, what an LLM learned, and the teacher's ceiling.

Library code, used by the scheduling pipeline's `simulate_baselines` (heuristics and the teacher), `evaluate_base`
(the untuned model) and `evaluate_policy` (the fine-tuned one) stages: `judge(sequences, P, policies, window,
teacher)` -> per mode (no backfilling, EASY) per policy a summary; `judge_workloads(...)` the same on several
workloads, with each schedule set's queue-length CDF; `teacher_results(...)` -> the lookahead teacher's own
schedules.

- **Both modes**: every policy runs without backfilling and with EASY (the policy picks the head job, EASY fills
  around it; see simulator.py) on the very same sequences.
- **What an LLM learned** (`DepartureLog`): at every decision with two or more visible jobs, whether the LLM's
  choice differs from F1's (the heuristic the prompts are lettered by, so copying it is the easy answer), and for
  each such departure whether the lookahead teacher, asked at that very state, makes the same choice. A student
  that departs often where the teacher disagrees learned noise; one that never departs learned F1.
- **The teacher's ceiling** (`teacher_results`): the teacher scheduling the test sequences itself. It sees actual
  run times in its rollouts (the student sees requested times), so it bounds what imitation of it can reach.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from frugaltune.scheduling.evaluation import Protocol, sequences
from frugaltune.scheduling.llm_policy import LLMPolicy
from frugaltune.scheduling.metrics import queue_length_cdf, sequence_metrics
from frugaltune.scheduling.policies import F1, ScorePolicy
from frugaltune.scheduling.sft import LookaheadTeacher, teacher_episode
from frugaltune.scheduling.simulator import (
    JobView,
    Policy,
    SchedulerState,
    SimulationResult,
    Simulator,
    simulate_batch,
)
from frugaltune.scheduling.swf import Job, Workload

MODES = {"no_backfill": False, "easy": True}
"""The two modes every policy is judged in, by the names reports use."""


def summarise(results: Sequence[SimulationResult], seconds: float) -> dict:
    """Mean/std over sequences of the per-sequence average bounded slowdown, mean wait and queue length."""
    values = [sequence_metrics(r) for r in results]
    bsld = np.array([m.avg_bsld for m in values])
    return {"avg_bsld": float(bsld.mean()), "avg_bsld_std": float(bsld.std(ddof=1)) if len(bsld) > 1 else 0.0,
            "mean_wait": float(np.mean([m.mean_wait for m in values])),
            "mean_queue_length": float(np.mean([m.mean_queue_length for m in values])),
            "decisions": int(sum(r.decisions for r in results)), "seconds": seconds,
            "per_sequence_avg_bsld": [float(v) for v in bsld]}


class DepartureLog:
    """An `on_decision` observer for `simulate_batch`: counts departures from `reference` and the teacher's
    agreement with them (see the module docstring). `teacher=None` counts departures only."""

    def __init__(self, teacher: LookaheadTeacher | None = None, reference: ScorePolicy = F1):
        self.teacher = teacher
        self.reference = reference
        self.decisions = 0
        self.departures = 0
        self.teacher_agrees = 0
        self.teacher_seconds = 0.0

    def __call__(self, sim: Simulator, state: SchedulerState, job: JobView) -> None:
        if len(state.queue) < 2:  # a forced choice is no decision
            return
        self.decisions += 1
        if job is self.reference.choose(state):
            return
        self.departures += 1
        if self.teacher is not None:
            began = time.perf_counter()
            self.teacher_agrees += self.teacher.choose(sim, state) is job
            self.teacher_seconds += time.perf_counter() - began

    def report(self) -> dict:
        """Counts and shares; `teacher_agreement_share` is None when there was no departure (or no teacher)."""
        asked = self.teacher is not None and self.departures > 0
        return {"reference": self.reference.name, "decisions": self.decisions, "departures": self.departures,
                "departure_share": self.departures / self.decisions if self.decisions else 0.0,
                "teacher_agrees": self.teacher_agrees if self.teacher is not None else None,
                "teacher_agreement_share": self.teacher_agrees / self.departures if asked else None,
                "teacher_seconds": self.teacher_seconds}


def judge(sequences: Sequence[Sequence[Job]], total_procs: int, policies: dict[str, Policy], window: int,
          teacher: LookaheadTeacher | None = None, log=print,
          ) -> tuple[dict[str, dict[str, dict]], dict[str, dict[str, list[SimulationResult]]]]:
    """Every policy in both `MODES` on `sequences`: (summaries[mode][key], results[mode][key]). An `LLMPolicy`'s
    summary also holds its own stats for that mode (decisions/s, model calls) and its `departures` report."""
    summaries: dict[str, dict[str, dict]] = {mode: {} for mode in MODES}
    results: dict[str, dict[str, list[SimulationResult]]] = {mode: {} for mode in MODES}
    for mode, backfill in MODES.items():
        for key, policy in policies.items():
            watch = DepartureLog(teacher) if isinstance(policy, LLMPolicy) else None
            before = policy.stats() if isinstance(policy, LLMPolicy) else None
            began = time.perf_counter()
            runs = simulate_batch(sequences, total_procs, policy, backfill=backfill, window=window,
                                  on_decision=watch)
            summary = summarise(runs, time.perf_counter() - began)
            if isinstance(policy, LLMPolicy) and watch is not None and before is not None:
                after = policy.stats()  # cumulative over modes: this mode's share is the difference
                calls, seconds = after["model_calls"] - before["model_calls"], after["seconds"] - before["seconds"]
                summary.update({"model_calls": calls, "policy_seconds": seconds,
                                "decisions_per_s": summary["decisions"] / seconds if seconds > 0 else 0.0,
                                "departures": watch.report()})
            summaries[mode][key], results[mode][key] = summary, runs
            log(f"judge: {mode:11s} {policy.name:10s} avg bsld {summary['avg_bsld']:10.2f} "
                f"({summary['seconds']:.1f} s)")
    return summaries, results


def judge_workloads(workloads: dict[str, tuple[Workload, Protocol]], policies: dict[str, Policy],
                    teacher: LookaheadTeacher | None = None, log=print) -> tuple[dict, dict]:
    """`judge` on each workload's test sequences (`evaluation.sequences` of its protocol): (summaries[workload][mode]
    [key], cdfs[workload][mode][key]), a CDF being the (lengths, fractions) lists of `metrics.queue_length_cdf` over
    that policy's schedules (what a report can store and `plots` draws)."""
    summaries, cdfs = {}, {}
    for name, (workload, proto) in workloads.items():
        log(f"judge: {name}: {proto.n_sequences} sequences of {proto.sequence_length} jobs on {workload.max_procs} "
            f"processors")
        summaries[name], results = judge(sequences(workload, proto), workload.max_procs, policies, proto.window,
                                         teacher, log)
        cdfs[name] = {mode: {key: [part.tolist() for part in queue_length_cdf(runs)] for key, runs in by_key.items()}
                      for mode, by_key in results.items()}
    return summaries, cdfs


def teacher_results(sequences: Sequence[Sequence[Job]], total_procs: int, teacher: LookaheadTeacher, window: int,
                    backfill: bool) -> list[SimulationResult]:
    """The teacher's own schedule of each sequence (its ceiling: see the module docstring)."""
    return [teacher_episode(jobs, total_procs, teacher, window, backfill)[0] for jobs in sequences]


def compact(summary: dict) -> dict:
    """The numbers a side-by-side table needs (no per-sequence lists), departures included for LLMs."""
    keep = {k: summary[k] for k in ("avg_bsld", "avg_bsld_std", "mean_wait") if k in summary}
    if "departures" in summary:
        keep["departures"] = summary["departures"]
    return keep
