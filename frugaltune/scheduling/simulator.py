"""Event-driven simulator of one parallel machine running a batch queue, with pluggable policies and EASY backfilling.

Library code: `simulate(workload.jobs, workload.max_procs, FCFS, backfill=True)`. Not run on its own; the benchmark
`python benchmarks/scheduling_heuristics.py` drives it over many job sequences. What a policy sees (`JobView`,
`SchedulerState`, `Policy`) and EASY's reservation live in `state.py`; this module re-exports them.

The model (the one RLScheduler's HPCSimPickJobs.py uses, made explicit):

- A machine of P identical processors, empty at the first job's submit time. A job arrives at its submit time,
  asks for `requested_procs` processors and, once started, holds them for its actual `run_time`. No preemption.
- The queue is the waiting jobs in arrival order (submit time, then job id). A policy sees the first `window` of
  them (RLScheduler's MAX_QUEUE_SIZE is 128, hence `DEFAULT_WINDOW`) plus the clock, the free processors and the
  running jobs with their *expected* ends (start + requested time), and picks one job.
- The picked job is committed: it starts as soon as enough processors are free, and until then the machine waits
  for it; no other job may jump ahead, except by EASY backfilling. Committing is RLScheduler's convention
  (`skip_for_resources_greedy`), and it keeps a policy's decision meaningful: asking again at every event would let
  a policy that changes its mind starve the wide job it picked a moment ago.
- **EASY backfilling** (Lifka 1995; Mu'alem & Feitelson 2001), with any policy: while the committed (head) job
  waits, it gets a reservation at the shadow time, the earliest time enough processors are free if every running
  job ends at its expected end. Then every other waiting job, in arrival order, starts now if it fits in the free
  processors and either its requested time ends by the shadow time or it uses only processors that are still
  spare at the shadow time (the "extra" processors). The pass repeats at every event while the head waits.
- **What a policy sees** (`SchedulerState`): what a real scheduler has at decision time, nothing more. Waiting
  and running jobs are `JobView`s: requested processors and time, submit time (so the wait so far), user and group
  id; a view has no run time. Beside them, the history of each user's *finished* jobs (`state.history(job)`: the
  last `HISTORY` of them, actual and requested times) and Tsafrir's prediction from it (`state.predicted_time`).
  The actual run time only ends a job (its completion event).
- **Run times assumed** (`runtime`): "estimate" (the user's requested time, the default) or "prediction" (Tsafrir,
  Etsion & Feitelson, IEEE TPDS 2007: the mean of the user's last two actual run times, capped by the estimate;
  the estimate while the user has none). A running job's expected end is start + that time; once a job runs past
  a prediction, its expected end becomes start + its estimate (the prediction was wrong; the estimate is the
  kill limit). EASY's reservations and backfilling decisions use these expected ends.
- **Kill at the estimate**: a backfilled job runs at most its requested time (the system kills it there, as real
  ones do and as Tsafrir et al. simulate), so a job backfilled on a short prediction can delay the reservation by
  at most its estimate.
- Events at the same time: completions first, then arrivals, then scheduling; ties between jobs go by
  (submit time, job id) everywhere, so a run is a pure function of its inputs.
- Time never advances during a decision: a policy can be slow (an LLM) without changing the schedule.

Cost: heaps for completions, one pass over the window per decision, and a backfill scan that stops as soon as no
processor is free, so 10,000 jobs take a few seconds in CPython (the benchmark prints the rate).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from frugaltune.scheduling.state import (
    HISTORY,
    RUNTIMES,
    Finished,
    JobView,
    Policy,
    RunningJob,
    Runtime,
    SchedulerState,
    predicted_time,
    reservation,
)
from frugaltune.scheduling.swf import Job

DEFAULT_WINDOW = 128
"""Waiting jobs a policy sees, oldest first. RLScheduler's MAX_QUEUE_SIZE (HPCSimPickJobs.py) is 128; its heuristic
baselines sort the whole queue, which is the same thing whenever fewer than 128 jobs wait."""


@dataclass
class SimulationResult:
    """One simulated schedule. Per-job arrays are in the order of the input jobs (submit time, then id)."""

    policy: str
    backfill: bool
    total_procs: int
    job_ids: np.ndarray
    submit: np.ndarray
    start: np.ndarray
    end: np.ndarray
    run: np.ndarray
    procs: np.ndarray
    queue_times: np.ndarray
    """Times at which the number of waiting jobs changed (the first is the first submit)."""
    queue_lengths: np.ndarray
    """Waiting jobs from queue_times[i] until queue_times[i + 1] (the last value holds until the last end)."""
    decisions: int
    """How many times the policy was asked (once per job started other than by backfilling)."""
    backfilled: int
    """Jobs started early by EASY backfilling."""

    @property
    def wait(self) -> np.ndarray:
        return self.start - self.submit

    def schedule(self) -> dict[int, float]:
        """{job id: start time}: the schedule, as the tests write it by hand."""
        return {int(i): float(s) for i, s in zip(self.job_ids, self.start)}


class Simulator:
    """The simulation as an object that stops at each decision, so a caller can look ahead before committing.

    `simulate()` is the plain loop over it. A lookahead teacher (`frugaltune.scheduling.sft`) or a batched LLM
    evaluation drives it directly:

        sim = Simulator(jobs, total_procs, backfill=False, window=8)
        while (state := sim.next_decision()) is not None:
            trial = sim.clone()           # an independent copy: same clock, queue, running jobs, schedule so far
            ...
            sim.commit(chosen_job)        # one of state.queue
        result = sim.result("my policy")

    Stopping at a decision changes nothing in the model: time stands still during a decision in `simulate` too,
    so a schedule driven step by step is the one `simulate` gives for the same choices.
    """

    def __init__(self, jobs: Sequence[Job], total_procs: int, *, backfill: bool = False,
                 window: int = DEFAULT_WINDOW, runtime: Runtime = "estimate"):
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime={runtime!r}: use one of {', '.join(RUNTIMES)}.")
        if window < 1:
            raise ValueError(f"window={window}: the policy must see at least one waiting job; use window >= 1.")
        if not jobs:
            raise ValueError("no jobs to simulate; give at least one job.")
        arrivals = sorted(jobs, key=lambda j: (j.submit_time, j.job_id))
        for job in arrivals:
            if not 0 < job.requested_procs <= total_procs:
                raise ValueError(f"job {job.job_id} asks for {job.requested_procs} processors; the machine has "
                                 f"{total_procs}. Filter the jobs or simulate a bigger machine.")
        self.total_procs = total_procs
        self.backfill = backfill
        self.window = window
        self.runtime = runtime
        self.arrivals = arrivals                       # shared by clones: never modified
        self._index = {id(job): i for i, job in enumerate(arrivals)}  # shared too
        self.views = [JobView.of(job) for job in arrivals]  # what policies see of each job; shared too
        self._view_index = {id(view): i for i, view in enumerate(self.views)}
        self.start = np.full(len(arrivals), np.nan)
        self.ran = np.array([job.run_time for job in arrivals], dtype=float)  # less where killed at the estimate
        self.finished: dict[int, tuple[Finished, ...]] = {}  # user id -> last HISTORY finished jobs
        self.clock = arrivals[0].submit_time
        self.free = total_procs
        self.waiting: list[Job] = []                   # arrival order, so the visible window is waiting[:window]
        self.running: dict[int, RunningJob] = {}       # keyed by id(job): job ids are not unique in every trace
        self._completions: list[tuple[float, float, int, int]] = []  # (actual end, submit, job id, id(job)): heap
        self.head: Job | None = None                   # the committed choice, waiting for processors
        self.next_arrival = 0
        self.arrival_limit = len(arrivals)             # jobs arrivals[arrival_limit:] never arrive (see clone)
        self.decisions = 0
        self.backfilled = 0
        self._queue_times: list[float] = []
        self._queue_lengths: list[int] = []
        self._at_events = True                         # False: the events at `clock` are processed already
        self._pending: SchedulerState | None = None    # the decision asked for and not yet committed
        self.done = False

    def clone(self, future_arrivals: int | None = None, future: Sequence[Job] | None = None) -> "Simulator":
        """An independent copy at this point (a pending decision included); the jobs themselves are shared.

        `future_arrivals`: the copy admits only that many more jobs (a bounded lookahead: a rollout that must
        schedule the rest of a long trace would cost more than it tells about this decision).
        `future`: the jobs the copy admits after the ones already arrived, instead of the true ones (a rollout over
        an imagined future: a teacher that knows only what a policy could know); submit times not before the clock.
        """
        other = object.__new__(Simulator)
        other.__dict__.update(self.__dict__)
        if future is not None:
            if future_arrivals is not None:
                raise ValueError("clone(): give future_arrivals (a cut of the true arrivals) or future, not both.")
            known = self.arrivals[:self.next_arrival]
            other.arrivals = list(known) + sorted(future, key=lambda j: (j.submit_time, j.job_id))
            if other.arrivals[len(known):] and other.arrivals[len(known)].submit_time < self.clock:
                raise ValueError(f"clone(): a future job is submitted at {other.arrivals[len(known)].submit_time}, "
                                 f"before the clock {self.clock}; shift it to the clock or later.")
            other._index = {id(job): i for i, job in enumerate(other.arrivals)}
            other.views = self.views[:len(known)] + [JobView.of(job) for job in other.arrivals[len(known):]]
            other._view_index = {id(view): i for i, view in enumerate(other.views)}
            other.start = np.concatenate([self.start[:self.next_arrival], np.full(len(future), np.nan)])
            other.ran = np.concatenate([self.ran[:self.next_arrival],
                                        np.array([j.run_time for j in other.arrivals[len(known):]], dtype=float)])
            other.arrival_limit = len(other.arrivals)
        else:
            if future_arrivals is not None:
                other.arrival_limit = min(self.arrival_limit, self.next_arrival + max(future_arrivals, 0))
            other.start = self.start.copy()
            other.ran = self.ran.copy()
        other.waiting = list(self.waiting)
        other.running = dict(self.running)
        other.finished = dict(self.finished)  # its values are tuples, never changed in place
        other._completions = list(self._completions)  # a copied heap is still a heap
        other._queue_times = list(self._queue_times)
        other._queue_lengths = list(self._queue_lengths)
        if self._pending is not None:
            other._pending = other._state()
        return other

    def _state(self) -> SchedulerState:
        return SchedulerState(self.clock, self.total_procs, self.free,
                              [self.views[self._index[id(job)]] for job in self.waiting[:self.window]],
                              len(self.waiting), self.running, self.finished)

    def _expected_run(self, view: JobView) -> float:
        if self.runtime == "estimate" or view.user_id < 0:
            return view.requested_time
        return predicted_time(view.requested_time, self.finished.get(view.user_id, ()))

    def _start_job(self, job: Job, kill_at_estimate: bool = False) -> None:
        index = self._index[id(job)]
        view = self.views[index]
        self.free -= job.requested_procs
        self.start[index] = self.clock
        if kill_at_estimate and job.run_time > job.requested_time:
            self.ran[index] = job.requested_time
        self.running[id(job)] = RunningJob(view, self.clock, self.clock + self._expected_run(view))
        heapq.heappush(self._completions, (self.clock + self.ran[index], job.submit_time, job.job_id, id(job)))
        self.waiting.remove(job)  # identity comparison (Job has eq=False), and the job is near the front

    def _complete(self, key: int) -> None:
        """The job `running[key]` ends now: its processors come back and its user's history learns its run."""
        r = self.running.pop(key)
        self.free += r.job.requested_procs
        if r.job.user_id >= 0:
            done = Finished(self.clock - r.start, r.job.requested_time, r.job.requested_procs)
            self.finished[r.job.user_id] = (self.finished.get(r.job.user_id, ()) + (done,))[-HISTORY:]

    def next_decision(self) -> SchedulerState | None:
        """Advance until the policy must pick a job; that decision's state, or None once every job has started
        and ended. Calling it again before `commit` returns the same pending decision."""
        if self._pending is not None:
            return self._pending
        while not self.done:
            if self._at_events:
                while self._completions and self._completions[0][0] <= self.clock:
                    self._complete(heapq.heappop(self._completions)[3])
                while (self.next_arrival < self.arrival_limit
                       and self.arrivals[self.next_arrival].submit_time <= self.clock):
                    self.waiting.append(self.arrivals[self.next_arrival])
                    self.next_arrival += 1
                self._at_events = False

            while self.waiting:
                if self.head is None:
                    self._pending = self._state()
                    return self._pending
                if self.head.requested_procs <= self.free:
                    self._start_job(self.head)
                    self.head = None
                    continue
                if self.backfill and self.free > 0:
                    self._backfill()
                break  # the head waits for the next event

            if not self._queue_lengths or self._queue_lengths[-1] != len(self.waiting):
                self._queue_times.append(self.clock)
                self._queue_lengths.append(len(self.waiting))
            next_times = []
            if self._completions:
                next_times.append(self._completions[0][0])
            if self.next_arrival < self.arrival_limit:
                next_times.append(self.arrivals[self.next_arrival].submit_time)
            if not next_times:
                self.done = True
                break
            self.clock = min(next_times)
            self._at_events = True
        return None

    def _backfill(self) -> None:
        shadow, extra = reservation(self.head, self.free, self.running, self.clock)
        for job in list(self.waiting):
            if job is self.head or job.requested_procs > self.free:
                continue
            if self.clock + self._expected_run(self.views[self._index[id(job)]]) <= shadow:
                self._start_job(job, kill_at_estimate=True)
            elif job.requested_procs <= extra:
                extra -= job.requested_procs  # it will still hold these at the shadow time
                self._start_job(job, kill_at_estimate=True)
            else:
                continue
            self.backfilled += 1
            if self.free == 0:
                break

    def commit(self, job: JobView, policy_name: str = "policy") -> None:
        """Answer the pending decision with `job`, which must be one of its `state.queue`."""
        state = self._pending
        if state is None:
            raise RuntimeError("commit() without a pending decision: call next_decision() first.")
        if not any(j is job for j in state.queue):
            raise ValueError(f"policy {policy_name!r} chose {job!r}, which is not in the visible queue; "
                             f"choose() must return one of state.queue.")
        self.head = self.arrivals[self._view_index[id(job)]]
        self.decisions += 1
        self._pending = None

    def started(self, job: Job) -> bool:
        return not np.isnan(self.start[self._index[id(job)]])


    def run_to_end(self, policy: Policy) -> None:
        """Let `policy` make every remaining decision."""
        while (state := self.next_decision()) is not None:
            self.commit(policy.choose(state), policy.name)

    def result(self, policy_name: str) -> SimulationResult:
        """The finished schedule (call after `next_decision()` returned None)."""
        if not self.done:
            raise RuntimeError("result() before the simulation ended: drive next_decision() until it returns None.")
        arrivals = self.arrivals
        submit = np.array([j.submit_time for j in arrivals], dtype=float)
        run = self.ran.copy()
        return SimulationResult(
            policy=policy_name, backfill=self.backfill, total_procs=self.total_procs,
            job_ids=np.array([j.job_id for j in arrivals]), submit=submit, start=self.start.copy(),
            end=self.start + run, run=run, procs=np.array([j.requested_procs for j in arrivals]),
            queue_times=np.array(self._queue_times, dtype=float), queue_lengths=np.array(self._queue_lengths),
            decisions=self.decisions, backfilled=self.backfilled,
        )


def runtime_of(policy: object) -> Runtime:
    """The run times `policy` schedules on: its `runtime` attribute ("estimate" or "prediction"), else estimates."""
    return getattr(policy, "runtime", "estimate")


def simulate(jobs: Sequence[Job], total_procs: int, policy: Policy, *, backfill: bool = False,
             window: int = DEFAULT_WINDOW) -> SimulationResult:
    """Run `jobs` on a machine of `total_procs` processors under `policy` (see the module docstring for the model).

    Args:
        jobs: the jobs, any order (they are admitted by submit time, then id); each no wider than the machine.
        total_procs: processors of the machine (`Workload.max_procs`).
        policy: picks the next job from the visible queue.
        backfill: EASY backfilling on or off (on the run times the policy assumes: `runtime_of(policy)`).
        window: how many waiting jobs (oldest first) the policy sees; >= 1.
    """
    sim = Simulator(jobs, total_procs, backfill=backfill, window=window, runtime=runtime_of(policy))
    sim.run_to_end(policy)
    return sim.result(policy.name)


def simulate_batch(job_lists: Sequence[Sequence[Job]], total_procs: int, policy: Policy, *, backfill: bool = False,
                   window: int = DEFAULT_WINDOW,
                   on_decision: Callable[[Simulator, SchedulerState, JobView], None] | None = None,
                   ) -> list[SimulationResult]:
    """`simulate` for several independent job sequences, in lockstep: each round collects the pending decision of
    every unfinished sequence and, when the policy has `choose_many(states) -> jobs`, answers them in one call.

    Each schedule is the one `simulate` gives (the sequences never interact); an LLM policy batches its forwards
    across sequences, which is where its time goes. Results are in the order of `job_lists`. `on_decision(sim,
    state, job)` sees every answer before it is committed, with the simulation still at the decision (so an
    observer can `sim.clone()` and look ahead, as `judge.DepartureLog` does) and must not commit itself.
    """
    sims = [Simulator(jobs, total_procs, backfill=backfill, window=window, runtime=runtime_of(policy))
            for jobs in job_lists]
    choose_many = getattr(policy, "choose_many", None)
    while True:
        pending = [(sim, state) for sim in sims if (state := sim.next_decision()) is not None]
        if not pending:
            break
        states = [state for _, state in pending]
        chosen = choose_many(states) if choose_many is not None else [policy.choose(s) for s in states]
        for (sim, state), job in zip(pending, chosen):
            if on_decision is not None:
                on_decision(sim, state, job)
            sim.commit(job, policy.name)
    return [sim.result(policy.name) for sim in sims]
