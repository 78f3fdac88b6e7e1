"""The per-step phase timer (`StepTimer`): mean milliseconds per phase of a training step, and their shares.

Library code, not run directly: the training loop times its steps with it (see `frugaltune.telemetry`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class _Phase:
    """The context manager `StepTimer.phase(name)` returns; one per phase, reused every step (no allocation)."""

    __slots__ = ("_timer", "_name", "_start")

    def __init__(self, timer: StepTimer, name: str):
        self._timer, self._name, self._start = timer, name, 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()
        if self._timer._step_start is None:
            self._timer._step_start = self._start

    def __exit__(self, *exc_info: object) -> None:
        timer = self._timer
        if timer._sync is not None:
            timer._sync()
        timer._step[self._name] += time.perf_counter() - self._start


class StepTimer:
    """Where each optimizer step's time goes: data wait, forward-backward, optimizer, and the untimed rest.

    Phases add up within a step (with gradient accumulation each micro-batch enters "data" and "fwd_bwd" once);
    `end_step()` closes the step. A step's wall time runs from the previous `end_step()` (or the first phase of
    the first step) to this one, so logging, progress bars and checkpoints between steps show up as "other".

    On a GPU, kernels run asynchronously: without `sync` the time of queued kernels lands in whichever phase
    waits for them next (the optimizer's kernels in the next step's host-to-device copy, which would read as data
    wait). Pass `sync=torch.cuda.synchronize` on CUDA: it is called as each phase ends, so each phase owns its
    kernels, at the cost of one synchronisation per phase.
    """

    PHASES = ("data", "fwd_bwd", "optimizer")

    def __init__(self, sync: Callable[[], None] | None = None, extra_phases: tuple[str, ...] = ()):
        # extra_phases: e.g. "all_reduce" in a data-parallel run, timed only where it exists
        self.PHASES = StepTimer.PHASES + tuple(extra_phases)
        self._sync = sync
        self._phases = {name: _Phase(self, name) for name in self.PHASES}
        self._step = dict.fromkeys(self.PHASES, 0.0)
        self._step_start: float | None = None
        self._total = dict.fromkeys(self.PHASES, 0.0)
        self._total_wall = 0.0
        self._window = dict.fromkeys(self.PHASES, 0.0)
        self._window_wall = 0.0
        self._window_steps = 0
        self.steps = 0

    def phase(self, name: str) -> _Phase:
        """`with timer.phase("data"): ...` adds the block's wall time to this step's `name` phase."""
        try:
            return self._phases[name]
        except KeyError:
            raise ValueError(f"unknown step phase {name!r}; StepTimer times {', '.join(self.PHASES)}") from None

    def end_step(self) -> dict[str, float]:
        """Close the step; return its seconds per phase and in all (`step`)."""
        now = time.perf_counter()
        wall = now - self._step_start if self._step_start is not None else sum(self._step.values())
        step = {**self._step, "step": wall}
        for name in self.PHASES:
            self._total[name] += self._step[name]
            self._window[name] += self._step[name]
            self._step[name] = 0.0
        self._total_wall += wall
        self._window_wall += wall
        self._window_steps += 1
        self.steps += 1
        self._step_start = now
        return step

    def window(self) -> dict[str, float]:
        """Mean milliseconds per step of each phase since the last call, then start a new window.

        For the training loop's periodic log (the train recipe sends it to MLflow as `step/step_time_ms`, ...,
        beside the step's loss: recipes.train.step_metrics). Empty when no step ended since the last call.
        """
        steps = self._window_steps
        if not steps:
            return {}
        out = {"step_time_ms": 1000 * self._window_wall / steps}
        out.update({f"step_{name}_ms": 1000 * self._window[name] / steps for name in self.PHASES})
        self._window = dict.fromkeys(self.PHASES, 0.0)
        self._window_wall, self._window_steps = 0.0, 0
        return out

    def summary(self) -> dict[str, float]:
        """Steps, mean step time and each phase's share of the total step time (`other_share`: untimed)."""
        if not self.steps:
            return {"steps": 0}
        wall = max(self._total_wall, 1e-12)
        out: dict[str, float] = {"steps": self.steps, "step_time_mean_ms": round(1000 * wall / self.steps, 3)}
        for name in self.PHASES:
            out[f"{name}_mean_ms"] = round(1000 * self._total[name] / self.steps, 3)
        for name in self.PHASES:
            out[f"{name}_share"] = round(self._total[name] / wall, 4)
        out["other_share"] = round(max(0.0, 1 - sum(self._total.values()) / wall), 4)
        return out
