// Op schemas of the maskedbranch library (the op families and their kernels: docs/design.md).
//
// The ops are primitives: CPU kernels in csrc/cpu/, CUDA kernels in csrc/cuda/, fake kernels
// and the autograd formulas in maskedbranch/_ops.py and maskedbranch/_autograd.py. gather and
// combine are each other's adjoint, so each one's backward is a call of the other.
//
// The library is loaded with torch.ops.load_library (no Python module, no CPython API).
//
// Plans made by hand (not by `plan`) are checked: on the CPU on the host (an exception that
// names the argument), on a GPU by device asserts, which cost no synchronization but leave the
// CUDA context unusable (csrc/cuda/plan_asserts.cuh says why). Both reject the same plans.
//
// CUDA graphs: gather, combine and combine_weights_backward launch kernels only (more than 64
// branches included: their pointer table is written by kernels, not copied from host memory),
// so they can be captured with a plan made before capture; so do pick, pick_backward and put_. `plan` with a GPU gate reads the
// counts back and refuses to run under capture.
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <vector>

namespace maskedbranch {
namespace {

#ifdef MASKEDBRANCH_WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

bool with_cuda() { return kWithCuda; }

// How many threads the CPU kernels' parallel loops run on now: at most torch.get_num_threads(),
// and 1 in a build whose parallel_for cannot fork (compiled without OpenMP under torch's OpenMP
// backend, where every kernel would silently run on one thread).
int64_t cpu_kernel_threads() {
  const int64_t limit = at::get_num_threads();
  std::vector<char> seen(static_cast<size_t>(limit), 0);  // one slot per thread: no races
  at::parallel_for(0, limit, 1, [&](int64_t, int64_t) {
    const int tid = at::get_thread_num();
    if (tid >= 0 && tid < limit) seen[static_cast<size_t>(tid)] = 1;
  });
  int64_t used = 0;
  for (char s : seen) used += s;
  return used;
}

}  // namespace
}  // namespace maskedbranch

TORCH_LIBRARY(maskedbranch, m) {
  // gate -> routing plan. `offsets` [N+1] always lives on the host (a device gate costs one
  // readback, which also carries the validity check); the rest lives on the gate's device.
  // CSR by branch: `rows` [M]. CSR by row: `row_offsets` [B+1], `row_branch` [M], `row_pos` [M]
  // (the position of each (row, branch) entry in the packed order).
  m.def("plan(Tensor gate, int num_branches) -> "
        "(Tensor offsets, Tensor rows, Tensor row_offsets, Tensor row_branch, Tensor row_pos)");
  // Each branch's rows of x, one new tensor per branch: out[i][k] = w * x[rows[starts[i] + k]],
  // w = weights[row, i] (or 1). counts[i] rows for branch i, in the plan's order.
  m.def("gather(Tensor x, Tensor rows, Tensor? weights, SymInt[] counts) -> Tensor[]");
  // out[b] = base[b] + sum over row b's entries e of weights[b, i] * ys[i][row_pos[e] - start_i],
  // i = row_branch[e]: a segmented sum in a fixed order (deterministic, no atomics).
  m.def("combine(Tensor? base, Tensor[] ys, Tensor? weights, Tensor row_offsets, Tensor row_branch, "
        "Tensor row_pos) -> Tensor");
  // The gradient of combine's weights: <grad[b], ys[i][...]> at live entries, zero elsewhere,
  // [B, N] in float32 (float64 for float64 inputs).
  m.def("combine_weights_backward(Tensor grad, Tensor[] ys, Tensor row_offsets, Tensor row_branch, "
        "Tensor row_pos) -> Tensor");
  // A whole-batch choice's chosen branch (maskedbranch/_choice.py's stacked form): `tensors`
  // holds k tensors per branch, branch after branch, and `index` (one integer) names the
  // branch. pick: copies of its k tensors (contiguous). pick_backward: pick's gradient, the k
  // `grads` for the chosen branch and zeros for the others, branch after branch. put_: writes
  // `values` into its k tensors, nothing when index is -1 (no branch ran).
  m.def("pick(Tensor[] tensors, Tensor index, int branches) -> Tensor[]");
  m.def("pick_backward(Tensor[] grads, Tensor index, int branches) -> Tensor[]");
  m.def("put_(Tensor(a!)[] tensors, Tensor index, int branches, Tensor[] values) -> ()");
  // Whether this build has CUDA kernels.
  m.def("with_cuda() -> bool", &maskedbranch::with_cuda);
  // How many threads the CPU kernels run on at the current torch thread count.
  m.def("cpu_kernel_threads() -> int", &maskedbranch::cpu_kernel_threads);
}

// The formulas live in Python (maskedbranch/_autograd.py). Differentiating the raw ops
// raises instead of silently giving no gradient.
TORCH_LIBRARY_IMPL(maskedbranch, Autograd, m) {
  for (const char* name : {"plan", "gather", "combine", "combine_weights_backward", "pick", "pick_backward"}) {
    m.impl(name, torch::autograd::autogradNotImplementedFallback());
  }
}

// put_ writes into its tensors: not differentiable, and their version counters move, as for any
// in-place op (the generic fallback moves those of single mutable tensors, not of a list).
namespace maskedbranch {
namespace {
void put_autograd(at::TensorList tensors, const at::Tensor& index, int64_t branches, at::TensorList values) {
  if (at::GradMode::is_enabled()) {
    for (size_t e = 0; e < tensors.size(); ++e)
      TORCH_CHECK(!tensors[e].requires_grad(), "tensors[", e, "]: put_ writes into tensors that do not require grad ",
                  "(it has no derivative)");
    for (size_t j = 0; j < values.size(); ++j)
      TORCH_CHECK(!values[j].requires_grad(), "values[", j, "]: put_ has no derivative (call it under no_grad)");
  }
  {
    at::AutoDispatchBelowADInplaceOrView below;
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("maskedbranch::put_", "")
                               .typed<void(at::TensorList, const at::Tensor&, int64_t, at::TensorList)>();
    op.call(tensors, index, branches, values);
  }
  for (const at::Tensor& t : tensors) t.unsafeGetTensorImpl()->bump_version();
}
}  // namespace
}  // namespace maskedbranch

TORCH_LIBRARY_IMPL(maskedbranch, Autograd, m) { m.impl("put_", &maskedbranch::put_autograd); }

#ifndef MASKEDBRANCH_WITH_CUDA
namespace maskedbranch {
namespace {
// A CPU-only build answers CUDA tensors with a clear error instead of the dispatcher's
// "could not run with arguments from the CUDA backend".
void built_without_cuda(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, op.schema().name(), ": this maskedbranch build has no CUDA kernels (it was ",
              "built without a CUDA-enabled torch or nvcc). Reinstall it where both are present, ",
              "or with FORCE_CUDA=1 and TORCH_CUDA_ARCH_LIST set.");
}
}  // namespace
}  // namespace maskedbranch

TORCH_LIBRARY_IMPL(maskedbranch, CUDA, m) {
  for (const char* name : {"plan", "gather", "combine", "combine_weights_backward", "pick", "pick_backward", "put_"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&maskedbranch::built_without_cuda>());
  }
}
#endif
