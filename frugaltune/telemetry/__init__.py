"""Live training telemetry: a background sampler, a per-step phase timer, and the bottleneck summary they give.

Library code; the `train` stage wraps its training loop in it. Not run directly. Its rooms: `steps` (`StepTimer`),
`nvml` (the GPUs' readings), `findings` (`bottleneck_findings`: the summary's plain sentences), `sampler`
(`TelemetrySampler`: the samples, the CSV, MLflow's system metrics, the summary and its logging).

    sampler = TelemetrySampler(interval_s=1.0, csv_path=paths.plot("train", "telemetry"),
                               mlflow_run_id=run.info.run_id, cores=threads)
    timer = StepTimer()
    with sampler:                                   # start() ... stop()
        for step in ...:
            with timer.phase("data"): batch = ...   # batch building, collate, host-to-device copy
            with timer.phase("fwd_bwd"): ...        # forward + backward
            with timer.phase("optimizer"): ...      # clip, step, scheduler, zero_grad
            timer.end_step()                        # timer.window(): mean ms per phase, for the periodic log
    summary = sampler.summary(timer)                # numbers + summary["findings"], plain sentences
    sampler.log_summary(summary)                    # MLflow: telemetry/<number> metrics, findings tag + text

The sampler reads psutil counters (process and system CPU, RSS, system memory, swap, disk and network rates) and,
where NVML finds an NVIDIA GPU, per-GPU utilisation, memory, power, temperature and SM clock: /proc files and
NVML calls, no subprocesses. Each sample becomes one row of a CSV (written and flushed as it is taken, so a crash
leaves a readable prefix) and `system/<name>` metrics of the MLflow run (the UI's System metrics tab), with step =
sample index. MLflow gets the samples in batches every `mlflow_flush_s` through `MlflowClient.log_batch`, never
through the fluent API (its active-run state belongs to the main thread). Every summary states what the telemetry
itself cost: `telemetry_cpu_percent` (its thread's CPU time) and `telemetry_busy_percent` (the wall time it was at
work), as percentages of the run.
"""

from frugaltune.telemetry.sampler import TelemetrySampler
from frugaltune.telemetry.steps import StepTimer

__all__ = ["StepTimer", "TelemetrySampler"]
