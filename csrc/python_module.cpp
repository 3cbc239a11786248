// The Python module maskedbranch._C: its init function (importing it runs the op
// registrations of every file) and the calls MaskedBranch and unused_grads_to_none make
// directly, without the dispatcher, on every routed call or step.
// MASKEDBRANCH_NO_PYTHON: a plain libtorch library (the CMake build), without this module.
#ifndef MASKEDBRANCH_NO_PYTHON
#include <Python.h>

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
