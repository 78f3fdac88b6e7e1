"""Judging policies on test sequences in both modes, what an LLM learned, and the teacher's ceiling.

Library code, used by the scheduling pipeline's `simulate_baselines` (heuristics and the teacher) and
`evaluate_policy` (the LLMs) stages: `judge(sequences, P, policies, window, teacher)` -> per mode (no backfilling,
EASY) per policy a summary; `judge_llms(workloads, specs, teacher, workers, threads)` -> the same for LLMs loaded
from `LLMSpec`s, the sequences dealt to `workers` processes; `teacher_results(...)` -> the lookahead teacher's own
schedules.

- **Both modes**: every policy runs without backfilling and with EASY (the policy picks the head job, EASY fills
  around it; see simulator.py) on the very same sequences.
- **What an LLM learned** (`DepartureLog`): at every decision with two or more visible jobs, whether the LLM's
  choice differs from F1's (the heuristic the prompts are lettered by, so copying it is the easy answer), and for
  each such departure whether the lookahead teacher, asked at that very state, makes the same choice. A student
  that departs often where the teacher disagrees learned noise; one that never departs learned F1.
- **LLMs in several processes** (`judge_llms`): an LLM's time goes to forwards of a 135M model on batches of at most
  one prompt per sequence; at that size one single-threaded process per thread the plan chose does more decisions
  per second than one process with every thread (the Python between forwards, the simulator and the prompt
  encoding overlap another process's matmuls; `python benchmarks/scheduling_eval_workers.py`, figures in
  docs/DECISIONS.md). `evaluation_workers` says how many. Each process loads every model once and schedules its
  share of every workload's sequences (dealt round-robin) in both modes; the schedules come back in the order of
  the sequences. A sequence's schedule does not depend on the others, but a batched forward's rounding does on
  the batch it is in, so an LLM's choice at a near tie may differ from a run with another number of workers.
- **The teacher's ceiling** (`teacher_results`): the teacher scheduling the test sequences itself. It sees actual
  run times in its rollouts (the student sees requested times), so it bounds what imitation of it can reach.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

import numpy as np

from frugaltune.scheduling.llm_policy import LLMPolicy, load_llm_policy
from frugaltune.scheduling.metrics import sequence_metrics
from frugaltune.scheduling.policies import F1, ScorePolicy
from frugaltune.scheduling.sft import LookaheadTeacher, teacher_episode
from frugaltune.scheduling.simulator import Policy, SchedulerState, SimulationResult, Simulator, simulate_batch
from frugaltune.scheduling.swf import Job

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

    def __call__(self, sim: Simulator, state: SchedulerState, job: Job) -> None:
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

    @classmethod
    def combined(cls, logs: Sequence["DepartureLog"]) -> "DepartureLog":
        """One log with the counts of `logs` (the same teacher and reference; one per worker process)."""
        total = cls(logs[0].teacher, logs[0].reference)
        for log in logs:
            total.decisions += log.decisions
            total.departures += log.departures
            total.teacher_agrees += log.teacher_agrees
            total.teacher_seconds += log.teacher_seconds
        return total

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


@dataclass(frozen=True)
class LLMSpec:
    """How to load an LLM policy in whichever process judges it: `llm_policy.load_llm_policy`'s arguments."""

    base_dir: str
    adapter_dir: str | None = None
    """None: the base model untuned."""
    name: str = "llm"
    fallback: str | None = None
    """A heuristic's name: it stands in (under a name that says so) when the model cannot be loaded."""
    options: dict = field(default_factory=dict)
    """`LLMPolicy` options and `bf16` (batch_size, max_running, order)."""

    def load(self, threads: int | None) -> Policy:
        return load_llm_policy(self.base_dir, self.adapter_dir, name=self.name, fallback=self.fallback,
                               threads=threads, **self.options)


def evaluation_workers(threads: int, n_sequences: int, min_sequences: int = 5) -> int:
    """Processes `judge_llms` deals sequences to: one per thread the plan chose (each single-threaded; see the
    module docstring), but at least `min_sequences` sequences each, or a lockstep batch holds too few prompts to
    use a forward."""
    return max(1, min(threads, n_sequences // min_sequences))


def _judge_share(specs: dict[str, LLMSpec], workloads: dict[str, tuple[Sequence[Sequence[Job]], int, int]],
                 teacher: LookaheadTeacher | None, threads: int | None, share: int, workers: int,
                 modes: dict[str, bool]) -> dict:
    """One worker's part of `judge_llms`: every spec on sequences share, share + workers, ... of each workload."""
    out: dict = {"names": {}, "parts": {}}
    for key, spec in specs.items():
        policy = spec.load(threads)
        llm = isinstance(policy, LLMPolicy)
        out["names"][key] = (policy.name, llm)
        for workload, (jobs, total_procs, window) in workloads.items():
            mine = list(jobs)[share::workers]
            for mode, backfill in modes.items():
                watch = DepartureLog(teacher) if llm else None
                before = policy.stats() if llm else {"model_calls": 0, "seconds": 0.0}
                began = time.perf_counter()
                runs = simulate_batch(mine, total_procs, policy, backfill=backfill, window=window, on_decision=watch)
                after = policy.stats() if llm else before
                out["parts"][workload, mode, key] = {
                    "runs": runs, "seconds": time.perf_counter() - began, "log": watch,
                    "model_calls": after["model_calls"] - before["model_calls"],
                    "policy_seconds": after["seconds"] - before["seconds"]}
    return out


def judge_llms(workloads: dict[str, tuple[Sequence[Sequence[Job]], int, int]], specs: dict[str, LLMSpec],
               teacher: LookaheadTeacher | None, workers: int = 1, threads: int | None = None,
               modes: dict[str, bool] = MODES, log=print,
               ) -> tuple[dict[str, dict[str, dict[str, dict]]], dict[str, dict[str, dict[str, list[SimulationResult]]]],
                          dict[str, tuple[str, bool]]]:
    """Every LLM of `specs` in `modes` on every workload ({name: (sequences, total_procs, window)}), in `workers`
    processes of `threads` torch threads each (see the module docstring; 1: in this process).

    Returns (summaries[workload][mode][key], results[workload][mode][key], {key: (the policy's name, whether it
    is an LLM)}): a spec whose model did not load is its fallback heuristic, under the name that says so. A
    summary is `judge`'s: `seconds` the mode's wall time (the slowest worker's), `model_calls` and
    `policy_seconds` summed over the workers, `decisions_per_s` per second of wall time, `departures`.
    """
    if workers < 1:
        raise ValueError(f"workers={workers}: give at least one process.")
    smallest = min(len(jobs) for jobs, _, _ in workloads.values())
    workers = min(workers, smallest)  # no worker without a sequence of every workload
    if workers == 1:
        shares = [_judge_share(specs, workloads, teacher, threads, 0, 1, modes)]
    else:
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            shares = [future.result() for future in [
                pool.submit(_judge_share, specs, workloads, teacher, threads, share, workers, modes)
                for share in range(workers)]]
    summaries: dict = {workload: {mode: {} for mode in modes} for workload in workloads}
    results: dict = {workload: {mode: {} for mode in modes} for workload in workloads}
    for workload, (jobs, _, _) in workloads.items():
        for mode in modes:
            for key in specs:
                parts = [share["parts"][workload, mode, key] for share in shares]
                runs: list = [None] * len(jobs)
                for share, part in enumerate(parts):
                    runs[share::workers] = part["runs"]
                summary = summarise(runs, max(part["seconds"] for part in parts))
                if shares[0]["names"][key][1]:
                    summary.update({
                        "model_calls": sum(part["model_calls"] for part in parts),
                        "policy_seconds": sum(part["policy_seconds"] for part in parts), "workers": workers,
                        "decisions_per_s": summary["decisions"] / summary["seconds"] if summary["seconds"] else 0.0,
                        "departures": DepartureLog.combined([part["log"] for part in parts]).report()})
                summaries[workload][mode][key], results[workload][mode][key] = summary, runs
                log(f"judge: {workload} {mode:11s} {shares[0]['names'][key][0]:10s} avg bsld "
                    f"{summary['avg_bsld']:10.2f} ({summary['seconds']:.1f} s, {workers} workers)")
    return summaries, results, shares[0]["names"]


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
