// Small kernels that show what the emulation does with right and wrong device code
// (tests/cuda_emu/test_emu_layer.py runs each one and checks the outcome). They use the same
// runtime header as csrc/cuda, so MB_SHARED and launch<> are the ones the library's kernels use.
#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>

#include "../../csrc/cuda/runtime.cuh"

namespace mbemu_selftest {
namespace {

using maskedbranch::cuda::current_stream;
using maskedbranch::cuda::launch;

constexpr int kBlock = 64;

__device__ int tid() { return static_cast<int>(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)); }

// out[block * 64 + t] = 100 * block + (t + 1) % 64, read from a neighbour through shared memory.
template <bool kBarrier>
__global__ void neighbour_kernel(int64_t* out) {
  MB_SHARED(int64_t, slots, kBlock);
  const int t = tid();
  slots[t] = 100 * int64_t(blockIdx.x) + t;
  if (kBarrier) __syncthreads();
  out[blockIdx.x * kBlock + t] = slots[(t + 1) % kBlock];
}

// Thread 5 returns before the barrier that the others wait at.
__global__ void skipped_barrier_kernel(int64_t* out) {
  if (tid() == 5) return;
  __syncthreads();
  out[tid()] = 1;
}

// Even threads wait at one barrier, odd threads at another.
__global__ void divergent_barriers_kernel(int64_t* out) {
  if (tid() % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[tid()] = 1;
}

// Each shuffle's result for v = 10 * t: down 3, up 2, xor 5, lane 7, down 3 within groups of 8.
__global__ void shuffles_kernel(int64_t* out) {
  const int t = tid();
  const int64_t v = 10 * t;
  out[5 * t + 0] = __shfl_down_sync(0xffffffffu, v, 3);
  out[5 * t + 1] = __shfl_up_sync(0xffffffffu, v, 2);
  out[5 * t + 2] = __shfl_xor_sync(0xffffffffu, v, 5);
  out[5 * t + 3] = __shfl_sync(0xffffffffu, v, 7);
  out[5 * t + 4] = __shfl_down_sync(0xffffffffu, v, 3, 8);
}

// A warp-shuffle tree sum of doubles, as combine's reduction does it; lane 0 writes it.
__global__ void warp_sum_kernel(double* out) {
  double v = 1.0 + tid();
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  if (tid() % 32 == 0) out[tid() / 32] = v;
}

__global__ void partial_mask_kernel(int64_t* out) { out[tid()] = __shfl_down_sync(0x0000ffffu, int64_t(tid()), 1); }

// Lane 3 returns; its warp's other lanes wait for it at a shuffle.
__global__ void lane_returns_kernel(int64_t* out) {
  if (tid() == 3) return;
  out[tid()] = __shfl_down_sync(0xffffffffu, int64_t(tid()), 1);
}

// Lanes 1-31 wait at a shuffle for lane 0, which waits at the block barrier for them: a deadlock.
__global__ void shuffle_vs_barrier_kernel(int64_t* out) {
  if (tid() >= 1 && tid() < 32) out[tid()] = __shfl_down_sync(0xffffffffu, int64_t(tid()), 1);
  __syncthreads();
}

__global__ void assert_kernel(int64_t* out) {
  CUDA_KERNEL_ASSERT_MSG(!(blockIdx.x == 1 && threadIdx.x == 3 && threadIdx.y == 1), "selftest: the assert fired");
  out[tid()] = 1;
}

// ticket[t]: the order in which threads passed two barriers (out: 2 * block threads).
__global__ void order_kernel(int64_t* out) {
  MB_SHARED(int64_t, counter, 1);
  const int n = static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
  if (tid() == 0) counter[0] = 0;
  __syncthreads();
  out[tid()] = __atomic_fetch_add(&counter[0], int64_t(1), __ATOMIC_SEQ_CST);
  __syncthreads();
  out[n + tid()] = __atomic_fetch_add(&counter[0], int64_t(1), __ATOMIC_SEQ_CST) - n;
}

__global__ void shared_overflow_kernel(int64_t* out) {
  MB_SHARED(int64_t, slots, kBlock);
  slots[tid()] = tid();
  __syncthreads();
  if (tid() == 0) slots[kBlock] = 1;  // one past the end
  out[tid()] = slots[tid()];
}

__global__ void global_overflow_kernel(int64_t* out, int64_t n) {
  if (tid() == 0) out[n] = 1;  // one past the end
}

__global__ void too_much_shared_kernel(int64_t* out) {
  MB_SHARED(int64_t, big, 7 * 1024);  // 56 KiB
  big[tid()] = 1;
  out[tid()] = big[tid()];
}

// Every thread of a 1024-thread block passes a barrier and reads a value another thread wrote.
__global__ void big_block_kernel(int64_t* out) {
  MB_SHARED(int64_t, slots, 1024);
  slots[tid()] = tid();
  __syncthreads();
  out[tid()] = slots[1023 - tid()];
}

}  // namespace

void selftest(const std::string& name, const at::Tensor& out) {
  TORCH_CHECK(out.is_contiguous() && out.numel() > 0, "selftest: out must be contiguous and not empty");
  int64_t* o = out.scalar_type() == at::kLong ? out.data_ptr<int64_t>() : nullptr;
  const auto s = current_stream();
  const std::map<std::string, std::function<void()>> cases = {
      {"neighbour", [&] { launch<neighbour_kernel<true>>(dim3(2), dim3(kBlock), s, o); }},
      {"missing_barrier", [&] { launch<neighbour_kernel<false>>(dim3(2), dim3(kBlock), s, o); }},
      {"skipped_barrier", [&] { launch<skipped_barrier_kernel>(dim3(1), dim3(kBlock), s, o); }},
      {"divergent_barriers", [&] { launch<divergent_barriers_kernel>(dim3(1), dim3(kBlock), s, o); }},
      {"shuffles", [&] { launch<shuffles_kernel>(dim3(1), dim3(kBlock), s, o); }},
      {"warp_sum", [&] { launch<warp_sum_kernel>(dim3(1), dim3(kBlock), s, out.data_ptr<double>()); }},
      {"partial_mask", [&] { launch<partial_mask_kernel>(dim3(1), dim3(kBlock), s, o); }},
      {"lane_returns", [&] { launch<lane_returns_kernel>(dim3(1), dim3(kBlock), s, o); }},
      {"shuffle_vs_barrier", [&] { launch<shuffle_vs_barrier_kernel>(dim3(1), dim3(kBlock), s, o); }},
      {"assert", [&] { launch<assert_kernel>(dim3(2), dim3(8, 4), s, o); }},
      {"order", [&] { launch<order_kernel>(dim3(1), dim3(kBlock), s, o); }},
      {"shared_overflow", [&] { launch<shared_overflow_kernel>(dim3(1), dim3(kBlock), s, o); }},
      {"global_overflow", [&] { launch<global_overflow_kernel>(dim3(1), dim3(kBlock), s, o, out.numel()); }},
      {"too_much_shared", [&] { launch<too_much_shared_kernel>(dim3(1), dim3(kBlock), s, o); }},
      {"big_block", [&] { launch<big_block_kernel>(dim3(1), dim3(1024), s, o); }},
      {"too_many_threads", [&] { launch<big_block_kernel>(dim3(1), dim3(1025), s, o); }},
      {"grid_too_tall", [&] { launch<big_block_kernel>(dim3(1, 65536), dim3(32), s, o); }},
  };
  const auto it = cases.find(name);
  TORCH_CHECK_VALUE(it != cases.end(), "selftest: no case named '", name, "'");
  it->second();
}

}  // namespace mbemu_selftest
