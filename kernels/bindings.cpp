// Torch bindings of the CUDA kernels: argument checks, output allocation, the current stream.
//
// Built only where a CUDA device and a CUDA build of torch exist (kernels/build.py `load_extension`); the
// kernels themselves live in the .cu files, which include no torch header.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "launchers.h"

namespace {

// Numbers in error messages go through std::to_string, never `std::ostream << int`: on the H100 image of
// 2026-11 (torch 2.11.0+cu130, g++ 13.3), inserting an integer into a stream inside any torch extension
// segfaults (a one-line load_inline extension does the same), so a rejected argument crashed the process
// instead of raising. Strings and std::to_string do not touch the stream's numeric facets.
std::string shape_str(const torch::Tensor& t) {
  std::string out = "[";
  for (int64_t d = 0; d < t.dim(); ++d) {
    out += (d ? ", " : "") + std::to_string(t.size(d));
  }
  return out + "]";
}

void check_aligned(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be 16-byte aligned (the kernels use 16-byte loads); pass a fresh or .clone()d tensor");
}

std::vector<torch::Tensor> flash_attn_fwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, bool causal,
                                          double softmax_scale) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "flash_attn_fwd: q, k, v must be CUDA tensors");
  TORCH_CHECK(q.dim() == 4, "flash_attn_fwd: q must be [batch, heads, seqlen, head_dim], got ", shape_str(q));
  TORCH_CHECK(k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "flash_attn_fwd: q, k, v must have the same shape (self-attention, no GQA); got ", shape_str(q), ", ",
              shape_str(k), ", ", shape_str(v));
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "flash_attn_fwd: q, k, v must share a dtype");
  int dtype;
  if (q.scalar_type() == torch::kHalf) {
    dtype = frugaltune::kAttnFloat16;
  } else if (q.scalar_type() == torch::kBFloat16) {
    dtype = frugaltune::kAttnBFloat16;
  } else {
    TORCH_CHECK(false, "flash_attn_fwd: dtype must be float16 or bfloat16, got ", c10::toString(q.scalar_type()));
  }
  const int64_t batch = q.size(0), heads = q.size(1), seqlen = q.size(2), head_dim = q.size(3);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "flash_attn_fwd: head_dim must be 64 or 128, got ",
              std::to_string(head_dim));

  c10::cuda::CUDAGuard guard(q.device());
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  check_aligned(q, "q");
  check_aligned(k, "k");
  check_aligned(v, "v");
  auto out = torch::empty_like(q);
  auto lse = torch::empty({batch, heads, seqlen}, q.options().dtype(torch::kFloat32));
  const float scale = softmax_scale > 0 ? static_cast<float>(softmax_scale) : 1.0f / std::sqrt(float(head_dim));
  const cudaError_t err = frugaltune::flash_attn_fwd(
      dtype, static_cast<int>(head_dim), causal, static_cast<int>(batch * heads), static_cast<int>(seqlen), scale,
      q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr<float>(),
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_attn_fwd: launch failed: ", cudaGetErrorString(err));
  return {out, lse};
}

// C = alpha * A @ B + beta * C. With `c` None a new C is returned and beta must be 0.
torch::Tensor sgemm(torch::Tensor a, torch::Tensor b, c10::optional<torch::Tensor> c, double alpha, double beta,
                    int64_t config) {
  TORCH_CHECK(a.is_cuda() && b.is_cuda(), "sgemm: A and B must be CUDA tensors");
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32, "sgemm: fp32 only");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0), "sgemm: shapes ", shape_str(a), " and ",
              shape_str(b), " do not multiply");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  TORCH_CHECK(K % 4 == 0 && N % 4 == 0, "sgemm: K and N must be multiples of 4 (float4 loads), got K=",
              std::to_string(K), " N=", std::to_string(N));
  TORCH_CHECK(config >= 0 && config < frugaltune::sgemm_num_configs(), "sgemm: config ", std::to_string(config),
              " out of range");

  c10::cuda::CUDAGuard guard(a.device());
  a = a.contiguous();
  b = b.contiguous();
  torch::Tensor out;
  if (c.has_value()) {
    out = c.value();
    TORCH_CHECK(out.is_cuda() && out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2 &&
                    out.size(0) == M && out.size(1) == N,
                "sgemm: C must be a contiguous fp32 CUDA tensor of shape [", std::to_string(M), ", ",
                std::to_string(N), "]");
  } else {
    TORCH_CHECK(beta == 0.0, "sgemm: beta != 0 needs C");
    out = torch::empty({M, N}, a.options());
  }
  check_aligned(a, "A");
  check_aligned(b, "B");
  check_aligned(out, "C");
  const cudaError_t err = frugaltune::sgemm(static_cast<int>(config), static_cast<int>(M), static_cast<int>(N),
                                            static_cast<int>(K), static_cast<float>(alpha), a.data_ptr<float>(),
                                            b.data_ptr<float>(), static_cast<float>(beta), out.data_ptr<float>(),
                                            c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "sgemm: launch failed: ", cudaGetErrorString(err));
  return out;
}

std::vector<std::vector<int64_t>> sgemm_configs() {
  std::vector<std::vector<int64_t>> configs;
  for (int i = 0; i < frugaltune::sgemm_num_configs(); ++i) {
    int tile[5];
    frugaltune::sgemm_config(i, tile);
    configs.push_back({tile[0], tile[1], tile[2], tile[3], tile[4]});
  }
  return configs;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "frugaltune CUDA kernels (see kernels/README in the project README)";
  m.def("flash_attn_fwd", &flash_attn_fwd, "FlashAttention-2 style forward: returns (out, lse)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("causal") = false, py::arg("softmax_scale") = 0.0);
  m.def("sgemm", &sgemm, "C = alpha * A @ B + beta * C (fp32)", py::arg("a"), py::arg("b"), py::arg("c") = py::none(),
        py::arg("alpha") = 1.0, py::arg("beta") = 0.0, py::arg("config") = 0);
  m.def("sgemm_configs", &sgemm_configs, "The compiled (BM, BN, BK, TM, TN) tile configurations, in config order");
}
