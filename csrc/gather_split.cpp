// gather_split: gather every branch's rows into one packed buffer and hand each branch its
// slice as a tensor of its own (same memory, but not a view: no shared version counter, so a
// branch may modify its input in place without disturbing the others). Backward: one combine
// reads the branches' input gradients where they are (never concatenated) and sums them back to
// rows, CSR by row: deterministic. Device-agnostic: it calls the gather and combine ops.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "autograd_node.h"

namespace maskedbranch {
namespace {

using torch::autograd::variable_list;
using OptTensor = c10::optional<at::Tensor>;

at::Tensor call_gather(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& row_offsets,
                       const at::Tensor& row_pos) {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("maskedbranch::gather", "")
                      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return h.call(x, rows, row_offsets, row_pos);
}

at::Tensor call_combine(at::TensorList ys, const at::Tensor& rows, const at::Tensor& row_offsets,
                        const at::Tensor& row_branch, const at::Tensor& row_pos) {
  static auto h = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("maskedbranch::combine", "")
                      .typed<at::Tensor(const OptTensor&, at::TensorList, const OptTensor&, const at::Tensor&,
                                        const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return h.call(c10::nullopt, ys, c10::nullopt, rows, row_offsets, row_branch, row_pos);
}

std::vector<int64_t> checked_counts(at::IntArrayRef counts, int64_t entries) {
  int64_t total = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    TORCH_CHECK_VALUE(counts[i] >= 0, "counts: entry ", i, " is negative (", counts[i], ")");
    total += counts[i];
  }
  TORCH_CHECK_VALUE(total == entries, "counts: they sum to ", total, " but the plan has ", entries,
                    " entries (rows.size(0))");
  return counts.vec();
}

// Rows [start, start + count) of `packed` as a tensor of its own.
at::Tensor alias_rows(const at::Tensor& packed, int64_t start, int64_t count) {
  auto sizes = packed.sizes().vec();
  sizes[0] = count;
  return at::empty({0}, packed.options())
      .set_(packed.storage(), packed.storage_offset() + start * packed.stride(0), sizes, packed.strides());
}

std::vector<at::Tensor> split_rows(const at::Tensor& packed, const std::vector<int64_t>& counts) {
  std::vector<at::Tensor> parts;
  parts.reserve(counts.size());
  int64_t start = 0;
  for (int64_t c : counts) {
    parts.push_back(alias_rows(packed, start, c));
    start += c;
  }
  return parts;
}

std::vector<at::Tensor> gather_split(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& row_offsets,
                                     const at::Tensor& row_branch, const at::Tensor& row_pos,
                                     at::IntArrayRef counts) {
  auto sizes = checked_counts(counts, rows.size(0));
  return split_rows(call_gather(x, rows, row_offsets, row_pos), sizes);
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
    return {call_combine(grads, rows, row_offsets, row_branch, row_pos)};
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
  auto sizes = checked_counts(counts, rows.size(0));
  at::Tensor packed;
  std::vector<at::Tensor> parts;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    packed = call_gather(x, rows, row_offsets, row_pos);
    parts = split_rows(packed, sizes);
  }
  if (torch::autograd::compute_requires_grad(x)) {
    auto node = make_node<GatherSplitBackward>();
    auto* fn = static_cast<GatherSplitBackward*>(node.get());
    fn->set_next_edges(torch::autograd::collect_next_edges(x));
    fn->rows = rows;
    fn->row_offsets = row_offsets;
    fn->row_branch = row_branch;
    fn->row_pos = row_pos;
    fn->counts = sizes;
    fn->trailing = x.sizes().slice(1).vec();
    fn->options = packed.options();
    for (const auto& part : parts) torch::autograd::set_history(part, node);
  }
  return parts;
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CompositeExplicitAutograd, m) { m.impl("gather_split", &gather_split); }

TORCH_LIBRARY_IMPL(maskedbranch, Autograd, m) { m.impl("gather_split", &gather_split_autograd); }

}  // namespace maskedbranch
