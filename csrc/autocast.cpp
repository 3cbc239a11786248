// Autocast: combine and drop_path_scale add tensors that autocast may leave in different
// dtypes (a float32 residual plus a bfloat16 branch output). Like autocast's "promote" ops
// (cat, stack, index_put) they run in the widest floating dtype among those tensors. gather
// has a single activation input and falls through unchanged.
#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace maskedbranch {
namespace {

at::ScalarType widest(at::ScalarType a, const at::Tensor& t) {
  // Only floating dtypes take part; anything else reaches the kernel as is and is refused there.
  return t.defined() && at::isFloatingType(t.scalar_type()) && at::isFloatingType(a)
             ? at::promote_types(a, t.scalar_type())
             : a;
}

at::Tensor cast_to(const at::Tensor& t, at::ScalarType dtype) {
  return t.defined() && at::isFloatingType(t.scalar_type()) && t.scalar_type() != dtype ? t.to(dtype) : t;
}

at::Tensor combine_autocast(const c10::optional<at::Tensor>& base, at::TensorList ys,
                            const c10::optional<at::Tensor>& weights, const at::Tensor& rows,
                            const at::Tensor& row_offsets, const at::Tensor& row_branch,
                            const at::Tensor& row_pos) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  at::ScalarType dtype = ys.empty() ? at::kFloat : ys[0].scalar_type();
  if (base.has_value()) dtype = widest(dtype, *base);
  for (const auto& y : ys) dtype = widest(dtype, y);
  std::vector<at::Tensor> cast_ys;
  for (const auto& y : ys) cast_ys.push_back(cast_to(y, dtype));
  c10::optional<at::Tensor> cast_base;
  if (base.has_value()) cast_base = cast_to(*base, dtype);
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("maskedbranch::combine", "").typed<decltype(combine_autocast)>();
  return op.call(cast_base, cast_ys, weights, rows, row_offsets, row_branch, row_pos);
}

at::Tensor drop_path_scale_autocast(const c10::optional<at::Tensor>& base, const at::Tensor& y,
                                    const at::Tensor& scale) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  at::ScalarType dtype = y.scalar_type();
  if (base.has_value()) dtype = widest(dtype, *base);
  c10::optional<at::Tensor> cast_base;
  if (base.has_value()) cast_base = cast_to(*base, dtype);
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("maskedbranch::drop_path_scale", "").typed<decltype(drop_path_scale_autocast)>();
  return op.call(cast_base, cast_to(y, dtype), scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, AutocastCPU, m) {
  m.impl("combine", &combine_autocast);
  m.impl("drop_path_scale", &drop_path_scale_autocast);
}

TORCH_LIBRARY_IMPL(maskedbranch, AutocastCUDA, m) {
  m.impl("combine", &combine_autocast);
  m.impl("drop_path_scale", &drop_path_scale_autocast);
}

}  // namespace maskedbranch
