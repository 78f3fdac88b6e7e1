"""CPU backends: check the tiled reference against SDPA, and measure fp32 against bf16 at the model's shapes.

Both run on every machine. The precision measurement is what the planner and `train.precision: auto` read: bf16 is
"supported" on any x86 CPU, but only CPUs with avx512_bf16 / AMX run it natively; elsewhere it is emulated and
slower than fp32. Measuring settles it for this machine instead of trusting the flags.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from frugaltune.kernels.reference import naive_attention, tiled_attention

# Scaled-down grid for the CPU check of the tiled reference (the GPU grid is in kernels/cuda.py). Sequence
# lengths that are not multiples of the 32-wide tiles exercise the ragged last tile.
REFERENCE_GRID = {
    "batch": (1, 2), "heads": (2, 3), "seqlen": (32, 77, 128), "head_dim": (64, 128), "causal": (False, True),
}
REFERENCE_TOLERANCE = 1e-5  # max |tiled - SDPA| in fp32, on the output and on the log-sum-exp

# Tolerances of the CPU backends against the float64 math reference on the same (already rounded) inputs:
# |out - ref| <= atol + rtol * |ref| elementwise. bf16 keeps 8 significant bits (relative rounding up to 2^-8 = 0.004).
BACKEND_TOLERANCE = {"fp32": {"atol": 1e-5, "rtol": 1e-5}, "bf16": {"atol": 1e-2, "rtol": 1.6e-2}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with n intra-op threads. Tiny ops are faster on one thread, and far faster on a busy machine,
    where OpenMP threads wait on each other."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def verify_tiled_reference(seed: int = 0) -> dict[str, Any]:
    """Max error of `tiled_attention` against torch's SDPA (output) and logsumexp (lse), fp32, over REFERENCE_GRID."""
    generator = torch.Generator().manual_seed(seed)
    worst_out = worst_lse = 0.0
    failures = []
    cases = 0
    start = time.perf_counter()
    with torch_threads(1):
        for batch, heads, seqlen, head_dim, causal in itertools.product(*REFERENCE_GRID.values()):
            q, k, v = (torch.randn(batch, heads, seqlen, head_dim, generator=generator) for _ in range(3))
            out, lse = tiled_attention(q, k, v, causal=causal)
            expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            scores = (q @ k.transpose(-2, -1)) / head_dim**0.5
            if causal:
                scores = scores.masked_fill(torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1), float("-inf"))
            err_out = (out - expected).abs().max().item()
            err_lse = (lse - torch.logsumexp(scores, dim=-1)).abs().max().item()
            worst_out, worst_lse = max(worst_out, err_out), max(worst_lse, err_lse)
            cases += 1
            if max(err_out, err_lse) > REFERENCE_TOLERANCE:
                failures.append(
                    {"batch": batch, "heads": heads, "seqlen": seqlen, "head_dim": head_dim, "causal": causal,
                     "max_abs_err": max(err_out, err_lse)}
                )
    return {
        "status": "passed" if not failures else "failed",
        "against": "torch.nn.functional.scaled_dot_product_attention (output), torch.logsumexp (lse)",
        "dtype": "fp32",
        "tolerance": REFERENCE_TOLERANCE,
        "cases": cases,
        "grid": {key: list(values) for key, values in REFERENCE_GRID.items()},
        "max_abs_err_out": worst_out,
        "max_abs_err_lse": worst_lse,
        "failures": failures[:10],
        "seconds": round(time.perf_counter() - start, 2),
    }


@dataclass(frozen=True)
class ModelShapes:
    """The shapes of one transformer layer of the model being fine-tuned (default: SmolLM2-135M)."""

    batch: int = 8
    seq_len: int = 128
    hidden: int = 576
    heads: int = 9
    intermediate: int = 1536

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


# How often each timed op runs in one layer's forward pass. q/k/v/o are counted as hidden x hidden (an upper bound
# when the model groups its KV heads); gate, up and down are hidden <-> intermediate.
LAYER_COUNTS = {"attention": 1, "linear_hidden": 4, "linear_mlp": 3}


@dataclass
class _Op:
    name: str
    shape: dict[str, Any]
    inputs: tuple[torch.Tensor, ...]  # fp32 master copies
    run: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]  # float64 math


def _ops(shapes: ModelShapes, generator: torch.Generator) -> list[_Op]:
    b, n, h, d = shapes.batch, shapes.seq_len, shapes.heads, shapes.head_dim

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*size, generator=generator) * scale

    attn = _Op(
        name="attention",
        shape={"batch": b, "heads": h, "seq_len": n, "head_dim": d, "causal": True},
        inputs=(randn(b, h, n, d), randn(b, h, n, d), randn(b, h, n, d)),
        run=lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        reference=lambda q, k, v: naive_attention(q, k, v, causal=True)[0],
    )
    linears = [
        _Op(
            name=name,
            shape={"tokens": shapes.tokens, "in_features": shapes.hidden, "out_features": out},
            # Weights scaled by 1/sqrt(fan_in) as at initialisation: outputs of order 1, like the model's.
            inputs=(randn(shapes.tokens, shapes.hidden), randn(out, shapes.hidden, scale=shapes.hidden**-0.5)),
            run=F.linear,
            reference=lambda x, w: x @ w.T,
        )
        for name, out in (("linear_hidden", shapes.hidden), ("linear_mlp", shapes.intermediate))
    ]
    return [attn, *linears]


def _time_ms(fn: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _errors(out: torch.Tensor, ref: torch.Tensor, tolerance: dict[str, float]) -> dict[str, Any]:
    diff = (out.double() - ref).abs()
    bound = tolerance["atol"] + tolerance["rtol"] * ref.abs()
    return {
        "max_abs_err": diff.max().item(),
        "mean_rel_err": (diff.mean() / ref.abs().mean().clamp_min(1e-30)).item(),
        "tolerance": tolerance,
        "verified": bool((diff <= bound).all().item()),
    }


def measure_precisions(shapes: ModelShapes, repeats: int = 10, warmup: int = 2, seed: int = 0) -> dict[str, Any]:
    """Verify and time each op in fp32 and in bf16 on this CPU; per op: errors and the median milliseconds.

    fp32 and bf16 runs alternate, so a burst of load from elsewhere on the machine hits both alike.
    """
    generator = torch.Generator().manual_seed(seed)
    ops: dict[str, Any] = {}
    for op in _ops(shapes, generator):
        cast = {name: tuple(t.to(dtype) for t in op.inputs) for name, dtype in DTYPES.items()}
        record: dict[str, Any] = {"shape": op.shape}
        with torch.inference_mode():
            for name, inputs in cast.items():
                # The reference sees the same rounded inputs, so the error measures the backend, not the rounding.
                reference = op.reference(*(t.double() for t in inputs))
                record[name] = _errors(op.run(*inputs), reference, BACKEND_TOLERANCE[name])
            times: dict[str, list[float]] = {name: [] for name in cast}
            for i in range(warmup + repeats):
                for name, inputs in cast.items():
                    elapsed = _time_ms(lambda: op.run(*inputs))
                    if i >= warmup:
                        times[name].append(elapsed)
        for name in cast:
            record[name]["ms"] = round(statistics.median(times[name]), 4)
        ops[op.name] = record
    return ops


def choose_precision(ops: dict[str, Any], min_speedup: float, counts: dict[str, int] = LAYER_COUNTS) -> dict[str, Any]:
    """bf16 when every op verified in bf16 and a layer's forward is at least `min_speedup` times faster; else fp32.

    The margin keeps timing noise from flipping the choice between two runs on one machine.
    """
    layer = {name: sum(counts[op] * ops[op][name]["ms"] for op in counts) for name in DTYPES}
    speedup = layer["fp32"] / layer["bf16"] if layer["bf16"] > 0 else 0.0
    bf16_ok = all(ops[op]["bf16"]["verified"] for op in counts)
    fp32_ok = all(ops[op]["fp32"]["verified"] for op in counts)
    if not bf16_ok:
        preferred, reason = "fp32", "bf16 results did not verify against the float64 reference"
    elif speedup >= min_speedup:
        preferred, reason = "bf16", f"bf16 is {speedup:.2f}x faster than fp32 per layer (threshold {min_speedup}x)"
    else:
        preferred, reason = "fp32", f"bf16 is only {speedup:.2f}x as fast as fp32 per layer (threshold {min_speedup}x)"
    return {
        "preferred_precision": preferred,
        "reason": reason,
        "bf16_speedup": round(speedup, 3),
        "layer_forward_ms": {name: round(ms, 3) for name, ms in layer.items()},
        "layer_counts": dict(counts),
        "fp32_verified": fp32_ok,
        "bf16_verified": bf16_ok,
    }


# Sequence lengths at which training attention is timed both ways; tokens per batch fixed, as length grouping does.
ATTENTION_LENGTHS = (16, 32, 64, 128, 256, 512)


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' eager path: QK^T + additive mask, softmax in fp32, times V."""
    weights = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5 + mask
    return torch.matmul(torch.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype), v)


def measure_training_attention(shapes: ModelShapes, tokens: int = 512, repeats: int = 5, warmup: int = 2,
                               min_speedup: float = 1.1, seed: int = 0) -> dict[str, Any]:
    """Forward + backward of causal attention, SDPA (PyTorch's CPU flash kernel) against eager, per length and precision.

    Training batches are length-grouped, so each has one padded length: `frugaltune.training.fast` runs eager up to
    `eager_max_len` and SDPA above. `eager_max_len[precision]` is the longest timed length up to which eager won
    at every length by `min_speedup` (0: never). Both paths are checked against each other before timing.
    """
    generator = torch.Generator().manual_seed(seed)
    h, d = shapes.heads, shapes.head_dim
    record: dict[str, Any] = {"tokens_per_batch": tokens, "heads": h, "head_dim": d, "min_speedup": min_speedup,
                              "ms": {}, "eager_max_len": {}}
    for precision, dtype in DTYPES.items():
        per_length: dict[str, dict[str, float]] = {}
        max_len, winning = 0, True
        for n in ATTENTION_LENGTHS:
            b = max(1, tokens // n)
            q, k, v = (torch.randn(b, h, n, d, generator=generator).to(dtype).requires_grad_() for _ in range(3))
            mask = torch.full((n, n), float("-inf")).triu(1)
            paths: dict[str, Callable[[], torch.Tensor]] = {
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "eager": lambda: _eager_attention(q, k, v, mask),
            }
            with torch.no_grad():
                diff = (paths["sdpa"]().float() - paths["eager"]().float()).abs().max().item()
            if diff > (1e-4 if precision == "fp32" else 5e-2):
                raise RuntimeError(f"attention: eager and SDPA differ by {diff} at length {n} in {precision}")
            times: dict[str, list[float]] = {name: [] for name in paths}
            for i in range(warmup + repeats):
                for name, fn in paths.items():  # alternate, so load from elsewhere hits both alike
                    elapsed = _time_ms(lambda: fn().float().sum().backward())
                    if i >= warmup:
                        times[name].append(elapsed)
            ms = {name: round(statistics.median(t), 3) for name, t in times.items()}
            per_length[str(n)] = ms
            winning = winning and ms["sdpa"] >= min_speedup * ms["eager"]
            if winning:
                max_len = n
        record["ms"][precision] = per_length
        record["eager_max_len"][precision] = max_len
    return record
