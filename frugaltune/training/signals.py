"""SIGINT/SIGTERM during training: a flag the loop reads after each step, so that it stops at a step's end.

Library code, not run directly: `frugaltune.training.loop.train_classifier` runs its steps inside
`stop_on_signals(flag)`, writes a checkpoint when the flag is set and raises `TrainingInterrupted`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path

from frugaltune import processes


class TrainingInterrupted(RuntimeError):
    """SIGINT/SIGTERM arrived: a checkpoint was written and the run stopped; the message says how to resume."""


@contextlib.contextmanager
def stop_on_signals(flag: dict):
    """SIGINT/SIGTERM set a flag the loop checks after each step, so the checkpoint it writes is consistent."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}

    def handler(signum, _frame):
        flag["signal"] = signal.Signals(signum).name

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        # After a stop a stage is on its way out (checkpoint written, TrainingInterrupted raised): the parent-death
        # SIGTERM (frugaltune/processes.py) that follows a process group's once DVC has died must not cut its exit
        # short (its message, its MLflow run marked KILLED). There the flag handler stays: it does nothing more.
        if not (flag and processes.dies_with_parent()):
            for sig, old in previous.items():
                signal.signal(sig, old)


def interrupted(stop: dict, step: int, total_steps: int, last_good: Path | None) -> TrainingInterrupted:
    where = f"checkpoint {last_good}" if last_good else "no checkpoint (checkpoints are off)"
    return TrainingInterrupted(f"{stop['signal']} at step {step} of {total_steps}: stopped after writing {where}. "
                               "Run the same `dvc repro` again (train.resume: auto) to continue from it.")
