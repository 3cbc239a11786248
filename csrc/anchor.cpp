// anchor: an identity on x whose backward hands the anchored parameters a gradient, so
// that every parameter's gradient hook fires (DDP) even when its branch did not run.
// Device-agnostic: the forward is a view and the zero-fill is one batched foreach call.
#include <torch/autograd.h>
#include <torch/library.h>

#include "autograd_node.h"
#include "op_calls.h"

namespace maskedbranch {
namespace {

using torch::autograd::variable_list;

void check_params(at::TensorList params) {
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK_VALUE(params[i].defined(), "params: entry ", i, " is undefined");
  }
}

at::Tensor anchor_view(const at::Tensor& x, at::TensorList params, bool materialize) {
  check_params(params);
  return x.alias();
}

std::vector<at::Tensor> zeros_like_all(at::TensorList tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(at::empty_like(t, at::MemoryFormat::Preserve));
  if (!out.empty()) at::_foreach_zero_(out);
  return out;
}

// A hand-written autograd node rather than a torch::autograd::Function: the generic machinery
// (per-input metadata, a saved-data map, output wrapping) cost about 10 us more per call.
struct AnchorBackward : public torch::autograd::Node {
  AnchorBackward(size_t count, bool materialize) : count(count), materialize(materialize) {}

  variable_list apply(variable_list&& grads) override {
    variable_list out(1 + count);
    out[0] = std::move(grads[0]);
    if (materialize) {
      // Zero tensors laid out like the parameters, from one batched fill.
      std::vector<at::Tensor> wanted;
      for (size_t i = 0; i < count; ++i) {
        if (should_compute_output(1 + i)) wanted.push_back(params[i]);
      }
      if (!wanted.empty()) {
        auto zeros = call_zeros_like_all(wanted);
        size_t k = 0;
        for (size_t i = 0; i < count; ++i) {
          if (should_compute_output(1 + i)) out[1 + i] = std::move(zeros[k++]);
        }
      }
    }
    // Otherwise undefined gradients: the engine still runs the parameters' accumulators and
    // their hooks (DDP zero-fills its bucket slot), at no cost per parameter.
    return out;
  }

  std::string name() const override { return "maskedbranch::AnchorBackward"; }
  void release_variables() override { params.clear(); }

  size_t count;
  bool materialize;
  std::vector<at::Tensor> params;  // with materialize only: their layout (never their values)
};

// The node whose backward passes the gradient of its one input on along `through` and hands
// `params` theirs.
NodePtr anchor_node(torch::autograd::Edge through, at::TensorList params, bool materialize) {
  auto node = make_node<AnchorBackward>(params.size(), materialize);
  auto edges = torch::autograd::collect_next_edges(params);
  edges.insert(edges.begin(), std::move(through));
  node->set_next_edges(std::move(edges));
  if (materialize) static_cast<AnchorBackward*>(node.get())->params = params.vec();
  return node;
}

at::Tensor anchor_autograd(const at::Tensor& x, at::TensorList params, bool materialize) {
  check_params(params);
  NodePtr node;
  if (torch::autograd::compute_requires_grad(x, params)) {
    node = anchor_node(torch::autograd::collect_next_edges(x).front(), params, materialize);
  }
  at::Tensor out;
  {
    // Below autograd but through ADInplaceOrView: the alias is a proper view of x.
    at::AutoDispatchBelowAutograd guard;
    out = at::alias(x);
  }
  if (node) {
    torch::autograd::set_history(out, node);
    // As for a view returned by a custom Function: modifying it in place raises, since the
    // view+inplace logic would replace this node (and drop the parameters from the graph).
    if (auto* meta = torch::autograd::impl::get_view_autograd_meta(out)) {
      meta->set_creation_meta(torch::autograd::CreationMeta::IN_CUSTOM_FUNCTION);
    }
  }
  return out;
}

}  // namespace

// The eager fast path of anchoring: instead of returning a view of `out` whose node carries the
// parameters, put the node into `out`'s own history (its gradient edge now leads through the
// anchor to the old one). No view, no dispatch, and in-place ops on `out` keep working. Only for
// a tensor produced by an op (not a leaf, not a view, whose history autograd may regenerate);
// returns false when it does not apply, and the caller uses the op instead.
bool anchor_into_history(const at::Tensor& out, at::TensorList params, bool materialize) {
  if (!at::GradMode::is_enabled() || !out.defined() || out.is_view() || !out.requires_grad() ||
      out.grad_fn() == nullptr) {
    return false;
  }
  check_params(params);
  if (!torch::autograd::compute_requires_grad(params)) return true;  // nothing to anchor
  auto node = anchor_node(torch::autograd::impl::gradient_edge(out), params, materialize);
  node->add_input_metadata(out);
  torch::autograd::impl::set_gradient_edge(out, {node, 0});
  return true;
}

TORCH_LIBRARY_IMPL(maskedbranch, CompositeExplicitAutograd, m) {
  m.impl("anchor", &anchor_view);
  m.impl("zeros_like_all", &zeros_like_all);
}

TORCH_LIBRARY_IMPL(maskedbranch, Autograd, m) { m.impl("anchor", &anchor_autograd); }

}  // namespace maskedbranch
