"""Processes that die with their parent, and whether the process a record names still runs.

Library code. Every stage calls `die_with_parent()` as it starts (in `faults.stage_errors`, the wrapper of every
stage's `main()`; the train stage also in its first lines, before its imports), and so does every process the
library starts: the plan's calibration worker (`parent=` the plan's pid, passed in `PARENT_ENV`), the federation's
Flower processes (`Popen(..., preexec_fn=child_dies_with_parent())`). On Linux the kernel then sends the process
SIGTERM when its parent dies (`prctl(PR_SET_PDEATHSIG)`), `kill -9` of the parent included: the training loop turns
that SIGTERM into a checkpoint and a clean exit, the other stages into an exit with their outputs untouched (they are
renamed into place only when complete). Without it a training whose `dvc repro` or `dvc exp run --temp` was killed
went on for hours at full CPU, writing into a workspace nobody would collect.

DVC runs a stage as `$SHELL -c '<cmd>'`, and bash, dash and zsh exec a single command, so a stage's parent is DVC
itself; DVC starts it from its main thread (the signal follows the parent thread, not the process). A shell that does
not exec it (fish, an old dash, a `cmd` of two commands) stays between them and outlives DVC: there a thread of the
stage watches the shell's parent instead, once a second. The library's own workers are started from the stage's main
thread for the same reason. Elsewhere than Linux there is no such
call: `die_with_parent` does nothing and `frugaltune exp-clean` (frugaltune/exp_clean.py) stops what is left.

`started(pid)` and `alive(pid, started)`: a process recorded by its pid and start time (a pid alone may be reused),
as `tracking.process_tags` records the one that logs into an MLflow run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import psutil

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_ENV = "FRUGALTUNE_PARENT_PID"  # a worker's expected parent: see die_with_parent
# psutil's start times are the kernel's boot-relative ticks: a little jitter, never seconds
_START_TOLERANCE_S = 1.0
_armed: list[bool] = []  # whether die_with_parent succeeded in this process
_SHELLS = {"sh", "ash", "bash", "dash", "zsh", "ksh", "mksh", "fish", "csh", "tcsh", "busybox"}
_WATCH_EVERY_S = 1.0


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # a libc without prctl (not glibc or musl)
        return None


def _arm(prctl: Callable[..., int], parent: int | None) -> bool:
    if prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    if parent and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def die_with_parent(parent: int | None = None) -> bool:
    """Ask the kernel for SIGTERM when this process's parent dies; whether it could (Linux only).

    A parent that died before this call sends nothing: given `parent` (the pid that started this process), a
    process adopted by another gets SIGTERM at once. Without it that case is not told apart (being a child of init
    is normal in a container), so a stage calls this in its first lines, before its imports.
    """
    prctl = _prctl()
    if prctl is None or not _arm(prctl, parent):
        return False
    _armed.append(True)
    _watch_past_a_shell()
    return True


def _watch_past_a_shell() -> None:
    """When this process's parent is a shell running `-c` (see the module's docstring), SIGTERM this process once
    the shell's own parent has died, as the kernel would have had the shell exec'd."""
    try:
        shell = psutil.Process().parent()
        if shell is None or os.path.basename(shell.name()) not in _SHELLS or "-c" not in shell.cmdline():
            return
        above = shell.parent()
        if above is None or above.pid == 1:
            return
        pid, start = above.pid, above.create_time()
    except psutil.Error:  # the parent is gone already or not ours to read: the kernel's signal is all there is
        return

    def watch() -> None:
        while alive(pid, start):
            time.sleep(_WATCH_EVERY_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="frugaltune-parent-watch", daemon=True).start()


def dies_with_parent() -> bool:
    """Whether this process asked for the parent-death signal: then a SIGTERM may come twice (a process group's,
    then the kernel's once DVC has died), and the training loop keeps ignoring the second while it exits."""
    return bool(_armed)


def child_dies_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` of a program that is not ours to change: the child asks for SIGTERM
    when this process dies, before it runs the program. None where there is no such call. libc's prctl is looked
    up here, in the parent: between fork and exec the child only calls it."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        _arm(prctl, parent)

    return arm


def sigterm_as_exit(what: str):
    """SIGTERM raises SystemExit in this process's main thread from now on, so that `finally` blocks and context
    managers clean up (a temporary directory of gigabytes, a worker process) instead of the process vanishing.
    Returns the previous handler, for `signal.signal(signal.SIGTERM, previous)` to restore."""
    def handler(signum: int, _frame) -> None:
        raise SystemExit(f"{what}: stopped by {signal.Signals(signum).name}; nothing was written.")

    return signal.signal(signal.SIGTERM, handler)


def worker_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a Python worker that calls `die_with_parent(parent_from_env())` first thing."""
    return {**env, PARENT_ENV: str(os.getpid())}


def parent_from_env() -> int | None:
    value = os.environ.get(PARENT_ENV, "")
    return int(value) if value.isdigit() else None


def started(pid: int | None = None) -> float:
    """The start time (seconds since the epoch) of `pid`, this process by default."""
    return psutil.Process(pid).create_time()


def alive(pid: int, start_time: float | None) -> bool:
    """Whether process `pid` runs and, with `start_time`, is the one that started then (not a reused pid)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return start_time is None or abs(process.create_time() - start_time) < _START_TOLERANCE_S
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's process: it runs, and it is not ours to judge
        return True


def end(procs: list[psutil.Process], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL what is still alive after `timeout`."""
    for process in procs:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            continue
    for process in _still_running(procs, timeout):
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    _still_running(procs, timeout)


def _still_running(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `procs` still running after up to `timeout` s. A zombie has stopped: psutil's wait_procs would wait
    for its reaping, which a container's init may never do."""
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in procs if alive(p.pid, p.create_time())]
        for stopped in set(procs) - set(running):  # ours to reap when we are its parent; a no-op otherwise
            with contextlib.suppress(psutil.Error, ChildProcessError):
                stopped.wait(timeout=0)
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)
