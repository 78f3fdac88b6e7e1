"""Training that shares the machine: fewer threads while other processes keep the cores busy, the plan's again after.

Library code, no entry point: `training.loop.train_classifier` asks a `CoreShare` after every step of a run in one
process (not the calibration's timed steps, not a torchrun rank).

The plan decides a run's threads for a machine of its own (`planner.machine.decide_machine`: the physical cores).
When something else takes those cores (a second training, a compile, a browser's burst), torch's OpenMP threads do
not slow down in proportion: each parallel region ends in a barrier, its threads spin there, and a thread whose
core is running another process's spinning thread holds up the whole region for a time slice. Two trainings at
once, each on the plan's threads, trained together at well under half the speed of one alone; each on fewer
threads, together as fast as one alone or faster. A passive wait policy (`OMP_WAIT_POLICY=PASSIVE`) also ended the
collapse but slowed a run alone (the figures: docs/DECISIONS.md, "Two trainings on two cores").

So the loop watches, over windows of at least `WINDOW_S` seconds, the CPU its process got per thread and what the
other processes used of the cores it may run on (/proc/stat through psutil): when its threads get under `CROWDED`
of a core each while the others keep at least `OTHERS_BUSY` of a core busy, it drops one thread; when a core's
worth (`IDLE`) stays idle, it takes one back, up to the plan's. Each change is one of the run's events. In a virtual
machine the "others" may be outside it: time the hypervisor gave to other machines (steal) holds a thread up as
another process would, so it counts alike, and the event names the two apart (no process here to look for).

A change of threads changes a LoRA run's speed, not its weights: its step computes the same values on any thread
count (measured: 1 to 4 threads in bf16 + int8 products with eager attention; 1 and 2 with SDPA, bf16 + int8 and fp32;
training.fast's eager attention carries the one softmax backward that was not), so a run that gave a thread up
on a busy machine trains what a quiet run of the same seed trains.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil
import torch

WINDOW_S = 5.0  # long enough for a few steps: a single slow step is not a crowd
CROWDED = 0.8  # CPU per thread below which the threads are not getting their cores (alone: ~1, spinning counted)
OTHERS_BUSY = 0.3  # cores' worth of CPU the other processes must use for the threads' loss to be theirs
IDLE = 0.8  # cores' worth left idle over a window: a thread given back can run


def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: every CPU
        return list(range(psutil.cpu_count() or 1))


class CoreShare:
    """One run's thread count against the machine's other work; `after_step()` once per optimizer step."""

    def __init__(self, event: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.most = torch.get_num_threads()  # the plan's (the recipe set it)
        self.threads = self.most
        self.event = event
        self.clock = clock
        self.process = psutil.Process()
        self.cores = _cores()
        self._mark = self._sample()

    def _sample(self) -> tuple[float, float, float, float, float]:
        """(wall, this process's CPU seconds, the cores' busy seconds, their idle seconds, the seconds the
        hypervisor took from them: steal, counted in busy)."""
        per_cpu = psutil.cpu_times(percpu=True)
        busy = idle = steal = 0.0
        for cpu in self.cores:
            if cpu < len(per_cpu):
                times = per_cpu[cpu]
                waiting = times.idle + getattr(times, "iowait", 0.0)
                idle += waiting
                busy += sum(times) - waiting - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
                steal += getattr(times, "steal", 0.0)
        cpu = self.process.cpu_times()
        return self.clock(), cpu.user + cpu.system, busy, idle, steal

    def after_step(self) -> None:
        now = self._sample()
        wall = now[0] - self._mark[0]
        if wall < WINDOW_S:
            return
        mine, busy, idle, steal = (now[i] - self._mark[i] for i in (1, 2, 3, 4))
        self._mark = now
        per_thread = mine / wall / self.threads
        others = max(busy - mine, 0.0) / wall
        host = min(max(steal, 0.0) / wall, others)  # steal is counted in busy, so it is a part of the others'
        if self.threads > 1 and per_thread < CROWDED and others >= OTHERS_BUSY:
            crowd = f"other processes use {others - host:.1f} of the cores"
            if host >= 0.05:
                crowd += f" and the hypervisor {host:.1f} (steal: other virtual machines on them)"
            self._set(self.threads - 1, f"{crowd} and this run's threads got {per_thread:.0%} of a core each")
        elif self.threads < self.most and idle / wall >= IDLE:
            self._set(self.threads + 1, f"{idle / wall:.1f} cores idle")

    def __enter__(self) -> CoreShare:
        return self

    def __exit__(self, *exc) -> None:
        """The plan's threads again, for whatever the process does after the run."""
        if self.threads != self.most:
            torch.set_num_threads(self.most)
            self.threads = self.most

    def _set(self, threads: int, why: str) -> None:
        self.event(f"threads {self.threads} -> {threads}: {why}")
        self.threads = threads
        torch.set_num_threads(threads)
