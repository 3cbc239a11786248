// gather (CUDA): each branch's rows of x into a new tensor of its own, optionally scaled by the
// gate weights (which makes it combine's backward with respect to the branch outputs). One
// launch for all branches: the outputs travel as a pointer table, like combine's inputs. Same
// outputs and layouts as csrc/cpu/gather.cpp; `rows` is checked on the device (plan_asserts.cuh).
#include <torch/library.h>

#include "../op_args.h"
#include "ops.h"
#include "row_kernels.cuh"

namespace maskedbranch {
namespace cuda {

std::vector<at::Tensor> gather_cuda(const at::Tensor& x_in, const at::Tensor& rows_in,
                                    const c10::optional<at::Tensor>& weights, c10::IntArrayRef counts) {
  auto a = check_gather(x_in, rows_in, weights, counts);
  DeviceGuard device_guard(a.x.device());
  std::vector<at::Tensor> outs;
  outs.reserve(counts.size());
  for (auto c : counts) outs.push_back(empty_rows(c, a.x.sizes().slice(1), a.x.options(), a.format));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x.scalar_type(), "maskedbranch_gather_cuda", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<scalar_t*> dst;
    for (auto& o : outs) dst.push_back(data_or_null<scalar_t>(o));
    launch_gather<scalar_t>(dst, a.starts, const_data_or_null<scalar_t>(a.x), a.rows.const_data_ptr<int64_t>(),
                            a.rows.numel(), a.x.size(0), row_numel(a.x), const_data_or_null<opmath_t>(a.weights),
                            a.x.device());
  });
  return outs;
}

}  // namespace cuda

#ifndef MASKEDBRANCH_CUDA_EMULATION
TORCH_LIBRARY_IMPL(maskedbranch, CUDA, m) { m.impl("gather", &cuda::gather_cuda); }
#endif

}  // namespace maskedbranch
