// Argument validation and normalization shared by the CPU and CUDA kernels, so that both
// backends reject the same inputs with the same messages. Checks that need the plan's values
// (ranges, ascending offsets) live with each backend: csrc/cpu/plan_checks.h on the host, and
// the same checks on the host copy or on the device for CUDA.
#pragma once
#include "row_layout.h"

namespace maskedbranch {

enum class GateKind { Ids, Mask };

inline GateKind check_gate(const at::Tensor& gate, int64_t num_branches) {
  TORCH_CHECK_VALUE(num_branches >= 1, "num_branches: expected at least 1 branch, got ", num_branches);
  if (gate.dim() == 1) {
    TORCH_CHECK_TYPE(at::isIntegralType(gate.scalar_type(), /*includeBool=*/false), "gate: a 1-D gate ",
                     "holds one integer branch id per row (-1 = no branch), got dtype ", gate.scalar_type());
    return GateKind::Ids;
  }
  TORCH_CHECK_VALUE(gate.dim() == 2, "gate: expected branch ids [B] or a mask/weights [B, ", num_branches,
                    "], got shape ", gate.sizes());
  TORCH_CHECK_VALUE(gate.size(1) == num_branches, "gate: expected shape [B, ", num_branches,
                    "] (one column per branch), got ", gate.sizes());
  TORCH_CHECK_TYPE(gate.scalar_type() == at::kBool || is_supported_float(gate.scalar_type()),
                   "gate: a 2-D gate must be bool or float64/float32/float16/bfloat16, got dtype ",
                   gate.scalar_type());
  return GateKind::Mask;
}

// The first packed row of each branch (N + 1 entries) from its row counts, which must be
// non-negative and add up to the number of routed entries.
inline std::vector<int64_t> branch_starts(c10::IntArrayRef counts, int64_t num_entries) {
  TORCH_CHECK_VALUE(!counts.empty(), "counts: expected one row count per branch, got none");
  std::vector<int64_t> starts{0};
  for (auto c : counts) {
    TORCH_CHECK_VALUE(c >= 0, "counts: expected non-negative row counts, got ", counts);
    starts.push_back(starts.back() + c);
  }
  TORCH_CHECK_VALUE(starts.back() == num_entries, "counts: they add up to ", starts.back(),
                    " rows but rows holds ", num_entries);
  return starts;
}

// weights [B, N] in the opmath dtype of `ref`, contiguous; undefined when absent.
inline at::Tensor check_weights(const c10::optional<at::Tensor>& weights, const at::Tensor& ref,
                                const char* ref_name, int64_t batch, int64_t num_branches) {
  if (!weights.has_value() || !weights->defined()) return at::Tensor();
  check_floating(*weights, "weights");
  check_same_device(*weights, ref, "weights", ref_name);
  TORCH_CHECK_VALUE(weights->dim() == 2 && weights->size(0) == batch && weights->size(1) == num_branches,
                    "weights: expected shape [", batch, ", ", num_branches, "], got ", weights->sizes());
  return weights->to(opmath_type(ref.scalar_type())).contiguous();
}

struct GatherArgs {
  at::Tensor x;                 // row blocks in `format`
  at::Tensor rows;              // contiguous
  at::Tensor weights;           // opmath dtype, contiguous [B, N], or undefined
  std::vector<int64_t> starts;  // N + 1 entries
  at::MemoryFormat format;
};

inline GatherArgs check_gather(const at::Tensor& x, const at::Tensor& rows,
                               const c10::optional<at::Tensor>& weights, c10::IntArrayRef counts) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "x: expected at least one dimension (rows first)");
  check_floating(x, "x");
  check_index(rows, "rows");
  check_same_device(rows, x, "rows", "x");
  GatherArgs a;
  a.starts = branch_starts(counts, rows.numel());
  a.weights = check_weights(weights, x, "x", x.size(0), static_cast<int64_t>(counts.size()));
  a.format = row_format(x);
  a.x = as_row_blocks(x, a.format);
  a.rows = rows.contiguous();
  return a;
}

// The row side of a plan (CSR by row) for `batch` rows.
struct RowPlan {
  at::Tensor row_offsets, row_branch, row_pos;  // contiguous
  int64_t batch;
  int64_t num_entries;
};

inline RowPlan check_row_plan(const at::Tensor& row_offsets, const at::Tensor& row_branch,
                              const at::Tensor& row_pos, const at::Tensor& ref, const char* ref_name) {
  check_index(row_offsets, "row_offsets");
  check_index(row_branch, "row_branch");
  check_index(row_pos, "row_pos");
  check_same_device(row_offsets, ref, "row_offsets", ref_name);
  check_same_device(row_branch, ref, "row_branch", ref_name);
  check_same_device(row_pos, ref, "row_pos", ref_name);
  TORCH_CHECK_VALUE(row_offsets.numel() >= 1, "row_offsets: expected B + 1 entries, got none");
  TORCH_CHECK_VALUE(row_branch.numel() == row_pos.numel(), "row_branch: expected ", row_pos.numel(),
                    " entries like row_pos, got ", row_branch.numel());
  return {row_offsets.contiguous(), row_branch.contiguous(), row_pos.contiguous(), row_offsets.numel() - 1,
          row_pos.numel()};
}

struct CombineArgs {
  at::Tensor base;              // row blocks in `format`, undefined when absent
  std::vector<at::Tensor> ys;   // row blocks in `format`
  at::Tensor weights;           // opmath dtype, contiguous [B, N], or undefined
  std::vector<int64_t> starts;  // packed position of each branch's first row; N + 1 entries
  at::Tensor ref;               // defines trailing shape, dtype and device of the output
  at::MemoryFormat format;
  RowPlan plan;
};

// combine's arguments; `base` may stand for the output gradient (combine_weights_backward).
inline CombineArgs check_combine(const c10::optional<at::Tensor>& base, at::TensorList ys,
                                 const c10::optional<at::Tensor>& weights, const at::Tensor& row_offsets,
                                 const at::Tensor& row_branch, const at::Tensor& row_pos,
                                 const char* base_name = "base") {
  TORCH_CHECK_VALUE(!ys.empty(), "ys: expected one output per branch, got an empty list");
  CombineArgs a;
  const bool has_base = base.has_value() && base->defined();
  a.ref = has_base ? *base : ys[0];
  const char* ref_name = has_base ? base_name : "ys[0]";
  TORCH_CHECK_VALUE(a.ref.dim() >= 1, ref_name, ": expected at least one dimension (rows first)");
  check_floating(a.ref, ref_name);
  a.plan = check_row_plan(row_offsets, row_branch, row_pos, a.ref, ref_name);
  a.format = row_format(a.ref);
  if (has_base) {
    TORCH_CHECK_VALUE(base->size(0) == a.plan.batch, base_name, ": the plan is for ", a.plan.batch,
                      " rows but ", base_name, " has ", base->size(0));
    a.base = as_row_blocks(*base, a.format);
  }
  a.starts.push_back(0);
  for (size_t i = 0; i < ys.size(); ++i) {
    const auto name = "ys[" + std::to_string(i) + "]";
    check_rows_like(ys[i], a.ref, -1, name, ref_name);
    a.ys.push_back(as_row_blocks(ys[i], a.format));
    a.starts.push_back(a.starts.back() + ys[i].size(0));
  }
  TORCH_CHECK_VALUE(a.starts.back() == a.plan.num_entries, "ys: the branch outputs hold ", a.starts.back(),
                    " rows in all but the plan routes ", a.plan.num_entries,
                    " (each branch must return one row per routed row)");
  a.weights = check_weights(weights, a.ref, ref_name, a.plan.batch, static_cast<int64_t>(ys.size()));
  return a;
}

// ---- pick, pick_backward, put_: the tensors of a whole-batch choice's chosen branch --------
// `tensors` holds k tensors per branch, branch after branch; tensor j of every branch has the
// shape and dtype of branch 0's and lives on its device. `index` names the branch.

inline void check_choice_index(const at::Tensor& index, at::TensorList tensors) {
  TORCH_CHECK_TYPE(at::isIntegralType(index.scalar_type(), /*includeBool=*/false),
                   "index: expected an integer tensor (the chosen branch), got dtype ", index.scalar_type());
  TORCH_CHECK_VALUE(index.numel() == 1, "index: expected one element (the chosen branch), got shape ",
                    index.sizes());
  if (!tensors.empty()) check_same_device(index, tensors[0], "index", "the tensors");
}

// k, the number of tensors per branch.
inline int64_t check_branch_tensors(at::TensorList tensors, int64_t branches, const char* name) {
  TORCH_CHECK_VALUE(branches >= 1, "branches: expected at least 1, got ", branches);
  const int64_t total = static_cast<int64_t>(tensors.size());
  TORCH_CHECK_VALUE(total % branches == 0, name, ": expected the same number of tensors for each of the ",
                    branches, " branches, got ", total, " tensors");
  const int64_t k = total / branches;
  for (int64_t e = k; e < total; ++e) {
    const at::Tensor& t = tensors[e];
    const at::Tensor& first = tensors[e % k];
    TORCH_CHECK_VALUE(t.sizes() == first.sizes() && t.scalar_type() == first.scalar_type(), name, "[", e,
                      "] (branch ", e / k, ", tensor ", e % k, "): expected shape ", first.sizes(), " and dtype ",
                      first.scalar_type(), " like branch 0's, got ", t.sizes(), " and ", t.scalar_type());
    TORCH_CHECK_VALUE(t.device() == tensors[0].device(), name, "[", e, "]: expected a tensor on ",
                      tensors[0].device(), " like ", name, "[0], got one on ", t.device());
  }
  return k;
}

// put_'s values: one per tensor of a branch, each like branch 0's.
inline void check_choice_values(at::TensorList values, at::TensorList tensors, int64_t k) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(values.size()) == k, "values: expected one tensor per tensor of a ",
                    "branch (", k, "), got ", values.size());
  for (int64_t j = 0; j < k; ++j) {
    TORCH_CHECK_VALUE(values[j].sizes() == tensors[j].sizes() && values[j].scalar_type() == tensors[j].scalar_type(),
                      "values[", j, "]: expected shape ", tensors[j].sizes(), " and dtype ", tensors[j].scalar_type(),
                      " like tensors[", j, "], got ", values[j].sizes(), " and ", values[j].scalar_type());
    TORCH_CHECK_VALUE(values[j].device() == tensors[j].device(), "values[", j, "]: expected a tensor on ",
                      tensors[j].device(), " like tensors[", j, "], got one on ", values[j].device());
  }
}

// The host's check of an index read back (CPU kernels): -1 (no branch) only where allowed.
inline int64_t checked_choice(int64_t i, int64_t branches, bool allow_none) {
  TORCH_CHECK_VALUE((allow_none ? i >= -1 : i >= 0) && i < branches, "index: expected a branch in [",
                    allow_none ? -1 : 0, ", ", branches, "), got ", i);
  return i;
}

}  // namespace maskedbranch
