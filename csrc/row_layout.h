// Shared argument checks and the row-block layout used by every routing kernel.
//
// Rows are the first dimension. A kernel sees each row as one dense block of
// D = numel / size(0) elements, which holds for contiguous tensors and for channels_last
// ones (dim 0 stays outermost). Outputs take the layout of the first input, other inputs
// are brought to it, so channels_last activations stay channels_last with no copy.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <string>
#include <vector>

namespace maskedbranch {

// Whether the trailing dimensions (all but the rows) are dense in the order `dims` (innermost
// first), ignoring sizes of 1 as torch's contiguity checks do.
inline bool trailing_dense(const at::Tensor& t, std::initializer_list<int64_t> dims) {
  int64_t expected = 1;
  for (int64_t d : dims) {
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

// The layout of a tensor's rows, read from its trailing strides only: the same answer whatever
// the row count (none included), so that the output layout never depends on how many rows a
// branch got (torch.compile traces with that count unknown).
inline at::MemoryFormat row_format(const at::Tensor& t) {
  if (t.dim() == 4 && !trailing_dense(t, {3, 2, 1}) && trailing_dense(t, {1, 3, 2})) {
    return at::MemoryFormat::ChannelsLast;
  }
  if (t.dim() == 5 && !trailing_dense(t, {4, 3, 2, 1}) && trailing_dense(t, {1, 4, 3, 2})) {
    return at::MemoryFormat::ChannelsLast3d;
  }
  return at::MemoryFormat::Contiguous;
}

// `t` as dense row blocks in `format` (a no-op when it already is). channels_last only
// applies to tensors of the matching rank.
inline at::Tensor as_row_blocks(const at::Tensor& t, at::MemoryFormat format) {
  if ((format == at::MemoryFormat::ChannelsLast && t.dim() != 4) ||
      (format == at::MemoryFormat::ChannelsLast3d && t.dim() != 5)) {
    format = at::MemoryFormat::Contiguous;
  }
  return t.contiguous(format);
}

// Elements per row (the product of the trailing sizes).
inline int64_t row_numel(const at::Tensor& t) {
  int64_t d = 1;
  for (int64_t i = 1; i < t.dim(); ++i) d *= t.size(i);
  return d;
}

// A new [rows, trailing...] tensor in the layout `format`.
inline at::Tensor empty_rows(int64_t rows, at::IntArrayRef trailing, const at::TensorOptions& opts,
                             at::MemoryFormat format) {
  std::vector<int64_t> sizes{rows};
  sizes.insert(sizes.end(), trailing.begin(), trailing.end());
  if ((format == at::MemoryFormat::ChannelsLast && sizes.size() != 4) ||
      (format == at::MemoryFormat::ChannelsLast3d && sizes.size() != 5)) {
    format = at::MemoryFormat::Contiguous;
  }
  return at::empty(sizes, opts.memory_format(format));
}

inline void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, name, ": expected an int64 plan tensor, got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1, name, ": expected a 1-D plan tensor, got shape ", t.sizes());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                              const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, ": expected a tensor on ", ref.device(),
                    " like ", ref_name, ", got one on ", t.device());
}

// The dtypes the kernels are compiled for. at::isFloatingType also admits float8 types,
// which would then fail in dispatch with a less helpful message.
inline bool is_supported_float(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_floating(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(is_supported_float(t.scalar_type()), name,
                   ": expected float64, float32, float16 or bfloat16, got ", t.scalar_type());
}

// Same trailing shape and dtype as `ref`; `rows` rows unless rows < 0.
inline void check_rows_like(const at::Tensor& t, const at::Tensor& ref, int64_t rows,
                            const std::string& name, const char* ref_name) {
  TORCH_CHECK_VALUE(t.dim() >= 1, name, ": expected at least one dimension (rows first)");
  TORCH_CHECK_VALUE(t.sizes().slice(1) == ref.sizes().slice(1), name, ": expected trailing shape ",
                    ref.sizes().slice(1), " like ", ref_name, ", got shape ", t.sizes());
  TORCH_CHECK_VALUE(rows < 0 || t.size(0) == rows, name, ": expected ", rows, " rows, got ",
                    t.size(0));
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), name, ": expected dtype ",
                   ref.scalar_type(), " like ", ref_name, ", got ", t.scalar_type());
  check_same_device(t, ref, name.c_str(), ref_name);
}

// The dtype in which weights are applied and sums accumulate.
inline at::ScalarType opmath_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace maskedbranch
