"""Calibration: the run's own loop timed on this machine, fitted into the model's constants.

Library code, no entry point. `calibrate` (the plan, the federated budget, benchmarks/plan_accuracy.py) picks the
run's micro-batches to time, hands them to a fresh process (frugaltune.planner.worker; what it runs:
frugaltune.planner.measure) and returns a `Calibration`: the fitted Constants and the calibration's report (the
plan's `calibration` section).

Calibration (`calibrate`) runs a few of the run's own micro-batches through the train stage's loop with the
configured method, in a fresh process started early (a clean peak RSS; its imports overlap the planner's own work),
and fits `peak = static + per_token x part tokens` and `step_time = overhead + per_token x tokens`. The memory fit rescales the activation constant and replaces the
runtime constant; the time fit turns the run's exact padded-token count into an ETA, plus a one-time startup: what
the first step at the peak shape costs beyond a warm one (page faults for the memory the run keeps; on a 20-step
run it is a fifth of the time, on the default 178-step run ~3%). Calibration runs on the training process's malloc
(`train.allocator`, see frugaltune/allocator.py). Methods other than the
calibrated one reuse its memory constants; their time is the calibrated step's times each one's own step time
against it, both timed on the same micro-batch in the calibration's process (`Constants.method_cost`): adapters
alike in FLOPs differ in what their kernels cost (NF4 dequantization, DoRA's norms, PreLayer's missing adapter
matmuls). A method not timed falls back to its training FLOPs per token (6N full, 4N adapters).

The plan's calibrations at its pick, and again where the measured memory moves it: frugaltune.planner.recalibration.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from frugaltune.planner.measure import _cpu_share, _fit_line, _marked_steps, _step_line
from frugaltune.planner.memory import (Constants, MethodKnobs, ModelShape, activation_bytes_per_token,
                                       logits_bytes_per_token, memory_estimate)
from frugaltune.planner.worker import BUSY_SHARE, WATCH_S, CalibrationStopped, CalibrationWorker

if TYPE_CHECKING:
    from frugaltune.training.loop_config import LoopConfig


def timed_micro_batches(time_samples: int) -> int:
    """How many of the run's micro-batches a calibration of `time_samples` sizes times at most: each sampled size
    once (calibration_batches), then again under the peak, all but the largest when more than two (calibrate)."""
    count = max(2, time_samples)
    return count + (count - 1 if count > 2 else count)


def calibration_batches(order: list[list[int]], lengths: list[int], part_tokens, time_samples: int) -> list[int]:
    """Positions in `order` (the run's micro-batches) that the calibration runs, `time_samples` sizes in all: the
    smallest batch first (its first step also pays the one-time warm-up: page faults, oneDNN and compiled kernels,
    at the lowest price), then batches at evenly spaced quantiles of their padded tokens, and last the batch with
    the largest part, which sets the run's peak memory (`part_tokens(batch)`: its part's padded tokens as the loop
    splits it) and stands for the top of the range."""
    if not order:
        return []
    by_size = sorted(range(len(order)), key=lambda i: len(order[i]) * max(lengths[j] for j in order[i]))
    worst = max(range(len(order)), key=lambda i: part_tokens(order[i]))
    count = max(2, time_samples)
    picks = []
    for q in range(count - 1):
        position = by_size[round(q * (len(by_size) - 1) / (count - 1))]
        if position not in picks and position != worst:
            picks.append(position)
    return picks + [worst]


def fit_memory(points: list[tuple[int, int]], static: float, per_token: float,
               loaded_rss: int) -> tuple[float, float]:
    """(activation scale, runtime bytes) from the calibration's (part tokens, peak RSS) points, smallest first:
    `peak = static + runtime + scale x per_token x tokens`, through the largest part's measured peak."""
    _, slope = _fit_line(points) if len(points) > 1 else (0.0, 0.0)
    # A slope of zero means RSS noise swamped the activations (tiny models): keep the analytic constant.
    scale = slope / per_token if slope > 0 and len(points) > 1 else 1.0
    largest_tokens, largest_rss = points[-1]
    runtime = largest_rss - scale * per_token * largest_tokens - static
    if runtime + static < 0.9 * loaded_rss:  # the slope read RSS noise (tiny models): analytic
        scale, runtime = 1.0, largest_rss - per_token * largest_tokens - static
    if runtime < 0:
        # The high-water mark also grew between steps for what is not activations (the allocator's growth, full
        # fine-tuning's optimizer state), so the slope overshoots; a runtime clamped at 0 would then put the largest
        # part above its own measured peak. The run's largest part is the one measured: keep its peak.
        scale = max(0.0, (largest_rss - static) / (per_token * largest_tokens))
        runtime = largest_rss - static - scale * per_token * largest_tokens
    return scale, runtime


class Calibration(NamedTuple):
    """What `calibrate` returns: the fitted constants (the plan's `constants`) and the calibration's report (the
    plan's `calibration` section: its steps and phases, memory points, the other methods timed, why it stopped)."""

    constants: Constants
    report: dict


class _Prepared(NamedTuple):
    """What calibrate hands its process (`spec`; the rows in `spec["rows_file"]`) and how its steps map onto the run:
    `picks` (positions in the run's order, the first pass), `runs` (each step's rows), their tokens, the rows the
    other methods are timed on (`typical_tokens`) and the evaluation batches (`inference`)."""

    spec: dict
    picks: list[int]
    runs: list[list[int]]
    runs_tokens: list[dict]
    typical_tokens: dict | None
    inference: dict | None


class _Measured(NamedTuple):
    """What the calibration's steps measured (the worker's `point`, or what it reported before it stopped) and the
    time line fitted under the peak: `step = overhead + per_token_s x padded tokens`, plus the run's start-up."""

    point: dict
    stopped: CalibrationStopped | None
    steps: list[dict]
    overhead: float
    per_token_s: float
    startup: float
    startup_cold: float
    startup_from: str


def calibrate(model_dir: Path | str, labels: list[str], pad_token_id: int, method: str, knobs: MethodKnobs,
              shape: ModelShape, *, rows: list[list[int]], targets: list, order: list[list[int]], loop: LoopConfig,
              int8: dict, gradient_checkpointing: bool, threads: int, seed: int = 0, time_samples: int = 6,
              timeout_s: float = 900, allocator: str = "auto", task: str = "classification",
              inference_rows: list[list[int]] | None = None, inference_batch: int = 32,
              others: list[dict] | None = None, others_share: float | None = 0.1,
              worker: CalibrationWorker | None = None,
              planned: tuple[int, int] | None = None, watch_s: float = WATCH_S,
              stop_when_busy: bool = False) -> Calibration:
    """Time the train stage's own loop on this machine over a few of the run's own micro-batches and fit the
    memory and time constants.

    `order` is the run's micro-batches (planned_order), `loop` the run's LoopConfig
    (frugaltune.training.setup.loop_config; its process receives `loop.to_dict()`) and `int8` the plan's int8
    decision, so the steps timed are the steps that train: the same int8 products and fused LoRA, micro-batch and
    token cap, attention crossover and malloc (`allocator`). One fresh process runs them (calibration_batches): its
    first step is the run's one-time warm-up (timed again in a second process when it compiled graphs afresh: the
    run finds them in inductor's cache); the sampled sizes, smallest first, give the peak RSS after each step, which
    fits `peak = static + per_token x part tokens`; run a second time under that peak (all but the largest, when two
    or more are left) they fit `step = overhead + per_token x padded tokens`, and what the first pass paid beyond
    that is the run's start-up. The peak the plan keeps is the process's over both passes. The process is `worker`
    when given (a CalibrationWorker started early, its imports done beside the caller's work), else a new one.

    With `inference_rows` (an evaluation split) the same process then times the model's forward passes, as
    evaluation runs them (without int8 products), over a few of that split's evaluation batches (classify.classify,
    `inference_batch` rows each): a warm-up, the smallest, the median and the largest, which fit
    `batch = overhead + per_token x padded tokens` in `calibration["inference"]` (the federated budget's
    evaluation rounds).

    `others` (each {"method", "knobs": MethodKnobs, "int8": its decision}): the same process then builds each of
    those methods and times it on half the rows of the sampled micro-batch nearest the run's mean step, after a
    two-row warm-up step, twice (the faster kept); its time over the calibrated method's on the same rows (the
    faster of two, their steps taken in turn with its own) is its `Constants.method_cost`, so that
    every method the plan lists gets an ETA measured here, not copied. The calibration as a whole, the configured
    method's steps included, may cost `others_share` of the run the plan plans (None: no bound): the methods are
    timed in `others`' order while that budget lasts, and one it cannot pay for keeps the FLOPs estimate, saying
    so (`Constants.not_timed`). `planned`: the run's (steps, padded tokens) as the plan counts them for its ETA
    (default: the micro-batches of `order` and all their padded tokens).

    A calibration that cannot finish ends here, never in a traceback (CalibrationWorker.run's watch): a process
    that gets no CPU for `watch_s` seconds, is killed, or runs past `timeout_s`, and, with `stop_when_busy` (the
    plan), one that loses its cores to other processes, is stopped there. After two steps or more, the constants
    are fitted from those steps and the other methods keep their FLOPs estimate; before, they are the analytic
    defaults (no ETA). `calibration["stopped"]` says why and `calibration["busy_note"]` what that means for the plan.
    With `inference_rows`, whose passes come after the steps, a stopped calibration is CalibrationStopped.
    """
    # The rows file is named before it exists: a SIGTERM (an exit here, frugaltune.processes.sigterm_as_exit) that
    # lands while it is written still finds its name in `finally`.
    rows_file = Path(tempfile.gettempdir()) / f"frugaltune-calibration-{uuid.uuid4().hex}.json"
    try:
        prepared = _prepare(model_dir, labels, pad_token_id, method, knobs, rows=rows, targets=targets, order=order,
                            loop=loop, int8=int8, gradient_checkpointing=gradient_checkpointing, threads=threads,
                            seed=seed, time_samples=time_samples, allocator=allocator, task=task,
                            inference_rows=inference_rows, inference_batch=inference_batch, others=others,
                            others_share=others_share, planned=planned, rows_file=rows_file)
        started = time.perf_counter()
        measured = _measure(prepared, method, worker, allocator, timeout_s, watch_s, stop_when_busy, inference_rows,
                            started)
    finally:
        rows_file.unlink(missing_ok=True)
    if isinstance(measured, Calibration):  # stopped before its second step: the analytic defaults, and why
        return measured
    return _fitted(measured, prepared, time.perf_counter() - started, shape, method, knobs, loop,
                   gradient_checkpointing, threads, others)


def _prepare(model_dir: Path | str, labels: list[str], pad_token_id: int, method: str, knobs: MethodKnobs, *,
             rows: list[list[int]], targets: list, order: list[list[int]], loop: LoopConfig, int8: dict,
             gradient_checkpointing: bool, threads: int, seed: int, time_samples: int, allocator: str, task: str,
             inference_rows: list[list[int]] | None, inference_batch: int, others: list[dict] | None,
             others_share: float | None, planned: tuple[int, int] | None, rows_file: Path) -> _Prepared:
    """calibrate's first step: the run's micro-batches it times (calibration_batches, then again under the peak,
    then the rows the other methods are timed on), written to `rows_file` (new, private) for its process to read,
    and the spec that names them (calibrate's arguments)."""
    from frugaltune.training.batching import parts

    lengths = [len(r) for r in rows]
    batching = loop.batching
    split = math.ceil(batching.batch_size / (batching.micro_batch_size or batching.batch_size))

    def tokens(batch: list[int]) -> dict[str, int]:
        """A micro-batch's padded tokens, and its largest part's (rows x the batch's longest), as the loop splits it."""
        pieces = parts(batch, lengths, split, batching.micro_batch_tokens)
        return {"padded_tokens": sum(len(p) * max(lengths[i] for i in p) for p in pieces),
                "part_tokens": len(pieces[0]) * max(lengths[i] for i in batch)}

    picks = calibration_batches(order, lengths, lambda batch: tokens(batch)["part_tokens"], time_samples)
    # The sampled sizes run twice: first smallest to largest, each raising the high-water mark (the memory fit's
    # points; each such step also pays for the pages it grows into), then again under the peak, as the run's steps
    # mostly are: those second timings fit the per-token time. The largest, the calibration's dearest step, runs
    # again only when fewer than two other sizes are left to draw the line (docs/DECISIONS.md, "A calibration
    # under a tenth of the run").
    again = [p for p in picks if p != picks[-1]] if len(picks) > 2 else picks
    runs = [order[p] for p in picks + again]  # each step's micro-batch (example indices of the run)
    # The other methods are timed on the sampled micro-batch nearest the run's mean step: a method's cost against
    # another's depends on the batch (full fine-tuning's optimizer step is fixed, its weight gradients grow with the
    # tokens), and the ETA is the sum of the run's steps, which the mean step stands for. Half of its rows: a
    # method's cost against the calibrated one's is a ratio of two steps on the same rows, and half the rows cost
    # half. The calibrated method runs those rows twice too, at the end of its second pass: two more points of the
    # time fit, and the bytes it saves for backward on them, which the others' are measured against (their time,
    # against its steps on those rows taken in turn with theirs).
    typical_tokens = None  # the timed rows' tokens (calibrate's `tokens`), when others are timed
    if others:
        run_tokens = [tokens(batch)["padded_tokens"] for batch in order]
        typical = min(picks, key=lambda p: abs(run_tokens[p] - sum(run_tokens) / len(order)))
        timed_rows = order[typical][:max(2, math.ceil(len(order[typical]) / 2))]
        typical_tokens = tokens(timed_rows)
        runs += [timed_rows, timed_rows]
    runs_tokens = [tokens(batch) for batch in runs]
    used = sorted({i for batch in runs for i in batch})
    index = {old: new for new, old in enumerate(used)}
    inference = None
    if inference_rows:
        from frugaltune.classify import sorted_batches

        widths = [len(r) for r in inference_rows]
        batches = sorted_batches(widths, inference_batch)[::-1]  # shortest first
        chosen = [batches[len(batches) // 2], batches[0], batches[len(batches) // 2], batches[-1]]
        inference = {"batches": [[list(inference_rows[i]) for i in b] for b in chosen],
                     "padded_tokens": [len(b) * max(widths[i] for i in b) for b in chosen]}
    with os.fdopen(os.open(rows_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
        json.dump({"rows": [list(rows[i]) for i in used], "targets": [targets[i] for i in used],
                   "batches": [[index[i] for i in batch] for batch in runs], "inference": inference}, handle)
    spec = {"model_dir": str(model_dir), "labels": labels, "pad_token_id": pad_token_id, "seed": seed,
            "method": method, "knobs": asdict(knobs), "gradient_checkpointing": gradient_checkpointing,
            "threads": threads, "allocator": allocator, "task": task, "int8": int8, "rows_file": str(rows_file),
            "loop": loop.to_dict()}
    if others:
        spec["others"] = [{"method": o["method"], "knobs": asdict(o["knobs"]), "int8": o["int8"]} for o in others]
        spec["others_batch"] = [index[i] for i in timed_rows]
        spec.update(others_share=others_share, others_tokens=typical_tokens["padded_tokens"], first_pass=len(picks),
                    runs_tokens=[t["padded_tokens"] for t in runs_tokens],
                    # the steps and padded tokens the plan's ETA counts (a causal LM's shared prefix once per part)
                    run_steps=planned[0] if planned else len(order),
                    run_tokens=planned[1] if planned else sum(run_tokens))
    return _Prepared(spec, picks, runs, runs_tokens, typical_tokens, inference)


def _measure(prepared: _Prepared, method: str, worker: CalibrationWorker | None, allocator: str, timeout_s: float,
             watch_s: float, stop_when_busy: bool, inference_rows: list[list[int]] | None,
             started: float) -> _Measured | Calibration:
    """calibrate's second step: its process runs the steps (a second one the first step alone, when that compiled
    graphs afresh); their time line and the run's start-up. A process stopped before two steps: the analytic
    Calibration (_not_calibrated); with `inference_rows`, CalibrationStopped."""
    spec, picks, runs, runs_tokens, _, _ = prepared
    stopped: CalibrationStopped | None = None
    startup_from = "the first step"
    try:
        # sent_at: the wall clock (shared by both processes) when this process starts to wait, from which the
        # worker counts what the calibration has cost
        point = (worker or CalibrationWorker(allocator)).run({**spec, "sent_at": time.time()}, timeout_s,
                                                             watch_s, stop_when_busy)
    except CalibrationStopped as exc:
        # What it measured before it stopped is the plan's, when there are two steps to fit; the evaluation's
        # forward passes (a caller's inference_rows) come after the steps: without them, the caller's error.
        if inference_rows or exc.built is None or len(exc.marks) < 2:
            if inference_rows:
                raise
            return _not_calibrated(exc, method, len(runs), time.perf_counter() - started)
        stopped, point = exc, _stopped_point(exc, spec)
    steps = [{**step, **counted, "under_peak": n >= len(picks)}
             for n, (step, counted) in enumerate(zip(point["steps"], runs_tokens))]
    growing = steps[:len(picks)]
    warm = growing[0]
    timed = [(s["padded_tokens"], s["seconds"]) for s in steps]
    overhead, per_token_s, excess = _step_line(timed[:len(picks)], timed[len(picks):])
    steady = lambda step: overhead + per_token_s * step["padded_tokens"]  # noqa: E731
    # What the first pass paid beyond a step under the peak is paid once per run: the warm-up (page faults,
    # oneDNN's kernels for new shapes) and the growth to the peak. When the first step compiled graphs afresh,
    # the run will load them from inductor's cache instead: a second process runs the first step alone and
    # measures the start-up the run will pay.
    growth = sum(excess[1:])
    startup_cold = excess[0] + growth
    first = warm["seconds"]
    if warm.get("compiled_graphs") and not stopped:
        try:
            first = CalibrationWorker(allocator).run({**spec, "batches": 1}, timeout_s, watch_s,
                                                     stop_when_busy)["steps"][0]["seconds"]
            startup_from = "a second process: the first step compiled graphs that the run will find in inductor's cache"
        except CalibrationStopped as exc:  # the cold first step's start-up, an overestimate, and why
            startup_from = f"the first step, compiling graphs (its second process stopped early: {exc.why})"
    startup = max(0.0, first - steady(warm)) + growth
    return _Measured(point, stopped, steps, overhead, per_token_s, startup, startup_cold, startup_from)


def _fit_peaks(steps: list[dict], growing: list[dict], shape: ModelShape, method: str, knobs: MethodKnobs,
               loop: LoopConfig, gradient_checkpointing: bool,
               loaded_rss: int) -> tuple[list, float, float, float, bool]:
    """(memory points, analytic bytes per token, activation scale, runtime bytes, whether the gradients overlap the
    activations): the peaks of the first pass, smallest part first, fitted against the memory model (fit_memory)."""
    # Memory: the peak after the warm-up step, then after each larger part (the first pass runs smallest first).
    points, top = [], 0
    for s in growing:
        if s["part_tokens"] > top:
            points.append((s["part_tokens"], s["peak_rss_bytes"]))
            top = s["part_tokens"]
    points[-1] = (top, max(s["peak_rss_bytes"] for s in steps))  # the largest part again, after smaller ones
    # what grows with a part's tokens: the activations saved for backward and the logits (a causal LM's are large)
    per_token = (activation_bytes_per_token(shape, bool(loop.speed.bf16), gradient_checkpointing)
                 + logits_bytes_per_token(shape))
    fixed = memory_estimate(shape, method, bf16=bool(loop.speed.bf16), micro_batch=0, seq_len=1,
                            gradient_checkpointing=gradient_checkpointing, knobs=knobs,
                            constants=Constants(runtime_bytes=0))
    # Each calibration step is one part (no accumulation): its gradients may take the pages the activations backward
    # frees (memory_estimate's gradients_overlap), so that the peaks grow from weights + optimizer state alone; or
    # the allocator keeps those pages for the sizes that freed them, and the peaks stand on the gradients too. Both
    # lines have the slope the points give; the one the process measured has for its runtime what the process held
    # before its first step (loaded_rss: the interpreter and its libraries, a trained model's weights still mapped,
    # unread), while the other's runtime takes in the gradients' bytes or goes below zero. Where the gradients are
    # the larger (full fine-tuning on short parts), the peaks stand on them either way.
    scale, runtime = fit_memory(points, fixed["peak"] - fixed["gradients"], per_token, loaded_rss)
    stacked = fit_memory(points, fixed["peak"], per_token, loaded_rss)
    if (scale * per_token * points[-1][0] < fixed["gradients"]
            or abs(stacked[1] - loaded_rss) < abs(runtime - loaded_rss)):
        return points, per_token, *stacked, False
    return points, per_token, scale, runtime, True


def _fitted(measured: _Measured, prepared: _Prepared, seconds: float, shape: ModelShape, method: str,
            knobs: MethodKnobs, loop: LoopConfig, gradient_checkpointing: bool, threads: int,
            others: list[dict] | None) -> Calibration:
    """calibrate's last step: the measured steps fitted into Constants (memory, time, each other method's cost and
    saved bytes), and the calibration's report, with what a busy machine or an early stop means for the plan."""
    point, stopped, steps, overhead, per_token_s, startup, startup_cold, startup_from = measured
    _, picks, runs, _, typical_tokens, inference = prepared
    points, per_token, scale, runtime, overlap = _fit_peaks(steps, steps[:len(picks)], shape, method, knobs, loop,
                                                            gradient_checkpointing, point["loaded_rss_bytes"])
    reference = min(s["seconds"] for s in steps[-2:]) if typical_tokens and not stopped else 0.0
    # each method against the calibrated one's steps on the same rows, taken in turn with its own
    method_cost = {m: round(t["seconds"] / t["calibrated_seconds"], 3) for m, t in point["others"].items()
                   if "seconds" in t and t["calibrated_seconds"] > 0}
    not_timed = {m: t.get("skipped") or t.get("error") or "no calibrated step to compare with"
                 for m, t in point["others"].items() if m not in method_cost}
    own_saved = point.get("saved_bytes") or 0
    activation_ratio = {m: round(t["saved_bytes"] / own_saved, 3) for m, t in point["others"].items()
                        if t.get("saved_bytes") and own_saved > 0}
    own_casts = point.get("cast_bytes") or 0
    extra_cast_bytes = {m: t["cast_bytes"] - own_casts for m, t in point["others"].items()
                        if m in activation_ratio and t.get("cast_bytes", 0) != own_casts}
    constants = Constants(runtime_bytes=max(0, int(runtime)), activation_scale=round(scale, 4),
                          step_overhead_s=overhead, seconds_per_token=per_token_s, startup_s=round(startup, 3),
                          calibrated_method=method, method_cost=method_cost, not_timed=not_timed,
                          activation_ratio=activation_ratio, extra_cast_bytes=extra_cast_bytes,
                          calibrated_per_token=per_token,
                          calibrated_checkpointing=gradient_checkpointing, gradients_overlap=overlap,
                          source=f"calibrated: the run's own loop over {len(steps)} of its micro-batches ({method}, "
                                 f"int8 products {'on' if point['int8_products'] else 'off'}, {threads} threads, "
                                 f"malloc {point['allocator']}) in {seconds:.0f} s"
                                 + (f", stopped early ({stopped.why})" if stopped else ""))
    busy = point["cpu_share"] < BUSY_SHARE or bool(stopped and stopped.busy)
    busy_note = (f"the machine was busy: calibration got {point['cpu_share']:.0%} of {threads} cores; the ETA assumes "
                 "the same load" if busy else None)
    if stopped:
        busy_note = (f"the calibration stopped after {len(steps)} of its {len(runs)} steps: {stopped.why}; the ETA "
                     f"and peak come from those steps{', under that load' if busy else ''}"
                     f"{', the other methods from training FLOPs' if others else ''}. "
                     f"{RECALIBRATE} when the machine is free calibrates it fully")
    timed_inference = None
    if inference:
        pairs = list(zip(inference["padded_tokens"], point["inference_seconds"]))[1:]  # after the warm-up
        fixed, per_token_inference = _fit_line([(float(t), s) for t, s in pairs])
        timed_inference = {"overhead_s": fixed, "seconds_per_token": per_token_inference, "threads": threads,
                           "batches": [{"padded_tokens": t, "seconds": round(s, 4)} for t, s in pairs]}
    report = {"method": method, "phases": point["phases"], "steps": steps, "inference": timed_inference,
              "memory_points": points,
              "others": {"padded_tokens": typical_tokens["padded_tokens"],
                         "calibrated_step_s": round(reference, 4), "calibrated_saved_bytes": own_saved,
                         "calibrated_cast_bytes": own_casts,
                         "methods": point["others"]}
              if others else None,
              "seconds": round(seconds, 1),
              "loaded_rss_bytes": point["loaded_rss_bytes"], "bf16": bool(loop.speed.bf16),
              "allocator": point["allocator"], "gradient_checkpointing": gradient_checkpointing,
              "int8_products": point["int8_products"], "cpu_share": point["cpu_share"],
              "startup_s": round(startup, 2), "startup_cold_s": round(startup_cold, 2),
              "startup_from": startup_from,
              "machine_busy": busy, "stopped": stopped.why if stopped else None, "busy_note": busy_note}
    return Calibration(constants, report)


RECALIBRATE = "`dvc repro --force --single-item plan`"


def _stopped_point(stopped: CalibrationStopped, spec: dict) -> dict:
    """A worker's result (`_calibration_point`) from what a calibration stopped after its second step had reported:
    those steps; no other method timed, nothing saved for backward counted."""
    marks, built = stopped.marks, stopped.built
    return {"phases": {"build_s": built["build_s"], "steps_s": round(marks[-1][4], 2)},
            "loaded_rss_bytes": built["loaded_rss_bytes"], "steps": _marked_steps(marks),
            "int8_products": built["int8_products"], "allocator": built["allocator"],
            "cpu_share": round(_cpu_share([tuple(m) for m in marks], 0.0, 0.0, spec["threads"]), 3),
            "inference_seconds": [], "saved_bytes": None, "cast_bytes": None,
            "others": {o["method"]: {"skipped": f"the calibration stopped early ({stopped.why})"}
                       for o in spec.get("others") or []}}


def _not_calibrated(stopped: CalibrationStopped, method: str, planned_steps: int,
                    seconds: float) -> Calibration:
    """calibrate's answer when its process stopped before two steps: the analytic constants, and why."""
    note = (f"the calibration stopped before its second step ({stopped.why}): the plan is analytic, without an ETA. "
            f"{RECALIBRATE} when the machine is free calibrates it")
    return Calibration(Constants(source=f"analytic defaults: {note}"), {
        "method": method, "steps": [], "planned_steps": planned_steps, "seconds": round(seconds, 1),
        "cpu_share": None, "int8_products": (stopped.built or {}).get("int8_products"),
        "machine_busy": stopped.busy, "stopped": stopped.why, "busy_note": note})
