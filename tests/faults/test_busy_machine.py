"""The plan on a busy machine: a calibration whose process is stopped (SIGSTOP), hangs after its second step, or
loses its cores to CPU-bound processes ends at once with the plan built from what it measured and a note saying
why, not a `subprocess.TimeoutExpired` traceback after 15 minutes.

Run with `pytest -m slow tests/faults/test_busy_machine.py` (seconds: the planner's real calibration process on the tiny
llama, watched over a short window instead of the plan's 30 s). Each test is a row of docs/FAULTS.md (see table.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from frugaltune.planner.assembly import RunSpec, make_plan
from frugaltune.planner.calibration import calibrate
from frugaltune.planner.memory import MethodKnobs, model_shape, planned_order
from frugaltune.planner.worker import CalibrationWorker
from frugaltune.models import load_tokenizer
from frugaltune.training.loop import LoopConfig
from frugaltune.methods import get as method_named
from tests.faults.table import fault

pytestmark = pytest.mark.slow  # with the other rows (`pytest -m slow tests/faults`), though these take seconds
LABELS = ["negative", "neutral", "positive"]
WATCH_S = 3.0
OFF = {"on": False, "why": "test"}


def calibrate_tiny(model_dir, worker=None, **kw):
    """The plan's calibration of lora on 48 rows of the tiny llama (4 sizes, then 3 again: 7 steps), prelayer to
    time after them; returns (constants, calibration, the plan made from them, seconds it took)."""
    lengths = [8 + (i * 7) % 25 for i in range(48)]
    _, order = planned_order(lengths, 8, 1, 1.0, None, seed=0)
    shape = model_shape(model_dir, len(LABELS), "lora")
    began = time.monotonic()
    constants, calibration = calibrate(
        model_dir, LABELS, load_tokenizer(model_dir).pad_token_id, "lora", MethodKnobs(), shape,
        rows=[[5 + j % 50 for j in range(n)] for n in lengths], targets=[i % 3 for i in range(48)], order=order,
        loop=LoopConfig.build(lr=1e-3, batch_size=8), int8=OFF, gradient_checkpointing=False, threads=1,
        time_samples=4, others=[{"method": "prelayer", "knobs": MethodKnobs(), "int8": OFF}],
        others_share=None, worker=worker, watch_s=WATCH_S, **kw)
    seconds = time.monotonic() - began
    hardware = {"cpu": {"model": "test CPU", "physical_cores": 2}, "gpus": [], "gpu_note": "test",
                "memory": {"total_bytes": 8 * 2**30, "cgroup_limit_bytes": None}}
    run = RunSpec(method="lora", batch_size=8, grad_accum=1, epochs=1.0, max_steps=None, seq_len=32,
                  lengths=tuple(lengths), seed=0)
    plan = make_plan(run, hardware, {m: model_shape(model_dir, 3, m) for m in ("lora", "prelayer")},
                     constants, calibration=calibration)
    json.dumps(plan)  # written as JSON: the note and all
    return constants, calibration, plan, seconds


@fault("process", "the plan's calibration process stopped (SIGSTOP) or starved of CPU before its second step",
       "the plan stage goes on after 30 s without CPU: the analytic plan (no ETA) and one line saying the "
       "calibration stopped, why, and the command that calibrates again",
       "recovered: a complete reports/plan.json (analytic constants, the note in `calibration`); no traceback, "
       "no 15-minute wait")
def test_a_stopped_calibration_process_gives_the_analytic_plan_and_says_why(tiny_model_dir):
    worker = CalibrationWorker()
    os.kill(worker.process.pid, signal.SIGSTOP)
    try:
        constants, calibration, plan, seconds = calibrate_tiny(tiny_model_dir, worker=worker)
    finally:
        worker.close()  # SIGKILL ends a stopped process too
    assert seconds < WATCH_S + 10, seconds
    assert calibration["stopped"].startswith("its process was stopped (SIGSTOP"), calibration
    assert constants.seconds_per_token is None and "calibration stopped before its second step" in constants.source
    assert "--force --single-item plan" in calibration["busy_note"]
    assert plan["fits"] and plan["methods"]["lora"]["eta_seconds"] is None
    assert plan["calibration"]["busy_note"] == calibration["busy_note"]


@fault("process", "the plan's calibration process hangs (or dies) after its second step",
       "the plan stage goes on after 30 s without CPU (at once when the process dies), with one line: the "
       "calibration stopped after N of its steps, why, and that the ETA and peak come from those steps",
       "recovered: the plan fitted from the steps measured, the other methods' ETA from training FLOPs (said so)")
def test_a_calibration_that_hangs_after_two_steps_keeps_what_it_measured(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("FRUGALTUNE_FAULT", "calibration:step-2:hang")  # the worker sleeps after its second step
    constants, calibration, plan, seconds = calibrate_tiny(tiny_model_dir)
    # why: stuck, or, on a machine that other processes keep busy, starved (both: no CPU for the window)
    assert len(calibration["steps"]) == 2 and calibration["busy_note"].startswith(
        f"the calibration stopped after 2 of its 9 steps: {calibration['stopped']}; the ETA and peak come from those")
    assert constants.seconds_per_token > 0 and "stopped early" in constants.source
    assert constants.method_cost == {} and "stopped early" in constants.not_timed["prelayer"]
    assert plan["methods"]["lora"]["eta_seconds"] > 0 and "stopped early" in plan["methods"]["prelayer"]["eta_note"]


@fault("process", "the plan beside CPU-bound jobs that take the calibration's cores",
       "the plan stage's calibration stops within 30 s of seeing it (beside two `while True` loops on 2 cores) and "
       "one line says the machine was busy: the share of the cores it got, and what the other processes used",
       "recovered: the plan fitted from the steps measured under that load (analytic before two steps), said so")
def test_a_calibration_beside_cpu_bound_jobs_stops_early_and_says_the_machine_was_busy(tiny_model_dir):
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        constants, calibration, plan, seconds = calibrate_tiny(tiny_model_dir, stop_when_busy=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert calibration["stopped"].startswith("the machine was busy: over "), calibration
    assert calibration["machine_busy"] and "other processes kept" in calibration["busy_note"]
    # the watch decides after its window, with two steps to fit, or after twice the window without them
    assert seconds < 2 * WATCH_S + 15, seconds
    assert plan["fits"] and ("stopped early" in constants.source or "analytic" in constants.source)



@fault("process", "a training beside CPU-bound work that takes its cores (a second training, `while True` loops)",
       "the training gives up a thread while the others crowd its cores (an event says what the others used), instead "
       "of both collapsing: two default trainings at once train together at >= 0.8x one alone "
       "(`python benchmarks/shared_machine.py`)",
       "recovered: the plan's threads again once a core stays idle, and after the run")
def test_a_training_beside_cpu_bound_jobs_gives_up_a_thread(tiny_model_dir, monkeypatch):
    import torch

    from frugaltune.training import sharing
    from frugaltune.training.methods import prepare_model

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: no thread to give up")
    monkeypatch.setattr(sharing, "WINDOW_S", 1.0)  # the tiny model's steps are milliseconds
    tokenizer = load_tokenizer(tiny_model_dir)
    model = prepare_model(tiny_model_dir, LABELS, tokenizer.pad_token_id, 0, method_named("lora"), MethodKnobs(r=4))
    rows = [[5 + (i + j) % 300 for j in range(64)] for i in range(64)]
    events: list[str] = []
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        from frugaltune.training.loop import train_classifier

        train_classifier(model, rows, [i % 3 for i in range(64)],
                         LoopConfig.build(lr=1e-3, batch_size=8, max_steps=200), tokenizer.pad_token_id,
                         progress=False, on_event=events.append)
        assert torch.get_num_threads() == 2, "the run left its threads changed"
    finally:
        torch.set_num_threads(before)
        for hog in hogs:
            hog.kill()
            hog.wait()
    drops = [e for e in events if e.startswith("threads 2 -> 1: other processes use")]
    assert drops, events
