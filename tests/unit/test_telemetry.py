"""Telemetry: the sampler's CSV and MLflow system metrics, a prompt stop, the step timer, the bottleneck findings,
and the NVML path against a fake NVML (and the plain no-GPU path)."""

from __future__ import annotations

import csv
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
from mlflow import MlflowClient

from frugaltune import hardware
from frugaltune.telemetry import StepTimer, TelemetrySampler
from frugaltune.telemetry.findings import bottleneck_findings
from frugaltune.telemetry.nvml import GPU_FIELDS
from frugaltune.telemetry.sampler import HOST_METRICS, MLFLOW_ATTEMPTS

FAST = 0.05  # seconds between samples in these tests


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def run_for(sampler: TelemetrySampler, seconds: float) -> None:
    with sampler:
        time.sleep(seconds)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML answers as on a machine without an NVIDIA driver, whatever machine runs the tests."""
    monkeypatch.setattr(hardware, "nvml_gpus", lambda: ([], "no NVIDIA GPU: NVML unavailable (Driver Not Loaded)",
                                                        None))


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A real sqlite MLflow store and an experiment in it: (tracking URI, experiment id). Only the client API is
    used, but MLflow's exported env vars are restored anyway so no other test sees this store."""
    saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID")}
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    experiment_id = MlflowClient(uri).create_experiment("telemetry", artifact_location=(root / "art").as_uri())
    try:
        yield uri, experiment_id
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# --------------------------------------------------------------------------------------------------------------
# The sampler


def test_sampler_writes_a_csv_row_per_sample_and_mlflow_system_metrics(tmp_path, mlflow_store, no_gpu):
    uri, experiment_id = mlflow_store
    client = MlflowClient(uri)
    run_id = client.create_run(experiment_id).info.run_id
    out = tmp_path / "reports" / "plots" / "train_telemetry.csv"
    sampler = TelemetrySampler(FAST, csv_path=out, mlflow_run_id=run_id, tracking_uri=uri, mlflow_flush_s=0.1)
    run_for(sampler, 0.4)

    columns, rows = read_csv(out)
    assert columns == ["elapsed_s", *HOST_METRICS]
    assert len(rows) == sampler.samples >= 3
    elapsed = [float(row["elapsed_s"]) for row in rows]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    assert all(float(row["process_rss_mb"]) > 1 for row in rows)
    assert all(0 <= float(row["system_cpu_percent"]) <= 100 for row in rows)

    # Every sample reached MLflow as system/<name>, step = sample index, in the order of the CSV.
    history = client.get_metric_history(run_id, "system/process_rss_mb")
    assert sorted(m.step for m in history) == list(range(len(rows)))
    assert set(client.get_run(run_id).data.metrics) == {f"system/{name}" for name in HOST_METRICS}


def test_summary_goes_to_the_mlflow_run_as_metrics_tag_and_artifacts(tmp_path, mlflow_store, no_gpu):
    uri, experiment_id = mlflow_store
    client = MlflowClient(uri)
    run_id = client.create_run(experiment_id).info.run_id
    sampler = TelemetrySampler(FAST, csv_path=tmp_path / "t.csv", mlflow_run_id=run_id, tracking_uri=uri)
    run_for(sampler, 0.15)
    summary = sampler.summary()
    sampler.log_summary(summary)

    run = client.get_run(run_id)
    assert run.data.metrics["telemetry/peak_rss_mb"] == summary["peak_rss_mb"]
    # how the sampler was set up is a param, not a one-point chart
    assert run.data.params["telemetry.samples"] == str(summary["samples"])
    assert run.data.params["telemetry.cores"] == str(summary["cores"])
    assert not {"telemetry/samples", "telemetry/cores", "telemetry/interval_s"} & set(run.data.metrics)
    assert run.data.tags["telemetry.findings"] == "\n".join(summary["findings"])
    assert "no NVIDIA GPU: telemetry covers CPU and RAM only" in run.data.tags["telemetry.findings"]
    artifacts = {a.path for a in client.list_artifacts(run_id, "telemetry")}
    assert artifacts == {"telemetry/findings.txt", "telemetry/t.csv"}


def test_a_busy_mlflow_store_gets_the_batch_again(tmp_path, mlflow_store, no_gpu, monkeypatch):
    uri, experiment_id = mlflow_store
    client = MlflowClient(uri)
    run_id = client.create_run(experiment_id).info.run_id
    real_log_batch, calls = MlflowClient.log_batch, []

    def locked_once(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("database is locked")
        return real_log_batch(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", locked_once)
    sampler = TelemetrySampler(FAST, mlflow_run_id=run_id, tracking_uri=uri, mlflow_flush_s=0.0)
    run_for(sampler, 0.15)
    assert len(calls) >= 2
    history = client.get_metric_history(run_id, "system/swap_used_mb")
    assert sorted(m.step for m in history) == list(range(sampler.samples))


def test_a_failing_mlflow_run_costs_the_metrics_not_the_csv(tmp_path, mlflow_store, no_gpu, caplog):
    uri, _ = mlflow_store
    sampler = TelemetrySampler(FAST, csv_path=tmp_path / "t.csv", mlflow_run_id="no-such-run", tracking_uri=uri,
                               mlflow_flush_s=0.0)
    with sampler:
        deadline = time.monotonic() + 10
        while "no more MLflow system metrics" not in caplog.text and time.monotonic() < deadline:
            time.sleep(FAST)
    assert len(read_csv(tmp_path / "t.csv")[1]) == sampler.samples >= MLFLOW_ATTEMPTS
    assert "no more MLflow system metrics this run" in caplog.text


def test_csv_rows_are_on_disk_while_training_runs(tmp_path, no_gpu):
    """Each row is flushed as it is taken: a crash leaves a readable prefix."""
    out = tmp_path / "t.csv"
    with TelemetrySampler(FAST, csv_path=out):
        deadline = time.monotonic() + 5
        while len(read_csv(out)[1]) < 2 and time.monotonic() < deadline:
            time.sleep(FAST)
        assert len(read_csv(out)[1]) >= 2


def test_stop_returns_promptly_and_still_takes_one_sample(tmp_path, no_gpu):
    sampler = TelemetrySampler(interval_s=30.0, csv_path=tmp_path / "t.csv")
    sampler.start()
    time.sleep(0.05)
    started = time.monotonic()
    sampler.stop()
    assert time.monotonic() - started < 1.0
    assert not sampler.running and not any(t.name == "frugaltune-telemetry" for t in threading.enumerate())
    assert sampler.samples == 1  # a run shorter than the interval still gets its one reading
    assert len(read_csv(tmp_path / "t.csv")[1]) == 1


def test_summary_numbers_and_the_sampler_cost(no_gpu):
    sampler = TelemetrySampler(FAST, cores=2)
    run_for(sampler, 0.2)
    summary = sampler.summary()
    assert summary["samples"] == sampler.samples >= 2
    assert summary["cores"] == 2
    assert summary["peak_rss_mb"] > 1
    assert summary["cpu_busy_share"] == pytest.approx(summary["process_cpu_mean_percent"] / 200, abs=1e-3)
    assert summary["gpu_count"] == 0
    assert 0 <= summary["telemetry_cpu_percent"] < 50


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        TelemetrySampler(interval_s=0)
    with pytest.raises(ValueError, match="cores must be >= 1"):
        TelemetrySampler(cores=0)


def test_a_sampler_runs_once(no_gpu):
    sampler = TelemetrySampler(FAST)
    with pytest.raises(RuntimeError, match="has been started"):
        sampler.summary()
    run_for(sampler, 0.01)
    with pytest.raises(RuntimeError, match="make a new one"):
        sampler.start()


# --------------------------------------------------------------------------------------------------------------
# The step timer


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_step_timer_splits_each_step_into_phases(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    timer = StepTimer()
    clock.now += 5.0  # model loading before the first step: not part of any step
    for _ in range(2):  # two optimizer steps, each with two accumulated micro-batches
        for _ in range(2):
            with timer.phase("data"):
                clock.now += 0.010
            with timer.phase("fwd_bwd"):
                clock.now += 0.030
        with timer.phase("optimizer"):
            clock.now += 0.010
        clock.now += 0.010  # logging, progress bar: in the step's wall time, in no phase
        step = timer.end_step()
    assert step == pytest.approx({"data": 0.020, "fwd_bwd": 0.060, "optimizer": 0.010, "step": 0.100})
    assert timer.window() == pytest.approx({"step_time_ms": 100.0, "step_data_ms": 20.0, "step_fwd_bwd_ms": 60.0,
                                            "step_optimizer_ms": 10.0})
    assert timer.window() == {}  # a new window starts after each call
    summary = timer.summary()
    assert summary["steps"] == 2 and summary["step_time_mean_ms"] == pytest.approx(100.0)
    assert (summary["data_share"], summary["fwd_bwd_share"], summary["optimizer_share"],
            summary["other_share"]) == pytest.approx((0.2, 0.6, 0.1, 0.1), abs=1e-4)


def test_step_timer_syncs_as_each_phase_ends_and_names_its_phases():
    calls = []
    timer = StepTimer(sync=lambda: calls.append(1))
    with timer.phase("fwd_bwd"):
        assert calls == []
    assert calls == [1]
    with pytest.raises(ValueError, match="data, fwd_bwd, optimizer"):
        timer.phase("forward")
    assert StepTimer().summary() == {"steps": 0}


def test_sampler_summary_includes_the_step_timer(no_gpu):
    timer = StepTimer()
    with TelemetrySampler(FAST) as sampler:
        for _ in range(3):
            with timer.phase("data"):
                time.sleep(0.02)
            with timer.phase("fwd_bwd"):
                time.sleep(0.005)
            timer.end_step()
    summary = sampler.summary(timer)
    assert summary["steps"] == 3 and summary["data_share"] > 0.5
    assert any(f.startswith("data loader starved the model") for f in summary["findings"])


# --------------------------------------------------------------------------------------------------------------
# The findings


def test_data_wait_above_10_percent_starves_the_model():
    findings = bottleneck_findings({"data_share": 0.31, "data_mean_ms": 31.0, "step_time_mean_ms": 100.0,
                                    "gpu_count": 1})
    assert findings[0].startswith("data loader starved the model 31% of the time (31.0 ms of 100.0 ms per step")
    assert not any("starved" in f for f in bottleneck_findings({"data_share": 0.10, "gpu_count": 1}))


def test_swap_growth_is_reported_in_megabytes():
    findings = bottleneck_findings({"swap_growth_mb": 512.0, "swap_peak_mb": 600.0, "gpu_count": 1})
    assert findings[0].startswith("swapping: 512 MB of swap used during training (peak 600 MB)")
    assert not any(f.startswith("swapping") for f in bottleneck_findings({"swap_growth_mb": 8.0, "gpu_count": 1}))


def test_idle_gpu_is_reported_per_gpu():
    findings = bottleneck_findings({"gpu_count": 2, "gpu_0_busy_mean_percent": 95.0, "gpu_1_busy_mean_percent": 23.0})
    assert findings == ["GPU 1 under 40% busy (mean 23% utilisation): it waits on the CPU or the data; "
                        "a larger micro-batch usually helps"]


def test_idle_cpu_is_reported_only_when_training_on_the_cpu():
    cpu_run = {"samples": 10, "cores": 8, "cpu_busy_share": 0.45, "gpu_count": 0}
    findings = bottleneck_findings(cpu_run, "no NVIDIA GPU: NVML reports 0 devices")
    assert findings[0].startswith("CPU under 60% of available cores busy: the process kept 3.6 of 8 cores busy")
    assert findings[-1] == "no NVIDIA GPU: telemetry covers CPU and RAM only; NVML reports 0 devices"
    gpu_run = {**cpu_run, "gpu_count": 1, "gpu_0_busy_mean_percent": 90.0}
    assert not any(f.startswith("CPU under") for f in bottleneck_findings(gpu_run))


def test_a_healthy_run_says_no_bottleneck_and_why():
    findings = bottleneck_findings({"samples": 10, "cores": 2, "cpu_busy_share": 0.95, "data_share": 0.02,
                                    "swap_growth_mb": 0.0, "gpu_count": 0})
    assert findings == ["no bottleneck found: CPU 95% of 2 cores busy, data wait 2% of step time, no swapping",
                        "no NVIDIA GPU: telemetry covers CPU and RAM only"]


# --------------------------------------------------------------------------------------------------------------
# NVML


class FakeNVML:
    """The pynvml functions the sampler calls (and `hardware.nvml_gpus` before it), answering for fake GPUs.

    Each device is a dict: name, util (percent), used (bytes), power (milliwatts, or None: not supported),
    temp (C), clock (MHz).
    """

    def __init__(self, devices: list[dict]):
        self.devices = devices
        self.init_calls = self.shutdown_calls = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        handles = [SimpleNamespace(**d) for d in self.devices]

        def init() -> None:
            self.init_calls += 1

        def shutdown() -> None:
            self.shutdown_calls += 1

        def power(handle) -> int:
            if handle.power is None:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return handle.power

        for name, fn in {
            "nvmlInit": init,
            "nvmlShutdown": shutdown,
            "nvmlSystemGetDriverVersion": lambda: "550.54.15",
            "nvmlSystemGetCudaDriverVersion": lambda: 12040,
            "nvmlDeviceGetCount": lambda: len(handles),
            "nvmlDeviceGetHandleByIndex": lambda i: handles[i],
            "nvmlDeviceGetName": lambda h: h.name,
            "nvmlDeviceGetCudaComputeCapability": lambda h: (9, 0),
            "nvmlDeviceGetMaxClockInfo": lambda h, kind: 1980,
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(total=80 * 2**30, used=h.used, free=1),
            "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=h.util, memory=10),
            "nvmlDeviceGetPowerUsage": power,
            "nvmlDeviceGetTemperatureV": lambda h, sensor: h.temp,
            "nvmlDeviceGetClockInfo": lambda h, kind: h.clock,
        }.items():
            monkeypatch.setattr(pynvml, name, fn)


def test_nvml_gpus_are_sampled_into_csv_and_summary(tmp_path, monkeypatch):
    fake = FakeNVML([
        {"name": "NVIDIA H100", "util": 25, "used": 10 * 2**30, "power": 150_000, "temp": 61, "clock": 1755},
        {"name": "NVIDIA H100", "util": 97, "used": 70 * 2**30, "power": None, "temp": 75, "clock": 1980},
    ])
    fake.install(monkeypatch)
    out = tmp_path / "t.csv"
    sampler = TelemetrySampler(FAST, csv_path=out)
    run_for(sampler, 0.2)

    columns, rows = read_csv(out)
    assert columns[len(HOST_METRICS) + 1:] == [f"gpu_{i}_{field}" for i in (0, 1) for field in GPU_FIELDS]
    first = rows[0]
    assert (first["gpu_0_utilization_percent"], first["gpu_0_memory_used_mb"], first["gpu_0_power_w"],
            first["gpu_0_temperature_c"], first["gpu_0_sm_clock_mhz"]) == ("25.00", "10240.00", "150.00", "61.00",
                                                                          "1755.00")
    assert first["gpu_1_power_w"] == ""  # not supported: an empty cell, and the other fields still sampled
    assert first["gpu_1_utilization_percent"] == "97.00"
    assert fake.shutdown_calls >= 2  # the probe's own init/shutdown, then the sampler's at stop

    summary = sampler.summary()
    assert summary["gpu_count"] == 2
    assert summary["gpu_0_busy_mean_percent"] == 25.0 and summary["gpu_1_busy_mean_percent"] == 97.0
    assert summary["gpu_busy_mean_percent"] == 61.0
    assert summary["gpu_1_memory_peak_mb"] == 70 * 1024
    assert summary["gpu_0_power_mean_w"] == 150.0 and "gpu_1_power_mean_w" not in summary
    assert summary["gpu_1_temperature_peak_c"] == 75.0
    assert any(f.startswith("GPU 0 under 40% busy (mean 25% utilisation)") for f in summary["findings"])
    assert not any("no NVIDIA GPU" in f or f.startswith("CPU under") for f in summary["findings"])


def test_older_drivers_without_temperature_v_use_the_old_call(tmp_path, monkeypatch):
    FakeNVML([{"name": "T4", "util": 80, "used": 2**30, "power": 70_000, "temp": 55, "clock": 1590}]).install(
        monkeypatch)

    def missing(handle, sensor):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperatureV", missing)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", lambda h, sensor: h.temp)
    sampler = TelemetrySampler(FAST)
    run_for(sampler, 0.12)
    assert sampler.summary()["gpu_0_temperature_peak_c"] == 55.0


def test_without_nvidia_gpu_telemetry_says_so_and_samples_the_cpu(tmp_path, no_gpu):
    out = tmp_path / "t.csv"
    sampler = TelemetrySampler(FAST, csv_path=out)
    run_for(sampler, 0.12)
    assert sampler.gpu_note == "no NVIDIA GPU: NVML unavailable (Driver Not Loaded)"
    assert read_csv(out)[0] == ["elapsed_s", *HOST_METRICS]
    summary = sampler.summary()
    assert summary["gpu_count"] == 0 and "gpu_busy_mean_percent" not in summary
    assert summary["findings"][-1] == ("no NVIDIA GPU: telemetry covers CPU and RAM only; "
                                       "NVML unavailable (Driver Not Loaded)")
