"""Stable hardware facts: CPU, RAM, torch build, NVIDIA GPUs (through NVML).

`probe()` returns the dictionary that `stages/probe.py` writes to `reports/hardware.json`. Only facts that stay
the same from one run to the next on one machine go in (model names, core counts, flags, totals, capabilities),
never free memory or load: other stages depend on that file, and a volatile reading would rerun them for nothing.

    from frugaltune.hardware import probe
    hw = probe()   # whether bf16 pays off here is measured, not read from these flags: planner.machine
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# CPU flags that decide the fast paths: avx512_bf16 / amx_bf16 make bf16 matmuls native on the CPU.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
CPUINFO = Path("/proc/cpuinfo")
# Read this file instead of /proc/cpuinfo: how a test plays another machine (the probe stage documents it).
CPUINFO_ENV = "FRUGALTUNE_CPUINFO"


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """Model name, core counts and the flags of interest from the text of /proc/cpuinfo.

    The model is the CPU's name with its x86 family and model numbers, "AMD EPYC (family 26 model 2)": a virtual
    machine often shows one generic name for CPUs of several generations, whose bf16 and int8 speeds differ several
    times over, and the model is what tells the kernels stage and the plan that their measurements describe another
    CPU (frugaltune.planner.machine.measured_on, frugaltune.resolve.read_plan).

    Physical cores are the distinct (physical id, core id) pairs; where the kernel does not list them (some VMs,
    ARM) they are None and `cpu_facts` falls back to psutil.
    """
    processors = [block for block in text.split("\n\n") if block.strip()]
    model = family = number = None
    flags: set[str] = set()
    cores: set[tuple[str, str]] = set()
    logical = 0
    for block in processors:
        fields: dict[str, str] = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if "processor" not in fields:
            continue
        logical += 1
        model = model or fields.get("model name") or fields.get("Hardware") or fields.get("cpu model")
        family, number = family or fields.get("cpu family"), number or fields.get("model")
        flags.update((fields.get("flags") or fields.get("Features") or "").split())
        if "physical id" in fields and "core id" in fields:
            cores.add((fields["physical id"], fields["core id"]))
    if model and family and number:
        model = f"{model} (family {family} model {number})"
    return {
        "model": model,
        "logical_cores": logical or None,
        "physical_cores": len(cores) or None,
        "flags": {flag: flag in flags for flag in CPU_FLAGS},
    }


def cpu_facts(cpuinfo_text: str | None = None) -> dict[str, Any]:
    """CPU model, cores (physical, logical, usable by this process) and flags."""
    import psutil

    if cpuinfo_text is None:
        source = Path(os.environ.get(CPUINFO_ENV) or CPUINFO)
        if os.environ.get(CPUINFO_ENV) and not source.is_file():
            raise FileNotFoundError(f"{CPUINFO_ENV}={source}: no such file (unset it to read {CPUINFO})")
        cpuinfo_text = source.read_text(encoding="utf-8", errors="replace") if source.is_file() else ""
    parsed = parse_cpuinfo(cpuinfo_text)
    logical = parsed["logical_cores"] or psutil.cpu_count(logical=True)
    return {
        "model": parsed["model"] or platform.processor() or platform.machine() or "unknown",
        "arch": platform.machine(),
        "physical_cores": parsed["physical_cores"] or psutil.cpu_count(logical=False) or logical,
        "logical_cores": logical,
        # The cores this process may run on (a container or taskset can allow fewer than the machine has).
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical,
        "flags": parsed["flags"],
    }


def memory_facts() -> dict[str, Any]:
    """Total RAM, and the cgroup (container) memory limit when one is set: the planner must respect the lower."""
    import psutil

    total = psutil.virtual_memory().total
    limit = None
    for path in (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")):
        if path.is_file():
            raw = path.read_text().strip()
            if raw.isdigit() and int(raw) < total:
                limit = int(raw)
            break
    return {"total_bytes": total, "cgroup_limit_bytes": limit}


def torch_facts() -> dict[str, Any]:
    """torch version and build: `cuda <version>` or `cpu`, and the CPU instruction set its kernels use."""
    import torch

    return {
        "version": torch.__version__,
        "build": f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu",
        "cuda_available": torch.cuda.is_available(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def nvml_gpus() -> tuple[list[dict[str, Any]], str | None, dict[str, Any] | None]:
    """NVIDIA GPUs through NVML: (gpus, note, driver). `note` says why the list is empty; None when it is not."""
    try:
        import pynvml
    except ImportError:
        return [], "no NVIDIA GPU: nvidia-ml-py (pynvml) is not installed", None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], f"no NVIDIA GPU: NVML unavailable ({exc}); no NVIDIA driver on this machine", None
    try:
        driver = {
            "version": _text(pynvml.nvmlSystemGetDriverVersion()),
            "cuda_version": _cuda_version(pynvml.nvmlSystemGetCudaDriverVersion()),
        }
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            try:
                max_sm_clock = int(pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM))
            except pynvml.NVMLError:  # not reported by some virtual GPUs / MIG instances
                max_sm_clock = None
            gpus.append(
                {
                    "index": index,
                    "name": _text(pynvml.nvmlDeviceGetName(handle)),
                    "memory_total_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    "compute_capability": f"{major}.{minor}",
                    "arch": f"sm_{major}{minor}",
                    "max_sm_clock_mhz": max_sm_clock,
                }
            )
    except pynvml.NVMLError as exc:
        return [], f"no NVIDIA GPU: NVML query failed ({exc})", None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    if not gpus:
        return [], "no NVIDIA GPU: NVML reports 0 devices", driver
    return gpus, None, driver


def _cuda_version(encoded: int) -> str:
    """NVML encodes CUDA 12.4 as 12040."""
    return f"{encoded // 1000}.{(encoded % 1000) // 10}"


def probe(use_nvml: bool = True, cpuinfo_text: str | None = None) -> dict[str, Any]:
    """All stable facts, in the layout of reports/hardware.json."""
    if use_nvml:
        gpus, note, driver = nvml_gpus()
    else:
        gpus, note, driver = [], "no NVIDIA GPU: not probed (probe.nvml is false)", None
    return {
        "cpu": cpu_facts(cpuinfo_text),
        "memory": memory_facts(),
        "platform": {"system": platform.system(), "python": platform.python_version()},
        "torch": torch_facts(),
        "gpus": gpus,
        "gpu_note": note,
        "nvidia_driver": driver,
    }


def cpu_clock_hz() -> tuple[float, str]:
    """The CPU's rated clock: cpufreq's maximum when the kernel exposes it, else /proc/cpuinfo's `cpu MHz`.

    Volatile on machines that scale frequency, so it stays out of reports/hardware.json; benchmarks read it live.
    """
    cpufreq = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    if cpufreq.is_file():
        return int(cpufreq.read_text().strip()) * 1e3, "cpufreq cpuinfo_max_freq"
    for line in CPUINFO.read_text(errors="replace").splitlines() if CPUINFO.is_file() else []:
        if line.lower().startswith("cpu mhz"):
            return float(line.split(":", 1)[1]) * 1e6, "/proc/cpuinfo cpu MHz"
    return 0.0, "unknown"


def cpu_flops_per_cycle(hw: dict[str, Any]) -> tuple[int, str]:
    """fp32 FLOPs per cycle per core: 2 (FMA) x SIMD lanes x FMA units.

    AVX-512: 16 fp32 lanes; Intel server cores have 2 FMA units (64), AMD Zen 4 runs 512-bit ops on two 256-bit
    pipes (32). AVX2: 8 lanes x 2 units (32). Without either: 8 (SSE, 2 units).
    """
    cpu = hw.get("cpu", {})
    flags = cpu.get("flags", {})
    amd = "amd" in str(cpu.get("model", "")).lower()
    if flags.get("avx512f"):
        return (32, "AVX-512 on 2x256-bit pipes (Zen 4): 2 FMA x 16 lanes") if amd else (
            64, "AVX-512: 2 FMA units x 16 fp32 lanes x 2 FLOPs")
    if flags.get("avx2"):
        return 32, "AVX2: 2 FMA units x 8 fp32 lanes x 2 FLOPs"
    return 8, "SSE: 2 units x 4 lanes"


def cpu_peak_flops(hw: dict[str, Any], cores: int | None = None) -> tuple[float, str]:
    """fp32 peak of the cores training uses: cores x clock x FLOPs/cycle, with the formula spelled out."""
    cores = cores or hw.get("cpu", {}).get("physical_cores") or os.cpu_count() or 1
    clock, clock_source = cpu_clock_hz()
    per_cycle, why = cpu_flops_per_cycle(hw)
    peak = cores * clock * per_cycle
    return peak, (f"{cores} cores x {clock / 1e9:.2f} GHz ({clock_source}) x {per_cycle} FLOPs/cycle ({why}) "
                  f"= {peak / 1e9:.0f} GFLOP/s")
