"""Read Standard Workload Format (SWF) traces, as published by the Parallel Workloads Archive.

Library code: `read_swf("../shared/data/swf/lublin_256.swf")` returns a `Workload`. Not run on its own.

The format (https://www.cs.huji.ac.il/labs/parallel/workload/swf.html): one job per line, 18 whitespace-separated
numeric fields; lines starting with `;` are header comments (`; MaxProcs: 256`); `-1` means "unknown". What this
reader decides, so the simulator never has to:

- **Machine size** = the `MaxProcs` header, else `MaxNodes` (the Lublin model traces give only `MaxNodes`; the
  RLScheduler loader makes the same fallback), else the `max_procs` argument, which also overrides both.
- **Requested processors** -1 (or 0) -> allocated processors; **requested time** -1 -> run time. Synthetic model
  traces such as Lublin's leave both unknown, and real logs fill them; the simulator only ever reads the
  requested values, so after the fallback a job is always runnable.
- **Skipped jobs, counted by reason** in `Workload.skipped` (never silently): run time -1 (the job never ran or the
  log lost it: there is nothing to simulate) and processors still unknown after the fallback. RLScheduler's loader
  also drops jobs with run time 0; we keep them (the SWF says 0 means "ran under half a second", and bounded
  slowdown's tau exists for exactly such jobs).
- **Errors** (`SWFError`, a ValueError) name the file and line and say how to fix it: a line without 18 fields,
  a non-numeric field, a negative run time, submit time or requested time other than -1, a job wider than the
  machine, no machine size, an empty file or one without jobs.
- Jobs come back sorted by (submit time, job id), the order the simulator admits them in; SWF promises that order
  already, but a concatenated or hand-edited trace may not keep it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

import pandas as pd

SWF_FIELD_COUNT = 18
UNKNOWN = -1

# The 18 SWF fields in file order, as they are named on `Job`. Fields 8 and 9 hold the values *after* the fallback.
SWF_FIELDS = (
    "job_id", "submit_time", "wait_time", "run_time", "allocated_procs", "avg_cpu_time", "used_memory",
    "requested_procs", "requested_time", "requested_memory", "status", "user_id", "group_id", "executable_id",
    "queue_id", "partition_id", "preceding_job_id", "think_time",
)


class SWFError(ValueError):
    """A trace the reader cannot use; the message names the file, the line and the fix."""


# eq=False: jobs are compared and hashed by identity. The simulator removes jobs from its waiting list, and a
# field-by-field __eq__ on 18 fields would make every removal slow (and two identical lines are two jobs).
@dataclass(frozen=True, slots=True, eq=False)
class Job:
    """One SWF job line. Times in seconds, memory in KB, -1 = unknown (except where a fallback filled it)."""

    job_id: int
    submit_time: float
    wait_time: float
    """As logged by the real scheduler (-1 in models); the simulator computes its own."""
    run_time: float
    """The actual run time: how long the job occupies its processors in the simulator."""
    allocated_procs: int
    avg_cpu_time: float
    used_memory: float
    requested_procs: int
    """Processors the job asks for; allocated processors when the trace left it unknown. What the simulator uses."""
    requested_time: float
    """The user's estimate (wall-clock limit); run time when the trace left it unknown. EASY backfilling and the
    SJF/WFP3/UNICEF/F1 scores see only this, never the run time."""
    requested_memory: float = UNKNOWN
    status: int = UNKNOWN
    user_id: int = UNKNOWN
    group_id: int = UNKNOWN
    executable_id: int = UNKNOWN
    queue_id: int = UNKNOWN
    partition_id: int = UNKNOWN
    preceding_job_id: int = UNKNOWN
    think_time: float = UNKNOWN

    def __repr__(self) -> str:  # the 18-field default repr drowns test failure messages
        return (f"Job(id={self.job_id}, submit={self.submit_time}, run={self.run_time}, "
                f"procs={self.requested_procs}, req_time={self.requested_time})")


@dataclass
class Workload:
    """A parsed trace: its jobs (sorted by submit time, then id) and what its header says about the machine."""

    jobs: list[Job]
    max_procs: int
    """Processors of the simulated machine (MaxProcs, else MaxNodes, else the caller's max_procs)."""
    max_nodes: int | None = None
    header: dict[str, str] = field(default_factory=dict)
    """Every `; Key: value` header line, keys as written (MaxProcs, MaxNodes, Version, Computer, Note, ...)."""
    comments: list[str] = field(default_factory=list)
    """Header lines without a `Key:` (free text, continuation lines), stripped of the leading `;`."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Jobs left out, by reason (e.g. {"run time unknown (-1)": 3}); empty when every line became a job."""
    source: str = "<memory>"

    def __len__(self) -> int:
        return len(self.jobs)

    def to_frame(self) -> pd.DataFrame:
        """One row per job, one column per SWF field (named as in `SWF_FIELDS`), in trace order."""
        return pd.DataFrame([[getattr(job, name) for name in SWF_FIELDS] for job in self.jobs],
                            columns=list(SWF_FIELDS))


def _number(token: str, path: str, lineno: int, position: int) -> float | int:
    try:
        value = float(token)
    except ValueError:
        raise SWFError(f"{path}:{lineno}: field {position} ({SWF_FIELDS[position - 1]}) is {token!r}, not a "
                       f"number. Every SWF field is numeric; write -1 where the value is unknown.") from None
    # SWF allows fractional times; keep integers as int so ids, processors and printed schedules stay exact.
    return int(value) if value.is_integer() else value


def _parse_header(text: str, header: dict[str, str], comments: list[str]) -> None:
    body = text[1:].strip()
    key, colon, value = body.partition(":")
    # A key is one word ("MaxProcs", "UnixStartTime"); free text with a colon in it is a comment, not a key.
    if colon and key.strip() and " " not in key.strip():
        header[key.strip()] = value.strip()
    elif body:
        comments.append(body)


def _header_int(header: dict[str, str], key: str, path: str) -> int | None:
    if key not in header:
        return None
    try:
        value = int(float(header[key]))
    except ValueError:
        raise SWFError(f"{path}: header `; {key}: {header[key]}` is not a number. Fix the header line, or pass "
                       f"max_procs= to read_swf to override it.") from None
    return value if value > 0 else None


def read_swf(path: str | Path, max_procs: int | None = None,
             too_wide: Literal["error", "skip"] = "error") -> Workload:
    """Parse an SWF trace into a `Workload` (see the module docstring for the fallbacks and the skip rules).

    Args:
        path: the .swf file (plain text, as the Parallel Workloads Archive publishes it after gunzip).
        max_procs: processors of the simulated machine; overrides the MaxProcs/MaxNodes headers.
        too_wide: what to do with a job that asks for more processors than the machine has: "error" (default:
            the trace and the machine size disagree, which usually means the wrong header or the wrong file) or
            "skip" (count it in `Workload.skipped`; some archive logs hold a few such jobs).
    """
    path = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        raise SWFError(f"{path}: no such file. Give the path of an .swf trace (gunzip archive downloads first).") \
            from None

    header: dict[str, str] = {}
    comments: list[str] = []
    rows: list[tuple[int, list[float | int]]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()  # published traces carry trailing spaces and \r line ends
        if not line:
            continue
        if line.startswith(";"):
            _parse_header(line, header, comments)
            continue
        tokens = line.split()
        if len(tokens) != SWF_FIELD_COUNT:
            raise SWFError(f"{path}:{lineno}: {len(tokens)} fields, expected {SWF_FIELD_COUNT}. An SWF job line "
                           f"has exactly 18 whitespace-separated numbers (-1 where unknown); header lines start "
                           f"with ';'.")
        rows.append((lineno, [_number(token, path, lineno, i) for i, token in enumerate(tokens, start=1)]))

    if not rows:
        what = "is empty" if not text.strip() else "has header lines but no job lines"
        raise SWFError(f"{path}: the trace {what}. Give an SWF file with at least one job line "
                       f"(18 numeric fields).")

    header_procs = _header_int(header, "MaxProcs", path)
    max_nodes = _header_int(header, "MaxNodes", path)
    machine = max_procs or header_procs or max_nodes
    if machine is None:
        raise SWFError(f"{path}: no `; MaxProcs:` or `; MaxNodes:` header, so the machine size is unknown. Add the "
                       f"header line or pass max_procs= to read_swf.")

    jobs: list[Job] = []
    skipped: Counter[str] = Counter()
    for lineno, v in rows:
        job_id, submit, wait, run, alloc, cpu, mem, req_procs, req_time = v[:9]
        if run == UNKNOWN:
            skipped["run time unknown (-1)"] += 1
            continue
        for name, value in (("run time", run), ("submit time", submit), ("requested time", req_time)):
            if value < 0 and value != UNKNOWN:
                raise SWFError(f"{path}:{lineno}: negative {name} {value}. Times are seconds >= 0, or -1 when "
                               f"unknown; fix or drop this line.")
        procs = req_procs if req_procs > 0 else alloc
        if procs <= 0:
            skipped["processors unknown (requested and allocated <= 0)"] += 1
            continue
        if procs > machine:
            if too_wide == "skip":
                skipped[f"wider than the machine ({machine} processors)"] += 1
                continue
            raise SWFError(f"{path}:{lineno}: job {job_id} asks for {procs} processors but the machine has "
                           f"{machine} (MaxProcs/MaxNodes header or max_procs=). Pass the right max_procs=, or "
                           f"too_wide='skip' to leave such jobs out.")
        jobs.append(Job(job_id, submit, wait, run, alloc, cpu, mem, procs, run if req_time == UNKNOWN else req_time,
                        *v[9:]))

    if not jobs:
        raise SWFError(f"{path}: none of the {len(rows)} job lines is usable ({dict(skipped)}). Check that the "
                       f"run time (field 4) and processors (fields 5 and 8) are filled.")
    jobs.sort(key=lambda job: (job.submit_time, job.job_id))
    return Workload(jobs=jobs, max_procs=int(machine), max_nodes=max_nodes, header=header, comments=comments,
                    skipped=dict(skipped), source=path)


def workload_from_rows(rows: list[tuple], max_procs: int, source: str = "<memory>") -> Workload:
    """A workload from (job_id, submit, run, procs, requested_time) tuples: hand-made traces for tests and docs."""
    jobs = [Job(job_id=i, submit_time=s, wait_time=UNKNOWN, run_time=r, allocated_procs=p, avg_cpu_time=UNKNOWN,
                used_memory=UNKNOWN, requested_procs=p, requested_time=rt) for i, s, r, p, rt in rows]
    for job in jobs:
        if job.requested_procs > max_procs:
            raise SWFError(f"{source}: job {job.job_id} asks for {job.requested_procs} processors but the machine "
                           f"has {max_procs}.")
    jobs.sort(key=lambda job: (job.submit_time, job.job_id))
    return Workload(jobs=jobs, max_procs=max_procs, source=source)


assert tuple(f.name for f in fields(Job)) == SWF_FIELDS  # one order for the file, the dataclass and the frame
