// combine (CPU): out = base + weighted sum of the branch outputs, read from a list of tensors
// (never concatenated); and the gradient of its weights.
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

// The plan's values, checked on the host so that a hand-made plan raises instead of reading
// out of bounds.
void check_plan_values(const CombineArgs& a) {
  cpu::check_row_offsets(a.plan.row_offsets.const_data_ptr<int64_t>(), a.plan.batch, a.plan.num_entries);
  cpu::check_positions(a.plan.row_branch.const_data_ptr<int64_t>(), a.plan.row_pos.const_data_ptr<int64_t>(),
                       a.plan.num_entries, a.starts);
}

at::Tensor combine_cpu(const c10::optional<at::Tensor>& base, at::TensorList ys,
                       const c10::optional<at::Tensor>& weights, const at::Tensor& row_offsets,
                       const at::Tensor& row_branch, const at::Tensor& row_pos) {
  auto a = check_combine(base, ys, weights, row_offsets, row_branch, row_pos);
  check_plan_values(a);
  auto out = empty_rows(a.plan.batch, a.ref.sizes().slice(1), a.ref.options(), a.format);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.ref.scalar_type(), "maskedbranch_combine", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<const scalar_t*> sources;
    for (const auto& y : a.ys) sources.push_back(y.const_data_ptr<scalar_t>());
    cpu::segment_sum_rows<scalar_t>(out.data_ptr<scalar_t>(), ptr_or_null<scalar_t>(a.base), sources, a.starts,
                                    a.plan.row_offsets.const_data_ptr<int64_t>(),
                                    a.plan.row_branch.const_data_ptr<int64_t>(),
                                    a.plan.row_pos.const_data_ptr<int64_t>(), a.plan.batch, row_numel(a.ref),
                                    ptr_or_null<opmath_t>(a.weights));
  });
  return out;
}

at::Tensor combine_weights_backward_cpu(const at::Tensor& grad, at::TensorList ys, const at::Tensor& row_offsets,
                                        const at::Tensor& row_branch, const at::Tensor& row_pos) {
  // grad plays the role of base: same rows, trailing shape, dtype and device as the output.
  auto a = check_combine(grad, ys, c10::nullopt, row_offsets, row_branch, row_pos, "grad");
  check_plan_values(a);
  const auto* ro = a.plan.row_offsets.const_data_ptr<int64_t>();
  const auto* rb = a.plan.row_branch.const_data_ptr<int64_t>();
  const auto* rp = a.plan.row_pos.const_data_ptr<int64_t>();
  const int64_t num_branches = static_cast<int64_t>(ys.size());
  const int64_t d = row_numel(grad);
  auto out = at::zeros({a.plan.batch, num_branches}, grad.options().dtype(opmath_type(grad.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "maskedbranch_combine_weights_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    auto* o = out.data_ptr<opmath_t>();
    const scalar_t* g = a.base.const_data_ptr<scalar_t>();
    at::parallel_for(0, a.plan.batch, cpu::row_grain(d), [&](int64_t begin, int64_t end) {
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
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CPU, m) {
  m.impl("combine", &combine_cpu);
  m.impl("combine_weights_backward", &combine_weights_backward_cpu);
}

}  // namespace maskedbranch
