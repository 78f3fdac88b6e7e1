"""The calibration's process as the planner sees it: started early, handed its spec, watched, stopped if it must.

Library code, no entry point of its own: CalibrationWorker starts `python -m frugaltune.planner
--calibration-worker` (frugaltune/planner/__main__.py), whose steps are frugaltune.planner.measure's. The watch
stops a process that gets no CPU, or, for the plan, one that loses its cores to other processes
(CalibrationStopped, with what it reported by then).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time


# The calibration's watch (CalibrationWorker.run), over its last WATCH_S seconds: a process that got under
# STALLED_CORE of one core is stopped (SIGSTOP, a debugger) or starved, and would wait out its timeout; one that got
# under BUSY_SHARE of its threads' cores while other processes kept OTHERS_BUSY of the machine's cores busy is
# sharing them: it runs past 1/BUSY_SHARE of its time on a free machine (more where OpenMP threads spin-wait for
# a descheduled sibling), and it measures the load as much as the run.
WATCH_S = 30.0
STALLED_CORE = 0.1
BUSY_SHARE = 0.8
OTHERS_BUSY = 0.25


class CalibrationStopped(RuntimeError):
    """The calibration's process ended before its result: `why` (a clause), and what it had reported by then:
    `built` (the model as loaded; None before), `marks` (the loop's, one per step). `busy`: the machine was."""

    def __init__(self, why: str, built: dict | None = None, marks: list | None = None, busy: bool = False):
        super().__init__(f"the calibration stopped early: {why}")
        self.why, self.built, self.marks, self.busy = why, built, marks or [], busy


class _Watch:
    """CPU seconds of a process and its descendants (inductor compiles in worker processes) and of the whole
    machine, sampled over time: whether the process is stalled, or losing its cores to other processes."""

    def __init__(self, pid: int, threads: int, window_s: float):
        import psutil

        self.process, self.threads, self.window_s = psutil.Process(pid), threads, window_s
        self.cores = psutil.cpu_count() or 1
        self.samples: list[tuple[float, float, float]] = []

    def _own(self) -> float:
        import psutil

        total = 0.0
        for process in [self.process, *self.process.children(recursive=True)]:
            try:
                t = process.cpu_times()  # children_*: descendants it has reaped
            except psutil.Error:
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total

    def verdict(self, stop_when_busy: bool, steps: int) -> tuple[str | None, bool]:
        """(why to stop, whether the machine was busy), or (None, False) to go on. A process that got under
        STALLED_CORE of a core over the window stops in any case: stopped, starved by a busy machine, or stuck.
        With `stop_when_busy`, one losing its cores to other processes stops once it has two steps to fit, or after
        twice the window without them."""
        import psutil

        now = time.monotonic()
        try:
            own = self._own()
        except psutil.Error:  # gone: its exit status says how
            return None, False
        machine = psutil.cpu_times()
        busy_all = (sum(machine) - machine.idle - getattr(machine, "iowait", 0.0) - getattr(machine, "guest", 0.0)
                    - getattr(machine, "guest_nice", 0.0))  # guest time is counted in user time already
        self.samples.append((now, own, busy_all))
        old = [sample for sample in self.samples if sample[0] <= now - self.window_s]
        if not old:
            return None, False
        then, own_then, busy_then = old[-1]
        wall, used = now - then, own - own_then
        others = max(0.0, busy_all - busy_then - used)
        crowded = others >= OTHERS_BUSY * self.cores * wall
        share = used / (wall * self.threads)
        with contextlib.suppress(psutil.Error):
            if used < STALLED_CORE * wall and self.process.status() == psutil.STATUS_STOPPED:
                return f"its process was stopped (SIGSTOP, or a debugger) for {wall:.0f} s", False
        # starved (it would take ten times its time), or sharing its cores with a plan that asked to stop then
        if crowded and (used < STALLED_CORE * wall or (
                stop_when_busy and share < BUSY_SHARE and (steps >= 2 or now - self.samples[0][0] >= 2 * self.window_s))):
            return (f"the machine was busy: over {wall:.0f} s it got {share:.0%} of its {self.threads} threads' "
                    f"cores while other processes kept {others / wall:.1f} of the {self.cores} cores busy"), True
        if used < STALLED_CORE * wall:
            return f"its process got {used / wall:.0%} of a core for {wall:.0f} s (stuck)", False
        return None, False


class CalibrationWorker:
    """The fresh process the calibration's steps run in: a clean peak RSS, on the training process's malloc
    (`train.allocator`: RSS depends on it as much as on the tensors). Started before the plan needs it, it imports
    torch, transformers and peft (seconds of one core) while the planner reads the data and builds its shapes on
    the other, then reads its spec from stdin; `run` hands it the spec and returns what it measured."""

    def __init__(self, allocator_choice: str = "auto"):
        from frugaltune import allocator, processes

        self.process = subprocess.Popen(
            [sys.executable, "-m", "frugaltune.planner", "--calibration-worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=processes.worker_env({**allocator.child_env(allocator_choice), "TQDM_DISABLE": "1"}))

    def run(self, spec: dict, timeout_s: float, watch_s: float = WATCH_S, stop_when_busy: bool = False) -> dict:
        """Hand the worker `spec` and read its progress as it comes; return what it measured (its last line).
        CalibrationStopped, with what it reported by then, when it runs past `timeout_s`, is killed, or (watched
        over its last `watch_s` seconds) gets no CPU, or, `stop_when_busy`, loses its cores to other processes."""
        import select
        import signal

        process, built, marks, result, why, busy = self.process, None, [], None, None, False
        out, err = process.stdout.fileno(), process.stderr.fileno()
        received = {out: bytearray(), err: bytearray()}
        began = time.monotonic()
        try:
            watch = _Watch(process.pid, spec["threads"], watch_s)
            with contextlib.suppress(BrokenPipeError):  # it died before reading: its exit status says how
                process.stdin.write(json.dumps(spec))
                process.stdin.close()
            pending = set(received)
            while pending:
                for fd in select.select(list(pending), [], [], 1.0)[0]:
                    chunk = os.read(fd, 1 << 16)
                    received[fd] += chunk
                    if not chunk:
                        pending.discard(fd)
                *lines, rest = received[out].split(b"\n")
                received[out] = bytearray(rest)
                for line in lines:
                    with contextlib.suppress(ValueError):  # not one of its JSON lines (a loop event)
                        item = json.loads(line)
                        if isinstance(item, dict):
                            built = item.get("built", built)
                            marks += [item["mark"]] if "mark" in item else []
                            result = item if "steps" in item else result
                if time.monotonic() - began > timeout_s:
                    why = f"it ran past its timeout of {timeout_s:.0f} s"
                elif pending:
                    why, busy = watch.verdict(stop_when_busy, len(marks))
                if why:
                    break
            if not why:  # its pipes are closed: it is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=watch_s)
        finally:  # its stdin is closed already: communicate (close) would refuse to flush it
            if process.poll() is None:
                process.kill()
                process.wait()
            for stream in (process.stdin, process.stdout, process.stderr):
                with contextlib.suppress(OSError, ValueError):  # a pipe it closed first, or closed here already
                    stream.close()
        if result is not None and not why:
            return result
        code = process.returncode
        if why or (code is not None and code < 0):
            why = why or f"its process was killed by {signal.Signals(-code).name}" + (
                " (out of memory?)" if code == -signal.SIGKILL else "")
            raise CalibrationStopped(why, built, marks, busy)
        raise RuntimeError(f"calibration of {spec['method']} failed:\n{received[err].decode()[-2000:]}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()

