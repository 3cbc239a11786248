// Autograd for the routing ops, in C++: the backward formulas call the registered backward ops,
// and a call costs a few microseconds instead of the tens that a Python autograd wrapper adds
// (which matters for many small routed layers per step).
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <c10/util/accumulate.h>

#include "op_calls.h"

namespace maskedbranch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GatherFunction : public torch::autograd::Function<GatherFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& rows,
                            const at::Tensor& row_offsets, const at::Tensor& row_pos) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({row_offsets, row_pos});
    return call_gather(x, rows, row_offsets, row_pos);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    return {call_gather_backward(grads[0], saved[0], saved[1]), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct CombineFunction : public torch::autograd::Function<CombineFunction> {
  static at::Tensor forward(AutogradContext* ctx, const OptTensor& base, at::TensorList ys, const OptTensor& weights,
                            const at::Tensor& rows, const at::Tensor& row_offsets, const at::Tensor& row_branch,
                            const at::Tensor& row_pos) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const bool has_base = base.has_value() && base->defined();
    const bool has_weights = weights.has_value() && weights->defined();
    std::vector<int64_t> counts;
    for (const auto& y : ys) counts.push_back(y.dim() > 0 ? y.size(0) : 0);
    ctx->saved_data["has_base"] = has_base;
    ctx->saved_data["has_weights"] = has_weights;
    ctx->saved_data["counts"] = counts;
    // ys are needed only for the weights' gradient: don't keep them alive otherwise.
    const bool keep_ys = has_weights && weights->requires_grad();
    std::vector<at::Tensor> saved{has_weights ? *weights : at::Tensor(), rows, row_offsets, row_branch, row_pos};
    if (keep_ys) saved.insert(saved.end(), ys.begin(), ys.end());
    ctx->saved_data["weights_dtype"] = has_weights ? weights->scalar_type() : at::kFloat;
    ctx->save_for_backward(saved);
    return call_combine(base, ys, weights, rows, row_offsets, row_branch, row_pos);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto backward_ys = op<at::Tensor(const at::Tensor&, const OptTensor&, const at::Tensor&, c10::SymIntArrayRef)>(
        "maskedbranch::combine_backward_ys");
    static auto backward_weights =
        op<at::Tensor(const at::Tensor&, at::TensorList, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      at::ScalarType)>("maskedbranch::combine_backward_weights");
    const bool has_base = ctx->saved_data["has_base"].toBool();
    const bool has_weights = ctx->saved_data["has_weights"].toBool();
    const auto counts = ctx->saved_data["counts"].toIntVector();
    const auto n = static_cast<int64_t>(counts.size());
    auto saved = ctx->get_saved_variables();
    const at::Tensor& grad = grads[0];
    // Edges exist for defined tensor inputs only: [base] ys... [weights] rows row_offsets row_branch row_pos.
    const int64_t ys_edge = has_base ? 1 : 0;
    variable_list out;
    out.push_back(has_base && ctx->needs_input_grad(0) ? grad : at::Tensor());
    bool ys_need_grad = false;
    for (int64_t i = 0; i < n; ++i) ys_need_grad |= ctx->needs_input_grad(ys_edge + i);
    if (ys_need_grad) {
      const OptTensor weights = has_weights ? OptTensor(saved[0]) : c10::nullopt;
      auto packed = backward_ys.call(grad, weights, saved[1], c10::fromIntArrayRefSlow(counts));
      auto parts = packed.split_with_sizes(counts);
      out.insert(out.end(), parts.begin(), parts.end());
    } else {
      out.resize(1 + n);
    }
    if (has_weights && ctx->needs_input_grad(ys_edge + n)) {
      std::vector<at::Tensor> ys(saved.begin() + 5, saved.end());
      out.push_back(backward_weights.call(grad, ys, saved[2], saved[3], saved[4],
                                          ctx->saved_data["weights_dtype"].toScalarType()));
    } else {
      out.push_back(at::Tensor());
    }
    out.resize(out.size() + 4);  // plan tensors
    return out;
  }
};

struct DropPathScaleFunction : public torch::autograd::Function<DropPathScaleFunction> {
  static at::Tensor forward(AutogradContext* ctx, const OptTensor& base, const at::Tensor& y, const at::Tensor& scale) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const bool has_base = base.has_value() && base->defined();
    ctx->saved_data["has_base"] = has_base;
    ctx->save_for_backward({scale, scale.requires_grad() ? y : at::Tensor()});
    return call_drop_path_scale(base, y, scale);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool has_base = ctx->saved_data["has_base"].toBool();
    auto saved = ctx->get_saved_variables();
    const at::Tensor& grad = grads[0];
    const int64_t y_edge = has_base ? 1 : 0;
    at::Tensor grad_base = has_base && ctx->needs_input_grad(0) ? grad : at::Tensor();
    at::Tensor grad_y = ctx->needs_input_grad(y_edge) ? call_drop_path_scale(c10::nullopt, grad, saved[0]) : at::Tensor();
    at::Tensor grad_scale;
    if (ctx->needs_input_grad(y_edge + 1)) {  // rare: a learnable per-row scale
      // Per row, the sum of grad * y over its values (one for a 1-D y), accumulated in at least
      // float32 (float64 stays float64).
      const at::Tensor& y = saved[1];
      const auto acc = at::promote_types(at::promote_types(grad.scalar_type(), y.scalar_type()), at::kFloat);
      const int64_t per_row = c10::multiply_integers(grad.sizes().slice(1));
      grad_scale = grad.to(acc).mul(y.to(acc)).reshape({grad.size(0), per_row}).sum(1).to(saved[0].scalar_type());
    }
    return {grad_base, grad_y, grad_scale};
  }
};

at::Tensor gather_autograd(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& row_offsets,
                           const at::Tensor& row_pos) {
  return GatherFunction::apply(x, rows, row_offsets, row_pos);
}

at::Tensor combine_autograd(const OptTensor& base, at::TensorList ys, const OptTensor& weights, const at::Tensor& rows,
                            const at::Tensor& row_offsets, const at::Tensor& row_branch, const at::Tensor& row_pos) {
  return CombineFunction::apply(base, ys, weights, rows, row_offsets, row_branch, row_pos);
}

at::Tensor drop_path_scale_autograd(const OptTensor& base, const at::Tensor& y, const at::Tensor& scale) {
  return DropPathScaleFunction::apply(base, y, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, Autograd, m) {
  m.impl("gather", &gather_autograd);
  m.impl("combine", &combine_autograd);
  m.impl("drop_path_scale", &drop_path_scale_autograd);
}

}  // namespace maskedbranch
