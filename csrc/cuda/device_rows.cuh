// Device code shared by the CUDA kernels: 16-byte vector access, a 2-D tiling of
// (rows x chunks of a row) and branch tables passed by value.
//
// Rules every kernel here follows:
// * each output element is written by exactly one thread, sums run in a fixed order in
//   at::opmath_type precision and are rounded once, so results are bitwise deterministic;
// * products are formed with __fmul_rn/__dmul_rn, which nvcc never contracts into an FMA,
//   so `acc + w * x` rounds like the CPU kernels' separate multiply and add;
// * all element offsets are int64 (B * D may exceed 2^31);
// * everything runs on the current stream, launches are checked, nothing synchronizes.
// The runtime calls go through runtime.cuh, so that the host emulation (tests/cuda_emu) runs
// this code too.
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/macros/Macros.h>

#include "runtime.cuh"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace maskedbranch {
namespace cuda {

constexpr int kThreads = 256;       // threads per block of every kernel
constexpr int kUnroll = 4;          // vectors in flight per thread and row
constexpr int kTableCapacity = 64;  // branches passed by value to a kernel; more go through a device table
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMaxGrid1d = int64_t(1) << 16;  // blocks of a 1-D grid-stride loop

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T val[N];
};

// Elements per 16-byte vector.
template <typename T>
constexpr int vec_width() {
  return 16 / static_cast<int>(sizeof(T));
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The vector path needs 16-byte aligned bases and rows a whole number of vectors long.
// Null pointers (absent or empty tensors) are never dereferenced and do not count.
template <typename T>
bool can_vectorize(int64_t row_numel, const std::vector<const void*>& ptrs) {
  if (row_numel % vec_width<T>() != 0) return false;
  for (const void* p : ptrs)
    if (p != nullptr && !aligned16(p)) return false;
  return true;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Products that are never fused with a following add.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// 1-D grid-stride launches.
inline unsigned grid_1d(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(ceil_div(n, kThreads), grid_limit(kMaxGrid1d))));
}

// A tensor's data, or null when it is absent or empty (never dereferenced then).
template <typename T>
T* data_or_null(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.data_ptr<T>() : nullptr;
}

template <typename T>
const T* const_data_or_null(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.const_data_ptr<T>() : nullptr;
}

// ------------------------------------------------------------------------------------------
// Row tiling. A block is tx x ty threads: tx threads along a row (the largest power of two
// not above the row's vector count, at most kThreads, so no thread of a row idles), ty rows
// side by side, so that short rows still fill a block. blockIdx.x selects a chunk of
// tx * kUnroll vectors of the row, blockIdx.y (grid-stride) a group of ty rows. Each thread
// handles at most kUnroll vectors per row: columns first + u * tx, u < kUnroll.

struct RowTiling {
  dim3 grid;
  dim3 block;
  int64_t chunk;  // vectors per block column, = block.x * kUnroll
};

inline RowTiling row_tiling(int64_t rows, int64_t row_vecs) {
  int tx = 1;
  while (tx < kThreads && 2 * int64_t(tx) <= row_vecs) tx <<= 1;
  const int ty = kThreads / tx;
  const int64_t chunk = int64_t(tx) * kUnroll;
  const int64_t gx = ceil_div(row_vecs, chunk);
  const int64_t gy = std::max<int64_t>(1, std::min(ceil_div(rows, ty), grid_limit(kMaxGridY)));
  TORCH_CHECK(gx <= std::numeric_limits<int32_t>::max(), "maskedbranch: rows of ", row_vecs,
              " vectors are too long for one launch");
  return {dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), dim3(tx, ty), chunk};
}

struct ThreadCols {
  int64_t first;  // first column of this thread
  int64_t end;    // end of this block's chunk
};

__device__ __forceinline__ ThreadCols thread_cols(int64_t row_vecs, int64_t chunk) {
  const int64_t c0 = int64_t(blockIdx.x) * chunk;
  return {c0 + threadIdx.x, min64(row_vecs, c0 + chunk)};
}

__device__ __forceinline__ int64_t first_row() { return int64_t(blockIdx.y) * blockDim.y + threadIdx.y; }
__device__ __forceinline__ int64_t row_stride() { return int64_t(gridDim.y) * blockDim.y; }

// ------------------------------------------------------------------------------------------
// Branch tables: one pointer per branch (its own tensor: gather's outputs, combine's inputs)
// and the packed position of each branch's first row. Up to kTableCapacity branches travel by
// value in the kernel's parameters; beyond that, one int64 table
// [ptr_0 .. ptr_{n-1}, start_0 .. start_n] in device memory, written by kernels that carry it
// in their parameters (no pinned staging buffer: kernel parameters are copied into a CUDA
// graph when one is captured, so the table is capture-safe, see make_table).

template <typename P>  // const scalar_t* (sources) or scalar_t* (destinations)
struct BranchTable {
  P ptr[kTableCapacity];
  int64_t start[kTableCapacity + 1];
  const int64_t* device_table;  // null when the arrays above hold everything
  int64_t n;

  __device__ __forceinline__ P at(int64_t i) const {
    return device_table != nullptr ? reinterpret_cast<P>(static_cast<uintptr_t>(device_table[i])) : ptr[i];
  }
  __device__ __forceinline__ int64_t first(int64_t i) const {
    return device_table != nullptr ? device_table[n + i] : start[i];
  }
  // The branch whose slice [first(i), first(i + 1)) holds packed position p (0 <= p < first(n)):
  // the last i with first(i) <= p, which skips empty branches.
  __device__ __forceinline__ int64_t branch_of(int64_t p) const {
    int64_t lo = 0, hi = n;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) >> 1;
      if (first(mid) <= p) lo = mid; else hi = mid;
    }
    return lo;
  }
};

constexpr int kTableChunk = 256;  // int64 values per table-writing launch (2 KiB of parameters)

struct TableChunk {
  int64_t* dst;
  int64_t count;
  int64_t val[kTableChunk];
};

// (A template, so that every .cu file may launch it from this header; on the table's pointer
// type, because GCC, which builds the kernels for the host emulation, instantiates a function
// template named as a template argument only where the name depends on the enclosing template.)
template <typename P>
__global__ void __launch_bounds__(kThreads) write_table_kernel(const __grid_constant__ TableChunk c) {
  for (int64_t j = threadIdx.x; j < c.count; j += blockDim.x) c.dst[j] = c.val[j];
}

// `ptrs` (n entries, null for empty branches) and `starts` (n + 1 entries). `holder` keeps the
// device table alive until the launches are queued; the caching allocator orders its reuse
// after them on the same stream (and under capture keeps it in the graph's pool).
template <typename P>
BranchTable<P> make_table(const std::vector<P>& ptrs, const std::vector<int64_t>& starts, const at::Device& device,
                          at::Tensor& holder) {
  TORCH_INTERNAL_ASSERT(starts.size() == ptrs.size() + 1);
  BranchTable<P> t;
  std::fill(std::begin(t.ptr), std::end(t.ptr), nullptr);
  std::fill(std::begin(t.start), std::end(t.start), int64_t(0));
  t.device_table = nullptr;
  t.n = static_cast<int64_t>(ptrs.size());
  if (t.n <= kTableCapacity) {
    std::copy(ptrs.begin(), ptrs.end(), t.ptr);
    std::copy(starts.begin(), starts.end(), t.start);
    return t;
  }
  std::vector<int64_t> values;
  values.reserve(2 * ptrs.size() + 1);
  for (P p : ptrs) values.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)));
  values.insert(values.end(), starts.begin(), starts.end());
  const int64_t total = static_cast<int64_t>(values.size());
  holder = at::empty({total}, at::TensorOptions().dtype(at::kLong).device(device));
  const Stream stream = current_stream();
  for (int64_t off = 0; off < total; off += kTableChunk) {
    TableChunk c;
    c.dst = holder.data_ptr<int64_t>() + off;
    c.count = std::min<int64_t>(kTableChunk, total - off);
    std::copy(values.begin() + off, values.begin() + off + c.count, c.val);
    launch<write_table_kernel<P>>(dim3(1), dim3(kThreads), stream, c);
  }
  t.device_table = holder.const_data_ptr<int64_t>();
  return t;
}

}  // namespace cuda
}  // namespace maskedbranch
