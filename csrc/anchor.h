// The eager anchors MaskedBranch calls directly from Python (csrc/python_module.cpp).
#pragma once
#include <ATen/ATen.h>

#include <mutex>
#include <vector>

#include "autograd_node.h"

namespace maskedbranch {

// Put a node that hands `params` their gradients into `out`'s history; false when `out` is not
// a tensor produced by an op under grad mode (the caller then uses the anchor op).
bool anchor_into_history(const at::Tensor& out, at::TensorList params, bool materialize);

// The parameters of one set of dead branches and the node that hands them their (undefined)
// gradients, built once and linked by every call that anchors that set: a call then adds one
// edge instead of collecting one per parameter, which reads each parameter's autograd metadata
// (cold in the cache of a large model: about 10 us per call at 64 -> 256 -> 64, 12 parameters).
class DeadSet {
 public:
  explicit DeadSet(std::vector<at::Tensor> params);
  // anchor_into_history(out, params, /*materialize=*/false), through the shared node.
  bool anchor_into(const at::Tensor& out);

 private:
  bool stale() const;
  void build();

  std::vector<at::Tensor> params_;
  std::mutex mutex_;  // a stale set is rebuilt under it
  // When built: the parameters that required grad (linked, with their dtype and device) and
  // those that did not. A parameter unfrozen later needs a rebuild; one frozen later keeps its
  // edge, and its accumulator, given no gradient, sets none. A dtype or device change through
  // `.data` gives a parameter a new accumulator, hence the check.
  std::vector<at::Tensor> linked_, frozen_;
  std::vector<caffe2::TypeMeta> dtypes_;
  std::vector<c10::Device> devices_;
  NodePtr node_;  // null when nothing is linked
};

}  // namespace maskedbranch
