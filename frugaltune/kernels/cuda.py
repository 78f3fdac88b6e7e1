"""Verify and benchmark the CUDA kernels on a CUDA device, honestly.

- Verification: every case of the grid in the issue, against the fp32 math reference computed from the same
  fp16/bf16 inputs, with the tolerances stated below (they are the rounding of the output dtype plus margin).
- Timing: CUDA events around enough back-to-back calls to last a couple of milliseconds, after warm-up; the median
  of several such measurements. Every figure is turned into TFLOP/s with the algorithmic FLOP count and compared
  with the device's peak computed from its SM count and boost clock; a figure above that peak is a timing error
  (the reference study's "0.72 ms" was twice its GPU's peak) and raises MeasurementError.

The functions take the kernels as plain callables and the timer as an argument, so their logic is unit-tested on
the CPU with the PyTorch references standing in for the kernels.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from frugaltune.kernels.reference import attention_flops, matmul_flops, naive_attention, sgemm_reference

DEVICE = "cuda"  # where the functions below allocate; the unit tests run their logic with "cpu"

# The verification grid of issue 6.
GPU_GRID = {
    "batch": (1, 2, 4, 8),
    "heads": (8, 16, 32),
    "seqlen": (512, 1024, 2048),
    "head_dim": (64, 128),
    "causal": (False, True),
}
ATTN_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# |out - ref| <= atol + rtol * |ref|. The kernel accumulates in fp32, so its error is the final rounding to the
# output dtype (relative 2^-11 for fp16, 2^-8 for bf16) plus accumulation-order noise; the bounds leave ~4x margin.
ATTN_TOLERANCE = {"float16": {"atol": 1e-3, "rtol": 2e-3}, "bfloat16": {"atol": 4e-3, "rtol": 1.6e-2}}
LSE_TOLERANCE = {"atol": 1e-3, "rtol": 1e-4}  # the log-sum-exp is fp32 in the kernel and in the reference
# max |C - C64| / max |C64|; sequential fp32 accumulation over K = 4096 measures ~2e-6.
SGEMM_TOLERANCE = 2e-5
SGEMM_VERIFY_SHAPES = ((33, 68, 12), (128, 128, 128), (1000, 1028, 516), (1024, 1536, 576), (1024, 576, 1536),
                       (2048, 2048, 2048), (4096, 4096, 4096))
SGEMM_BENCH_SHAPES = ((1024, 1536, 576), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096))
ATTN_BENCH_CASES = tuple(
    {"batch": 4, "heads": 16, "seqlen": n, "head_dim": d, "causal": c}
    for n, d, c in itertools.product((1024, 2048), (64, 128), (False, True))
)

# Peak throughput per SM per clock, dense. FP32 on the CUDA cores (FMA = 2 FLOPs); fp16/bf16 inputs on the tensor
# cores with fp32 accumulation (what every attention kernel here does). GeForce parts of the architectures in
# GEFORCE_HALF_RATE run fp32 accumulation at half the rate of the same chip's datacenter/workstation parts.
FP32_FLOPS_PER_SM_CLOCK = {
    (7, 0): 128, (7, 5): 128, (8, 0): 128, (8, 6): 256, (8, 7): 256, (8, 9): 256,
    (9, 0): 256, (10, 0): 256, (10, 3): 256, (12, 0): 256, (12, 1): 256,
}
TENSOR_FP16_FLOPS_PER_SM_CLOCK = {
    (7, 0): 1024, (7, 5): 1024, (8, 0): 2048, (8, 6): 1024, (8, 7): 2048, (8, 9): 1024,
    (9, 0): 4096, (10, 0): 8192, (10, 3): 8192, (12, 0): 1024, (12, 1): 1024,
}

GEFORCE_HALF_RATE = {(7, 5), (8, 6), (8, 9), (12, 0)}


class MeasurementError(Exception):
    """A timing that implies more than the device's peak throughput: the measurement is wrong, not the GPU fast."""


def _per_clock(table: dict[tuple[int, int], int], capability: tuple[int, int]) -> tuple[int, str]:
    if capability in table:
        return table[capability], "table"
    # Unknown part: the largest figure known for its major version (else overall) keeps the peak an upper bound.
    same_major = [v for (major, _), v in table.items() if major == capability[0]]
    return max(same_major or table.values()), "table (nearest known architecture, upper bound)"


def device_peaks(capability: tuple[int, int], sm_count: int, clock_mhz: float, name: str = "") -> dict[str, Any]:
    """Peak TFLOP/s of a device: fp32 (CUDA cores) and fp16/bf16 with fp32 accumulation (tensor cores), at the
    boost clock. `name` (as NVML reports it) tells GeForce parts apart."""
    fp32, source32 = _per_clock(FP32_FLOPS_PER_SM_CLOCK, capability)
    tensor, source16 = _per_clock(TENSOR_FP16_FLOPS_PER_SM_CLOCK, capability)
    if "geforce" in name.lower() and capability in GEFORCE_HALF_RATE:
        tensor //= 2
    scale = sm_count * clock_mhz * 1e6 / 1e12
    return {
        "fp32_tflops": round(fp32 * scale, 2),
        "fp16_tensor_tflops": round(tensor * scale, 2),
        "sm_count": sm_count,
        "clock_mhz": clock_mhz,
        "source": source32 if source32 == source16 else f"{source32}; {source16}",
    }


def check_peak(tflops: float, peak_tflops: float, what: str) -> None:
    if tflops > peak_tflops:
        raise MeasurementError(
            f"{what}: {tflops:.1f} TFLOP/s exceeds the device peak of {peak_tflops:.1f} TFLOP/s. The timing is "
            "wrong (an unsynchronised timer, a skipped launch, or a FLOP count for work not done), not the kernel "
            "fast."
        )


def cuda_timer(warmup: int = 3, repeats: int = 7, target_ms: float = 2.0) -> Callable[[Callable[[], Any]], float]:
    """A timer: ms per call of `fn`, measured with CUDA events; median of `repeats` measurements."""

    def time_ms(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        # Enough back-to-back calls per measurement that launch latency and event resolution do not matter.
        calls = max(1, min(1000, math.ceil(target_ms / max(start.elapsed_time(end), 1e-3))))
        samples = []
        for _ in range(repeats):
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        return statistics.median(samples)

    return time_ms


# ---- flash attention ---------------------------------------------------------------------------------------------
AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """fp32 math reference, one batch element at a time to bound the memory of the score matrix."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        out, lse = naive_attention(q[b : b + 1].float(), k[b : b + 1].float(), v[b : b + 1].float(), causal)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def verify_attention(
    attn: AttnFn, grid: dict[str, tuple] | None = None, dtypes: dict[str, torch.dtype] | None = None, seed: int = 0
) -> dict[str, Any]:
    """Run `attn` over the grid (default GPU_GRID) in every dtype and compare with the fp32 reference."""
    grid, dtypes, device = grid or GPU_GRID, dtypes or ATTN_DTYPES, DEVICE
    generator = torch.Generator(device=device).manual_seed(seed)
    per_dtype: dict[str, Any] = {}
    failures: list[dict[str, Any]] = []
    for dtype_name, dtype in dtypes.items():
        tol = ATTN_TOLERANCE[dtype_name]
        worst = {"max_abs_err": 0.0, "mean_rel_err": 0.0, "lse_max_abs_err": 0.0}
        cases = 0
        for batch, heads, seqlen, head_dim, causal in itertools.product(*grid.values()):
            shape = (batch, heads, seqlen, head_dim)
            q, k, v = (torch.randn(shape, generator=generator, device=device).to(dtype) for _ in range(3))
            out, lse = attn(q, k, v, causal)
            ref_out, ref_lse = _reference_attention(q, k, v, causal)
            diff = (out.float() - ref_out).abs()
            lse_diff = (lse.float() - ref_lse).abs()
            ok = bool((diff <= tol["atol"] + tol["rtol"] * ref_out.abs()).all()) and bool(
                (lse_diff <= LSE_TOLERANCE["atol"] + LSE_TOLERANCE["rtol"] * ref_lse.abs()).all()
            )
            errors = {
                "max_abs_err": diff.max().item(),
                "mean_rel_err": (diff.mean() / ref_out.abs().mean()).item(),
                "lse_max_abs_err": lse_diff.max().item(),
            }
            worst = {key: max(worst[key], errors[key]) for key in worst}
            cases += 1
            if not ok or not all(math.isfinite(x) for x in errors.values()):
                failures.append({"dtype": dtype_name, "batch": batch, "heads": heads, "seqlen": seqlen,
                                 "head_dim": head_dim, "causal": causal, **errors})
            del q, k, v, out, lse, ref_out, ref_lse, diff, lse_diff
        per_dtype[dtype_name] = {"cases": cases, "tolerance": tol, **worst}
    return {
        "status": "passed" if not failures else "failed",
        "against": "fp32 math attention on the same fp16/bf16 inputs",
        "grid": {key: list(values) for key, values in grid.items()},
        "lse_tolerance": LSE_TOLERANCE,
        "dtypes": per_dtype,
        "failures": failures[:20],
        "failed_cases": len(failures),
    }


def _naive_attention_timed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def benchmark_attention(
    attn: AttnFn, peaks: dict[str, Any], timer: Callable, cases: tuple[dict[str, Any], ...] | None = None,
    dtypes: dict[str, torch.dtype] | None = None,
) -> list[dict[str, Any]]:
    """ms, TFLOP/s and % of peak for the kernel, SDPA's flash backend and a naive materialised attention.

    The kernel runs on the CUDA cores, so its ceiling is the fp32 peak; SDPA and the naive version use the tensor
    cores, so theirs is the fp16/bf16 tensor peak. Each figure is checked against its ceiling.
    """
    cases, dtypes, device = cases or ATTN_BENCH_CASES, dtypes or ATTN_DTYPES, DEVICE
    rows = []
    for dtype_name, dtype in dtypes.items():
        for case in cases:
            shape = (case["batch"], case["heads"], case["seqlen"], case["head_dim"])
            q, k, v = (torch.randn(shape, device=device).to(dtype) for _ in range(3))
            mask = torch.ones(shape[2], shape[2], dtype=torch.bool, device=device).triu(1) if case["causal"] else None
            flops = attention_flops(*shape, causal=case["causal"])
            impls = {
                "frugaltune": (lambda: attn(q, k, v, case["causal"]), "fp32_tflops"),
                "sdpa_flash": (lambda: sdpa_flash(q, k, v, case["causal"]), "fp16_tensor_tflops"),
                "naive": (lambda: _naive_attention_timed(q, k, v, mask), "fp16_tensor_tflops"),
            }
            row: dict[str, Any] = {"dtype": dtype_name, **case, "gflop": round(flops / 1e9, 3)}
            for name, (fn, peak_key) in impls.items():
                try:
                    ms = timer(fn)
                except RuntimeError as exc:  # e.g. the flash backend does not support this GPU or shape
                    row[name] = {"status": f"unavailable: {str(exc).splitlines()[0][:200]}"}
                    continue
                tflops = flops / (ms * 1e-3) / 1e12
                check_peak(tflops, peaks[peak_key], f"{name} attention {dtype_name} {case}")
                row[name] = {"ms": round(ms, 4), "tflops": round(tflops, 2),
                             "pct_of_peak": round(100 * tflops / peaks[peak_key], 1), "peak": peak_key}
            rows.append(row)
    return rows


# ---- sgemm -------------------------------------------------------------------------------------------------------
SgemmFn = Callable[..., torch.Tensor]  # sgemm(a, b, c, alpha, beta, config) -> C


def verify_sgemm(sgemm: SgemmFn, configs: list[list[int]], shapes=None, seed: int = 0) -> dict[str, Any]:
    """Every tile configuration on every shape, with alpha = 1.5 and beta = 0.5 (reads C) and beta = 0 (must not)."""
    shapes, device = shapes or SGEMM_VERIFY_SHAPES, DEVICE
    generator = torch.Generator(device=device).manual_seed(seed)
    failures, worst, cases = [], 0.0, 0
    for m, n, k in shapes:
        a = torch.randn(m, k, generator=generator, device=device)
        b = torch.randn(k, n, generator=generator, device=device)
        c0 = torch.randn(m, n, generator=generator, device=device)
        for (alpha, beta), (index, tile) in itertools.product(((1.5, 0.5), (1.0, 0.0)), enumerate(configs)):
            c = c0.clone() if beta != 0 else torch.full_like(c0, float("nan"))  # NaN: beta = 0 must ignore C
            out = sgemm(a, b, c, alpha, beta, index)
            ref = sgemm_reference(a, b, c0, alpha, beta)
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            worst = max(worst, err) if math.isfinite(err) else math.inf
            cases += 1
            if not err <= SGEMM_TOLERANCE:  # also catches NaN
                failures.append({"shape": [m, n, k], "tile": tile, "alpha": alpha, "beta": beta, "rel_err": err})
    return {
        "status": "passed" if not failures else "failed",
        "against": "float64 matmul (alpha * A @ B + beta * C)",
        "tolerance": {"max_abs_err / max_abs_ref": SGEMM_TOLERANCE},
        "shapes": [list(s) for s in shapes],
        "configs": configs,
        "cases": cases,
        "max_rel_err": worst,
        "failures": failures[:20],
    }


def benchmark_sgemm(
    sgemm: SgemmFn, configs: list[list[int]], peaks: dict[str, Any], timer: Callable, shapes=None
) -> dict[str, Any]:
    """Autotune: time every tile configuration per shape, keep the best, compare with torch.matmul (cuBLAS fp32)."""
    shapes, device = shapes or SGEMM_BENCH_SHAPES, DEVICE
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # cuBLAS in true fp32, as the kernel; TF32 is a different problem
    rows = []
    try:
        for m, n, k in shapes:
            a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
            c = torch.empty(m, n, device=device)
            flops = matmul_flops(m, n, k)

            def figures(ms: float, what: str) -> dict[str, Any]:
                tflops = flops / (ms * 1e-3) / 1e12
                check_peak(tflops, peaks["fp32_tflops"], what)
                return {"ms": round(ms, 4), "tflops": round(tflops, 2),
                        "pct_of_peak": round(100 * tflops / peaks["fp32_tflops"], 1)}

            tiles = []
            for index, tile in enumerate(configs):
                ms = timer(lambda: sgemm(a, b, c, 1.0, 0.0, index))
                tiles.append({"tile": tile, **figures(ms, f"sgemm {tile} on {m}x{n}x{k}")})
            best = min(tiles, key=lambda t: t["ms"])
            cublas = figures(timer(lambda: torch.matmul(a, b, out=c)), f"torch.matmul on {m}x{n}x{k}")
            rows.append({"shape": [m, n, k], "gflop": round(flops / 1e9, 3), "best_tile": best["tile"],
                         "frugaltune": {k_: v for k_, v in best.items() if k_ != "tile"}, "torch_matmul": cublas,
                         "tiles": tiles})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    # The autotuned choice: the tile that wins on the largest shape (the most representative of compute-bound use).
    return {"peak": "fp32_tflops", "tf32": False, "autotuned_tile": rows[-1]["best_tile"] if rows else None,
            "shapes": rows}


def attention_at_model_shapes(
    attn: AttnFn, shapes: dict[str, int], timer: Callable, dtypes: dict[str, torch.dtype] | None = None,
    min_speedup: float = 1.1,
) -> dict[str, Any]:
    """The kernel against SDPA with its default backend choice (what transformers' `sdpa` runs) at the model's
    attention shape; `faster` is true only when the kernel is at least `min_speedup` times as fast in every dtype.

    The margin matters: at the default model's shape both are launch-bound microsecond kernels whose ratio moves
    between processes (docs/DECISIONS.md, "On a lent GPU"), so a bare `> 1` would flip the choice from run to run."""
    dtypes, device = dtypes or ATTN_DTYPES, DEVICE
    shape = (shapes["batch"], shapes["heads"], shapes["seq_len"], shapes["head_dim"])
    rows = {}
    for dtype_name, dtype in dtypes.items():
        q, k, v = (torch.randn(shape, device=device).to(dtype) for _ in range(3))
        ours = timer(lambda: attn(q, k, v, True))
        sdpa = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        rows[dtype_name] = {
            "frugaltune_ms": round(ours, 4), "sdpa_ms": round(sdpa, 4), "speedup": round(sdpa / ours, 3),
        }
    return {"shape": dict(zip(("batch", "heads", "seq_len", "head_dim"), shape, strict=True)), "causal": True,
            "dtypes": rows, "min_speedup": min_speedup,
            "faster": all(r["speedup"] >= min_speedup for r in rows.values())}
