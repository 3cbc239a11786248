// Device code shared by the CUDA routing kernels: 16-byte vector access, a 2-D tiling of
// (rows x chunks of a row), branch tables passed by value, the checks of hand-made plans, and
// the two row loops that gather and combine share (a weighted row copy into per-branch
// tensors, and a segmented sum out of them).
//
// Rules every kernel here follows:
// * each output element is written by exactly one thread, sums run in a fixed order in
//   at::opmath_type precision and are rounded once, so results are bitwise deterministic;
// * products are formed with __fmul_rn/__dmul_rn, which nvcc never contracts into an FMA,
//   so `acc + w * x` rounds like the CPU kernels' separate multiply and add;
// * all element offsets are int64 (B * D may exceed 2^31);
// * everything runs on the current stream, launches are checked, nothing synchronizes.
//
// Hand-made plans (docs: why device asserts and not a host check). The CPU kernels check plan
// values on the host (csrc/cpu/plan_checks.h) and raise. Here the values live on the device,
// and checking them on the host would cost a device->host copy, that is a synchronization, in
// every op, which the routing path promises not to do (the plan's readback is the only one).
// So the kernels assert the same conditions on the device (CUDA_KERNEL_ASSERT_MSG, active in
// release builds), like ATen's own index ops do for out-of-range indices: a bad plan stops the
// kernel before it reads or writes out of bounds, and the error names the argument. A device
// assert leaves the CUDA context unusable, so it is for hand-made plans only: plans from the
// plan op (and make_plan) are valid by construction. To check a hand-made plan recoverably,
// call the op on CPU copies first (the same conditions, raised as Python exceptions).
// The per-row form of the CPU's conditions is in assert_row_span / checked_branch below; a plan
// passes them for every row iff it passes the CPU's whole-plan checks (see there).
#pragma once
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>

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
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(ceil_div(n, kThreads), kMaxGrid1d)));
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
  const int64_t gy = std::max<int64_t>(1, std::min(ceil_div(rows, ty), kMaxGridY));
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

// (Templates, so that every .cu file may launch them from this header.)
template <int = 0>
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
  auto stream = at::cuda::getCurrentCUDAStream();
  for (int64_t off = 0; off < total; off += kTableChunk) {
    TableChunk c;
    c.dst = holder.data_ptr<int64_t>() + off;
    c.count = std::min<int64_t>(kTableChunk, total - off);
    std::copy(values.begin() + off, values.begin() + off + c.count, c.val);
    write_table_kernel<><<<1, kThreads, 0, stream>>>(c);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  t.device_table = holder.const_data_ptr<int64_t>();
  return t;
}

// ------------------------------------------------------------------------------------------
// Plan checks, per row. The CPU (csrc/cpu/plan_checks.h) requires row_offsets[0] == 0,
// row_offsets[B] == M, row_offsets ascending, and for every entry e: 0 <= row_branch[e] < N and
// row_pos[e] in branch row_branch[e]'s slice. Per row b with entries [e0, e1) that is: 0 <= e0
// <= e1 <= M, e0 == 0 for the first row, e1 == M for the last. If every row passes, the offsets
// ascend from 0 to M and the rows' entries cover [0, M), so every entry is checked; if the CPU
// rejects a plan, some row (or some entry of a row) fails here. B == 0 has no rows: then
// check_row_plan_kernel checks row_offsets[0] == 0 == M with one thread.

__device__ __forceinline__ void assert_row_span(int64_t b, int64_t batch, int64_t e0, int64_t e1, int64_t m) {
  CUDA_KERNEL_ASSERT_MSG(0 <= e0 && e0 <= e1 && e1 <= m,
                         "row_offsets: not ascending within [0, number of entries] (hand-made plan)");
  CUDA_KERNEL_ASSERT_MSG(b != 0 || e0 == 0, "row_offsets: expected to start at 0 (hand-made plan)");
  CUDA_KERNEL_ASSERT_MSG(b != batch - 1 || e1 == m,
                         "row_offsets: expected to end at the number of entries (hand-made plan)");
}

// Entry e's branch, after checking it and its packed position.
template <typename P>
__device__ __forceinline__ int64_t checked_branch(const BranchTable<P>& t, const int64_t* row_branch,
                                                  const int64_t* row_pos, int64_t e) {
  const int64_t i = row_branch[e];
  CUDA_KERNEL_ASSERT_MSG(i >= 0 && i < t.n, "row_branch: entry out of range [0, number of branches) (hand-made plan)");
  const int64_t pos = row_pos[e];
  CUDA_KERNEL_ASSERT_MSG(pos >= t.first(i) && pos < t.first(i + 1),
                         "row_pos: entry outside its branch's rows (hand-made plan)");
  return i;
}

// The checks alone, for calls whose main kernel has nothing to compute (no rows, or rows of
// zero elements), so that the same plans are rejected as on the CPU.
template <typename P>
struct RowPlanCheck {
  const int64_t* row_offsets;
  const int64_t* row_branch;
  const int64_t* row_pos;
  int64_t batch;
  int64_t num_entries;
  BranchTable<P> table;
};

template <typename P>
__global__ void __launch_bounds__(kThreads) check_row_plan_kernel(const __grid_constant__ RowPlanCheck<P> c) {
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c.batch == 0 && tid == 0) {
    CUDA_KERNEL_ASSERT_MSG(c.row_offsets[0] == 0 && c.num_entries == 0,
                           "row_offsets: expected to run from 0 to the number of entries (hand-made plan)");
  }
  for (int64_t b = tid; b < c.batch; b += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e0 = c.row_offsets[b];
    const int64_t e1 = c.row_offsets[b + 1];
    assert_row_span(b, c.batch, e0, e1, c.num_entries);
    for (int64_t e = e0; e < e1; ++e) checked_branch(c.table, c.row_branch, c.row_pos, e);
  }
}

template <typename P>
void launch_check_row_plan(const int64_t* row_offsets, const int64_t* row_branch, const int64_t* row_pos,
                           int64_t batch, int64_t num_entries, const BranchTable<P>& table) {
  RowPlanCheck<P> c{row_offsets, row_branch, row_pos, batch, num_entries, table};
  check_row_plan_kernel<P><<<grid_1d(batch), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(c);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// gather's rows, alone (rows of zero elements).
template <int = 0>
__global__ void __launch_bounds__(kThreads) check_rows_kernel(const int64_t* rows, int64_t num_entries, int64_t src_rows) {
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < num_entries; p += int64_t(gridDim.x) * blockDim.x) {
    CUDA_KERNEL_ASSERT_MSG(rows[p] >= 0 && rows[p] < src_rows, "rows: entry out of range [0, x.size(0)) (hand-made plan)");
  }
}

// ------------------------------------------------------------------------------------------
// Gather: packed entry p (branch i's slice [first(i), first(i + 1))) goes to row p - first(i)
// of branch i's output: out_i[k] = w * src[rows[p]]. Without weights a plain copy (bit-exact);
// with weights [B, N] (opmath), w = weights[rows[p], i].

template <typename scalar_t>
struct GatherParams {
  const scalar_t* src;
  const int64_t* rows;
  const at::opmath_type<scalar_t>* weights;  // may be null
  int64_t num_entries;
  int64_t src_rows;
  int64_t row_vecs;
  int64_t chunk;
  BranchTable<scalar_t*> outs;
};

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads) gather_kernel(const __grid_constant__ GatherParams<scalar_t> P) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, kVec>;
  const ThreadCols cols = thread_cols(P.row_vecs, P.chunk);
  if (cols.first >= cols.end) return;
  const int64_t step = blockDim.x;
  for (int64_t p = first_row(); p < P.num_entries; p += row_stride()) {
    const int64_t r = P.rows[p];
    CUDA_KERNEL_ASSERT_MSG(r >= 0 && r < P.src_rows, "rows: entry out of range [0, x.size(0)) (hand-made plan)");
    const int64_t i = P.outs.branch_of(p);
    const V* in = reinterpret_cast<const V*>(P.src) + r * P.row_vecs;
    V* o = reinterpret_cast<V*>(P.outs.at(i)) + (p - P.outs.first(i)) * P.row_vecs;
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
      const opmath_t w = P.weights[r * P.outs.n + i];
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

// `outs` (N pointers, null for empty branches) with `starts` (N + 1 packed offsets).
template <typename scalar_t>
void launch_gather(const std::vector<scalar_t*>& outs, const std::vector<int64_t>& starts, const scalar_t* src,
                   const int64_t* rows, int64_t num_entries, int64_t src_rows, int64_t row_numel,
                   const at::opmath_type<scalar_t>* weights, const at::Device& device) {
  if (num_entries == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  if (row_numel == 0) {
    check_rows_kernel<><<<grid_1d(num_entries), kThreads, 0, stream>>>(rows, num_entries, src_rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  GatherParams<scalar_t> P;
  at::Tensor holder;
  P.outs = make_table<scalar_t*>(outs, starts, device, holder);
  P.src = src;
  P.rows = rows;
  P.weights = weights;
  P.num_entries = num_entries;
  P.src_rows = src_rows;
  std::vector<const void*> all(outs.begin(), outs.end());
  all.push_back(src);
  constexpr int kVec = vec_width<scalar_t>();
  const bool vec = can_vectorize<scalar_t>(row_numel, all);
  P.row_vecs = vec ? row_numel / kVec : row_numel;
  const RowTiling t = row_tiling(num_entries, P.row_vecs);
  P.chunk = t.chunk;
  if (vec) {
    gather_kernel<scalar_t, kVec><<<t.grid, t.block, 0, stream>>>(P);
  } else {
    gather_kernel<scalar_t, 1><<<t.grid, t.block, 0, stream>>>(P);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ------------------------------------------------------------------------------------------
// Segmented sum (combine, which is also gather's backward):
//   out[b] = base[b] + sum over e in [row_offsets[b], row_offsets[b+1]) of w_e * src_e
// where entry e reads row (row_pos[e] - first(i)) of source i = row_branch[e] and
// w_e = weights[b, i] (1 without weights). Entries are added in CSR order.

template <typename scalar_t>
struct SegmentSumParams {
  scalar_t* out;
  const scalar_t* base;                      // may be null
  const int64_t* row_offsets;                // [B + 1]
  const int64_t* row_branch;                 // [M]
  const int64_t* row_pos;                    // [M]
  const at::opmath_type<scalar_t>* weights;  // [B, N] or null
  int64_t batch;
  int64_t num_entries;
  int64_t row_vecs;
  int64_t chunk;
  BranchTable<const scalar_t*> sources;
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
    assert_row_span(b, P.batch, e0, e1, P.num_entries);
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
      const int64_t i = checked_branch(P.sources, P.row_branch, P.row_pos, e);
      const V* in = reinterpret_cast<const V*>(P.sources.at(i)) + (P.row_pos[e] - P.sources.first(i)) * P.row_vecs;
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
                        const std::vector<int64_t>& starts, const int64_t* row_offsets, const int64_t* row_branch,
                        const int64_t* row_pos, int64_t batch, int64_t num_entries, int64_t row_numel,
                        const at::opmath_type<scalar_t>* weights, const at::Device& device) {
  at::Tensor holder;
  SegmentSumParams<scalar_t> P;
  P.sources = make_table<const scalar_t*>(sources, starts, device, holder);
  if (batch == 0 || row_numel == 0) {
    launch_check_row_plan(row_offsets, row_branch, row_pos, batch, num_entries, P.sources);
    return;
  }
  P.out = out;
  P.base = base;
  P.row_offsets = row_offsets;
  P.row_branch = row_branch;
  P.row_pos = row_pos;
  P.weights = weights;
  P.batch = batch;
  P.num_entries = num_entries;
  std::vector<const void*> all(sources.begin(), sources.end());
  all.push_back(out);
  all.push_back(base);
  auto stream = at::cuda::getCurrentCUDAStream();
  constexpr int kVec = vec_width<scalar_t>();
  const bool vec = can_vectorize<scalar_t>(row_numel, all);
  P.row_vecs = vec ? row_numel / kVec : row_numel;
  const RowTiling t = row_tiling(batch, P.row_vecs);
  P.chunk = t.chunk;
  if (vec) {
    segment_sum_kernel<scalar_t, kVec><<<t.grid, t.block, 0, stream>>>(P);
  } else {
    segment_sum_kernel<scalar_t, 1><<<t.grid, t.block, 0, stream>>>(P);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace maskedbranch
