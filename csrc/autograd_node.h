// Helpers for hand-written autograd nodes (anchor, gather_split): nodes built and freed once per
// routed call, where the generic torch::autograd::Function machinery costs more than a small
// branch.
#pragma once
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <type_traits>
#include <utility>

namespace maskedbranch {

// Autograd nodes are held by c10::intrusive_ptr since torch 2.13, by std::shared_ptr before.
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename T, typename... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

}  // namespace maskedbranch
