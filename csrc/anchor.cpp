// anchor: an identity on x whose backward hands the anchored parameters a gradient, so
// that every parameter's gradient hook fires (DDP) even when its branch did not run.
// Device-agnostic: the forward is a view and the zero-fill is one batched foreach call.
#include <torch/autograd.h>
#include <torch/library.h>

namespace maskedbranch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor anchor_view(const at::Tensor& x, at::TensorList params, bool materialize) {
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(params[i].defined(), "params: entry ", i, " is undefined");
  }
  return x.alias();
}

std::vector<at::Tensor> zeros_like_all(at::TensorList tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(at::empty_like(t, at::MemoryFormat::Preserve));
  if (!out.empty()) at::_foreach_zero_(out);
  return out;
}

struct AnchorFunction : public torch::autograd::Function<AnchorFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList params,
                            bool materialize) {
    ctx->saved_data["materialize"] = materialize;
    ctx->saved_data["count"] = static_cast<int64_t>(params.size());
    if (materialize) ctx->save_for_backward(params.vec());
    for (size_t i = 0; i < params.size(); ++i) {
      TORCH_CHECK_VALUE(params[i].defined(), "params: entry ", i, " is undefined");
    }
    // A view made under no-grad mode, as a Python autograd.Function returning x would give.
    return x.view_as(x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto count = ctx->saved_data["count"].toInt();
    variable_list out{grads[0]};
    if (ctx->saved_data["materialize"].toBool()) {
      auto params = ctx->get_saved_variables();
      std::vector<at::Tensor> wanted;
      for (int64_t i = 0; i < count; ++i) {
        if (ctx->needs_input_grad(1 + i)) wanted.push_back(params[i]);
      }
      auto zeros = wanted.empty() ? std::vector<at::Tensor>{}
                                  : c10::Dispatcher::singleton()
                                        .findSchemaOrThrow("maskedbranch::zeros_like_all", "")
                                        .typed<std::vector<at::Tensor>(at::TensorList)>()
                                        .call(wanted);
      size_t k = 0;
      for (int64_t i = 0; i < count; ++i) {
        out.push_back(ctx->needs_input_grad(1 + i) ? zeros[k++] : at::Tensor());
      }
    } else {
      // Undefined gradients: the engine still runs the parameters' accumulators and their
      // hooks (DDP zero-fills its bucket slot), at no cost per parameter.
      out.resize(1 + count);
    }
    out.push_back(at::Tensor());  // materialize
    return out;
  }
};

at::Tensor anchor_autograd(const at::Tensor& x, at::TensorList params, bool materialize) {
  return AnchorFunction::apply(x, params, materialize);
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CompositeExplicitAutograd, m) {
  m.impl("anchor", &anchor_view);
  m.impl("zeros_like_all", &zeros_like_all);
}

TORCH_LIBRARY_IMPL(maskedbranch, Autograd, m) { m.impl("anchor", &anchor_autograd); }

}  // namespace maskedbranch
