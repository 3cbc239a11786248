// The two row loops that gather and combine share: a weighted row copy into per-branch
// tensors, and a segmented sum out of them. The rules they follow and the tiling are in
// device_rows.cuh, the checks of hand-made plans in plan_asserts.cuh.
#pragma once
#include "plan_asserts.cuh"

namespace maskedbranch {
namespace cuda {

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
  const Stream stream = current_stream();
  if (row_numel == 0) {
    launch<check_rows_kernel<scalar_t>>(dim3(grid_1d(num_entries)), dim3(kThreads), stream, rows, num_entries, src_rows);
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
    launch<gather_kernel<scalar_t, kVec>>(t.grid, t.block, stream, P);
  } else {
    launch<gather_kernel<scalar_t, 1>>(t.grid, t.block, stream, P);
  }
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
  const Stream stream = current_stream();
  constexpr int kVec = vec_width<scalar_t>();
  const bool vec = can_vectorize<scalar_t>(row_numel, all);
  P.row_vecs = vec ? row_numel / kVec : row_numel;
  const RowTiling t = row_tiling(batch, P.row_vecs);
  P.chunk = t.chunk;
  if (vec) {
    launch<segment_sum_kernel<scalar_t, kVec>>(t.grid, t.block, stream, P);
  } else {
    launch<segment_sum_kernel<scalar_t, 1>>(t.grid, t.block, stream, P);
  }
}

}  // namespace cuda
}  // namespace maskedbranch
