// gather_split: gather every branch's rows into one packed buffer and hand each branch its
// slice as a tensor of its own (same memory, but not a view: no shared version counter, so a
// branch may modify its input in place without disturbing the others). Backward: one combine
// reads the branches' input gradients where they are (never concatenated) and sums them back to
// rows, CSR by row: deterministic. Device-agnostic: it calls the gather and combine ops.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "autograd_node.h"
#include "op_args.h"
#include "op_calls.h"

namespace maskedbranch {
namespace {

using torch::autograd::variable_list;

// Rows [start, start + count) of `packed` as a tensor of its own.
at::Tensor alias_rows(const at::Tensor& packed, int64_t start, int64_t count) {
  auto sizes = packed.sizes().vec();
  sizes[0] = count;
  return at::empty({0}, packed.options())
      .set_(packed.storage(), packed.storage_offset() + start * packed.stride(0), sizes, packed.strides());
}

std::vector<at::Tensor> gather_split(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& row_offsets,
                                     const at::Tensor& row_branch, const at::Tensor& row_pos,
                                     at::IntArrayRef counts) {
  const auto starts = branch_starts(counts, rows);
  const auto packed = call_gather(x, rows, row_offsets, row_pos);
  std::vector<at::Tensor> parts;
  parts.reserve(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) parts.push_back(alias_rows(packed, starts[i], counts[i]));
  return parts;
}

struct GatherSplitBackward : public torch::autograd::Node {
  variable_list apply(variable_list&& grads) override {
    if (!should_compute_output(0)) return {at::Tensor()};
    // A branch whose input gradient is undefined contributes zeros.
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) {
        auto sizes = trailing;
        sizes.insert(sizes.begin(), counts[i]);
        grads[i] = at::zeros(sizes, options);
      }
    }
    return {call_combine(c10::nullopt, grads, c10::nullopt, rows, row_offsets, row_branch, row_pos)};
  }
  std::string name() const override { return "maskedbranch::GatherSplitBackward"; }
  void release_variables() override {
    rows.reset();
    row_offsets.reset();
    row_branch.reset();
    row_pos.reset();
  }

  at::Tensor rows, row_offsets, row_branch, row_pos;  // the plan (index tensors, never modified)
  std::vector<int64_t> counts, trailing;
  at::TensorOptions options;
};

std::vector<at::Tensor> gather_split_autograd(const at::Tensor& x, const at::Tensor& rows,
                                              const at::Tensor& row_offsets, const at::Tensor& row_branch,
                                              const at::Tensor& row_pos, at::IntArrayRef counts) {
  std::vector<at::Tensor> parts;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    parts = gather_split(x, rows, row_offsets, row_branch, row_pos, counts);
  }
  if (torch::autograd::compute_requires_grad(x)) {
    auto node = make_node<GatherSplitBackward>();
    auto* fn = static_cast<GatherSplitBackward*>(node.get());
    fn->set_next_edges(torch::autograd::collect_next_edges(x));
    fn->rows = rows;
    fn->row_offsets = row_offsets;
    fn->row_branch = row_branch;
    fn->row_pos = row_pos;
    fn->counts = counts.vec();
    fn->trailing = x.sizes().slice(1).vec();
    fn->options = parts.front().options();  // one part per branch: never empty
    for (const auto& part : parts) torch::autograd::set_history(part, node);
  }
  return parts;
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CompositeExplicitAutograd, m) { m.impl("gather_split", &gather_split); }

TORCH_LIBRARY_IMPL(maskedbranch, Autograd, m) { m.impl("gather_split", &gather_split_autograd); }

}  // namespace maskedbranch
