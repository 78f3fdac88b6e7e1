// FlashAttention-2 style forward pass: fp16 / bf16 in, fp32 accumulation, online softmax, causal or not.
//
// One thread block owns kBlockM = 32 query rows of one (batch, head) and streams the keys and values past them
// in tiles of kBlockN = 32, so the N x N score matrix never exists in memory. As in FlashAttention-2, the query
// rows are split across the warps (8 rows each) and never the keys, so warps never exchange partial sums; the
// softmax normalisation is deferred to the end; the kernel also returns the log-sum-exp, which a backward pass
// needs. Per key tile:
//   1. S = Q K^T: lane j of every warp scores key n0 + j against the warp's 8 rows (K in shared memory,
//      padded by one 32-bit word per row so that the 32 lanes read 32 different banks).
//   2. Online softmax per row: new max m' = max(m, rowmax(S)), P = exp2(S - m'), l = l * exp2(m - m') + rowsum(P),
//      O *= exp2(m - m'). Q is pre-scaled by softmax_scale * log2(e), so exp2 gives exactly exp of the
//      natural-log scores.
//   3. O += P V: lane c owns output columns c, c + 32, ...; P[row, j] is broadcast from lane j by a shuffle.
// At the end O /= l and lse = (m + log2 l) * ln 2. kernels/reference.py `tiled_attention` performs the same steps
// in PyTorch, block by block, and is checked against torch's SDPA on every machine.
//
// This kernel runs on the CUDA cores (FMA), not the tensor cores: it is the readable baseline that the stage
// verifies and times honestly, and it is used only where it measures faster than PyTorch's own attention.
#include "launchers.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace frugaltune {
namespace {

constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 8;
constexpr int kBlockM = kWarps * kRowsPerWarp;  // query rows per block
constexpr int kBlockN = 32;                      // keys per tile: one per lane
constexpr int kThreads = kWarps * 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T>
struct Pair;  // two adjacent elements read as one 32-bit word
template <>
struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 to_float2(type x) { return __half22float2(x); }
};
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(type x) { return __bfloat1622float2(x); }
};

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// grid: (ceil(seqlen / kBlockM), batch * heads); block: kThreads. Tensors are [batch * heads, seqlen, D].
template <typename T, int D, bool kCausal>
__global__ void __launch_bounds__(kThreads)
    flash_attn_fwd_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                          T* __restrict__ out, float* __restrict__ lse, int seqlen, float scale_log2) {
  static_assert(D % 32 == 0, "each lane owns D / 32 output columns");
  constexpr int kCols = D / 32;
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte global load
  using PairT = typename Pair<T>::type;

  __shared__ __align__(16) float q_s[kBlockM][D];
  __shared__ __align__(16) T k_s[kBlockN][D + 2];  // +2 elements = +1 bank: conflict-free reads along a column
  __shared__ __align__(16) T v_s[kBlockN][D];

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int m0 = blockIdx.x * kBlockM;
  const size_t head = static_cast<size_t>(blockIdx.y) * seqlen;
  q += head * D;
  k += head * D;
  v += head * D;
  out += head * D;
  lse += head;

  // Q tile -> fp32 shared memory, pre-scaled; rows past the end are zeros (their results are never stored).
  for (int idx = tid * kVec; idx < kBlockM * D; idx += kThreads * kVec) {
    const int r = idx / D, c = idx % D;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (m0 + r < seqlen) raw = *reinterpret_cast<const uint4*>(q + static_cast<size_t>(m0 + r) * D + c);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      PairT pair;
      memcpy(&pair, &words[w], sizeof(pair));  // a bit cast; compiles to a register move
      const float2 f = Pair<T>::to_float2(pair);
      q_s[r][c + 2 * w] = f.x * scale_log2;
      q_s[r][c + 2 * w + 1] = f.y * scale_log2;
    }
  }

  float acc[kRowsPerWarp][kCols];
  float row_max[kRowsPerWarp];
  float row_sum[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.f;
  }

  // Causal: keys after the block's last query row are masked for every row, so those tiles are skipped.
  const int kv_end = kCausal ? min(seqlen, m0 + kBlockM) : seqlen;
  for (int n0 = 0; n0 < kv_end; n0 += kBlockN) {
    __syncthreads();  // the previous tile is consumed (and, on the first pass, q_s is complete)
    for (int idx = tid * kVec; idx < kBlockN * D; idx += kThreads * kVec) {
      const int r = idx / D, c = idx % D;
      uint4 kr = make_uint4(0, 0, 0, 0), vr = make_uint4(0, 0, 0, 0);
      if (n0 + r < seqlen) {
        kr = *reinterpret_cast<const uint4*>(k + static_cast<size_t>(n0 + r) * D + c);
        vr = *reinterpret_cast<const uint4*>(v + static_cast<size_t>(n0 + r) * D + c);
      }
      *reinterpret_cast<uint4*>(&v_s[r][c]) = vr;
      // k_s rows are padded (not 16-byte aligned), so store the 16 bytes as four 32-bit words.
      uint32_t* dst = reinterpret_cast<uint32_t*>(&k_s[r][c]);
      dst[0] = kr.x;
      dst[1] = kr.y;
      dst[2] = kr.z;
      dst[3] = kr.w;
    }
    __syncthreads();

    // 1. Scores of key n0 + lane against the warp's rows (log2 units).
    float s[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) s[r] = 0.f;
    const PairT* k_row = reinterpret_cast<const PairT*>(&k_s[lane][0]);
#pragma unroll 8
    for (int c2 = 0; c2 < D / 2; ++c2) {
      const float2 kf = Pair<T>::to_float2(k_row[c2]);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float2 qf = *reinterpret_cast<const float2*>(&q_s[warp * kRowsPerWarp + r][2 * c2]);
        s[r] = fmaf(qf.x, kf.x, fmaf(qf.y, kf.y, s[r]));
      }
    }
    const int key = n0 + lane;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int query = m0 + warp * kRowsPerWarp + r;
      if (key >= seqlen || (kCausal && key > query)) s[r] = -INFINITY;
    }

    // 2. Online softmax: rescale what was accumulated under the old running max.
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const float new_max = fmaxf(row_max[r], warp_max(s[r]));
      const float base = new_max == -INFINITY ? 0.f : new_max;  // a fully masked row so far: keep exp2 finite
      const float p = exp2f(s[r] - base);
      const float correction = exp2f(row_max[r] - base);
      row_sum[r] = row_sum[r] * correction + warp_sum(p);
      row_max[r] = new_max;
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[r][c] *= correction;
      s[r] = p;
    }

    // 3. O += P V.
#pragma unroll 4
    for (int j = 0; j < kBlockN; ++j) {
      float vj[kCols];
#pragma unroll
      for (int c = 0; c < kCols; ++c) vj[c] = to_float(v_s[j][lane + 32 * c]);
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float pj = __shfl_sync(0xffffffffu, s[r], j);
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[r][c] = fmaf(pj, vj[c], acc[r][c]);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int query = m0 + warp * kRowsPerWarp + r;
    if (query >= seqlen) continue;
    const float inv_sum = 1.f / row_sum[r];
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      out[static_cast<size_t>(query) * D + lane + 32 * c] = from_float<T>(acc[r][c] * inv_sum);
    if (lane == 0) lse[query] = (row_max[r] + log2f(row_sum[r])) * kLn2;
  }
}

template <typename T, int D, bool kCausal>
cudaError_t launch(int batch_heads, int seqlen, float scale, const void* q, const void* k, const void* v, void* out,
                   float* lse, cudaStream_t stream) {
  const dim3 grid((seqlen + kBlockM - 1) / kBlockM, batch_heads);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;
  flash_attn_fwd_kernel<T, D, kCausal><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<T*>(out), lse,
      seqlen, scale * kLog2e);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch(bool causal, int batch_heads, int seqlen, float scale, const void* q, const void* k,
                   const void* v, void* out, float* lse, cudaStream_t stream) {
  return causal ? launch<T, D, true>(batch_heads, seqlen, scale, q, k, v, out, lse, stream)
                : launch<T, D, false>(batch_heads, seqlen, scale, q, k, v, out, lse, stream);
}

template <typename T>
cudaError_t launch(int head_dim, bool causal, int batch_heads, int seqlen, float scale, const void* q,
                   const void* k, const void* v, void* out, float* lse, cudaStream_t stream) {
  switch (head_dim) {
    case 64: return launch<T, 64>(causal, batch_heads, seqlen, scale, q, k, v, out, lse, stream);
    case 128: return launch<T, 128>(causal, batch_heads, seqlen, scale, q, k, v, out, lse, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t flash_attn_fwd(int dtype, int head_dim, bool causal, int batch_heads, int seqlen, float softmax_scale,
                           const void* q, const void* k, const void* v, void* out, float* lse,
                           cudaStream_t stream) {
  if (batch_heads <= 0 || seqlen <= 0) return cudaSuccess;
  switch (dtype) {
    case kAttnFloat16:
      return launch<__half>(head_dim, causal, batch_heads, seqlen, softmax_scale, q, k, v, out, lse, stream);
    case kAttnBFloat16:
      return launch<__nv_bfloat16>(head_dim, causal, batch_heads, seqlen, softmax_scale, q, k, v, out, lse,
                                   stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace frugaltune
