// combine: out = base + weighted sum of the branch outputs, read from a list of tensors;
// backward: the packed gradient of every branch output, and the gradient of the weights.
#include <torch/library.h>

#include "../op_args.h"
#include "plan_checks.h"
#include "row_kernels.h"

namespace maskedbranch {
namespace {

template <typename T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

at::Tensor combine_cpu(const c10::optional<at::Tensor>& base, at::TensorList ys,
                       const c10::optional<at::Tensor>& weights, const at::Tensor& rows,
                       const at::Tensor& row_offsets_in, const at::Tensor& row_branch_in,
                       const at::Tensor& row_pos_in) {
  auto a = check_combine(base, ys, weights, rows, row_offsets_in, row_branch_in, row_pos_in);
  auto row_offsets = row_offsets_in.contiguous();
  auto row_branch = row_branch_in.contiguous();
  auto row_pos = row_pos_in.contiguous();
  const int64_t num_entries = row_pos.numel();
  cpu::check_row_offsets(row_offsets.data_ptr<int64_t>(), a.batch, num_entries);
  cpu::check_positions(row_branch.data_ptr<int64_t>(), row_pos.data_ptr<int64_t>(), num_entries, a.starts);
  auto out = empty_rows(a.batch, a.ref.sizes().slice(1), a.ref.options(), a.format);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.ref.scalar_type(), "maskedbranch_combine", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<const scalar_t*> sources;
    for (const auto& y : a.ys) sources.push_back(y.const_data_ptr<scalar_t>());
    cpu::segment_sum_rows<scalar_t>(out.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(a.base), sources,
                                    a.starts, row_offsets.const_data_ptr<int64_t>(),
                                    row_branch.const_data_ptr<int64_t>(), row_pos.const_data_ptr<int64_t>(),
                                    a.batch, row_numel(a.ref), ptr_or_null<opmath_t>(a.weights));
  });
  return out;
}

at::Tensor combine_backward_ys_cpu(const at::Tensor& grad_in, const c10::optional<at::Tensor>& weights,
                                   const at::Tensor& rows_in, c10::IntArrayRef counts) {
  auto a = check_combine_backward_ys(grad_in, weights, rows_in, counts);
  auto rows = rows_in.contiguous();
  const int64_t num_entries = rows.numel();
  cpu::check_in_range(rows.data_ptr<int64_t>(), num_entries, 0, a.grad.size(0), "rows");
  auto out = empty_rows(num_entries, a.grad.sizes().slice(1), a.grad.options(), a.format);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.grad.scalar_type(), "maskedbranch_combine_backward_ys", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    cpu::gather_rows<scalar_t>(out.data_ptr<scalar_t>(), a.grad.const_data_ptr<scalar_t>(),
                               rows.const_data_ptr<int64_t>(), num_entries, row_numel(a.grad),
                               ptr_or_null<opmath_t>(a.weights), a.starts);
  });
  return out;
}

at::Tensor combine_backward_weights_cpu(const at::Tensor& grad, at::TensorList ys,
                                        const at::Tensor& row_offsets_in, const at::Tensor& row_branch_in,
                                        const at::Tensor& row_pos_in, at::ScalarType dtype) {
  // grad plays the role of base: same rows, trailing shape, dtype and device as the output.
  auto a = check_combine(grad, ys, c10::nullopt, row_pos_in, row_offsets_in, row_branch_in, row_pos_in);
  auto row_offsets = row_offsets_in.contiguous();
  auto row_branch = row_branch_in.contiguous();
  auto row_pos = row_pos_in.contiguous();
  const int64_t num_entries = row_pos.numel();
  const auto* ro = row_offsets.const_data_ptr<int64_t>();
  const auto* rb = row_branch.const_data_ptr<int64_t>();
  const auto* rp = row_pos.const_data_ptr<int64_t>();
  cpu::check_row_offsets(ro, a.batch, num_entries);
  cpu::check_positions(rb, rp, num_entries, a.starts);
  const int64_t num_branches = static_cast<int64_t>(ys.size());
  const int64_t d = row_numel(grad);
  auto out = at::zeros({a.batch, num_branches}, grad.options().dtype(opmath_type(grad.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "maskedbranch_combine_backward_weights", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    auto* o = out.data_ptr<opmath_t>();
    const scalar_t* g = a.base.const_data_ptr<scalar_t>();
    at::parallel_for(0, a.batch, cpu::row_grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t e = ro[b]; e < ro[b + 1]; ++e) {
          const int64_t i = rb[e];
          const scalar_t* y = a.ys[i].template const_data_ptr<scalar_t>() + (rp[e] - a.starts[i]) * d;
          opmath_t dot = 0;
          for (int64_t j = 0; j < d; ++j) dot += static_cast<opmath_t>(g[b * d + j]) * static_cast<opmath_t>(y[j]);
          o[b * num_branches + i] = dot;
        }
      }
    });
  });
  return out.to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CPU, m) {
  m.impl("combine", &combine_cpu);
  m.impl("combine_backward_ys", &combine_backward_ys_cpu);
  m.impl("combine_backward_weights", &combine_backward_weights_cpu);
}

}  // namespace maskedbranch
