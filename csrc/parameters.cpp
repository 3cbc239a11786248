// A data-parallel wrapper's parameters by position, and the per-parameter loops of
// maskedbranch's data-parallel layer (maskedbranch/_reducer.py), one call each:
//
//   undefined  which parameters of a set have no gradient (at a backward's start: cleared since
//              the previous one);
//   to_none    set the gradients of a set to undefined (before the optimizer step, those no
//              rank used);
//   note /     remember each gradient of a set as it goes into a step / which gradients of a set
//   changed    are defined and not the one remembered (cleared and produced again since: a
//              model that no wrapper runs, whose backward the layer does not watch);
//   gather /   the gradients of a set, scaled, in one flat tensor (zeros where a parameter has
//   scatter    none) / that tensor written back to each gradient (at a backward's end: the
//              parameters a DDP module leaves to the layer, averaged in one all-reduce).
//
// Positions are those of the wrapper's named_parameters(), as DDP's Reducer indexes its
// variables; a set is a bit set over them, passed as little-endian bytes (a uint8 CPU tensor,
// bit k of byte k / 8: position k). Python would pay about a microsecond per parameter for each
// of these loops (a routed model has hundreds of dead parameters per step); here the Python side
// pays one call. (The tie at the wrapper stays a Python autograd Function: its apply already
// collects the edges in C++, as fast as a C++ Function measured.) Public C++ API only:
// Tensor::grad(), Tensor::mutable_grad(), c10::weak_intrusive_ptr, torch::class_.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <cstring>
#include <utility>
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

bool plain(const at::Tensor& t) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && !t.is_conj() && !t.is_neg();
}

// Whether gather and scatter copy a parameter's `n` elements between `flat` and `grad` (undefined:
// none yet) with their own loops: a small parameter of a floating dtype, contiguous CPU tensors of
// one dtype. An ATen op per parameter costs microseconds of dispatch, more than such a copy; from
// ATen's grain size on, ATen's copies (vectorized, on several threads) are left to do it, and so
// are empty tensors (memcpy must not be given their null data pointers).
bool copied_by_loop(const at::Tensor& flat, const at::Tensor& grad, int64_t n) {
  constexpr int64_t kLoopMax = 32768;
  return 0 < n && n < kLoopMax && at::isFloatingType(flat.scalar_type()) && plain(flat) &&
         (!grad.defined() || (plain(grad) && grad.scalar_type() == flat.scalar_type()));
}

// flat[offset:offset + n] = grad * scale (zeros for an undefined grad), computed as ATen's CPU
// multiplication by a scalar computes it (in the dtype's opmath type, the scalar cast to it), so
// the bits equal at::mul_out's, which DDP fills its buckets with.
void scaled_copy(at::Tensor& flat, int64_t offset, int64_t n, const at::Tensor& grad, double scale) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "gather", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    scalar_t* out = flat.mutable_data_ptr<scalar_t>() + offset;
    if (!grad.defined()) {
      std::fill(out, out + n, scalar_t(0));
      return;
    }
    const scalar_t* in = grad.const_data_ptr<scalar_t>();
    const auto s = static_cast<opmath_t>(scale);
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<scalar_t>(static_cast<opmath_t>(in[i]) * s);
  });
}

struct Parameters : torch::CustomClassHolder {
  std::vector<at::Tensor> params;  // by position; undefined: a position this table does not hold
  // Per position, the gradient it held when last noted; weak, so that a gradient set to None is
  // freed (an expired one never equals a live gradient, even at the same address).
  std::vector<WeakTensor> noted;

  explicit Parameters(std::vector<at::Tensor> params)
      : params(std::move(params)), noted(this->params.size(), WeakTensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>())) {}

  int64_t size() const { return static_cast<int64_t>(params.size()); }

  // The positions in `bits` (each holding a parameter; at least one) and their elements in all.
  std::pair<std::vector<int64_t>, int64_t> members(const at::Tensor& bits) const {
    std::vector<int64_t> ks;
    int64_t total = 0;
    for_each_position(bits, size(), [&](int64_t k) {
      TORCH_CHECK(params[static_cast<size_t>(k)].defined(), "bits: position ", k, " holds no parameter");
      ks.push_back(k);
      total += params[static_cast<size_t>(k)].numel();
    });
    TORCH_CHECK(!ks.empty(), "bits: the set is empty");
    return {std::move(ks), total};
  }

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

  // The gradients of the positions in `bits` times `scale`, one after another in a flat tensor
  // of their parameters' dtype and device (one of each: the caller splits sets that mix them);
  // zeros for a parameter without one. Multiplying while copying is what DDP's reducer does to
  // fill its buckets (with scale 1 / world size), so the average has the same bits.
  at::Tensor gather(const at::Tensor& bits, double scale) const {
    const auto [ks, total] = members(bits);
    const at::Tensor& first = params[static_cast<size_t>(ks[0])];
    at::Tensor flat = at::empty({total}, first.options());
    const auto factor = at::scalar_tensor(scale, at::TensorOptions().dtype(at::kDouble));
    int64_t offset = 0;
    for (int64_t k : ks) {
      const at::Tensor& p = params[static_cast<size_t>(k)];
      TORCH_CHECK(p.scalar_type() == first.scalar_type() && p.device() == first.device(),
                  "bits: position ", k, " is a ", p.scalar_type(), " parameter on ", p.device(), ", position ", ks[0],
                  " a ", first.scalar_type(), " one on ", first.device(), ": gather one dtype and device at a time");
      const at::Tensor& grad = p.grad();
      TORCH_CHECK(!grad.defined() || grad.layout() == at::kStrided, "the gradient at position ", k, " is ",
                  grad.layout(), ": only dense gradients are gathered");
      if (copied_by_loop(flat, grad, p.numel())) {
        scaled_copy(flat, offset, p.numel(), grad, scale);
      } else {
        at::Tensor slice = flat.narrow(0, offset, p.numel()).view(p.sizes());
        if (grad.defined()) {
          at::mul_out(slice, grad, factor);
        } else {
          slice.zero_();
        }
      }
      offset += p.numel();
    }
    return flat;
  }

  // Writes `flat` (as gather made it) back: each position in `bits` gets its slice, copied into
  // its gradient, or as a new gradient (with its parameter's strides) where it has none. The
  // sizes are checked before anything is written.
  void scatter(const at::Tensor& bits, const at::Tensor& flat) {
    const auto [ks, total] = members(bits);
    TORCH_CHECK(flat.dim() == 1 && flat.numel() == total, "flat: holds ", flat.numel(), " elements, the set's parameters ", total);
    int64_t offset = 0;
    for (int64_t k : ks) {
      at::Tensor& p = params[static_cast<size_t>(k)];
      at::Tensor& grad = p.mutable_grad();
      if (!grad.defined()) {
        grad = at::empty_like(p, at::MemoryFormat::Preserve);
      }
      if (copied_by_loop(flat, grad, p.numel())) {
        const auto size = static_cast<int64_t>(flat.element_size());
        std::memcpy(grad.data_ptr(), static_cast<const char*>(flat.const_data_ptr()) + offset * size,
                    static_cast<size_t>(p.numel() * size));
      } else {
        grad.copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
      }
      offset += p.numel();
    }
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
      .def("changed", &maskedbranch::Parameters::changed)
      .def("gather", &maskedbranch::Parameters::gather)
      .def("scatter", &maskedbranch::Parameters::scatter);
}
