// gather (CPU): each branch's rows of x into a new tensor of its own, optionally scaled by the
// gate weights (which makes it combine's backward with respect to the branch outputs).
#include <torch/library.h>

#include "../op_args.h"
#include "plan_checks.h"
#include "row_kernels.h"

namespace maskedbranch {
namespace {

std::vector<at::Tensor> gather_cpu(const at::Tensor& x_in, const at::Tensor& rows_in,
                                   const c10::optional<at::Tensor>& weights, c10::IntArrayRef counts) {
  auto a = check_gather(x_in, rows_in, weights, counts);
  const int64_t num_entries = a.rows.numel();
  cpu::check_in_range(a.rows.const_data_ptr<int64_t>(), num_entries, 0, a.x.size(0), "rows");
  std::vector<at::Tensor> outs;
  outs.reserve(counts.size());
  for (auto c : counts) outs.push_back(empty_rows(c, a.x.sizes().slice(1), a.x.options(), a.format));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x.scalar_type(), "maskedbranch_gather", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<scalar_t*> dst;
    for (auto& o : outs) dst.push_back(o.data_ptr<scalar_t>());
    cpu::gather_rows<scalar_t>(dst, a.x.const_data_ptr<scalar_t>(), a.x.size(0), a.rows.const_data_ptr<int64_t>(), a.starts,
                               row_numel(a.x), a.weights.defined() ? a.weights.const_data_ptr<opmath_t>() : nullptr);
  });
  return outs;
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CPU, m) { m.impl("gather", &gather_cpu); }

}  // namespace maskedbranch
