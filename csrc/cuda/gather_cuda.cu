// gather: pack the routed rows of x (a row copy at copy bandwidth); backward: the
// deterministic segmented sum of the packed gradient back to rows. Same outputs and
// layouts as csrc/cpu/gather.cpp; plan contents are checked on the device (asserts), not
// on the host, so that neither op synchronizes.
#include <torch/library.h>

#include "../op_args.h"
#include "row_kernels.cuh"

namespace maskedbranch {
namespace {

using namespace maskedbranch::cuda;

at::Tensor gather_cuda(const at::Tensor& x_in, const at::Tensor& rows_in, const at::Tensor& row_offsets,
                       const at::Tensor& row_pos) {
  const auto args = check_gather(x_in, rows_in, row_offsets, row_pos);
  const at::Tensor& x = args.x;
  const auto format = args.format;
  c10::cuda::CUDAGuard device_guard(x.device());
  auto rows = rows_in.contiguous();
  const int64_t num_entries = rows.numel();
  auto out = empty_rows(num_entries, x.sizes().slice(1), x.options(), format);
  const int64_t d = row_numel(x);
  if (num_entries == 0 || d == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "maskedbranch_gather_cuda", [&] {
    launch_gather_rows<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                 rows.const_data_ptr<int64_t>(), num_entries, x.size(0), d, nullptr,
                                 {0, num_entries}, x.device());
  });
  return out;
}

at::Tensor gather_backward_cuda(const at::Tensor& grad_in, const at::Tensor& row_offsets_in,
                                const at::Tensor& row_pos_in) {
  const auto args = check_gather_backward(grad_in, row_offsets_in, row_pos_in);
  const at::Tensor& grad = args.grad;
  const auto format = args.format;
  c10::cuda::CUDAGuard device_guard(grad.device());
  auto row_offsets = row_offsets_in.contiguous();
  auto row_pos = row_pos_in.contiguous();
  const int64_t batch = plan_rows(row_offsets);
  const int64_t num_entries = grad.size(0);
  auto out = empty_rows(batch, grad.sizes().slice(1), grad.options(), format);
  const int64_t d = row_numel(grad);
  if (batch == 0 || d == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "maskedbranch_gather_backward_cuda", [&] {
    launch_segment_sum<scalar_t>(out.data_ptr<scalar_t>(), nullptr, {num_entries > 0 ? grad.const_data_ptr<scalar_t>() : nullptr},
                                 {0, num_entries}, row_offsets.const_data_ptr<int64_t>(), nullptr,
                                 row_pos.const_data_ptr<int64_t>(), batch, num_entries, d, nullptr, grad.device());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CUDA, m) {
  m.impl("gather", &gather_cuda);
  m.impl("gather_backward", &gather_backward_cuda);
}

}  // namespace maskedbranch
