// combine (CUDA): out = base + weighted sum of the branch outputs, read where they are (a table
// of per-branch pointers, never concatenated; it is also gather's backward); and the gradient
// of its weights (one dot product per live entry, a fixed-shape tree reduction, no atomics).
// Same outputs as csrc/cpu/combine.cpp; the weights' gradient differs from the CPU only by
// summation order. Plan values are checked on the device (plan_asserts.cuh).
#include <torch/library.h>

#include "../op_args.h"
#include "ops.h"
#include "row_kernels.cuh"

namespace maskedbranch {
namespace cuda {
namespace {

template <typename scalar_t>
std::vector<const scalar_t*> source_ptrs(const std::vector<at::Tensor>& ys) {
  std::vector<const scalar_t*> ptrs;
  ptrs.reserve(ys.size());
  for (const auto& y : ys) ptrs.push_back(const_data_or_null<scalar_t>(y));
  return ptrs;
}

}  // namespace

at::Tensor combine_cuda(const c10::optional<at::Tensor>& base, at::TensorList ys,
                        const c10::optional<at::Tensor>& weights, const at::Tensor& row_offsets,
                        const at::Tensor& row_branch, const at::Tensor& row_pos) {
  auto a = check_combine(base, ys, weights, row_offsets, row_branch, row_pos);
  DeviceGuard device_guard(a.ref.device());
  auto out = empty_rows(a.plan.batch, a.ref.sizes().slice(1), a.ref.options(), a.format);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.ref.scalar_type(), "maskedbranch_combine_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    launch_segment_sum<scalar_t>(data_or_null<scalar_t>(out), const_data_or_null<scalar_t>(a.base),
                                 source_ptrs<scalar_t>(a.ys), a.starts, a.plan.row_offsets.const_data_ptr<int64_t>(),
                                 a.plan.row_branch.const_data_ptr<int64_t>(), a.plan.row_pos.const_data_ptr<int64_t>(),
                                 a.plan.batch, a.plan.num_entries, row_numel(a.ref),
                                 const_data_or_null<opmath_t>(a.weights), out.device());
  });
  return out;
}

namespace {

// ------------------------------------------------------------------------------------------
// combine_weights_backward: out[b, i] = <grad[b], ys[i][local]> for every live entry (b, i).
// kRowThreads threads (a warp, or the whole block) own a row; blockIdx.x picks a chunk of
// the row when rows are few and long. Each thread sums its strided vectors in order, then a
// fixed shuffle/shared-memory tree combines the threads. With one chunk the result goes
// straight to out; with several, to partial[e, chunk], summed in order by a second kernel.

template <typename scalar_t>
struct DotParams {
  const scalar_t* grad;        // [B, D]
  const int64_t* row_offsets;  // [B + 1]
  const int64_t* row_branch;   // [M]
  const int64_t* row_pos;      // [M]
  at::opmath_type<scalar_t>* out;      // [B, N] (one chunk)
  at::opmath_type<scalar_t>* partial;  // [M, chunks] (several)
  int64_t batch;
  int64_t num_entries;
  int64_t row_vecs;
  int64_t chunk;  // vectors per chunk
  int64_t chunks;
  BranchTable<const scalar_t*> sources;
};

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;  // complete in lane 0
}

template <typename scalar_t, int kVec, int kRowThreads>
__global__ void __launch_bounds__(kThreads) dot_rows_kernel(const __grid_constant__ DotParams<scalar_t> P) {
  static_assert(kRowThreads == 32 || kRowThreads == kThreads, "a warp or a block per row");
  using opmath_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, kVec>;
  constexpr int kRowsPerBlock = kThreads / kRowThreads;
  constexpr int kWarps = kThreads / 32;
  MB_SHARED(opmath_t, warp_partial, kWarps);
  const int slot = threadIdx.x / kRowThreads;
  const int lane = threadIdx.x % kRowThreads;
  const int64_t c0 = int64_t(blockIdx.x) * P.chunk;
  const int64_t c1 = min64(P.row_vecs, c0 + P.chunk);
  // The row loop and the entry loop are uniform over the threads of a row (a warp, or the
  // whole block when kRowThreads == kThreads), so the block barriers below are safe.
  for (int64_t b0 = int64_t(blockIdx.y) * kRowsPerBlock; b0 < P.batch; b0 += int64_t(gridDim.y) * kRowsPerBlock) {
    const int64_t b = b0 + slot;
    if (b >= P.batch) continue;  // only with kRowThreads == 32: a whole warp skips
    const int64_t e0 = P.row_offsets[b];
    const int64_t e1 = P.row_offsets[b + 1];
    assert_row_span(b, P.batch, e0, e1, P.num_entries);
    const V* g = reinterpret_cast<const V*>(P.grad) + b * P.row_vecs;
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t i = checked_branch(P.sources, P.row_branch, P.row_pos, e);
      const V* y = reinterpret_cast<const V*>(P.sources.at(i)) + (P.row_pos[e] - P.sources.first(i)) * P.row_vecs;
      opmath_t dot = 0;
      for (int64_t j = c0 + lane; j < c1; j += int64_t(kRowThreads) * kUnroll) {
        V gv[kUnroll], yv[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t jj = j + int64_t(u) * kRowThreads;
          if (jj < c1) {
            gv[u] = g[jj];
            yv[u] = y[jj];
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (j + int64_t(u) * kRowThreads < c1) {
#pragma unroll
            for (int k = 0; k < kVec; ++k)
              dot += mul_rn(static_cast<opmath_t>(gv[u].val[k]), static_cast<opmath_t>(yv[u].val[k]));
          }
        }
      }
      dot = warp_sum(dot);
      if constexpr (kRowThreads == kThreads) {
        const int warp = threadIdx.x / 32;
        if (threadIdx.x % 32 == 0) warp_partial[warp] = dot;
        __syncthreads();
        if (warp == 0) {
          dot = threadIdx.x < kWarps ? warp_partial[threadIdx.x] : opmath_t(0);
          dot = warp_sum(dot);
        }
        __syncthreads();  // warp_partial is reused by the next entry
      }
      if (lane == 0) {
        if (P.chunks == 1) {
          P.out[b * P.sources.n + i] = dot;
        } else {
          P.partial[e * P.chunks + blockIdx.x] = dot;
        }
      }
    }
  }
}

template <typename opmath_t>
__global__ void __launch_bounds__(kThreads)
    sum_partials_kernel(const opmath_t* __restrict__ partial, const int64_t* __restrict__ row_offsets,
                        const int64_t* __restrict__ row_branch, int64_t batch, int64_t n, int64_t chunks,
                        opmath_t* __restrict__ out) {
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b < batch; b += int64_t(gridDim.x) * blockDim.x) {
    for (int64_t e = row_offsets[b]; e < row_offsets[b + 1]; ++e) {
      opmath_t s = 0;
      for (int64_t c = 0; c < chunks; ++c) s += partial[e * chunks + c];
      out[b * n + row_branch[e]] = s;
    }
  }
}

// Rows of at most this many vectors get a warp each; longer ones a block.
constexpr int64_t kWarpRowVecs = 512;
// With few rows, long rows are split until about this many blocks run (a constant, so the
// summation order, hence the result, does not depend on the GPU model)...
constexpr int64_t kTargetBlocks = 1024;
// ...but never into chunks shorter than this many vectors.
constexpr int64_t kMinChunkVecs = 2048;

template <typename scalar_t, int kVec>
void launch_dot_rows(DotParams<scalar_t>& P, int64_t n, const at::TensorOptions& opmath_opts) {
  const Stream stream = current_stream();
  using opmath_t = at::opmath_type<scalar_t>;
  if (P.row_vecs <= kWarpRowVecs) {
    P.chunk = std::max<int64_t>(P.row_vecs, 1);
    P.chunks = 1;
    const dim3 grid(1, static_cast<unsigned>(std::min(ceil_div(P.batch, kThreads / 32), grid_limit(kMaxGridY))));
    launch<dot_rows_kernel<scalar_t, kVec, 32>>(grid, dim3(kThreads), stream, P);
    return;
  }
  int64_t chunks = 1;
  if (P.batch < kTargetBlocks) {
    chunks = std::max<int64_t>(1, std::min(ceil_div(kTargetBlocks, P.batch), P.row_vecs / kMinChunkVecs));
  }
  P.chunk = ceil_div(P.row_vecs, chunks);
  P.chunks = ceil_div(P.row_vecs, P.chunk);
  at::Tensor partial;
  if (P.chunks > 1) {
    partial = at::empty({P.num_entries, P.chunks}, opmath_opts);
    P.partial = partial.data_ptr<opmath_t>();
  }
  const dim3 grid(static_cast<unsigned>(P.chunks), static_cast<unsigned>(std::min(P.batch, grid_limit(kMaxGridY))));
  launch<dot_rows_kernel<scalar_t, kVec, kThreads>>(grid, dim3(kThreads), stream, P);
  if (P.chunks > 1) {
    launch<sum_partials_kernel<opmath_t>>(dim3(grid_1d(P.batch)), dim3(kThreads), stream, P.partial, P.row_offsets,
                                          P.row_branch, P.batch, n, P.chunks, P.out);
  }
}

}  // namespace

at::Tensor combine_weights_backward_cuda(const at::Tensor& grad, at::TensorList ys, const at::Tensor& row_offsets,
                                         const at::Tensor& row_branch, const at::Tensor& row_pos) {
  // grad plays the role of base: same rows, trailing shape, dtype and device as the output.
  auto a = check_combine(grad, ys, c10::nullopt, row_offsets, row_branch, row_pos, "grad");
  DeviceGuard device_guard(grad.device());
  const int64_t num_branches = static_cast<int64_t>(ys.size());
  const int64_t d = row_numel(grad);
  const auto opmath_opts = grad.options().dtype(opmath_type(grad.scalar_type()));
  auto out = at::zeros({a.plan.batch, num_branches}, opmath_opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "maskedbranch_combine_weights_backward_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const auto ptrs = source_ptrs<scalar_t>(a.ys);
    at::Tensor holder;
    DotParams<scalar_t> P;
    P.sources = make_table<const scalar_t*>(ptrs, a.starts, grad.device(), holder);
    P.row_offsets = a.plan.row_offsets.const_data_ptr<int64_t>();
    P.row_branch = a.plan.row_branch.const_data_ptr<int64_t>();
    P.row_pos = a.plan.row_pos.const_data_ptr<int64_t>();
    P.batch = a.plan.batch;
    P.num_entries = a.plan.num_entries;
    if (a.plan.batch == 0 || d == 0 || a.plan.num_entries == 0) {
      // Nothing to sum (the zeros are the answer), but the plan is checked as on the CPU.
      launch_check_row_plan(P.row_offsets, P.row_branch, P.row_pos, P.batch, P.num_entries, P.sources);
      return;
    }
    P.grad = a.base.const_data_ptr<scalar_t>();
    P.out = out.data_ptr<opmath_t>();
    P.partial = nullptr;
    std::vector<const void*> all(ptrs.begin(), ptrs.end());
    all.push_back(P.grad);
    constexpr int kVec = vec_width<scalar_t>();
    if (can_vectorize<scalar_t>(d, all)) {
      P.row_vecs = d / kVec;
      launch_dot_rows<scalar_t, kVec>(P, num_branches, opmath_opts);
    } else {
      P.row_vecs = d;
      launch_dot_rows<scalar_t, 1>(P, num_branches, opmath_opts);
    }
  });
  return out;
}

}  // namespace cuda

#ifndef MASKEDBRANCH_CUDA_EMULATION
TORCH_LIBRARY_IMPL(maskedbranch, CUDA, m) {
  m.impl("combine", &cuda::combine_cuda);
  m.impl("combine_weights_backward", &cuda::combine_weights_backward_cuda);
}
#endif

}  // namespace maskedbranch
