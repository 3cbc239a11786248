// gate -> routing plan on the host. O(B * N), one pass to count, one to fill; stable order
// (rows ascending within each branch, branches ascending within each row).
#include <torch/library.h>

#include <cmath>

#include "../op_args.h"

namespace maskedbranch {
namespace {

using PlanTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// is_live(b, i) says whether row b is routed to branch i.
template <typename IsLive>
PlanTensors build_plan(int64_t batch, int64_t num_branches, int64_t num_entries, IsLive is_live) {
  auto opts = at::TensorOptions().dtype(at::kLong);
  auto offsets = at::empty({num_branches + 1}, opts);
  auto rows = at::empty({num_entries}, opts);
  auto row_offsets = at::empty({batch + 1}, opts);
  auto row_branch = at::empty({num_entries}, opts);
  auto row_pos = at::empty({num_entries}, opts);
  auto* off = offsets.data_ptr<int64_t>();
  std::fill(off, off + num_branches + 1, 0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < num_branches; ++i)
      if (is_live(b, i)) ++off[i + 1];
  for (int64_t i = 0; i < num_branches; ++i) off[i + 1] += off[i];
  std::vector<int64_t> cursor(off, off + num_branches);
  auto* r = rows.data_ptr<int64_t>();
  auto* ro = row_offsets.data_ptr<int64_t>();
  auto* rb = row_branch.data_ptr<int64_t>();
  auto* rp = row_pos.data_ptr<int64_t>();
  int64_t e = 0;
  ro[0] = 0;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < num_branches; ++i) {
      if (!is_live(b, i)) continue;
      const int64_t p = cursor[i]++;
      r[p] = b;
      rb[e] = i;
      rp[e] = p;
      ++e;
    }
    ro[b + 1] = e;
  }
  return {offsets, rows, row_offsets, row_branch, row_pos};
}

PlanTensors plan_ids(const at::Tensor& gate, int64_t num_branches) {
  auto ids = gate.to(at::kLong).contiguous();
  const int64_t batch = ids.numel();
  const auto* id = ids.data_ptr<int64_t>();
  int64_t live = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_INDEX(id[b] >= -1 && id[b] < num_branches, "gate: branch id ", id[b], " at row ",
                      b, " is out of range; expected -1 (no branch) to ", num_branches - 1);
    live += id[b] >= 0;
  }
  return build_plan(batch, num_branches, live,
                    [id](int64_t b, int64_t i) { return id[b] == i; });
}

template <typename scalar_t>
PlanTensors plan_mask(const at::Tensor& mask, int64_t num_branches) {
  const int64_t batch = mask.size(0);
  const auto* g = mask.data_ptr<scalar_t>();
  int64_t live = 0;
  for (int64_t k = 0; k < batch * num_branches; ++k) {
    if constexpr (!std::is_same_v<scalar_t, bool>) {
      const double v = static_cast<double>(g[k]);
      TORCH_CHECK_VALUE(std::isfinite(v), "gate: weight ", v, " at row ", k / num_branches,
                        ", branch ", k % num_branches, " is not finite");
    }
    live += g[k] != scalar_t(0);
  }
  return build_plan(batch, num_branches, live, [g, num_branches](int64_t b, int64_t i) {
    return g[b * num_branches + i] != scalar_t(0);
  });
}

PlanTensors plan_cpu(const at::Tensor& gate, int64_t num_branches) {
  if (check_gate(gate, num_branches) == GateKind::Ids) return plan_ids(gate, num_branches);
  auto mask = gate.contiguous();
  PlanTensors out;
  AT_DISPATCH_FLOATING_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, mask.scalar_type(),
                                  "maskedbranch_plan", [&] { out = plan_mask<scalar_t>(mask, num_branches); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CPU, m) { m.impl("plan", &plan_cpu); }

}  // namespace maskedbranch
