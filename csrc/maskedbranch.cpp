// Op schemas of the maskedbranch library and the Python module entry point.
// Every op lives in the `maskedbranch` namespace; kernels register per backend in
// csrc/cpu/*.cpp and csrc/cuda/*.cu, autograd and fake kernels in maskedbranch/_ops.py.
// MASKEDBRANCH_NO_PYTHON: a plain libtorch library (the CMake build), without the Python entry point.
#ifndef MASKEDBRANCH_NO_PYTHON
#include <Python.h>
#endif
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#ifndef MASKEDBRANCH_NO_PYTHON
#include <ATen/autocast_mode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <memory>

#include "anchor.h"

namespace {
// `obj` as a sequence whose items are all tensors; a TypeError names the first item that is not.
THPObjectPtr tensor_sequence(PyObject* obj, const char* name) {
  const std::string not_a_sequence = std::string(name) + ": expected a sequence of tensors";
  THPObjectPtr seq(PySequence_Fast(obj, not_a_sequence.c_str()));
  if (!seq) throw python_error();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
  for (Py_ssize_t i = 0; i < n; ++i) {
    TORCH_CHECK_TYPE(THPVariable_Check(PySequence_Fast_GET_ITEM(seq.get(), i)), name, "[", i,
                     "]: expected a tensor");
  }
  return seq;
}

// The tensors of a sequence checked by tensor_sequence.
std::vector<at::Tensor> tensor_list(PyObject* obj, const char* name) {
  const auto seq = tensor_sequence(obj, name);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) out.push_back(THPVariable_Unpack(PySequence_Fast_GET_ITEM(seq.get(), i)));
  return out;
}

// A capsule named `name` that owns `value` (deleted with the capsule).
template <typename T>
PyObject* owning_capsule(std::unique_ptr<T> value, const char* name) {
  PyObject* capsule = PyCapsule_New(value.get(), name, [](PyObject* c) {
    delete static_cast<T*>(PyCapsule_GetPointer(c, PyCapsule_GetName(c)));
  });
  if (capsule != nullptr) value.release();
  return capsule;
}

// _C.anchor_into_history(out, params, materialize) -> bool: MaskedBranch's per-call anchor in
// eager mode, called directly (a routed layer runs it on every call; see csrc/anchor.cpp).
PyObject* py_anchor_into_history(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* out_obj = nullptr;
  PyObject* params_obj = nullptr;
  int materialize = 0;
  if (!PyArg_ParseTuple(args, "OOp", &out_obj, &params_obj, &materialize)) return nullptr;
  TORCH_CHECK_TYPE(THPVariable_Check(out_obj), "out: expected a tensor");
  const auto params = tensor_list(params_obj, "params");
  return PyBool_FromLong(maskedbranch::anchor_into_history(THPVariable_Unpack(out_obj), params, materialize != 0));
  END_HANDLE_TH_ERRORS
}

constexpr const char* kDeadSet = "maskedbranch.DeadSet";

// _C.dead_set(params) -> capsule: the parameters of one set of dead branches, for
// anchor_dead_set (MaskedBranch keeps one per set of live branches).
PyObject* py_dead_set(PyObject* /*self*/, PyObject* params_obj) {
  HANDLE_TH_ERRORS
  return owning_capsule(std::make_unique<maskedbranch::DeadSet>(tensor_list(params_obj, "params")), kDeadSet);
  END_HANDLE_TH_ERRORS
}

// _C.anchor_dead_set(out, set) -> bool: anchor_into_history(out, the set's params, False).
PyObject* py_anchor_dead_set(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *out_obj = nullptr, *set_obj = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &out_obj, &set_obj)) return nullptr;
  TORCH_CHECK_TYPE(THPVariable_Check(out_obj), "out: expected a tensor");
  auto* set = static_cast<maskedbranch::DeadSet*>(PyCapsule_GetPointer(set_obj, kDeadSet));
  if (set == nullptr) return nullptr;
  return PyBool_FromLong(set->anchor_into(THPVariable_Unpack(out_obj)));
  END_HANDLE_TH_ERRORS
}

// _C.grads_to_none(params) -> int: `p.grad = None` for each, returning how many were set.
// unused_grads_to_none clears hundreds of gradients before every step; in Python each costs
// two attribute calls.
PyObject* py_grads_to_none(PyObject* /*self*/, PyObject* params_obj) {
  HANDLE_TH_ERRORS
  const auto seq = tensor_sequence(params_obj, "params");
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.get());
  long cleared = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq.get(), i);
    at::Tensor& grad = THPVariable_Unpack(item).mutable_grad();
    if (!grad.defined()) continue;
    ++cleared;
    if (THPVariable_CheckExact(item)) {
      grad.reset();  // what assigning None to .grad does
    } else if (PyObject_SetAttrString(item, "grad", Py_None) != 0) {
      return nullptr;  // a subclass may intercept the assignment: its error propagates
    }
  }
  return PyLong_FromLong(cleared);
  END_HANDLE_TH_ERRORS
}

// A branch output's row signature, learned for inputs like x: x's trailing sizes, dtype and
// device, and the output's trailing sizes and dtype. MaskedBranch compares every int-gate call
// against the last one it learned; the same comparison in Python (shapes, dtypes and devices
// as Python objects, a dict lookup) cost about 5 us per call.
struct RowSignature {
  std::vector<int64_t> x_trailing, y_trailing;
  at::ScalarType x_dtype, y_dtype;
  at::Device device;
};

constexpr const char* kRowSignature = "maskedbranch.RowSignature";

bool has_rows(const at::Tensor& t) { return t.dim() >= 1 && !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides(); }

std::vector<int64_t> trailing(const at::Tensor& t) { return t.sizes().slice(1).vec(); }

bool trailing_equals(const at::Tensor& t, const std::vector<int64_t>& want) {
  return t.sizes().slice(1).equals(want);
}

// Autocast changes the dtype a branch returns: those calls take the full check in Python.
bool autocast_on(at::DeviceType type) {
  return at::autocast::is_autocast_available(type) && at::autocast::is_autocast_enabled(type);
}

// _C.row_signature(x, y) -> capsule
PyObject* py_row_signature(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *x_obj = nullptr, *y_obj = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &x_obj, &y_obj)) return nullptr;
  TORCH_CHECK_TYPE(THPVariable_Check(x_obj) && THPVariable_Check(y_obj), "row_signature: expected two tensors");
  const at::Tensor& x = THPVariable_Unpack(x_obj);
  const at::Tensor& y = THPVariable_Unpack(y_obj);
  TORCH_CHECK_VALUE(has_rows(x) && has_rows(y), "row_signature: expected tensors with rows and concrete sizes");
  return owning_capsule(
      std::make_unique<RowSignature>(RowSignature{trailing(x), trailing(y), x.scalar_type(), y.scalar_type(), x.device()}),
      kRowSignature);
  END_HANDLE_TH_ERRORS
}

// _C.row_signature_matches(sig, x, y) -> bool: y is a plain tensor with x's rows, and x and y
// have the signature's shapes, dtypes and device (with autocast off on x's device).
PyObject* py_row_signature_matches(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *sig_obj = nullptr, *x_obj = nullptr, *y_obj = nullptr;
  if (!PyArg_ParseTuple(args, "OOO", &sig_obj, &x_obj, &y_obj)) return nullptr;
  auto* sig = static_cast<RowSignature*>(PyCapsule_GetPointer(sig_obj, kRowSignature));
  if (sig == nullptr) return nullptr;
  if (!THPVariable_Check(x_obj) || !THPVariable_CheckExact(y_obj)) Py_RETURN_FALSE;
  const at::Tensor& x = THPVariable_Unpack(x_obj);
  const at::Tensor& y = THPVariable_Unpack(y_obj);
  const bool same = has_rows(x) && has_rows(y) && y.size(0) == x.size(0) && x.scalar_type() == sig->x_dtype &&
                    y.scalar_type() == sig->y_dtype && x.device() == sig->device &&
                    trailing_equals(x, sig->x_trailing) && trailing_equals(y, sig->y_trailing) &&
                    !autocast_on(x.device().type());
  return PyBool_FromLong(same);
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"row_signature", py_row_signature, METH_VARARGS, "row_signature(x, y) -> capsule"},
    {"row_signature_matches", py_row_signature_matches, METH_VARARGS, "row_signature_matches(sig, x, y) -> bool"},
    {"anchor_into_history", py_anchor_into_history, METH_VARARGS,
     "anchor_into_history(out, params, materialize) -> bool"},
    {"dead_set", py_dead_set, METH_O, "dead_set(params) -> capsule"},
    {"anchor_dead_set", py_anchor_dead_set, METH_VARARGS, "anchor_dead_set(out, set) -> bool"},
    {"grads_to_none", py_grads_to_none, METH_O, "grads_to_none(params) -> int"},
    {nullptr, nullptr, 0, nullptr},
};
}  // namespace

extern "C" {
// setuptools builds the extension as a Python module, which needs an init function. Importing
// it runs the static TORCH_LIBRARY initializers.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  PyObject* module = PyModule_Create(&module_def);
#ifdef MASKEDBRANCH_WITH_CUDA
  if (module != nullptr) PyModule_AddIntConstant(module, "WITH_CUDA", 1);
#else
  if (module != nullptr) PyModule_AddIntConstant(module, "WITH_CUDA", 0);
#endif
  return module;
}
}
#endif  // MASKEDBRANCH_NO_PYTHON

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
