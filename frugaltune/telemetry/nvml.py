"""The GPUs' readings for the sampler, through NVML: utilisation, memory, power, temperature, SM clock.

Library code, not run directly: `TelemetrySampler` reads one row per sample through `_NvmlReader`.
"""

from __future__ import annotations

import logging
from typing import Any

from frugaltune import hardware

logger = logging.getLogger(__name__)

MB = 2**20  # "MB" here is MiB, as in `frugaltune.training.loop.peak_rss_mb`
GPU_FIELDS = ("utilization_percent", "memory_used_mb", "power_w", "temperature_c", "sm_clock_mhz")


class _NvmlReader:
    """Open NVML handles for the life of a sampler; one read of every GPU field per sample.

    Which GPUs exist, and why there are none, comes from `hardware.nvml_gpus` (the probe stage's logic). A field a
    GPU does not report (power on some virtual GPUs, clocks on MIG slices) is dropped after its first error
    rather than asked for again every second.
    """

    def __init__(self, use_nvml: bool = True):
        self.gpus: list[dict[str, Any]] = []
        self.handles: list[Any] = []
        self._nvml: Any = None
        self._dropped: set[tuple[int, str]] = set()
        self._temperature_v = True
        if not use_nvml:
            self.note: str | None = "no NVIDIA GPU: not sampled (use_nvml=False)"
            return
        gpus, self.note, _driver = hardware.nvml_gpus()
        if not gpus:
            return
        import pynvml

        try:
            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(gpu["index"]) for gpu in gpus]
        except pynvml.NVMLError as exc:
            self.handles = []
            self.note = f"no NVIDIA GPU: NVML failed when opening the devices ({exc})"
            return
        self._nvml, self.gpus = pynvml, gpus

    @property
    def names(self) -> list[str]:
        return [f"gpu_{gpu['index']}_{field}" for gpu in self.gpus for field in GPU_FIELDS]

    def read(self) -> dict[str, float | None]:
        nvml, row = self._nvml, {}
        for gpu, handle in zip(self.gpus, self.handles):
            index = gpu["index"]
            for field in GPU_FIELDS:
                key = f"gpu_{index}_{field}"
                if (index, field) in self._dropped:
                    row[key] = None
                    continue
                try:
                    row[key] = float(self._read_field(nvml, handle, field))
                except Exception as exc:  # noqa: BLE001 an NVMLError, or a binding that does not fit this driver
                    self._dropped.add((index, field))
                    row[key] = None
                    logger.warning("telemetry: GPU %d does not report %s (%s); not sampled any more", index, field,
                                   exc)
        return row

    def _read_field(self, nvml: Any, handle: Any, field: str) -> float:
        if field == "utilization_percent":
            return nvml.nvmlDeviceGetUtilizationRates(handle).gpu
        if field == "memory_used_mb":
            return nvml.nvmlDeviceGetMemoryInfo(handle).used / MB
        if field == "power_w":
            return nvml.nvmlDeviceGetPowerUsage(handle) / 1000  # NVML reports milliwatts
        if field == "temperature_c":
            # nvmlDeviceGetTemperature is deprecated (gone with CUDA 14 drivers); older drivers lack the V form.
            if self._temperature_v:
                try:
                    return nvml.nvmlDeviceGetTemperatureV(handle, nvml.NVML_TEMPERATURE_GPU)
                except (AttributeError, nvml.NVMLError):
                    self._temperature_v = False
            return nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
        if field == "sm_clock_mhz":
            return nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)
        raise KeyError(field)

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError:
                pass
            self._nvml = None
