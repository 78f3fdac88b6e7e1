// Host-side entry points of the CUDA kernels, shared by the .cu files and the torch bindings.
//
// The .cu files include no torch header, so `nvcc -cubin` compiles them on a machine whose torch build has
// no CUDA (the ptxas report in `reports/kernels.json`), and the torch extension links them unchanged.
#pragma once

#include <cuda_runtime_api.h>

namespace frugaltune {

// ---- sgemm: C = alpha * A @ B + beta * C, fp32, row-major, M x K times K x N -----------------------------
// The tile configurations compiled into the library, in the order of `config` below.
int sgemm_num_configs();
// Writes BM, BN, BK, TM, TN of configuration `config` into `tile[0..4]`; false when out of range.
bool sgemm_config(int config, int* tile);
// Requirements (checked by the bindings): K % 4 == 0, N % 4 == 0, 16-byte aligned pointers (float4 loads).
// beta == 0 never reads C, so C may hold garbage then.
cudaError_t sgemm(int config, int M, int N, int K, float alpha, const float* A, const float* B, float beta,
                  float* C, cudaStream_t stream);

// ---- flash_attn_fwd: O = softmax(Q K^T * scale [+ causal mask]) V, plus the log-sum-exp ----------------
enum AttnDtype { kAttnFloat16 = 0, kAttnBFloat16 = 1 };
// q, k, v, out: [batch_heads, seqlen, head_dim] contiguous, 16-byte aligned, fp16 or bf16 (`dtype`);
// lse: [batch_heads, seqlen] fp32 (natural log). head_dim is 64 or 128. The causal mask is top-left aligned
// (query i sees keys 0..i), as in torch.nn.functional.scaled_dot_product_attention(is_causal=True).
cudaError_t flash_attn_fwd(int dtype, int head_dim, bool causal, int batch_heads, int seqlen,
                           float softmax_scale, const void* q, const void* k, const void* v, void* out,
                           float* lse, cudaStream_t stream);

}  // namespace frugaltune
