"""What a policy sees of the simulation: `JobView`s, the running jobs, each user's finished jobs, `SchedulerState`,
and the `Policy` protocol; also EASY's reservation for a waiting job (`reservation`), which the state and the
simulator both use.

Library code, not run on its own: `simulator.Simulator` builds a `SchedulerState` at every decision and hands it to
a policy's `choose`. `frugaltune.scheduling.simulator` re-exports these names, so `from
frugaltune.scheduling.simulator import JobView, SchedulerState` keeps working. The model is in simulator.py's
docstring ("What a policy sees", "Run times assumed").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from frugaltune.scheduling.swf import Job

HISTORY = 8
"""Finished jobs kept per user for `SchedulerState.history` (Tsafrir's prediction reads the last two)."""

Runtime = Literal["estimate", "prediction"]
RUNTIMES: tuple[Runtime, ...] = ("estimate", "prediction")


# eq=False, as for Job: views are compared by identity (one view per job and simulation, shared by its clones).
@dataclass(frozen=True, slots=True, eq=False)
class JobView:
    """A job as a scheduler knows it before it ends: no run time (see the module docstring)."""

    job_id: int
    submit_time: float
    requested_procs: int
    requested_time: float
    """The user's estimate (wall-clock limit)."""
    user_id: int
    group_id: int

    @classmethod
    def of(cls, job: Job) -> "JobView":
        return cls(job.job_id, job.submit_time, job.requested_procs, job.requested_time, job.user_id, job.group_id)

    def __repr__(self) -> str:
        return (f"JobView(id={self.job_id}, submit={self.submit_time}, procs={self.requested_procs}, "
                f"req_time={self.requested_time}, user={self.user_id})")


@dataclass(frozen=True, slots=True)
class Finished:
    """One finished job in its user's history: what the scheduler learnt when it ended."""

    run_time: float
    requested_time: float
    requested_procs: int

    @property
    def accuracy(self) -> float:
        """Actual over requested time (1: a perfect estimate)."""
        return self.run_time / self.requested_time if self.requested_time > 0 else 1.0


def predicted_time(requested_time: float, history: Sequence[Finished]) -> float:
    """Tsafrir, Etsion & Feitelson (TPDS 2007): the mean of the user's last two actual run times (the last one
    when there is one), capped by the estimate; the estimate without history."""
    if not history:
        return requested_time
    last = history[-2:]
    return min(sum(f.run_time for f in last) / len(last), requested_time)


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A started job: what a scheduler knows about it (its start and expected end, not its actual end)."""

    job: JobView | Job
    start: float
    expected_end: float
    """start + the run time assumed (requested time, or the prediction): when the scheduler expects the processors
    back (the job may end earlier, or later: past a prediction, or in real traces whose runs overshoot the
    request)."""


class SchedulerState:
    """What a policy sees when it must pick the next job. Read-only by convention; valid only during `choose`.

    Attributes:
        clock: the current simulated time (seconds, the trace's clock).
        total_procs: processors of the machine.
        free_procs: processors free right now.
        queue: the visible waiting jobs as `JobView`s, oldest first (at most `window` of them; never empty during
            `choose`).
        queue_length: every waiting job, visible or not.
    """

    __slots__ = ("clock", "total_procs", "free_procs", "queue", "queue_length", "_running", "_finished")

    def __init__(self, clock: float, total_procs: int, free_procs: int, queue: list, queue_length: int,
                 running: dict[int, RunningJob], finished: dict[int, tuple[Finished, ...]] | None = None):
        self.clock = clock
        self.total_procs = total_procs
        self.free_procs = free_procs
        self.queue = queue
        self.queue_length = queue_length
        self._running = running
        self._finished = finished if finished is not None else {}

    def history(self, job: JobView) -> tuple[Finished, ...]:
        """The last `HISTORY` finished jobs of `job`'s user, oldest first (none for an unknown user, id < 0)."""
        return self._finished.get(job.user_id, ()) if job.user_id >= 0 else ()

    def predicted_time(self, job: JobView) -> float:
        """Tsafrir's prediction of `job`'s run time from its user's history (`predicted_time`)."""
        return predicted_time(job.requested_time, self.history(job))

    def runtime(self, job: JobView, runtime: Runtime) -> float:
        """The run time a scheduler assuming `runtime` ("estimate" or "prediction") expects of `job`."""
        return job.requested_time if runtime == "estimate" else self.predicted_time(job)

    @property
    def running(self) -> list[RunningJob]:
        """The running jobs, soonest expected end first (built on demand: the heuristics never look)."""
        return sorted(self._running.values(), key=lambda r: (r.expected_end, r.job.submit_time, r.job.job_id))

    def start_time(self, job: JobView) -> float:
        """When `job` could start if it were run next: now when it fits, else when enough processors are back by
        the running jobs' expected ends (EASY's shadow time for it)."""
        if job.requested_procs <= self.free_procs:
            return self.clock
        return reservation(job, self.free_procs, self._running, self.clock)[0]

    def wait_time(self, job: JobView) -> float:
        """How long `job` has waited so far."""
        return self.clock - job.submit_time


@runtime_checkable
class Policy(Protocol):
    """Anything with a `name` and `choose(state) -> JobView` (one of `state.queue`) schedules. A policy may say
    which run times EASY assumes for it with a `runtime` attribute ("estimate", the default, or "prediction").

    The heuristics in `policies.py` are score functions; an LLM policy renders `state` as text, reads a job id
    from the answer and returns that job of `state.queue`.
    """

    name: str

    def choose(self, state: SchedulerState) -> JobView: ...


def reservation(head: Job | JobView, free: int, running: dict[int, RunningJob], clock: float) -> tuple[float, int]:
    """EASY's reservation for `head`: (shadow time, processors spare at that time once head has its share).

    Running jobs are assumed to end at their expected end; one already past it is assumed to end at its estimate
    (a prediction that was too short: Tsafrir's correction), and one past that too (a run that overshot its
    request) to end now, which is the most optimistic guess and the one real EASY implementations make.
    """
    available = free
    ends = sorted((_expected(r, clock), r.job.submit_time, r.job.job_id, r.job.requested_procs)
                  for r in running.values())
    for end, _, _, procs in ends:
        available += procs
        if available >= head.requested_procs:
            return end, available - head.requested_procs
    # Unreachable for a job no wider than the machine: all running jobs' processors plus the free ones are P.
    raise RuntimeError(f"job {head.job_id} needs {head.requested_procs} processors, more than the machine has")


def _expected(r: RunningJob, clock: float) -> float:
    if r.expected_end > clock:
        return r.expected_end
    return max(r.start + r.job.requested_time, clock)
