// drop_path_scale: out[b] = base[b] + scale[b] * y[b] in one pass over y (and base). Same
// outputs and layouts as csrc/cpu/drop_path.cpp (the product is never fused with the add).
#include <torch/library.h>

#include "../op_args.h"
#include "row_kernels.cuh"

namespace maskedbranch {
namespace {

using namespace maskedbranch::cuda;

template <typename scalar_t>
struct DropPathParams {
  scalar_t* out;
  const scalar_t* base;  // may be null
  const scalar_t* y;
  const at::opmath_type<scalar_t>* scale;  // [B]
  int64_t batch;
  int64_t row_vecs;
  int64_t chunk;
};

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(kThreads) drop_path_scale_kernel(const DropPathParams<scalar_t> P) {
  using opmath_t = at::opmath_type<scalar_t>;
  using V = Vec<scalar_t, kVec>;
  const ThreadCols cols = thread_cols(P.row_vecs, P.chunk);
  if (cols.first >= cols.end) return;
  const int64_t step = blockDim.x;
  for (int64_t b = first_row(); b < P.batch; b += row_stride()) {
    const opmath_t s = P.scale[b];
    const V* yr = reinterpret_cast<const V*>(P.y) + b * P.row_vecs;
    const V* br = P.base != nullptr ? reinterpret_cast<const V*>(P.base) + b * P.row_vecs : nullptr;
    V* o = reinterpret_cast<V*>(P.out) + b * P.row_vecs;
    V yv[kUnroll], bv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = cols.first + u * step;
      if (j < cols.end) {
        yv[u] = yr[j];
        if (br != nullptr) bv[u] = br[j];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = cols.first + u * step;
      if (j < cols.end) {
        V t;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const opmath_t prod = mul_rn(s, static_cast<opmath_t>(yv[u].val[k]));
          t.val[k] = static_cast<scalar_t>(br != nullptr ? static_cast<opmath_t>(bv[u].val[k]) + prod : prod);
        }
        o[j] = t;
      }
    }
  }
}

at::Tensor drop_path_scale_cuda(const c10::optional<at::Tensor>& base_in, const at::Tensor& y_in,
                                const at::Tensor& scale_in) {
  auto a = check_drop_path_scale(base_in, y_in, scale_in);
  c10::cuda::CUDAGuard device_guard(a.y.device());
  const int64_t batch = a.y.size(0);
  const int64_t d = row_numel(a.y);
  auto out = empty_rows(batch, a.y.sizes().slice(1), a.y.options(), a.format);
  if (batch == 0 || d == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.y.scalar_type(), "maskedbranch_drop_path_scale_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    DropPathParams<scalar_t> P;
    P.out = out.data_ptr<scalar_t>();
    P.base = ptr_or_null<scalar_t>(a.base);
    P.y = a.y.const_data_ptr<scalar_t>();
    P.scale = a.scale.const_data_ptr<opmath_t>();
    P.batch = batch;
    auto stream = at::cuda::getCurrentCUDAStream();
    constexpr int kVec = vec_width<scalar_t>();
    if (can_vectorize<scalar_t>(d, {P.out, P.base, P.y})) {
      P.row_vecs = d / kVec;
      const RowTiling t = row_tiling(batch, P.row_vecs);
      P.chunk = t.chunk;
      drop_path_scale_kernel<scalar_t, kVec><<<t.grid, t.block, 0, stream>>>(P);
    } else {
      P.row_vecs = d;
      const RowTiling t = row_tiling(batch, P.row_vecs);
      P.chunk = t.chunk;
      drop_path_scale_kernel<scalar_t, 1><<<t.grid, t.block, 0, stream>>>(P);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CUDA, m) { m.impl("drop_path_scale", &drop_path_scale_cuda); }

}  // namespace maskedbranch
