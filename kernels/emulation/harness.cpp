// Runs the emulated kernels on random inputs and compares them with a float64 reference; one JSON line per case.
//
// Usage: harness <fp16_atol> <fp16_rtol> <bf16_atol> <bf16_rtol>
// `worst_ratio` is max |out - ref| / (atol + rtol * |ref|): the case passes when it is <= 1.
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "launchers.h"
#include "shim.h"

using namespace frugaltune;

namespace {

std::mt19937 rng(0);
float randn() {
  static std::normal_distribution<float> normal(0.f, 1.f);
  return normal(rng);
}

template <typename T>
T to(float x);
template <>
__half to<__half>(float x) { return __float2half_rn(x); }
template <>
__nv_bfloat16 to<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
float from(__half x) { return __half2float(x); }
float from(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
void flash_case(const char* dtype_name, int dtype, double atol, double rtol, int heads, int n, int d, bool causal) {
  const size_t size = static_cast<size_t>(heads) * n * d;
  std::vector<T> q(size), k(size), v(size), out(size);
  std::vector<float> lse(static_cast<size_t>(heads) * n);
  for (size_t i = 0; i < size; ++i) {
    q[i] = to<T>(randn());
    k[i] = to<T>(randn());
    v[i] = to<T>(randn());
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const cudaError_t err =
      flash_attn_fwd(dtype, d, causal, heads, n, scale, q.data(), k.data(), v.data(), out.data(), lse.data(), nullptr);
  double max_abs = 0, worst_ratio = 0, lse_max_abs = 0;
  for (int h = 0; h < heads && err == cudaSuccess; ++h) {
    for (int i = 0; i < n; ++i) {
      const int last = causal ? i : n - 1;
      std::vector<double> p(n);
      double m = -INFINITY;
      for (int j = 0; j <= last; ++j) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double(from(q[(h * n + i) * d + c])) * from(k[(h * n + j) * d + c]);
        p[j] = dot * scale;
        m = std::max(m, p[j]);
      }
      double l = 0;
      for (int j = 0; j <= last; ++j) l += (p[j] = std::exp(p[j] - m));
      for (int c = 0; c < d; ++c) {
        double ref = 0;
        for (int j = 0; j <= last; ++j) ref += p[j] * from(v[(h * n + j) * d + c]);
        ref /= l;
        double diff = std::abs(from(out[(h * n + i) * d + c]) - ref);
        if (diff != diff) diff = INFINITY;
        max_abs = std::max(max_abs, diff);
        worst_ratio = std::max(worst_ratio, diff / (atol + rtol * std::abs(ref)));
      }
      lse_max_abs = std::max(lse_max_abs, std::abs(lse[h * n + i] - (m + std::log(l))));
    }
  }
  std::printf(
      "{\"kernel\": \"flash_attn_fwd\", \"dtype\": \"%s\", \"heads\": %d, \"seqlen\": %d, \"head_dim\": %d, "
      "\"causal\": %s, \"launch\": %d, \"max_abs_err\": %.6g, \"worst_ratio\": %.6g, \"lse_max_abs_err\": %.6g}\n",
      dtype_name, heads, n, d, causal ? "true" : "false", int(err), max_abs, worst_ratio, lse_max_abs);
}

void sgemm_case(int config, int M, int N, int K, float alpha, float beta) {
  std::vector<float> A(size_t(M) * K), B(size_t(K) * N), C0(size_t(M) * N), C(size_t(M) * N);
  for (auto& x : A) x = randn();
  for (auto& x : B) x = randn();
  for (auto& x : C0) x = randn();
  for (size_t i = 0; i < C.size(); ++i) C[i] = beta != 0 ? C0[i] : NAN;  // beta == 0 must not read C
  const cudaError_t err = sgemm(config, M, N, K, alpha, A.data(), B.data(), beta, C.data(), nullptr);
  double max_abs = 0, max_ref = 0;
  for (int i = 0; i < M && err == cudaSuccess; ++i) {
    for (int j = 0; j < N; ++j) {
      double dot = 0;
      for (int k = 0; k < K; ++k) dot += double(A[size_t(i) * K + k]) * B[size_t(k) * N + j];
      const double ref = alpha * dot + (beta != 0 ? beta * C0[size_t(i) * N + j] : 0.0);
      double diff = std::abs(C[size_t(i) * N + j] - ref);
      if (diff != diff) diff = INFINITY;
      max_abs = std::max(max_abs, diff);
      max_ref = std::max(max_ref, std::abs(ref));
    }
  }
  int tile[5];
  sgemm_config(config, tile);
  std::printf(
      "{\"kernel\": \"sgemm\", \"tile\": [%d, %d, %d, %d, %d], \"shape\": [%d, %d, %d], \"beta\": %g, \"launch\": %d, "
      "\"rel_err\": %.6g}\n",
      tile[0], tile[1], tile[2], tile[3], tile[4], M, N, K, beta, int(err), max_abs / max_ref);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s fp16_atol fp16_rtol bf16_atol bf16_rtol\n", argv[0]);
    return 2;
  }
  const double f16_atol = std::stod(argv[1]), f16_rtol = std::stod(argv[2]);
  const double bf16_atol = std::stod(argv[3]), bf16_rtol = std::stod(argv[4]);
  // Ragged shapes on purpose: partial tiles in M, N and K, and sequences that end inside a 32-wide tile.
  for (int config = 0; config < sgemm_num_configs(); ++config) {
    sgemm_case(config, 33, 68, 12, 1.5f, 0.5f);
    sgemm_case(config, 130, 132, 36, 1.0f, 0.0f);
  }
  for (int d : {64, 128}) {
    for (bool causal : {false, true}) {
      flash_case<__half>("float16", kAttnFloat16, f16_atol, f16_rtol, 2, 70, d, causal);
      flash_case<__nv_bfloat16>("bfloat16", kAttnBFloat16, bf16_atol, bf16_rtol, 1, 45, d, causal);
    }
  }
  return 0;
}
