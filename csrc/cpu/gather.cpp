// gather: pack the routed rows of x; backward: segmented sum back to rows.
#include <torch/library.h>

#include "../op_args.h"
#include "plan_checks.h"
#include "row_kernels.h"

namespace maskedbranch {
namespace {

at::Tensor gather_cpu(const at::Tensor& x_in, const at::Tensor& rows_in,
                      const at::Tensor& row_offsets, const at::Tensor& row_pos) {
  auto [x, format] = check_gather(x_in, rows_in, row_offsets, row_pos);
  auto rows = rows_in.contiguous();
  const int64_t num_entries = rows.numel();
  cpu::check_in_range(rows.data_ptr<int64_t>(), num_entries, 0, x.size(0), "rows");
  auto out = empty_rows(num_entries, x.sizes().slice(1), x.options(), format);
  const int64_t d = row_numel(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "maskedbranch_gather", [&] {
    cpu::gather_rows<scalar_t>(out.data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                               rows.const_data_ptr<int64_t>(), num_entries, d, nullptr, {0, num_entries});
  });
  return out;
}

at::Tensor gather_backward_cpu(const at::Tensor& grad_in, const at::Tensor& row_offsets_in,
                               const at::Tensor& row_pos_in) {
  auto [grad, format] = check_gather_backward(grad_in, row_offsets_in, row_pos_in);
  auto row_offsets = row_offsets_in.contiguous();
  auto row_pos = row_pos_in.contiguous();
  const int64_t batch = plan_rows(row_offsets);
  const int64_t num_entries = grad.size(0);
  cpu::check_row_offsets(row_offsets.data_ptr<int64_t>(), batch, num_entries);
  cpu::check_in_range(row_pos.data_ptr<int64_t>(), num_entries, 0, num_entries, "row_pos");
  auto out = empty_rows(batch, grad.sizes().slice(1), grad.options(), format);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "maskedbranch_gather_backward", [&] {
    cpu::segment_sum_rows<scalar_t>(out.data_ptr<scalar_t>(), nullptr, {grad.const_data_ptr<scalar_t>()},
                                    {0, num_entries}, row_offsets.const_data_ptr<int64_t>(), nullptr,
                                    row_pos.const_data_ptr<int64_t>(), batch, row_numel(grad), nullptr);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CPU, m) {
  m.impl("gather", &gather_cpu);
  m.impl("gather_backward", &gather_backward_cpu);
}

}  // namespace maskedbranch
