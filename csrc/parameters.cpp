// A data-parallel wrapper's parameters by position, and the per-parameter loops of
// maskedbranch's data-parallel layer (maskedbranch/_reducer.py), one call each:
//
//   undefined  which parameters of a set have no gradient (at a backward's start: cleared since
//              the previous one);
//   to_none    set the gradients of a set to undefined (before the optimizer step, those no
//              rank used);
//   note /     remember each gradient of a set as it goes into a step / which gradients of a set
//   changed    are defined and not the one remembered (cleared and produced again since: a
//              model that no wrapper runs, whose backward the layer does not watch).
//
// Positions are those of the wrapper's named_parameters(), as DDP's Reducer indexes its
// variables; a set is a bit set over them, passed as little-endian bytes (a uint8 CPU tensor,
// bit k of byte k / 8: position k). Python would pay about a microsecond per parameter for each
// of these loops (a routed model has hundreds of dead parameters per step); here the Python side
// pays one call. (The tie at the wrapper stays a Python autograd Function: its apply already
// collects the edges in C++, as fast as a C++ Function measured.) Public C++ API only:
// Tensor::grad(), Tensor::mutable_grad(), c10::weak_intrusive_ptr, torch::class_.
#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <vector>

namespace maskedbranch {
namespace {

// Calls fn(k) for each position k set in `bits` below `size`.
template <typename Fn>
void for_each_position(const at::Tensor& bits, int64_t size, const Fn& fn) {
  TORCH_CHECK(bits.device().is_cpu() && bits.scalar_type() == at::kByte && bits.dim() == 1,
              "bits: expected a 1-d uint8 CPU tensor (a bit set over positions), got ", bits.scalar_type(), " ",
              bits.device(), " with ", bits.dim(), " dims");
  const at::Tensor bytes = bits.contiguous();
  const uint8_t* data = bytes.const_data_ptr<uint8_t>();
  const int64_t n = std::min<int64_t>(bytes.numel(), (size + 7) / 8);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t b = data[i];
    if (b == 0) continue;
    for (int j = 0; j < 8; ++j) {
      const int64_t k = 8 * i + j;
      if ((b >> j & 1) && k < size) fn(k);
    }
  }
}

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Parameters : torch::CustomClassHolder {
  std::vector<at::Tensor> params;  // by position; undefined: a position this table does not hold
  // Per position, the gradient it held when last noted; weak, so that a gradient set to None is
  // freed (an expired one never equals a live gradient, even at the same address).
  std::vector<WeakTensor> noted;

  explicit Parameters(std::vector<at::Tensor> params)
      : params(std::move(params)), noted(this->params.size(), WeakTensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>())) {}

  int64_t size() const { return static_cast<int64_t>(params.size()); }

  // The tensor an optimizer holds for position k (FSDP2 puts sharded parameters in the wrapper).
  void set(int64_t k, const at::Tensor& p) {
    TORCH_CHECK(k >= 0 && k < size(), "k: position ", k, " is outside the table's ", size(), " parameters");
    params[static_cast<size_t>(k)] = p;
  }

  // The positions in `bits` whose parameter has no gradient, as a bit set of the same size.
  at::Tensor undefined(const at::Tensor& bits) const {
    at::Tensor out = at::zeros({(size() + 7) / 8}, at::kByte);
    uint8_t* data = out.mutable_data_ptr<uint8_t>();
    for_each_position(bits, size(), [&](int64_t k) {
      const at::Tensor& p = params[static_cast<size_t>(k)];
      if (p.defined() && !p.grad().defined()) data[k / 8] |= static_cast<uint8_t>(1u << (k % 8));
    });
    return out;
  }

  // Sets the gradients of the parameters in `bits` to undefined; returns how many had one.
  int64_t to_none(const at::Tensor& bits) {
    int64_t done = 0;
    for_each_position(bits, size(), [&](int64_t k) {
      at::Tensor& p = params[static_cast<size_t>(k)];
      if (p.defined() && p.grad().defined()) {
        p.mutable_grad().reset();
        ++done;
      }
    });
    return done;
  }

  // Remembers the gradient of each parameter in `bits` (none: forgets).
  void note(const at::Tensor& bits) {
    for_each_position(bits, size(), [&](int64_t k) {
      const at::Tensor& p = params[static_cast<size_t>(k)];
      noted[static_cast<size_t>(k)] = WeakTensor(p.defined() ? p.grad().getIntrusivePtr()
                                                             : c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>());
    });
  }

  // The positions in `bits` whose parameter has a gradient other than the one noted there.
  at::Tensor changed(const at::Tensor& bits) const {
    at::Tensor out = at::zeros({(size() + 7) / 8}, at::kByte);
    uint8_t* data = out.mutable_data_ptr<uint8_t>();
    for_each_position(bits, size(), [&](int64_t k) {
      const at::Tensor& p = params[static_cast<size_t>(k)];
      if (!p.defined() || !p.grad().defined()) return;
      const WeakTensor& w = noted[static_cast<size_t>(k)];
      if (w.expired() || w.lock().get() != p.grad().unsafeGetTensorImpl())
        data[k / 8] |= static_cast<uint8_t>(1u << (k % 8));
    });
    return out;
  }
};

}  // namespace
}  // namespace maskedbranch

TORCH_LIBRARY_FRAGMENT(maskedbranch, m) {
  m.class_<maskedbranch::Parameters>("Parameters")
      .def(torch::init<std::vector<at::Tensor>>())
      .def("size", &maskedbranch::Parameters::size)
      .def("set", &maskedbranch::Parameters::set)
      .def("undefined", &maskedbranch::Parameters::undefined)
      .def("to_none", &maskedbranch::Parameters::to_none)
      .def("note", &maskedbranch::Parameters::note)
      .def("changed", &maskedbranch::Parameters::changed);
}
