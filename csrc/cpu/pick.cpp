// pick, pick_backward, put_ (CPU): the tensors of a whole-batch choice's chosen branch, read
// out, given their gradient, and written back (maskedbranch/_choice.py's stacked form). The
// index is read on the host and checked there. Outputs are new contiguous tensors (their
// layout never depends on the inputs' strides, so the fake kernels need none).
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cstring>

#include "../op_args.h"

namespace maskedbranch {
namespace {

// The index read where it lies (one element: its data pointer is the element), without the
// dispatcher calls of item().
int64_t read_choice(const at::Tensor& index, int64_t branches, bool allow_none) {
  int64_t i = 0;
  AT_DISPATCH_INTEGRAL_TYPES(index.scalar_type(), "maskedbranch_pick_index",
                             [&] { i = static_cast<int64_t>(*index.const_data_ptr<scalar_t>()); });
  return checked_choice(i, branches, allow_none);
}

// dst = src (dst contiguous, same shape and dtype): a memmove when src is contiguous too (put_
// may be given a tensor as its own value). These tensors are a branch's parameters, often tiny,
// where copy_'s dispatch costs more than the copy.
void copy_into(at::Tensor& dst, const at::Tensor& src) {
  if (src.is_contiguous() && dst.is_contiguous()) {
    if (src.numel() > 0) std::memmove(dst.data_ptr(), src.const_data_ptr(), src.nbytes());
  } else {
    dst.copy_(src);
  }
}

std::vector<at::Tensor> pick_cpu(at::TensorList tensors, const at::Tensor& index, int64_t branches) {
  const int64_t k = check_branch_tensors(tensors, branches, "tensors");
  check_choice_index(index, tensors);
  const int64_t i = read_choice(index, branches, /*allow_none=*/false);
  std::vector<at::Tensor> out;
  out.reserve(k);
  for (int64_t j = 0; j < k; ++j) {
    const at::Tensor& src = tensors[i * k + j];
    out.push_back(at::empty(src.sizes(), src.options().memory_format(at::MemoryFormat::Contiguous)));
    copy_into(out.back(), src);
  }
  return out;
}

std::vector<at::Tensor> pick_backward_cpu(at::TensorList grads, const at::Tensor& index, int64_t branches) {
  TORCH_CHECK_VALUE(branches >= 1, "branches: expected at least 1, got ", branches);
  check_choice_index(index, grads);
  const int64_t i = read_choice(index, branches, /*allow_none=*/false);
  std::vector<at::Tensor> out;
  out.reserve(branches * grads.size());
  for (int64_t b = 0; b < branches; ++b) {
    for (const at::Tensor& g : grads) {
      at::Tensor o = at::empty(g.sizes(), g.options().memory_format(at::MemoryFormat::Contiguous));
      if (b == i) {
        copy_into(o, g);
      } else if (o.numel() > 0) {
        std::memset(o.data_ptr(), 0, o.nbytes());  // all-zero bytes: zero in every dtype
      }
      out.push_back(std::move(o));
    }
  }
  return out;
}

void put_cpu(at::TensorList tensors, const at::Tensor& index, int64_t branches, at::TensorList values) {
  const int64_t k = check_branch_tensors(tensors, branches, "tensors");
  check_choice_index(index, tensors);
  check_choice_values(values, tensors, k);
  const int64_t i = read_choice(index, branches, /*allow_none=*/true);
  if (i < 0) return;  // no branch ran: nothing to write
  for (int64_t j = 0; j < k; ++j) {
    at::Tensor dst = tensors[i * k + j];
    copy_into(dst, values[j]);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(maskedbranch, CPU, m) {
  m.impl("pick", &pick_cpu);
  m.impl("pick_backward", &pick_backward_cpu);
  m.impl("put_", &put_cpu);
}

}  // namespace maskedbranch
