"""Faults: the disk-full message every stage gives, and the injection points the fault suite drives.

Library code. `stage_errors(stage)` wraps every stage's `main()` (through frugaltune.entry's `stage_main`, or
directly where the entry point does more): it refuses a damaged dvc.lock first
(frugaltune.checkout), turns a full disk or a checkout it cannot write into one line, and turns progress bars off
when the stage's output is not a terminal (frugaltune.console). `is_disk_full(exc)` also sees a full disk through
sqlite's and MLflow's exceptions (frugaltune.store). `inject(point, name)` is called where a fault is most harmful
(just before an atomic rename, in the middle of a checkpoint write) and does nothing unless the fault suite
(`tests/faults/`, `pytest -m slow tests/faults`) set FRUGALTUNE_FAULT in the stage's environment:

    FRUGALTUNE_FAULT=<point>:<file name>:<action>[,...]   action: enospc (raise OSError ENOSPC) | hang (write the
                                                          pid to $FRUGALTUNE_FAULT_MARKER, then wait to be killed) |
                                                          pause (as hang, but go on once the marker is deleted)
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from frugaltune import checkout, console, processes

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
SQLITE_FULL = "database or disk is full"  # sqlite's message for SQLITE_FULL, however many layers wrap it (MLflow's)


def inject(point: str, name: str) -> None:
    spec = os.environ.get("FRUGALTUNE_FAULT")
    if not spec:
        return
    for item in spec.split(","):
        where, target, action = item.split(":")
        if where != point or target != name:
            continue
        if action == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)
        if action in ("hang", "pause"):
            marker = os.environ.get("FRUGALTUNE_FAULT_MARKER")
            if marker:
                Path(marker).write_text(str(os.getpid()))
            if action == "hang":
                time.sleep(3600)
            deadline = time.monotonic() + 3600
            while marker and Path(marker).exists() and time.monotonic() < deadline:
                time.sleep(0.1)


def disk_full_message(stage: str, exc: OSError) -> str:
    where = exc.filename or "its outputs"
    return (f"{stage}: no space left on the device while writing {where} ({exc.strerror}). Nothing half-written was "
            f"kept: outputs are written to temporary paths and renamed only when complete, so the previous outputs "
            f"(and, for train, the last complete checkpoint) are intact. Free some space (`df -h .`; `dvc gc` "
            f"removes cache entries no commit uses) and rerun: training resumes from its last checkpoint.")


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is a full disk: ENOSPC/EDQUOT, or sqlite's SQLITE_FULL (which
    MLflow's store raises wrapped in SQLAlchemy's and its own exceptions)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL:
            return True
        if SQLITE_FULL in str(current):
            return True
        todo += [current.__cause__, current.__context__, getattr(current, "orig", None)]
    return False


def not_writable_message(stage: str, exc: OSError) -> str:
    here = Path.cwd()
    where = here / exc.filename if isinstance(exc.filename, str) else "its outputs"
    return (f"{stage}: {where}: {exc.strerror}: this checkout ({here}), or that path in it, is not writable: the "
            f"stage writes its outputs here, and DVC dvc.lock and .dvc/tmp. Make it writable (`chmod -R u+w {here}`, "
            f"or mount it read-write), or clone it where you can write (`git clone {here} <dir>`) and rerun "
            f"`dvc repro` there.")


@contextmanager
def stage_errors(stage: str) -> Iterator[None]:
    """Refuse a damaged dvc.lock, then turn a full disk or an unwritable path into one clear line and exit status 1,
    for any stage (other errors pass through).

    Every stage runs in here, so this is where its progress bars are turned off unless it writes to a terminal, where
    dvc.lock is checked (whatever DVC command runs the stage, this runs before the stage does any work), and where it
    asks to die with DVC (frugaltune/processes.py): a stage whose `dvc repro` was killed stops too.
    """
    processes.die_with_parent()
    console.quiet_progress_unless_terminal()
    problem = checkout.lock_problem()
    if problem is not None:
        sys.exit(f"{stage}: {problem}")
    try:
        yield
    except OSError as exc:
        if exc.errno in DISK_FULL:
            sys.exit(disk_full_message(stage, exc))
        if exc.errno in NOT_WRITABLE:
            sys.exit(not_writable_message(stage, exc))
        raise
