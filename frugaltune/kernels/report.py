"""What the kernels stage measures on this machine, as reports/kernels.json.

Library code, run by the `kernels` stage (`python -m stages.kernels`, the root dvc.yaml: once per machine; the
other pipelines read its report). `build_report` decides by the machine:

- CUDA device and a CUDA build of torch: build the torch extension for the device's architecture, verify both
  kernels over the grid of issue 6, benchmark them against PyTorch, and mark the attention `used` when it is
  verified and faster than SDPA at the model's shapes.
- No CUDA device, nvcc present (CPU machines, CI): compile each kernel for `kernels.archs` and record the ptxas
  figures (registers, shared memory, spills) per instantiation; the kernels are built, not run. Their logic is
  checked on the CPU by the emulator in the unit tests, or by hand: `python -m frugaltune.kernels.emulate`.
- No nvcc: the CUDA kernels are recorded as skipped.

On every machine the tiled reference attention is checked against SDPA in fp32, and the CPU attention and matmul
backends are verified and timed in fp32 and bf16 at the model's shapes: `cpu` is what the planner reads. A failed
build or verification is recorded, never raised; a benchmark figure above the device's peak is a measurement error.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from frugaltune.kernels import build, cpu

if TYPE_CHECKING:
    from frugaltune.config import KernelsParams

# Where the kernels' code is checked without a GPU: an emulation costs minutes of CPU on every machine that
# cannot run the kernels anyway, so it lives in the tests and behind one command, not in the pipeline.
EMULATOR = "their logic: tests/unit/test_kernels.py, or `python -m frugaltune.kernels.emulate`"
FALLBACK = "training and evaluation use PyTorch's kernels (torch.matmul, scaled_dot_product_attention)"


def skipped(reason: str) -> dict[str, Any]:
    """The record of a kernel that was not built."""
    return {
        "build": {"status": "skipped", "reason": reason},
        "verify": {"status": "not run", "reason": reason},
        "benchmark": {"status": "not run", "reason": reason},
        "used": False,
        "reason": f"{reason}; {FALLBACK}",
    }


def compile_only(archs: list[str], build_root: Path, nvcc: str) -> dict[str, Any]:
    """No CUDA device: compile every kernel for every arch with nvcc and keep the ptxas figures. Nothing runs: the
    kernels' logic is checked on the CPU by the unit tests (tests/unit/test_kernels.py runs the emulator), not by
    every pipeline run on every machine."""
    kernels = {}
    for kernel in build.KERNEL_SOURCES:
        per_arch: dict[str, Any] = {}
        for arch in archs:
            try:
                record = build.compile_cubin(kernel, arch, build_root, nvcc)
                per_arch[arch] = {"status": "built", **{k: record[k] for k in ("seconds", "cached", "functions")}}
            except (build.BuildError, OSError, ValueError) as exc:
                per_arch[arch] = {"status": "failed", "error": str(exc)}
        ok = all(entry["status"] == "built" for entry in per_arch.values())
        not_run = "no CUDA device on this machine: built, not run"
        kernels[kernel] = {
            "build": {"status": "built" if ok else "failed", "nvcc": build.nvcc_version(nvcc), "archs": per_arch},
            "verify": {"status": "not run", "reason": f"{not_run} ({EMULATOR})"},
            "benchmark": {"status": "not run", "reason": not_run},
            "used": False,
            "reason": f"{'built' if ok else 'build failed'}, not run (no CUDA device); {FALLBACK}",
        }
    return kernels


def usable_cuda_device(hw: dict[str, Any]) -> str | None:
    """None when the CUDA kernels can run here, else why not."""
    if not hw.get("gpus"):
        return hw.get("gpu_note") or "no NVIDIA GPU"
    if not torch.cuda.is_available():
        return f"an NVIDIA GPU is present but torch {torch.__version__} cannot use it (CPU build or driver mismatch)"
    return None


def on_cuda(hw: dict[str, Any], kp: KernelsParams, build_root: Path, device: dict[str, Any]) -> dict[str, Any]:
    """CUDA device present: build for it, verify, benchmark. Fills `device` (name, arch, peaks) first.

    Raises frugaltune.kernels.cuda.MeasurementError when a timing exceeds the device's peak.
    """
    from frugaltune.kernels import cuda

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    arch = f"sm_{props.major}{props.minor}"
    nvml = next((g for g in hw["gpus"] if g.get("name") == props.name), hw["gpus"][0])
    # The boost clock: the larger of NVML's and the driver's figure, so the peak stays an upper bound.
    clock_mhz = max(nvml.get("max_sm_clock_mhz") or 0, getattr(props, "clock_rate", 0) / 1000)
    peaks = cuda.device_peaks((props.major, props.minor), props.multi_processor_count, clock_mhz, props.name)
    device.update({"name": props.name, "arch": arch, "peaks": peaks})

    nvcc = build.find_nvcc()
    ptxas: dict[str, Any] = {}
    for kernel in build.KERNEL_SOURCES:
        try:
            ptxas[kernel] = build.compile_cubin(kernel, arch, build_root, nvcc)["functions"] if nvcc else None
        except (build.BuildError, OSError) as exc:
            ptxas[kernel] = {"error": str(exc)}
    try:
        ext, ext_record = build.load_extension(arch, build_root)
    except Exception as exc:  # compiler, ninja or CUDA-version problems: all of them are "build failed"
        kernels = {}
        for kernel in build.KERNEL_SOURCES:
            kernels[kernel] = skipped(f"torch extension build failed for {arch}")
            kernels[kernel]["build"] = {"status": "failed", "arch": arch, "error": str(exc)[-3000:],
                                        "ptxas": ptxas[kernel]}
        return kernels
    built = {"status": "built", "arch": arch, **ext_record}
    timer = cuda.cuda_timer()

    def flash(q, k, v, causal):
        out, lse = ext.flash_attn_fwd(q, k, v, causal)
        return out, lse

    def sgemm(a, b, c, alpha, beta, config):
        return ext.sgemm(a, b, c, alpha, beta, config)

    # flash_attn_fwd: used for evaluation when verified and kernels.cuda_min_speedup x SDPA at the model's shapes.
    shapes = {"batch": kp.bench_batch, "heads": kp.model_heads, "seq_len": kp.bench_seq_len,
              "head_dim": kp.model_hidden // kp.model_heads}
    attn: dict[str, Any] = {"build": {**built, "ptxas": ptxas["flash_attn_fwd"]}}
    attn["verify"] = guarded(lambda: cuda.verify_attention(flash))
    attn["benchmark"] = guarded(
        lambda: {"status": "done", "cases": cuda.benchmark_attention(flash, peaks, timer),
                 "model_shapes": cuda.attention_at_model_shapes(flash, shapes, timer, min_speedup=kp.cuda_min_speedup)},
        when=attn["verify"]["status"] == "passed",
    )
    faster = attn["benchmark"].get("model_shapes", {}).get("faster", False)
    attn["used"] = attn["verify"]["status"] == "passed" and faster
    attn["reason"] = (
        f"verified, and >= {kp.cuda_min_speedup}x SDPA at the model's shapes: evaluation may register it as its "
        "attention"
        if attn["used"] else f"verify {attn['verify']['status']}, benchmark {attn['benchmark']['status']}, "
        f">= {kp.cuda_min_speedup}x SDPA at the model's shapes: {faster}; {FALLBACK}"
    )
    # sgemm: verified and autotuned as a reference point; training's matmuls stay on cuBLAS.
    configs = [list(c) for c in ext.sgemm_configs()]
    gemm: dict[str, Any] = {"build": {**built, "ptxas": ptxas["sgemm"]}}
    gemm["verify"] = guarded(lambda: cuda.verify_sgemm(sgemm, configs))
    gemm["benchmark"] = guarded(
        lambda: {"status": "done", **cuda.benchmark_sgemm(sgemm, configs, peaks, timer)},
        when=gemm["verify"]["status"] == "passed",
    )
    gemm["used"] = False
    gemm["reason"] = (f"verify {gemm['verify']['status']}, benchmark {gemm['benchmark']['status']}; training's "
                      "matmuls stay on torch.matmul (cuBLAS)")
    return {"flash_attn_fwd": attn, "sgemm": gemm}


def guarded(step, when: bool = True) -> dict[str, Any]:
    """Run a verification or benchmark step. A crash (illegal address, launch failure, out of memory) is recorded
    as a failed step, never a failed stage; only a MeasurementError (a figure above peak) goes through."""
    from frugaltune.kernels.cuda import MeasurementError

    if not when:
        return {"status": "not run", "reason": "verification did not pass"}
    try:
        return step()
    except MeasurementError:
        raise
    except Exception as exc:
        return {"status": "failed", "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}


def cpu_precision(kp: KernelsParams, hw: dict[str, Any], seed: int) -> dict[str, Any]:
    """fp32 against bf16 (and SDPA against eager attention in training) at the model's shapes on this CPU: the
    `cpu` section the planner reads (planner.machine.measured_on, recommend_precision, eager_attention_max_len)."""
    shapes = cpu.ModelShapes(kp.bench_batch, kp.bench_seq_len, kp.model_hidden, kp.model_heads, kp.model_intermediate)
    ops = cpu.measure_precisions(shapes, repeats=kp.timing_repeats, seed=seed)
    choice = cpu.choose_precision(ops, kp.bf16_min_speedup)
    flags = hw.get("cpu", {}).get("flags", {})
    return {
        **choice,
        "threads": torch.get_num_threads(),
        "native_bf16": bool(flags.get("avx512_bf16") or flags.get("amx_bf16")),
        "ops": ops,
        # fwd + bwd of training attention, SDPA vs eager per sequence length: the plan's eager_attention_max_len
        "training_attention": cpu.measure_training_attention(shapes, min_speedup=kp.bf16_min_speedup, seed=seed),
    }


def summarize(mode: str, kernels: dict[str, Any], archs: list[str], cpu_report: dict[str, Any]) -> str:
    """The report's one-line `summary`: what was built, verified and used, the fallback, the CPU's precision."""
    used = [name for name, k in kernels.items() if k.get("used")]
    if mode == "cuda":
        status = ", ".join(
            f"{name}: build {k['build']['status']}, verify {k['verify']['status']}" for name, k in kernels.items()
        )
        cuda_line = f"CUDA kernels on this device: {status}; used: {', '.join(used) or 'none'}."
    elif mode == "nvcc":
        ok = all(k["build"]["status"] == "built" for k in kernels.values())
        cuda_line = (f"CUDA kernels {'built' if ok else 'NOT all built'} for {', '.join(archs)} and not run: this "
                     "machine has no usable CUDA device.")
    else:
        cuda_line = f"CUDA kernels skipped: {next(iter(kernels.values()))['build']['reason']}."
    fallback = "" if used else f" {FALLBACK[0].upper()}{FALLBACK[1:]}."
    return (f"{cuda_line}{fallback} CPU: {cpu_report['preferred_precision']} preferred "
            f"(bf16 {cpu_report['bf16_speedup']}x fp32 per layer).")


def build_report(kp: KernelsParams, hw: dict[str, Any], build_root: Path, seed: int) -> tuple[dict[str, Any], str | None]:
    """The report for this machine (`hw`: reports/hardware.json) and the error that must fail the stage, if any (a
    timing above the device's peak: written to the report first, so it can be read)."""
    report: dict[str, Any] = {"mode": None, "summary": None, "device": None}
    error: str | None = None
    archs = list(kp.archs)
    nvcc = build.find_nvcc()
    no_cuda = usable_cuda_device(hw)
    if no_cuda is not None:
        report["device"] = {"cuda": False, "reason": no_cuda}
    if not kp.enabled:
        mode, kernels = "disabled", {k: skipped("kernels.enabled is false") for k in build.KERNEL_SOURCES}
    elif no_cuda is None:
        from frugaltune.kernels.cuda import MeasurementError

        mode, report["device"] = "cuda", {"cuda": True}
        try:
            kernels = on_cuda(hw, kp, build_root, report["device"])
        except MeasurementError as exc:
            error = f"kernels: measurement error: {exc}"
            kernels = {k: skipped(f"benchmark aborted: {exc}") for k in build.KERNEL_SOURCES}
        archs = [report["device"].get("arch", "?")]
    elif nvcc is None:
        mode, kernels = "no-nvcc", {k: skipped("nvcc not found") for k in build.KERNEL_SOURCES}
    else:
        mode = "nvcc"
        # A GPU that this torch cannot drive still deserves a build for its own architecture.
        archs += [g["arch"] for g in hw.get("gpus", []) if g.get("arch") and g["arch"] not in archs]
        kernels = compile_only(archs, build_root, nvcc)
    report["mode"] = mode
    report["kernels"] = kernels
    report["reference"] = {"tiled_attention_vs_sdpa": cpu.verify_tiled_reference(seed=seed)}
    # The CPU it was measured on: the plan uses the measurement only on that same CPU (planner.machine.measured_on).
    report["cpu"] = {**cpu_precision(kp, hw, seed), "cpu_model": hw.get("cpu", {}).get("model")}
    report["summary"] = error or summarize(mode, kernels, archs, report["cpu"])
    return report, error
