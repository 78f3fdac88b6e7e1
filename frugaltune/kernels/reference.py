"""Pure-PyTorch references the CUDA kernels are verified against.

- `naive_attention`: the textbook formula, the full score matrix materialised; run it in float64 for a math
  reference, or in the input dtype as the "naive PyTorch attention" baseline of the benchmark.
- `tiled_attention`: the same computation in the blocks and order of `flash_attn_fwd.cu` (32-row query blocks,
  32-key tiles, online softmax in base 2, deferred normalisation). It is checked against torch's SDPA on every
  machine, so a reader can trust the algorithm before trusting the CUDA that implements it.
- `sgemm_reference`: C = alpha * A @ B + beta * C in float64.
- FLOP counts used for TFLOP/s: the algorithmic count, the same for every implementation of one problem.
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
BLOCK_M = 32  # query rows per thread block (kBlockM in flash_attn_fwd.cu)
BLOCK_N = 32  # keys per tile (kBlockN)


def _scale(head_dim: int, softmax_scale: float | None) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, softmax_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T * scale [masked]) V and the row log-sum-exp, in the dtype of the inputs.

    Shapes: q, k, v [..., seqlen, head_dim]; returns out [..., seqlen, head_dim] and lse [..., seqlen].
    The causal mask is top-left aligned (query i sees keys 0..i), as SDPA's `is_causal=True`.
    """
    scores = (q @ k.transpose(-2, -1)) * _scale(q.shape[-1], softmax_scale)
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v
    return out, lse


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 forward in PyTorch, step for step as `flash_attn_fwd.cu` does it; fp32 accumulation.

    Returns (out in the input dtype, lse in float32). Batch and head dimensions are processed together, which is
    what the kernel's grid does in parallel.
    """
    seqlen, head_dim = q.shape[-2], q.shape[-1]
    # Pre-scale Q by scale * log2(e): the kernel works in base 2 (exp2 is one instruction).
    q_s = q.float() * (_scale(head_dim, softmax_scale) * LOG2E)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for m0 in range(0, seqlen, block_m):
        q_tile = q_s[..., m0 : m0 + block_m, :]
        rows = q_tile.shape[-2]
        queries = torch.arange(m0, m0 + rows, device=q.device)
        acc = torch.zeros(q_tile.shape, dtype=torch.float32, device=q.device)
        row_max = torch.full(q_tile.shape[:-1], float("-inf"), device=q.device)
        row_sum = torch.zeros(q_tile.shape[:-1], device=q.device)
        # Causal: tiles that start after the block's last query are masked for every row; the kernel skips them.
        kv_end = min(seqlen, m0 + block_m) if causal else seqlen
        for n0 in range(0, kv_end, block_n):
            k_tile = k[..., n0 : n0 + block_n, :].float()
            v_tile = v[..., n0 : n0 + block_n, :].float()
            s = q_tile @ k_tile.transpose(-2, -1)  # 1. scores, base-2 units
            if causal:
                keys = torch.arange(n0, n0 + k_tile.shape[-2], device=q.device)
                s = s.masked_fill(keys[None, :] > queries[:, None], float("-inf"))
            # 2. online softmax: a fully masked row so far keeps base 0 so that exp2 stays finite (0, not NaN)
            new_max = torch.maximum(row_max, s.amax(dim=-1))
            base = torch.where(new_max == float("-inf"), torch.zeros_like(new_max), new_max)
            p = torch.exp2(s - base[..., None])
            correction = torch.exp2(row_max - base)
            row_sum = row_sum * correction + p.sum(dim=-1)
            row_max = new_max
            acc = acc * correction[..., None] + p @ v_tile  # 3. O += P V
        out[..., m0 : m0 + rows, :] = acc / row_sum[..., None]
        lse[..., m0 : m0 + rows] = (row_max + torch.log2(row_sum)) * LN2
    return out.to(q.dtype), lse


def sgemm_reference(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 0.0
) -> torch.Tensor:
    """alpha * A @ B + beta * C, computed in float64."""
    result = alpha * (a.double() @ b.double())
    if c is not None and beta != 0.0:
        result = result + beta * c.double()
    return result


def attention_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> float:
    """Q K^T and P V: 2 * 2 * N^2 * d per head; a causal mask halves the useful work."""
    flops = 4.0 * batch * heads * seqlen * seqlen * head_dim
    return flops / 2 if causal else flops


def matmul_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k
