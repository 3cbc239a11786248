// Op schemas of the maskedbranch library.
// Every op lives in the `maskedbranch` namespace; kernels register per backend in
// csrc/cpu/*.cpp and csrc/cuda/*.cu, autograd and fake kernels in maskedbranch/_ops.py; the
// Python module `_C` is csrc/python_module.cpp.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

TORCH_LIBRARY(maskedbranch, m) {
  // gate -> routing plan. `offsets` [N+1] always lives on the host (a device gate costs one
  // readback, which also carries the validity check); the rest lives on the gate's device.
  // CSR by branch: `rows` [M]. CSR by row: `row_offsets` [B+1], `row_branch` [M], `row_pos` [M]
  // (the position of each (row, branch) entry in the packed buffer).
  m.def("plan(Tensor gate, int num_branches) -> "
        "(Tensor offsets, Tensor rows, Tensor row_offsets, Tensor row_branch, Tensor row_pos)");
  // packed[p] = x[rows[p]]; the plan's row side rides along for the backward.
  m.def("gather(Tensor x, Tensor rows, Tensor row_offsets, Tensor row_pos) -> Tensor");
  // gather, then each branch's slice (counts[i] rows) as a tensor of its own (not a view);
  // backward: one combine of the slices' gradients.
  m.def("gather_split(Tensor x, Tensor rows, Tensor row_offsets, Tensor row_branch, Tensor row_pos, "
        "int[] counts) -> Tensor[]");
  // grad_x[b] = sum of grad_packed over the packed positions of row b (segmented, no atomics).
  m.def("gather_backward(Tensor grad, Tensor row_offsets, Tensor row_pos) -> Tensor");
  // out[b] = base[b] + sum over row b's entries of weights[b, i] * ys[i][local position].
  m.def("combine(Tensor? base, Tensor[] ys, Tensor? weights, Tensor rows, Tensor row_offsets, "
        "Tensor row_branch, Tensor row_pos) -> Tensor");
  // Packed gradient of every branch output: g[p] = weights[rows[p], i] * grad[rows[p]].
  m.def("combine_backward_ys(Tensor grad, Tensor? weights, Tensor rows, SymInt[] counts) -> Tensor");
  // Gradient of the weights: <grad[b], ys[i][local]> at live entries, zero elsewhere.
  m.def("combine_backward_weights(Tensor grad, Tensor[] ys, Tensor row_offsets, Tensor row_branch, "
        "Tensor row_pos, ScalarType dtype) -> Tensor");
  // out[b] = base[b] + scale[b] * y[b], the fused timm-style drop-path.
  m.def("drop_path_scale(Tensor? base, Tensor y, Tensor scale) -> Tensor");
  // Identity that ties `params` into the graph; its backward yields zeros (materialize) or
  // nothing for them. Returns a view of x, hence the alias annotation.
  m.def("anchor(Tensor(a) x, Tensor[] params, bool materialize) -> Tensor(a)");
  // One batched zero-fill: zeros shaped like each tensor.
  m.def("zeros_like_all(Tensor[] tensors) -> Tensor[]");
}

// The backward ops and the plan have no derivative of their own (double backward is not
// supported): differentiating through them raises instead of silently giving zeros.
TORCH_LIBRARY_IMPL(maskedbranch, Autograd, m) {
  for (const char* name : {"plan", "gather_backward", "combine_backward_ys", "combine_backward_weights",
                           "zeros_like_all"}) {
    m.impl(name, torch::autograd::autogradNotImplementedFallback());
  }
}

#ifndef MASKEDBRANCH_WITH_CUDA
namespace {
// A CPU-only build answers CUDA tensors with a clear error instead of the dispatcher's
// "could not run with arguments from the CUDA backend".
void built_without_cuda(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, op.schema().name(), ": this maskedbranch build has no CUDA kernels (it was ",
              "built without a CUDA-enabled torch or nvcc). Reinstall it where both are present, ",
              "or with FORCE_CUDA=1 and TORCH_CUDA_ARCH_LIST set.");
}
}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CUDA, m) {
  for (const char* name : {"plan", "gather", "gather_backward", "combine", "combine_backward_ys",
                           "combine_backward_weights", "drop_path_scale"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&built_without_cuda>());
  }
}
#endif
