"""The background sampler (`TelemetrySampler`): one row of machine readings every interval, into a CSV and MLflow's
system metrics; the run's summary and its logging to MLflow.

Library code, not run directly: the train recipe wraps its training loop in it (see `frugaltune.telemetry`).
"""

from __future__ import annotations

import csv
import logging
import os
import resource
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from frugaltune.telemetry.findings import bottleneck_findings
from frugaltune.telemetry.nvml import MB, _NvmlReader
from frugaltune.telemetry.steps import StepTimer

logger = logging.getLogger(__name__)

METRIC_PREFIX = "system/"  # what MLflow's UI groups under "System metrics"
MLFLOW_BATCH_LIMIT = 1000  # metrics per log_batch call (mlflow.utils.validation.MAX_METRICS_PER_BATCH)
MLFLOW_ATTEMPTS = 3  # consecutive failed flushes before MLflow logging is given up for the run
MLFLOW_TAG_LIMIT = 8000  # characters in a tag value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH)
# summary() keys that describe how the sampler was set up, not what it measured: MLflow params, not metrics
SETUP_KEYS = frozenset({"samples", "interval_s", "cores", "gpu_count"})

HOST_METRICS = (
    "process_cpu_percent",  # all threads of the process; 100 = one core busy, so it can exceed 100
    "system_cpu_percent",  # all cores of the machine; 100 = every core busy
    "process_rss_mb",
    "system_memory_used_mb",
    "swap_used_mb",
    "disk_read_mb_per_s",
    "disk_write_mb_per_s",
    "net_recv_mb_per_s",
    "net_sent_mb_per_s",
)


class _Stat:
    __slots__ = ("count", "total", "peak")

    def __init__(self) -> None:
        self.count, self.total, self.peak = 0, 0.0, float("-inf")

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.peak = max(self.peak, value)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


def _cpu_busy_idle() -> tuple[float, float]:
    """System CPU (busy, total) seconds. Our own deltas rather than psutil.cpu_percent(), whose module-level state
    another caller (MLflow's system-metrics monitor) would reset under us."""
    times = psutil.cpu_times()
    total = sum(times)
    # Linux counts guest time inside user time too; psutil subtracts it the same way.
    total -= getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
    idle = times.idle + getattr(times, "iowait", 0.0)
    return total - idle, total


class TelemetrySampler:
    """Samples the machine every `interval_s` seconds on a daemon thread, into a CSV and an MLflow run.

    Args:
        interval_s: seconds between samples (default 1.0).
        csv_path: the CSV to write (`elapsed_s` then one column per metric); None for no CSV.
        mlflow_run_id: the run to log `system/<name>` metrics to; None for no MLflow logging.
        pid: the process whose CPU and RSS are sampled; default this process.
        cores: CPU cores the training is meant to keep busy (the train stage: its torch threads); default the
            cores this process may run on. The "CPU under 60% busy" finding compares against it.
        tracking_uri: the MLflow store; default MLflow's current one (MLFLOW_TRACKING_URI / set_tracking_uri).
        mlflow_flush_s: seconds between MLflow batches (and at stop); the CSV gets every sample at once.
        use_nvml: sample NVIDIA GPUs through NVML where present.
    """

    def __init__(
        self,
        interval_s: float = 1.0,
        csv_path: Path | str | None = None,
        mlflow_run_id: str | None = None,
        pid: int | None = None,
        *,
        cores: int | None = None,
        tracking_uri: str | None = None,
        mlflow_flush_s: float = 10.0,
        use_nvml: bool = True,
    ):
        if not interval_s > 0:
            raise ValueError(f"telemetry interval_s must be > 0 seconds, got {interval_s}")
        if cores is not None and cores < 1:
            raise ValueError(f"telemetry cores must be >= 1, got {cores}")
        self.interval_s = float(interval_s)
        self.csv_path = Path(csv_path) if csv_path is not None else None
        self.mlflow_run_id = mlflow_run_id
        self.pid = pid or os.getpid()
        self.cores = cores
        self.tracking_uri = tracking_uri
        self.mlflow_flush_s = mlflow_flush_s
        self.use_nvml = use_nvml
        self.samples = 0
        self.gpu_note: str | None = None
        self.columns: list[str] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stats: dict[str, _Stat] = {}
        self._pending: list[Any] = []  # mlflow Metric objects not yet sent
        self._mlflow_ok = True
        self._mlflow_failures = 0
        self._errors_logged: set[str] = set()
        self._own_cpu_s = self._own_wall_s = 0.0
        self._t0 = self._t_end = 0.0
        self._nvml_reader: _NvmlReader | None = None
        self._disk_start = self._disk_prev = self._net_start = self._net_prev = None
        self._swap_start_mb = 0.0

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def __enter__(self) -> TelemetrySampler:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Prime the counters, open the CSV and the MLflow client, start the thread. A sampler runs once."""
        if self._t0:
            # Its sample index is the MLflow step: a second run would log steps 0, 1, ... over the first ones.
            raise RuntimeError("this TelemetrySampler has already run; make a new one for the next run")
        self._process = psutil.Process(self.pid)
        if self.cores is None:
            try:
                self.cores = len(self._process.cpu_affinity()) or None
            except (AttributeError, psutil.Error):  # no cpu_affinity on macOS
                self.cores = None
            self.cores = self.cores or psutil.cpu_count() or 1
        self._process.cpu_percent(None)  # the first call only sets the reference point
        self._cpu_prev = _cpu_busy_idle()
        self._disk_start = self._disk_prev = psutil.disk_io_counters()
        self._net_start = self._net_prev = psutil.net_io_counters()
        self._swap_start_mb = psutil.swap_memory().used / MB
        self._nvml_reader = _NvmlReader(self.use_nvml)
        self.gpu_note = self._nvml_reader.note
        self.columns = ["elapsed_s", *HOST_METRICS, *self._nvml_reader.names]
        self._stats = {name: _Stat() for name in self.columns[1:]}
        self.samples = 0
        self._csv_file = None
        if self.csv_path is not None:
            self.csv_path.parent.mkdir(parents=True, exist_ok=True)
            self._csv_file = open(self.csv_path, "w", newline="", encoding="utf-8")  # noqa: SIM115 closed in stop
            self._csv = csv.writer(self._csv_file, lineterminator="\n")
            self._csv.writerow(self.columns)
            self._csv_file.flush()
        self._client = None
        if self.mlflow_run_id is not None:
            from mlflow import MlflowClient

            self._client = MlflowClient(self.tracking_uri)
        self._stop.clear()
        self._t0 = self._t_prev = self._last_flush = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="frugaltune-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Take a last sample, send what MLflow has not got, close the CSV. Returns within about one sample."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        # A stalled MLflow server must not hold training hostage: give up on the thread after a while.
        thread.join(timeout=max(10.0, 2 * self.mlflow_flush_s))
        if thread.is_alive():
            logger.warning("telemetry: the sampler thread did not stop in time; some MLflow metrics may be missing")
        self._thread = None
        self._t_end = time.monotonic()
        if self._csv_file is not None:
            self._csv_file.close()
            self._csv_file = None
        if self._nvml_reader is not None:
            self._nvml_reader.close()

    @property
    def running(self) -> bool:
        return self._thread is not None

    # -- the thread --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        deadline = self._t0 + self.interval_s
        while True:
            stopping = self._stop.wait(max(0.0, deadline - time.monotonic()))
            cpu_start = time.thread_time()
            now = time.monotonic()
            # At stop, sample the partial interval unless it is too short to give a meaningful CPU percentage.
            if not stopping or self.samples == 0 or now - self._t_prev >= 0.2 * self.interval_s:
                self._guarded("sample", self._sample, now)
            due = stopping or now - self._last_flush >= self.mlflow_flush_s
            if self._client is not None and self._pending and due:
                self._guarded("mlflow", self._flush_mlflow)
                self._last_flush = now
            self._own_cpu_s += time.thread_time() - cpu_start
            self._own_wall_s += time.monotonic() - now
            if stopping:
                return
            deadline += self.interval_s
            if deadline < now:  # fell behind (a suspended machine, a very slow flush): do not burst to catch up
                deadline = now + self.interval_s

    def _guarded(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        # Telemetry must never crash training: log each kind of failure once and carry on.
        try:
            fn(*args)
            if what == "mlflow":
                self._mlflow_failures = 0
        except Exception as exc:  # noqa: BLE001
            suffix = ""
            if what == "mlflow":
                # A busy store (sqlite locked by the main thread's own logging) gets the batch again next time;
                # a store that keeps refusing (run deleted, server gone) is given up on.
                self._mlflow_failures += 1
                if self._mlflow_failures >= MLFLOW_ATTEMPTS:
                    self._mlflow_ok = False
                    self._pending.clear()
                    suffix = "; no more MLflow system metrics this run"
            if what not in self._errors_logged or suffix:
                self._errors_logged.add(what)
                logger.warning("telemetry: %s failed (%s: %s)%s", what, type(exc).__name__, exc, suffix)

    def _read(self, now: float) -> dict[str, float | None]:
        """One sample of every metric (rates over the time since the previous read)."""
        dt = max(now - self._t_prev, 1e-6)
        row: dict[str, float | None] = dict.fromkeys(HOST_METRICS)
        try:
            with self._process.oneshot():
                row["process_cpu_percent"] = self._process.cpu_percent(None)
                row["process_rss_mb"] = self._process.memory_info().rss / MB
        except psutil.NoSuchProcess:
            pass  # the sampled process ended; system metrics go on
        busy, total = _cpu_busy_idle()
        d_total = total - self._cpu_prev[1]
        row["system_cpu_percent"] = 100 * (busy - self._cpu_prev[0]) / d_total if d_total > 0 else 0.0
        self._cpu_prev = (busy, total)
        row["system_memory_used_mb"] = psutil.virtual_memory().used / MB
        row["swap_used_mb"] = psutil.swap_memory().used / MB
        disk = psutil.disk_io_counters()
        if disk is not None and self._disk_prev is not None:  # None in containers without /proc/diskstats
            row["disk_read_mb_per_s"] = (disk.read_bytes - self._disk_prev.read_bytes) / MB / dt
            row["disk_write_mb_per_s"] = (disk.write_bytes - self._disk_prev.write_bytes) / MB / dt
        self._disk_prev = disk
        net = psutil.net_io_counters()
        if net is not None and self._net_prev is not None:
            row["net_recv_mb_per_s"] = (net.bytes_recv - self._net_prev.bytes_recv) / MB / dt
            row["net_sent_mb_per_s"] = (net.bytes_sent - self._net_prev.bytes_sent) / MB / dt
        self._net_prev = net
        row.update(self._nvml_reader.read())
        self._t_prev = now
        return row

    def _sample(self, now: float) -> None:
        row = self._read(now)
        step, elapsed = self.samples, now - self._t0
        with self._lock:
            for name, value in row.items():
                if value is not None:
                    self._stats[name].add(value)
            self.samples += 1
        if self._csv_file is not None:
            cells = ("" if row[name] is None else f"{row[name]:.2f}" for name in self.columns[1:])
            self._csv.writerow([f"{elapsed:.3f}", *cells])
            self._csv_file.flush()
        if self._client is not None and self._mlflow_ok:
            from mlflow.entities import Metric

            timestamp = int(time.time() * 1000)
            self._pending.extend(Metric(METRIC_PREFIX + name, value, timestamp, step)
                                 for name, value in row.items() if value is not None)

    def _flush_mlflow(self) -> None:
        while self._pending:  # what fails stays pending for the next attempt
            chunk = self._pending[:MLFLOW_BATCH_LIMIT]
            self._client.log_batch(self.mlflow_run_id, metrics=chunk, synchronous=True)
            del self._pending[:len(chunk)]

    # -- the summary -------------------------------------------------------------------------------------------

    def summary(self, timer: StepTimer | None = None) -> dict[str, Any]:
        """Numbers over the whole run (plus `timer.summary()` when given) and `findings`: plain sentences."""
        if not self._t0:
            raise RuntimeError("TelemetrySampler.summary() needs a sampler that has been started")
        with self._lock:
            stats = {name: (s.count, s.mean, s.peak) for name, s in self._stats.items()}
            samples = self.samples
        end = self._t_end if self._thread is None and self._t_end else time.monotonic()
        duration = max(end - self._t0, 1e-9)
        cores = self.cores or 1

        def mean(name: str) -> float | None:
            count, value, _ = stats.get(name, (0, 0.0, 0.0))
            return value if count else None

        def peak(name: str) -> float | None:
            count, _, value = stats.get(name, (0, 0.0, 0.0))
            return value if count else None

        out: dict[str, Any] = {"samples": samples, "duration_s": round(duration, 2), "interval_s": self.interval_s,
                               "cores": cores}
        cpu_mean = mean("process_cpu_percent")
        if cpu_mean is not None:
            out["process_cpu_mean_percent"] = round(cpu_mean, 1)
            out["process_cpu_peak_percent"] = round(peak("process_cpu_percent"), 1)
            out["cpu_busy_share"] = round(cpu_mean / (100 * cores), 4)
        if mean("system_cpu_percent") is not None:
            out["system_cpu_mean_percent"] = round(mean("system_cpu_percent"), 1)
        rss_peak = peak("process_rss_mb") or 0.0
        if self.pid == os.getpid():  # the kernel's own peak also catches spikes between samples (Linux: KiB)
            rss_peak = max(rss_peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        out["peak_rss_mb"] = round(rss_peak, 1)
        if peak("system_memory_used_mb") is not None:
            out["system_memory_peak_mb"] = round(peak("system_memory_used_mb"), 1)
        if peak("swap_used_mb") is not None:
            swap_peak = peak("swap_used_mb")
            out["swap_peak_mb"] = round(swap_peak, 1)
            out["swap_growth_mb"] = round(max(0.0, swap_peak - self._swap_start_mb), 1)
        if self._disk_start is not None and self._disk_prev is not None:
            out["disk_read_mb"] = round((self._disk_prev.read_bytes - self._disk_start.read_bytes) / MB, 1)
            out["disk_write_mb"] = round((self._disk_prev.write_bytes - self._disk_start.write_bytes) / MB, 1)
        if self._net_start is not None and self._net_prev is not None:
            out["net_recv_mb"] = round((self._net_prev.bytes_recv - self._net_start.bytes_recv) / MB, 1)
            out["net_sent_mb"] = round((self._net_prev.bytes_sent - self._net_start.bytes_sent) / MB, 1)
        gpus = self._nvml_reader.gpus if self._nvml_reader is not None else []
        out["gpu_count"] = len(gpus)
        busy_means = []
        for gpu in gpus:
            i = gpu["index"]
            for key, name, fn, digits in (
                (f"gpu_{i}_busy_mean_percent", f"gpu_{i}_utilization_percent", mean, 1),
                (f"gpu_{i}_memory_peak_mb", f"gpu_{i}_memory_used_mb", peak, 1),
                (f"gpu_{i}_power_mean_w", f"gpu_{i}_power_w", mean, 1),
                (f"gpu_{i}_temperature_peak_c", f"gpu_{i}_temperature_c", peak, 1),
            ):
                value = fn(name)
                if value is not None:
                    out[key] = round(value, digits)
            if f"gpu_{i}_busy_mean_percent" in out:
                busy_means.append(out[f"gpu_{i}_busy_mean_percent"])
        if busy_means:
            out["gpu_busy_mean_percent"] = round(sum(busy_means) / len(busy_means), 1)
        # The sampler's own cost: its CPU time, and the wall time it was at work (an upper bound on how long it
        # can have kept the training thread waiting for the GIL), each as a percentage of the run.
        out["telemetry_cpu_percent"] = round(100 * self._own_cpu_s / duration, 3)
        out["telemetry_busy_percent"] = round(100 * self._own_wall_s / duration, 3)
        if timer is not None:
            out.update(timer.summary())
        out["findings"] = bottleneck_findings(out, self.gpu_note)
        return out

    def log_summary(self, summary: dict[str, Any]) -> None:
        """Send a `summary()` to the MLflow run (from the main thread, after stop()).

        Numbers become `telemetry/<key>` metrics, the findings the `telemetry.findings` tag and the text artifact
        `telemetry/findings.txt`, and the CSV (if any) the artifact `telemetry/<csv name>`.
        """
        if self.mlflow_run_id is None:
            raise ValueError("log_summary needs the sampler's mlflow_run_id; this sampler logs to no MLflow run")
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param, RunTag

        client = MlflowClient(self.tracking_uri)
        timestamp = int(time.time() * 1000)
        numbers = {key: value for key, value in summary.items()
                   if isinstance(value, int | float) and not isinstance(value, bool)}
        # How the sampler was set up is a param: a one-point chart of "cores" says nothing
        metrics = [Metric(f"telemetry/{key}", float(value), timestamp, 0) for key, value in numbers.items()
                   if key not in SETUP_KEYS]
        params = [Param(f"telemetry.{key}", str(value)) for key, value in numbers.items() if key in SETUP_KEYS]
        text = "\n".join(summary.get("findings", []))
        tags = [RunTag("telemetry.findings", text[:MLFLOW_TAG_LIMIT])]
        client.log_batch(self.mlflow_run_id, metrics=metrics, params=params, tags=tags, synchronous=True)
        client.log_text(self.mlflow_run_id, text + "\n", "telemetry/findings.txt")
        if self.csv_path is not None and self.csv_path.is_file():
            client.log_artifact(self.mlflow_run_id, str(self.csv_path), "telemetry")
