// The CUDA ops' entry points (one .cu file per op family). The library registers them for the
// CUDA dispatch key; the host emulation's test library (tests/cuda_emu) calls the same functions
// on CPU tensors.
#pragma once
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace maskedbranch {
namespace cuda {

using PlanTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

PlanTensors plan_cuda(const at::Tensor& gate, int64_t num_branches);

std::vector<at::Tensor> gather_cuda(const at::Tensor& x, const at::Tensor& rows,
                                    const c10::optional<at::Tensor>& weights, c10::IntArrayRef counts);

at::Tensor combine_cuda(const c10::optional<at::Tensor>& base, at::TensorList ys,
                        const c10::optional<at::Tensor>& weights, const at::Tensor& row_offsets,
                        const at::Tensor& row_branch, const at::Tensor& row_pos);

at::Tensor combine_weights_backward_cuda(const at::Tensor& grad, at::TensorList ys, const at::Tensor& row_offsets,
                                         const at::Tensor& row_branch, const at::Tensor& row_pos);

std::vector<at::Tensor> pick_cuda(at::TensorList tensors, const at::Tensor& index, int64_t branches);

std::vector<at::Tensor> pick_backward_cuda(at::TensorList grads, const at::Tensor& index, int64_t branches);

void put_cuda(at::TensorList tensors, const at::Tensor& index, int64_t branches, at::TensorList values);

}  // namespace cuda
}  // namespace maskedbranch
