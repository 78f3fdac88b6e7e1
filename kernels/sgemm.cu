// SGEMM, C = alpha * A @ B + beta * C in fp32 (row-major): shared-memory tiles, 2D block tiling, float4 loads.
//
// The last of the classic steps (naive -> coalesced -> shared memory -> 1D -> 2D block tiling -> vectorized):
// a block computes a BM x BN tile of C, walking K in steps of BK. Each step stages a BM x BK slice of A
// (transposed, so the inner loop reads it along M with consecutive addresses) and a BK x BN slice of B in
// shared memory; each thread then accumulates a TM x TN sub-tile in registers from TM + TN shared-memory reads
// per k, which is what moves the kernel from memory-bound to FMA-bound. Global loads and C stores are float4.
//
// Edges are guarded (zero-filled loads, masked stores), so any M is fine; K and N must be multiples of 4 so that
// every float4 is either fully inside the matrix or fully outside. The autotuner (kernels/cuda.py) times every
// configuration in SGEMM_CONFIGS on the device and records the best; kernels/reference.py holds the reference.
#include "launchers.h"

#include <cuda_runtime.h>

namespace frugaltune {
namespace {

// Compiled tile configurations (BM, BN, BK, TM, TN). Each must satisfy the static_asserts in SgemmTile.
#define SGEMM_CONFIGS(X)    \
  X(128, 128, 8, 8, 8)      \
  X(128, 128, 16, 8, 8)     \
  X(128, 64, 16, 8, 8)      \
  X(64, 128, 16, 8, 8)      \
  X(64, 64, 16, 8, 4)       \
  X(64, 64, 8, 8, 8)

template <int BM, int BN, int BK, int TM, int TN>
struct SgemmTile {
  static constexpr int kThreads = (BM * BN) / (TM * TN);
  // One float4 per thread per pass: an A row holds BK / 4 of them, a B row BN / 4.
  static constexpr int kRowStrideA = kThreads / (BK / 4);
  static constexpr int kRowStrideB = kThreads / (BN / 4);
  static_assert(BM % TM == 0 && BN % TN == 0, "thread tiles must divide the block tile");
  static_assert(BK % 4 == 0 && BN % 4 == 0 && TN % 4 == 0, "float4 loads and stores need multiples of 4");
  static_assert(kThreads >= 32 && kThreads <= 1024, "a block holds 32..1024 threads");
  static_assert(kThreads % (BK / 4) == 0 && BM % kRowStrideA == 0, "A-tile loads must cover the tile exactly");
  static_assert(kThreads % (BN / 4) == 0 && BK % kRowStrideB == 0, "B-tile loads must cover the tile exactly");
  static_assert((BM * BK + BK * BN) * sizeof(float) <= 48 * 1024, "static shared memory is limited to 48 KiB");
};

template <int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__((BM * BN) / (TM * TN))
    sgemm_blocktiled(int M, int N, int K, float alpha, const float* __restrict__ A, const float* __restrict__ B,
                     float beta, float* __restrict__ C) {
  using Tile = SgemmTile<BM, BN, BK, TM, TN>;
  __shared__ __align__(16) float As[BK * BM];  // transposed: As[k * BM + m]
  __shared__ __align__(16) float Bs[BK * BN];  // Bs[k * BN + n]

  const int block_row = blockIdx.y * BM;
  const int block_col = blockIdx.x * BN;
  const int thread_row = threadIdx.x / (BN / TN);  // which TM x TN sub-tile this thread owns
  const int thread_col = threadIdx.x % (BN / TN);
  const int a_row = threadIdx.x / (BK / 4);  // which float4 of the A and B tiles this thread loads first
  const int a_col = (threadIdx.x % (BK / 4)) * 4;
  const int b_row = threadIdx.x / (BN / 4);
  const int b_col = (threadIdx.x % (BN / 4)) * 4;

  float acc[TM][TN] = {};
  float reg_m[TM];
  float reg_n[TN];

  for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
    for (int r = a_row; r < BM; r += Tile::kRowStrideA) {
      const int gr = block_row + r;
      const int gc = k0 + a_col;
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
      if (gr < M && gc < K) a = *reinterpret_cast<const float4*>(&A[static_cast<size_t>(gr) * K + gc]);
      As[(a_col + 0) * BM + r] = a.x;
      As[(a_col + 1) * BM + r] = a.y;
      As[(a_col + 2) * BM + r] = a.z;
      As[(a_col + 3) * BM + r] = a.w;
    }
#pragma unroll
    for (int r = b_row; r < BK; r += Tile::kRowStrideB) {
      const int gr = k0 + r;
      const int gc = block_col + b_col;
      float4 b = make_float4(0.f, 0.f, 0.f, 0.f);
      if (gr < K && gc < N) b = *reinterpret_cast<const float4*>(&B[static_cast<size_t>(gr) * N + gc]);
      *reinterpret_cast<float4*>(&Bs[r * BN + b_col]) = b;
    }
    __syncthreads();

#pragma unroll
    for (int k = 0; k < BK; ++k) {
#pragma unroll
      for (int i = 0; i < TM; ++i) reg_m[i] = As[k * BM + thread_row * TM + i];
#pragma unroll
      for (int j = 0; j < TN; ++j) reg_n[j] = Bs[k * BN + thread_col * TN + j];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(reg_m[i], reg_n[j], acc[i][j]);
    }
    __syncthreads();  // the next iteration overwrites As / Bs
  }

#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int gr = block_row + thread_row * TM + i;
    if (gr >= M) continue;
#pragma unroll
    for (int j = 0; j < TN; j += 4) {
      const int gc = block_col + thread_col * TN + j;
      if (gc >= N) continue;
      float4* c = reinterpret_cast<float4*>(&C[static_cast<size_t>(gr) * N + gc]);
      float4 out = make_float4(alpha * acc[i][j], alpha * acc[i][j + 1], alpha * acc[i][j + 2], alpha * acc[i][j + 3]);
      if (beta != 0.f) {  // beta == 0 must not read C: it may be uninitialized (NaN * 0 is NaN)
        const float4 old = *c;
        out.x = fmaf(beta, old.x, out.x);
        out.y = fmaf(beta, old.y, out.y);
        out.z = fmaf(beta, old.z, out.z);
        out.w = fmaf(beta, old.w, out.w);
      }
      *c = out;
    }
  }
}

template <int BM, int BN, int BK, int TM, int TN>
cudaError_t launch(int M, int N, int K, float alpha, const float* A, const float* B, float beta, float* C,
                   cudaStream_t stream) {
  const dim3 grid((N + BN - 1) / BN, (M + BM - 1) / BM);
  if (grid.y > 65535) return cudaErrorInvalidConfiguration;
  sgemm_blocktiled<BM, BN, BK, TM, TN>
      <<<grid, SgemmTile<BM, BN, BK, TM, TN>::kThreads, 0, stream>>>(M, N, K, alpha, A, B, beta, C);
  return cudaGetLastError();
}

#define SGEMM_TILE_ROW(bm, bn, bk, tm, tn) {bm, bn, bk, tm, tn},
constexpr int kConfigs[][5] = {SGEMM_CONFIGS(SGEMM_TILE_ROW)};
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);

}  // namespace

int sgemm_num_configs() { return kNumConfigs; }

bool sgemm_config(int config, int* tile) {
  if (config < 0 || config >= kNumConfigs) return false;
  for (int i = 0; i < 5; ++i) tile[i] = kConfigs[config][i];
  return true;
}

cudaError_t sgemm(int config, int M, int N, int K, float alpha, const float* A, const float* B, float beta,
                  float* C, cudaStream_t stream) {
  if (M <= 0 || N <= 0) return cudaSuccess;
  if (K % 4 != 0 || N % 4 != 0) return cudaErrorInvalidValue;
  int index = 0;
#define SGEMM_DISPATCH(bm, bn, bk, tm, tn) \
  if (config == index++) return launch<bm, bn, bk, tm, tn>(M, N, K, alpha, A, B, beta, C, stream);
  SGEMM_CONFIGS(SGEMM_DISPATCH)
#undef SGEMM_DISPATCH
  return cudaErrorInvalidValue;
}

}  // namespace frugaltune
