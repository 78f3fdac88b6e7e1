"""The bottleneck findings: plain sentences from a telemetry summary's numbers (`bottleneck_findings`).

Library code, not run directly: `TelemetrySampler.summary` calls it.
"""

from __future__ import annotations

from typing import Any

# The thresholds of the findings, in one visible place.
DATA_STARVED_SHARE = 0.10  # data wait above this share of step time: the loader starves the model
GPU_BUSY_LOW_PERCENT = 40.0
CPU_BUSY_LOW_SHARE = 0.60  # process CPU below this share of 100% x cores (CPU training only)
SWAP_GROWTH_MB = 32.0  # system swap grew by more than this during training
NO_GPU_FINDING = "no NVIDIA GPU: telemetry covers CPU and RAM only"


def bottleneck_findings(summary: dict[str, Any], gpu_note: str | None = None) -> list[str]:
    """Plain-sentence findings from summary numbers (the keys `TelemetrySampler.summary` writes).

    Rules: data wait above 10% of step time; system swap grew; a GPU under 40% busy; with no GPU, the process
    keeping under 60% of its cores busy; no GPU at all. When none of the first four fire, one line says so.
    """
    findings: list[str] = []
    data_share = summary.get("data_share")
    if data_share is not None and data_share > DATA_STARVED_SHARE:
        findings.append(
            f"data loader starved the model {data_share:.0%} of the time "
            f"({summary.get('data_mean_ms', 0):.1f} ms of {summary.get('step_time_mean_ms', 0):.1f} ms per step "
            "building batches): pre-tokenize, cache or simplify the collate, or use DataLoader workers"
        )
    swap_growth = summary.get("swap_growth_mb")
    if swap_growth is not None and swap_growth > SWAP_GROWTH_MB:
        findings.append(
            f"swapping: {swap_growth:.0f} MB of swap used during training (peak {summary.get('swap_peak_mb', 0):.0f} "
            "MB): memory is short; lower the micro-batch or sequence length, or use gradient checkpointing"
        )
    gpu_count = summary.get("gpu_count", 0)
    for i in range(gpu_count):
        busy = summary.get(f"gpu_{i}_busy_mean_percent")
        if busy is not None and busy < GPU_BUSY_LOW_PERCENT:
            findings.append(f"GPU {i} under {GPU_BUSY_LOW_PERCENT:.0f}% busy (mean {busy:.0f}% utilisation): "
                            "it waits on the CPU or the data; a larger micro-batch usually helps")
    cpu_share = summary.get("cpu_busy_share")
    if not gpu_count and cpu_share is not None and summary.get("samples", 0) > 0 and cpu_share < CPU_BUSY_LOW_SHARE:
        cores = summary.get("cores", 1)
        findings.append(
            f"CPU under {CPU_BUSY_LOW_SHARE:.0%} of available cores busy: the process kept {cpu_share * cores:.1f} "
            f"of {cores} cores busy on average ({cpu_share:.0%}); other load on the machine, too few torch threads "
            "or single-threaded Python (data, logging) hold it back"
        )
    if not findings:
        parts = []
        if cpu_share is not None:
            parts.append(f"CPU {cpu_share:.0%} of {summary.get('cores', 1)} cores busy")
        if summary.get("gpu_busy_mean_percent") is not None:
            parts.append(f"GPU {summary['gpu_busy_mean_percent']:.0f}% busy")
        if data_share is not None:
            parts.append(f"data wait {data_share:.0%} of step time")
        if swap_growth is not None:
            parts.append("no swapping")
        findings.append("no bottleneck found" + (": " + ", ".join(parts) if parts else ""))
    if not gpu_count:
        reason = (gpu_note or "").removeprefix("no NVIDIA GPU:").strip()
        findings.append(NO_GPU_FINDING + (f"; {reason}" if reason else ""))
    return findings
