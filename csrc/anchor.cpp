// anchor: an identity on x whose backward hands the anchored parameters a gradient, so
// that every parameter's gradient hook fires (DDP) even when its branch did not run.
// Device-agnostic: the forward is a view and the zero-fill is one batched foreach call.
#include <torch/autograd.h>
#include <torch/library.h>

#include <limits>

#include "anchor.h"
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

// The node that hands one set of dead parameters their (undefined) gradients, shared by every
// call that anchors that set (see DeadSet). Like an accumulator it runs as soon as it is ready
// (the highest sequence number), so the parameters' hooks fire where the calls' backward runs.
struct DeadParamsBackward : public torch::autograd::Node {
  explicit DeadParamsBackward(at::TensorList params) : Node(std::numeric_limits<uint64_t>::max()) {
    add_input_metadata(Node::undefined_input());  // the calls' anchors pass it no gradient
    set_next_edges(torch::autograd::collect_next_edges(params));
  }

  variable_list apply(variable_list&& /*grads*/) override { return variable_list(num_outputs()); }
  std::string name() const override { return "maskedbranch::DeadParamsBackward"; }
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

// `out` was produced by an op, under grad mode: not a leaf, and not a view (whose history
// autograd may regenerate).
bool has_own_history(const at::Tensor& out) {
  return at::GradMode::is_enabled() && out.defined() && !out.is_view() && out.requires_grad() &&
         out.grad_fn() != nullptr;
}

// `out`'s gradient edge now leads to `node`, whose first edge is the old one.
void insert_into_history(const at::Tensor& out, const NodePtr& node) {
  node->add_input_metadata(out);
  torch::autograd::impl::set_gradient_edge(out, {node, 0});
}

}  // namespace

// The eager fast path of anchoring: instead of returning a view of `out` whose node carries the
// parameters, put the node into `out`'s own history (its gradient edge now leads through the
// anchor to the old one). No view, no dispatch, and in-place ops on `out` keep working. Only for
// a tensor with its own history (has_own_history); returns false otherwise, and the caller uses
// the op instead.
bool anchor_into_history(const at::Tensor& out, at::TensorList params, bool materialize) {
  if (!has_own_history(out)) return false;
  check_params(params);
  if (!torch::autograd::compute_requires_grad(params)) return true;  // nothing to anchor
  insert_into_history(out, anchor_node(torch::autograd::impl::gradient_edge(out), params, materialize));
  return true;
}

DeadSet::DeadSet(std::vector<at::Tensor> params) : params_(std::move(params)) {
  check_params(params_);
  build();
}

void DeadSet::build() {
  linked_.clear();
  frozen_.clear();
  dtypes_.clear();
  devices_.clear();
  for (const auto& p : params_) {
    if (p.requires_grad()) {
      linked_.push_back(p);
      dtypes_.push_back(p.dtype());
      devices_.push_back(p.device());
    } else {
      frozen_.push_back(p);
    }
  }
  node_ = linked_.empty() ? NodePtr() : make_node<DeadParamsBackward>(linked_);
}

bool DeadSet::stale() const {
  for (const auto& p : frozen_) {
    if (p.requires_grad()) return true;
  }
  for (size_t i = 0; i < linked_.size(); ++i) {
    if (linked_[i].dtype() != dtypes_[i] || linked_[i].device() != devices_[i]) return true;
  }
  return false;
}

bool DeadSet::anchor_into(const at::Tensor& out) {
  if (!has_own_history(out)) return false;
  NodePtr shared;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stale()) build();
    shared = node_;
  }
  if (!shared) return true;  // nothing to anchor
  // The call's own node passes the gradient on and links the shared one.
  auto node = make_node<AnchorBackward>(1, false);
  node->set_next_edges({torch::autograd::impl::gradient_edge(out), torch::autograd::Edge(std::move(shared), 0)});
  insert_into_history(out, node);
  return true;
}

TORCH_LIBRARY_IMPL(maskedbranch, CompositeExplicitAutograd, m) {
  m.impl("anchor", &anchor_view);
  m.impl("zeros_like_all", &zeros_like_all);
}

TORCH_LIBRARY_IMPL(maskedbranch, Autograd, m) { m.impl("anchor", &anchor_autograd); }

}  // namespace maskedbranch
