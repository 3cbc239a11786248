// Device code shared by the CUDA routing kernels: 16-byte vector access, a 2-D tiling of
// (rows x chunks of a row), branch tables passed by value, and the two row loops that
// gather, combine and their backwards share (a weighted row copy and a segmented sum).
//
// Rules every kernel here follows:
// * each output element is written by exactly one thread, sums run in a fixed order in
//   at::opmath_type precision and are rounded once, so results are bitwise deterministic;
// * products are formed with __fmul_rn/__dmul_rn, which nvcc never contracts into an FMA,
//   so `acc + w * x` rounds like the CPU kernels' separate multiply and add;
// * all element offsets are int64 (B * D may exceed 2^31);
// * plan contents live on the device and are not validated on the host (that would need a
//   synchronization); entries out of range trip a device-side assert instead of reading or
//   writing out of bounds.
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <vector>

namespace maskedbranch {
namespace cuda {

constexpr int kThreads = 256;        // threads per block of every kernel
constexpr int kUnroll = 4;           // vectors in flight per thread and row
constexpr int kTableCapacity = 64;   // branches passed by value to a kernel; more go through a device table
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
// Null pointers (absent or empty inputs) are never dereferenced and do not count.
template <typename T>
bool can_vectorize(int64_t row_numel, std::initializer_list<const void*> ptrs) {
  if (row_numel % vec_width<T>() != 0) return false;
  for (const void* p : ptrs)
    if (p != nullptr && !aligned16(p)) return false;
  return true;
}

template <typename T>
bool can_vectorize(int64_t row_numel, const std::vector<const T*>& ptrs) {
  if (row_numel % vec_width<T>() != 0) return false;
  for (const T* p : ptrs)
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
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(ceil_div(n, kThreads), kMaxGrid1d)));
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
  const int64_t gy = std::min(ceil_div(rows, ty), kMaxGridY);
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
// Branch tables. Up to kTableCapacity branches travel by value in the kernel's parameters
// (read through __grid_constant__, no local copy); beyond that, one int64 table
// [ptr_0 .. ptr_{n-1}, start_0 .. start_n] is copied to the device asynchronously.

template <typename scalar_t>
struct Sources {
  const scalar_t* ptr[kTableCapacity];
  int64_t start[kTableCapacity + 1];
  const int64_t* device_table;  // null when the table above holds everything
  int64_t n;

  __device__ __forceinline__ const scalar_t* source(int64_t i) const {
    return device_table != nullptr ? reinterpret_cast<const scalar_t*>(device_table[i]) : ptr[i];
  }
  __device__ __forceinline__ int64_t first(int64_t i) const {
    return device_table != nullptr ? device_table[n + i] : start[i];
  }
  // The branch whose slice [first(i), first(i + 1)) holds packed position p (0 <= p < first(n)).
  __device__ __forceinline__ int64_t branch_of(int64_t p) const {
    int64_t lo = 0, hi = n;
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) >> 1;
      if (first(mid) <= p) lo = mid; else hi = mid;
    }
    return lo;
  }
};

// `ptrs` (n entries, may be null for empty branches) and `starts` (n + 1 entries). `holder`
// keeps the device table alive until the launch is queued; the caching allocator orders its
// reuse after the kernel on the same stream.
template <typename scalar_t>
Sources<scalar_t> make_sources(const std::vector<const scalar_t*>& ptrs, const std::vector<int64_t>& starts,
                               const at::Device& device, at::Tensor& holder) {
  TORCH_INTERNAL_ASSERT(starts.size() == ptrs.size() + 1);
  Sources<scalar_t> s;
  std::fill(std::begin(s.ptr), std::end(s.ptr), nullptr);
  std::fill(std::begin(s.start), std::end(s.start), int64_t(0));
  s.device_table = nullptr;
  s.n = static_cast<int64_t>(ptrs.size());
  if (s.n <= kTableCapacity) {
    std::copy(ptrs.begin(), ptrs.end(), s.ptr);
    std::copy(starts.begin(), starts.end(), s.start);
    return s;
  }
  // Pinned staging + non_blocking copy: no synchronization (the host allocator records an
  // event so the staging buffer is not reused before the copy has run).
  const int64_t n = s.n;
  at::Tensor host = at::empty({2 * n + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) h[i] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptrs[i]));
  std::copy(starts.begin(), starts.end(), h + n);
  holder = at::empty({2 * n + 1}, at::TensorOptions().dtype(at::kLong).device(device));
  holder.copy_(host, /*non_blocking=*/true);
  s.device_table = holder.const_data_ptr<int64_t>();
  return s;
}

// ------------------------------------------------------------------------------------------
// Weighted row copy: out[p] = w_p * src[rows[p]] for p in [0, M). Without weights a plain
// copy (bit-exact); with weights [B, N] (opmath), w_p = weights[rows[p], i] where p lies in
// branch i's slice of `branches` (its starts; pointers unused).

template <typename scalar_t>
struct GatherRowsParams {
  scalar_t* out;
  const scalar_t* src;
  const int64_t* rows;
  const at::opmath_type<scalar_t>* weights;  // may be null
  int64_t num_entries;
  int64_t src_rows;
  int64_t row_vecs;
  int64_t chunk;
  Sources<scalar_t> branches;
};

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    gather_rows_kernel(const __grid_constant__ GatherRowsParams<scalar_t> P) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, kVec>;
  const ThreadCols cols = thread_cols(P.row_vecs, P.chunk);
  if (cols.first >= cols.end) return;
  const int64_t step = blockDim.x;
  for (int64_t p = first_row(); p < P.num_entries; p += row_stride()) {
    const int64_t r = P.rows[p];
    CUDA_KERNEL_ASSERT(r >= 0 && r < P.src_rows);
    const V* in = reinterpret_cast<const V*>(P.src) + r * P.row_vecs;
    V* o = reinterpret_cast<V*>(P.out) + p * P.row_vecs;
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = cols.first + u * step;
      if (j < cols.end) v[u] = in[j];
    }
    if (P.weights == nullptr) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = cols.first + u * step;
        if (j < cols.end) o[j] = v[u];
      }
    } else {
      const int64_t i = P.branches.branch_of(p);
      const opmath_t w = P.weights[r * P.branches.n + i];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = cols.first + u * step;
        if (j < cols.end) {
          V t;
#pragma unroll
          for (int k = 0; k < kVec; ++k) t.val[k] = static_cast<scalar_t>(mul_rn(w, static_cast<opmath_t>(v[u].val[k])));
          o[j] = t;
        }
      }
    }
  }
}

// `starts` (N + 1 entries) is only read with weights.
template <typename scalar_t>
void launch_gather_rows(scalar_t* out, const scalar_t* src, const int64_t* rows, int64_t num_entries,
                        int64_t src_rows, int64_t row_numel, const at::opmath_type<scalar_t>* weights,
                        const std::vector<int64_t>& starts, const at::Device& device) {
  if (num_entries == 0 || row_numel == 0) return;
  GatherRowsParams<scalar_t> P;
  at::Tensor holder;
  if (weights != nullptr) {
    P.branches = make_sources<scalar_t>(std::vector<const scalar_t*>(starts.size() - 1, nullptr), starts,
                                        device, holder);
  } else {
    P.branches = make_sources<scalar_t>({nullptr}, {0, num_entries}, device, holder);
  }
  P.out = out;
  P.src = src;
  P.rows = rows;
  P.weights = weights;
  P.num_entries = num_entries;
  P.src_rows = src_rows;
  auto stream = at::cuda::getCurrentCUDAStream();
  constexpr int kVec = vec_width<scalar_t>();
  if (can_vectorize<scalar_t>(row_numel, {out, src})) {
    P.row_vecs = row_numel / kVec;
    const RowTiling t = row_tiling(num_entries, P.row_vecs);
    P.chunk = t.chunk;
    gather_rows_kernel<scalar_t, kVec><<<t.grid, t.block, 0, stream>>>(P);
  } else {
    P.row_vecs = row_numel;
    const RowTiling t = row_tiling(num_entries, P.row_vecs);
    P.chunk = t.chunk;
    gather_rows_kernel<scalar_t, 1><<<t.grid, t.block, 0, stream>>>(P);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ------------------------------------------------------------------------------------------
// Segmented sum (combine and gather's backward):
//   out[b] = base[b] + sum over e in [row_offsets[b], row_offsets[b+1]) of w_e * src_e
// where entry e reads row (row_pos[e] - first(i)) of source i = row_branch[e] (0 without
// row_branch) and w_e = weights[b, i] (1 without weights). Entries are added in CSR order.

template <typename scalar_t>
struct SegmentSumParams {
  scalar_t* out;
  const scalar_t* base;        // may be null
  const int64_t* row_offsets;  // [B + 1]
  const int64_t* row_branch;   // [M] or null (one source)
  const int64_t* row_pos;      // [M]
  const at::opmath_type<scalar_t>* weights;  // [B, N] or null
  int64_t batch;
  int64_t num_entries;
  int64_t row_vecs;
  int64_t chunk;
  Sources<scalar_t> sources;
};

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads)
    segment_sum_kernel(const __grid_constant__ SegmentSumParams<scalar_t> P) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, kVec>;
  const ThreadCols cols = thread_cols(P.row_vecs, P.chunk);
  if (cols.first >= cols.end) return;
  const int64_t step = blockDim.x;
  for (int64_t b = first_row(); b < P.batch; b += row_stride()) {
    const int64_t e0 = P.row_offsets[b];
    const int64_t e1 = P.row_offsets[b + 1];
    CUDA_KERNEL_ASSERT(e0 >= 0 && e0 <= e1 && e1 <= P.num_entries);
    opmath_t acc[kUnroll][kVec];
    if (P.base != nullptr) {
      const V* in = reinterpret_cast<const V*>(P.base) + b * P.row_vecs;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = cols.first + u * step;
        V v;
        if (j < cols.end) v = in[j];
#pragma unroll
        for (int k = 0; k < kVec; ++k) acc[u][k] = j < cols.end ? static_cast<opmath_t>(v.val[k]) : opmath_t(0);
      }
    } else {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int k = 0; k < kVec; ++k) acc[u][k] = opmath_t(0);
    }
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t i = P.row_branch != nullptr ? P.row_branch[e] : 0;
      CUDA_KERNEL_ASSERT(i >= 0 && i < P.sources.n);
      const int64_t s0 = P.sources.first(i);
      const int64_t pos = P.row_pos[e];
      CUDA_KERNEL_ASSERT(pos >= s0 && pos < P.sources.first(i + 1));
      const V* in = reinterpret_cast<const V*>(P.sources.source(i)) + (pos - s0) * P.row_vecs;
      V v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = cols.first + u * step;
        if (j < cols.end) v[u] = in[j];
      }
      if (P.weights == nullptr) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int k = 0; k < kVec; ++k)
            if (cols.first + u * step < cols.end) acc[u][k] += static_cast<opmath_t>(v[u].val[k]);
      } else {
        const opmath_t w = P.weights[b * P.sources.n + i];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int k = 0; k < kVec; ++k)
            if (cols.first + u * step < cols.end) acc[u][k] += mul_rn(w, static_cast<opmath_t>(v[u].val[k]));
      }
    }
    V* o = reinterpret_cast<V*>(P.out) + b * P.row_vecs;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = cols.first + u * step;
      if (j < cols.end) {
        V t;
#pragma unroll
        for (int k = 0; k < kVec; ++k) t.val[k] = static_cast<scalar_t>(acc[u][k]);
        o[j] = t;
      }
    }
  }
}

// `sources` (N pointers, null for empty ones) with `starts` (N + 1 packed offsets).
template <typename scalar_t>
void launch_segment_sum(scalar_t* out, const scalar_t* base, const std::vector<const scalar_t*>& sources,
                        const std::vector<int64_t>& starts, const int64_t* row_offsets,
                        const int64_t* row_branch, const int64_t* row_pos, int64_t batch,
                        int64_t num_entries, int64_t row_numel, const at::opmath_type<scalar_t>* weights,
                        const at::Device& device) {
  if (batch == 0 || row_numel == 0) return;
  SegmentSumParams<scalar_t> P;
  at::Tensor holder;
  P.sources = make_sources<scalar_t>(sources, starts, device, holder);
  P.out = out;
  P.base = base;
  P.row_offsets = row_offsets;
  P.row_branch = row_branch;
  P.row_pos = row_pos;
  P.weights = weights;
  P.batch = batch;
  P.num_entries = num_entries;
  std::vector<const scalar_t*> all = sources;
  all.push_back(out);
  all.push_back(base);
  auto stream = at::cuda::getCurrentCUDAStream();
  constexpr int kVec = vec_width<scalar_t>();
  if (can_vectorize<scalar_t>(row_numel, all)) {
    P.row_vecs = row_numel / kVec;
    const RowTiling t = row_tiling(batch, P.row_vecs);
    P.chunk = t.chunk;
    segment_sum_kernel<scalar_t, kVec><<<t.grid, t.block, 0, stream>>>(P);
  } else {
    P.row_vecs = row_numel;
    const RowTiling t = row_tiling(batch, P.row_vecs);
    P.chunk = t.chunk;
    segment_sum_kernel<scalar_t, 1><<<t.grid, t.block, 0, stream>>>(P);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

}  // namespace cuda
}  // namespace maskedbranch
