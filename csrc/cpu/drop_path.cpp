// drop_path_scale: out[b] = base[b] + scale[b] * y[b], one pass over y (and base).
#include <torch/library.h>

#include "../op_args.h"
#include "row_kernels.h"

namespace maskedbranch {
namespace {

at::Tensor drop_path_scale_cpu(const c10::optional<at::Tensor>& base_in, const at::Tensor& y_in,
                               const at::Tensor& scale_in) {
  auto a = check_drop_path_scale(base_in, y_in, scale_in);
  const int64_t batch = a.y.size(0);
  const int64_t d = row_numel(a.y);
  auto out = empty_rows(batch, a.y.sizes().slice(1), a.y.options(), a.format);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.y.scalar_type(), "maskedbranch_drop_path_scale", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* y = a.y.const_data_ptr<scalar_t>();
    const scalar_t* base = a.base.defined() ? a.base.const_data_ptr<scalar_t>() : nullptr;
    const opmath_t* scale = a.scale.const_data_ptr<opmath_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch, cpu::row_grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const opmath_t s = scale[b];
        const scalar_t* yr = y + b * d;
        scalar_t* orow = o + b * d;
        if (base == nullptr) {
          for (int64_t j = 0; j < d; ++j) orow[j] = static_cast<scalar_t>(s * static_cast<opmath_t>(yr[j]));
        } else {
          const scalar_t* br = base + b * d;
          for (int64_t j = 0; j < d; ++j)
            orow[j] = static_cast<scalar_t>(static_cast<opmath_t>(br[j]) + s * static_cast<opmath_t>(yr[j]));
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CPU, m) { m.impl("drop_path_scale", &drop_path_scale_cpu); }

}  // namespace maskedbranch
