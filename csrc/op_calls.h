// Typed calls of the maskedbranch ops through the dispatcher (the handle is looked up once), for
// the autograd code that builds on them: csrc/autograd.cpp, csrc/anchor.cpp, csrc/gather_split.cpp.
#pragma once
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <vector>

namespace maskedbranch {

using OptTensor = c10::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

inline at::Tensor call_gather(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& row_offsets,
                              const at::Tensor& row_pos) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "maskedbranch::gather");
  return h.call(x, rows, row_offsets, row_pos);
}

inline at::Tensor call_gather_backward(const at::Tensor& grad, const at::Tensor& row_offsets,
                                       const at::Tensor& row_pos) {
  static auto h = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>(
      "maskedbranch::gather_backward");
  return h.call(grad, row_offsets, row_pos);
}

inline at::Tensor call_combine(const OptTensor& base, at::TensorList ys, const OptTensor& weights,
                               const at::Tensor& rows, const at::Tensor& row_offsets, const at::Tensor& row_branch,
                               const at::Tensor& row_pos) {
  static auto h = op<at::Tensor(const OptTensor&, at::TensorList, const OptTensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, const at::Tensor&)>("maskedbranch::combine");
  return h.call(base, ys, weights, rows, row_offsets, row_branch, row_pos);
}

inline at::Tensor call_drop_path_scale(const OptTensor& base, const at::Tensor& y, const at::Tensor& scale) {
  static auto h = op<at::Tensor(const OptTensor&, const at::Tensor&, const at::Tensor&)>(
      "maskedbranch::drop_path_scale");
  return h.call(base, y, scale);
}

inline std::vector<at::Tensor> call_zeros_like_all(at::TensorList tensors) {
  static auto h = op<std::vector<at::Tensor>(at::TensorList)>("maskedbranch::zeros_like_all");
  return h.call(tensors);
}

}  // namespace maskedbranch
