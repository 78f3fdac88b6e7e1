// Host emulation of the CUDA features the kernels use, one OS thread per CUDA thread, so that the kernels' own
// code runs on a CPU (kernels/emulate.py). A functional check of indexing, masking, tiling and barrier placement;
// it says nothing about speed, coalescing or occupancy. Blocks run one after another; threads of a block run
// concurrently and meet at __syncthreads (a block barrier) and at every shuffle (a warp barrier).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

using std::max;
using std::min;

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __shared__
#define __shared__ static  // one block at a time: a static local is exactly "shared by the block"
#undef __align__
#define __align__(n) __attribute__((aligned(n)))
#define cudaGetLastError() cudaSuccess

struct EmuIndex {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local EmuIndex emu_thread_idx, emu_block_idx;
#define threadIdx emu_thread_idx
#define blockIdx emu_block_idx

inline std::barrier<>* emu_block_barrier = nullptr;
inline std::vector<std::unique_ptr<std::barrier<>>> emu_warp_barriers;
inline float emu_lanes[32][32];  // [warp][lane]: the value each lane offers to a shuffle

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

inline float emu_shuffle(float value, int source_lane) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  emu_lanes[warp][lane] = value;
  emu_warp_barriers[warp]->arrive_and_wait();
  const float result = emu_lanes[warp][source_lane & 31];
  emu_warp_barriers[warp]->arrive_and_wait();  // nobody overwrites a slot before everyone has read
  return result;
}
inline float __shfl_sync(unsigned, float value, int source_lane) { return emu_shuffle(value, source_lane); }
inline float __shfl_xor_sync(unsigned, float value, int mask) {
  return emu_shuffle(value, static_cast<int>(threadIdx.x % 32) ^ mask);
}

// kernel<<<grid, block, 0, stream>>>(args) is rewritten by kernels/emulate.py into emu_launch(grid, block, body).
inline void emu_launch(dim3 grid, dim3 block, const std::function<void()>& body) {
  for (unsigned by = 0; by < grid.y; ++by) {
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      std::barrier<> block_barrier(block.x);
      emu_block_barrier = &block_barrier;
      emu_warp_barriers.clear();
      for (unsigned w = 0; w < (block.x + 31) / 32; ++w) emu_warp_barriers.emplace_back(new std::barrier<>(32));
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < block.x; ++t) {
        threads.emplace_back([&, t] {
          emu_thread_idx = {t, 0, 0};
          emu_block_idx = {bx, by, 0};
          body();
        });
      }
      for (auto& thread : threads) thread.join();
    }
  }
}
