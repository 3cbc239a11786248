// Argument validation and normalization shared by the CPU and CUDA kernels, so both
// backends reject the same inputs with the same messages.
#pragma once
#include "row_layout.h"

namespace maskedbranch {

enum class GateKind { Ids, Mask };

inline GateKind check_gate(const at::Tensor& gate, int64_t num_branches) {
  TORCH_CHECK_VALUE(num_branches >= 1, "num_branches: expected at least 1 branch, got ",
                    num_branches);
  if (gate.dim() == 1) {
    TORCH_CHECK_TYPE(at::isIntegralType(gate.scalar_type(), /*includeBool=*/false), "gate: a 1-D gate ",
                     "holds one integer branch id per row (-1 = no branch), got dtype ",
                     gate.scalar_type());
    return GateKind::Ids;
  }
  TORCH_CHECK_VALUE(gate.dim() == 2, "gate: expected branch ids [B] or a mask/weights [B, ",
                    num_branches, "], got shape ", gate.sizes());
  TORCH_CHECK_VALUE(gate.size(1) == num_branches, "gate: expected shape [B, ", num_branches,
                    "] (one column per branch), got ", gate.sizes());
  TORCH_CHECK_TYPE(gate.scalar_type() == at::kBool || at::isFloatingType(gate.scalar_type()),
                   "gate: a 2-D gate must be bool or floating, got dtype ", gate.scalar_type());
  return GateKind::Mask;
}

// The row side of a plan for B rows and M entries.
inline void check_row_plan(const at::Tensor& row_offsets, const at::Tensor& row_pos,
                           const at::Tensor& ref, const char* ref_name) {
  check_index(row_offsets, "row_offsets");
  check_index(row_pos, "row_pos");
  check_same_device(row_offsets, ref, "row_offsets", ref_name);
  check_same_device(row_pos, ref, "row_pos", ref_name);
  TORCH_CHECK_VALUE(row_offsets.numel() >= 1, "row_offsets: expected B + 1 entries, got none");
}

inline int64_t plan_rows(const at::Tensor& row_offsets) { return row_offsets.numel() - 1; }

struct GatherArgs {
  at::Tensor x;
  at::MemoryFormat format;
};

inline GatherArgs check_gather(const at::Tensor& x, const at::Tensor& rows,
                               const at::Tensor& row_offsets, const at::Tensor& row_pos) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "x: expected at least one dimension (rows first)");
  check_floating(x, "x");
  check_index(rows, "rows");
  check_same_device(rows, x, "rows", "x");
  check_row_plan(row_offsets, row_pos, x, "x");
  TORCH_CHECK_VALUE(plan_rows(row_offsets) == x.size(0), "row_offsets: the plan is for ",
                    plan_rows(row_offsets), " rows but x has ", x.size(0));
  TORCH_CHECK_VALUE(row_pos.numel() == rows.numel(), "row_pos: expected ", rows.numel(),
                    " entries like rows, got ", row_pos.numel());
  auto format = row_format(x);
  return {as_row_blocks(x, format), format};
}

struct GatherBackwardArgs {
  at::Tensor grad;
  at::MemoryFormat format;
};

inline GatherBackwardArgs check_gather_backward(const at::Tensor& grad, const at::Tensor& row_offsets,
                                                const at::Tensor& row_pos) {
  TORCH_CHECK_VALUE(grad.dim() >= 1, "grad: expected at least one dimension (rows first)");
  check_floating(grad, "grad");
  check_row_plan(row_offsets, row_pos, grad, "grad");
  TORCH_CHECK_VALUE(row_pos.numel() == grad.size(0), "row_pos: expected one entry per packed row (",
                    grad.size(0), "), got ", row_pos.numel());
  auto format = row_format(grad);
  return {as_row_blocks(grad, format), format};
}

struct CombineArgs {
  at::Tensor base;              // undefined when absent
  std::vector<at::Tensor> ys;   // row blocks in `format`
  at::Tensor weights;           // opmath dtype, contiguous [B, N], or undefined
  std::vector<int64_t> starts;  // packed position of each branch's first row; N + 1 entries
  at::Tensor ref;               // defines trailing shape, dtype and device of the output
  at::MemoryFormat format;
  int64_t batch;
};

inline CombineArgs check_combine(const c10::optional<at::Tensor>& base, at::TensorList ys,
                                 const c10::optional<at::Tensor>& weights, const at::Tensor& rows,
                                 const at::Tensor& row_offsets, const at::Tensor& row_branch,
                                 const at::Tensor& row_pos) {
  TORCH_CHECK_VALUE(!ys.empty(), "ys: expected one output per branch, got an empty list");
  CombineArgs a;
  const bool has_base = base.has_value() && base->defined();
  a.ref = has_base ? *base : ys[0];
  const char* ref_name = has_base ? "base" : "ys[0]";
  TORCH_CHECK_VALUE(a.ref.dim() >= 1, ref_name, ": expected at least one dimension (rows first)");
  check_floating(a.ref, ref_name);
  check_row_plan(row_offsets, row_pos, a.ref, ref_name);
  check_index(row_branch, "row_branch");
  check_same_device(row_branch, a.ref, "row_branch", ref_name);
  TORCH_CHECK_VALUE(row_branch.numel() == row_pos.numel(), "row_branch: expected ",
                    row_pos.numel(), " entries like row_pos, got ", row_branch.numel());
  check_index(rows, "rows");
  check_same_device(rows, a.ref, "rows", ref_name);
  TORCH_CHECK_VALUE(rows.numel() == row_pos.numel(), "rows: expected ", row_pos.numel(),
                    " entries like row_pos, got ", rows.numel());
  a.batch = plan_rows(row_offsets);
  a.format = row_format(a.ref);
  if (has_base) {
    TORCH_CHECK_VALUE(base->size(0) == a.batch, "base: the plan is for ", a.batch,
                      " rows but base has ", base->size(0));
    a.base = as_row_blocks(*base, a.format);
  }
  a.starts.push_back(0);
  for (size_t i = 0; i < ys.size(); ++i) {
    const auto name = "ys[" + std::to_string(i) + "]";
    check_rows_like(ys[i], a.ref, -1, name, ref_name);
    a.ys.push_back(as_row_blocks(ys[i], a.format));
    a.starts.push_back(a.starts.back() + ys[i].size(0));
  }
  TORCH_CHECK_VALUE(a.starts.back() == row_pos.numel(), "ys: the branch outputs hold ",
                    a.starts.back(), " rows in all but the plan routes ", row_pos.numel(),
                    " (each branch must return one row per routed row)");
  if (weights.has_value() && weights->defined()) {
    check_floating(*weights, "weights");
    check_same_device(*weights, a.ref, "weights", ref_name);
    TORCH_CHECK_VALUE(weights->dim() == 2 && weights->size(0) == a.batch &&
                          weights->size(1) == static_cast<int64_t>(ys.size()),
                      "weights: expected shape [", a.batch, ", ", ys.size(), "], got ",
                      weights->sizes());
    a.weights = weights->to(opmath_type(a.ref.scalar_type())).contiguous();
  }
  return a;
}

}  // namespace maskedbranch

namespace maskedbranch {

struct CombineBackwardYsArgs {
  at::Tensor grad;
  at::Tensor weights;           // opmath dtype, contiguous, or undefined
  std::vector<int64_t> starts;  // N + 1 entries
  at::MemoryFormat format;
};

// The first packed row of each branch (N + 1 entries) from its row counts, which must be
// non-negative and add up to the plan's entries.
inline std::vector<int64_t> branch_starts(c10::IntArrayRef counts, const at::Tensor& rows) {
  TORCH_CHECK_VALUE(!counts.empty(), "counts: expected one row count per branch, got none");
  std::vector<int64_t> starts{0};
  for (auto c : counts) {
    TORCH_CHECK_VALUE(c >= 0, "counts: expected non-negative row counts, got ", counts);
    starts.push_back(starts.back() + c);
  }
  TORCH_CHECK_VALUE(starts.back() == rows.numel(), "counts: they add up to ", starts.back(),
                    " rows but rows holds ", rows.numel());
  return starts;
}

inline CombineBackwardYsArgs check_combine_backward_ys(const at::Tensor& grad,
                                                      const c10::optional<at::Tensor>& weights,
                                                      const at::Tensor& rows,
                                                      c10::IntArrayRef counts) {
  TORCH_CHECK_VALUE(grad.dim() >= 1, "grad: expected at least one dimension (rows first)");
  check_floating(grad, "grad");
  check_index(rows, "rows");
  check_same_device(rows, grad, "rows", "grad");
  CombineBackwardYsArgs a;
  a.starts = branch_starts(counts, rows);
  if (weights.has_value() && weights->defined()) {
    check_floating(*weights, "weights");
    check_same_device(*weights, grad, "weights", "grad");
    TORCH_CHECK_VALUE(weights->dim() == 2 && weights->size(0) == grad.size(0) &&
                          weights->size(1) == static_cast<int64_t>(counts.size()),
                      "weights: expected shape [", grad.size(0), ", ", counts.size(), "], got ",
                      weights->sizes());
    a.weights = weights->to(opmath_type(grad.scalar_type())).contiguous();
  }
  a.format = row_format(grad);
  a.grad = as_row_blocks(grad, a.format);
  return a;
}

// out[b] = base[b] + scale[b] * y[b].
struct DropPathArgs {
  at::Tensor base;  // undefined when absent
  at::Tensor y;
  at::Tensor scale;  // opmath dtype, contiguous [B]
  at::MemoryFormat format;
};

inline DropPathArgs check_drop_path_scale(const c10::optional<at::Tensor>& base, const at::Tensor& y,
                                          const at::Tensor& scale) {
  TORCH_CHECK_VALUE(y.dim() >= 1, "y: expected at least one dimension (rows first)");
  check_floating(y, "y");
  check_floating(scale, "scale");
  check_same_device(scale, y, "scale", "y");
  TORCH_CHECK_VALUE(scale.dim() == 1 && scale.size(0) == y.size(0), "scale: expected shape [",
                    y.size(0), "] (one factor per row of y), got ", scale.sizes());
  DropPathArgs a;
  a.format = row_format(y);
  a.y = as_row_blocks(y, a.format);
  if (base.has_value() && base->defined()) {
    check_rows_like(*base, y, y.size(0), "base", "y");
    a.base = as_row_blocks(*base, a.format);
  }
  a.scale = scale.to(opmath_type(y.scalar_type())).contiguous();
  return a;
}

}  // namespace maskedbranch
