// What the kernels' host code needs from the CUDA runtime, in one place: the stream, kernel
// launches, the device guard, the capture check, the plan's one readback, and the limits the
// launch code clamps grids to. Everything else in csrc/cuda (kernel bodies, grid sizes,
// vector-width dispatch, branch tables) is plain code that two compilers build:
// * nvcc, for the library (this header maps the calls onto ATen's CUDA API);
// * the host compiler with MASKEDBRANCH_CUDA_EMULATION, for the tests only: tests/cuda_emu
//   runs the same kernels on CPU threads (its header cuda_emulation.h, found through that
//   build's include path, says what it models and what it does not).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#ifndef MASKEDBRANCH_CUDA_EMULATION
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#else
#include <cuda_emulation.h>
#endif

namespace maskedbranch {
namespace cuda {

#ifndef MASKEDBRANCH_CUDA_EMULATION

using Stream = cudaStream_t;
using DeviceGuard = c10::cuda::CUDAGuard;

inline Stream current_stream() { return at::cuda::getCurrentCUDAStream(); }

// Kernel<<<grid, block, 0, stream>>>(args...), checked.
template <auto Kernel, typename... Args>
void launch(dim3 grid, dim3 block, Stream stream, const Args&... args) {
  Kernel<<<grid, block, 0, stream>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

inline bool stream_is_capturing(Stream stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  return capture != cudaStreamCaptureStatusNone;
}

// Host memory for the readback (pinned: the copy is then a single DMA).
inline at::TensorOptions readback_options() { return at::TensorOptions().dtype(at::kLong).pinned_memory(true); }

inline void copy_to_host_and_sync(void* dst, const void* src, int64_t bytes, Stream stream) {
  c10::cuda::memcpy_and_sync(dst, src, bytes, cudaMemcpyDeviceToHost, stream);
}

// The most blocks a grid-stride dimension gets (the hardware's or the launch code's limit).
inline int64_t grid_limit(int64_t limit) { return limit; }

// The plan kernels count in int32 up to this many (row, branch) entries, in int64 beyond.
inline int64_t int32_plan_limit() { return std::numeric_limits<int32_t>::max(); }

#define MB_SHARED(type, name, count) __shared__ type name[count]

#else  // the host emulation

using Stream = mbemu::Stream;

struct DeviceGuard {
  explicit DeviceGuard(const at::Device&) {}
};

inline Stream current_stream() { return Stream{}; }

template <auto Kernel, typename... Args>
void launch(dim3 grid, dim3 block, Stream, const Args&... args) {
  mbemu::launch<Kernel>(grid, block, args...);
}

inline bool stream_is_capturing(Stream) { return false; }

inline at::TensorOptions readback_options() { return at::TensorOptions().dtype(at::kLong); }

inline void copy_to_host_and_sync(void* dst, const void* src, int64_t bytes, Stream) {
  mbemu::copy_bytes(dst, src, bytes);
}

// The tests lower these to reach, with small inputs, the paths that big ones take: later rounds
// of the grid-stride loops, and int64 counting in the plan kernels.
inline int64_t grid_limit(int64_t limit) { return std::min(limit, mbemu::limits().grid_blocks); }
inline int64_t int32_plan_limit() {
  return std::min<int64_t>(std::numeric_limits<int32_t>::max(), mbemu::limits().int32_plan_entries);
}

#define MB_SHARED(type, name, count) type* name = ::mbemu::shared_array<type>(count, __FILE__, __LINE__)

#endif

}  // namespace cuda
}  // namespace maskedbranch
