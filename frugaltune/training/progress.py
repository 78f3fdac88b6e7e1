"""The training loop's progress as a line every so many seconds, where the output is a log file or a pipe.

Library code, not run directly: `frugaltune.training.loop.train_classifier` feeds a `ProgressLines` each step when
its stdout is not a terminal (`LoopConfig.reporting.progress_every_s`); a terminal gets tqdm's bar instead.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from tqdm.auto import tqdm


class ProgressLines:
    """The loop's progress as a line every `every_s` seconds, for a log: one clock read per step."""

    def __init__(self, every_s: float, total_steps: int, first_step: int, start: float):
        self.every_s, self.total, self.first, self.start = every_s, total_steps, first_step, start
        self.due, self.losses, self.tokens, self.since = start + every_s, [], 0, start

    def step(self, step: int, loss: float, tokens: int) -> None:
        self.losses.append(loss)
        self.tokens += tokens
        now = time.perf_counter()
        if now < self.due:
            return
        per_step = (now - self.start) / (step - self.first + 1)  # this process's steps: a resumed run's too
        tqdm.write(f"train: step {step}/{self.total} ({step / self.total:.0%}), loss {np.mean(self.losses):.4f}, "
                   f"{self.tokens / max(now - self.since, 1e-9):.0f} tokens/s, {_minutes(now - self.start)} in, "
                   f"ETA {_minutes(per_step * (self.total - step))}", file=sys.stdout)
        sys.stdout.flush()
        self.due, self.losses, self.tokens, self.since = now + self.every_s, [], 0, now


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
